"""Validation helpers shared by every configuration dataclass: a bad value raises ``ConfigError`` naming
the class, the field, the value and what was expected."""

from __future__ import annotations

import math
from typing import Any


class ConfigError(ValueError):
    """A configuration field holds an invalid value. The message names the field."""


def check(ok: bool, cls: str, name: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{cls}.{name} = {value!r} is invalid: expected {expected}")


def check_int(cls: str, name: str, value: Any, minimum: int) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    check(ok, cls, name, value, f"an integer >= {minimum}")


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool): NaN and infinity are refused everywhere."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
