"""DAR on Hugging Face models, offline: tiny random-weight configs (the families of test_hf), no downloads."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from allhere import ConfigError, DARConfig  # noqa: E402
from allhere.hf import convert, load_pretrained, save_pretrained  # noqa: E402

from helpers import rel_err  # noqa: E402
from test_hf import FAMILIES, build  # noqa: E402


@pytest.mark.parametrize("name", FAMILIES)
def test_no_bottleneck_or_wide_window_equals_original(name):
    ids = torch.randint(3, 97, (2, 24))
    with torch.no_grad():
        ref = build(name)(ids).logits
        same = convert(build(name), DARConfig(window=4, d_down=64))(ids).logits  # d_down = d: h' = h
        wide = convert(build(name), DARConfig(window=24, d_down=8))(ids).logits  # every key is near
        dar = convert(build(name), DARConfig(window=4, d_down=8))(ids).logits
    assert rel_err(same, ref) < 1e-5 and rel_err(wide, ref) < 1e-5
    assert rel_err(dar[:, :4], ref[:, :4]) < 1e-5  # the first w tokens see only near keys
    assert rel_err(dar, ref) > 1e-3


def fold_bottleneck(model, plain):
    """Give ``plain`` (the original model) K/V projections W_K W_up W_down, W_V W_up W_down from ``model``'s
    bottlenecks: run by transformers itself, it is then an oracle for uniform reduction (w = 0)."""
    from allhere.hf.convert import attention_modules

    for attn, target in zip(attention_modules(model), attention_modules(plain)):
        fold = attn.allhere.up.weight @ attn.allhere.down.weight  # [d, d]: h -> h'
        with torch.no_grad():
            if hasattr(target, "query_key_value"):  # GPT-NeoX: per head rows [q | k | v]
                heads = model.config.num_attention_heads
                w = target.query_key_value.weight.view(heads, 3, -1, fold.shape[0])
                w[:, 1:] = w[:, 1:] @ fold
            else:
                target.k_proj.weight.copy_(target.k_proj.weight @ fold)
                target.v_proj.weight.copy_(target.v_proj.weight @ fold)


@pytest.mark.parametrize("name", FAMILIES)
def test_uniform_reduction_equals_transformers_with_folded_projections(name):
    model = convert(build(name), DARConfig(window=0, d_down=12))
    torch.manual_seed(1)
    for attn_dar in (m for n, m in model.named_modules() if n.endswith(".allhere")):
        torch.nn.init.normal_(attn_dar.up.weight, std=0.2)  # not just the transpose of W_down
    oracle = build(name)
    fold_bottleneck(model, oracle)
    ids = torch.randint(3, 97, (2, 20))
    with torch.no_grad():
        assert rel_err(model(ids).logits, oracle(ids).logits) < 1e-5


def test_save_load_generate_and_padding(tmp_path):
    model = convert(build("qwen3"), DARConfig(window=3, d_down=16))
    save_pretrained(model, tmp_path / "m")
    again = load_pretrained(tmp_path / "m").eval()
    ids = torch.randint(3, 97, (2, 20))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
        assert again.config.allhere_mechanism == model.config.allhere_mechanism
        out = again.generate(ids[:, :6], max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=2)
        assert out.shape == (2, 11)  # no cache by default after conversion
        cached = again(ids, use_cache=True).past_key_values  # a prefill needs no cached keys...
        with pytest.raises(RuntimeError, match="use_cache=False"):
            again(ids[:, -1:], past_key_values=cached, use_cache=True)  # ...the next step would
        a, b = ids[:1, :12], ids[1:, :7]
        padded = torch.full((2, 12), 2)
        padded[0], padded[1, 5:] = a[0], b[0]  # left padding
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[1, :5] = 0
        batched = model(padded, attention_mask=mask).logits
        assert rel_err(batched[0], model(a).logits[0]) < 1e-5
        assert rel_err(batched[1, 5:], model(b).logits[0]) < 1e-5


def test_bad_input():
    with pytest.raises(ConfigError, match="DARConfig.d_down = 100 is invalid: expected <= d_model = 64"):
        convert(build("llama"), DARConfig(window=4, d_down=100))
    with pytest.raises(ConfigError, match="larger than the model's context"):
        convert(build("llama"), DARConfig(window=1000, d_down=8))
    with pytest.raises(ValueError, match="already converted"):
        convert(convert(build("llama"), DARConfig(window=4, d_down=8)), __import__("allhere").AHAConfig(window=4))
