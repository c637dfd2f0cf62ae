"""Reports and pictures of routing behaviour (matplotlib is loaded only where a picture is drawn)."""
