"""The paths of op family ``"paged"`` (``allhere.backend``; registered in ``allhere.ops.families`` with every other
family): a served layer's attention over its paged KV cache, picked like every other op's, so that ``allhere serve
--backend reference`` (or ``use_backend("reference")`` around a direct call) runs served models on the ground
truth.

Every path takes ``attention.paged_attention``'s arguments (q, view, query_start, seq_lens, block_table, reads,
scale, out, row_class=, sinks=, softcap=, extra=, ...) plus ``window_class`` (the row class that reads exactly
its window, the others every earlier key: AHA's two classes; None for the other mechanisms) and ``transposed``
(how the cache stores its keys, as ``attention.write`` wrote them):

- ``"reference"``: per request, its keys and values gathered in order through the block table, every row's
  mask evaluated from its class's predicates on the dense grid, scores and softmax in float32 (slow);
- ``"torch"``: ``attention.paged_attention`` (tiles of rows over gathered blocks; keys transposed). Inside vLLM's
  CPU backend the served layer also runs vLLM's own kernel for what it computes (``allhere.serve.vllm.cpu_kernels``);
- ``"triton"``: allhere's Triton paged kernel (``aha_triton.aha_paged``; AHA's two classes only, the local
  one's window and sinks as its ``window_read`` holds them; keys untransposed); ``"auto"`` picks it on CUDA, an
  explicit ``"triton"`` also under Triton's interpreter.

A layer keeps one path, hence one cache layout, for its life: ``transposed_for(path)`` says which layout its
path reads (the torch path reads transposed keys, the Triton kernel untransposed ones; the reference either).
"""

from __future__ import annotations

import torch

from ...backend import OpPath
from ...softmax import NEG_INF, merge_pieces, softmax_lse
from .attention import Read, of_tokens, paged_attention

OP = "paged"


def transposed_for(path: OpPath) -> bool:
    """Whether a layer on ``path`` stores its keys transposed (``attention.write(..., transposed=)``)."""
    return path.backend != "triton"


def paged_reference(q: torch.Tensor, view: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor,
                    block_table: torch.Tensor, reads, scale: float, out: torch.Tensor,
                    row_class: torch.Tensor | None = None, sinks: torch.Tensor | None = None, softcap: float = 0.0,
                    extra=(), transposed: bool = True, positions=None, **_tiling) -> None:
    """The dense float32 ground truth of ``paged_attention`` (same arguments and result; its tiling options are
    ignored). ``extra`` pieces join each row's softmax by their log-sum-exp."""
    n, heads, d = int(query_start[-1]), q.shape[1], q.shape[2]
    if n == 0:
        return
    kv_heads = view.shape[1]
    req, pos = of_tokens(positions, query_start, seq_lens, n)
    cls = torch.zeros(n, heads, dtype=torch.long, device=q.device) if row_class is None else row_class[:n].long()
    o = torch.zeros(n, heads, d, dtype=torch.float32, device=q.device)
    lse = torch.full((n, heads), NEG_INF, device=q.device)
    h = torch.arange(heads, device=q.device)[None, :, None]
    zero = torch.zeros((), dtype=torch.long, device=q.device)
    for r in range(query_start.numel() - 1):
        rows = (req == r).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        k, v = _keys_of(view, block_table[r], int(seq_lens[r]), transposed)
        kpos = torch.arange(k.shape[0], device=q.device)[None, None, :]
        qpos = pos[rows][:, None, None]
        allowed = torch.zeros(rows.numel(), heads, k.shape[0], dtype=torch.bool, device=q.device)
        for c, parts in enumerate(reads):
            mine = (cls[rows] == c)[..., None]
            for part in parts:
                allowed |= mine & Read(*part).pred(zero, h, qpos, kpos)
        allowed &= kpos <= qpos
        group = heads // kv_heads
        s = torch.einsum("thd,khd->thk", q[rows].float(), k.repeat_interleave(group, 1)) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~allowed, NEG_INF)
        if sinks is not None:  # exp(sink logit) joins every row's denominator, with no value
            s = torch.cat([s, sinks.float().view(1, heads, 1).expand(rows.numel(), heads, 1)], -1)
        p, lse[rows] = softmax_lse(s)
        o[rows] = torch.einsum("thk,khd->thd", p[..., : k.shape[0]], v.repeat_interleave(group, 1))
    if extra:  # more pieces the rows read (DAR's distant keys), under the same softmax
        whole = (torch.arange(n * heads, device=q.device)[:, None], o.view(-1, 1, d), lse.view(-1, 1))
        o = merge_pieces([whole, *extra], n * heads, d, q.device)[0]
    merged = o.view(n, heads, d).to(out.dtype)
    empty = [] if extra else [c for c, parts in enumerate(reads) if not parts]
    keep = torch.isin(cls, torch.tensor(empty, dtype=torch.long, device=q.device))[..., None]
    out[:n] = torch.where(keep, out[:n], merged)


def _keys_of(view: torch.Tensor, table: torch.Tensor, length: int, transposed: bool):
    """One request's keys and values in position order, [length, kv_heads, d] float32 each."""
    nb, kv_heads, _, bs, d = view.shape
    p = torch.arange(length, device=view.device)
    block, slot = table[p // bs].long(), p % bs
    keys = view[:, :, 0].reshape(nb, kv_heads, d, bs).permute(0, 3, 1, 2) if transposed else \
        view[:, :, 0].transpose(1, 2)  # [blocks, block_size, kv_heads, d]
    return keys[block, slot].float(), view[:, :, 1].transpose(1, 2)[block, slot].float()


def paged_torch(*args, window_class=None, transposed: bool = True, max_seq_len=None, max_query_len=None,
                **kwargs) -> None:
    """Backend "torch": ``attention.paged_attention`` (the arguments only the other paths read are dropped)."""
    paged_attention(*args, **kwargs)


def paged_triton(q, view, query_start, seq_lens, block_table, reads, scale, out, row_class=None, window_class=None,
                 max_seq_len=None, max_query_len=None, **unused) -> None:
    """Backend "triton": AHA's two row classes through ``aha_triton.aha_paged``; ``out``'s rows past the step's
    tokens zeroed."""
    from .aha_triton import aha_paged

    local = reads[window_class][0]  # a window_read: its window and its sinks (the request's first positions)
    aha_paged(q, view, query_start, seq_lens, block_table, row_class != window_class, local.window, scale, out,
              max_seq_len, max_query_len, n_sinks=local.n_sinks)
    out[int(query_start[-1]):].zero_()


def triton_takes(q, view, query_start, seq_lens, block_table, reads, scale, out, row_class=None,
                 window_class=None, sinks=None, softcap: float = 0.0, extra=(), **unused) -> str | None:
    """None where the Triton path takes this call, else why not (one line)."""
    from .aha_triton import kernel_refusal

    if window_class is None or len(reads) != 2 or extra:
        return "the Triton paged kernel computes AHA's two row classes only (a window, every earlier key)"
    return kernel_refusal(q.shape[2], q.device, softcap, sinks)
