"""Triton kernels for AHA on the GPU: prefill, decode and training (forward + backward), and attention over a
paged KV cache as a server keeps it (``aha_paged``: a served AHA layer's path on CUDA, through
``allhere.ops.paged.aha_triton``); and the absorbed decode of op family ``"dar_latent"`` (``dar_latent_decode``,
its "triton" path). What the kernels share -- the window rule, the online softmax, the split-KV
merge, the launch helpers -- is written once, in ``aha_common``. The kernels are the ground floor: they import nothing
of the ops, the mechanisms or the serving code (their callers check the arguments); what they share with those,
such as the merge of partial results in torch, is in ``allhere.softmax``.

Needs the ``gpu`` extra (``pip install 'allhere[gpu]'``, i.e. triton). ``allhere.ops.aha.aha_attention``
takes them with backend "triton", and with "auto" on CUDA where they take the call (``allhere.backend``;
``allhere.ops.aha.triton_path`` says which calls). Without a GPU they still run under Triton's interpreter
(``TRITON_INTERPRET=1`` set before triton is imported; then backend "triton" takes CPU tensors too): that
is how the CPU test suite checks them against the dense reference (slowly, at small sizes). Nothing here
reads the environment on a call. Launch settings (tiles, warps, stages, the decode split) are chosen on the
GPU by ``autotune`` and remembered across processes; ``autotune.pinned()`` fixes them.
"""

from __future__ import annotations

import functools
import importlib.util


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Whether triton is installed (looked up once)."""
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
def interpreted() -> bool:
    """Whether the kernels were built for Triton's interpreter (``TRITON_INTERPRET=1`` when triton was
    first imported), so that they run on CPU tensors. Imports the kernels; asked once."""
    from .aha_common import built_for_interpreter

    return built_for_interpreter()


def device_refusal(device, what: str = "the tensors are") -> str | None:
    """Why the kernels cannot run on ``device`` (a torch.device), or None: triton must be installed, and the device
    CUDA unless the kernels were built for Triton's interpreter. ``what`` names the inputs in the message."""
    if not triton_available():
        return "triton is not installed (pip install 'allhere[gpu]')"
    if device.type != "cuda" and not interpreted():
        return (f"{what} on {device.type}, not CUDA (off CUDA the kernels run only under Triton's interpreter: "
                f"TRITON_INTERPRET=1 before triton is imported)")
    return None


def kernel_dtypes(cuda: bool) -> tuple:
    """The dtypes the kernels take: float16 and bfloat16; float32 too under Triton's interpreter (on a GPU,
    Triton's dots would round it to tf32)."""
    import torch

    return (torch.float16, torch.bfloat16) if cuda else (torch.float16, torch.bfloat16, torch.float32)
