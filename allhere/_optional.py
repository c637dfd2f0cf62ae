"""Optional dependencies: one clear message naming the extra to install."""

import importlib.util


def require(module: str, extra: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"this part of allhere needs '{module}': pip install 'allhere[{extra}]'")
