"""The paged AHA kernels (a server's KV cache in blocks) against the dense reference, request by request:
compiled on a GPU, in Triton's interpreter on the CPU (tiny sizes: the interpreter is slow)."""

import pytest
import torch

pytest.importorskip("triton")  # on the CPU, conftest.py has chosen Triton's interpreter

from allhere.kernels.aha_pack import pack_global  # noqa: E402
from allhere.kernels.aha_paged import paged_aha_attention, refusal  # noqa: E402
from allhere.ops.aha import aha_attention_reference  # noqa: E402

from helpers import rel_err  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = dict(BLOCK_M=16, BLOCK_N=16, SPLIT=16)  # several tiles, key steps and decode splits per request
SENTINEL = 123.0  # what the padding rows of ``out`` hold and must still hold

# A step of a server: (tokens so far, queries of this step, (earlier request, tokens of its prefix shared) or
# None; the whole blocks of that prefix are shared).
MIXED = [(37, 1, None),  # decode of a long context: three splits of 16 keys
         (29, 20, None),  # a chunk of a prefill after 9 cached tokens: two query tiles
         (1, 1, None),  # the first token of a request
         (6, 6, None),  # a whole short prompt
         (9, 0, None),  # no query in this step
         (19, 3, (1, 8)),  # shares its first 8 tokens with request 1
         (30, 1, (0, 20))]  # a decode sharing request 0's first 20 tokens


class Step:
    """One call's inputs: a [2, blocks, block_size, kv_heads, d] cache whose blocks the requests hold in a
    random order (shared prefixes included; every other block and every unused table entry point at
    NaN blocks, which a kernel must never load), q as a view of a wider projection, padding rows."""

    def __init__(self, specs, heads=4, kv_heads=2, d=16, block_size=4, pad=3, p_global=0.35, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.specs, self.heads, self.d, self.block_size = specs, heads, d, block_size
        shares = [share[1] // block_size if share else 0 for _, _, share in specs]  # whole blocks
        own = [-(-n // block_size) - shares[r] for r, (n, _, _) in enumerate(specs)]
        blocks = sum(own) + 3  # spare blocks: NaN
        ids = torch.randperm(blocks, generator=g)
        self.nan_block = int(ids[-1])
        # a server's [2, blocks, block_size, kv_heads, d] cache laid out block-major: k and v are strided views
        self.kv = torch.full((blocks, 2, block_size, kv_heads, d), float("nan")).transpose(0, 1)
        width = max(-(-n // block_size) for n, _, _ in specs) + 2
        self.table = torch.full((len(specs), width), self.nan_block, dtype=torch.int32)
        at = 0
        for r, (n, _, share) in enumerate(specs):
            shared = self.table[share[0], :shares[r]].tolist() if share else []
            mine = ids[at:at + own[r]].tolist()
            at += own[r]
            self.table[r, :len(shared) + len(mine)] = torch.tensor(shared + mine, dtype=torch.int32)
            self.kv[:, mine] = torch.randn(2, len(mine), block_size, kv_heads, d, generator=g)
        counts = torch.tensor([nq for _, nq, _ in specs])
        self.query_start = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32)
        self.seq_lens = torch.tensor([n for n, _, _ in specs], dtype=torch.int32)
        self.tokens = int(counts.sum()) + pad
        qkv = torch.randn(self.tokens, (heads + 2 * kv_heads) * d, generator=g)  # a fused projection
        self.q = qkv[:, :heads * d].view(self.tokens, heads, d)
        self.gate = torch.rand(self.tokens, heads, generator=g) < p_global

    def keys(self, r):
        """Request r's keys and values, contiguous: [1, kv_heads, seq_len, d] each."""
        n = int(self.seq_lens[r])
        pos = torch.arange(n)
        blocks = self.table[r, pos // self.block_size].long()
        return [self.kv[i, blocks, pos % self.block_size].permute(1, 0, 2)[None] for i in (0, 1)]

    def reference(self, window, scale):
        """The dense reference of every request, rows laid as q's: [real tokens, heads, d] fp32."""
        rows = []
        for r in range(len(self.specs)):
            qs, qe = int(self.query_start[r]), int(self.query_start[r + 1])
            if qs == qe:
                continue
            k, v = self.keys(r)
            q = self.q[qs:qe].permute(1, 0, 2)[None]
            out = aha_attention_reference(q.float(), k, v, self.gate[qs:qe].T[None], window, scale)
            rows.append(out[0].permute(1, 0, 2))
        return torch.cat(rows)

    def run(self, window, dtype=torch.float32, kv=None, **kw):
        """The kernel on this step (``kv``: another cache of the same shape), in ``dtype``; ``out`` fp32."""
        kv = (self.kv if kv is None else kv).to(DEVICE, dtype)
        out = torch.full((self.tokens, self.heads, self.d), SENTINEL, device=DEVICE, dtype=dtype)
        q = self.q.to(DEVICE, dtype)
        paged_aha_attention(q, kv[0], kv[1], *(t.to(DEVICE) for t in (self.table, self.query_start, self.seq_lens,
                                                                     self.gate)),
                            window, self.d ** -0.5, out, **kw)
        return out.float().cpu()

    def check(self, out, window, tol):
        real = int(self.query_start[-1])
        assert rel_err(out[:real], self.reference(window, self.d ** -0.5)) < tol
        assert (out[real:] == SENTINEL).all(), "a padding row was written"


@pytest.mark.parametrize("window", [1, 3, 8, 64], ids=lambda w: f"w{w}")
def test_mixed_step_equals_reference(window):
    """Decode and chunked-prefill requests in one call, GQA, shared prefixes, mixed gates, a window of one
    key, one inside the contexts and one past every context."""
    step = Step(MIXED)
    assert step.table[5, :2].tolist() == step.table[1, :2].tolist()  # a shared prefix
    assert not step.q.is_contiguous() and not step.kv[0].is_contiguous()  # read where they lie
    step.check(step.run(window, tiles=SMALL), window, 1e-4)


@pytest.mark.parametrize("pattern", ["all-local", "all-global"])
def test_uniform_gates(pattern):
    step = Step(MIXED, p_global=0.0 if pattern == "all-local" else 1.0, seed=1)
    step.check(step.run(5, tiles=SMALL), 5, 1e-4)


def test_default_setting_and_blocks_larger_than_a_key_step():
    """The setting the interpreter (and ``autotune.pinned()``) gives by default, with cache blocks of 32
    tokens: a block spans two key steps of 16 in the small setting, and half a default step of 64."""
    step = Step(MIXED, heads=2, kv_heads=1, block_size=32, seed=2)
    step.check(step.run(6), 6, 1e-4)
    step.check(step.run(6, tiles=SMALL), 6, 1e-4)


def test_block_size_that_is_not_a_power_of_two():
    step = Step(MIXED, heads=2, kv_heads=1, block_size=6, seed=6)
    step.check(step.run(5, tiles=SMALL), 5, 1e-4)


def test_host_hints():
    """max_seq_len bounds the decode splits; max_query_len 1 (a pure decode step) skips the prefill kernel."""
    decodes = [(37, 1, None), (5, 1, None), (22, 1, (0, 12))]
    step = Step(decodes, seed=3)
    step.check(step.run(4, tiles=SMALL, max_seq_len=37, max_query_len=1), 4, 1e-4)
    mixed = Step(MIXED, seed=3)
    mixed.check(mixed.run(4, tiles=SMALL, max_seq_len=37, max_query_len=20), 4, 1e-4)
    step.run(4, tiles=SMALL, max_seq_len=20, max_query_len=1)  # a hint under a length: that call is wrong, but
    step.check(step.run(4, tiles=SMALL, max_seq_len=37, max_query_len=1), 4, 1e-4)  # it leaves no count behind


def test_local_rows_never_load_keys_before_their_window():
    """The point of AHA: a local row costs its window, not its prefix. With every gate local, the cache
    blocks before the windows' first key step are overwritten with NaN: a kernel that loaded any of them
    (even masked out afterwards) would return NaN."""
    step = Step([(64, 16, None), (64, 1, None)], p_global=0.0, seed=4)
    window = 4  # prefill rows at 48..63 read from key 45 (its step of 16 starts at 32); the decode from 60
    poisoned = step.kv.clone()
    for r, keep_from in ((0, 32), (1, 48)):
        poisoned[:, step.table[r, :keep_from // step.block_size].long()] = float("nan")
    out = step.run(window, kv=poisoned, tiles=SMALL)
    assert not out.isnan().any()
    step.check(out, window, 1e-4)


def test_half_precision():
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    step = Step(MIXED, seed=5)
    step.check(step.run(7, dtype=dtype, tiles=SMALL), 7, 2e-2)


def test_bad_arguments_are_named():
    step = Step(MIXED[:2])
    q, kv = step.q, step.kv
    args = (step.table, step.query_start, step.seq_lens, step.gate)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="window"):
        paged_aha_attention(q, kv[0], kv[1], *args, 0, 1.0, out)
    with pytest.raises(ValueError, match="multiple"):
        paged_aha_attention(q[:, :3], kv[0], kv[1], *args, 2, 1.0, out[:, :3])
    with pytest.raises(ValueError, match="query_start"):
        paged_aha_attention(q, kv[0], kv[1], step.table, step.query_start[:-1], *args[2:], 2, 1.0, out)
    with pytest.raises(ValueError, match="gate"):
        paged_aha_attention(q, kv[0], kv[1], *args[:3], step.gate[:-1], 2, 1.0, out)
    wide = torch.zeros(q.shape[0], q.shape[1], 256)  # a head dim past the rule (``refusal``): the kernels' too
    with pytest.raises(ValueError, match="head dim 256: the paged kernels take a power of two from 16 to 128"):
        paged_aha_attention(wide, *(torch.zeros(*c.shape[:-1], 256) for c in kv), *args, 2, 1.0, wide)


def test_one_rule_for_the_kernels_and_a_served_layer():
    """``refusal``: what ``paged_aha_attention`` checks and ``allhere.ops.paged.aha_triton.kernel_refusal`` asks."""
    from allhere.ops.paged.aha_triton import kernel_refusal

    assert refusal(16) is None and refusal(128) is None
    for d in (8, 96, 256):
        assert refusal(d).startswith(f"head dim {d}:")
        assert kernel_refusal(d, torch.device("cuda")) == refusal(d)
    assert "soft-capped" in refusal(64, softcap=30.0) and "sink logits" in refusal(64, sinks=True)


def test_packing_by_head_of_a_token_major_gate():
    """The global pass packs a [tokens, heads] gate per head (``pack_global`` of its transpose): each head's
    running count of global rows up to each token, and its global rows in order."""
    gate = torch.tensor([[1, 0], [0, 0], [1, 1], [1, 0]], dtype=torch.bool)
    rows, cum = (t.cpu() for t in pack_global(gate.to(DEVICE).T[None]))
    assert cum.T.tolist() == [[1, 0], [1, 0], [2, 1], [3, 1]]
    assert rows[0, :3].tolist() == [0, 2, 3] and rows[1, :1].tolist() == [2]
