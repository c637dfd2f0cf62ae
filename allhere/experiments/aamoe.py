"""``allhere aamoe``: AA-MoE against a dense transformer, All-Attention, context-only and experts-only
budgets ("Attention Is All You Need 2: Seriously, All We Are Using Is Attention", Ohad Rubin), at small
scale, offline, on the embedded byte corpus.

Every model is trained from the same seed on the same batches for the same steps: a dense transformer
(attention + SwiGLU FFN), All-Attention ("Augmenting Self-attention with Persistent Memory",
arXiv:1907.01470; persistent memory instead of the FFN), AA-MoE with context chunks only (experts = 0)
and with experts only (no routed chunks), and AA-MoE at several budgets B (resources per token). Then on
held-out windows:
  - bits per byte with the sequence-level budgets (as trained; they read the whole sequence, so they
    are not a causal model) and with the causal budget predictor (honest: the number the goals use);
  - FLOPs per token counted from what runs (projections, attention over the keys actually read, FFN,
    routers and predictor, the output head) with the predictor's budgets;
  - the histogram of B_i, the split of the chosen resources between context and experts per layer,
    and how far the predictor's budgets drift from the sequence-level ones;
  - evaluation at 2x and 4x the training length (same tokens, longer windows) and at budgets B/2, 2B.
Writes report.md, report.json and the plots into ``<out>/aamoe``; trained models are reused from there.

The command line: ``allhere aamoe`` (``allhere.cli.runs``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ModelConfig, TrainConfig
from ..data.corpus import VOCAB_SIZE, eval_windows, sample_batch, stdlib_corpus
from ..losses import lm_loss
from ..mechanisms.aamoe import AAMoEConfig, aamoe_layers, set_budget_scale, set_budget_source, set_record
from ..mechanisms.allattention import AllAttentionConfig
from ..mechanisms.full import FullConfig
from ..model import Decoder
from ..runlock import run_lock
from ..train import train
from ..validation import ConfigError
from .report import goal_lines, write_report
from .rundir import check_out, claim


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
    eval_windows: int  # held-out windows of seq_len (the longer lengths use as many tokens)
    seed: int = 0


PRESETS = {
    "tiny": AAMoEPlan(d_model=32, n_layers=1, n_heads=2, seq_len=32, batch_size=4, steps=3, lr=3e-3, chunk=4,
                      experts=4, n_mem=16, budgets=(2.0,), side_budget=2.0, eval_windows=4),
    "cpu": AAMoEPlan(d_model=96, n_layers=2, n_heads=4, seq_len=128, batch_size=8, steps=300, lr=3e-3,
                         chunk=8, experts=32, n_mem=256, budgets=(1.0, 2.0, 4.0), side_budget=2.0,
                         eval_windows=24),
}


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
             batch: int = 8) -> dict:
    """bits per byte and, for AA-MoE, the budget statistics over ``windows``."""
    model.eval()
    layers = aamoe_layers(model)
    set_budget_source(model, source)
    set_budget_scale(model, scale)
    set_record(model, True)
    total, count = 0.0, 0
    acc = [dict(budget=[], used=[], chunks=[], experts=[], keys=[], predicted=[]) for _ in layers]
    for ids in windows.split(batch):
        out = model(ids)
        n = ids.shape[0] * (ids.shape[1] - 1)
        total += lm_loss(out.logits, ids).item() * n
        count += n
        for a, m in zip(acc, layers):
            s = m.stats
            for key in ("budget", "used", "chunks", "experts", "keys"):
                a[key].append(s[key].flatten().float())
            a["predicted"].append(s.get("predicted_budget", s["budget"]).flatten().float())
    set_record(model, False)
    set_budget_scale(model, 1.0)
    set_budget_source(model, "sequence")
    result = {"bits_per_byte": total / count / math.log(2)}
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


def train_model(run: Path, name: str, mech, plan: AAMoEPlan, corpus, device: str, progress: bool) -> Decoder:
    """A model with ``mech`` trained from the plan's seed on the same batches (reused when finished)."""
    torch.manual_seed(plan.seed)
    model = Decoder(ModelConfig(vocab_size=VOCAB_SIZE, d_model=plan.d_model, n_layers=plan.n_layers,
                                n_heads=plan.n_heads, mechanism=mech))
    cfg = TrainConfig(steps=plan.steps, batch_size=plan.batch_size, lr=plan.lr, ckpt_every=plan.steps,
                      log_every=max(1, plan.steps // 10), eval_every=0, device=device, seed=plan.seed,
                      router_lr_mult=1.0)
    batches = lambda step, micro, g: sample_batch(corpus.train, plan.batch_size, plan.seq_len, g)  # noqa: E731
    folder = name.replace(" ", "_").replace("=", "")
    train(model, batches, cfg, run / folder / "checkpoint.safetensors", resume=True, progress=progress)
    return model.to("cpu").eval()


def run_aamoe(out: str | Path = "runs/aamoe", preset: str = "cpu", device: str = "cpu", progress: bool = True,
              steps: int | None = None, budgets=None) -> dict:
    """Train every model of the comparison, evaluate, write report.md / report.json / plots."""
    t0 = time.time()
    plan = plan_for(preset, steps, budgets)
    with run_lock(out):  # one writer at a time
        check_out(out)
        run = Path(out) / "aamoe"
        corpus = stdlib_corpus()
        claim(run, {"plan": dataclasses.asdict(plan)})
        L = plan.seq_len
        windows = {f: eval_windows(corpus.val, L * f, max(1, plan.eval_windows // f)) for f in (1, 2, 4)}
        rows = {}
        for name, mech in models(plan).items():
            model = train_model(run, name, mech, plan, corpus, device, progress)
            routed = bool(aamoe_layers(model))
            row = {"mechanism": mech.kind, "params": sum(p.numel() for p in model.parameters())}
            causal = evaluate(model, windows[1], "predictor")
            row.update(bpb=causal["bits_per_byte"], flops_per_token=causal["flops_per_token"])
            row["bpb_2x"] = evaluate(model, windows[2], "predictor")["bits_per_byte"]
            row["bpb_4x"] = evaluate(model, windows[4], "predictor")["bits_per_byte"]
            if routed:
                seq = evaluate(model, windows[1], "sequence")
                row.update(bpb_sequence=seq["bits_per_byte"], layers=seq["layers"], predictor_layers=causal["layers"])
                for label, scale in (("half", 0.5), ("double", 2.0)):
                    r = evaluate(model, windows[1], "predictor", scale)
                    row[f"bpb_budget_{label}"], row[f"flops_budget_{label}"] = r["bits_per_byte"], r["flops_per_token"]
            rows[name] = row
        report = {"preset": preset, "plan": dataclasses.asdict(plan), "data": corpus.describe(), "rows": rows}
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
    """The document's central claim at this scale (causal bits/byte, predictor budgets)."""
    dense = rows["dense"]
    aamoe = {k: r for k, r in rows.items() if k.startswith("AA-MoE")}
    cheap = [r for r in aamoe.values() if r["flops_per_token"] <= 0.6 * dense["flops_per_token"]]
    best = min(cheap, key=lambda r: r["bpb"], default=None)
    same = aamoe.get(f"AA-MoE B={side_budget:g}")
    side = [r for k, r in rows.items() if k.startswith(("context-only", "experts-only"))]
    return {
        "an AA-MoE model within 3% of dense bits/byte at <= 60% of its FLOPs per token":
            best is not None and best["bpb"] <= 1.03 * dense["bpb"],
        f"AA-MoE B={side_budget:g} better than context-only and experts-only at the same budget":
            same is not None and all(same["bpb"] < r["bpb"] for r in side),
    }


def render(report: dict) -> str:
    rows = report["rows"]
    dense = rows["dense"]
    out = ["# AA-MoE against dense, All-Attention, context-only and experts-only", "",
           f"Preset `{report['preset']}`: {report['data']}. Plan: `{report['plan']}`.", "",
           "bits/byte on held-out windows with the causal budget predictor (the honest number); "
           "\"seq. budgets\" uses the non-causal sequence-level budgets the models were trained with. "
           "FLOPs per token: forward, counted from what runs (keys actually read), the output head included.", "",
           "| model | params | FLOPs/token | FLOPs vs dense | bits/byte | bits/byte, seq. budgets | 2x length | "
           "4x length | budget B/2 | budget 2B |", "|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda r, k: f"{r[k]:.4f}" if k in r else "-"  # noqa: E731
    for name, r in rows.items():
        out.append(f"| {name} | {r['params']:,} | {r['flops_per_token'] / 1e3:.0f}k | "
                   f"{100 * r['flops_per_token'] / dense['flops_per_token']:.0f}% | {r['bpb']:.4f} | "
                   f"{f(r, 'bpb_sequence')} | {r['bpb_2x']:.4f} | {r['bpb_4x']:.4f} | {f(r, 'bpb_budget_half')} | "
                   f"{f(r, 'bpb_budget_double')} |")
    out += ["", "Per AA-MoE layer (sequence-level budgets): mean B_i, share of the chosen resources that are "
            "context chunks / experts, histogram of B_i (tokens with 0, 1, 2, ... resources, in %), and the "
            "drift of the causal predictor (mean |B^_i - B_i|, share of tokens with B^_i = B_i):", "",
            "| model | layer | mean B_i | context | experts | histogram of B_i | drift mean abs | drift equal |",
            "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        for i, lay in enumerate(r.get("layers", [])):
            n = sum(lay["budget_histogram"])
            hist = " / ".join(f"{100 * c / n:.0f}" for c in lay["budget_histogram"][:9])
            out.append(f"| {name} | {i} | {lay['mean_budget']:.2f} | {100 * lay['context_share']:.0f}% | "
                       f"{100 * lay['expert_share']:.0f}% | {hist} | {lay['drift_mean_abs']:.2f} | "
                       f"{100 * lay['drift_equal']:.0f}% |")
    out += ["", "Goals (the document's central claim, at this scale):"] + goal_lines(report["goals"])
    if report.get("plots"):
        out += [""] + [f"![{p}]({p})" for p in report["plots"]]
    out.append(f"\n{report['seconds']:.0f} s.")
    return "\n".join(out) + "\n"
