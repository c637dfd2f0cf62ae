"""What the layers of one served step share. An engine hands every layer of a KV cache group the same metadata
object (vLLM rebuilds it each step), so what follows from it alone (token positions, block coordinates of the slot
mapping, token tables, rotary factors) is made by the step's first layer and read by the others: at batch 1 a
step's cost is its number of tensor operations, thirty layers over."""

from __future__ import annotations

_STEP: list = [None, {}]


def step_values(key) -> dict:
    """A dict for the step whose metadata object is ``key``, fresh whenever ``key`` changes. The last key is held,
    so its id cannot be reused by another object while it is compared."""
    if _STEP[0] is not key:
        _STEP[:] = [key, {}]
    return _STEP[1]


def memo(step: dict | None, key, make):
    """``make()``, kept in ``step`` under ``key`` (``step`` None: made every time)."""
    if step is None:
        return make()
    if key not in step:
        step[key] = make()
    return step[key]
