"""The backend registry (``allhere.backend``): every op family has a reference path, ``use_backend`` picks
among the paths, and ``with use_backend("reference"): model(ids)`` computes every layer of a model of any
registered mechanism kind on the references."""

import pytest
import torch
import torch.nn.functional as F

from allhere import AAMoEConfig, Decoder, ModelConfig, SinksConfig, backend, registry, use_backend

from helpers import rel_err, spy_paths
from mechanism_examples import contract_cases, example

N = 260  # tokens: past the pattern layers' dense_below (q_len x kv_len > 65536), so their sparse ops run
LAYERS = 2


def run(model, ids, name):
    """Logits, parameter gradients and the logits of a cached decode (prefill, then the last token) under
    backend ``name``."""
    model.zero_grad()
    with use_backend(name):
        out = model(ids)
        (out.logits.square().mean() + (0 if out.aux_loss is None else out.aux_loss)).backward()
        with torch.no_grad():
            cache = model.new_cache()
            model(ids[:, :-1], cache=cache)
            step = model(ids[:, -1:], cache=cache).logits
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads, step


def test_every_op_family_has_a_reference_path():
    assert set(backend.ops()) >= {"full", "sliding", "aha", "dar", "patterns", "aamoe", "all_attention"}
    for op in backend.ops():
        assert "reference" in backend.paths(op), op


def test_every_op_family_is_registered_in_one_place_that_names_them_all():
    """``allhere.ops.families`` is the one module that calls ``register_path`` (read from the source: every call
    in the package), and its ``FAMILIES`` names every family registered once the mechanisms are imported -- no
    more, no fewer."""
    import ast
    from pathlib import Path

    import allhere.mechanisms  # noqa: F401
    from allhere.ops import FAMILIES

    root = Path(allhere.__file__).parent
    callers = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name == "register_path":
                    callers.add(path.relative_to(root).as_posix())
    assert callers == {"ops/families.py"}
    assert set(backend.ops()) == set(FAMILIES)


@pytest.mark.parametrize("kind", contract_cases())
def test_reference_backend_runs_every_layer_on_the_references(kind, monkeypatch):
    """A two-layer model of ``kind`` under "reference" and under "auto": the same logits, gradients and
    cached decoding; under "reference" every layer's every call ran a reference path (and SDPA, which
    every fast path on the CPU uses and no reference does, never ran); under "auto" the family's fast path
    ran where it has one."""
    torch.manual_seed(0)
    model = Decoder(ModelConfig(vocab_size=61, d_model=32, n_layers=LAYERS, n_heads=4, n_kv_heads=2,
                                mechanism=example(kind)))
    ids = torch.randint(0, 61, (2, N))
    calls = spy_paths(monkeypatch)
    auto = run(model, ids, "auto")
    fast_calls, calls[:] = list(calls), []

    def no_sdpa(*args, **kwargs):
        raise AssertionError("SDPA ran under the reference backend")

    monkeypatch.setattr(F, "scaled_dot_product_attention", no_sdpa)
    ref = run(model, ids, "reference")
    assert len(calls) == 3 * LAYERS, calls  # one op call per layer: the forward, the prefill, the decode step
    assert all(b == "reference" for _, b in calls), calls
    families = {op for op, _ in calls}
    assert {op for op, _ in fast_calls} == families
    for op in families:
        if set(backend.paths(op)) - {"reference"}:
            assert ("reference" not in {b for o, b in fast_calls if o == op}), (op, fast_calls)
    assert rel_err(auto[0], ref[0]) < 1e-4
    assert rel_err(auto[2], ref[2]) < 1e-4
    assert auto[1].keys() == ref[1].keys()
    for name in auto[1]:
        assert rel_err(auto[1][name], ref[1][name]) < 1e-3, name


def test_named_backend_picks_its_path_or_says_why():
    """A named backend runs its path of each family that has one (ValueError where that path refuses the
    call); a family without such a path runs its "auto" choice."""
    calls = []
    backend.register_path("toy", "reference", lambda x: calls.append("reference") or x)
    backend.register_path("toy", "torch", lambda x: calls.append("torch") or x,
                          takes=lambda x: None if x >= 0 else "negative input")
    try:
        assert backend.dispatch("toy", 1) == 1 and calls == ["torch"]  # auto: the fast path that takes it
        assert backend.dispatch("toy", -1) == -1 and calls[-1] == "reference"  # auto: the next that does
        with use_backend("reference"):
            backend.dispatch("toy", 1)
        assert calls[-1] == "reference"
        with use_backend("triton"):  # no triton path: auto's choice
            backend.dispatch("toy", 1)
        assert calls[-1] == "torch"
        with pytest.raises(ValueError, match="backend 'torch' cannot take this toy call: negative input"):
            backend.dispatch("toy", -1, backend="torch")
    finally:
        backend._PATHS.pop("toy")
    with pytest.raises(ValueError, match="'auto' is a choice among the paths"):
        backend.register_path("toy", "auto", abs)
    with pytest.raises(ValueError, match="unknown op family 'toy'"):
        backend.dispatch("toy", 1)
    with pytest.raises(ValueError, match="backend must be one of"):
        backend.dispatch("full", backend="flash")


@pytest.mark.parametrize("old, module, new", [
    ("aha_attention_naive", "allhere", "aha_attention_reference"),
    ("sliding_window_attention_naive", "allhere", "sliding_window_attention_reference"),
    ("aha_attention_naive", "allhere.ops.aha", "aha_attention_reference"),
    ("sliding_window_attention_naive", "allhere.ops.sliding", "sliding_window_attention_reference"),
    ("dar_attention_naive", "allhere.ops.dar", "dar_attention_reference"),
    ("aamoe_attention_naive", "allhere.ops.aamoe", "aamoe_attention_reference"),
    ("reference_attention", "allhere.ops.full", "pattern_attention_reference"),
    ("masked_attention_fp32", "allhere.ops.common", "masked_attention_reference"),
    ("set_forced_gate", "allhere.hf", "set_forced_gate"),
    ("load_model", "allhere.checkpoint", "runtime.model_checkpoint.load_model"),
    ("CheckpointError", "allhere.checkpoint", "runtime.model_checkpoint.CheckpointError"),
    ("report_to", "allhere.reporting", "runtime.reporting.report_to"),
    ("model_path", "allhere.models_cache", "runtime.models_cache.model_path"),
    ("fetch", "allhere.models_cache", "runtime.models_cache.fetch"),
])
def test_renamed_names_still_import_and_say_where_they_went(old, module, new):
    import importlib

    if module == "allhere.hf":
        pytest.importorskip("transformers")
    mod = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=new):
        got = getattr(mod, old)
    assert got.__name__ == new.rpartition(".")[2]


def test_removed_switches_say_where_they_went():
    from allhere.mechanisms.aamoe import AAMoEAttention
    from allhere.mechanisms.base import AttentionDims

    dims = AttentionDims(32, 4, 2, 8)
    pattern = registry.build(SinksConfig(window=4), dims)
    with pytest.raises(AttributeError, match=r"use_backend\('torch' \| 'flex'"):
        pattern.backend = "flex"
    with pytest.raises(AttributeError, match=r"use_backend\('reference'\)"):
        AAMoEAttention(AAMoEConfig(chunk=4, experts=2), dims).reference = True
