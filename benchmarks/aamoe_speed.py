"""Training step time of AA-MoE against the dense transformer it is compared with, at the shapes of the
``allhere aamoe`` experiment, ratios measured round-robin in one run.

    python benchmarks/aamoe_speed.py                    # preset `cpu` (d = 96, 2 layers, 4 heads, B = 8, m = 8,
                                                        # E = 32) at T = 128 and T = 1024, 9 rounds
    python benchmarks/aamoe_speed.py --quick            # smoke run: the `tiny` preset, two rounds
    python benchmarks/aamoe_speed.py --profile aamoe    # where one step goes (torch.profiler, per-op table)

The models are the experiment's own (``allhere_recipes.aamoe.models``: "dense" = attention + SwiGLU FFN,
"AA-MoE B=2" = budget 2 per token, budgets from the sequence as in training), built as its ``train_model``
builds them, and one step is what ``allhere.train`` does per step: forward, ``training_loss`` (the
predictor's loss included), backward, gradient clipping, AdamW (``make_optimizer``, the experiment's
TrainConfig), zero_grad. Batches are byte windows of the embedded corpus (``sample_batch``). Each time is
the median over --repeats rounds; the order of the models rotates every round. The machine's load average
is printed before and after: on a shared 2-core machine a busy core stalls every parallel op of both models.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform

import torch

from allhere.config import ModelConfig, TrainConfig
from allhere.data.corpus import VOCAB_SIZE, sample_batch, stdlib_corpus
from allhere.losses import training_loss
from allhere.model import Decoder
from allhere.train import make_optimizer, model_lam
from allhere_recipes.aamoe import models as experiment_models
from allhere_recipes.aamoe import plan_for
from allhere_recipes.timing import round_robin_times


def build(plan, mech) -> Decoder:
    """As ``allhere_recipes.aamoe.train_model`` builds a model (before training)."""
    torch.manual_seed(plan.seed)
    return Decoder(ModelConfig(vocab_size=VOCAB_SIZE, d_model=plan.d_model, n_layers=plan.n_layers,
                               n_heads=plan.n_heads, mechanism=mech))


def step_fn(model: Decoder, plan, ids: torch.Tensor):
    """One step of ``allhere.train``'s loop (one micro-batch, CPU: no autocast)."""
    cfg = TrainConfig(steps=plan.steps, batch_size=plan.batch_size, lr=plan.lr, ckpt_every=plan.steps,
                      eval_every=0, device="cpu", seed=plan.seed, router_lr_mult=1.0)
    opt, lam = make_optimizer(model, cfg), model_lam(model, cfg)
    model.train()

    def step():
        loss = training_loss(model(ids), ids, lam)
        loss.total.backward()
        loss.total.item(), loss.lm.item()  # the loop logs both
        if cfg.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def cases(preset: str, lengths: list[int], budget: float):
    """(label, step) of the dense model and AA-MoE at ``budget``, for every length."""
    corpus = stdlib_corpus()
    out = []
    for length in lengths:
        plan = dataclasses.replace(plan_for(preset, budgets=[budget]), seq_len=length)
        mechs = experiment_models(plan)
        ids = sample_batch(corpus.train, plan.batch_size, length, torch.Generator().manual_seed(1))
        for name in ("dense", f"AA-MoE B={budget:g}"):
            out.append((name, length, step_fn(build(plan, mechs[name]), plan, ids)))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cpu", help="the experiment's preset (cpu | tiny)")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 1024], help="sequence lengths T")
    p.add_argument("--budget", type=float, default=2.0, help="AA-MoE budget per token")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny preset, T = 32 and 64, 2 rounds")
    p.add_argument("--profile", choices=["dense", "aamoe"], default=None,
                   help="print the per-op profile of one step of that model at the first length")
    a = p.parse_args(argv)
    if a.quick:
        a.preset, a.lengths, a.repeats = "tiny", [32, 64], 2
    runs = cases(a.preset, a.lengths, a.budget)
    if a.profile:
        name, length, step = [c for c in runs if (c[0] == "dense") == (a.profile == "dense")][0]
        step(), step()
        with torch.profiler.profile() as prof:
            step()
        print(f"# {name}, T = {length}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
        return
    plan = plan_for(a.preset)
    print(f"# torch {torch.__version__}, {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
          f"threads; preset {a.preset}: d={plan.d_model}, {plan.n_layers} layers, {plan.n_heads} heads, "
          f"B={plan.batch_size}, m={plan.chunk}, E={plan.experts}; load average {os.getloadavg()[0]:.2f} before")
    for _, _, step in runs:  # warm-up
        step()
    times = round_robin_times({i: step for i, (_, _, step) in enumerate(runs)}, a.repeats)
    med = [sorted(t)[len(t) // 2] for t in times.values()]
    print("| T | model | step ms (median) | / dense |")
    print("|---|---|---|---|")
    for i, (name, length, _) in enumerate(runs):
        dense = next(med[j] for j, c in enumerate(runs) if c[1] == length and c[0] == "dense")
        print(f"| {length} | {name} | {med[i] * 1e3:.1f} | {med[i] / dense:.2f}x |")
    print(f"# load average {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
