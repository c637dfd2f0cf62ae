"""One way to pick how attention ops compute: an argument, or a context manager around any code; and the
registry of every op's paths that the choice picks from.

Backends:
  - ``"auto"`` (default): the fastest path that takes the call -- the Triton kernels on CUDA where they
    apply (``pip install 'allhere[gpu]'``), FlexAttention for the sparse patterns on CUDA, the PyTorch path
    everywhere else;
  - ``"torch"``: the PyTorch paths (SDPA, the blocked and block-sparse ops), even on CUDA with triton installed;
  - ``"triton"``: the Triton kernels; an error where they cannot take the call;
  - ``"flex"``: FlexAttention (``torch.compile``) for the sparse patterns, on any device;
  - ``"reference"``: the dense fp32 reference of every op (slow; the ground truth every other path is
    tested against).

    with allhere.use_backend("reference"):
        logits = model(ids).logits          # every layer of any model on the references

An op family (``"aha"``, ``"sliding"``, ``"dar"``, ...; every one of allhere's is registered in
``allhere.ops.families``, which names them all) registers each of its paths with ``register_path``:
the backend it implements, the function, and which calls it takes (``takes(*args, **kwargs) -> None``
where it takes the call, else one line saying why not). ``dispatch(op, *args, **kwargs)`` runs the path the
backend picks: a named backend runs that path of the family (ValueError where it does not take the call);
a family without a path of that name, and ``"auto"``, run the first path of ``AUTO_ORDER`` that takes the
call and that ``"auto"`` may pick (its ``auto`` predicate, e.g. ``on_cuda``: only for CUDA tensors). Every
family has a reference path, which takes every call.

The choice is read from a context variable once per op call (no environment variable in the hot path).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Callable

import torch

BACKENDS = ("auto", "torch", "triton", "flex", "reference")
AUTO_ORDER = ("triton", "flex", "torch", "reference")  # what "auto" tries, fastest first

_current: contextvars.ContextVar[str] = contextvars.ContextVar("allhere_backend", default="auto")


def check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    return name


def get_backend(name: str | None = None) -> str:
    """``name`` if given (validated), else the backend of the innermost ``use_backend`` block ("auto")."""
    return _current.get() if name is None else check_backend(name)


@contextlib.contextmanager
def use_backend(name: str):
    """Run the block with every attention op on backend ``name`` (see the module docstring)."""
    token = _current.set(check_backend(name))
    try:
        yield name
    finally:
        _current.reset(token)


def _always(*args, **kwargs) -> None:
    return None


def _anywhere(*args, **kwargs) -> bool:
    return True


def on_cuda(*args, **kwargs) -> bool:
    """The ``auto`` predicate of a GPU path: whether the call's first tensor argument (its queries) is on CUDA."""
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    return first is not None and first.is_cuda


@dataclass(frozen=True)
class OpPath:
    op: str  # the op family, e.g. "aha"
    backend: str  # the backend it implements: "reference", "torch", "triton" or "flex"
    fn: Callable  # the path itself, called with the family's arguments
    takes: Callable[..., str | None] = _always  # None where it takes the call, else why not (one line)
    auto: Callable[..., bool] = _anywhere  # whether "auto" may pick it for a call it takes


_PATHS: dict[str, dict[str, OpPath]] = {}


def register_path(op: str, backend: str, fn: Callable, takes: Callable[..., str | None] | None = None,
                  auto: Callable[..., bool] | None = None) -> None:
    """Register ``fn`` as op family ``op``'s path for ``backend`` (registering it again replaces it)."""
    if check_backend(backend) == "auto":
        raise ValueError("'auto' is a choice among the paths, not a path")
    _PATHS.setdefault(op, {})[backend] = OpPath(op, backend, fn, takes or _always, auto or _anywhere)


def paths(op: str) -> dict[str, OpPath]:
    """The registered paths of op family ``op``, by backend."""
    if op not in _PATHS:
        raise ValueError(f"unknown op family {op!r}: expected one of {', '.join(sorted(_PATHS))}")
    return dict(_PATHS[op])


def ops() -> tuple[str, ...]:
    """Every op family registered so far: allhere's are registered by ``allhere.ops.families`` (which names them
    all in ``FAMILIES``), "patterns" once the code that holds its paths is imported."""
    return tuple(sorted(_PATHS))


def select(op: str, *args, backend: str | None = None, **kwargs) -> OpPath:
    """The path of ``op`` that ``backend`` (default: ``get_backend()``) picks for these arguments."""
    name, found = get_backend(backend), paths(op)
    if name != "auto" and name in found:
        why = found[name].takes(*args, **kwargs)
        if why is not None:
            raise ValueError(f"backend {name!r} cannot take this {op} call: {why}")
        return found[name]
    for candidate in AUTO_ORDER:
        path = found.get(candidate)
        if path is not None and path.auto(*args, **kwargs) and path.takes(*args, **kwargs) is None:
            return path
    raise ValueError(f"no path of op {op!r} takes this call (paths: {', '.join(found)})")


def dispatch(op: str, *args, backend: str | None = None, **kwargs):
    """Run the path of ``op`` that ``backend`` picks (``select``) on these arguments."""
    return select(op, *args, backend=backend, **kwargs).fn(*args, **kwargs)
