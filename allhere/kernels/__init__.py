"""Triton kernels for AHA on the GPU: prefill, decode and training (forward + backward).

Needs the ``gpu`` extra (``pip install 'allhere[gpu]'``, i.e. triton). ``allhere.ops.aha.aha_attention``
takes them with backend "triton", and with "auto" on CUDA where they take the call (``allhere.backend``;
``allhere.ops.aha.triton_path`` says which calls). Without a GPU they still run under Triton's interpreter
(``TRITON_INTERPRET=1`` set before triton is imported; then backend "triton" takes CPU tensors too): that
is how the CPU test suite checks them against the dense reference (slowly, at small sizes). Nothing here
reads the environment on a call.
"""

from __future__ import annotations

import functools
import importlib.util

import torch


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Whether triton is installed (looked up once)."""
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
def interpreted() -> bool:
    """Whether the kernels were built for Triton's interpreter (``TRITON_INTERPRET=1`` when triton was
    first imported), so that they run on CPU tensors. Imports the kernels; asked once."""
    from .aha_prefill import built_for_interpreter

    return built_for_interpreter()


def pipeline_stages(device: torch.device) -> int:
    """Triton's pipelining depth (num_stages) for the prefill and training kernels on ``device``: from the
    shared memory one block may use there (``stages_for``). Off CUDA (Triton's interpreter) it does not
    matter: 3."""
    if device.type != "cuda":
        return 3
    return _cuda_stages(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_stages(index: int) -> int:  # asked once per GPU
    from triton.runtime import driver

    return stages_for(driver.active.utils.get_device_properties(index)["max_shared_mem"])


def stages_for(shared_bytes: int) -> int:
    """3 stages where a block may use >= 160 KiB of shared memory (A100, H100), 2 where >= 96 KiB
    (sm_86 / sm_89 allow 99 KiB; with 3 stages the dQ kernels need 104 KiB there), else 1
    (``benchmarks/kernel_compile.py --arch 89`` shows the sizes)."""
    return 3 if shared_bytes >= 160 * 1024 else 2 if shared_bytes >= 96 * 1024 else 1
