"""The cost model ``allhere serve`` prints (``allhere.serve.cost``): ratios counted by hand for each kind of work,
the pattern kinds' keys counted from their own masks, and the verdict each regime gets. No vLLM needed."""

import pytest

import allhere as ah
from allhere.registry import to_dict
from allhere.serve.cost import decode_work

GQA = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}  # heads of 64


def work(cfg, context, shape=GQA):
    return decode_work({**shape, "allhere_mechanism": to_dict(cfg)}, context)


def test_dar_latent_counts_its_rows_absorbed():
    t, w, d_c, pairs = 8192, 256, 64, 4
    r = work(ah.DARLatentConfig(window=w, d_down=d_c, rope_pairs=pairs), t)
    width = d_c + 2 * 2 * pairs  # [c ; k^R of both KV heads]
    plain_macs, plain_numbers = 4 * 2 * 64 * t, 2 * 2 * 64 * t
    assert r.macs == pytest.approx((4 * 2 * 64 * w + (t - w) * 4 * (width + d_c)) / plain_macs)
    assert r.bytes == pytest.approx((2 * 2 * 64 * w + (t - w) * width) / plain_numbers)
    assert r.macs > 1 > r.bytes and "bound by memory" in r.line()


def test_dar_rebuilds_every_distant_key():
    t, w, d_c = 4096, 256, 64
    r = work(ah.DARConfig(window=w, d_down=d_c), t)
    far = (t - w) * (2 * 64 * d_c + 4 * (64 + d_c))
    assert r.macs == pytest.approx((4 * 2 * 64 * w + far) / (4 * 2 * 64 * t))
    assert r.bytes == pytest.approx((2 * 2 * 64 * w + (t - w) * d_c) / (2 * 2 * 64 * t))
    assert f"over {r.macs:.1f}x as long" in r.line()


def test_aha_is_given_per_unit_of_mu_f():
    r = work(ah.AHAConfig(window=256), 8192)
    assert (r.macs, r.per_mu_f) == (pytest.approx(256 / 8192), pytest.approx(1 - 256 / 8192))
    assert "0.031x + 0.969x per unit of global share" in r.line() and "mu_f" not in r.line()


@pytest.mark.parametrize("cfg, keys", [(ah.SlidingConfig(window=256), 256),
                                       (ah.SinksConfig(window=252, n_sinks=4), 256),
                                       (ah.LongformerConfig(window=256, global_first=4), 260),
                                       (ah.DilatedConfig(window=128, dilation=(1, 2, 3, 4)), 128)],
                         ids=["sliding", "sinks", "longformer", "dilated"])
def test_patterns_read_the_keys_of_their_mask(cfg, keys):
    r = work(cfg, 8192, {**GQA, "num_key_value_heads": 4})  # multi-head: bytes follow the keys exactly
    assert r.macs == pytest.approx(keys / 8192) and r.bytes == pytest.approx(keys / 8192)
    assert "outweigh its fixed cost" in r.line()


def test_a_kv_head_is_read_for_every_key_any_of_its_heads_reads():
    # BigBird draws its random blocks per query head: two heads of a KV group read different blocks
    r = work(ah.BigBirdConfig(block=64, window_blocks=3, global_blocks=1, random_blocks=2), 8192)
    assert r.bytes > r.macs
    mha = work(ah.BigBirdConfig(block=64, window_blocks=3, global_blocks=1, random_blocks=2), 8192,
               {**GQA, "num_key_value_heads": 4})
    assert mha.bytes == pytest.approx(mha.macs)


def test_nothing_to_say_without_a_mechanism_or_a_plain_shape():
    assert decode_work(GQA, 8192) is None
    aha = to_dict(ah.AHAConfig(window=8))
    assert decode_work({"hidden_size": 256, "allhere_mechanism": aha}, 8192) is None  # no heads said
    nested = decode_work({"text_config": GQA, "allhere_mechanism": aha}, 8192)
    assert nested is not None and nested.macs == pytest.approx(8 / 8192)
    assert decode_work({**GQA, "allhere_mechanism": to_dict(ah.AHAConfig(window=8))}, 0) is None
