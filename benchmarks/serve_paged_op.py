"""One layer's attention over a paged KV cache, as served: allhere's batched paged attention
(``allhere.ops.paged.attention``) per mechanism against vLLM's own CPU attention kernel
(``cpu_attention_with_kv_cache``) over the same blocks, and AHA computed with vLLM's kernel on the subsets (the
windowed kernel for every token, the full kernel again for the tokens with a global head, joined per head), and AHA
as served (vLLM's windowed kernel for every row's window, its full kernel per (token, kv head) for the decode
tokens' global rows, allhere's attention for the prefill tokens' global rows), DAR as served (the window from the
paged K/V, the far keys rebuilt from a paged cache of d_down = 64 latents), and dar_latent's decode as served (the
far keys read absorbed from paged rows of 64 latent + 4 x 8 rotated numbers).

    .venv-serve/bin/python benchmarks/serve_paged_op.py             # decode 16 x 8k, decode 1 x 8k, a prefill chunk
    .venv-serve/bin/python benchmarks/serve_paged_op.py --threads 1
    .venv-serve/bin/python benchmarks/serve_paged_op.py --dtype bfloat16 --heads 9 --kv-heads 3   # SmolLM2's GQA
    .venv-serve/bin/python benchmarks/serve_paged_op.py --dtype bfloat16 --heads 9 --kv-heads 3 --only sink

Shapes: 4 heads of 64 (4 kv heads; --heads, --kv-heads), fp32 (--dtype), blocks of 128 (vLLM's CPU default), blocks
scattered at random. Scenarios: "decode16": 16 requests of 8192 tokens, one query each; "decode1": one such
request; "prefill": the last 2048-token chunk of an 8192-token prompt (vLLM's CPU server schedules 2048 tokens a
step); "prefill2k": a 2048-token prompt. AHA's gates: head 0 global for 27% of the queries, the others for 2% (mu_f
about 8%), drawn at random. ``--only`` keeps the runs whose name holds one of the words given. Times are the median
of --reps calls after one warm-up; the load average is printed with each row (the machine may be shared).
"""

from __future__ import annotations

import argparse
import os

import torch

from allhere_recipes.timing import median_time

H, KVH, D, BS = 4, 4, 64, 128
D_DOWN, WINDOW = 64, 256  # DAR's latents; the window of every mechanism
ROPE = 8  # dar_latent: rotated channels kept per kv head (4 pairs); its rows hold D_DOWN + KVH x ROPE numbers
SCENARIOS = {"decode16": (16, 8192, 1), "decode1": (1, 8192, 1), "prefill": (1, 8192, 2048),
             "prefill2k": (1, 2048, 2048)}


def setup(requests: int, length: int, q_len: int, dtype: torch.dtype = torch.float32):
    from allhere.ops.paged.attention import paged_view

    torch.manual_seed(0)
    nb = requests * (length // BS) + 4
    cache = (torch.randn(nb, KVH, BS, 2 * D) * 0.5).to(dtype)
    table = torch.randperm(nb)[: requests * (length // BS)].view(requests, length // BS).int()
    return dict(nb=nb, cache=cache, view=paged_view(cache, BS, KVH, D), table=table,
                latents=(torch.randn(nb, BS, D_DOWN) * 0.5).to(dtype),
                rows=(torch.randn(nb, BS, D_DOWN + KVH * ROPE) * 0.5).to(dtype),
                seq=torch.full((requests,), length, dtype=torch.int32),
                qs=torch.arange(requests + 1, dtype=torch.int32) * q_len,
                q=torch.randn(requests * q_len, H, D).to(dtype), out=torch.zeros(requests * q_len, H, D, dtype=dtype),
                gate=torch.rand(requests * q_len, H) < torch.tensor([0.27] + [0.02] * (H - 1)))


def vllm_attention(s, q, qs, seq, table, window, out):
    """vLLM's CPU kernel over the same blocks (allhere's layout is the kernel's "vec" layout), causal,
    ``window`` keys (-1: all)."""
    from allhere.serve.vllm.cpu_kernels import vllm_attention as kernel

    kernel(q, s["cache"].view(s["nb"], KVH, BS * 2, D), out, qs, seq, table, window, D ** -0.5, 0.0, None, "vec")


def vllm_aha(s):
    """AHA from vLLM's kernel: the windowed attention for every token, the full one again for every token with
    a global head (all its heads: the kernel has no per-head subset), joined per (token, head)."""
    q, qs, seq, table, gate = s["q"], s["qs"], s["seq"], s["table"], s["gate"]
    local = torch.empty_like(s["out"])
    vllm_attention(s, q, qs, seq, table, 256, local)
    idx = gate.any(1).nonzero().squeeze(1)
    if idx.numel():
        q_len = qs[1:] - qs[:-1]
        req = torch.repeat_interleave(torch.arange(len(seq)), q_len)[idx]
        pos = idx - qs[req] + (seq - q_len)[req]
        full = torch.empty(idx.numel(), H, D, dtype=q.dtype)
        vllm_attention(s, q[idx].contiguous(), torch.arange(idx.numel() + 1, dtype=torch.int32), (pos + 1).int(),
                       table[req].contiguous(), -1, full)
        local[idx] = torch.where(gate[idx][..., None], full, local[idx])
    s["out"].copy_(local)


def aha_served(s, workspace, n_sinks: int = 0):
    """AHA as ``allhere serve`` computes it on this CPU (``aha_over_vllm``): vLLM's windowed kernel for every row
    in place, its full kernel per (token, kv head) for the decode tokens' global rows, allhere's attention for the
    prefill tokens' global rows; with one sink, the decode tokens' windows with the sink swapped in, the prefill
    tokens' rows in a few calls of torch's fused attention (``allhere.ops.paged.aha_prefill``)."""
    from types import SimpleNamespace

    from allhere.ops.paged.attention import causal_read, window_read
    from allhere.serve.vllm.cpu_kernels import aha_over_vllm
    from allhere.serve.vllm.layers import WIDE_TILE, WINDOW_TILE

    meta = SimpleNamespace(num_actual_tokens=s["q"].shape[0], query_start_loc=s["qs"], seq_lens=s["seq"],
                           block_table=s["table"])
    reads = [[window_read(256, q_tile=WINDOW_TILE, n_sinks=n_sinks)], [causal_read(q_tile=WIDE_TILE)]]
    aha_over_vllm(s["q"], s["cache"], s["view"], meta, reads, s["gate"], 0, D ** -0.5, 0.0, None, "vec", s["out"],
                  workspace)


def latent_kv():
    """DAR's far keys as a Llama block makes them from latents under ``allhere serve``: W_K W_up [256, 64] and
    the rotary embedding from a cos/sin table (GPT-NeoX pairs, as Llama's), one complex multiply
    (``rotary_projection``); far values through W_V W_up."""
    from allhere.ops.paged.dar_far import LatentKV, rotary_projection

    g = torch.Generator().manual_seed(1)
    a_k = torch.randn(KVH * D, D_DOWN, generator=g) * D_DOWN ** -0.5
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2).float() / D))
    angles = torch.arange(131072).float()[:, None] * inv
    keys, order = rotary_projection(a_k, None, KVH, (torch.polar(torch.ones_like(angles), angles), True))
    return LatentKV(keys, torch.randn(KVH, D, D_DOWN, generator=g) * D_DOWN ** -0.5, None, order)


def latent_rows_kv():
    """dar_latent's far keys: rows [c ; k^R of every kv head] read absorbed. Returns (W_UK [kv heads, D - ROPE,
    D_DOWN], W_UV [kv heads, D, D_DOWN])."""
    g = torch.Generator().manual_seed(1)
    return (torch.randn(KVH, D - ROPE, D_DOWN, generator=g) * D_DOWN ** -0.5,
            torch.randn(KVH, D, D_DOWN, generator=g) * D_DOWN ** -0.5)


def dar_latent_served(s, maps):
    """dar_latent's decode step as ``allhere serve`` computes it (every request decoding): the window from the
    paged K/V and the far rows read absorbed, written to out (``dar_latent_decode.decode_latent``: in bf16 with vLLM's
    CPU kernel for latent caches, two calls merged by log-sum-exp; the far queries are drawn here, not made from
    the queries by the rotary table, and laid out as rows through W_UK: the served layer's one matmul)."""
    from allhere.ops.dar_latent.check import query_rows
    from allhere.ops.paged.dar_latent_decode import decode_latent

    w_uk, w_uv = maps
    m = s["q"].shape[0]
    pos = s["seq"].long() - 1
    q_row = query_rows(s["q"].view(m, KVH, -1, D), w_uk, ROPE, s["rows"].dtype).view(m, H, -1)
    decode_latent(s["q"], q_row, pos, s["view"], s["table"], s["rows"], s["table"], WINDOW, w_uv, D ** -0.5,
                  s["out"])


def dar_served(s, kv, workspace):
    """DAR as ``allhere serve`` computes it: the window from the paged K/V, the far keys rebuilt from the paged
    latents (the same block table here), one softmax."""
    from allhere.ops.paged.attention import paged_attention, window_read
    from allhere.ops.paged.dar_far import far_pieces
    from allhere.serve.vllm.layers import WINDOW_TILE

    far = far_pieces(s["q"], s["latents"], s["qs"], s["seq"], s["table"], WINDOW, kv, D ** -0.5)
    paged_attention(s["q"], s["view"], s["qs"], s["seq"], s["table"], [[window_read(WINDOW, q_tile=WINDOW_TILE)]],
                    D ** -0.5, s["out"], workspace=workspace, extra=far)


def allhere_reads():
    import allhere as ah
    from allhere import registry
    from allhere.ops.paged.attention import Read, causal_read, window_read
    from allhere.serve.vllm.layers import WIDE_TILE, WINDOW_TILE

    def pattern(cfg):
        return [[Read(registry.from_dict(registry.to_dict(cfg)).mask_fn(None), WINDOW_TILE)]]

    return {"full": ([[causal_read(q_tile=WIDE_TILE)]], False),
            "aha": ([[window_read(256, q_tile=WINDOW_TILE)], [causal_read(q_tile=WIDE_TILE)]], True),
            "aha, one sink": ([[window_read(256, q_tile=WINDOW_TILE, n_sinks=1)], [causal_read(q_tile=WIDE_TILE)]],
                              True),
            "sinks": (pattern(ah.SinksConfig(window=252, n_sinks=4)), False),
            "dilated": (pattern(ah.DilatedConfig(window=128, dilation=(1, 2, 3, 4))), False),
            "longformer": (pattern(ah.LongformerConfig(window=256, global_first=4)), False),
            "bigbird": (pattern(ah.BigBirdConfig(block=64, window_blocks=3, global_blocks=1, random_blocks=1)), False)}


def main() -> None:
    global H, KVH
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--heads", type=int, default=H, help=f"query heads (default {H})")
    p.add_argument("--kv-heads", type=int, default=KVH, help=f"kv heads (default {KVH})")
    p.add_argument("--only", nargs="+", default=None, help="run only the runs whose name holds one of these words")
    a = p.parse_args()
    H, KVH = a.heads, a.kv_heads
    dtype = getattr(torch, a.dtype)
    if a.threads:
        torch.set_num_threads(a.threads)
    from allhere.ops.paged.attention import paged_attention
    from allhere.ops.paged.chunks import Workspace

    workspace = Workspace()
    kv, rows_kv = latent_kv(), latent_rows_kv()
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores, {a.dtype}, "
          f"{H} heads over {KVH} kv heads of {D}")
    print("| scenario | attention | ms | vs vLLM full | load |")
    print("|---|---|---|---|---|")
    for scenario in a.scenarios:
        s = setup(*SCENARIOS[scenario], dtype=dtype)
        runs = {"vLLM full": lambda: vllm_attention(s, s["q"], s["qs"], s["seq"], s["table"], -1, s["out"]),
                "vLLM window 256": lambda: vllm_attention(s, s["q"], s["qs"], s["seq"], s["table"], 256, s["out"]),
                "AHA from vLLM's kernel": lambda: vllm_aha(s)}
        for name, (reads, routed) in allhere_reads().items():
            runs[f"allhere {name}"] = (lambda reads=reads, routed=routed: paged_attention(
                s["q"], s["view"], s["qs"], s["seq"], s["table"], reads, D ** -0.5, s["out"],
                row_class=s["gate"] if routed else None, workspace=workspace))
        runs["allhere aha, as served (vLLM's kernels: windows, decode's global rows)"] = (
            lambda: aha_served(s, workspace))
        runs["allhere aha, one sink, as served (vLLM's windows with the sink swapped in; prefill in large calls)"] = (
            lambda: aha_served(s, workspace, n_sinks=1))
        runs["allhere dar, as served (far keys rebuilt from latents)"] = lambda: dar_served(s, kv, workspace)
        if SCENARIOS[scenario][2] == 1:  # dar_latent's decode (a prefill rebuilds its far keys, as DAR does)
            runs["allhere dar_latent, as served (window and latent rows read absorbed)"] = (
                lambda: dar_latent_served(s, rows_kv))
        base = None
        for name, run in runs.items():
            if a.only and name != "vLLM full" and not any(w in name for w in a.only):
                continue
            ms = 1e3 * median_time(run, a.reps)
            base = base or ms
            print(f"| {scenario} | {name} | {ms:.1f} | {base / ms:.2f}x | {os.getloadavg()[0]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
