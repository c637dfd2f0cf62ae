"""allhere patterns: reachability and hops against hand-computed cases, the figure, the table figures of a
tiny run, and the settings it refuses."""

import json
import math

import pytest
import torch

from allhere.masks import (
    causal,
    dense_mask,
    dilated_window,
    global_tokens,
    longformer,
    sliding_window,
)
from allhere.validation import ConfigError
from allhere_recipes import sparse_graph as graph
from allhere_recipes.sparse_family import Pattern, PatternSettings, build, layer_masks
from allhere_recipes.sparse_patterns import _check_whole, render, run_patterns
from allhere_recipes.sparse_plot import COLOURS, edge_image, mask_figure


def _mask(pred, n):
    return dense_mask(pred, n, n)[0, 0]


def _hops(pred, n, is_causal=True, layers=1):
    a = _mask(pred, n)
    return graph.propagate(lambda l: a, 1, n, layers, is_causal)


@pytest.mark.parametrize("w,layers", [(2, 1), (5, 3), (4, 6)])
def test_sliding_reach_is_layers_times_w_minus_1(w, layers):
    n = 40
    reach = graph.reach_after([_mask(sliding_window(w), n)] * layers)
    for i in range(n):
        got = reach[i].nonzero().flatten()
        back = min(i, layers * (w - 1))  # the window holds the current token: w - 1 further per layer
        assert got.tolist() == list(range(i - back, i + 1)), i
    stats = graph.propagate(lambda l: _mask(sliding_window(w), n), 1, n, layers, True).receptive
    assert [s["farthest"] for s in stats] == [min(n - 1, k * (w - 1)) for k in range(1, layers + 1)]
    assert stats[-1]["last_token_positions"] == min(n, layers * (w - 1) + 1)


def test_encoder_window_reaches_both_sides():
    n, w, layers = 30, 3, 2
    reach = graph.reach_after([_mask(sliding_window(w, causal=False), n)] * layers)
    assert reach[15].nonzero().flatten().tolist() == list(range(11, 20))  # 15 +- 2 (w - 1) = 4
    s = graph.reach_stats(reach, causal=False)
    assert s["farthest"] == 4 and s["max_positions"] == 9


def test_full_causal_is_one_hop():
    h = _hops(causal, 24).hops()
    assert h["mean"] == 1.0 and h["max"] == 1 and h["unreachable_share"] == 0.0
    assert h["histogram"] == {"1": 24 * 23 // 2}


@pytest.mark.parametrize("is_causal", [True, False])
def test_sliding_hops_are_ceil_distance_over_w_minus_1(is_causal):
    n, w = 37, 4
    pairs = [(i, j) for i in range(n) for j in range(n) if (i > j if is_causal else i != j)]
    want = [math.ceil(abs(i - j) / (w - 1)) for i, j in pairs]
    h = _hops(sliding_window(w, causal=is_causal), n, is_causal).hops()
    assert h["max"] == max(want)
    assert h["mean"] == pytest.approx(sum(want) / len(want))
    assert sum(h["histogram"].values()) == len(pairs)


def test_globals_make_hops_at_most_two():
    n, w = 48, 3
    first = torch.zeros(n, dtype=torch.bool)
    first[:2] = True
    # encoder: every pair goes through a global token
    enc = _hops(longformer(w, first, causal=False), n, is_causal=False).hops()
    assert enc["max"] == 2 and enc["unreachable_share"] == 0.0
    # decoder: leading globals see only what is before them; from j = 2 on, paths are the window's
    dec = _hops(longformer(w, first), n).hops()
    assert dec["max"] == math.ceil((n - 1 - 2) / (w - 1)) == 23
    # decoder with a global every 3 positions and w >= the gap: at most 2 hops
    spread = torch.zeros(n, dtype=torch.bool)
    spread[2::3] = True
    assert _hops(longformer(w, spread), n).hops()["max"] == 2


def test_dilation_alone_leaves_pairs_unconnected_a_schedule_does_not():
    n, w = 32, 4
    h = _hops(dilated_window(w, 2), n).hops()
    odd = sum(1 for i in range(n) for j in range(i) if (i - j) % 2)
    assert h["unreachable_share"] == pytest.approx(odd / (n * (n - 1) / 2))
    cycle = [_mask(dilated_window(w, d), n) for d in (1, 2)]
    g = graph.propagate(lambda l: cycle[l], 2, n, 2, True)
    assert g.hops()["unreachable_share"] == 0.0
    assert g.receptive[-1]["farthest"] == (w - 1) * (1 + 2)


def test_window_of_one_connects_nothing():
    h = _hops(sliding_window(1), 10).hops()
    assert h["mean"] is None and h["max"] is None and h["unreachable_share"] == 1.0


def test_union_of_heads_and_scores():
    m = torch.zeros(2, 3, 3, dtype=torch.bool)
    m[0, 0, 0] = m[1, 1, 0] = m[1, 2, 2] = True
    assert graph.union_heads(m).sum() == 3
    assert graph.scores([m]) == 1.5  # 1 and 2 pairs: mean over heads


def test_edge_colours_follow_components():
    n = 8
    parts = {"window": _mask(sliding_window(2), n), "global": _mask(global_tokens(torch.arange(n) == 0), n)}
    img = edge_image(parts)
    assert torch.equal(img[5, 5], torch.tensor(COLOURS["window"]))
    assert torch.equal(img[5, 0], torch.tensor(COLOURS["global"]))
    assert torch.equal(img[1, 0], torch.tensor(COLOURS["window"]))  # window first where both allow
    assert torch.equal(img[5, 2], torch.ones(3))


def test_mask_figure_is_written(tmp_path):
    n = 16
    panels = [{"title": "sliding", "density": 0.5, "components": {"window": _mask(sliding_window(3), n)}}]
    path = mask_figure({"decoder": panels}, tmp_path / "m.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_components_must_make_the_pattern():
    s = PatternSettings(n=16, window=4, n_global=2, sinks=1, block=4, layers=1, heads=2)
    for p in build(s, True, s.n):
        _check_whole(p, [layer_masks(p, s.n, 0, s.heads)], s)  # the family matches allhere.masks
    bad = Pattern("x", "x", lambda l: [("window", sliding_window(4))], whole=lambda l: sliding_window(3))
    with pytest.raises(AssertionError):
        _check_whole(bad, [layer_masks(bad, 16, 0, 1)], s)


def test_tiny_run_table(tmp_path):
    n, w, s, g = 32, 4, 2, 4
    report = run_patterns(tmp_path / "run", n=n, window=w, dilations=(1, 2), n_global=g, sinks=s, random_blocks=1,
                          block=4, layers=2, heads=2, head_dim=8, kv_length=1000, kv_dtype="float16", time_n=64,
                          repeats=1, encoder=True, progress=lambda line: None)
    for name in ("patterns.md", "patterns.json", "patterns_masks.png", "patterns_reach.png"):
        assert (tmp_path / "run" / name).stat().st_size > 0
    assert json.loads((tmp_path / "run" / "patterns.json").read_text())["settings"]["window"] == w
    rows = {r["name"]: r for r in report["modes"]["decoder"]["rows"]}
    sliding = sum(min(i + 1, w) for i in range(n))
    assert rows["sliding"]["scores"] == sliding
    assert rows["sliding"]["density"] == pytest.approx(sliding / (n * (n + 1) / 2))
    assert rows["full"]["density"] == 1.0
    # sinks out of the window
    assert rows["sinks"]["scores"] == sliding + sum(min(s, max(0, i - w + 1)) for i in range(n))
    dil = (sliding + sum(min(i // 2 + 1, w) for i in range(n))) / 2
    assert rows["dilated"]["scores"] == dil
    assert rows["sliding"]["receptive"][-1]["farthest"] == 2 * (w - 1)
    assert rows["dilated"]["receptive"][-1]["farthest"] == (w - 1) * 3
    # KV cache: the formula and the check on the masks agree where the pattern bounds it
    per_key = 2 * 2 * 8 * 2  # K and V, heads, head_dim, float16
    kv = {k: r["kv"] for k, r in rows.items()}
    assert kv["sliding"]["keys_per_layer"] == w and kv["sliding"]["bytes"] == 2 * w * per_key
    assert kv["sinks"]["keys_per_layer"] == w + s
    assert kv["dilated"]["keys_per_layer"] == ((w - 1) * 1 + 1 + (w - 1) * 2 + 1) / 2
    assert kv["longformer"]["keys_per_layer"] == w + g
    assert not kv["bigbird"]["bounded"] and kv["bigbird"]["bytes"] == kv["full"]["bytes"] == 2 * 1000 * per_key
    for name in ("sliding", "sinks", "dilated", "longformer"):
        assert kv[name]["measured_keys_at_n"] == kv[name]["formula_keys_at_n"], name
    # timing: the limit is dense scores / pattern scores at time_n
    t = report["modes"]["decoder"]["timing"]["rows"]
    assert t["sliding"]["limit"] == pytest.approx((64 * 65 / 2) / sum(min(i + 1, w) for i in range(64)))
    assert t["sliding"]["ms"] > 0 and t["full"]["speedup"] == 1.0
    enc = {r["name"]: r for r in report["modes"]["encoder"]["rows"]}
    assert enc["longformer"]["hops"]["max"] <= 2 and "kv" not in enc["full"]
    md = render(report)
    assert (f"| sliding w=4 | {sliding} | {100 * sliding / (n * (n + 1) / 2):.2f}% |" in md
            and "## Encoder (bidirectional)" in md)


BAD = [({"window": 0}, "window"), ({"n": 16, "window": 32}, "window"), ({"dilations": (1, 0)}, "dilations"),
       ({"dilations": ()}, "dilations"), ({"n_global": 99, "n": 64, "window": 4}, "n_global"), ({"block": 0}, "block"),
       ({"layers": 0}, "layers"), ({"time_n": 8}, "time_n"), ({"kv_dtype": "int3"}, "kv_dtype"),
       ({"patterns": ("sliding", "nope")}, "patterns"), ({"n": 100000}, "n"), ({"device": "tpu"}, "device"),
       ({"repeats": 0}, "repeats")]


@pytest.mark.parametrize("bad,name", BAD)
def test_bad_settings_raise_config_error(tmp_path, bad, name):
    with pytest.raises(ConfigError, match=rf"\b{name}\b"):
        run_patterns(tmp_path / "x", **bad, progress=lambda line: None)
    assert not (tmp_path / "x").exists()  # refused before anything is written


def test_refuses_an_earlier_run_without_force(tmp_path):
    (tmp_path / "patterns.json").write_text("{}")
    with pytest.raises(ConfigError, match="--force"):
        run_patterns(tmp_path, progress=lambda line: None)
