"""``dar_latent``'s decode op on a GPU against plain attention's: B requests, one new query each over a context
of N tokens, read by the Triton kernel (``allhere.kernels.dar_latent_decode``: the window's K/V and every far
token's latent row [c ; k^R], the queries folded into the latent) against the plain model's decode over its full
GQA cache by SDPA, the fastest of its CUDA backends (flash, memory-efficient, cuDNN) in the same run.

    python3 benchmarks/dar_latent_decode.py                 # CUDA: B = 8 at 32k and 128k, two model shapes
    python3 benchmarks/dar_latent_decode.py --lengths 32768 --batch 8 --shapes smollm2-d64
    python3 benchmarks/dar_latent_decode.py --quick         # the CPU: tiny shapes in Triton's interpreter, checked

Shapes (heads / KV heads x head dim; window w; latent d_c; rotated numbers per KV head e_r = 2 r):
smollm2-d64 (SmolLM2-135M, 9 / 3 x 64, w 128, d_c 64, e_r 8: the served shape that decodes faster than plain
on the CPU), smollm2-d144 (the same at d_c = d/4 = 144), llama-1b (Llama-3.2-1B, 32 / 8 x 64, w 256, d_c 512,
e_r 8). Time: ``triton.testing.do_bench`` (median ms). Bytes: what each reads per step (plain: K and V of every
token; ``dar_latent``: the rows, the window's K/V); their ratio is the most a byte-bound decode can gain.
Every case is first checked against the op's PyTorch path (relative error). The weights and inputs are random:
the speed of a decode step does not depend on their values.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = {  # heads, kv_heads, head_dim, window, d_c, e_r
    "smollm2-d64": (9, 3, 64, 128, 64, 8),
    "smollm2-d144": (9, 3, 64, 128, 144, 8),
    "llama-1b": (32, 8, 64, 256, 512, 8),
}


def inputs(b: int, n: int, shape: tuple, dtype, device) -> tuple[dict, tuple]:
    """(the op's arguments for one decode step over n tokens, plain's (q, K, V))."""
    from allhere.ops.dar_latent.check import pack_rows

    h, g, d, w, d_c, e_r = shape
    r = lambda *s: torch.randn(*s, device=device, dtype=dtype)  # noqa: E731
    op = dict(q=r(b, h, 1, d), q_far=r(b, h, 1, d), k_near=r(b, g, w, d), v_near=r(b, g, w, d),
              rows=pack_rows(r(b, n, d_c), r(b, g, n, e_r)),
              w_uk=torch.randn(g, d - e_r, d_c, device=device) / d_c ** 0.5,
              w_uv=torch.randn(g, d, d_c, device=device) / d_c ** 0.5)
    return op, (op["q"], r(b, g, n, d), r(b, g, n, d))


def plain_decode(q, k, v, backend):
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def fastest_plain(q, k, v) -> tuple[float, str]:
    """(median ms, backend name) of the fastest SDPA backend that takes the call."""
    from torch.nn.attention import SDPBackend
    from triton.testing import do_bench

    best = None
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            plain_decode(q, k, v, backend)
        except RuntimeError:  # this backend does not take the call (shape, dtype, GQA)
            continue
        ms = do_bench(lambda: plain_decode(q, k, v, backend), return_mode="median")
        if best is None or ms < best[0]:
            best = (ms, backend.name.lower())
    if best is None:
        raise SystemExit("no SDPA backend takes the plain decode on this device")
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072], help="context tokens per request")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--quick", action="store_true", help="the CPU under Triton's interpreter: tiny, checked only")
    a = p.parse_args()
    if a.quick:
        import os

        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    elif not torch.cuda.is_available():
        p.error("no CUDA device: run on a GPU, or --quick to check the script in Triton's interpreter")
    from allhere.kernels.dar_latent_decode import dar_latent_decode_triton
    from allhere.ops.dar_latent import dar_latent_attention_torch

    device, dtype = ("cpu", torch.float32) if a.quick else ("cuda", torch.bfloat16)
    batch, lengths = (2, [300]) if a.quick else (a.batch, a.lengths)
    name = "CPU (Triton's interpreter)" if a.quick else torch.cuda.get_device_name()
    print(f"# {name}, torch {torch.__version__}, {dtype}; B = {batch}; one query per request")
    print("| shape | context | plain ms (backend) | dar_latent ms | x plain | bytes read x plain | rel. error |")
    print("|---|---|---|---|---|---|---|")
    for shape_name in a.shapes:
        h, g, d, w, d_c, e_r = shape = SHAPES[shape_name]
        for n in lengths:
            op, (q, k, v) = inputs(batch, n, shape, dtype, device)
            got = dar_latent_decode_triton(**op, window=w).float()
            want = dar_latent_attention_torch(**{key: t.float() for key, t in op.items()}, window=w)
            err = ((got - want).norm() / want.norm()).item()
            if a.quick:
                t0 = time.perf_counter()
                dar_latent_decode_triton(**op, window=w)
                ms, vs = (time.perf_counter() - t0) * 1e3, "- (not timed) | "
            else:
                from triton.testing import do_bench

                plain, backend = fastest_plain(q, k, v)
                ms = do_bench(lambda op=op: dar_latent_decode_triton(**op, window=w), return_mode="median")
                vs = f"{plain:.3f} ({backend}) | "
            plain_bytes = 2 * g * n * d
            ours = n * (d_c + g * e_r) + 2 * g * w * d
            ratio = "-" if a.quick else f"{plain / ms:.2f}x"
            print(f"| {shape_name} | {n:,} | {vs}{ms:.3f} | {ratio} | "
                  f"{ours / plain_bytes:.2f}x | {err:.1e} |", flush=True)
            del op, q, k, v


if __name__ == "__main__":
    main()
