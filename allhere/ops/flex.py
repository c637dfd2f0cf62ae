"""Attention under a mask predicate through PyTorch's FlexAttention (``torch.nn.attention.flex_attention``):
the other backend of the sparse patterns, beside the block-sparse op (``allhere.ops.blocksparse``).

The predicates of ``allhere.masks`` are FlexAttention ``mask_mod``s as they are. This CPU (torch 2.13) runs
``torch.compile(flex_attention, dynamic=False)``, exact against the dense reference. The compiled kernel is
as fast as the block-sparse op or faster at 8192 tokens. But every new shape compiles again (about 10 to
20 s here), and ``create_block_mask`` evaluates the predicate on the full n x n grid (vmap). So on the CPU
it is an option (``allhere.use_backend("flex")``), not the default. On CUDA the same code runs
FlexAttention's Triton kernel, and ``PatternAttention`` takes it by default there (backend "auto").
"""

from __future__ import annotations

import torch

from ..masks.mask import Mask, MaskFn, as_mask
from .common import check_qkv, default_scale

COMPILED_MASK_FROM = 1 << 26  # batch x heads x q x kv from which eager create_block_mask's int64 grids are too big
_compiled: dict = {}


def _compile(name: str):
    """FlexAttention's ``flex_attention`` or ``create_block_mask``, compiled once (``dynamic=False``)."""
    if name not in _compiled:
        from torch.nn.attention import flex_attention as fa

        _compiled[name] = torch.compile(getattr(fa, name), dynamic=False)
    return _compiled[name]


def flex_block_mask(pred: MaskFn | Mask, q_len: int, kv_len: int, *, heads: int = 1, batch: int = 1,
                    key_offset: int = 0, block: int = 128, device=None, per_batch: bool = True,
                    per_head: bool = True):
    """FlexAttention's BlockMask of ``pred`` (queries: the last q_len of the keys at ``key_offset`` ..).
    ``per_batch`` / ``per_head`` False: the pattern is the same for every batch row / head (one mask)."""
    from torch.nn.attention.flex_attention import create_block_mask

    mask = as_mask(pred)
    if mask.prepare is not None:  # its tables complete and on the device before vmap / the kernel trace it
        mask.prepare(heads, key_offset + kv_len, device or "cpu")
    pred = mask.pred  # the plain function: FlexAttention lifts the tensors its closures capture
    q_off = key_offset + kv_len - q_len

    def mask_mod(b, h, q_idx, kv_idx):
        return pred(b, h, q_idx + q_off, kv_idx + key_offset)

    build = create_block_mask
    grid = (batch if per_batch else 1) * (heads if per_head else 1) * q_len * kv_len
    if torch.device(device or "cpu").type == "cuda" and grid >= COMPILED_MASK_FROM:
        build = _compile("create_block_mask")  # block by block: no [heads, q_len, kv_len] intermediates
    return build(mask_mod, batch if per_batch else None, heads if per_head else None, q_len, kv_len,
                 device=device or "cpu", BLOCK_SIZE=block)


def flex_pattern_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask,
                           scale: float | None = None) -> torch.Tensor:
    """``flex_attention`` (compiled) of q [b, h, lq, d] over k, v [b, kv_heads, lk, d] under ``block_mask``
    (``flex_block_mask``). Rows that see no key give 0."""
    _, h, _, d, hkv, _ = check_qkv(q, k, v)
    return _compile("flex_attention")(q, k, v, block_mask=block_mask, scale=default_scale(d, scale),
                                      enable_gqa=h != hkv)
