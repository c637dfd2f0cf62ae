"""One training step (AdamW) of ``allhere.Decoder`` against a plain PyTorch decoder of the same shape and
parameter count, ratios measured round-robin in one run.

    python benchmarks/train_step.py                 # the demo's stdlib shape: d = 192, 4 layers, 6 heads,
                                                    # B = 16, T = 256
    python benchmarks/train_step.py --profile aha   # where one step of a model goes (torch.profiler, per-op table)

The plain decoder (``PlainDecoder`` below, ~50 lines: RMSNorm, RoPE, SwiGLU, tied embeddings,
``F.scaled_dot_product_attention(is_causal=True)``) is the reference the ratios are taken against. Rows:
``Decoder`` with ``FullConfig`` and with ``AHAConfig(window=32)`` (routers at their "global" init plus the
L1 term in the loss, as training starts; the straight-through gate needs both outputs of every (token, head),
see docs/performance.md). Each time is the median over --repeats rounds; the order rotates every round. The
machine's load average is printed before and after.
"""

from __future__ import annotations

import argparse
import os
import platform

import torch
import torch.nn.functional as F
from torch import nn

import allhere as ah
from allhere.losses import training_loss
from allhere.model import apply_rope, rope_cos_sin
from allhere_recipes.timing import round_robin_times, timed_call


class PlainBlock(nn.Module):
    def __init__(self, d: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = nn.RMSNorm(d, eps=1e-5), nn.RMSNorm(d, eps=1e-5)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.gate_up = nn.Linear(d, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x, cos, sin):
        b, n, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, n, d))
        gate, up = self.gate_up(self.n2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class PlainDecoder(nn.Module):
    """The reference: what a careful user writes in plain PyTorch for the same model."""

    def __init__(self, cfg: ah.ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(PlainBlock(cfg.d_model, cfg.n_heads, cfg.hidden) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=1e-5)

    def forward(self, ids):
        cos, sin = rope_cos_sin(torch.arange(ids.shape[1]), self.cfg.d_model // self.cfg.n_heads, self.cfg.rope_theta)
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x) @ self.embed.weight.T


def step_fn(model, ids, lam: float):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        if isinstance(getattr(model, "_orig_mod", model), PlainDecoder):
            logits = model(ids)
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        else:
            loss = training_loss(model(ids), ids, lam).total
        loss.backward()
        opt.step()

    return step


def build(args):
    cfg = ah.ModelConfig(vocab_size=256, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads)
    torch.manual_seed(0)
    models = {"plain PyTorch": PlainDecoder(cfg), "Decoder + FullConfig": ah.Decoder(cfg)}
    aha = ah.Decoder(ah.ModelConfig(**{**cfg.__dict__, "mechanism": ah.AHAConfig(window=args.window)}))
    models[f"Decoder + AHAConfig(window={args.window})"] = aha
    counts = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    return models, counts


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--d-model", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--profile", choices=["plain", "full", "aha"], default=None)
    p.add_argument("--compile", action="store_true",
                   help="also time each model under torch.compile (inductor; compile time printed apart)")
    a = p.parse_args(argv)
    models, counts = build(a)
    if a.compile:
        for name in list(models):
            models[f"{name}, compiled"] = torch.compile(models[name])
            counts[f"{name}, compiled"] = counts[name]
    ids = torch.randint(0, 256, (a.batch, a.seq), generator=torch.Generator().manual_seed(1))
    steps = {name: step_fn(m, ids, 3e-4) for name, m in models.items()}
    if a.profile:
        name = [n for n in steps if n.lower().startswith({"plain": "plain", "full": "decoder + full",
                                                          "aha": "decoder + aha"}[a.profile])][0]
        steps[name]()
        with torch.profiler.profile() as prof:
            steps[name]()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        return
    print(f"# torch {torch.__version__}, {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
          f"threads; B={a.batch}, T={a.seq}, d={a.d_model}, {a.layers} layers, {a.heads} heads; load average "
          f"{os.getloadavg()[0]:.2f} before")
    for name, step in steps.items():  # warm-up (and compilation)
        _, first = timed_call(lambda step=step: (step(), step()))
        if a.compile:
            print(f"# {name}: first two steps {first:.1f} s")
    times = round_robin_times(steps, a.repeats)
    names = list(steps)
    ref = sorted(times[names[0]])[a.repeats // 2]
    print("| model | parameters | step ms (median) | / plain PyTorch |")
    print("|---|---|---|---|")
    for name in names:
        t = sorted(times[name])[a.repeats // 2]
        print(f"| {name} | {counts[name]:,} | {t * 1e3:.0f} | {t / ref:.2f}x |")
    print(f"# load average {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
