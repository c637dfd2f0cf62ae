"""Attention masks as predicates ``(b, h, q_idx, kv_idx) -> bool`` (True = may attend).

The same predicate feeds the dense references (``dense_mask``), FlexAttention and any plot of the
pattern. Indices are absolute token positions. Predicates work on broadcastable integer tensors, so
they are written with tensor operators (``&``, ``|``), never ``and``/``or``.

The one window definition of the project: window ``w`` = the ``w`` most recent keys including the
current token, i.e. ``0 <= q_idx - kv_idx < w`` (Eq. 4 of the AHA paper; Hugging Face ``sliding_window=w``;
flash-attn ``window_size=(w - 1, 0)``).

A predicate that reads tables (per-head dilations, global-token flags, BigBird's random blocks) has
``prepare(heads, length, device)``: it fills its tables for that many heads and positions and copies them
to ``device`` before the predicate is traced (FlexAttention's ``create_block_mask`` vmaps it and its
compiled kernels read captured tensors on their own device only). One whose pattern differs between heads
says ``varies_by_head = True``. ``and_masks`` / ``or_masks`` pass both on.
"""

from __future__ import annotations

from typing import Callable

import torch

MaskFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def sliding_window(window: int, causal: bool = True) -> MaskFn:
    """Causal window of ``window`` keys, the current one included; with ``causal=False`` (an encoder)
    ``window - 1`` keys on each side: ``|q - k| < window``."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")

    if causal:
        def pred(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx - kv_idx < window)
    else:
        def pred(b, h, q_idx, kv_idx):
            d = q_idx - kv_idx
            return (d < window) & (d > -window)

    def tiles(b, h, ql, qh, kl, kh):  # exact: every difference in [ql - kh, qh - kl] occurs
        return (qh - kl >= (0 if causal else 1 - window)) & (ql - kh < window)

    pred.__name__ = f"sliding_window_{window}" + ("" if causal else "_bidir")
    pred.tiles = tiles
    return pred


def and_masks(*preds: MaskFn) -> MaskFn:
    def pred(b, h, q_idx, kv_idx):
        out = preds[0](b, h, q_idx, kv_idx)
        for p in preds[1:]:
            out = out & p(b, h, q_idx, kv_idx)
        return out

    return _combined(pred, preds, torch.logical_and)  # tiles: a superset, both parts may hit different entries


def or_masks(*preds: MaskFn) -> MaskFn:
    def pred(b, h, q_idx, kv_idx):
        out = preds[0](b, h, q_idx, kv_idx)
        for p in preds[1:]:
            out = out | p(b, h, q_idx, kv_idx)
        return out

    return _combined(pred, preds, torch.logical_or)


def _combined(pred: MaskFn, preds, combine) -> MaskFn:
    """``pred`` with the ``tiles`` rule and the ``prepare`` of its parts."""
    tiles = _tiles_of(preds, combine)
    if tiles is not None:
        pred.tiles = tiles
    prepares = [p.prepare for p in preds if hasattr(p, "prepare")]
    if prepares:
        def prepare(heads: int, length: int, device=None) -> None:
            for f in prepares:
                f(heads, length, device)

        pred.prepare = prepare
    if any(getattr(p, "varies_by_head", False) for p in preds):
        pred.varies_by_head = True
    return pred


def _device(device) -> torch.device:
    """A device with its index ("cuda" is the current CUDA device), so that equal devices compare equal."""
    device = torch.device(device or "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class _Tables:
    """The CPU tensors a predicate reads, with one copy per device they are read on: made by ``prepare``
    ahead of tracing (a traced evaluation cannot copy), or by the first eager read there."""

    def __init__(self, **tensors: torch.Tensor) -> None:
        self.cpu = tensors
        self.copies: dict[torch.device, dict[str, torch.Tensor]] = {}

    def replace(self, **tensors: torch.Tensor) -> None:
        """New contents (a table that grew), copied again to every device it was on."""
        self.cpu = tensors
        for device in list(self.copies):
            self.prepare(device=device, again=True)

    def prepare(self, heads: int = 0, length: int = 0, device=None, again: bool = False) -> None:
        device = _device(device)
        if device.type != "cpu" and (again or device not in self.copies):
            self.copies[device] = {k: v.to(device) for k, v in self.cpu.items()}

    def get(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The table ``name`` on ``like``'s device."""
        if like.device.type == "cpu":
            return self.cpu[name]
        device = _device(like.device)
        if device not in self.copies:
            if _tracing(like):
                raise RuntimeError("a mask predicate's tables must be on the device before it is traced: call its "
                                   "prepare(heads, length, device) first (allhere.ops.flex does)")
            self.prepare(device=device)
        return self.copies[device][name]


def _tracing(t) -> bool:
    """Whether ``t`` is being traced (vmapped by ``create_block_mask``, compiled), where no value can be read."""
    return (torch.compiler.is_compiling() or type(t) is not torch.Tensor
            or torch._C._functorch.is_batchedtensor(t))


def dense_mask(pred: MaskFn, q_len: int, kv_len: int, device=None, q_offset: int | None = None,
               batch: int = 1, heads: int = 1, key_offset: int = 0) -> torch.Tensor:
    """Evaluate ``pred`` on a grid: bool tensor [batch, heads, q_len, kv_len].

    The keys sit at absolute positions ``key_offset`` .. ``key_offset + kv_len - 1`` (a rolling cache that
    dropped older keys has ``key_offset`` > 0); the queries are the last ``q_len`` of them (bottom-right
    alignment, as in a KV cache) unless ``q_offset`` says where the first query sits.
    """
    off = key_offset + kv_len - q_len if q_offset is None else q_offset
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    q = torch.arange(q_len, device=device).view(1, 1, -1, 1) + off
    k = torch.arange(kv_len, device=device).view(1, 1, 1, -1) + key_offset
    return pred(b, h, q, k).expand(batch, heads, q_len, kv_len)


def segment_starts(mask: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor | None:
    """Read segment starts off a dense mask, for masks built by others (Hugging Face builds one per
    forward; ``allhere.hf`` converts it once, here). If ``mask`` (bool [batch, 1, q_len, kv_len], True =
    may attend), taken together with causality as the attention ops take it, is causal attention within
    contiguous segments -- the sequences of a padded batch, or the documents of packed sequences --
    return, per query, the first key of its segment ([batch, q_len] int64), -1 for a query that does not
    see itself; otherwise None.

    Checked: a query that sees itself sees exactly the keys from its segment's start to itself; a segment
    starts at a query or before the first one; no such query sees the position of a query that does not
    see itself (a padding query, whose output is therefore never read). Queries are the last q_len
    positions. Code that knows its boundaries passes them directly (``starts_from``).
    """
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (q_len, kv_len):
        return None
    # Memory: one [b, q_len, kv_len] temporary besides the mask.
    j = torch.arange(kv_len, device=mask.device)
    pos = torch.arange(q_len, device=mask.device) + (kv_len - q_len)
    m = mask[:, 0] & (j <= pos[:, None])  # what the ops use: the mask and causality
    real = m[:, torch.arange(q_len, device=mask.device), pos]  # [b, q_len]: sees itself
    first = m.view(torch.uint8).argmax(-1)  # the first key each query sees (argmax: the first maximum)
    exact = (m.sum(-1) == pos - first + 1) | ~real  # every key from the first to itself, and no other
    del m
    same_or_new = (first[:, 1:] == pos[1:]) | (real[:, :-1] & (first[:, 1:] == first[:, :-1])) | ~real[:, 1:]
    # Positions some real query reads: each covers [first, itself]; summed as +1 / -1 steps.
    steps = torch.zeros(mask.shape[0], kv_len + 1, device=mask.device, dtype=torch.int64)
    steps.scatter_add_(1, first, real.long()).scatter_add_(1, pos.expand_as(first) + 1, -real.long())
    seen = (steps.cumsum(1)[:, kv_len - q_len:kv_len] > 0)  # [b, q_len]
    if not bool(exact.all()) or not bool(same_or_new.all()) or bool((seen & ~real).any()):
        return None
    return torch.where(real, first, -1)


def starts_from(padding_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor | None:
    """Segment starts [batch, n] of a batch, from what the collator knows: ``padding_mask`` [batch, n]
    (True = a real token; padding may sit on either side) and/or ``position_ids`` [batch, n] that restart
    at 0 where a packed document starts. A real token's segment starts at its document's first token (and
    not before its run of real tokens); a padding token gets -1. None when neither is given."""
    if padding_mask is None and position_ids is None:
        return None
    ref = padding_mask if padding_mask is not None else position_ids
    b, n = ref.shape
    idx = torch.arange(n, device=ref.device).expand(b, n)
    starts = torch.zeros(b, n, dtype=torch.long, device=ref.device)
    if position_ids is not None:
        starts = (idx - position_ids.long()).clamp_min(0)
    if padding_mask is None:
        return starts
    real = padding_mask.bool()
    run_start = torch.where(real & ~torch.cat([real.new_zeros(b, 1), real[:, :-1]], 1), idx, 0).cummax(1).values
    return torch.where(real, torch.maximum(starts, run_start), -1)


def within_segments(starts: torch.Tensor, q_offset: int = 0) -> MaskFn:
    """Predicate of segment starts [batch, q_len] (``starts_from``): query i sees key j iff
    starts[b, i] <= j, and nothing when starts is -1. AND it with a causal pattern."""

    def pred(b, h, q_idx, kv_idx):
        s = starts[b, q_idx - q_offset]
        return (s >= 0) & (kv_idx >= s)

    return pred


# ---------------------------------------------------------------------------------------------------------
# The sparse attention pattern family: sinks, dilated windows, global tokens, Longformer and BigBird.
#
# Every factory takes ``causal`` (default True). With ``causal=False`` (an encoder) a window of ``w`` reaches
# ``w - 1`` keys on each side (``|q - k| < w``) and global tokens see / are seen by every position.
#
# Besides being a predicate, each factory's result carries ``tiles(b, h, q_lo, q_hi, k_lo, k_hi)``: for
# rectangles of positions (inclusive bounds, broadcastable integer tensors) whether the rectangle may hold
# an allowed entry. It may say True for an empty rectangle (a superset), never False for a non-empty one;
# the block-sparse op (``allhere.ops.blocksparse``) uses it to find the blocks to compute without
# evaluating the predicate on all n x n positions. ``and_masks`` / ``or_masks`` combine it.
# ---------------------------------------------------------------------------------------------------------


def _with_tiles(pred: MaskFn, name: str, tiles=None) -> MaskFn:
    pred.__name__ = name
    if tiles is not None:
        pred.tiles = tiles
    return pred


def _tiles_of(preds, combine):
    parts = [getattr(p, "tiles", None) for p in preds]
    if any(t is None for t in parts):
        return None

    def tiles(b, h, ql, qh, kl, kh):
        out = parts[0](b, h, ql, qh, kl, kh)
        for t in parts[1:]:
            out = combine(out, t(b, h, ql, qh, kl, kh))
        return out

    return tiles


causal.tiles = lambda b, h, ql, qh, kl, kh: kl <= qh  # noqa: E731  (exact: the rectangle's corner (qh, kl))


def _check_count(name: str, value, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _range_hits(diff_lo, diff_hi, step, count):
    """Whether some m in [0, count) has m * step in [diff_lo, diff_hi] (step >= 1; tensors broadcast)."""
    lo = diff_lo.clamp_min(0)
    m = (lo + step - 1) // step
    return (diff_hi >= lo) & (m < count) & (m * step <= diff_hi)


def dilated_window(window: int, dilation=1, causal: bool = True) -> MaskFn:
    """``window`` keys at stride ``dilation``: q - k in {0, d, 2d, ..., (window-1) d} (span (window-1) d + 1),
    or |q - k| in that set when ``causal=False``. ``dilation``: an int, or a tuple of one int per query head
    (indexed by the predicate's ``h``: Longformer's per-head dilation, "Longformer: The Long-Document
    Transformer", arXiv:2004.05150). ``dilation=1`` is ``sliding_window``."""
    _check_count("window", window, 1)
    per_head = isinstance(dilation, (tuple, list))
    dils = tuple(dilation) if per_head else (dilation,)
    if not dils:
        raise ValueError("dilation must be an integer >= 1 or a non-empty tuple of them")
    for d in dils:
        _check_count("dilation", d, 1)
    table = _Tables(d=torch.tensor(dils, dtype=torch.long))

    def step(h, like):
        if not per_head:
            return dils[0]
        return table.get("d", like)[torch.as_tensor(h, device=like.device)]

    def pred(b, h, q_idx, kv_idx):
        d = step(h, q_idx)
        diff = q_idx - kv_idx
        if not causal:
            diff = diff.abs()
        return (diff >= 0) & (diff % d == 0) & (diff <= (window - 1) * d)

    def tiles(b, h, ql, qh, kl, kh):
        d = step(h, ql)
        lo, hi = ql - kh, qh - kl  # every difference in between occurs in the rectangle
        ahead = _range_hits(lo, hi, d, window)
        return ahead if causal else ahead | _range_hits(-hi, -lo, d, window)

    name = f"dilated_window_{window}_{'x'.join(map(str, dils))}" + ("" if causal else "_bidir")
    if per_head:
        pred.prepare, pred.varies_by_head = table.prepare, True
    return _with_tiles(pred, name, tiles)


def sinks(n_sinks: int, causal: bool = True) -> MaskFn:
    """Attention sinks: every query sees the keys at positions < ``n_sinks`` (earlier ones if causal), as in
    StreamingLLM ("Efficient Streaming Language Models with Attention Sinks", arXiv:2309.17453). A
    component: ``sliding_with_sinks`` ORs it with a window."""
    _check_count("n_sinks", n_sinks, 0)

    def pred(b, h, q_idx, kv_idx):
        out = kv_idx < n_sinks
        return out & (kv_idx <= q_idx) if causal else out

    def tiles(b, h, ql, qh, kl, kh):
        out = kl < n_sinks
        return out & (kl <= qh) if causal else out

    return _with_tiles(pred, f"sinks_{n_sinks}" + ("" if causal else "_bidir"), tiles)


def sliding_with_sinks(window: int, n_sinks: int, causal: bool = True) -> MaskFn:
    """StreamingLLM's pattern (arXiv:2309.17453): the window of ``window`` keys OR the first ``n_sinks`` keys."""
    pred = or_masks(sliding_window(window, causal=causal), sinks(n_sinks, causal=causal))
    return _with_tiles(pred, f"sliding_{window}_sinks_{n_sinks}" + ("" if causal else "_bidir"))


def _lookup(flags: torch.Tensor):
    """pos -> flags[pos] (flags [n] or [batch, n]) for broadcastable positions; False outside [0, n); and
    whether a flag lies in [lo, hi]; and the tables' ``prepare``."""
    n = flags.shape[-1]
    counts = torch.cat([torch.zeros(*flags.shape[:-1], 1, dtype=torch.long), flags.long().cumsum(-1)], -1)
    tables = _Tables(flags=flags, counts=counts)

    def at(b, pos):
        f = tables.get("flags", pos)
        i = pos.clamp(0, max(n - 1, 0))
        hit = f[i] if f.dim() == 1 else f[torch.as_tensor(b, device=pos.device), i]
        return hit & (pos >= 0) & (pos < n)

    def any_in(b, lo, hi):  # some flagged position in [lo, hi]
        c = tables.get("counts", lo)
        lo_c, hi_c = lo.clamp(0, n), (hi + 1).clamp(0, n)
        if c.dim() == 1:
            got = c[hi_c] - c[lo_c]
        else:
            bb = torch.as_tensor(b, device=lo.device)
            got = c[bb, hi_c] - c[bb, lo_c]
        return (got > 0) & (hi >= lo)

    return at, any_in, tables.prepare


def global_tokens(is_global: torch.Tensor, causal: bool = True) -> MaskFn:
    """Global tokens (Longformer, arXiv:2004.05150): ``is_global`` bool [n] or [batch, n] over absolute
    positions (positions past its end are not global). A global query sees every key, every query sees
    every global key; with ``causal`` only keys at or before the query."""
    is_global = torch.as_tensor(is_global).bool().cpu()  # copied to each device by ``prepare``
    if is_global.dim() not in (1, 2):
        raise ValueError(f"is_global must be bool [n] or [batch, n], got shape {tuple(is_global.shape)}")
    at, any_in, prepare = _lookup(is_global)

    def pred(b, h, q_idx, kv_idx):
        out = at(b, q_idx) | at(b, kv_idx)
        return out & (kv_idx <= q_idx) if causal else out

    def tiles(b, h, ql, qh, kl, kh):
        if not causal:
            return any_in(b, ql, qh) | any_in(b, kl, kh)
        # a global query q in [max(ql, kl), qh] sees key kl; a global key k in [kl, min(kh, qh)] is seen by qh
        return any_in(b, torch.maximum(ql, kl), qh) | any_in(b, kl, torch.minimum(kh, qh))

    pred.prepare = prepare
    return _with_tiles(pred, "global_tokens" + ("" if causal else "_bidir"), tiles)


def longformer(window: int, is_global: torch.Tensor, dilation=1, causal: bool = True) -> MaskFn:
    """Longformer's pattern (arXiv:2004.05150): a (dilated) window OR global tokens."""
    pred = or_masks(dilated_window(window, dilation, causal=causal), global_tokens(is_global, causal=causal))
    return _with_tiles(pred, f"longformer_{window}" + ("" if causal else "_bidir"))


def bigbird_window(block: int, window_blocks: int, causal: bool = True) -> MaskFn:
    """BigBird's block window (arXiv:2007.14062): query block i sees key blocks j with 0 <= i - j <
    ``window_blocks`` (|i - j| < window_blocks for an encoder: BigBird's 3-block window is 2), and, if causal,
    only keys at or before the query."""
    _check_count("block", block, 1)
    inner = sliding_window(_check_count("window_blocks", window_blocks, 1), causal=causal)

    def pred(b, h, q_idx, kv_idx):
        out = inner(b, h, q_idx // block, kv_idx // block)
        return out & (kv_idx <= q_idx) if causal else out

    def tiles(b, h, ql, qh, kl, kh):
        out = inner.tiles(b, h, ql // block, qh // block, kl // block, kh // block)
        return out & (kl <= qh) if causal else out

    return _with_tiles(pred, f"bigbird_window_{block}x{window_blocks}" + ("" if causal else "_bidir"), tiles)


def bigbird_global(block: int, global_blocks: int, causal: bool = True) -> MaskFn:
    """BigBird's global blocks (arXiv:2007.14062): the first ``global_blocks`` blocks see every key and are
    seen by every query (keys at or before the query if causal)."""
    _check_count("block", block, 1)
    edge = block * _check_count("global_blocks", global_blocks, 0)

    def pred(b, h, q_idx, kv_idx):
        out = (q_idx < edge) | (kv_idx < edge)
        return out & (kv_idx <= q_idx) if causal else out

    def tiles(b, h, ql, qh, kl, kh):
        out = (ql < edge) | (kl < edge)
        return out & (kl <= qh) if causal else out

    return _with_tiles(pred, f"bigbird_global_{block}x{global_blocks}" + ("" if causal else "_bidir"), tiles)


class BigBirdRandom:
    """BigBird's random blocks (arXiv:2007.14062) as a predicate: each (head, query block i) sees
    ``random_blocks`` key blocks drawn among those the window and the global blocks do not cover.

    Causal: drawn among blocks g <= j <= i - window_blocks, from a generator seeded by (seed, layer, head,
    i) alone, so a prefix of a sequence has the pattern of the whole sequence (cached decoding equals the
    full forward). Encoder: drawn among every uncovered block of the sequence, seeded by (seed, layer,
    head, i, number of blocks); ``length`` fixes the sequence length, else it is read off the largest key
    position the predicate is evaluated on (right for ``dense_mask`` of the whole sequence only). Global
    query blocks draw nothing (they see everything already).

    ``heads_per_draw``: consecutive query heads that share one draw (head h uses draw h // heads_per_draw);
    with grouped-query attention, sharing a draw per kv head lets the block-sparse op gather each kv head's
    keys once for exactly the pattern (1: a draw per query head, as in the paper).

    The draws are made on the CPU with Python's ``random`` (string seeds: the same on every machine and
    run) and kept in a table [heads, query blocks, key blocks] that grows as larger positions or heads are
    asked for.
    """

    def __init__(self, block: int, window_blocks: int, global_blocks: int, random_blocks: int, seed: int = 0,
                 layer: int = 0, causal: bool = True, length: int | None = None, heads_per_draw: int = 1) -> None:
        self.block = _check_count("block", block, 1)
        self.window_blocks = _check_count("window_blocks", window_blocks, 1)
        self.global_blocks = _check_count("global_blocks", global_blocks, 0)
        self.random_blocks = _check_count("random_blocks", random_blocks, 0)
        self.seed, self.layer, self.causal = _check_count("seed", seed, 0), _check_count("layer", layer, 0), causal
        self.length = None if length is None else _check_count("length", length, 1)
        self.heads_per_draw = _check_count("heads_per_draw", heads_per_draw, 1)
        self.__name__ = f"bigbird_random_{block}x{random_blocks}" + ("" if causal else "_bidir")
        self.varies_by_head = random_blocks > 0  # a draw per head (group)
        self._table = torch.zeros(0, 0, 0, dtype=torch.bool)
        self._n_blocks = None  # encoder: the number of key blocks the table was drawn for
        self._tables = _Tables()  # the table and its 2-D prefix sums (for tiles), per device

    def row(self, head: int, i: int, n_blocks: int | None = None) -> list[int]:
        """The random key blocks of query block ``i`` of ``head`` (``n_blocks``: the encoder's block count)."""
        import random

        g, w, r = self.global_blocks, self.window_blocks, self.random_blocks
        if r == 0 or i < g:
            return []
        if self.causal:
            pool = list(range(g, i - w + 1))
            key = f"bigbird:{self.seed}:{self.layer}:{head}:{i}"
        else:
            pool = [j for j in range(g, n_blocks) if abs(i - j) >= w]
            key = f"bigbird:{self.seed}:{self.layer}:{head}:{i}:{n_blocks}"
        return sorted(random.Random(key).sample(pool, min(r, len(pool))))

    def table(self, heads: int, n_blocks: int) -> torch.Tensor:
        """bool [heads, n_blocks, n_blocks]: [h, i, j] = key block j is a random block of query block i."""
        if self.causal:
            have_h, have_n = self._table.shape[:2]
            if heads <= have_h and n_blocks <= have_n:
                return self._table[:heads, :n_blocks, :n_blocks]
            heads, n_blocks = max(heads, have_h), max(n_blocks, have_n)
        elif self._n_blocks == n_blocks and heads <= self._table.shape[0]:
            return self._table[:heads]
        t = torch.zeros(heads, n_blocks, n_blocks, dtype=torch.bool)
        for hh in range(heads):
            if hh % self.heads_per_draw:  # shares the draw of the group's first head
                t[hh] = t[hh - hh % self.heads_per_draw]
                continue
            for i in range(n_blocks):
                t[hh, i, self.row(hh // self.heads_per_draw, i, n_blocks)] = True
        self._table, self._n_blocks = t, n_blocks
        c = torch.zeros(heads, n_blocks + 1, n_blocks + 1, dtype=torch.long)
        c[:, 1:, 1:] = t.long().cumsum(1).cumsum(2)
        self._tables.replace(table=t, counts=c)
        return t

    def prepare(self, heads: int, length: int, device=None) -> None:
        """Draw the table for ``heads`` heads and ``length`` positions now, on ``device`` too: a traced
        evaluation (``vmap`` / ``torch.compile`` in FlexAttention) reads no positions, so it uses the table
        as it stands. Eager evaluations still grow it as they need."""
        self.table(heads, -(-(self.length or length) // self.block))
        self._tables.prepare(device=device)

    def _blocks_for(self, h, q_hi, k_hi) -> tuple[int, int]:
        if _tracing(q_hi):  # no position can be read: the table as ``prepare`` drew it
            if not self._table.numel():
                raise RuntimeError("BigBird's random blocks must be drawn before the mask is traced (vmap, "
                                   "torch.compile): call its prepare(heads, length, device) first")
            return self._table.shape[0], self._table.shape[1]
        heads = int(torch.as_tensor(h).max()) + 1
        if self.causal:
            return heads, int(q_hi.max()) // self.block + 1
        length = self.length if self.length is not None else int(k_hi.max()) + 1
        return heads, -(-length // self.block)

    def __call__(self, b, h, q_idx, kv_idx):
        heads, nb = self._blocks_for(h, q_idx, kv_idx)
        self.table(heads, nb)
        t = self._tables.get("table", q_idx)[:heads, :nb, :nb]
        qb, kb = q_idx // self.block, kv_idx // self.block
        inside = (qb >= 0) & (qb < nb) & (kb >= 0) & (kb < t.shape[-1])
        hit = t[torch.as_tensor(h, device=q_idx.device), qb.clamp(0, nb - 1), kb.clamp(0, t.shape[-1] - 1)]
        out = hit & inside
        return out & (kv_idx <= q_idx) if self.causal else out

    def tiles(self, b, h, ql, qh, kl, kh):
        heads, nb = self._blocks_for(h, qh, kh)
        self.table(heads, nb)
        c = self._tables.get("counts", ql)
        n = c.shape[-1] - 1
        hh = torch.as_tensor(h, device=ql.device)
        i0, i1 = (ql // self.block).clamp(0, n), (qh // self.block + 1).clamp(0, n)
        j0, j1 = (kl // self.block).clamp(0, n), (kh // self.block + 1).clamp(0, n)
        got = c[hh, i1, j1] - c[hh, i0, j1] - c[hh, i1, j0] + c[hh, i0, j0]
        out = got > 0
        return out & (kl <= qh) if self.causal else out


def bigbird_random(block: int, window_blocks: int, global_blocks: int, random_blocks: int, seed: int = 0,
                   layer: int = 0, causal: bool = True, length: int | None = None,
                   heads_per_draw: int = 1) -> BigBirdRandom:
    """The random component of ``bigbird`` alone (``BigBirdRandom``)."""
    return BigBirdRandom(block, window_blocks, global_blocks, random_blocks, seed, layer, causal, length,
                         heads_per_draw)


def bigbird(block: int, window_blocks: int, global_blocks: int, random_blocks: int, seed: int = 0,
            layer: int = 0, causal: bool = True, length: int | None = None, heads_per_draw: int = 1) -> MaskFn:
    """BigBird's block-sparse pattern ("Big Bird: Transformers for Longer Sequences", arXiv:2007.14062), in
    blocks of ``block`` positions: ``bigbird_window`` OR ``bigbird_global`` OR ``bigbird_random``."""
    rand = bigbird_random(block, window_blocks, global_blocks, random_blocks, seed, layer, causal, length, heads_per_draw)
    pred = or_masks(bigbird_window(block, window_blocks, causal), bigbird_global(block, global_blocks, causal), rand)
    return _with_tiles(pred, f"bigbird_{block}" + ("" if causal else "_bidir"))
