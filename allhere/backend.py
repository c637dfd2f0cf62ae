"""One way to pick how attention ops compute: an argument, or a context manager around any code.

Backends:
  - ``"auto"`` (default): the fastest path that takes the call -- the Triton kernels on CUDA where they
    apply (``pip install 'allhere[gpu]'``), the PyTorch path everywhere else;
  - ``"torch"``: the PyTorch path (SDPA and blocked ops), even on CUDA with triton installed;
  - ``"triton"``: the Triton kernels; an error where they cannot take the call;
  - ``"reference"``: the dense fp32 reference (slow; the ground truth every other path is tested against).

    with allhere.use_backend("reference"):
        logits = model(ids).logits

The choice is read from a context variable once per op call (no environment variable in the hot path).
"""

from __future__ import annotations

import contextlib
import contextvars

BACKENDS = ("auto", "torch", "triton", "reference")

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
