"""Names that were renamed or moved: a module's ``__getattr__`` that still hands them out, with a
``DeprecationWarning`` saying where each one went (attributed to the line that asked for it)."""

from __future__ import annotations

import importlib
import warnings


def moved_names(module: str, moved: dict[str, tuple[str, str]]):
    """``__getattr__`` for module ``module``: ``moved`` maps an old name to (its module now, its name now)."""

    def __getattr__(name: str):
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        where, new = moved[name]
        warnings.warn(f"{module}.{name} is deprecated and will be removed: use {where}.{new}", DeprecationWarning,
                      stacklevel=2)
        return getattr(importlib.import_module(where), new)

    return __getattr__
