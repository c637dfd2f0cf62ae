"""The mechanism interface: a mechanism defined here, in the test, plugs into the decoder, cached
generation, checkpoints and the Hugging Face conversion with no library file changed."""

from dataclasses import dataclass, field

import pytest
import torch

from allhere import ConfigError, Decoder, ModelConfig, register
from allhere.masks import and_masks, causal, starts_from
from allhere.mechanisms import AttentionCall, AttentionDims, AttentionMechanism
from allhere.ops.common import segment_mask
from allhere.ops.full import full_attention
from allhere.registry import from_dict, get, kinds
from allhere.runtime.model_checkpoint import load_model, save_checkpoint

from helpers import rel_err


def every_other(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx) % 2 == 0


@dataclass(frozen=True)
class EveryOtherConfig:
    """Each query reads itself and every second key before it."""

    kind: str = field(default="every_other", init=False)


@register(EveryOtherConfig, summary="every other key (a test mechanism)")
class EveryOther(AttentionMechanism):
    def forward(self, q, k, v, call, cache=None):
        if cache is not None:
            k, v = cache.update(k, v)
        b, lq, lk = q.shape[0], q.shape[2], k.shape[2]
        starts = call.segment_starts if call.segment_starts is not None else torch.zeros(b, lq, dtype=torch.long)
        mask = segment_mask(starts, lq, lk, and_masks(causal, every_other))
        return full_attention(q, k, v, call.scale, mask), None


def tiny():
    torch.manual_seed(0)
    return Decoder(ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                               mechanism=EveryOtherConfig())).eval()


def test_registry_lists_and_refuses():
    assert {"full", "sliding", "aha", "dar", "every_other"} <= set(kinds())
    assert get("every_other").module is EveryOther
    with pytest.raises(ConfigError, match="unknown mechanism kind 'nope'.*every_other"):
        from_dict({"kind": "nope"})
    with pytest.raises(ValueError, match="already registered"):
        register(EveryOtherConfig)(type("Other", (AttentionMechanism,), {}))
    with pytest.raises(ConfigError, match="ModelConfig.mechanism"):
        ModelConfig(mechanism="every_other")


def test_the_op_reads_every_other_key():
    q, k, v = torch.randn(1, 4, 9, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    out, routing = EveryOther(EveryOtherConfig(), AttentionDims(32, 4, 2, 8))(q, k, v, AttentionCall(x=None))
    assert routing is None
    for h in range(4):
        for i in range(9):
            keys = list(range(i, -1, -2))
            p = torch.softmax(k[0, h // 2, keys].double() @ q[0, h, i].double() / 8 ** 0.5, 0)
            assert rel_err(out[0, h, i], p @ v[0, h // 2, keys].double()) < 1e-6


def test_decoder_cache_segments_and_checkpoint(tmp_path):
    model = tiny()
    ids = torch.randint(0, 40, (2, 11))
    logits = model(ids).logits
    cache = model.new_cache()
    steps = torch.cat([model(ids[:, t:t + 1], cache=cache).logits for t in range(11)], 1)
    assert rel_err(steps, logits) < 1e-5
    assert torch.equal(model.generate(ids[:, :4], 5)[:, :4], ids[:, :4])
    positions = torch.cat([torch.arange(5), torch.arange(6)])[None].expand(2, -1)
    packed = model(ids, segment_starts=starts_from(position_ids=positions)).logits
    assert rel_err(packed[:, 5:], model(ids[:, 5:]).logits) < 1e-5
    save_checkpoint(tmp_path / "m.safetensors", model, None, {"step": 0})
    again, _ = load_model(tmp_path / "m.safetensors")
    assert again.cfg.mechanism == EveryOtherConfig() and torch.equal(again(ids).logits, logits)


def test_hugging_face_conversion():
    transformers = pytest.importorskip("transformers")
    from allhere.hf import convert, load_pretrained, save_pretrained  # noqa: F401

    cfg = transformers.LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    ids = torch.randint(1, 40, (2, 12))  # no pad token (0): generate would read zeros as padding
    i, j = torch.arange(12)[:, None], torch.arange(12)[None]
    pattern = ((j <= i) & ((i - j) % 2 == 0)).expand(2, 1, 12, 12)
    with torch.no_grad():
        oracle = model(ids, attention_mask=pattern).logits  # transformers' own SDPA under the same pattern
        convert(model, EveryOtherConfig())
        assert rel_err(model(ids).logits, oracle) < 1e-5
        kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(ids, use_cache=True, **kw), model.generate(ids, use_cache=False, **kw))


def test_each_served_kind_declares_how_once():
    """How vLLM serves a kind is declared where it registers (``register(..., serving=Serving(...))``); a kind
    without it is not served."""
    from allhere import Serving

    want = {"aha": Serving("aha", devices=("cpu", "cuda"), softmax_terms=True, cuda_graphs=False),
            "sliding": Serving("sliding", devices=("cpu", "cuda")), "dilated": Serving("masked"),
            "longformer": Serving("masked"), "bigbird": Serving("masked")}
    for kind, spec in want.items():
        assert get(kind).serving == spec, kind
    sinks, dar = get("sinks").serving, get("dar").serving
    assert (sinks.installer, sinks.devices, sinks.transformers_backend) == ("sinks", ("cpu",), True)
    assert (dar.installer, dar.devices, dar.transformers_backend) == ("dar", ("cpu",), False)
    assert "sinks and the window" in sinks.own_cache_group and "latent" in dar.own_cache_group
    assert not sinks.softmax_terms and not dar.softmax_terms
    assert all(get(k).serving is None for k in ("full", "aamoe", "all_attention", "every_other"))


def test_a_serving_spec_is_checked():
    from allhere import Serving

    with pytest.raises(ValueError, match="installer 'flash'"):
        Serving("flash")
    with pytest.raises(ValueError, match="devices"):
        Serving("masked", devices=("tpu",))
    with pytest.raises(TypeError, match="Serving"):
        register(EveryOtherConfig, serving="masked")
