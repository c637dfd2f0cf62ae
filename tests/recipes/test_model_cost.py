"""The whole-model cost model (``allhere_recipes.model_cost``) and its table script."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from allhere_recipes.cost import Shape, plan_for, ring_cost, saved_bytes, summary
from allhere_recipes.model_cost import (
    MECHANISMS,
    PRESETS,
    ModelShape,
    load_model_shape,
    step_cost,
)

from real_configs import PUBLISHED

ROOT = Path(__file__).resolve().parents[2]
N = 4096  # small enough that every plan below is walked in milliseconds


def hf_param_count(cls_name: str, cfg: dict) -> int:
    transformers = pytest.importorskip("transformers")
    config_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    with torch.device("meta"):
        model = getattr(transformers, cls_name)(config_cls(**cfg))
    return sum(p.numel() for p in model.parameters())  # tied weights counted once


def test_mistral_preset_is_the_published_config_and_counts_like_transformers():
    cfg = {k: v for k, v in PUBLISHED["Mistral-7B-v0.1"].items() if k not in ("architectures", "torch_dtype")}
    shape = PRESETS["Mistral-7B-v0.1"]
    assert ModelShape.from_config(cfg) == shape
    assert shape.params == hf_param_count("MistralForCausalLM", cfg) == 7_241_732_096


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_llama_counts_like_transformers(tied):
    cfg = dict(hidden_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=24,
               intermediate_size=160, vocab_size=500, tie_word_embeddings=tied)
    shape = ModelShape.from_config(cfg)
    assert shape.tied is tied and shape.head_dim == 24  # head_dim given, != hidden / heads
    assert shape.params == hf_param_count("LlamaForCausalLM", cfg)
    cfg.pop("head_dim")  # then hidden / heads
    assert ModelShape.from_config(cfg).head_dim == 16
    assert ModelShape.from_config(cfg).params == hf_param_count("LlamaForCausalLM", cfg)


def test_load_model_shape_from_preset_name_or_config_json(tmp_path):
    assert load_model_shape("mistral-7b-v0.1") is PRESETS["Mistral-7B-v0.1"]
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED["SmolLM2-135M"]))
    smol = load_model_shape(str(tmp_path / "config.json"))
    assert load_model_shape(str(tmp_path)) == smol and smol.tied and smol.kv_heads == 3
    with pytest.raises(ValueError, match="neither a preset"):
        load_model_shape(str(tmp_path / "missing.json"))


def test_state_scales_as_one_over_the_gpus():
    m = PRESETS["Mistral-7B-v0.1"]
    c = {(dp, cp): step_cost(m, N, dp, cp) for dp, cp in [(1, 2), (2, 2), (4, 2), (1, 8)]}
    for (dp, cp), x in c.items():
        assert x["sharded_state"] == pytest.approx(16 * m.params / (dp * cp))
        # the unsharded buffers (root + two blocks in bf16, one block's grads) do not depend on the mesh
        assert x["state"] - x["sharded_state"] == pytest.approx(c[1, 2]["state"] - c[1, 2]["sharded_state"])
    assert c[2, 2]["sharded_state"] * 2 == pytest.approx(c[1, 2]["sharded_state"])
    assert c[4, 2]["sharded_state"] == pytest.approx(c[1, 8]["sharded_state"])  # same G, other split
    assert c[1, 2]["gathered_blocks"] == 2 * 2 * m.block_params
    # FSDP traffic: (G-1)/G of 2 bf16 all-gathers (the root's only once) and an fp32 reduce-scatter
    g = 4
    want = (2 * m.params + 2 * m.layers * m.block_params + 4 * m.params) * (g - 1) / g
    assert c[2, 2]["fsdp_sent_per_step"] == pytest.approx(want)


@pytest.mark.parametrize("mech", MECHANISMS)
def test_ring_terms_are_the_layer_summary_times_the_layers(mech):
    m = ModelShape(layers=5, d_model=256, heads=4, kv_heads=2, head_dim=64, ffn=512, vocab=1000)
    cp, window = 4, 256
    shape = Shape(batch=1, heads=4, kv_heads=2, head_dim=64, elt=2)
    is_global = torch.zeros(N, dtype=torch.bool)
    is_global[:64] = True
    plan, sel = plan_for(mech.split()[0], N, cp, "zigzag", window=window, mu_f=0.07, is_global=is_global)
    trained = "trained" in mech
    extra = None
    if trained:
        from allhere_recipes.cost import aha_training_extra

        def extra(r):
            return aha_training_extra(N, cp, "zigzag", window, shape, r)
    s = summary(plan, shape, sel, extra)
    no_ckpt = step_cost(m, N, 2, cp, mech, window=window, checkpointing=False)
    ckpt = step_cost(m, N, 2, cp, mech, window=window)
    for c in (no_ckpt, ckpt):
        assert c["ring_sent_per_layer"] == s["sent"] and c["ring_received_per_layer"] == s["received"]
        assert c["ring_rounds_per_layer"] == s["rounds"] and c["attn_flops_per_layer"] == s["flops"]
        assert c["ring_working_set"] == s["peak"]
        assert c["attn_saved_per_layer"] == saved_bytes(shape, N, cp, sel, trained_gate=trained)
    assert no_ckpt["ring_sent_per_step"] == m.layers * s["sent"]
    assert no_ckpt["attn_flops_per_step"] == m.layers * s["flops"]
    # the recompute runs each layer's forward again (the gate's extra passes included)
    fwd = []
    for r in range(cp):
        f = ring_cost(plan, shape, r)["forward"]
        if extra is not None:
            f = {k: f[k] + extra(r)["forward"][k] for k in f}
        fwd.append(f)
    assert ckpt["ring_sent_per_step"] == m.layers * (s["sent"] + max(f["bytes_sent"] for f in fwd))
    assert ckpt["attn_flops_per_step"] == m.layers * (s["flops"] + max(f["flops"] for f in fwd))
    assert 0 < ckpt["ring_received_per_round"] <= s["received"]


def test_activations_scale_down_with_cp():
    m = PRESETS["Mistral-7B-v0.1"]
    acts = [step_cost(m, N, 1, cp, "full") for cp in (1, 2, 4, 8)]
    for a, b in zip(acts, acts[1:]):
        assert b["activations"] < a["activations"]
        for k in ("block_inputs", "block_recompute", "logits"):
            assert b[k] == pytest.approx(a[k] / 2)  # linear in the rank's tokens
        assert b["ring_working_set"] < a["ring_working_set"] / 2  # the score block is quadratic in them
    assert acts[-1]["block_inputs"] == m.layers * (N // 8) * m.d_model * 2
    # without checkpointing every block's saved tensors stay, and there is no recompute
    off = step_cost(m, N, 1, 8, "full", checkpointing=False)
    assert off["block_recompute"] == m.layers * acts[-1]["block_recompute"] and off["block_inputs"] == 0
    assert off["ring_recompute_sent_per_layer"] == 0 and off["attn_recompute_flops_per_layer"] == 0
    for c in acts + [off]:
        assert c["peak"] == pytest.approx(c["state"] + c["activations"])


def test_script_prints_a_row_per_mechanism_and_mesh(capsys):
    spec = importlib.util.spec_from_file_location("scale_model", ROOT / "benchmarks" / "scale_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--seq", str(N), "--meshes", "1x2", "2x2", "1x4"])
    out = capsys.readouterr().out
    assert "not a measurement" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| mechanism")]
    assert [(r.split(" | ")[0][2:], r.split(" | ")[1]) for r in rows] == [
        (mech, mesh) for mech in MECHANISMS for mesh in ("1×2", "2×2", "1×4")]
    assert all(len(r.split("|")) == 13 for r in rows)  # 11 columns
