"""DAR (Dual Dimensionality for Local and Global Attention, arXiv:2606.18587): the reference op against a
loop, equivalences, cached decoding, cache memory."""

import math

import pytest
import torch

from allhere import ConfigError, DARConfig, Decoder, ModelConfig, swap_mechanism
from allhere.ops.dar import dar_attention_reference, dar_attention_torch

from helpers import rel_err


def loop_dar(q, kn, vn, kf, vf, w):
    b, h, lq, d = q.shape
    lk, g = kn.shape[2], h // kn.shape[1]
    out = torch.zeros(b, h, lq, d, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(lq):
                pos = lk - lq + i
                keys = torch.stack([(kn if pos - j < w else kf)[bi, hi // g, j] for j in range(pos + 1)]).double()
                vals = torch.stack([(vn if pos - j < w else vf)[bi, hi // g, j] for j in range(pos + 1)]).double()
                out[bi, hi, i] = torch.softmax(keys @ q[bi, hi, i].double() / math.sqrt(d), 0) @ vals
    return out


@pytest.mark.parametrize("w", [0, 1, 3, 100])
@pytest.mark.parametrize("lq,lk", [(12, 12), (1, 12), (4, 12)])
def test_reference_equals_loop(w, lq, lk):
    q = torch.randn(2, 4, lq, 8)
    kn, vn, kf, vf = (torch.randn(2, 2, lk, 8) for _ in range(4))
    assert rel_err(dar_attention_reference(q, kn, vn, kf, vf, w), loop_dar(q, kn, vn, kf, vf, w)) < 1e-5


@pytest.mark.parametrize("w", [0, 1, 5, 100])
@pytest.mark.parametrize("lq,lk,kv_heads", [(19, 19, 4), (1, 19, 2), (6, 19, 1)])
@pytest.mark.parametrize("block", [1, 4, 256])
def test_blocked_equals_reference_with_gradients(w, lq, lk, kv_heads, block):
    q = torch.randn(2, 4, lq, 8, requires_grad=True)
    kv = [torch.randn(2, kv_heads, lk, 8, requires_grad=True) for _ in range(4)]
    fast = dar_attention_torch(q, *kv, w, block=block)
    ref = dar_attention_reference(q, *kv, w)
    assert rel_err(fast, ref) < 1e-5
    up = torch.randn_like(ref)
    g_fast = torch.autograd.grad((fast * up).sum(), [q, *kv])
    g_ref = torch.autograd.grad((ref * up).sum(), [q, *kv])
    for a, b in zip(g_fast, g_ref):
        assert rel_err(a, b) < 1e-5


def test_blocked_with_padding_mask_equals_reference():
    q = torch.randn(2, 4, 10, 8)
    kv = [torch.randn(2, 2, 10, 8) for _ in range(4)]
    mask = torch.ones(2, 1, 10, 10, dtype=torch.bool)
    mask[0, ..., :3] = False  # left padding of 3 tokens in sequence 0: its first 3 queries see nothing
    fast, ref = dar_attention_torch(q, *kv, 4, mask=mask, block=3), dar_attention_reference(q, *kv, 4, mask=mask)
    assert torch.isfinite(fast).all() and rel_err(fast, ref) < 1e-5
    assert fast[0, :, :3].abs().max() == 0
    with pytest.raises(ValueError, match="mask must be"):
        dar_attention_torch(q, *kv, 4, mask=mask[:, :, :5])


def test_blocked_bf16_close_to_fp32_reference():
    q = torch.randn(1, 4, 64, 16)
    kv = [torch.randn(1, 2, 64, 16) for _ in range(4)]
    fast = dar_attention_torch(q.bfloat16(), *(t.bfloat16() for t in kv), 8, block=16)
    assert fast.dtype == torch.bfloat16 and rel_err(fast.float(), dar_attention_reference(q, *kv, 8)) < 2e-2


def base_model(kv_heads=2):
    return Decoder(ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=kv_heads)).eval()


@pytest.mark.parametrize("cfg", [DARConfig(window=4, d_down=32), DARConfig(window=0, d_down=32),
                                 DARConfig(window=64, d_down=8)], ids=["no-bottleneck", "no-bottleneck-w0", "w>=seq"])
def test_equivalences_with_vanilla(cfg):
    """d_down = d (modules present, W_up W_down = I at init) or a window covering everything = vanilla."""
    base = base_model()
    ids = torch.randint(0, 50, (2, 21))
    with torch.no_grad():
        assert rel_err(swap_mechanism(base, cfg).eval()(ids).logits, base(ids).logits) < 1e-5


def test_bottleneck_changes_the_far_keys_only():
    base = base_model()
    ids = torch.randint(0, 50, (2, 21))
    dar = swap_mechanism(base, DARConfig(window=4, d_down=8)).eval()
    uniform = swap_mechanism(base, DARConfig(window=0, d_down=8)).eval()
    with torch.no_grad():
        ref, a, u = base(ids).logits, dar(ids).logits, uniform(ids).logits
    assert rel_err(a[:, :4], ref[:, :4]) < 1e-5  # the first w tokens see only near keys
    assert rel_err(a, ref) > 1e-3 and rel_err(u, ref) > rel_err(a, ref)


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("w,d_down", [(0, 8), (1, 8), (4, 8), (4, 32)])
def test_cached_decoding_equals_full_forward(w, d_down, kv_heads):
    model = swap_mechanism(base_model(kv_heads), DARConfig(window=w, d_down=d_down)).eval()
    ids = torch.randint(0, 50, (2, 19))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache()
        steps = torch.cat([model(ids[:, :7], cache=cache).logits]
                          + [model(ids[:, t:t + 1], cache=cache).logits for t in range(7, 19)], 1)
    assert rel_err(steps, full) < 1e-5
    layer = cache.layers[0]
    assert len(layer) == 19 and (layer.k is None if w == 0 else layer.k.shape[2] == w)
    assert layer.latent.shape[-1] == d_down
    assert [w.shape for w in layer.absorbed] == [(kv_heads * 8, d_down)] * 2  # W_up absorbed into W_K, W_V


def test_dar_cache_at_32k_is_at_most_15_percent_of_vanilla():
    from allhere.mechanisms.dar import cache_bytes

    dar, vanilla = cache_bytes(32768, 1024, 16, 16, 256, 128, torch.float16)
    assert dar / vanilla <= 0.15


def test_dar_config_errors_and_training_gradients():
    with pytest.raises(ConfigError, match="DARConfig.window"):
        DARConfig(window=-1)
    with pytest.raises(ConfigError, match="DARConfig.d_down"):
        DARConfig(d_down=0)
    with pytest.raises(ConfigError, match="DARConfig.d_down = 64"):
        ModelConfig(d_model=32, n_heads=4, mechanism=DARConfig(d_down=64))
    model = swap_mechanism(base_model(), DARConfig(window=3, d_down=8)).train()
    model(torch.randint(0, 50, (2, 12))).logits.square().mean().backward()
    assert model.blocks[0].attn.mechanism.down.weight.grad.abs().sum() > 0
    assert model.blocks[0].attn.mechanism.up.weight.grad.abs().sum() > 0
