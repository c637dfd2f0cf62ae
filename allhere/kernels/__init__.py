"""Triton kernels for AHA on the GPU: prefill, decode and training (forward + backward).

Needs the ``gpu`` extra (``pip install 'allhere[gpu]'``, i.e. triton). The ops pick these kernels on
CUDA only. Without a GPU the kernels can still be called directly under Triton's interpreter
(``TRITON_INTERPRET=1`` set before triton is imported): that is how the CPU test suite checks them
against the dense reference (slowly, at small sizes).
"""

from __future__ import annotations

import importlib.util
import os

import torch


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(t: torch.Tensor) -> bool:
    """Whether the ops should take the Triton kernels for tensors like ``t``: on CUDA with triton
    installed (``ALLHERE_NO_TRITON=1`` turns them off, e.g. to compare with the PyTorch path)."""
    return t.is_cuda and triton_available() and os.environ.get("ALLHERE_NO_TRITON") != "1"
