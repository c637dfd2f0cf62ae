"""SFT training throughput: a converted AHA model against the same model with plain SDPA, in one run.

    python benchmarks/sft_throughput.py --device cuda             # 134M Llama-shaped model, 8 x 2048 tokens
    python benchmarks/sft_throughput.py --device cuda --doc-len 512   # packed documents of 512 tokens
    python benchmarks/sft_throughput.py --device cuda --shape llama-1b --router-init global   # ~1 minute on an H100
    python benchmarks/sft_throughput.py --device cpu --tiny       # a smoke test of the script

Both models start from the same random weights and train with the SFT path of ``allhere.hf`` (packed
sequences, assistant-only loss mask, AdamW, straight-through routers for AHA, bf16 autocast on CUDA) on the
same synthetic batches. Shapes: ``134m`` (d 768, 12 layers, 12 heads, vocabulary 32k), ``llama-1b`` (the
published Llama-3.2-1B config: 16 layers, 32 heads / 8 KV heads, vocabulary 128256, tied embeddings; 4 x
2048 tokens, 25 steps, to fit one command of a lent GPU), ``tiny`` (a smoke test); --steps, --warmup,
--batch-size and --seq-len override a shape's defaults. tokens/s are measured from the start of step
--warmup to the start of the last step (a CUDA synchronise at each step's start); the checkpoint the
training loop writes at its end is skipped (a 1B model's weights and AdamW state are 15 GB: writing them is
no part of the throughput). Prints one Markdown table with the ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from unittest import mock

import torch

import allhere.train
from allhere import AHAConfig
from allhere.config import TrainConfig
from allhere.hf import HFCausalLM, convert
from allhere.masks import starts_from
from allhere.train import train

SHAPES = {  # LlamaConfig fields, and the shape's default steps / warmup / batch / sequence length
    "tiny": (dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512),
             dict(steps=300, warmup=20, batch_size=8, seq_len=2048)),
    "134m": (dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=4096),
             dict(steps=300, warmup=20, batch_size=8, seq_len=2048)),
    "llama-1b": (None, dict(steps=25, warmup=5, batch_size=4, seq_len=2048)),  # fields: llama_bench.LLAMA_3_2_1B
}


def build(shape: str, device: str, seed: int = 0):
    """The model of ``shape`` (fp32 weights, as the training loop keeps them) made on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from allhere_recipes.llama_bench import LLAMA_3_2_1B

    fields = SHAPES[shape][0] or LLAMA_3_2_1B
    cfg = LlamaConfig(**fields, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        return LlamaForCausalLM(cfg)


def run(name, model, args, vocab):
    times = []

    def batches(step, micro, g):
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()  # the steps before this one have finished
        times.append(time.perf_counter())
        ids = torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=g)
        mask = torch.rand(args.batch_size, args.seq_len, generator=g) < 0.5  # assistant share of the tokens
        if not args.doc_len:
            return ids, mask
        positions = (torch.arange(args.seq_len) % args.doc_len).expand(args.batch_size, -1)
        return ids, mask, starts_from(position_ids=positions)  # packed documents, as allhere sft packs them

    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=3e-5, beta2=0.95, warmup_ratio=0.03,
                      ckpt_every=10**9, log_every=10, device=args.device)
    with tempfile.TemporaryDirectory() as d, mock.patch.object(allhere.train, "save_checkpoint", lambda *a, **k: None):
        state = train(HFCausalLM(model), batches, cfg, os.path.join(d, "c.safetensors"), progress=False)
    timed = times[args.warmup:]  # step starts: the last step's end would take in what train does after it
    tok_s = (len(timed) - 1) * args.batch_size * args.seq_len / (timed[-1] - timed[0])
    return tok_s, state


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", choices=tuple(SHAPES), default="134m", help="model shape (default 134m)")
    p.add_argument("--tiny", action="store_true", help="the same as --shape tiny")
    p.add_argument("--steps", type=int, default=None, help="default per shape: 300 (llama-1b: 25)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps; default per shape: 20 (llama-1b: 5)")
    p.add_argument("--batch-size", type=int, default=None, help="default per shape: 8 (llama-1b: 4)")
    p.add_argument("--seq-len", type=int, default=None, help="default 2048")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--doc-len", type=int, default=0,
                   help="pack documents of this many tokens into each row (position ids restart, as allhere sft "
                        "does with conversations; each document attends only to itself); 0 = one per row")
    p.add_argument("--router-init", nargs="+", default=["global", "local"], choices=["global", "local", "neutral"],
                   help="AHA runs, one per router start: global (every gate open, as allhere sft starts: the "
                        "original model's function, mu_f ~1) and local (every gate closed, mu_f ~0)")
    a = p.parse_args(argv)
    shape = "tiny" if a.tiny else a.shape
    for name, value in SHAPES[shape][1].items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    if a.warmup >= a.steps - 1:
        sys.exit("--warmup must be smaller than --steps - 1")
    base = build(shape, a.device)
    vocab = base.config.vocab_size
    params = sum(t.numel() for t in base.parameters())
    print(f"# {params / 1e6:.0f}M parameters ({shape}), batch {a.batch_size} x {a.seq_len} tokens "
          f"({f'documents of {a.doc_len}' if a.doc_len else 'one document per row'}), w={a.window}, "
          f"{a.steps} steps ({a.warmup} warm-up), device {a.device}, torch {torch.__version__}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    sdpa_tps, _ = run("sdpa", base, a, vocab)
    del base
    rows = [f"| plain SDPA | - | {sdpa_tps:,.0f} | 1.00x |"]
    for init in a.router_init:
        aha = convert(build(shape, a.device), AHAConfig(window=a.window, router_init=init))
        aha_tps, state = run("aha", aha, a, vocab)
        del aha
        mu = [h["mu_f"] for h in state["history"]]
        mu_text = f"{sum(mu) / len(mu):.3f}" if mu else "n/a"
        rows.append(f"| AHA (SFT path), routers start {init} | {mu_text} | {aha_tps:,.0f} | "
                    f"{aha_tps / sdpa_tps:.2f}x |")
    print("| model | mean mu_f (every 10th step) | tokens/s | ratio to SDPA |")
    print("|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
