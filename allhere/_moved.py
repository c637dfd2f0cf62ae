"""The warning of a module that moved: its old path stays importable for a while as a shim that re-exports
the names and calls ``warn_moved`` once, when it is first imported."""

from __future__ import annotations

import warnings


def warn_moved(old: str, where: str) -> None:
    """Emit a DeprecationWarning that module ``old`` moved (``where`` says where its names are now),
    attributed to the line that imported the shim (``warnings`` skips importlib's own frames), so that
    Python's default filters show it to a script that imports the old path."""
    warnings.warn(f"{old} is deprecated and will be removed: {where}", DeprecationWarning, stacklevel=3)
