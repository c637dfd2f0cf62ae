"""Routing analysis, as a library: statistics of the routers' decisions, the static-heads baseline, tau
calibration for a budget, figures and token pages (matplotlib is loaded only where a picture is drawn)."""
