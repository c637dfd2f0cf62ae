"""Attention over a paged KV cache, computed by allhere for every served mechanism that reads a subset of its
keys (AHA, attention sinks, dilated windows, Longformer, BigBird, DAR): the whole batch in one call, each
(request, query head) reading only the keys its mechanism's rule allows, straight from the blocks through the
block table. Plain torch: a served layer (vLLM's: ``allhere.serve.vllm.attention``) hands it the engine's cache
tensors, slot mapping, block table and the per-request query ranges.

Layout. vLLM allocates a layer's cache tensor, hands its blocks to requests (block table) and keeps them across
steps and requests (prefix caching); what a block holds is up to the attention that writes and reads it.
allhere reads the tensor's storage as ``[blocks, kv_heads, 2 (key, value), block_size x head_dim]``: token slot
``s`` (vLLM's slot mapping) is position ``s % block_size`` of block ``s // block_size``; one (block, kv head)
holds its keys transposed, one contiguous ``[head_dim, block_size]`` tile, then its values, ``[block_size,
head_dim]``. That is the layout vLLM's own CPU attention kernel reads (its "vec" and "vec16" variants, for x86
without AMX), so that kernel can read the same blocks where it computes a part of the rule (AHA's windowed
rows: ``allhere.serve.vllm.cpu_kernels``). A layer served by the Triton paged kernel instead (AHA on CUDA:
``aha_triton``) stores its keys untransposed, ``[block_size, head_dim]`` like its values
(``write(..., transposed=False)``, read through ``kernel_caches``); a layer keeps one layout for its life.

The rule. A mechanism gives, per *row class*, what a row of that class reads: masks over positions (``Read``,
with an optional query tile size), each the same one allhere trains and generates with (an
``allhere.masks.Mask``: its ``tiles`` block test says which rectangles may hold an allowed entry; its
``dense`` test, if it has one, which ones are allowed entirely; a plain predicate has neither). The parts of one
class must allow disjoint keys: each is attended on its own and the pieces merged, so a key two parts allow
would count twice (a union of overlapping parts is one part, its mask their ``masks.or_masks``: AHA's window
with sinks, ``window_read(..., n_sinks=)``). A row is one (query token, query head); ``row_class`` [tokens, heads]
says which class each is in (AHA: 0 local, 1 global, from the router; one class otherwise). Causality is always
added.

The work (``paged_attention``), batched tensor operations throughout (the only Python loops run over the
rule's parts and over pieces of bounded memory, never over requests or heads):

1. rows of requests with several queries this step (prefill, chunked prefill) are grouped by (class, request,
   kv head) and cut into query tiles of up to ``q_tile`` rows, in order of position, the query heads of one
   kv head together (a tile shares its keys; the rest of a group goes into a smaller tile);
2. per tile and part, the key blocks its rows may read: at or before the tile's last position and not
   excluded by ``tiles``. A block no row of the tile may read is never gathered (``chunks``);
3. blocks every row of the tile reads entirely (``dense``, or the predicate evaluated) are packed several to a
   call and attended unmasked; the others under the predicate's mask, each (tile, block) in torch's fused
   flash attention for the CPU, which also returns each row's log-sum-exp;
4. decode rows (one query in their request) take one tile per (token, kv head, class) that gathers all its
   blocks at once and scores them by matmul from the transposed keys (``decode``); where every row of
   the layer reads one predicate (the masked patterns: no classes, no extra pieces, no sink logits), all the
   step's decode tokens are computed at once and written straight to ``out``, with no merge
   (``decode.decode_direct``: at batch 1 a step's cost is its number of operations);
5. all pieces a row read are merged by their log-sum-exp (one softmax over everything it reads), learned sink
   logits (gpt-oss) joining as one more term, folded as they come once they pass a memory budget
   (``chunks.Merger``); the rows are written to ``out``.

Soft-capped scores (Gemma-2) have no fused kernel: there the scores are computed with matmuls too.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from ...masks.mask import Mask, as_mask
from ...masks.predicates import causal
from ...masks.windows import sliding_window, sliding_with_sinks
from .chunks import Merger, Workspace, attend_part, tile_rows
from .decode import decode_direct, decode_rows
from .step_plan import PagedStepPlan, slot_places, token_positions


class Read(NamedTuple):
    """One part of what a row class reads."""

    pred: Mask  # (b, h, q_idx, kv_idx) -> allowed, with its block tests (a plain predicate: none)
    q_tile: int | None = None  # rows per query tile for this part (None: paged_attention's q_tile)
    window: int | None = None  # ``window_read``'s: pred reads exactly the ``window`` most recent keys ...
    n_sinks: int = 0  # ... and the request's first ``n_sinks`` positions (attention sinks in AHA's local rows)


def paged_view(cache: torch.Tensor, block_size: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """``cache`` (a layer's whole cache tensor, any shape, contiguous) as [blocks, kv_heads, 2, block_size,
    head_dim] (``[..., 0, :, :]`` holds the keys transposed: see the module docstring)."""
    per_block = block_size * 2 * kv_heads * head_dim
    if not cache.is_contiguous() or cache.numel() % per_block:
        raise ValueError(f"a paged cache of {tuple(cache.shape)} does not hold whole blocks of {block_size} tokens x "
                         f"2 x {kv_heads} heads x {head_dim}")
    return cache.view(-1).view(cache.numel() // per_block, kv_heads, 2, block_size, head_dim)


def write(view: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, transposed: bool = True,
          places=None) -> None:
    """Store k, v [tokens, kv_heads, head_dim] at ``slots`` [tokens] (negative slots: padding, skipped).
    transposed: keys as [head_dim, block_size] per (block, kv head), as ``paged_attention`` reads them; False:
    as [block_size, head_dim], as the Triton paged kernel reads them (``kernel_caches``). ``places``: the slots'
    ``slot_places``, where the caller has them."""
    nb, kv_heads, _, bs, d = view.shape
    kept, blocks, rows = places or slot_places(slots, bs)
    if kept is not None:
        k, v = k[kept], v[kept]
    if transposed:
        view[:, :, 0].view(nb, kv_heads, d, bs)[blocks, :, :, rows] = k.to(view.dtype)
    else:
        view[blocks, :, 0, rows] = k.to(view.dtype)
    view[blocks, :, 1, rows] = v.to(view.dtype)


def kernel_caches(view: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of a view written with ``transposed=False`` as the Triton paged kernel takes them:
    [blocks, block_size, kv_heads, head_dim] each, views with one set of strides (nothing copied)."""
    return view[:, :, 0].transpose(1, 2), view[:, :, 1].transpose(1, 2)


def window_read(window: int, q_tile: int | None = None, n_sinks: int = 0) -> Read:
    """The ``window`` most recent keys, the query's own included (``masks.sliding_window``, block tests and all);
    with ``n_sinks`` > 0 also the request's first ``n_sinks`` positions (``masks.sliding_with_sinks``: one part,
    the union, whose ``tiles`` test skips the blocks between the sinks and the window; it has no ``dense`` test,
    so the blocks a tile reads entirely are found by evaluating the predicate)."""
    if n_sinks:
        return Read(sliding_with_sinks(window, n_sinks), q_tile, window, n_sinks)
    return Read(sliding_window(window), q_tile, window)


def causal_read(q_tile: int | None = None) -> Read:
    """Every key at or before the query (``masks.causal``, block tests and all)."""
    return Read(causal, q_tile)


def of_tokens(positions, query_start: torch.Tensor, seq_lens: torch.Tensor, n: int):
    """``positions`` (request [n], position [n]) where a caller gives them for the step's ``n`` tokens, else
    ``token_positions`` computed here."""
    if positions is not None and positions[0].numel() == n:
        return positions
    return token_positions(query_start, seq_lens, n)


def paged_attention(q: torch.Tensor, view: torch.Tensor, query_start: torch.Tensor,
                    seq_lens: torch.Tensor, block_table: torch.Tensor, reads: Sequence[Sequence[Read]], scale: float,
                    out: torch.Tensor, row_class: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                    softcap: float = 0.0, q_tile: int = 64, pack: int = 8,
                    workspace: Workspace | None = None, extra: Sequence = (), positions=None,
                    plan: PagedStepPlan | None = None) -> None:
    """Every request's queries against its cached keys (the step's own already written).

    q [tokens, heads, d]: request r's queries are rows ``query_start[r]:query_start[r + 1]``, at the last
    positions of its ``seq_lens[r]`` tokens (rows past ``query_start[-1]`` are not read). ``view``: the
    cache's ``paged_view``, read through ``block_table`` [requests, blocks]. ``reads[c]``: what a row of
    class c reads, ``Read`` tuples (see the module docstring); rows of a class that reads nothing are left as
    they are in ``out`` (another kernel computes them); ``row_class`` [tokens, heads] (int or bool; None: all
    class 0). ``sinks`` [heads]: learned sink logits (one more term in each row's softmax denominator);
    ``softcap``: scores become ``softcap * tanh(scores / softcap)`` (0: none). Writes ``out`` [>= tokens, heads,
    d] (rows past the last request's are left as they are); a row that reads no key gets 0.

    ``q_tile``: rows per query tile, unless a ``Read`` names its own. ``pack``: at most this many blocks read
    entirely by a tile go into one call (a power of two). ``workspace``: memory reused across calls for the
    gathered keys and values (one is made for this call if None). ``extra``: more pieces the rows read (as
    ``paged_pieces`` returns them), joined under the same softmax (then every row is written). ``positions``:
    ``token_positions`` of the step's tokens where a caller has them (a ``PagedStepPlan``'s, made once for every
    layer of the step); None: computed here. ``plan``: the step's ``PagedStepPlan``, where a decode step's reads
    of a one-rule layer are kept for the step's other layers of the same rule (``decode.decode_direct``)."""
    heads = q.shape[1]
    n = int(query_start[-1])
    if n == 0:
        return
    one_read = len(reads) == 1 and len(reads[0]) == 1 and not extra and sinks is None and row_class is None
    starts = query_start.long()
    decode = (starts[1:] - starts[:-1]) == 1 if one_read else None
    if decode is not None and bool(decode.all()):  # a decode step of a one-rule layer: no merge at all
        _direct(q, seq_lens, block_table, reads, scale, softcap, starts, decode, view, out, plan)
        return
    merger = Merger(n * heads, q.shape[2], q.device)
    for piece in extra:  # in turn, not interleaved: the pieces may share the workspace's buffers
        merger.add(piece)
    for piece in paged_pieces(q, view, query_start, seq_lens, block_table, reads, scale, row_class, softcap, q_tile,
                              pack, workspace, with_decode=decode is None, positions=positions):
        merger.add(piece)
    if sinks is not None:  # exp(sink logit) joins every row's denominator, with no value
        rows = torch.arange(n * heads, device=q.device)[:, None]
        merger.add((rows, q.new_zeros(n * heads, 1, q.shape[2]), sinks.float().repeat(n)[:, None]))
    merged = merger.result().view(n, heads, -1).to(out.dtype)
    empty = [] if extra else [c for c, parts in enumerate(reads) if not parts]
    if not empty:
        out[:n] = merged
    else:  # rows of a class that reads nothing here keep what ``out`` holds
        cls = torch.zeros(n, heads, dtype=torch.long, device=q.device) if row_class is None else row_class[:n].long()
        mine = ~torch.isin(cls, torch.tensor(empty, device=q.device))[..., None]
        out[:n] = torch.where(mine, merged, out[:n])
    if decode is not None and bool(decode.any()):
        _direct(q, seq_lens, block_table, reads, scale, softcap, starts, decode, view, out, plan)


def _direct(q, seq_lens, block_table, reads, scale, softcap, starts, decode, view, out, plan) -> None:
    """The decode tokens of a layer whose rows all read one predicate, straight into ``out``
    (``decode.decode_direct``)."""
    req = decode.nonzero().squeeze(1)
    decode_direct(q, starts[:-1][req], req, seq_lens[req].long() - 1, as_mask(Read(*reads[0][0]).pred), view,
                  block_table, scale, softcap, out, plan)


def paged_pieces(q: torch.Tensor, view: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor,
                 block_table: torch.Tensor, reads: Sequence[Sequence[Read]], scale: float,
                 row_class: torch.Tensor | None = None, softcap: float = 0.0, q_tile: int = 64, pack: int = 8,
                 workspace: Workspace | None = None, with_decode: bool = True, positions=None):
    """What ``paged_attention`` reads, before the merge: yields pieces (row ids ``token x heads + head`` [n, size],
    -1: padding; output [n, size, d]; log-sum-exp [n, size]) for ``allhere.softmax.merge_pieces`` /
    ``chunks.Merger`` as they are computed (a consumer that folds them holds no more than it chooses).
    ``with_decode`` False: none for the decode tokens (requests with one query). ``positions``: as
    ``paged_attention``'s."""
    heads = q.shape[1]
    n = int(query_start[-1])
    dev = q.device
    workspace = workspace or Workspace()
    reads = [[Read(as_mask(r[0]), *r[1:]) for r in parts] for parts in reads]
    starts = query_start.long()
    q_len = starts[1:] - starts[:-1]
    req, pos = of_tokens(positions, query_start, seq_lens, n)
    tok = torch.arange(n, device=dev).repeat_interleave(heads)  # rows, token-major
    head = torch.arange(heads, device=dev).repeat(n)
    cls = (torch.zeros(n * heads, dtype=torch.long, device=dev) if row_class is None
           else row_class[:n].reshape(-1).long())
    qflat = q[:n].reshape(n * heads, q.shape[2])  # by row id (one copy where q is a strided view)
    one = q_len == 1
    if with_decode and bool(one.any()):  # decode rows: one tile per (token, kv head, class)
        t = starts[:-1][one]
        yield from decode_rows(qflat, t, req[t], pos[t], None if row_class is None else row_class[t], reads, view,
                             block_table, scale, softcap, heads, workspace)
    if not bool(one.all()):  # longer queries: tiles of rows in order of position, read chunk by chunk
        longer = ~one[req][tok]
        tok, head, cls = tok[longer], head[longer], cls[longer]
        for c, reads_c in enumerate(reads):
            in_c = cls == c
            if not bool(in_c.any()):
                continue
            tiled = {}
            for read in reads_c:
                size = read.q_tile or q_tile
                if size not in tiled:
                    tiled[size] = tile_rows(tok[in_c], head[in_c], req, pos, qflat, heads, view.shape[1], size)
                for tiles in tiled[size]:
                    for t, o, lse in attend_part(tiles, read.pred, view, block_table, scale, softcap,
                                                 pack, workspace):
                        yield tiles.row[t], o, lse
