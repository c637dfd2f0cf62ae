"""``allhere patterns``: the sparse attention family side by side -- masks, cost and reach, measured.

For full causal attention, the sliding window, window + sinks, a dilated window on a per-layer schedule,
Longformer (window + global tokens) and BigBird (window, global and random blocks), in the decoder and
optionally the encoder version (``sparse_family``):

  - ``patterns_masks.png``: the masks at n = 64, edges coloured by component;
  - per pattern: scores (allowed query-key pairs of a layer) and density against dense attention; the
    receptive field after L layers by reachability over the masks (``sparse_graph``) against the rule of
    thumb L x w; hops between token pairs (shortest paths; BigBird's small-diameter claim); KV-cache
    bytes at a generation length; the time of the block-sparse op (``allhere.ops.blocksparse``) against
    dense SDPA measured in the same run, with the limit dense scores / pattern scores;
  - ``patterns.md``, ``patterns.json`` and ``patterns_reach.png`` (receptive field against depth).

Papers: "Longformer: The Long-Document Transformer" (arXiv:2004.05150), "Big Bird: Transformers for
Longer Sequences" (arXiv:2007.14062), "Efficient Streaming Language Models with Attention Sinks"
(arXiv:2309.17453).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from allhere import masks
from allhere.ops.blocksparse import blocksparse_attention, plan_blocks
from allhere.runtime.runlock import run_lock
from allhere.validation import ConfigError, check, check_int

from . import sparse_graph as graph
from .report import write_report
from .sparse_family import (
    KV_DTYPES,
    NAMES,
    PatternSettings,
    build,
    figure_settings,
    layer_masks,
)
from .sparse_plot import mask_figure, receptive_figure
from .timing import median_time, ms_text

MODES = {"decoder": True, "encoder": False}  # mode -> causal


def run_patterns(out: str | Path = "runs/patterns", n: int = 2048, window: int = 128, dilations=(1, 2, 4, 8),
                 n_global: int = 64, sinks: int = 4, random_blocks: int = 3, block: int = 64, layers: int = 4,
                 heads: int = 8, head_dim: int = 64, kv_length: int = 32768, kv_dtype: str = "bfloat16",
                 time_n: int = 4096, repeats: int = 5, encoder: bool = False, device: str = "cpu", seed: int = 0,
                 patterns=NAMES, force: bool = False, progress=print) -> dict:
    """Analyse the family; write patterns.md, patterns.json, patterns_masks.png and patterns_reach.png
    into ``out``; return the report (``render`` turns it into the markdown).

    Command line (``allhere patterns``), one option per argument, defaults as here:

      --out PATH            folder for patterns.md / .json / _masks.png / _reach.png (default runs/patterns)
      --force               replace the results of an earlier run in --out (default: refuse)
      --n N                 sequence length of the graph figures: scores, receptive field, hops (default 2048)
      --window W            window w, the current token included (default 128)
      --dilations D [D ...] dilation schedule of the dilated pattern, layer l uses D[l mod len] (default 1 2 4 8)
      --global-tokens G     global tokens of Longformer (BigBird: ceil(G / block) global blocks) (default 64;
                            dest n_global: ``global`` is a Python keyword)
      --sinks S             attention sinks of the sliding + sinks pattern (default 4)
      --random-blocks R     BigBird random blocks per query block (default 3)
      --block B             BigBird block, and the tile of the block-sparse op (default 64)
      --layers L            layers of the receptive field (BigBird draws its random blocks per layer) (default 4)
      --heads H             heads: BigBird draws per head; KV cache and timing (default 8)
      --head-dim D          head dimension of the KV cache and the timing (default 64)
      --kv-length T         generation length of the KV-cache figures (default 32768)
      --kv-dtype DTYPE      float32, bfloat16, float16 or float8: bytes per cached value (default bfloat16)
      --time-n N            sequence length of the timing, 0 to skip it (default 4096)
      --repeats K           timed calls per measurement, median (default 5)
      --encoder             also the bidirectional (encoder) version of every pattern
      --device DEV          device of the timing: cpu or cuda[:N] (default cpu)
      --seed SEED           seed of BigBird's random blocks (default 0)
      --patterns NAME ...   some of full sliding sinks dilated longformer longformer-spread bigbird (default all)
    """
    settings = PatternSettings(n=n, window=window, dilations=dilations, n_global=n_global, sinks=sinks,
                               random_blocks=random_blocks, block=block, layers=layers, heads=heads, seed=seed)
    check_int("patterns", "head_dim", head_dim, 1)
    check_int("patterns", "kv_length", kv_length, 1)
    check(kv_dtype in KV_DTYPES, "patterns", "kv_dtype", kv_dtype, f"one of {', '.join(KV_DTYPES)}")
    check_int("patterns", "time_n", time_n, 0)
    check(time_n == 0 or time_n >= max(window, block), "patterns", "time_n", time_n,
          f"0 (no timing) or at least the window and the block ({max(window, block)})")
    check_int("patterns", "repeats", repeats, 1)
    check(device == "cpu" or (device.startswith("cuda") and torch.cuda.is_available()), "patterns", "device",
          device, "cpu, or cuda[:N] on a machine with a CUDA device")
    patterns = tuple(patterns)
    check(bool(patterns) and all(p in NAMES for p in patterns) and len(set(patterns)) == len(patterns),
          "patterns", "patterns", patterns, f"distinct names among {', '.join(NAMES)}")
    out = Path(out)
    if (out / "patterns.json").exists() and not force:
        raise ConfigError(f"--out {out} holds the results of an earlier patterns run; pass --force to replace them, "
                          "or choose another folder (nothing was written)")
    modes = [m for m in MODES if m == "decoder" or encoder]
    report = {"settings": {**dataclasses.asdict(settings), "head_dim": head_dim, "kv_length": kv_length,
                           "kv_dtype": kv_dtype, "time_n": time_n, "repeats": repeats, "device": device,
                           "patterns": list(patterns), "modes": modes,
                           "window_blocks": settings.window_blocks, "global_blocks": settings.global_blocks},
              "torch": torch.__version__, "modes": {}}
    with run_lock(out):  # one writer at a time
        for mode in modes:
            report["modes"][mode] = analyse_mode(settings, MODES[mode], patterns, head_dim, kv_length, kv_dtype,
                                                 time_n, repeats, device, progress, label=mode)
        report["figures"] = {"masks": str(draw_masks(settings, patterns, modes, out / "patterns_masks.png")),
                             "reach": str(draw_reach(report, out / "patterns_reach.png"))}
        write_report(out, "patterns", report, render(report))
    progress(f"written to {out}/patterns.md, patterns.json, patterns_masks.png, patterns_reach.png")
    return report


def analyse_mode(s: PatternSettings, causal: bool, names, head_dim: int, kv_length: int, kv_dtype: str,
                 time_n: int, repeats: int, device: str, progress=print, label: str = "decoder") -> dict:
    """Every figure of the table for one mode (causal or encoder)."""
    rows = []
    dense = s.n * (s.n + 1) // 2 if causal else s.n * s.n
    for p in build(s, causal, s.n, names):
        t0 = time.perf_counter()
        cycle = [layer_masks(p, s.n, l, s.heads) for l in range(p.period)]
        _check_whole(p, cycle, s)
        row = {"name": p.name, "title": p.title, "per_head": p.per_head, "period": p.period}
        row["scores"] = graph.scores(cycle)
        row["density"] = row["scores"] / dense
        if p.per_head:
            row["scores_per_head"] = [int(x) for x in cycle[0].reshape(cycle[0].shape[0], -1).sum(1)]
        g = graph.propagate(lambda l, cycle=cycle: graph.union_heads(cycle[l]), p.period, s.n, s.layers, causal,
                            progress=progress)
        row["receptive"] = g.receptive
        row["hops"] = g.hops()
        row["layers_propagated"] = g.steps
        if p.per_head:  # one head's graph, as in BigBird's graph argument
            row["hops_one_head"] = graph.propagate(lambda l, cycle=cycle: cycle[l][0], p.period, s.n, s.layers,
                                                   causal).hops()
        if causal:
            row["kv"] = kv_cache(p, s, kv_length, kv_dtype, head_dim)
            row["kv"]["measured_keys_at_n"], row["kv"]["formula_keys_at_n"] = kv_measured(p, s)
        progress(f"{label}: {p.name}: {row['density']:.1%} dense, reach {g.receptive[-1]['max_positions']} "
                 f"positions after {s.layers} layers, hops mean {_num(row['hops']['mean'])} max {row['hops']['max']} "
                 f"({time.perf_counter() - t0:.1f} s)")
        rows.append(row)
    rule = [l * s.window for l in range(1, s.layers + 1)]  # how far L layers reach, by the rule of thumb L x w
    result = {"causal": causal, "dense_scores": dense, "rule_of_thumb": rule,
              "rows": rows}
    if time_n:
        result["timing"] = time_patterns(s, causal, names, head_dim, time_n, repeats, device, progress, label)
    return result


def _check_whole(p, cycle, s: PatternSettings) -> None:
    """The components OR-ed are the pattern of ``allhere.masks`` (what the op and the models run)."""
    if p.whole is None:
        return
    for l, m in enumerate(cycle):
        whole = masks.dense_mask(p.whole(l), s.n, s.n, heads=m.shape[0])[0]
        if not torch.equal(whole, m):
            raise AssertionError(f"the components of {p.name} do not make allhere.masks' pattern (layer {l})")


def kv_cache(p, s: PatternSettings, length: int, dtype: str, head_dim: int) -> dict:
    """Keys each layer keeps at generation length ``length`` (the formula of the pattern) and the bytes of
    K and V over ``layers`` layers."""
    keys = [p.kv_keys(length, l) if p.kv_keys else length for l in range(s.layers)]
    per_key = 2 * s.heads * head_dim * KV_DTYPES[dtype]  # K and V
    return {"length": length, "keys_per_layer": sum(keys) / len(keys), "bounded": p.kv_keys is not None,
            "bytes": sum(keys) * per_key, "full_bytes": length * s.layers * per_key, "note": p.kv_note}


def kv_measured(p, s: PatternSettings) -> tuple[float, float]:
    """(measured, formula) keys per layer at generation length n: the keys among the first n that some
    query of the next n positions (n - 1 .. 2n - 2) reads, any head -- a check of the formula on the masks."""
    n, got = s.n, []
    for l in range(s.layers):
        m = masks.dense_mask(p.mask_fn(l), n, n, q_offset=n - 1, heads=s.heads if p.per_head else 1)[0]
        got.append(int(m.any(0).any(0).sum()))
    formula = [p.kv_keys(n, l) if p.kv_keys else n for l in range(s.layers)]
    return sum(got) / len(got), sum(formula) / len(formula)


def time_patterns(s: PatternSettings, causal: bool, names, head_dim: int, n: int, repeats: int, device: str,
                  progress=print, label: str = "decoder") -> dict:
    """Median time of one attention layer (B = 1, ``heads`` x ``head_dim``) per pattern through the
    block-sparse op, against dense SDPA (causal or not) timed alternately with it (``paired_times``): the
    speed-up is the median over adjacent (dense, pattern) pairs of their ratio (for the dilation schedule:
    over its layers, dense time / mean layer time). The limits are dense scores / pattern scores and dense
    tiles / pattern tiles. The plan is built once per pattern (its time is reported apart: a model builds it
    once for all layers and steps)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, s.heads, n, head_dim, generator=g, device=device, dtype=dtype) for _ in range(3))

    def dense_fn():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    base = plan_blocks(masks.sliding_window(n, causal), n, n, heads=s.heads, block=s.block, device=device)  # dense
    dense_scores = n * (n + 1) // 2 if causal else n * n
    rows, dense_all = {}, []
    for p in build(s, causal, n, names):
        if p.name == "full":
            continue
        # Layers of the cycle that differ in cost (the dilation schedule); BigBird's layers cost the same.
        per_layer = []
        for l in range(p.period) if p.name == "dilated" else range(1):
            pred = p.mask_fn(l)
            t0 = time.perf_counter()
            plan = plan_blocks(pred, n, n, heads=s.heads, block=s.block, device=device)
            plan_ms = 1e3 * (time.perf_counter() - t0)
            with torch.no_grad():
                dense, ms = paired_times(dense_fn, lambda plan=plan: blocksparse_attention(q, k, v, plan), repeats,
                                         device)
            dense_all += dense
            per_layer.append({"layer": l, "ms": 1e3 * statistics.median(ms), "dense_ms": 1e3 * statistics.median(dense),
                              "speedup": statistics.median(d / t for d, t in zip(dense, ms)),  # per adjacent pair
                              "plan_ms": plan_ms, "scores": _scores(pred, n, s.heads if p.per_head else 1, device),
                              "tiles": plan.kept_tiles})
        ms, dense_ms = _mean(per_layer, "ms"), _mean(per_layer, "dense_ms")
        speedup = len(per_layer) / sum(1 / x["speedup"] for x in per_layer)  # dense time over the mean layer time
        rows[p.name] = {"ms": ms, "dense_ms": dense_ms, "speedup": speedup,
                        "limit": dense_scores / _mean(per_layer, "scores"),
                        "tile_limit": base.kept_tiles / _mean(per_layer, "tiles"),
                        "plan_ms": _mean(per_layer, "plan_ms"),
                        "how": "allhere.ops.blocksparse", "per_layer": per_layer}
        progress(f"{label}: {p.name} at n = {n}: {ms_text(ms)} against dense SDPA {ms_text(dense_ms)}: {speedup:.2f}x "
                 f"(limit {rows[p.name]['limit']:.1f}x scores, {rows[p.name]['tile_limit']:.1f}x tiles)")
    if not dense_all:  # only the full pattern asked for
        with torch.no_grad():
            dense_all = paired_times(dense_fn, dense_fn, repeats, device)[0]
    dense_ms = 1e3 * statistics.median(dense_all)
    if "full" in names:
        rows = {"full": {"ms": dense_ms, "dense_ms": dense_ms, "speedup": 1.0, "limit": 1.0, "tile_limit": 1.0,
                         "plan_ms": 0.0, "how": "dense SDPA itself"}, **rows}
    progress(f"{label}: dense SDPA at n = {n}: {ms_text(dense_ms)} (median of {len(dense_all)} calls)")
    return {"n": n, "heads": s.heads, "head_dim": head_dim, "dtype": str(dtype).replace("torch.", ""),
            "device": device, "dense_ms": dense_ms, "repeats": repeats, "rows": rows}


def _mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def paired_times(first, second, repeats: int, device: str) -> tuple[list, list]:
    """Seconds of ``repeats`` calls of each callable, alternating (after one warm-up call each), so that a
    load coming and going on a shared machine falls on both alike."""
    first(), second()
    a, b = [], []
    for _ in range(repeats):
        a.append(median_time(first, 1, warmup=0, device=device))
        b.append(median_time(second, 1, warmup=0, device=device))
    return a, b


def _scores(pred, n: int, heads: int, device: str) -> float:
    """Allowed pairs of ``pred`` on n x n, the mean over ``heads`` heads (a head at a time: small memory)."""
    total = 0
    for h in range(heads):
        hh = torch.tensor(h, device=device).view(1, 1, 1, 1)
        q = torch.arange(n, device=device).view(1, 1, -1, 1)
        total += int(pred(torch.zeros_like(hh), hh, q, q.view(1, 1, 1, -1)).expand(1, 1, n, n).sum())
    return total / heads


def draw_masks(s: PatternSettings, names, modes, path: Path) -> Path:
    """patterns_masks.png: every pattern at n = 64 (``figure_settings``), one row per mode."""
    f = figure_settings(s)
    shown = next((l for l, d in enumerate(f.dilations) if d > 1), 0)  # the first layer with a real dilation
    rows = {}
    for mode in modes:
        panels = []
        for p in build(f, MODES[mode], f.n, names):
            layer = shown if p.name == "dilated" else 0
            parts = {k: m[0] for k, m in layer_masks(p, f.n, layer, 1, by_kind=True).items()}
            union = torch.stack(list(parts.values())).any(0)
            dense = f.n * (f.n + 1) // 2 if MODES[mode] else f.n * f.n
            title = (p.title if p.name != "dilated"
                     else f"dilated w={f.window}, d={f.dilations[layer]} (layer {layer + 1})")
            panels.append({"title": title, "density": float(union.sum()) / dense, "components": parts})
        rows["decoder (causal)" if MODES[mode] else "encoder"] = panels
    return mask_figure(rows, path, f"n = {f.n}, w = {f.window}, {f.n_global} global tokens, {f.sinks} sinks, "
                                   f"BigBird blocks of {f.block} (head 0, layer shown)")


def draw_reach(report: dict, path: Path) -> Path:
    curves = {mode: {r["name"]: [x["max_positions"] for x in r["receptive"]] for r in m["rows"]}
              for mode, m in report["modes"].items()}
    # positions within reach by the rule of thumb: L x w back (and as many ahead in an encoder)
    rules = {mode: [x * (1 if m["causal"] else 2) for x in m["rule_of_thumb"]] for mode, m in report["modes"].items()}
    return receptive_figure(curves, rules, path)


# Markdown ----------------------------------------------------------------------------------------------

def _num(x, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _share(x: float) -> str:
    """A share as a percentage, two significant digits below 1%: 0.0005 -> "0.05%"."""
    return f"{100 * x:.2g}%" if x < 0.01 else f"{100 * x:.1f}%"


def _bytes(b: float) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if b >= size:
            return f"{b / size:.1f} {unit}"
    return f"{b:.0f} B"


def render(report: dict) -> str:
    """patterns.md: settings, the figure, per mode the structure table and the cost table, the reading."""
    s = report["settings"]
    L, w, n = s["layers"], s["window"], s["n"]
    out = ["# Sparse attention patterns, measured", "",
           f"n = {n}, w = {w} (the current token included), dilation schedule {','.join(map(str, s['dilations']))}, "
           f"{s['n_global']} global tokens, {s['sinks']} sinks, BigBird blocks of {s['block']} "
           f"({s['window_blocks']} window, {s['global_blocks']} global, {s['random_blocks']} random), L = {L} layers, "
           f"{s['heads']} heads. torch {report['torch']}.", "",
           "![masks](patterns_masks.png)", ""]
    for m in report["modes"].values():
        causal = m["causal"]
        out += [f"## {'Decoder (causal)' if causal else 'Encoder (bidirectional)'}", ""]
        out += structure_table(m, s, causal) + [""]
        out += cost_table(m, s, causal) + [""]
    out += reading(report)
    return "\n".join(out) + "\n"


def structure_table(m: dict, s: dict, causal: bool) -> list[str]:
    L, n = s["layers"], s["n"]
    dense = "dense causal" if causal else "dense"
    far = "farthest back" if causal else "farthest"
    lines = [f"Scores: allowed (query, key) pairs of one layer at n = {n} (mean over heads and the layers of a "
             f"schedule). Receptive field after L = {L} layers: input positions a token depends on (residual "
             f"stream included; heads united), the most over tokens ({'the last token' if causal else 'a middle token'}"
             f") and the mean, and the {far} position reached, against the rule of thumb L x w. "
             f"Hops: layers needed to connect a pair ({'i > j' if causal else 'i != j'}), over all pairs.", "",
             f"| pattern | scores / layer | density vs {dense} | positions after L: most | mean "
             f"| {far} (rule of thumb {m['rule_of_thumb'][-1]:,}) | hops mean | hops max | never connected |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in m["rows"]:
        rf = r["receptive"][-1]
        h = r["hops"]
        lines.append(f"| {r['title']} | {r['scores']:,.0f} | {100 * r['density']:.2f}% | {rf['max_positions']:,} "
                     f"({100 * rf['max_positions'] / n:.0f}%) | {rf['mean_positions']:,.0f} | {rf['farthest']:,} "
                     f"| {_num(h['mean'])} | {h['max'] if h['max'] is not None else 'n/a'} "
                     f"| {100 * h['unreachable_share']:.1f}% |")
    one = [r for r in m["rows"] if "hops_one_head" in r]
    for r in one:
        h = r["hops_one_head"]
        lines += ["", f"{r['title']}, one head alone (random blocks are drawn per head; the table unites the "
                      f"{s['heads']} heads): hops mean {_num(h['mean'])}, max {h['max']}, never connected "
                      f"{100 * h['unreachable_share']:.1f}%."]
    return lines


def cost_table(m: dict, s: dict, causal: bool) -> list[str]:
    t = m.get("timing")
    lines = []
    head = "| pattern |"
    sep = "|---|"
    if causal:
        kv = m["rows"][0]["kv"]
        lines.append(f"KV cache at generation length T = {kv['length']:,}: keys each layer keeps, and the bytes of "
                     f"K and V over {s['layers']} layers ({s['heads']} heads x {s['head_dim']} dims, {s['kv_dtype']}). "
                     f"Checked on the masks at T = n = {s['n']}: keys among the first n that a query of the next n "
                     f"positions reads.")
        lines.append("")
        head += " KV keys / layer | KV bytes | of full | check at T = n: measured (formula) |"
        sep += "---|---|---|---|"
    if t:
        lines.append(f"Time of one layer at n = {t['n']} (B = 1, {t['heads']} heads x {t['head_dim']}, {t['dtype']}, "
                     f"{t['device']}, median of {t['repeats']}): the block-sparse op (``allhere.ops.blocksparse``, "
                     f"tiles of {s['block']}) against dense SDPA ({'causal' if causal else 'bidirectional'}) timed "
                     f"alternately with each pattern in the same run ({ms_text(t['dense_ms'])}: the median of all its "
                     f"calls); the speed-up is the median ratio of adjacent dense and pattern calls. "
                     f"Limit: dense scores / pattern scores; tile limit: dense tiles / tiles the op computes.")
        head += " time | vs dense SDPA | limit (scores) | limit (tiles) |"
        sep += "---|---|---|---|"
    if not lines:
        return []
    lines += ["", head, sep]
    for r in m["rows"]:
        cells = [r["title"]]
        if causal:
            kv = r["kv"]
            keys = f"{kv['keys_per_layer']:,.0f}" if kv["bounded"] else f"{kv['keys_per_layer']:,.0f} (all: unbounded)"
            cells += [keys, _bytes(kv["bytes"]), _share(kv["bytes"] / kv["full_bytes"]),
                      f"{kv['measured_keys_at_n']:,.0f} ({kv['formula_keys_at_n']:,.0f})"]
        if t:
            tr = t["rows"].get(r["name"])
            cells += ([ms_text(tr['ms']), f"{tr['speedup']:.2f}x", f"{tr['limit']:.1f}x", f"{tr['tile_limit']:.1f}x"]
                      if tr else ["n/a"] * 4)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def reading(report: dict) -> list[str]:
    """How to read the tables, with this run's numbers."""
    s = report["settings"]
    L, w, dil = s["layers"], s["window"], s["dilations"]
    rows = {r["name"]: r for r in report["modes"]["decoder"]["rows"]}
    enc = {r["name"]: r for r in report["modes"].get("encoder", {}).get("rows", [])}
    out = ["## Reading the tables", ""]
    if "sliding" in rows:
        got = rows["sliding"]["receptive"][-1]
        out.append(f"- **Receptive field: L (w - 1), not L x w.** The window holds the current token, so each layer "
                   f"reaches w - 1 = {w - 1} positions further back: after {L} layers the sliding window reaches "
                   f"{L} x {w - 1} = {L * (w - 1)} back "
                   f"({got['farthest']} measured, {got['max_positions']} positions), "
                   f"not {L * w}. Tokens d apart are ceil(d / (w - 1)) hops apart.")
    if "dilated" in rows:
        sched = [dil[l % len(dil)] for l in range(L)]
        got = rows["dilated"]["receptive"][-1]
        holes = "no holes" if got["max_positions"] == got["farthest"] + 1 else "with holes"
        out.append(f"- **Dilation schedule.** Layer l reaches (w - 1) d_l further back: (w - 1) x "
                   f"({' + '.join(map(str, sched))}) = {(w - 1) * sum(sched)} after {L} layers ({got['farthest']} "
                   f"measured, {got['max_positions']} positions: {holes}). The reach has no holes while each stride is "
                   f"at most one more than the span of the layers below it (1, 2, 4, 8 for any w >= 2); a dilation "
                   f"d > 1 alone never connects tokens whose distance is not a multiple of d.")
    lead = [n for n in ("sinks", "longformer") if n in rows]
    if lead:
        said = "; ".join(f"{rows[n]['title']}: max {rows[n]['hops']['max']} hops, "
                         f"{rows[n]['receptive'][-1]['max_positions']} positions" for n in lead)
        base = (f" (sliding alone: max {rows['sliding']['hops']['max']} hops, "
                f"{rows['sliding']['receptive'][-1]['max_positions']} positions)") if "sliding" in rows else ""
        out.append(f"- **Sinks and leading globals in a decoder.** Every query reads the first tokens, so the farthest "
                   f"position reached is the sequence start from the first layer on, yet they add little more than "
                   f"their own positions and hardly shorten paths: a causal global token sees only what precedes it, "
                   f"so no path through it carries a later token. Measured: {said}{base}.")
    if "longformer" in enc or "longformer-spread" in rows:
        parts = []
        if "longformer" in enc:
            parts.append(f"in the encoder with the globals first "
                         f"(max {enc['longformer']['hops']['max']} hops measured)")
        if "longformer-spread" in rows:
            parts.append(f"in a decoder only with globals spread along the sequence (max "
                         f"{rows['longformer-spread']['hops']['max']} hops measured, window >= their spacing) -- at "
                         f"the price of an unbounded KV cache, since a later global query reads every key")
        out.append("- **Globals connect everything in 2 hops** when a global token sits between j and i: "
                   + "; ".join(parts) + ".")
    if "bigbird" in rows:
        h = rows["bigbird"]["hops"]
        one = rows["bigbird"].get("hops_one_head", h)
        out.append(f"- **BigBird's small diameter.** Random blocks make the graph an expander: hops mean "
                   f"{_num(h['mean'])}, max {h['max']} with the {s['heads']} heads united ({_num(one['mean'])} and "
                   f"{one['max']} for one head alone, whose graph the paper's argument is about). Its KV cache cannot "
                   f"be bounded: the random blocks of later queries range over the whole past.")
    out.append("- **KV cache.** Sliding: w keys per layer; sinks: sinks + w; dilated: (w - 1) d + 1 per layer (the "
               "window spans that much, and later queries read the keys in between); Longformer with leading "
               "globals: w + g; full, BigBird and spread globals: every key.")
    t = report["modes"]["decoder"].get("timing")
    if t:
        out.append("- **Time.** The op computes whole tiles: a dilated window touches every tile of its span while "
                   "reading 1 key in d, and a global query in a tile makes the op compute that tile's whole row "
                   "(spread globals: one in every tile), so the tile limit sits below the score limit. Each pattern "
                   "is timed alternately with dense SDPA and the speed-up is the median ratio of adjacent calls, so "
                   "a load that comes and goes on a shared machine falls on both alike; the plan (built once per "
                   "pattern, reused across layers and steps) is not in the time.")
    return out + [""]
