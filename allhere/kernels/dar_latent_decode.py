"""The absorbed decode of op family ``"dar_latent"`` in Triton: DAR whose distant keys are scored in the latent
(decoupled RoPE, as DeepSeek-V2's multi-head latent attention, arXiv:2405.04434), for calls of a few queries.

Query i (at position p_i, the last lq of the lk positions) reads key j <= p_i

  - near (p_i - j < window): score q_i . k_j, value v_j, from the host's window (k_near, v_near);
  - far (p_i - j >= window): score q~_i . c_j + q^R_i . k^R_j, value c_j (summed in the latent), from the cache
    row of position j, where q~_i = q_far_i[e_r:] W_UK_g (folded once per call, in torch) and q^R_i =
    q_far_i[:e_r];

one softmax (base 2, as ``aha_common``) over both kinds. A program keeps two accumulators, acc_near [rows, d] (the
near values) and acc_lat [rows, d_c] (the far latents); after the launch torch merges the splits by their
log-sum-exps and up-projects the latent sum once: out = acc_near / l + (acc_lat / l) W_UV_g^T.

Layout: q [b, h, lq, d]; q_far [b, h, lq, e_r + e_c]; k_near, v_near [b, kv_heads, ln, d] (the last ln of the
lk positions); rows [b, lk, d_c + kv_heads x e_r] (``ops.dar_latent.check``: [c ; k^R of KV head 0 ; ...]);
all read in place (any strides but a unit-stride last dimension). Dimensions need not be powers of two: the
tiles are padded and masked.

Launch: one program per (batch x KV head, block of BLOCK_M rows, split of the keys). A KV head's rows are its
query heads' queries (head-major: row r is head g x group + r // lq, query r % lq), so each key is loaded once
for the whole group (grouped and multi-query heads). The keys a call reads are laid end to end -- the far range
[0, lk - window), then the near range [lk - lq - window + 1, lk) -- and cut into splits of SPLIT keys (split-KV,
as flash decoding); the two ranges overlap by lq - 1 positions, where each (row, key) pair takes exactly one of
its two scores by the window rule. Every split writes its normalised partials and log-sum-exp (base 2) to fp32
scratch; ``allhere.softmax.merge_splits`` combines them in torch (one split: a plain copy of the weights).
``aha_common.finish_split`` (the last split merges, in the kernel) is written for one row and one accumulator, so it
is not used here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..softmax import default_scale, merge_splits
from . import interpreted
from .aha_common import LOG2E


@triton.jit
def _dot(a, b, F32: tl.constexpr):
    """a @ b accumulated in fp32. F32: both taken in fp32, products in full fp32 -- for fp32 inputs (a GPU would
    round them to TF32), and under Triton's interpreter, whose dots do not take bfloat16 --; else ``a`` taken in
    b's dtype."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(b.dtype), b)


@triton.jit
def _softmax_step(m_i, l_i, s):
    """The online softmax (base 2) of [rows] past a score tile ``s`` [rows, keys] (masked: -inf): (new max, new
    sum, alpha -- the factor of the accumulators --, p -- the tile's weights)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), alpha, p


@triton.jit
def _host_mask(seen, at, HAS_MASK: tl.constexpr):
    """``seen`` [rows, keys] and, with HAS_MASK, the caller's mask at pointers ``at`` (read where seen only)."""
    if HAS_MASK:
        seen = seen & (tl.load(at, mask=seen, other=0) != 0)
    return seen


@triton.jit
def _decode_kernel(Q, QL, QF, KN, VN, R, MASK, ON, OL, LSE, qk_scale, KVH, LK, LQ, W, GROUP, FAR1, NEAR0, SHIFT,
                   D, DC, ER, sqb, sqh, sqm, sfb, sfh, sfm, skb, skh, skn, srb, srn, smb, smh, smm, smn,
                   SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_P: tl.constexpr,
                   DC_P: tl.constexpr, ER_P: tl.constexpr, HAS_MASK: tl.constexpr, F32: tl.constexpr):
    """One split of one block of rows of one (batch, KV head) (program ids: batch x KVH + KV head, row block,
    split). QL: the folded queries q~ [b, h, lq, DC], contiguous, in the rows' dtype; ER_P = 0: no rotated part.
    Writes ON [b x KVH, splits, GROUP x LQ, D], OL [.., DC] (the accumulators over l) and LSE [.., GROUP x LQ]
    (base 2; -inf where the split saw no key), all contiguous fp32."""
    bg = tl.program_id(0).to(tl.int64)  # 64-bit: offsets into a long cache may pass 2**31
    split = tl.program_id(2)
    b = bg // KVH
    g = bg % KVH
    nrows = GROUP * LQ
    r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = r < nrows
    h = g * GROUP + r // LQ  # head-major rows: the group's heads, each with its LQ queries
    qi = r % LQ
    pos = LK - LQ + qi  # the queries are the last LQ positions
    offs_d = tl.arange(0, D_P)
    offs_c = tl.arange(0, DC_P)
    dmask = offs_d < D
    cmask = offs_c < DC

    # the queries, loaded once: host q (near keys), folded q~ and rotated q^R (far keys)
    q = tl.load(Q + b * sqb + h[:, None] * sqh + qi[:, None] * sqm + offs_d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    q_lat = tl.load(QL + ((b * KVH * GROUP + h) * LQ + qi)[:, None] * DC + offs_c[None, :],
                    mask=rmask[:, None] & cmask[None, :], other=0.0)
    if ER_P > 0:
        offs_e = tl.arange(0, ER_P)
        emask = offs_e < ER
        q_rope = tl.load(QF + b * sfb + h[:, None] * sfh + qi[:, None] * sfm + offs_e[None, :],
                         mask=rmask[:, None] & emask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_near = tl.zeros([BLOCK_M, D_P], tl.float32)
    acc_lat = tl.zeros([BLOCK_M, DC_P], tl.float32)

    # this split's share of the keys laid end to end: t < FAR1 the far key t, else the near key NEAR0 + t - FAR1
    start = split * SPLIT
    end = tl.minimum(start + SPLIT, FAR1 + LK - NEAR0)

    for t0 in range(start, tl.minimum(end, FAR1), BLOCK_N):  # far keys: read in the latent
        j = t0 + tl.arange(0, BLOCK_N)
        kmask = j < tl.minimum(end, FAR1)
        row = R + b * srb + j[:, None] * srn
        c = tl.load(row + offs_c[None, :], mask=kmask[:, None] & cmask[None, :], other=0.0)
        s = _dot(q_lat, tl.trans(c), F32)
        if ER_P > 0:  # KV head g's rotated key: slot g after the latent
            k_rope = tl.load(row + DC + g * ER + offs_e[None, :], mask=kmask[:, None] & emask[None, :], other=0.0)
            s += _dot(q_rope, tl.trans(k_rope), F32)
        seen = rmask[:, None] & kmask[None, :] & (pos[:, None] - j[None, :] >= W)
        seen = _host_mask(seen, MASK + b * smb + h[:, None] * smh + qi[:, None] * smm + j[None, :] * smn, HAS_MASK)
        m_i, l_i, alpha, p = _softmax_step(m_i, l_i, tl.where(seen, s * qk_scale, float("-inf")))
        acc_near = acc_near * alpha[:, None]
        acc_lat = acc_lat * alpha[:, None] + _dot(p, c, F32)

    for t0 in range(tl.maximum(start, FAR1), end, BLOCK_N):  # near keys: the host's window
        t = t0 + tl.arange(0, BLOCK_N)
        kmask = t < end
        j = NEAR0 + t - FAR1
        kv = b * skb + g * skh + (j - SHIFT)[:, None] * skn + offs_d[None, :]
        k = tl.load(KN + kv, mask=kmask[:, None] & dmask[None, :], other=0.0)
        v = tl.load(VN + kv, mask=kmask[:, None] & dmask[None, :], other=0.0)
        s = _dot(q, tl.trans(k), F32)
        diff = pos[:, None] - j[None, :]
        seen = rmask[:, None] & kmask[None, :] & (diff >= 0) & (diff < W)
        seen = _host_mask(seen, MASK + b * smb + h[:, None] * smh + qi[:, None] * smm + j[None, :] * smn, HAS_MASK)
        m_i, l_i, alpha, p = _softmax_step(m_i, l_i, tl.where(seen, s * qk_scale, float("-inf")))
        acc_near = acc_near * alpha[:, None] + _dot(p, v, F32)
        acc_lat = acc_lat * alpha[:, None]

    # the split's partials: normalised by its own sum, weighted against the other splits by its log-sum-exp
    at = (bg * tl.num_programs(2) + split) * nrows + r
    live = l_i > 0
    l_safe = tl.where(live, l_i, 1.0)
    tl.store(ON + at[:, None] * D + offs_d[None, :], acc_near / l_safe[:, None], mask=rmask[:, None] & dmask[None, :])
    tl.store(OL + at[:, None] * DC + offs_c[None, :], acc_lat / l_safe[:, None], mask=rmask[:, None] & cmask[None, :])
    tl.store(LSE + at, tl.where(live, m_i + tl.log2(l_safe), float("-inf")), mask=rmask)


def _pow2(n: int) -> int:
    return 0 if n == 0 else max(16, triton.next_power_of_2(n))  # tl.dot takes tiles of 16 or more


def dar_latent_decode_triton(q, q_far, k_near, v_near, rows, w_uk, w_uv, window: int, scale: float | None = None,
                             mask: torch.Tensor | None = None, split: int = 512, block_n: int = 32,
                             block_m: int = 16, num_warps: int = 4) -> torch.Tensor:
    """The result of ``ops.dar_latent.dar_latent_attention_reference`` (no gradients) for arguments of its layout,
    which the op's path checks before it calls this (``ops.dar_latent.check.check_latent_call``); output in q's
    dtype. The launch setting is fixed, not tuned (no ``autotune`` class yet): split, keys per program; block_n,
    keys per step; block_m, the most query rows per program (block_n and block_m: powers of two, 16 or more)."""
    b, h, lq, d = q.shape
    kvh, ln, lk = k_near.shape[1], k_near.shape[2], rows.shape[1]
    group, (e_c, d_c) = h // kvh, w_uk.shape[1:]
    e_r = q_far.shape[-1] - e_c
    q, q_far, k_near, v_near, rows = (t if t.stride(-1) == 1 else t.contiguous()
                                      for t in (q, q_far, k_near, v_near, rows))
    if k_near.stride() != v_near.stride():
        k_near, v_near = k_near.contiguous(), v_near.contiguous()
    # the folded queries q~ = q_far[e_r:] W_UK_g, in fp32 then in the rows' dtype: [b, h, lq, d_c]
    q_lat = torch.einsum("bgnqe,gec->bgnqc", q_far.reshape(b, kvh, group, lq, -1)[..., e_r:].float(), w_uk.float())
    q_lat = q_lat.to(rows.dtype).reshape(b, h, lq, d_c).contiguous()
    far1 = max(0, lk - window)  # far keys: [0, far1) (the last query's)
    near0 = max(0, lk - lq - window + 1) if window > 0 else lk  # near keys: [near0, lk) (the first query's)
    nrows, keys = group * lq, far1 + lk - near0
    bm = min(block_m, _pow2(nrows))
    nsplit = max(1, triton.cdiv(keys, split))
    scratch = torch.empty(b * kvh * nsplit * nrows * (d + d_c + 1), device=q.device, dtype=torch.float32)
    o_near, o_lat, lse = scratch.split([b * kvh * nsplit * nrows * n for n in (d, d_c, 1)])
    if mask is None:
        m, mstrides = q, (0, 0, 0, 0)  # a placeholder pointer, never read
    else:
        m = mask.expand(b, h, lq, lk)
        m = m.view(torch.uint8) if m.dtype == torch.bool else m
        mstrides = m.stride()
    qs = q_far.stride()
    _decode_kernel[(b * kvh, triton.cdiv(nrows, bm), nsplit)](
        q, q_lat, q_far, k_near, v_near, rows, m, o_near, o_lat, lse, default_scale(d, scale) * LOG2E, kvh, lk, lq,
        window, group, far1, near0, lk - ln, d, d_c, e_r, *q.stride()[:3], *qs[:3], *k_near.stride()[:3],
        *rows.stride()[:2], *mstrides, SPLIT=split, BLOCK_M=bm, BLOCK_N=block_n, D_P=_pow2(d), DC_P=_pow2(d_c),
        ER_P=_pow2(e_r), HAS_MASK=mask is not None, F32=q.dtype == torch.float32 or interpreted(), num_warps=num_warps)
    # the splits' partials [b, kv_heads, splits, rows, .] merged by their log-sum-exps (base 2): acc / l of each
    near, lat = merge_splits(lse.view(b, kvh, nsplit, nrows), o_near.view(b, kvh, nsplit, nrows, d),
                             o_lat.view(b, kvh, nsplit, nrows, d_c), dim=2, base2=True)
    out = near + torch.einsum("bgrc,gdc->bgrd", lat, w_uv.float())  # the latent sum up-projected once per row
    return out.view(b, h, lq, d).to(q.dtype)
