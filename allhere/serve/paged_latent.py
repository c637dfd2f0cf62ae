"""dar_latent's decode step over its two paged caches, all at once (``allhere.serve.vllm_dar_latent``): when every
request of a step has one query, each query's window (the host's K/V, from the sliding-window cache) and its far
keys (the latent rows [c ; k^R of every KV head], from the latent cache) are read in one softmax and written
straight to ``out``: no log-sum-exp, no merge, few operations (at batch 1 a step's cost is its number of
operations, not its keys). No vLLM import: vLLM's kernel (below) is found among torch's registered ops.

Far keys are read absorbed, as ``paged_far._attend_absorbed`` reads them: a head's query becomes a row [q^C W_UK_g ;
q^R in its KV head's slot, zeros elsewhere], scored against the rows as they are gathered (one matmul per step);
the probabilities weight the rows, and W_UV_g maps the weighted latent once per head.

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

from ..ops.dar_latent.check import query_rows
from .paged_chunks import Workspace
from .paged_decode import block_kv

_NEG = float("-inf")
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


def decode_latent(q, q_far, pos, near, near_table, rows, rows_table, window: int, w_uk, w_uv, e_r: int,
                  scale: float, out, workspace: Workspace | None = None) -> None:
    """q, q_far [m, heads, d]: one query per request (request i's at ``pos[i]``), the host's rotated query and the
    far query [q^R ; q^C]; near: the window cache ``paged.paged_view`` [blocks, kv_heads, 2, bs, d] (keys
    transposed) with ``near_table`` [m, >=]; rows: the latent cache [blocks, bs_l, d_c + kv_heads x e_r] with
    ``rows_table`` [m, >=]; w_uk [kv_heads, d - e_r, d_c], w_uv [kv_heads, d, d_c]. Writes ``out`` [m, heads, d].
    ``workspace``: where the gathered rows go (``paged_chunks.Workspace``: reused, not page-faulted anew).

    The slots a row does not read (past its far keys in a gathered block, blocks past its own) get weight 0 but
    are multiplied all the same: they must hold finite numbers, which vLLM's caches do (zeroed when allocated,
    then written with keys, values and rows). Masking them instead would copy every gathered row once more."""
    workspace = workspace or Workspace()
    kernel = _kernel_for(rows)
    if kernel is not None:
        _decode_by_kernel(kernel, q, q_far, pos, near, near_table, rows, rows_table, window, w_uk, w_uv, e_r, scale,
                          out, workspace)
        return
    m, heads, d = q.shape
    kv_heads, bs = near.shape[1], near.shape[3]
    group, dev = heads // kv_heads, q.device
    p = pos.long().view(m, 1)
    cols = _window_cols(p[:, 0], window, bs)  # [m, nw]
    nw = cols.shape[1]
    kpos = (cols[:, :, None] * bs + torch.arange(bs, device=dev)).view(m, nw * bs)
    near_ok = (kpos <= p) & (p - kpos < window)
    cols = cols.clamp_max(near_table.shape[1] - 1)
    kt, v = block_kv(near, torch.where(near_ok.view(m, nw, bs).any(-1), near_table.long().gather(1, cols), 0),
                     workspace)
    # [m, kv_heads, group, nw x bs], in the cache's dtype as the far scores (fp32 accumulation), softmax in fp32
    s_near = torch.matmul(q.view(m, kv_heads, group, d).to(kt.dtype), kt).float()
    # the far keys: every row of positions 0 .. pos - window, read by pieces of requests whose gathered rows stay
    # in the CPU's caches between the two products that read them
    bl, width = rows.shape[1], rows.shape[2]
    far = (p[:, 0] - window + 1).clamp_min(0)  # keys read far
    blocks = (far + bl - 1) // bl
    q_row = query_rows(q_far.view(m, kv_heads, group, d), w_uk, e_r, rows.dtype).view(m, heads, width)
    summed = torch.empty(m, heads, w_uk.shape[2], device=dev)
    o = torch.empty(m, kv_heads, group, d, device=dev)
    per_request = max(1, int(blocks.max())) * bl * width * rows.element_size()
    step = max(1, PIECE_BYTES // per_request)
    for a in range(0, m, step):
        b = min(m, a + step)
        nf = max(1, int(blocks[a:b].max()))
        ids = torch.where(torch.arange(nf, device=dev) < blocks[a:b, None], rows_table[a:b, :nf].long(), 0)
        c = torch.index_select(rows, 0, ids.flatten(), out=workspace.take("rows", ((b - a) * nf, bl, width), rows))
        c = c.view(b - a, nf * bl, width)
        s_far = torch.bmm(q_row[a:b], c.transpose(1, 2)).float().view(b - a, kv_heads, group, -1)
        far_ok = torch.arange(nf * bl, device=dev) < far[a:b, None]
        s = torch.cat([s_near[a:b], s_far], -1).mul_(scale)
        s.masked_fill_(~torch.cat([near_ok[a:b], far_ok], -1).view(b - a, 1, 1, -1), _NEG)
        w = torch.softmax(s, -1).nan_to_num_(0.0)  # a row that reads no key: 0
        w_near, w_far = w.split([s_near.shape[-1], nf * bl], -1)
        summed[a:b] = torch.bmm(w_far.reshape(b - a, heads, -1).to(c.dtype), c)[..., :w_uk.shape[2]]
        o[a:b] = torch.matmul(w_near.to(v.dtype), v[a:b]).float()
    o += torch.einsum("mgnc,gdc->mgnd", summed.view(m, kv_heads, group, -1), w_uv.float())
    out.copy_(o.view(m, heads, d))


def _window_cols(p: torch.Tensor, window: int, bs: int) -> torch.Tensor:
    """The block columns [m, nw] of the window of positions p - window + 1 .. p [m], from its first position's
    block on (nw of them for any p; the last may lie past a request's blocks)."""
    nw = (window - 1) // bs + 2 if window > 0 else 0
    return (p - window + 1).clamp_min(0)[:, None] // bs + torch.arange(nw, device=p.device)


def _decode_by_kernel(kernel, q, q_far, pos, near, near_table, rows, rows_table, window: int, w_uk, w_uv,
                      e_r: int, scale: float, out, workspace: Workspace) -> None:
    """``decode_latent`` by two calls of vLLM's kernel: the window (its blocks gathered, the keys transposed to
    the values' layout) and the far rows (read in place), merged by their log-sum-exps."""
    m, heads, d = q.shape
    kv_heads, d_c = w_uk.shape[0], w_uk.shape[2]
    p = pos.long()
    lat, lse_far = _far_by_kernel(kernel, q_far, p, rows, rows_table, window, w_uk, e_r, scale)
    lat = lat.float().nan_to_num_(0.0)  # a request with no far key: NaN, weight 0 below
    if window > 0:
        o_near, lse_near = _near_by_kernel(kernel, q, p, near, near_table, window, scale, workspace)
        lse = torch.logaddexp(lse_far, lse_near)
        o = o_near.float().mul_(torch.exp(lse_near - lse)[..., None])
        lat.mul_(torch.exp(lse_far - lse)[..., None])
    else:
        o = torch.zeros(m, heads, d, device=q.device)
    o.view(m, kv_heads, -1, d).add_(torch.einsum("mgnc,gdc->mgnd", lat.view(m, kv_heads, -1, d_c), w_uv.float()))
    out.copy_(o)


def _near_by_kernel(kernel, q, p, near, near_table, window: int, scale: float, workspace: Workspace):
    """The window's part of a decode step: (output [m, heads, d] in q's dtype, log-sum-exp [m, heads] fp32)."""
    m, d = q.shape[0], q.shape[2]
    kv_heads, bs = near.shape[1], near.shape[3]
    count = (p + 1).clamp_max(window)  # the window's keys: positions p - count + 1 .. p
    cols = _window_cols(p, window, bs)
    blocks = near_table.long().gather(1, cols.clamp_max(near_table.shape[1] - 1))  # past a request's last: not read
    kt, v = block_kv(near, blocks, workspace)  # [m, kv_heads, d, T], [m, kv_heads, T, d]
    t = cols.shape[1] * bs
    k = workspace.take("near_keys", (m, kv_heads, t, d), kt)
    k.copy_(kt.transpose(-1, -2))
    v = v.contiguous()
    # token u of request i's window is slot i x kv_heads x T + (its first position - its first block's) + u of
    # these views (a kv head T slots further)
    size, strides = (m * kv_heads * t - (kv_heads - 1) * t, kv_heads, d), (d, t * d, 1)
    table = ((torch.arange(m, device=q.device) * kv_heads * t + p - count + 1 - cols[:, 0] * bs)[:, None]
             + torch.arange(window, device=q.device))
    return _attend(kernel, q, k.as_strided(size, strides), v.as_strided(size, strides), table, count, scale, 1)


def _far_by_kernel(kernel, q_far, p, rows, rows_table, window: int, w_uk, e_r: int, scale: float):
    """The far rows' part: (the weighted latents [m, heads, d_c] in the rows' dtype (NaN where a request reads no
    far key), log-sum-exp [m, heads] fp32, -inf there), the rows read where they lie."""
    m, heads, d = q_far.shape
    kv_heads, d_c = w_uk.shape[0], w_uk.shape[2]
    bl, width = rows.shape[1], rows.shape[2]
    far = (p - window + 1).clamp_min(0)  # keys read far: positions 0 .. p - window
    most = max(1, int(far.max()))
    # The kernel reads token t's row at t x its stride: vLLM pads a page to another group's page size, not always
    # by whole rows, so the stride is the gcd of the page's and the row's (rows overlap in this view; only whole
    # rows are indexed). Its token table: each request's rows, position by position, in those units.
    unit = math.gcd(rows.stride(0), width)
    per_block, per_row = rows.stride(0) // unit, width // unit
    flat = rows.as_strided(((rows.shape[0] - 1) * per_block + (bl - 1) * per_row + 1, 1, width), (unit, unit, 1))
    slots = (rows_table[:, :(most + bl - 1) // bl].long()[..., None] * per_block
             + torch.arange(bl, device=p.device) * per_row)
    splits = max(1, min(most // KEYS_PER_SPLIT, -(-2 * torch.get_num_threads() // m)))
    q_row = query_rows(q_far.view(m, kv_heads, heads // kv_heads, d), w_uk, e_r, rows.dtype).view(m, heads, width)
    return _attend(kernel, q_row, flat, flat[..., :d_c], slots.view(m, -1), far, scale, splits)


def _attend(kernel, q, k, v, table, lens, scale: float, splits: int):
    """vLLM's kernel: query i [heads, e] against keys ``k[table[i, :lens[i]]]`` [kv heads, e] and their values
    ``v[...]`` [kv heads, dv], split in ``splits`` along the keys -> (output [m, heads, dv] in q's dtype,
    log-sum-exp [m, heads] fp32: the splits' merged)."""
    m, heads = q.shape[:2]
    dv = v.shape[-1]
    o = torch.empty(m, heads, dv, dtype=q.dtype, device=q.device)
    parts = torch.empty(m, heads, splits, dv + 1, device=q.device)  # each split's output and log-sum-exp
    kernel(q, k, v, o, None, None, None, parts, table, torch.arange(m, device=q.device), lens, scale, 0.0, False, 0,
           None, None)
    return o, parts[..., 0, dv] if splits == 1 else torch.logsumexp(parts[..., dv], -1)
