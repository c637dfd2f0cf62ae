"""dar_latent's decode step over its two paged caches, all at once (``allhere.serve.vllm.dar_latent``): when every
request of a step has one query, each query's window (the host's K/V, from the sliding-window cache) and its far
keys (the latent rows [c ; k^R of every KV head], from the latent cache) are read in one softmax and written
straight to ``out``: no log-sum-exp, no merge, few operations (at batch 1 a step's cost is its number of
operations, not its keys). Plain torch: vLLM's kernel (below) is found among torch's registered ops.

Far keys are read absorbed, as ``dar_far._attend_absorbed`` reads them: a head's query comes as a row [q^C W_UK_g ;
q^R in its KV head's slot, zeros elsewhere] (the served layer makes it in one matmul: ``ops.dar_latent.query_map``),
scored against the rows as they are gathered (one matmul per step); the probabilities weight the rows, and W_UV_g
maps the weighted latent once per head. What follows from the step's positions and tables alone is made by its
first layer and kept for the others (``step_plan``).

With vLLM's CPU build loaded and a bf16 cache, the step is two calls of vLLM's own CPU decode kernel for latent
caches (``torch.ops._C.decode_attention_cpu``, from sgl-kernel, the one vLLM's CPU MLA backend runs for DeepSeek's
[c ; k_pe] rows: our rows have that form, one shared KV head, the values the rows' first d_c numbers): the far
rows read where they lie, split along the keys across the CPU's threads, and the window's K/V, gathered. Each
returns its part normalised with its log-sum-exp; the two are merged by them. The kernel has no fp32 version: an
fp32 cache takes the torch way above, as does every step where vLLM loaded its build for processors without
AVX512-BF16, which lacks the kernel.
"""

from __future__ import annotations

import math

import torch

from ...softmax import NEG_INF
from ..dar_latent.query_map import by_kv_head
from .chunks import Workspace
from .decode import block_kv
from .step_plan import PagedStepPlan, part_of

PIECE_BYTES = 4 << 20  # gathered rows per piece of requests: read twice, from the CPU's caches the second time
KEYS_PER_SPLIT = 512  # the fewest far keys a thread of vLLM's kernel takes (vLLM's CPU MLA backend's choice)
USE_KERNEL = True  # vLLM's CPU decode kernel for a bf16 step, when loaded; False: the torch way


def vllm_decode_kernel():
    """``torch.ops._C.decode_attention_cpu`` when vLLM's CPU build is loaded (the serving process) and has it (its
    build for x86 with AVX512-BF16 does; those for AVX512 or AVX2 alone do not), else None."""
    try:
        return torch.ops._C.decode_attention_cpu
    except (AttributeError, RuntimeError):
        return None


def _kernel_for(rows: torch.Tensor):
    """vLLM's kernel where it reads ``rows``: bf16 on the CPU, each block's rows contiguous."""
    if not USE_KERNEL or rows.dtype != torch.bfloat16 or rows.device.type != "cpu":
        return None
    if rows.stride(2) != 1 or rows.stride(1) != rows.shape[2]:
        return None
    return vllm_decode_kernel()


def decode_latent(q, q_row, pos, near, near_table, rows, rows_table, window: int, w_uv, scale: float, out,
                  workspace: Workspace | None = None, plan: PagedStepPlan | None = None) -> None:
    """q [m, heads, d]: one query per request (request i's at ``pos[i]``), as the host rotated it; q_row [m, heads,
    d_c + kv_heads x e_r]: its far query as a cache row (``ops.dar_latent.check.query_rows``, absorbed); near: the
    window cache ``attention.paged_view`` [blocks, kv_heads, 2, bs, d] (keys transposed) with ``near_table`` [m, >=];
    rows: the latent cache [blocks, bs_l, d_c + kv_heads x e_r] with ``rows_table`` [m, >=]; w_uv [kv_heads, d,
    d_c]. Writes ``out`` [m, heads, d]. ``workspace``: where the gathered rows go (``chunks.Workspace``:
    reused, not page-faulted anew). ``plan``: the step's ``PagedStepPlan``, where what depends on the step alone
    (pos, the tables, the caches' shapes) is kept for the next layer (None: made for this call).

    The slots a row does not read (past its far keys in a gathered block, blocks past its own) get weight 0 but
    are multiplied all the same: they must hold finite numbers, which vLLM's caches do (zeroed when allocated,
    then written with keys, values and rows). Masking them instead would copy every gathered row once more."""
    workspace = workspace or Workspace()
    kernel = _kernel_for(rows)
    if kernel is not None:
        _decode_by_kernel(kernel, q, q_row, pos, near, near_table, rows, rows_table, window, w_uv, scale, out,
                          workspace, plan)
        return
    m, heads, d = q.shape
    kv_heads, bs = near.shape[1], near.shape[3]
    group, d_c = heads // kv_heads, w_uv.shape[2]
    bl, width = rows.shape[1], rows.shape[2]
    near_blocks, pieces = part_of(plan, ("torch", window, bs, bl, width * rows.element_size()), lambda: _plan(
        pos.long(), near_table, rows_table, window, bs, bl, width * rows.element_size()))
    kt, v = block_kv(near, near_blocks, workspace)
    # Every product in float32: on a CPU without bf16 matrix units, torch's bf16 bmm of a few query rows runs 5-25x
    # slower than the same product in fp32 (one thread, 4 rows x 8k keys: 1.2 / 3.4 ms against 0.21 / 0.13 ms),
    # far more than the one copy that converts the gathered rows.
    s_near = torch.matmul(q.view(m, kv_heads, group, d).float(), kt.float())  # [m, kv_heads, group, nw x bs]
    v = v.float()
    summed = torch.empty(m, heads, d_c, device=q.device)
    o = torch.empty(m, kv_heads, group, d, device=q.device)
    for a, b, ids, blocked in pieces:  # pieces of requests whose gathered rows stay in the CPU's caches
        c = torch.index_select(rows, 0, ids, out=workspace.take("rows", (ids.numel(), bl, width), rows))
        c = c.view(b - a, -1, width).float()
        s_far = torch.bmm(q_row[a:b].float(), c.transpose(1, 2)).view(b - a, kv_heads, group, -1)
        s = torch.cat([s_near[a:b], s_far], -1).mul_(scale).masked_fill_(blocked, NEG_INF)
        w = torch.softmax(s, -1).nan_to_num_(0.0)  # a row that reads no key: 0
        w_near, w_far = w.split([s_near.shape[-1], c.shape[1]], -1)
        summed[a:b] = torch.bmm(w_far.reshape(b - a, heads, -1), c[..., :d_c])
        o[a:b] = torch.matmul(w_near, v[a:b])
    o += by_kv_head(summed.view(m, kv_heads, group, d_c), w_uv.float().transpose(1, 2))
    out.copy_(o.view(m, heads, d))


def _plan(p, near_table, rows_table, window: int, bs: int, bl: int, row_bytes: int):
    """What the torch way reads, from the positions p [m] alone: (the window's blocks [m, nw], and per piece of
    requests (first, end, its far rows' blocks [pieces x nf], the keys a row does not read [pieces, 1, 1, nw x bs
    + nf x bl]))."""
    m, dev = p.shape[0], p.device
    cols = _window_cols(p, window, bs)  # [m, nw]
    nw = cols.shape[1]
    kpos = (cols[:, :, None] * bs + torch.arange(bs, device=dev)).view(m, nw * bs)
    near_ok = (kpos <= p[:, None]) & (p[:, None] - kpos < window)
    blocks = torch.where(near_ok.view(m, nw, bs).any(-1), near_table.long().gather(1, cols.clamp_max(
        near_table.shape[1] - 1)), 0)
    far = (p - window + 1).clamp_min(0)  # keys read far: positions 0 .. p - window
    far_blocks = (far + bl - 1) // bl
    per_piece = max(1, PIECE_BYTES // (max(1, int(far_blocks.max())) * bl * row_bytes))
    pieces = []
    for a in range(0, m, per_piece):
        b = min(m, a + per_piece)
        nf = max(1, int(far_blocks[a:b].max()))
        ids = torch.where(torch.arange(nf, device=dev) < far_blocks[a:b, None], rows_table[a:b, :nf].long(), 0)
        far_ok = torch.arange(nf * bl, device=dev) < far[a:b, None]
        pieces.append((a, b, ids.flatten(), ~torch.cat([near_ok[a:b], far_ok], -1).view(b - a, 1, 1, -1)))
    return blocks, pieces


def _window_cols(p: torch.Tensor, window: int, bs: int) -> torch.Tensor:
    """The block columns [m, nw] of the window of positions p - window + 1 .. p [m], from its first position's
    block on (nw of them for any p; the last may lie past a request's blocks)."""
    nw = (window - 1) // bs + 2 if window > 0 else 0
    return (p - window + 1).clamp_min(0)[:, None] // bs + torch.arange(nw, device=p.device)


def _decode_by_kernel(kernel, q, q_row, pos, near, near_table, rows, rows_table, window: int, w_uv, scale: float,
                      out, workspace: Workspace, plan: PagedStepPlan | None) -> None:
    """``decode_latent`` by two calls of vLLM's kernel: the far rows (read in place) and the window (its blocks
    gathered, the keys transposed back to the values' layout), merged by their log-sum-exps."""
    m, heads, d = q.shape
    kv_heads, d_c = w_uv.shape[0], w_uv.shape[2]
    p = part_of(plan, "pos", lambda: pos.long())
    lat, lse_far = _far_by_kernel(kernel, q_row, p, rows, rows_table, window, d_c, scale, plan)
    lat = lat.float().nan_to_num_(0.0)  # a request with no far key: NaN, weight 0 below
    o = by_kv_head(lat.view(m, kv_heads, -1, d_c), w_uv.float().transpose(1, 2)).reshape(m, heads, d)
    if window > 0:
        o_near, lse_near = _near_by_kernel(kernel, q, p, near, near_table, window, scale, workspace, plan)
        # the far part's share of the softmax (0 where a request reads no far key: lse_far -inf)
        o = torch.lerp(o_near.float(), o, torch.sigmoid(lse_far - lse_near)[..., None])
    out.copy_(o)


def _near_by_kernel(kernel, q, p, near, near_table, window: int, scale: float, workspace: Workspace,
                    plan: PagedStepPlan | None):
    """The window's part of a decode step: (output [m, heads, d] in q's dtype, log-sum-exp [m, heads] fp32)."""
    d = q.shape[2]
    kv_heads, bs = near.shape[1], near.shape[3]
    tiles, table, count, reqs = part_of(plan, ("near", window, bs, kv_heads), lambda: _near_plan(
        p, near_table, window, bs, kv_heads))
    flat = near.reshape(-1, bs, d)  # (block, kv head, keys | values)
    both = torch.index_select(flat, 0, tiles, out=workspace.take("kv", (tiles.numel(), bs, d), flat))
    n = tiles.numel() // 2
    k = workspace.take("k", (n, bs, d), flat)
    k.copy_(both[:n].view(n, d, bs).transpose(1, 2))  # the keys (stored transposed) in the values' layout
    # [m, nw, kv_heads, bs, d] each: token (request i, column j, slot s) is row (i nw + j) kv_heads bs + s of
    # these views, its kv head h bs rows further
    size, strides = (n * bs - (kv_heads - 1) * bs, kv_heads, d), (d, bs * d, 1)
    return _attend(kernel, q, k.as_strided(size, strides), both[n:].as_strided(size, strides), table, count, scale,
                   1, reqs)


def _near_plan(p, near_table, window: int, bs: int, kv_heads: int):
    """The window's (cache rows to gather: keys' then values', the token table [m, window] into them, the keys
    read [m], arange(m))."""
    m, dev = p.shape[0], p.device
    count = (p + 1).clamp_max(window)  # the window's keys: positions p - count + 1 .. p
    cols = _window_cols(p, window, bs)
    blocks = near_table.long().gather(1, cols.clamp_max(near_table.shape[1] - 1))  # past a request's last: not read
    idx = ((blocks[..., None] * kv_heads + torch.arange(kv_heads, device=dev)) * 2).flatten()
    u = p[:, None] - count[:, None] + 1 + torch.arange(window, device=dev)  # positions (past count: not read)
    base = torch.arange(m, device=dev)[:, None] * cols.shape[1]
    table = ((base + (u // bs - cols[:, :1]).clamp(0, cols.shape[1] - 1)) * kv_heads * bs + u % bs)
    return torch.cat([idx, idx + 1]), table, count, torch.arange(m, device=dev)


def _far_by_kernel(kernel, q_row, p, rows, rows_table, window: int, d_c: int, scale: float,
                   plan: PagedStepPlan | None):
    """The far rows' part: (the weighted latents [m, heads, d_c] in the rows' dtype (NaN where a request reads no
    far key), log-sum-exp [m, heads] fp32, -inf there), the rows read where they lie."""
    bl, width = rows.shape[1], rows.shape[2]
    # The kernel reads token t's row at t x its stride: vLLM pads a page to another group's page size, not always
    # by whole rows, so the stride is the gcd of the page's and the row's (rows overlap in this view; only whole
    # rows are indexed). Its token table: each request's rows, position by position, in those units.
    unit = math.gcd(rows.stride(0), width)
    per_block, per_row = rows.stride(0) // unit, width // unit
    flat = rows.as_strided(((rows.shape[0] - 1) * per_block + (bl - 1) * per_row + 1, 1, width), (unit, unit, 1))
    far, slots, splits, reqs = part_of(plan, ("far", window, bl, per_block, per_row), lambda: _far_plan(
        p, rows_table, window, bl, per_block, per_row))
    return _attend(kernel, q_row, flat, flat[..., :d_c], slots, far, scale, splits, reqs)


def _far_plan(p, rows_table, window: int, bl: int, per_block: int, per_row: int):
    """The far rows' (keys read [m], token table, splits along the keys, arange(m))."""
    m = p.shape[0]
    far = (p - window + 1).clamp_min(0)  # keys read far: positions 0 .. p - window
    most = max(1, int(far.max()))
    slots = (rows_table[:, :(most + bl - 1) // bl].long()[..., None] * per_block
             + torch.arange(bl, device=p.device) * per_row)
    threads = torch.get_num_threads()  # one (vLLM's CPU worker on 2 cores): one split, its log-sum-exp read as is
    splits = 1 if threads == 1 else max(1, min(most // KEYS_PER_SPLIT, -(-2 * threads // m)))
    return far, slots.view(m, -1), splits, torch.arange(m, device=p.device)


def _attend(kernel, q, k, v, table, lens, scale: float, splits: int, reqs):
    """vLLM's kernel: query i [heads, e] against keys ``k[table[i, :lens[i]]]`` [kv heads, e] and their values
    ``v[...]`` [kv heads, dv], split in ``splits`` along the keys -> (output [m, heads, dv] in q's dtype,
    log-sum-exp [m, heads] fp32: the splits' merged). ``reqs``: arange(m)."""
    m, heads = q.shape[:2]
    dv = v.shape[-1]
    o = torch.empty(m, heads, dv, dtype=q.dtype, device=q.device)
    parts = torch.empty(m, heads, splits, dv + 1, device=q.device)  # each split's output and log-sum-exp
    kernel(q, k, v, o, None, None, None, parts, table, reqs, lens, scale, 0.0, False, 0, None, None)
    return o, parts[..., 0, dv] if splits == 1 else torch.logsumexp(parts[..., dv], -1)
