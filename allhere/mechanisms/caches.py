"""The KV caches most mechanisms decode with: every key (full attention, AHA), the last ``window``
(sliding window), or the keys a sparse pattern may still read (sinks, Longformer).

Writes are in place. A cache holds a buffer with room for more tokens than it keeps and writes each
call's keys and values into it, so a decode step copies its own token, not the whole cache:

- ``KVCache`` grows by doubling its capacity when full (amortised O(1) copy per token; O(log N)
  reallocations for N tokens). ``reserve(tokens)`` sizes it once when the final length is known.
- ``RollingKVCache`` keeps the window in a buffer of ``window + slack`` tokens and moves it back to the
  front only when the buffer's end is reached (``window`` keys copied every ``slack`` tokens).
- ``PatternKVCache`` drops keys lazily: keys no later query reads stay in the buffer (they are returned
  with their positions, and the pattern's mask excludes them) until it is full; then the kept keys are
  copied into a new buffer sized to them plus a quarter (amortised O(1) per token).

**What ``update`` returns.** The keys and values to attend to, in position order as before, usually
*views into the buffer*. They are valid until this cache's next ``update`` / ``update_at`` (or batch
reorder): a later call may overwrite the memory they show (the rolling cache moving its window to the
front). Use them within the call and keep no reference across calls -- every mechanism updates its
layer's cache once per forward and reads the result in that same forward, so nothing it holds is ever
overwritten. A caller that must keep them longer clones them.

**Autograd.** While autograd records (grad enabled and a new key, value or the buffer requires grad),
the caches concatenate out of place as before, so tensors saved for a backward are never modified in
place; under ``torch.no_grad()`` / ``torch.inference_mode()`` (``generate``, evaluation) they write in
place. A buffer made in inference mode and continued outside it is copied once into a normal tensor.

**Memory.** ``nbytes()`` reports the storage the cache keeps alive (its capacity, the spare room
included); ``used_nbytes()`` the bytes of the tokens it keeps; ``capacity`` the tokens that fit.
"""

from __future__ import annotations

import torch

GRAIN = 64  # capacities are multiples of this many tokens


def round_up(n: int, grain: int = GRAIN) -> int:
    return max(grain, -(-n // grain) * grain)


def recording(*tensors) -> bool:
    """Whether autograd records an operation on these tensors (then the caches work out of place)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def writable(buf: torch.Tensor | None) -> bool:
    """A buffer this cache may write into in place: no autograd history, and not an inference tensor
    outside inference mode (PyTorch refuses that)."""
    return (buf is not None and not buf.requires_grad
            and not (buf.is_inference() and not torch.is_inference_mode_enabled()))


def check_rows(buf: torch.Tensor | None, x: torch.Tensor, dim: int) -> None:
    """New tokens must match the cached ones in every dim before ``dim`` (batch, heads): a copy into the
    buffer would broadcast where torch.cat refused."""
    if buf is not None and buf.shape[:dim] != x.shape[:dim]:
        raise ValueError(f"the cache holds {tuple(buf.shape[:dim])} rows x heads, the new tokens have "
                         f"{tuple(x.shape[:dim])}")


def storage_bytes(t: torch.Tensor | None) -> int:
    """Bytes of the storage behind ``t`` (a view keeping a larger tensor alive counts it all)."""
    return 0 if t is None else t.untyped_storage().nbytes()


def view_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class GrowingTensor:
    """A tensor that grows along ``dim`` in place: a buffer whose capacity doubles when full (rounded up to
    ``GRAIN``), so appending N elements copies O(N) in all and reallocates O(log N) times. ``view()`` is
    the used part; ``append`` returns it (see the module docstring for how long it stays valid)."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.data: torch.Tensor | None = None  # the buffer; its first ``length`` entries along ``dim`` are used
        self.length = 0
        self.reallocations = 0  # buffers allocated so far (the first one included)
        self.min_capacity = 0  # set by ``reserve``

    @property
    def capacity(self) -> int:
        return 0 if self.data is None else self.data.shape[self.dim]

    def view(self) -> torch.Tensor | None:
        return None if self.data is None else self.data.narrow(self.dim, 0, self.length)

    def append(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[self.dim]
        end = self.length + n
        if recording(x, self.data):  # out of place, as torch.cat always did: nothing saved is modified
            self.data = x if self.data is None or self.length == 0 else torch.cat([self.view(), x], self.dim)
            self.length = end
            return self.data
        check_rows(self.data, x, self.dim)
        if end > self.capacity or not writable(self.data):
            self.reallocate(end, x)
        self.data.narrow(self.dim, self.length, n).copy_(x)
        self.length = end
        return self.view()

    def reallocate(self, needed: int, like: torch.Tensor) -> None:
        """A new buffer of at least ``needed`` (and twice the old capacity), holding the used part."""
        cap = round_up(max(needed, 2 * self.capacity, self.min_capacity))
        shape = list(like.shape)
        shape[self.dim] = cap
        new = like.new_empty(shape)
        if self.length:
            new.narrow(self.dim, 0, self.length).copy_(self.view())
        self.data = new
        self.reallocations += 1

    def reserve(self, n: int) -> None:
        """Room for ``n`` elements in all: allocated now when the buffer exists, else at the first append."""
        self.min_capacity = n
        if self.data is not None and n > self.capacity and not recording(self.data):
            self.reallocate(n, self.data)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` elements (the rest of the buffer becomes spare room)."""
        self.length = min(self.length, length)

    def map(self, fn) -> None:
        """Replace the buffer by ``fn(buffer)`` (a selection along another dim: beam search)."""
        if self.data is not None:
            self.data = fn(self.data)

    def clear(self) -> None:
        self.data, self.length = None, 0

    def nbytes(self) -> int:
        return storage_bytes(self.data)

    def used_nbytes(self) -> int:
        return view_bytes(self.view())


class KVCache:
    """Keeps every key and value seen so far: [batch, kv_heads, tokens, dim], in buffers that double their
    capacity when full (see the module docstring). ``k``, ``v``: the keys and values so far (views)."""

    def __init__(self) -> None:
        self._k, self._v = GrowingTensor(2), GrowingTensor(2)

    k = property(lambda self: self._k.view())
    v = property(lambda self: self._v.view())

    def __len__(self) -> int:
        return self._k.length

    @property
    def capacity(self) -> int:
        """Tokens the buffers hold before the next reallocation."""
        return self._k.capacity

    @property
    def reallocations(self) -> int:
        """Times the buffers were (re)allocated: O(log tokens) when filled a token at a time."""
        return self._k.reallocations

    def nbytes(self) -> int:
        """Bytes of the storage the cache keeps alive: its capacity, the spare room included."""
        return self._k.nbytes() + self._v.nbytes()

    def used_nbytes(self) -> int:
        """Bytes of the keys and values kept (the tokens so far)."""
        return self._k.used_nbytes() + self._v.used_nbytes()

    def reserve(self, tokens: int) -> None:
        """Room for ``tokens`` tokens in all (e.g. prompt + new tokens of a generation): no reallocation
        until then."""
        self._k.reserve(tokens)
        self._v.reserve(tokens)

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens' k, v and return all keys and values to attend to (views, see the module
        docstring)."""
        return self._k.append(k), self._v.append(v)

    def map_rows(self, fn) -> None:
        """Apply ``fn`` to the batch dimension of the buffers (beam search reordering, batch selection)."""
        self._k.map(fn)
        self._v.map(fn)

    def truncate(self, tokens: int) -> None:
        """Keep the first ``tokens`` tokens (assisted generation rolling back rejected drafts)."""
        self._k.truncate(tokens)
        self._v.truncate(tokens)


class RollingKVCache:
    """Keeps only the ``window`` most recent keys and values: what any later query may still read.

    They live in a buffer of ``window + slack`` tokens (slack = max(16, window / 4)): a call writes its
    tokens after the kept ones and the window's start moves forward; when the buffer's end is reached,
    the window is moved back to the front (``window`` keys copied once every ``slack`` tokens). A call
    with more new tokens than fit (a long prefill) gets a fresh concatenation, and the buffer keeps its
    last ``window``. Storage stays ``window + slack`` tokens however long generation runs.
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self.slack = max(16, window // 4)
        self.dropped = 0  # positions no longer kept: the absolute position of the first kept key
        self._k: torch.Tensor | None = None  # [b, kv_heads, window + slack, dim]
        self._v: torch.Tensor | None = None
        self._start = 0  # buffer index of the first kept key
        self._n = 0  # keys kept
        self.moves = 0  # times the window was moved back to the front of the buffer

    k = property(lambda self: None if self._k is None else self._k[:, :, self._start:self._start + self._n])
    v = property(lambda self: None if self._v is None else self._v[:, :, self._start:self._start + self._n])

    def __len__(self) -> int:
        return self._n

    @property
    def capacity(self) -> int:
        return 0 if self._k is None else self._k.shape[2]

    def nbytes(self) -> int:
        """Bytes of the storage kept alive: the whole buffer (``window + slack`` tokens once allocated)."""
        return storage_bytes(self._k) + storage_bytes(self._v)

    def used_nbytes(self) -> int:
        """Bytes of the keys and values kept (at most ``window`` tokens)."""
        return view_bytes(self.k) + view_bytes(self.v)

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the kept keys followed by the new ones (contiguous positions, from ``dropped`` before the
        call), then keep the last ``window``. Views into the buffer when the new tokens fit in it (see the
        module docstring: valid until the next update)."""
        n, m = k.shape[2], self._n
        total = m + n
        if recording(k, v, self._k, self._v):
            k_all, v_all = (new if m == 0 else torch.cat([old, new], dim=2) for old, new in ((self.k, k), (self.v, v)))
            over = max(0, total - self.window)
            # A slice would keep the whole longer tensor (e.g. a prefill's) alive: keep a copy of the window.
            self._k, self._v = (t[:, :, over:].clone() if over else t for t in (k_all, v_all))
            self._start, self._n = 0, total - over
            self.dropped += over
            return k_all, v_all
        check_rows(self._k, k, 2)
        if not (writable(self._k) and writable(self._v)):
            self._allocate(k, v)
        cap = self.capacity
        if total <= cap:
            if self._start + total > cap:
                self._move_to_front()
            s = self._start
            self._k[:, :, s + m:s + total].copy_(k)
            self._v[:, :, s + m:s + total].copy_(v)
            k_all, v_all = self._k[:, :, s:s + total], self._v[:, :, s:s + total]
        else:  # more new tokens than the buffer holds: a fresh tensor for this call
            k_all, v_all = (new if m == 0 else torch.cat([old, new], dim=2) for old, new in ((self.k, k), (self.v, v)))
        over = max(0, total - self.window)
        self.dropped += over
        if total <= cap:
            self._start += over
        else:
            keep = total - over
            self._k[:, :, :keep].copy_(k_all[:, :, over:])
            self._v[:, :, :keep].copy_(v_all[:, :, over:])
            self._start = 0
        self._n = total - over
        return k_all, v_all

    def _allocate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """A buffer of ``window + slack`` tokens holding the kept keys, if any, at its front."""
        cap = self.window + self.slack
        new_k = k.new_empty((*k.shape[:2], cap, *k.shape[3:]))
        new_v = v.new_empty((*v.shape[:2], cap, *v.shape[3:]))
        if self._n:
            new_k[:, :, :self._n].copy_(self.k)
            new_v[:, :, :self._n].copy_(self.v)
        self._k, self._v, self._start = new_k, new_v, 0

    def _move_to_front(self) -> None:
        s, m = self._start, self._n
        for buf in (self._k, self._v):
            src = buf[:, :, s:s + m]
            buf[:, :, :m].copy_(src if s >= m else src.clone())  # overlapping ranges: through a copy
        self._start = 0
        self.moves += 1

    def map_rows(self, fn) -> None:
        """Apply ``fn`` to the batch dimension of the buffers (beam search reordering, batch selection)."""
        if self._k is not None:
            self._k, self._v = fn(self._k), fn(self._v)


class PatternKVCache:
    """Keeps the keys a sparse causal pattern may still read: the last ``span`` positions, the positions
    ``fixed(positions)`` marks (attention sinks, global tokens), and every key while a query that reads
    the whole past may still come (``keep_all_until``: the last such query's position, -1 = none).

    The kept keys are not contiguous positions: ``update_at`` returns their absolute positions too
    (``positions``), and ``update`` the keys alone. Keys are dropped lazily (see the module docstring):
    the buffer may also hold keys no later query reads, returned with their positions, which the
    pattern's mask excludes; ``len()`` counts only the kept ones, ``held`` all of them, ``compact()``
    drops the others now. A call of ``GRAIN`` tokens or more (a prefill) is followed by a compaction,
    so the stale keys stay below a quarter of the kept ones plus ``GRAIN``. Memory: about 1.25 x
    (``span`` + the fixed positions seen), once the last whole-past query has passed.
    """

    def __init__(self, span: int, fixed=None, keep_all_until: int = -1) -> None:
        self.span = span
        self.fixed = fixed
        self.keep_all_until = keep_all_until
        self.seen = 0  # tokens added so far: the next token's absolute position
        self._k: torch.Tensor | None = None  # [b, kv_heads, capacity, dim]
        self._v: torch.Tensor | None = None
        self._pos: torch.Tensor | None = None  # int64 [capacity] absolute positions of the held keys
        self._n = 0  # keys held (kept and stale)
        self.compactions = 0

    k = property(lambda self: None if self._k is None else self._k[:, :, :self._n])
    v = property(lambda self: None if self._v is None else self._v[:, :, :self._n])
    positions = property(lambda self: None if self._pos is None else self._pos[:self._n])

    @property
    def held(self) -> int:
        """Keys in the buffer: the kept ones and those dropped lazily."""
        return self._n

    def __len__(self) -> int:
        """Keys a later query may still read."""
        return 0 if self._pos is None else int(self._keep(self.positions, self.seen).sum())

    @property
    def capacity(self) -> int:
        return 0 if self._k is None else self._k.shape[2]

    def nbytes(self) -> int:
        """Bytes of the storage kept alive: the buffers' capacity, positions included."""
        return storage_bytes(self._k) + storage_bytes(self._v) + storage_bytes(self._pos)

    def used_nbytes(self) -> int:
        """Bytes of the keys held (kept and not yet dropped), positions included."""
        return view_bytes(self.k) + view_bytes(self.v) + view_bytes(self.positions)

    def _keep(self, pos: torch.Tensor, seen: int) -> torch.Tensor:
        """Which keys at ``pos`` a query at position ``seen`` or later may read."""
        if seen <= self.keep_all_until:
            return torch.ones_like(pos, dtype=torch.bool)
        keep = pos >= seen - self.span
        if self.fixed is not None:
            keep |= self.fixed(pos)
        return keep

    def update_at(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Add the new tokens; return the held keys and values followed by the new ones, and their absolute
        positions (increasing); keys no later query reads may be among them (the pattern masks them)."""
        n = k.shape[2]
        new = torch.arange(self.seen, self.seen + n, device=k.device)
        if recording(k, v, self._k, self._v):
            return self._update_out_of_place(k, v, new)
        check_rows(self._k, k, 2)
        if not (writable(self._k) and writable(self._v)):
            self._compact(self.seen, n, k, v)
        elif self._n + n > self.capacity:
            self._compact(self.seen, n)
        m = self._n
        self._k[:, :, m:m + n].copy_(k)
        self._v[:, :, m:m + n].copy_(v)
        self._pos[m:m + n].copy_(new)
        self._n = m + n
        out = self.k, self.v, self.positions
        self.seen += n
        if n >= GRAIN:  # a prefill: drop now what no query reads (into a new buffer: ``out`` stays valid)
            self._compact(self.seen, 0)
        return out

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k_all, v_all, _ = self.update_at(k, v)
        return k_all, v_all

    def compact(self) -> None:
        """Drop now the keys no later query reads (into a buffer sized to the rest)."""
        if self._k is not None:
            self._compact(self.seen, 0)

    def _compact(self, seen: int, n: int, k=None, v=None) -> None:
        """Copy the keys a query at ``seen`` or later may read into a new buffer with room for ``n`` more
        and a quarter to spare (``k``, ``v``: the new tokens, whose shapes the first buffer takes)."""
        if self._k is None:
            idx = torch.zeros(0, dtype=torch.long, device=k.device)
        else:
            idx = self._keep(self.positions, seen).nonzero().flatten()
        kept = idx.numel()
        cap = round_up(kept + n + max(GRAIN, (kept + n) // 4))
        pad = idx.new_zeros(cap - kept)  # index 0 for the spare room: one copy builds the whole buffer
        if self._k is None:
            self._k = k.new_empty((*k.shape[:2], cap, *k.shape[3:]))
            self._v = v.new_empty((*v.shape[:2], cap, *v.shape[3:]))
            self._pos = torch.empty(cap, dtype=torch.long, device=k.device)
        else:
            full = torch.cat([idx, pad])  # into a new buffer: the views returned before stay valid
            self._k, self._v = self._k.index_select(2, full), self._v.index_select(2, full)
            self._pos = self._pos.index_select(0, full)
        self._n = kept
        self.compactions += 1

    def _update_out_of_place(self, k, v, new):
        """While autograd records: concatenate and select copies, as before (nothing saved is modified)."""
        k_all = k if self._n == 0 else torch.cat([self.k, k], dim=2)
        v_all = v if self._n == 0 else torch.cat([self.v, v], dim=2)
        pos = new if self._n == 0 else torch.cat([self.positions, new])
        self.seen += k.shape[2]
        keep = self._keep(pos, self.seen)
        if bool(keep.all()):
            self._k, self._v, self._pos = k_all, v_all, pos
        else:  # copies: a view would keep the longer tensors alive
            idx = keep.nonzero().flatten()
            self._k, self._v, self._pos = k_all.index_select(2, idx), v_all.index_select(2, idx), pos[idx]
        self._n = self._pos.numel()
        return k_all, v_all, pos

    def map_rows(self, fn) -> None:
        """Apply ``fn`` to the batch dimension of the buffers (beam search reordering, batch selection)."""
        if self._k is not None:
            self._k, self._v = fn(self._k), fn(self._v)
