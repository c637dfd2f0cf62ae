"""The grid of the AA-MoE experiment (``allhere_recipes.aamoe``): one resumable run folder per
(model, seed), which of them have finished, the mean and standard deviation over seeds of what they
measured, and the decision rule of docs/aamoe.md ("Deciding the claim")."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from allhere.validation import ConfigError

CKPT = "checkpoint.safetensors"
EVAL = "eval.json"  # a finished run's measurements, so that a later report does not evaluate it again
MIN_SEEDS = 3  # seeds a row needs before a comparison decides anything
EQUAL_FLOPS = 0.10  # rows within 10% of each other's forward FLOPs per token count as equal compute


def folder_name(name: str) -> str:
    """"AA-MoE B=2" -> "AA-MoE_B2": the model's folder under the run."""
    return name.replace(" ", "_").replace("=", "")


def cell_dir(run: Path, name: str, seed: int) -> Path:
    return Path(run) / folder_name(name) / f"seed{seed}"


def model_keys(names) -> dict[str, str]:
    """Short key -> model name: dense, all-attention, context-only, experts-only, aamoe-<B>."""
    keys = {}
    for name in names:
        head, _, budget = name.partition(" B=")
        keys[f"aamoe-{budget}" if head == "AA-MoE" else head] = name
    return keys


def select_models(names, wanted) -> list[str]:
    """The models ``wanted`` names (report names, short keys, folder names, or "aamoe" for every AA-MoE
    budget; any case), in the comparison's order; None: all. ConfigError naming what is unknown."""
    names = list(names)
    if wanted is None:
        return names
    lookup = {k.lower(): [v] for k, v in model_keys(names).items()}
    lookup.update({n.lower(): [n] for n in names})
    lookup.update({folder_name(n).lower(): [n] for n in names})
    lookup["aamoe"] = [n for n in names if n.startswith("AA-MoE")]
    chosen = set()
    for w in wanted:
        if str(w).strip().lower() not in lookup:
            raise ConfigError(f"--models {w!r} is not a model of this comparison: expected names or keys among "
                              f"{', '.join(model_keys(names))}, aamoe (every budget)")
        chosen.update(lookup[str(w).strip().lower()])
    return [n for n in names if n in chosen]


def check_seeds(seeds) -> tuple[int, ...]:
    """Seeds as given, repeats dropped; ConfigError for none or a value that is not an integer >= 0."""
    seeds = list(seeds)
    if not seeds or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds):
        raise ConfigError(f"--seeds {seeds!r} is invalid: expected one or more integers >= 0")
    return tuple(dict.fromkeys(seeds))


def cell_state(run: Path, name: str, seed: int, steps: int) -> tuple[str, int]:
    """("finished" | "partial" | "missing", steps done) of one (model, seed) run."""
    meta = Path(cell_dir(run, name, seed)) / "checkpoint.json"
    if not meta.exists():
        return "missing", 0
    try:
        step = int(json.loads(meta.read_text()).get("step", 0))
    except (ValueError, UnicodeDecodeError, AttributeError):
        return "partial", 0
    return ("finished" if step >= steps else "partial"), step


def seeds_on_disk(run: Path, names) -> set[int]:
    found = set()
    for name in names:
        folder = Path(run) / folder_name(name)
        if folder.is_dir():
            found.update(int(m.group(1)) for p in folder.iterdir() if (m := re.fullmatch(r"seed(\d+)", p.name)))
    return found


def stat(values) -> dict:
    """mean, sample standard deviation (None for one value) and count."""
    v = [float(x) for x in values]
    mean = sum(v) / len(v)
    std = math.sqrt(sum((x - mean) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else None
    return {"mean": mean, "std": std, "n": len(v)}


def aggregate(by_seed: dict[int, dict]) -> dict:
    """One model's rows of several seeds -> every number as ``stat``; per-layer statistics likewise, the
    budget histograms summed; "seeds": the seeds it holds."""
    rows = [by_seed[s] for s in sorted(by_seed)]
    out = {"seeds": sorted(by_seed), "mechanism": rows[0]["mechanism"]}
    for key, value in rows[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and all(key in r for r in rows):
            out[key] = stat(r[key] for r in rows)
    for key in ("layers", "predictor_layers"):
        if all(r.get(key) for r in rows):
            out[key] = [_aggregate_layer([r[key][i] for r in rows]) for i in range(len(rows[0][key]))]
    return out


def _aggregate_layer(layers: list[dict]) -> dict:
    out = {k: stat(lay[k] for lay in layers) for k, v in layers[0].items() if isinstance(v, (int, float))}
    width = max(len(lay["budget_histogram"]) for lay in layers)
    out["budget_histogram"] = [sum(lay["budget_histogram"][j] for lay in layers if j < len(lay["budget_histogram"]))
                               for j in range(width)]
    return out


def compare(ref: dict, other: dict, key: str, higher_is_better: bool = False) -> dict:
    """Is ``ref`` better than ``other`` on ``key`` by more than twice the larger of their standard
    deviations over seeds? verdict: "better", "worse" or "undecided" (also when a row has < MIN_SEEDS)."""
    a, b = ref.get(key), other.get(key)
    if a is None or b is None:
        return {"verdict": "undecided", "why": "not measured"}
    gain = (a["mean"] - b["mean"]) if higher_is_better else (b["mean"] - a["mean"])
    if min(a["n"], b["n"]) < MIN_SEEDS:
        return {"gain": gain, "verdict": "undecided", "why": f"needs >= {MIN_SEEDS} seeds per row"}
    margin = 2 * max(a["std"], b["std"])
    verdict = "better" if gain > margin else "worse" if -gain > margin else "undecided"
    return {"gain": gain, "margin": margin, "verdict": verdict}


def decide(rows: dict, task: str, side_budget: float) -> dict:
    """The comparisons of "Deciding the claim" that this task's rows allow (see docs/aamoe.md)."""
    ref_name = f"AA-MoE B={side_budget:g}"
    ref = rows.get(ref_name)
    out = {"reference": ref_name, "comparisons": [], "predictions": []}
    if ref is None:
        return out
    for side in ("context-only", "experts-only", "dense"):
        name = side if side == "dense" else f"{side} B={side_budget:g}"
        if name not in rows:
            continue
        other = rows[name]
        c = compare(ref, other, "bpb")
        ratio = lambda key: other[key]["mean"] / ref[key]["mean"]  # noqa: E731
        c.update(model=name, metric="bpb", flops_ratio=ratio("flops_per_token"), params_ratio=ratio("params"))
        c["equal_flops"] = abs(c["flops_ratio"] - 1) <= EQUAL_FLOPS
        c["equal_params"] = abs(c["params_ratio"] - 1) <= EQUAL_FLOPS
        out["comparisons"].append(c)
    if task == "mixed":
        for side, key, text in (("context-only", "acc_table", "context-only fails the table facts (a)"),
                                ("experts-only", "acc_context", "experts-only fails the in-context pairs (b)")):
            name = f"{side} B={side_budget:g}"
            if name in rows:
                c = compare(ref, rows[name], key, higher_is_better=True)
                out["predictions"].append({"prediction": text, "model": name, "metric": key, **c,
                                           "holds": c["verdict"] == "better"})
        for name in ("dense", ref_name):
            if name in rows and "acc_table" in rows[name]:
                accs = {k: rows[name][k]["mean"] for k in ("acc_table", "acc_context")}
                out["predictions"].append({"prediction": f"{name} does both (a) and (b): >= 50% on each",
                                           "model": name, **accs, "holds": min(accs.values()) >= 0.5})
    return out


def verdict(decision: dict) -> str:
    """One line: what this task's runs say about the claim at equal forward FLOPs."""
    side = [c for c in decision["comparisons"] if c["model"] != "dense"]
    if len(side) < 2:
        return "undecided: the reference or an ablation has no finished run"
    if any(c["verdict"] == "worse" for c in side):
        return "refuted on this task: an ablation beats AA-MoE by more than the margin"
    if not all(c["verdict"] == "better" and c["equal_flops"] for c in side):
        return "undecided on this task"
    if any(not p["holds"] for p in decision["predictions"]):
        return "undecided on this task: bits/byte favour AA-MoE but a prediction on the query kinds fails"
    return "supported on this task (confirmed only when the other task agrees)"
