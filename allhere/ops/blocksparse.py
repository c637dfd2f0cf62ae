"""Attention under any mask predicate, computing only the blocks the predicate keeps (CPU and GPU, any
dtype, differentiable).

Two steps, as FlexAttention's ``create_block_mask`` / ``flex_attention``:

1. ``plan_blocks(pred, ...)`` cuts queries and keys into tiles of ``block`` positions and finds the
   (query tile, key tile) pairs that may hold an allowed entry. A ``Mask`` of ``allhere.masks`` says
   so itself for whole rectangles (its ``tiles`` test: interval arithmetic, prefix sums), so this costs
   O(tiles), never n x n; a mask without one (a plain predicate) is evaluated on the full grid, a chunk of
   query tiles at a time. For each query tile it then gathers the kept key tiles and evaluates the
   predicate exactly on that gather only: the element mask, O(kept scores). Query tiles are bucketed by
   how many key tiles they keep (rounded up to 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, ...), so one long row (a
   global token) does not pad every other row to its length.
2. ``blocksparse_attention(q, k, v, plan)`` runs, per bucket, one batched SDPA of each query tile
   against its gathered keys under the element mask. Grouped-query heads that share a kv head are
   stacked as extra query rows of the same tile, so keys are gathered once per kv head, never copied per
   query head. A plan depends only on the pattern and the shapes: build it once, reuse it across layers
   and steps.

Rows that may see no key give 0 (as ``allhere.ops.full.masked_attention``).

FlexAttention (``allhere.ops.flex``) takes the same predicates; on CPU it needs ``torch.compile`` and
compiles once per shape, which is why this op is the default there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..masks.mask import Mask, MaskFn, as_mask
from .common import check_qkv, default_scale


def _bucket_sizes(counts: torch.Tensor, max_buckets: int = 24) -> torch.Tensor:
    """Per row, the number of key tiles its bucket gathers: its own count, except that beyond
    ``max_buckets`` distinct counts the rarest merge into the next larger one (padding a few rows rather
    than calling SDPA once per count)."""
    values, freq = torch.unique(counts[counts > 0], return_counts=True)
    sizes = dict(zip(values.tolist(), values.tolist()))
    keep = sorted(values.tolist())
    while len(keep) > max_buckets:
        rare = min(keep[:-1], key=lambda c: int(freq[values.tolist().index(c)]))
        keep.remove(rare)
    for c in sizes:
        sizes[c] = next(x for x in keep if x >= c)
    return torch.tensor([sizes.get(c, 0) for c in counts.tolist()], device=counts.device)


@dataclass
class Bucket:
    rows: torch.Tensor  # [R] index into the (group, query tile) rows
    kidx: torch.Tensor  # [R, c] key tiles of each row (padding repeats a kept tile, masked out)
    mask: torch.Tensor  # bool [1, R, g * bq, c * bk]: the exact element mask of the gather (a row that sees
    # nothing sees everything here; ``seen`` zeroes it)
    seen: torch.Tensor  # bool [R, g * bq, 1]: the query sees some key
    all_seen: bool = True  # every query of the bucket sees some key
    additive: dict = field(default_factory=dict)  # dtype -> the mask as 0 / -inf (what SDPA on CPU runs fastest)
    index: dict = field(default_factory=dict)  # lead -> (query rows, key tiles) in the flattened layout


@dataclass
class BlockPlan:
    """What ``blocksparse_attention`` computes for one pattern and one set of shapes (``plan_blocks``)."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    key_offset: int
    q_offset: int
    block: int  # query tile
    bk: int  # key tile
    per_batch: bool  # the pattern differs between batch rows
    per_head: bool  # the pattern differs between kv head groups
    buckets: list[Bucket] = field(default_factory=list)
    kept_tiles: int = 0  # (query tile, key tile) pairs computed, over every group
    total_tiles: int = 0

    @property
    def density(self) -> float:
        """Fraction of the tiles computed."""
        return self.kept_tiles / max(1, self.total_tiles)


def _tile_map(pred: Mask, bb, hh, ql, qh, kl, kh, lq, lk, q_off, key_offset, block, device):
    if pred.tiles is not None:
        return pred.tiles(bb, hh, ql, qh, kl, kh)
    # No rectangle rule: evaluate the predicate, a few query tiles at a time.
    nq, nk = ql.shape[-2], kl.shape[-1]
    k = (torch.arange(nk * block, device=device) + key_offset).clamp_max(key_offset + lk - 1)
    out = []
    step = max(1, (1 << 22) // max(1, nk * block * block))
    for s in range(0, nq, step):
        e = min(nq, s + step)
        q = (torch.arange(s * block, e * block, device=device) + q_off).clamp_max(q_off + lq - 1)
        m = pred(bb, hh, q.view(1, 1, -1, 1), k.view(1, 1, 1, -1))
        out.append(m.reshape(*m.shape[:2], e - s, block, nk, block).any(-1).any(-2))
    return torch.cat(out, -2)


def plan_blocks(pred: MaskFn | Mask, q_len: int, kv_len: int, *, heads: int = 1, kv_heads: int | None = None,
                batch: int = 1, block: int = 64, key_offset: int = 0, q_offset: int | None = None,
                device=None) -> BlockPlan:
    """The tiles ``pred`` keeps for queries at ``q_offset`` .. (default: the last ``q_len`` of the keys) and
    keys at ``key_offset`` .. ``key_offset + kv_len - 1`` (absolute positions), for ``heads`` query heads
    sharing ``kv_heads`` kv heads and ``batch`` rows (the predicate may depend on both)."""
    pred = as_mask(pred)
    kv_heads = heads if kv_heads is None else kv_heads
    if heads % kv_heads:
        raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads}")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    g = heads // kv_heads
    q_off = key_offset + kv_len - q_len if q_offset is None else q_offset
    bq = max(1, min(block, q_len))
    bk = max(1, min(block, kv_len))
    nq, nk = -(-q_len // bq), -(-kv_len // bk)
    i, j = torch.arange(nq, device=device), torch.arange(nk, device=device)
    ql = (i * bq + q_off).view(1, 1, -1, 1)
    qh = torch.clamp(ql + bq - 1, max=q_off + q_len - 1)
    kl = (j * bk + key_offset).view(1, 1, 1, -1)
    kh = torch.clamp(kl + bk - 1, max=key_offset + kv_len - 1)
    bb = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    hh = torch.arange(heads, device=device).view(1, -1, 1, 1)
    if pred.tiles is None and bq != bk:
        bq = bk = min(bq, bk)  # the chunked evaluation cuts square tiles
        return plan_blocks(pred, q_len, kv_len, heads=heads, kv_heads=kv_heads, batch=batch, block=bq,
                           key_offset=key_offset, q_offset=q_offset, device=device)
    tmap = _tile_map(pred, bb, hh, ql, qh, kl, kh, q_len, kv_len, q_off, key_offset, bq, device)
    tmap = torch.as_tensor(tmap, device=device).bool()
    while tmap.dim() < 4:
        tmap = tmap.unsqueeze(0)
    per_batch, per_head = tmap.shape[0] > 1, tmap.shape[1] > 1
    tmap = tmap.expand(batch if per_batch else 1, heads if per_head else 1, nq, nk)
    if per_head:  # a kv group computes the union of its query heads' tiles
        tmap = tmap.reshape(tmap.shape[0], kv_heads, g, nq, nk).any(2)
    if per_batch and not per_head:
        tmap = tmap.expand(batch, kv_heads, nq, nk)
    rows_map = tmap.reshape(-1, nk)  # [groups * nq, nk]
    copies = 1 if per_batch else batch if per_head else batch * kv_heads  # groups one row of rows_map stands for
    plan = BlockPlan(batch, heads, kv_heads, q_len, kv_len, key_offset, q_off, bq, bk, per_batch, per_head,
                     kept_tiles=int(rows_map.sum()) * copies, total_tiles=batch * kv_heads * nq * nk)
    counts = rows_map.sum(-1)
    sizes = _bucket_sizes(counts)
    for size in sorted(set(sizes.tolist()) - {0}):
        rows = (sizes == size).nonzero().flatten()
        c = min(size, nk)
        sel = rows_map[rows]  # [R, nk]
        # The kept tiles first (in order), then padding that repeats the first kept tile.
        order = torch.sort((~sel).to(torch.int8), dim=-1, stable=True).indices[:, :c]
        valid = torch.gather(sel, 1, order)
        kidx = torch.where(valid, order, order[:, :1])
        grp, qt = rows // nq, rows % nq
        # Element positions of the gather.
        qpos = (qt * bq + q_off).view(-1, 1, 1, 1) + torch.arange(bq, device=device).view(1, 1, -1, 1)
        kpos = (kidx * bk + key_offset).view(-1, 1, 1, c, 1) + torch.arange(bk, device=device).view(1, 1, 1, 1, -1)
        kpos = kpos.reshape(-1, 1, 1, c * bk)
        kvalid = (valid.view(-1, c, 1) & (kpos.view(-1, c, bk) < key_offset + kv_len)).view(-1, 1, 1, c * bk)
        if per_batch:
            b_idx = (grp // kv_heads).view(-1, 1, 1, 1)
            h_idx = ((grp % kv_heads) * g).view(-1, 1, 1, 1) + torch.arange(g, device=device).view(1, -1, 1, 1)
        elif per_head:
            b_idx = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
            h_idx = (grp * g).view(-1, 1, 1, 1) + torch.arange(g, device=device).view(1, -1, 1, 1)
        else:
            b_idx = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
            h_idx = torch.arange(g, device=device).view(1, -1, 1, 1)
        m = pred(b_idx, h_idx, qpos, kpos) & kvalid  # [R, g, bq, c * bk]
        m = m.expand(rows.shape[0], g, bq, c * bk).reshape(rows.shape[0], g * bq, c * bk)
        seen = m.any(-1, keepdim=True)
        plan.buckets.append(Bucket(rows, kidx, (m | ~seen).unsqueeze(0), seen, all_seen=bool(seen.all())))
    return plan


def blocksparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan,
                          scale: float | None = None, chunk_bytes: int = 16 << 20) -> torch.Tensor:
    """Attention of q [b, h, q_len, d] over k, v [b, kv_heads, kv_len, d] under the plan's pattern;
    output in q's dtype. ``chunk_bytes``: about how many bytes of keys one SDPA call gathers."""
    b, h, lq, d, hkv, lk = check_qkv(q, k, v)
    if (b, h, hkv, lq, lk) != (plan.batch, plan.heads, plan.kv_heads, plan.q_len, plan.kv_len):
        raise ValueError(f"the plan is for batch={plan.batch}, heads={plan.heads}, kv_heads={plan.kv_heads}, "
                         f"q_len={plan.q_len}, kv_len={plan.kv_len}; got {b}, {h}, {hkv}, {lq}, {lk}")
    scale = default_scale(d, scale)
    g, bq, bk = h // hkv, plan.block, plan.bk
    nq, nk = -(-lq // bq), -(-lk // bk)
    # Queries: [b, hkv, nq, g * bq, d]; keys: [b, hkv, nk, bk, d].
    qt = F.pad(q, (0, 0, 0, nq * bq - lq)).view(b, hkv, g, nq, bq, d).transpose(2, 3).reshape(b, hkv, nq, g * bq, d)
    kt = F.pad(k, (0, 0, 0, nk * bk - lk)).view(b, hkv, nk, bk, d)
    vt = F.pad(v, (0, 0, 0, nk * bk - lk)).view(b, hkv, nk, bk, d)
    # Everything flattened to dim 0 (index_select on dim 0 copies whole contiguous tiles: the fast gather
    # on CPU); ``lead`` copies of the plan's rows run side by side where the pattern is shared.
    qt = qt.reshape(b * hkv * nq, g * bq, d)
    kt, vt = kt.reshape(b * hkv * nk, bk * d), vt.reshape(b * hkv * nk, bk * d)
    lead = _lead(plan)
    outs, order = [], []
    for bucket in plan.buckets:
        qidx, kidx = _indices(plan, bucket, lead, nq, nk)
        r, c = bucket.kidx.shape
        mask = bucket.additive.get(q.dtype)
        if mask is None:  # SDPA on CPU runs an additive float mask of shape [1, R, ...] fastest
            mask = bucket.additive[q.dtype] = torch.zeros(
                bucket.mask.shape, dtype=q.dtype, device=q.device).masked_fill(~bucket.mask, float("-inf"))
        qidx, kidx = qidx.view(lead, r), kidx.view(lead, r, c)
        # Chunks of rows whose gathered keys stay moderate: a large fresh buffer costs more in page faults
        # than the copy itself (up to 10x slower gathers on CPU, measured), many tiny calls cost more in
        # per-call overhead.
        step = max(1, chunk_bytes // max(1, lead * c * bk * d * k.element_size()))
        for s0 in range(0, r, step):
            s1 = min(r, s0 + step)
            ki = kidx[:, s0:s1].flatten()
            kr = kt.index_select(0, ki).view(lead, s1 - s0, c * bk, d)
            vr = vt.index_select(0, ki).view(lead, s1 - s0, c * bk, d)
            qr = qt.index_select(0, qidx[:, s0:s1].flatten()).view(lead, s1 - s0, g * bq, d)
            o = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask[:, s0:s1], scale=scale)
            if not bucket.all_seen:
                o = o * bucket.seen[s0:s1].to(o.dtype)
            outs.append(o.reshape(lead * (s1 - s0), g * bq, d))
            order.append(qidx[:, s0:s1].flatten())
    outs.append(qt.new_zeros(1, g * bq, d))  # what rows that keep no tile read
    out = torch.cat(outs).index_select(0, _inverse(order, b * hkv * nq))
    if not plan.buckets and torch.is_grad_enabled():  # nothing is read: zero gradients, still connected
        out = out + 0 * (q.sum() + k.sum() + v.sum())
    out = out.view(b, hkv, nq, g, bq, d).transpose(2, 3).reshape(b, h, nq * bq, d)
    return out[:, :, :lq]


def _lead(plan: BlockPlan) -> int:
    """How many copies of the plan's rows run: every (batch, kv head) when the pattern is shared, every
    batch row when it differs by kv head only, one when it differs by batch row."""
    if plan.per_batch:
        return 1
    return plan.batch if plan.per_head else plan.batch * plan.kv_heads


def _indices(plan: BlockPlan, bucket: Bucket, lead: int, nq: int, nk: int):
    """Rows of the flattened queries [b * hkv * nq] and tiles of the flattened keys [b * hkv * nk] of a bucket."""
    got = bucket.index.get(lead)
    if got is None:
        per_lead = plan.batch * plan.kv_heads // lead  # groups each copy covers
        base = torch.arange(lead, device=bucket.rows.device).view(-1, 1)
        grp = (bucket.rows // nq).view(1, -1)
        qidx = (base * per_lead * nq + bucket.rows.view(1, -1)).flatten()
        kidx = ((base * per_lead + grp) * nk).unsqueeze(-1) + bucket.kidx.unsqueeze(0)
        got = bucket.index[lead] = (qidx, kidx.flatten())
    return got


def _inverse(order: list[torch.Tensor], total: int) -> torch.Tensor:
    """Per flattened query row, where its output sits in the concatenated chunk outputs (the last row: 0s)."""
    src = torch.cat(order) if order else torch.zeros(0, dtype=torch.long)
    inv = torch.full((total,), src.numel(), dtype=torch.long, device=src.device)
    inv[src] = torch.arange(src.numel(), device=src.device)
    return inv


def pattern_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pred: MaskFn | Mask,
                      scale: float | None = None, block: int = 64, key_offset: int = 0) -> torch.Tensor:
    """One-shot ``plan_blocks`` + ``blocksparse_attention`` (queries: the last q_len of the keys)."""
    b, h, lq, _, hkv, lk = check_qkv(q, k, v)
    plan = plan_blocks(pred, lq, lk, heads=h, kv_heads=hkv, batch=b, block=block, key_offset=key_offset,
                       device=q.device)
    return blocksparse_attention(q, k, v, plan, scale)
