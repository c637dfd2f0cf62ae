"""allhere's attention over a paged KV cache (allhere.serve.paged; what vLLM serving runs for sinks, the other
masked patterns and DAR): equal to the dense references, for requests split into chunks over scattered blocks.
No vLLM needed."""

from __future__ import annotations

import pytest
import torch

import allhere as ah
from allhere import registry
from allhere.ops.dar import dar_attention_reference
from allhere.ops.full import pattern_attention_reference
from allhere.serve.paged import dar_choice, masked_choice, paged_attention, paged_view, write

HEADS, KV_HEADS, D, BS = 4, 2, 8, 4  # 2 query heads per kv head; blocks of 4 tokens


def _serve(lengths, chunks, sets, choose, gen):
    """Fill a paged cache request by request in ``chunks`` steps of several requests each (as vLLM
    schedules: a step holds the next tokens of every request), attending after each write; returns each
    request's outputs over all its tokens [length, heads, d], and its q and key sets [length, kv_heads, d]."""
    blocks_needed = sum(-(-n // BS) for n in lengths)
    views = [paged_view(torch.zeros(blocks_needed + 3, KV_HEADS, BS, 2 * D), BS, KV_HEADS, D) for _ in range(sets)]
    order = torch.randperm(blocks_needed + 3, generator=gen)[:blocks_needed]  # scattered, in no order
    table, used = torch.full((len(lengths), max(-(-n // BS) for n in lengths)), -1, dtype=torch.int32), 0
    for r, n in enumerate(lengths):
        table[r, : -(-n // BS)] = order[used: used + -(-n // BS)]
        used += -(-n // BS)
    data = [(torch.randn(n, HEADS, D, generator=gen), [(torch.randn(n, KV_HEADS, D, generator=gen),
                                                         torch.randn(n, KV_HEADS, D, generator=gen)) for _ in range(sets)])
            for n in lengths]
    outs = [torch.zeros(n, HEADS, D) for n in lengths]
    done = [0] * len(lengths)
    for step in range(chunks):
        rows, starts, lens = [], [0], []
        for r, n in enumerate(lengths):
            take = n - done[r] if step == chunks - 1 else min(n - done[r], (n + chunks - 1) // chunks)
            rows.append((r, done[r], done[r] + take))
            starts.append(starts[-1] + take)
            lens.append(done[r] + take)
            done[r] += take
        q = torch.cat([data[r][0][a:b] for r, a, b in rows])
        slots = torch.cat([torch.tensor([int(table[r, p // BS]) * BS + p % BS for p in range(a, b)], dtype=torch.long)
                           for r, a, b in rows])
        for i, view in enumerate(views):
            k = torch.cat([data[r][1][i][0][a:b] for r, a, b in rows])
            v = torch.cat([data[r][1][i][1][a:b] for r, a, b in rows])
            write(view, torch.cat([slots, torch.tensor([-1])]), torch.cat([k, k[:1]]), torch.cat([v, v[:1]]))  # + padding
        out = torch.full((q.shape[0] + 1, HEADS, D), 7.0)
        paged_attention(q, views, torch.tensor(starts), torch.tensor(lens), table, choose, D ** -0.5, out)
        assert bool((out[-1] == 7.0).all())  # the padding row is left alone
        for (r, a, b), s0, s1 in zip(rows, starts, starts[1:]):
            outs[r][a:b] = out[s0:s1]
    return outs, data


def _bhld(x):
    return x.transpose(0, 1)[None]


@pytest.mark.parametrize("cfg", [ah.SinksConfig(window=3, n_sinks=2), ah.DilatedConfig(window=6, dilation=(1, 2, 1, 3)),
                                 ah.LongformerConfig(window=3, global_first=2, global_positions=(7,)),
                                 ah.BigBirdConfig(block=2, window_blocks=1, global_blocks=1, random_blocks=1)])
def test_masked_patterns_equal_dense_reference(cfg):
    gen = torch.Generator().manual_seed(0)
    pred = registry.from_dict(registry.to_dict(cfg)).mask_fn(None)
    outs, data = _serve([13, 5, 9], 3, 1, masked_choice(pred), gen)
    for out, (q, [(k, v)]) in zip(outs, data):
        want = pattern_attention_reference(_bhld(q), _bhld(k), _bhld(v), pred, scale=D ** -0.5)[0].transpose(0, 1)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 3, 20])
def test_dar_equals_reference(window):
    gen = torch.Generator().manual_seed(1)
    outs, data = _serve([11, 6], 2, 2, dar_choice(window), gen)
    for out, (q, [(kn, vn), (kf, vf)]) in zip(outs, data):
        want = dar_attention_reference(*map(_bhld, (q, kn, vn, kf, vf)), window, scale=D ** -0.5)[0].transpose(0, 1)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_view_refuses_partial_blocks():
    with pytest.raises(ValueError, match="whole blocks"):
        paged_view(torch.zeros(10), BS, KV_HEADS, D)
