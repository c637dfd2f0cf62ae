"""SFT training throughput: a converted AHA model against the same model with plain SDPA, in one run.

    python benchmarks/sft_throughput.py --device cuda             # ~110M Llama-shaped model, bf16, 2048 tokens
    python benchmarks/sft_throughput.py --device cuda --doc-len 512   # packed documents of 512 tokens
    python benchmarks/sft_throughput.py --device cpu --tiny       # a smoke test of the script

Both models start from the same random weights and train with the SFT path of ``allhere.hf`` (packed
sequences, assistant-only loss mask, AdamW, straight-through routers for AHA) on the same synthetic
batches; tokens/s are measured after --warmup steps. Prints one Markdown table with the ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

from allhere import AHAConfig
from allhere.config import TrainConfig
from allhere.hf import HFCausalLM, convert
from allhere.train import train


def build(tiny: bool, seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    if tiny:
        cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    else:  # ~110M parameters: d 768, 12 layers, 12 heads, vocab 32k
        cfg = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                          num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=4096)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def run(name, model, args, vocab):
    times = []

    def batches(step, micro, g):
        times.append(time.perf_counter())
        ids = torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=g)
        mask = torch.rand(args.batch_size, args.seq_len, generator=g) < 0.5  # assistant share of the tokens
        if not args.doc_len:
            return ids, mask
        positions = (torch.arange(args.seq_len) % args.doc_len).expand(args.batch_size, -1)
        return ids, mask, positions  # packed documents, as allhere sft packs conversations

    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=3e-5, beta2=0.95, warmup_ratio=0.03,
                      ckpt_every=10**9, log_every=10, device=args.device)
    with tempfile.TemporaryDirectory() as d:
        state = train(HFCausalLM(model), batches, cfg, os.path.join(d, "c.safetensors"), progress=False)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    times.append(time.perf_counter())
    timed = times[args.warmup:]
    tok_s = (len(timed) - 1) * args.batch_size * args.seq_len / (timed[-1] - timed[0])
    return tok_s, state


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--doc-len", type=int, default=0,
                   help="pack documents of this many tokens into each row (position ids restart, as allhere sft "
                        "does with conversations; each document attends only to itself); 0 = one per row")
    p.add_argument("--router-init", nargs="+", default=["global", "local"], choices=["global", "local", "neutral"],
                   help="AHA runs, one per router start: global (every gate open, as allhere sft starts: the "
                        "original model's function, mu_f ~1) and local (every gate closed, mu_f ~0)")
    a = p.parse_args(argv)
    if a.warmup >= a.steps - 1:
        sys.exit("--warmup must be smaller than --steps - 1")
    base = build(a.tiny).to(a.device)
    vocab = base.config.vocab_size
    params = sum(t.numel() for t in base.parameters())
    print(f"# {params / 1e6:.0f}M parameters, batch {a.batch_size} x {a.seq_len} tokens "
          f"({f'documents of {a.doc_len}' if a.doc_len else 'one document per row'}), w={a.window}, "
          f"{a.steps} steps ({a.warmup} warm-up), device {a.device}, torch {torch.__version__}")
    sdpa_tps, _ = run("sdpa", base, a, vocab)
    rows = [f"| plain SDPA | - | {sdpa_tps:,.0f} | 1.00x |"]
    for init in a.router_init:
        aha = convert(build(a.tiny).to(a.device), AHAConfig(window=a.window, router_init=init))
        aha_tps, state = run("aha", aha, a, vocab)
        mu = [h["mu_f"] for h in state["history"]]
        mu_text = f"{sum(mu) / len(mu):.3f}" if mu else "n/a"
        rows.append(f"| AHA (SFT path), routers start {init} | {mu_text} | {aha_tps:,.0f} | {aha_tps / sdpa_tps:.2f}x |")
    print("| model | mean mu_f (every 10th step) | tokens/s | ratio to SDPA |")
    print("|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
