"""AHA over a paged KV cache through allhere's Triton paged kernels (``allhere.kernels.aha_paged``): the path of a
served AHA layer on CUDA, where ``attention.paged_attention``'s torch tiles would be the slow way. A served layer
(vLLM's: ``allhere.serve.vllm.attention``) hands it the step's tensors; the tests call it on their own caches.

The whole step is a few launches for the batch (one split-KV decode kernel for the requests with one query; for
the others a window pass over every row, then a pass over the global rows, packed per head), each
(request, query head) reading through the block table only the blocks its rule allows: a local row its window
(and its request's first ``n_sinks`` positions: AHA with sinks), a global row every key before it. Keys are
stored untransposed in these layers (``attention.write(..., transposed=False)``). fp32 caches are computed with IEEE
fp32 dots; fp16 / bf16 as the other kernels.

Off CUDA the kernels run only under Triton's interpreter, slowly: a layer takes this path there only when asked
(``allhere serve --backend triton`` with ``TRITON_INTERPRET=1`` before triton is imported; backend "triton" of op
family "paged", ``dispatch``), which the tests use to check the wiring inside vLLM's CPU backend.
"""

from __future__ import annotations

import torch

from .attention import kernel_caches


def kernel_refusal(head_dim: int, device: torch.device, softcap: float = 0.0,
                   sinks: torch.Tensor | None = None) -> str | None:
    """None where a served AHA layer can run the Triton paged kernel, else why not (one line): triton, a CUDA cache
    (or Triton's interpreter), then the kernel's own rule (``allhere.kernels.aha_paged.refusal``)."""
    from ... import kernels

    why = kernels.device_refusal(device, "the cache is")
    if why:
        return why
    from ...kernels.aha_paged import refusal

    return refusal(head_dim, softcap, sinks is not None)


def aha_paged(q: torch.Tensor, view: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor,
              block_table: torch.Tensor, gate: torch.Tensor, window: int, scale: float, out: torch.Tensor,
              max_seq_len: int | None = None, max_query_len: int | None = None, n_sinks: int = 0) -> None:
    """AHA's rows of one step into ``out`` [tokens, heads, d]: q [tokens, heads, d] and gate [tokens, heads] (True:
    global) may run past the step's real tokens (``query_start[-1]``); those rows of ``out`` are left as they are.
    ``view``: the layer's ``paged_view``, keys untransposed; query_start [requests + 1], seq_lens and block_table
    at least [requests] (vLLM pads them in some steps). Host hints as ``paged_aha_attention`` takes them.
    n_sinks: a local row also reads its request's first ``n_sinks`` positions (``AHAConfig.sinks``; not the
    learned sink logits of ``kernel_refusal``'s ``sinks``)."""
    from ...kernels.aha_paged import paged_aha_attention

    reqs = query_start.numel() - 1
    k_cache, v_cache = kernel_caches(view)
    paged_aha_attention(q, k_cache, v_cache, block_table[:reqs], query_start, seq_lens[:reqs], gate, window, scale,
                        out, max_seq_len=max_seq_len, max_query_len=max_query_len, sinks=n_sinks)
