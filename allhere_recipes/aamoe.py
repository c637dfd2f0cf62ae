"""``allhere aamoe``: AA-MoE against a dense transformer, All-Attention, context-only and experts-only
budgets ("Attention Is All You Need 2: Seriously, All We Are Using Is Attention", Ohad Rubin), at small
scale, offline, with several seeds.

Every model is trained with each seed (the seed sets the initialisation and the batches; every model of
a seed sees the same batches) for the same steps: a dense transformer (attention + SwiGLU FFN),
All-Attention ("Augmenting Self-attention with Persistent Memory", arXiv:1907.01470; persistent memory
instead of the FFN), AA-MoE with context chunks only (experts = 0) and with experts only (no routed
chunks), and AA-MoE at several budgets B (resources per token). Two tasks: ``stdlib`` (the embedded byte
corpus) and ``mixed`` (``allhere.data.mixed_recall``: facts of a fixed table that only parameters can
hold, and pairs stated in the sequence that only reading the context answers). Then on held-out windows:
  - bits per byte with the sequence-level budgets (as trained; they read the whole sequence, so they
    are not a causal model) and with the causal budget predictor (honest: the number the goals use);
    on the mixed task also the accuracy per kind of query;
  - FLOPs per token counted from what runs (projections, attention over the keys actually read, FFN,
    routers and predictor, the output head) with the predictor's budgets;
  - the histogram of B_i, the split of the chosen resources between context and experts per layer,
    and how far the predictor's budgets drift from the sequence-level ones;
  - evaluation at 2x and 4x the training length and at budgets B/2, 2B.
Each (model, seed) is its own resumable run folder ``<out>/aamoe/<model>/seed<k>``; a sitting trains the
models and seeds asked for, and the report (mean and standard deviation over seeds, the runs still
missing, the decision of docs/aamoe.md) covers whatever has finished. Writes report.md, report.json and
the plots into ``<out>/aamoe``.

The command line: ``allhere aamoe`` (``allhere.cli.runs``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from allhere.config import ModelConfig, TrainConfig
from allhere.data.corpus import VOCAB_SIZE, eval_windows, sample_batch, stdlib_corpus
from allhere.data.mixed_recall import KINDS, PAIR_ITEM, TABLE_ITEM, MixedTask, score
from allhere.losses import lm_loss
from allhere.mechanisms.aamoe import (
    AAMoEConfig,
    aamoe_layers,
    set_budget_scale,
    set_budget_source,
    set_record,
)
from allhere.mechanisms.allattention import AllAttentionConfig
from allhere.mechanisms.full import FullConfig
from allhere.model import Decoder
from allhere.runtime.model_checkpoint import load_model
from allhere.runtime.runlock import run_lock
from allhere.train import train
from allhere.validation import ConfigError

from .aamoe_grid import (
    CKPT,
    EVAL,
    aggregate,
    cell_dir,
    cell_state,
    check_seeds,
    decide,
    seeds_on_disk,
    select_models,
    verdict,
)
from .aamoe_render import render
from .report import write_report
from .rundir import check_out, claim, write_json


@dataclass(frozen=True)
class AAMoEPlan:
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    chunk: int  # m
    experts: int  # E
    n_mem: int  # All-Attention slots per head (E m: the same memory as AA-MoE)
    budgets: tuple  # AA-MoE budgets per token
    side_budget: float  # the budget of context-only and experts-only
    eval_windows: int  # held-out windows of seq_len (the longer lengths use as many tokens; mixed: 4x)
    seed: int = 0  # for scripts that train one model (benchmarks/aamoe_speed.py); the grid's seeds: run_aamoe


PRESETS = {
    "tiny": AAMoEPlan(d_model=32, n_layers=1, n_heads=2, seq_len=32, batch_size=4, steps=3, lr=3e-3, chunk=4,
                      experts=4, n_mem=16, budgets=(2.0,), side_budget=2.0, eval_windows=4),
    "cpu": AAMoEPlan(d_model=96, n_layers=2, n_heads=4, seq_len=128, batch_size=8, steps=300, lr=3e-3,
                     chunk=8, experts=32, n_mem=256, budgets=(1.0, 2.0, 4.0), side_budget=2.0,
                     eval_windows=24),
    # The runs that decide the claim: the cpu sizes trained until dense is below ~2.2 bits/byte on the
    # stdlib corpus (~4000 steps) and has learnt both kinds of query of the mixed task (the pairs after a
    # jump near step 6500). 10000 steps is an estimate from two dense runs of seed 0 (docs/aamoe.md), not a
    # measurement of every model; only the budget the ablations use, and 4x the held-out windows.
    "cpu-long": AAMoEPlan(d_model=96, n_layers=2, n_heads=4, seq_len=128, batch_size=8, steps=10000, lr=3e-3,
                          chunk=8, experts=32, n_mem=256, budgets=(2.0,), side_budget=2.0, eval_windows=96),
}
TASKS = ("stdlib", "mixed")
EVAL_SEED = 12345  # the held-out sequences of the mixed task
CKPT_EVERY = 250  # steps between checkpoints of a run (and always at its end)


def plan_for(preset: str, steps: int | None = None, budgets=None) -> AAMoEPlan:
    if preset not in PRESETS:
        raise ConfigError(f"preset = {preset!r} is invalid: expected one of {', '.join(PRESETS)}")
    plan = PRESETS[preset]
    if steps is not None:
        if not isinstance(steps, int) or steps < 1:
            raise ConfigError(f"steps = {steps!r} is invalid: expected an integer >= 1")
        plan = dataclasses.replace(plan, steps=steps)
    if budgets is not None:
        plan = dataclasses.replace(plan, budgets=tuple(float(b) for b in budgets))
        for b in plan.budgets:
            AAMoEConfig(budget=b)  # validated
    return plan


def models(plan: AAMoEPlan) -> dict:
    """name -> mechanism config of every model compared."""
    aamoe = lambda b, **kw: AAMoEConfig(chunk=plan.chunk, experts=plan.experts, budget=b, **kw)  # noqa: E731
    rows = {"dense": FullConfig(), "all-attention": AllAttentionConfig(n_mem=plan.n_mem),
            f"context-only B={plan.side_budget:g}": AAMoEConfig(chunk=plan.chunk, experts=0, budget=plan.side_budget),
            f"experts-only B={plan.side_budget:g}": aamoe(plan.side_budget, route_context=False)}
    rows.update({f"AA-MoE B={b:g}": aamoe(b) for b in plan.budgets})
    return rows


def flops_per_token(model: Decoder, n: int, keys: list | None) -> float:
    """Forward FLOPs per token (2 per multiply-add) at sequence length n: per layer the q/k/v/o
    projections, attention over the keys read (QK^T and PV), the FFN or the memory, routers and the
    budget predictor; then the output head. ``keys``: per AA-MoE layer the mean keys read per token."""
    cfg = model.cfg
    d, h, hd, hkv = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.kv_heads
    total, aamoe_i = 2.0 * d * cfg.vocab_size, 0
    for blk in model.blocks:
        mech = blk.attn.mechanism
        total += 2.0 * d * (2 * h * hd + 2 * hkv * hd)
        if blk.has_mlp:
            total += 2.0 * 3 * d * cfg.hidden
        causal = (n + 1) / 2  # mean keys of causal attention
        if mech.cfg.kind == "all_attention":
            total += 4.0 * h * hd * (causal + mech.cfg.n_mem)
        elif mech.cfg.kind == "aamoe":
            c = mech.cfg
            chunks_seen = ((n // c.chunk) - 1) / 2 if c.route_context else 0.0  # mean previous chunks
            total += 4.0 * h * hd * keys[aamoe_i] + 2.0 * d * d + 2.0 * d * (chunks_seen + c.experts) + 2.0 * d
            if mech.predictor is not None:
                total += 2.0 * (d * c.predictor_hidden + c.predictor_hidden)
            aamoe_i += 1
        else:
            total += 4.0 * h * hd * causal
    return total


@torch.no_grad()
def evaluate(model: Decoder, windows: torch.Tensor, source: str = "sequence", scale: float = 1.0,
             batch: int = 8, kinds: torch.Tensor | None = None) -> dict:
    """bits per byte and, for AA-MoE, the budget statistics over ``windows``; with ``kinds`` (the mixed
    task's answer positions) also "accuracy" per kind of query."""
    model.eval()
    layers = aamoe_layers(model)
    set_budget_source(model, source)
    set_budget_scale(model, scale)
    set_record(model, True)
    total, count = 0.0, 0
    acc = [dict(budget=[], used=[], chunks=[], experts=[], keys=[], predicted=[]) for _ in layers]
    hits = {name: [0, 0] for name in KINDS.values()}
    for i, ids in enumerate(windows.split(batch)):
        out = model(ids)
        n = ids.shape[0] * (ids.shape[1] - 1)
        total += lm_loss(out.logits, ids).item() * n
        count += n
        if kinds is not None:
            for name, (c, k) in score(out.logits, ids, kinds[i * batch:(i + 1) * batch]).items():
                hits[name][0] += c
                hits[name][1] += k
        for a, m in zip(acc, layers):
            s = m.stats
            for key in ("budget", "used", "chunks", "experts", "keys"):
                a[key].append(s[key].flatten().float())
            a["predicted"].append(s.get("predicted_budget", s["budget"]).flatten().float())
    set_record(model, False)
    set_budget_scale(model, 1.0)
    set_budget_source(model, "sequence")
    result = {"bits_per_byte": total / count / math.log(2)}
    if kinds is not None:
        result["accuracy"] = {name: c / k if k else float("nan") for name, (c, k) in hits.items()}
    if layers:
        per_layer = []
        for a in acc:
            t = {k: torch.cat(v) for k, v in a.items()}
            used = t["used"].sum().clamp_min(1.0)
            hist = torch.bincount(t["budget"].long(), minlength=1)
            per_layer.append({
                "mean_budget": t["budget"].mean().item(), "mean_used": t["used"].mean().item(),
                "context_share": (t["chunks"].sum() / used).item(), "expert_share": (t["experts"].sum() / used).item(),
                "mean_keys": t["keys"].mean().item(), "budget_histogram": hist.tolist(),
                "drift_mean_abs": (t["predicted"] - t["budget"]).abs().mean().item(),
                "drift_equal": (t["predicted"] == t["budget"]).float().mean().item(),
                "mean_predicted": t["predicted"].mean().item()})
        result["layers"] = per_layer
    result["flops_per_token"] = flops_per_token(model, windows.shape[1],
                                                [lay["mean_keys"] for lay in result.get("layers", [])])
    return result


def mixed_task(plan: AAMoEPlan, seq_len: int | None = None) -> MixedTask:
    """The mixed task of a plan: 4 pairs and 2 table queries per 128 bytes (at least 1 each), queried at
    least 4 chunks after the statements (2 where the sequence is too short), at ``seq_len`` (default the
    plan's; longer sequences keep the items and lengthen the filler)."""
    pairs, queries = max(1, plan.seq_len // 32), max(1, plan.seq_len // 64)
    room = plan.seq_len - 2 * PAIR_ITEM * pairs - TABLE_ITEM * queries
    gap = 4 * plan.chunk if room >= 4 * plan.chunk else 2 * plan.chunk
    return MixedTask(seq_len=seq_len or plan.seq_len, pairs=pairs, table_queries=queries, min_gap=gap)


def task_data(task: str, plan: AAMoEPlan) -> dict:
    """batches(step, micro, generator), held-out windows {1, 2, 4: (ids, kinds or None)}, a description
    and the task's settings."""
    corpus = stdlib_corpus()
    L = plan.seq_len
    if task == "stdlib":
        return {"batches": lambda step, micro, g: sample_batch(corpus.train, plan.batch_size, L, g),
                "windows": {f: (eval_windows(corpus.val, L * f, max(1, plan.eval_windows // f)), None)
                            for f in (1, 2, 4)},
                "describe": corpus.describe(), "settings": {}}
    t = mixed_task(plan)
    held_out = lambda f: mixed_task(plan, L * f).batch(max(1, 4 * plan.eval_windows // f),  # noqa: E731
                                                       torch.Generator().manual_seed(EVAL_SEED), corpus.val)
    return {"batches": lambda step, micro, g: t.batch(plan.batch_size, g, corpus.train)[0],
            "windows": {f: held_out(f) for f in (1, 2, 4)},
            "describe": f"mixed recall task {dataclasses.asdict(t)}, filler from {corpus.describe()}",
            "settings": {"mixed": dataclasses.asdict(t)}}


def train_model(run: Path, name: str, mech, plan: AAMoEPlan, batches, seed: int, device: str,
                progress: bool) -> Decoder:
    """A model with ``mech`` trained from ``seed`` on the seed's batches, resumed where it stopped."""
    torch.manual_seed(seed)
    model = Decoder(ModelConfig(vocab_size=VOCAB_SIZE, d_model=plan.d_model, n_layers=plan.n_layers,
                                n_heads=plan.n_heads, mechanism=mech))
    cfg = TrainConfig(steps=plan.steps, batch_size=plan.batch_size, lr=plan.lr,
                      ckpt_every=min(plan.steps, CKPT_EVERY), log_every=max(1, plan.steps // 10), eval_every=0,
                      device=device, seed=seed, router_lr_mult=1.0)
    train(model, batches, cfg, cell_dir(run, name, seed) / CKPT, resume=True, progress=progress)
    return model.to("cpu").eval()


def measure(model: Decoder, windows: dict) -> dict:
    """Every number of one trained model (one seed): a row of the report."""
    row = {"mechanism": model.cfg.mechanism.kind, "params": sum(p.numel() for p in model.parameters())}
    ids, kinds = windows[1]

    def put(suffix: str, r: dict) -> dict:
        row[f"bpb{suffix}"] = r["bits_per_byte"]
        row.update({f"acc_{k}{suffix}": v for k, v in r.get("accuracy", {}).items()})
        return r

    causal = put("", evaluate(model, ids, "predictor", kinds=kinds))
    row["flops_per_token"] = causal["flops_per_token"]
    for f in (2, 4):
        put(f"_{f}x", evaluate(model, windows[f][0], "predictor", kinds=windows[f][1]))
    if aamoe_layers(model):
        seq = put("_sequence", evaluate(model, ids, "sequence", kinds=kinds))
        row.update(layers=seq["layers"], predictor_layers=causal["layers"])
        for label, scale in (("half", 0.5), ("double", 2.0)):
            r = put(f"_budget_{label}", evaluate(model, ids, "predictor", scale, kinds=kinds))
            row[f"flops_budget_{label}"] = r["flops_per_token"]
    return row


def measured(run: Path, name: str, seed: int, plan: AAMoEPlan, model: Decoder | None, windows: dict) -> dict:
    """The row of a finished run: from its eval.json, else measured (``model`` or its checkpoint) and saved."""
    folder = cell_dir(run, name, seed)
    saved = folder / EVAL
    if saved.exists():
        try:
            data = json.loads(saved.read_text())
            if data.get("step") == plan.steps:
                return data["row"]
        except (ValueError, UnicodeDecodeError, KeyError, AttributeError):
            pass  # measured again below
    if model is None:
        model = load_model(folder / CKPT)[0].eval()
    row = measure(model, windows)
    write_json(saved, {"step": plan.steps, "row": row})
    return row


def training_curve(run: Path, name: str, seed: int) -> list[list[float]]:
    """[step, bits per byte] of a run's logged training steps (one batch's loss every tenth of the run,
    ``TrainConfig.log_every``), from its checkpoint's history."""
    history = json.loads((cell_dir(run, name, seed) / "checkpoint.json").read_text()).get("history", [])
    return [[h["step"], h["lm"] / math.log(2)] for h in history]


def run_aamoe(out: str | Path = "runs/aamoe", preset: str = "cpu", device: str = "cpu", progress: bool = True,
              steps: int | None = None, budgets=None, wanted=None, seeds=(0, 1, 2), task: str = "stdlib",
              train_runs: bool = True) -> dict:
    """Train the (model, seed) runs asked for (``wanted``: model names or keys, None = all; resumed where they
    stopped; none with ``train_runs=False``), then report on every run of the folder that has finished.
    Writes report.md / report.json / plots into ``<out>/aamoe``."""
    t0 = time.time()
    plan = plan_for(preset, steps, budgets)
    if task not in TASKS:
        raise ConfigError(f"task = {task!r} is invalid: expected one of {', '.join(TASKS)}")
    grid = models(plan)
    chosen, seeds = select_models(grid, wanted), check_seeds(seeds)
    with run_lock(out):  # one writer at a time
        check_out(out)
        run = Path(out) / "aamoe"
        data = task_data(task, plan)
        claim(run, {"plan": dataclasses.asdict(plan), "task": task, **data["settings"]})
        if train_runs:
            for name in chosen:
                for seed in seeds:
                    model = train_model(run, name, grid[name], plan, data["batches"], seed, device, progress)
                    measured(run, name, seed, plan, model, data["windows"])
        all_seeds = sorted(set(seeds) | seeds_on_disk(run, grid))
        runs, missing = {}, []
        for name in grid:
            for seed in all_seeds:
                state, step = cell_state(run, name, seed, plan.steps)
                if state == "finished":
                    runs.setdefault(name, {})[str(seed)] = measured(run, name, seed, plan, None, data["windows"])
                else:
                    missing.append({"model": name, "seed": seed, "state": state, "step": step})
        rows = {name: aggregate({int(s): r for s, r in by_seed.items()}) for name, by_seed in runs.items()}
        curves = {name: {s: training_curve(run, name, int(s)) for s in by_seed} for name, by_seed in runs.items()}
        report = {"preset": preset, "task": task, "plan": dataclasses.asdict(plan), "data": data["describe"],
                  "seeds": all_seeds, "rows": rows, "runs": runs, "curves": curves, "missing": missing}
        report["decision"] = decide(rows, task, plan.side_budget)
        report["verdict"] = verdict(report["decision"])
        report["goals"] = goals(rows, plan.side_budget)
        report["seconds"] = round(time.time() - t0, 1)
        try:
            from .aamoe_plots import write_plots

            report["plots"] = [p.name for p in write_plots(run, report)]
        except ImportError:
            report["plots"] = []
        write_report(run, "report", report, render(report))
    return report


def goals(rows: dict, side_budget: float) -> dict:
    """The document's central claim at this scale, on the seed means (causal bits/byte, predictor
    budgets); the decision with error bars is ``aamoe_grid.decide``."""
    mean = lambda r, k: r[k]["mean"]  # noqa: E731
    dense = rows.get("dense")
    aamoe = {k: r for k, r in rows.items() if k.startswith("AA-MoE")}
    cheap = [r for r in aamoe.values() if dense and mean(r, "flops_per_token") <= 0.6 * mean(dense, "flops_per_token")]
    best = min(cheap, key=lambda r: mean(r, "bpb"), default=None)
    same = aamoe.get(f"AA-MoE B={side_budget:g}")
    side = [r for k, r in rows.items() if k.startswith(("context-only", "experts-only"))]
    return {
        "an AA-MoE model within 3% of dense bits/byte at <= 60% of its FLOPs per token (seed means)":
            best is not None and mean(best, "bpb") <= 1.03 * mean(dense, "bpb"),
        f"AA-MoE B={side_budget:g} better than context-only and experts-only at the same budget (seed means)":
            same is not None and len(side) == 2 and all(mean(same, "bpb") < mean(r, "bpb") for r in side),
    }
