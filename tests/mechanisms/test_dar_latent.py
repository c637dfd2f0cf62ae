"""Mechanism ``dar_latent`` in allhere's decoder: configuration errors, initialisation from the host (exact at full
rank, the 2-norm pair choice), the cache it decodes with (a latent + rotated key per token, the window's K/V),
decoding through the absorbed path, and DAR's two training stages. (The registry-wide contract -- cached decoding
in chunks, GQA, packed documents, round trips, the reference backend -- runs it from tests/mechanism_examples.py.)"""

import pytest
import torch

from allhere import ConfigError, DARLatentConfig, Decoder, FullConfig, ModelConfig, swap_mechanism
from allhere.config import TrainConfig
from allhere.mechanisms.base import AttentionDims, mechanism_layers
from allhere.mechanisms.dar_latent_init import calibrate, init_from_host
from allhere.ops.dar_latent import absorbed, dispatch, rebuilt
from allhere.train import train

from helpers import rel_err

VOCAB, D, HEADS, KV, HD = 61, 32, 4, 2, 8


def host(seed=0, kv_heads=KV):
    """A full-attention decoder whose attention is peaked (q, k scaled up from the 0.02 init), as trained ones are."""
    torch.manual_seed(seed)
    model = Decoder(ModelConfig(vocab_size=VOCAB, d_model=D, n_layers=2, n_heads=HEADS, n_kv_heads=kv_heads,
                                mechanism=FullConfig())).eval()
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn.q_proj.weight.mul_(6)
            blk.attn.k_proj.weight.mul_(6)
    return model


def latent_model(cfg, base=None, run=None):
    base = base or host()
    model = swap_mechanism(base, cfg).eval()
    return init_from_host(model, run)


def test_config_errors_name_the_field():
    for bad, field in (({"window": -1}, "window"), ({"d_down": 0}, "d_down"), ({"rope_pairs": -1}, "rope_pairs")):
        with pytest.raises(ConfigError, match=f"DARLatentConfig.{field}"):
            DARLatentConfig(**bad)
    with pytest.raises(ConfigError, match="DARLatentConfig.d_down = 64 is invalid: expected <= d_model = 32"):
        ModelConfig(d_model=32, n_heads=4, mechanism=DARLatentConfig(d_down=64))
    with pytest.raises(ConfigError, match="rope_pairs = 5 is invalid: expected <= head_dim / 2 = 4"):
        Decoder(ModelConfig(vocab_size=VOCAB, d_model=D, n_heads=HEADS, mechanism=DARLatentConfig(d_down=8,
                                                                                                  rope_pairs=5)))


def test_cache_numbers_per_token():
    """SmolLM2-135M's shape (3 KV heads of 64) at d_c 144, 4 pairs: 168 numbers a token against plain's 384."""
    cfg = DARLatentConfig(d_down=144, rope_pairs=4)
    assert cfg.cache_numbers(AttentionDims(576, 9, 3, 64)) == (144 + 24, 384)


def test_full_rank_reproduces_the_host_and_less_does_not():
    """Every pair kept and d_c = kv_heads x head_dim: the host's logits (exactly: the SVD is exact there). Keeping
    fewer pairs (content rank still full) or a narrower latent changes them; so does skipping the initialisation."""
    base = host()
    ids = torch.randint(0, VOCAB, (2, 30))
    with torch.no_grad():
        want = base(ids).logits
        full = latent_model(DARLatentConfig(window=4, d_down=KV * HD, rope_pairs=HD // 2), base)
        assert rel_err(full(ids).logits, want) < 1e-5
        partial = latent_model(DARLatentConfig(window=4, d_down=D, rope_pairs=1), base)  # rank of [W_K,nope; W_V] = 28
        narrow = latent_model(DARLatentConfig(window=4, d_down=8, rope_pairs=HD // 2), base)
        uninit = swap_mechanism(base, DARLatentConfig(window=4, d_down=KV * HD, rope_pairs=HD // 2)).eval()
        for other in (partial, narrow, uninit):
            got = other(ids).logits
            assert rel_err(got[:, :4], want[:, :4]) < 1e-5  # the first w tokens read only near keys
            assert rel_err(got, want) > 1e-3


def test_partial_rope_content_channels_are_the_svd_of_the_host():
    """With the content rank full (d_c = 28 here), only the content channels' rotation is lost: the far scores
    equal the host's with those channels unrotated, i.e. the layer equals itself with W_UK, W_UV taken exactly."""
    base = host()
    model = latent_model(DARLatentConfig(window=4, d_down=D, rope_pairs=1), base)
    for blk, mech in zip(base.blocks, mechanism_layers(model)):
        order = mech.channels
        rows = (order[:, 2:] + torch.arange(KV)[:, None] * HD).reshape(-1)
        fold = mech.up_k.weight @ mech.down.weight  # the content keys' map h -> k_c
        assert rel_err(fold, blk.attn.k_proj.weight[rows]) < 1e-5
        assert rel_err(mech.up_v.weight @ mech.down.weight, blk.attn.v_proj.weight) < 1e-5


def test_calibration_runs_the_host_and_picks_pairs_by_their_2_norm():
    base = host()
    with torch.no_grad():  # make pair 2 of KV head 1 and pair 0 of KV head 0 dominate the keys
        k = base.blocks[0].attn.k_proj.weight.view(KV, HD, D)
        k[1, [2, 2 + HD // 2]] *= 20
        k[0, [0, HD // 2]] *= 20
    ids = torch.randint(0, VOCAB, (2, 24))
    model = swap_mechanism(base, DARLatentConfig(window=4, d_down=8, rope_pairs=1)).eval()
    with torch.no_grad():
        want = base(ids).logits
        seen = []
        stats = calibrate(model, lambda: seen.append(model(ids).logits))
    assert rel_err(seen[0], want) < 1e-5  # the calibration pass computes the host
    assert stats[0]["tokens"] == 48 and stats[0]["rot"] == HD and stats[0]["k"].shape == (KV, HD // 2)
    init_from_host(model, lambda: model(ids))
    assert mechanism_layers(model)[0].channels[:, :2].tolist() == [[0, 4], [2, 6]]
    assert all(m.calibration is None for m in mechanism_layers(model))


def test_without_calibration_the_pairs_come_from_the_weights():
    """No calibration text: the 2-norm score on the weights' pair norms picks the pairs. A pair's norm is the
    Frobenius norm of its two rows, what the squared pair norms sum to over an orthonormal basis of inputs."""
    from allhere.mechanisms.dar_latent_channels import weight_pair_norms

    w = torch.randn(HEADS * HD, D)
    q = w.view(HEADS, HD, D).transpose(1, 2)  # [heads, D inputs (the identity's rows), HD]
    squared = (q[..., :HD // 2] ** 2 + q[..., HD // 2:] ** 2).sum(1)
    assert rel_err(weight_pair_norms(w, HEADS, HD) ** 2, squared) < 1e-5
    base = host()
    with torch.no_grad():
        k = base.blocks[0].attn.k_proj.weight.view(KV, HD, D)
        k[1, [2, 2 + HD // 2]] *= 20
        k[0, [0, HD // 2]] *= 20
    model = latent_model(DARLatentConfig(window=4, d_down=8, rope_pairs=1), base)
    assert mechanism_layers(model)[0].channels[:, :2].tolist() == [[0, 4], [2, 6]]


def test_decoding_keeps_latents_and_the_window_and_reads_them_absorbed(monkeypatch):
    """The cache holds, per token, d_c + 2 r kv_heads numbers and the window's full K/V only; decode steps run the
    absorbed path and never rebuild a far key (the prompt, without gradients, runs the fused path); greedy
    generation equals greedy decoding without a cache."""
    cfg = DARLatentConfig(window=4, d_down=8, rope_pairs=1)
    model = latent_model(cfg)
    prompt = torch.randint(0, VOCAB, (2, 20))
    calls = []
    monkeypatch.setattr(absorbed, "attend_in_blocks", lambda *a, **k: calls.append("absorbed") or
                        absorbed_blocks(*a, **k))
    monkeypatch.setattr(rebuilt, "attend_in_blocks", lambda *a, **k: calls.append("rebuilt") or rebuilt_blocks(*a, **k))
    monkeypatch.setattr(dispatch, "dar_latent_attention_fused", lambda *a, **k: calls.append("fused") or
                        fused_path(*a, **k))
    out = model.generate(prompt, max_new_tokens=6)
    assert calls == ["fused"] * 2 + ["absorbed"] * 12  # the prompt, then 6 steps, in 2 layers
    ids = prompt
    with torch.no_grad():
        for _ in range(6):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(out, ids)
    cache = model.new_cache()
    with torch.no_grad():
        model(out, cache=cache)
    layer = cache.layers[0]
    assert layer.latent.shape == (2, 26, 8 + 2 * 1 * KV)
    assert len(layer.near) == 4 and layer.used_nbytes() == 4 * (2 * 26 * 12 + 2 * 2 * KV * 4 * HD)


absorbed_blocks, rebuilt_blocks = absorbed.attend_in_blocks, rebuilt.attend_in_blocks
fused_path = dispatch.dar_latent_attention_fused


def test_two_stages_train_the_latent_then_everything(tmp_path):
    """DAR's stage 1 (``train_only=".mechanism."``): only W_down / W_UK / W_UV move; stage 2: everything, the host's
    K projection included (its rotated channels are the far keys' too)."""
    model = latent_model(DARLatentConfig(window=3, d_down=8, rope_pairs=1))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batches = lambda s, m, g: torch.randint(0, VOCAB, (2, 12), generator=g)  # noqa: E731
    train(model, batches, TrainConfig(steps=2, batch_size=2, lr=1e-2), tmp_path / "s1.safetensors", progress=False,
          train_only=".mechanism.")
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) != (".mechanism." in n), n
    model.train()
    model(torch.randint(0, VOCAB, (2, 12))).logits.square().mean().backward()
    attn = model.blocks[0].attn
    for p in (attn.mechanism.down.weight, attn.mechanism.up_k.weight, attn.mechanism.up_v.weight, attn.k_proj.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0
