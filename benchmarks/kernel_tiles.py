"""Tile settings of the Triton kernels, timed side by side: which block sizes, warps and stages (and the
decode split) should be the defaults on this GPU. Each setting's result is first checked against the
default setting's; a setting the GPU cannot run (shared memory, registers) is listed as failed.

    python benchmarks/kernel_tiles.py            # CUDA: prefill n = 32k, training n = 16k, decode B = 8
    python benchmarks/kernel_tiles.py --smoke    # no GPU: tiny sizes in Triton's interpreter (checks the script)

Shapes follow issue 6: 16 heads, head dim 128, bf16, w = 256, long-tailed gates at mu_f = 7%.
"""

from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from allhere.bench.gates import long_tailed  # noqa: E402
from allhere.bench.timing import median_time  # noqa: E402
from allhere.kernels.aha_decode import aha_decode_triton  # noqa: E402
from allhere.kernels.aha_prefill import aha_prefill_triton  # noqa: E402
from allhere.kernels.aha_train import aha_train_triton  # noqa: E402
from tile_settings import BLOCK_TILES, DECODE_TILES, DKDV_TILES  # noqa: E402 -- benchmarks/tile_settings.py


def qkv(b, h, n, d, device, dtype, grad=False, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(b, h, n, d, device=device, dtype=dtype, generator=g).requires_grad_(grad) for _ in range(3)]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def sweep(name, settings, call, device, repeats):
    """call(setting) -> list of tensors. Times each setting; checks it against the first one."""
    ref = [t.detach().clone() for t in call(settings[0])]
    rows = []
    for s in settings:
        try:
            err = max(rel(a, b) for a, b in zip(call(s), ref))
            ms = 1e3 * median_time(lambda: call(s), repeats, device=device)
        except Exception as e:  # noqa: BLE001 -- a setting the GPU cannot compile is reported, not fatal
            rows.append((s, None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"))
            continue
        rows.append((s, ms, "ok" if err < 2e-2 else f"WRONG (rel. err. {err:.1e})"))
    best = min((r for r in rows if r[1] is not None and r[2] == "ok"), key=lambda r: r[1])
    print(f"\n## {name}\n\n| setting | ms | vs default | check |\n|---|---|---|---|")
    default = rows[0][1]
    for s, ms, note in sorted(rows, key=lambda r: (r[1] is None, r[1] or 0)):
        tags = [t for t, on in (("default", s == settings[0]), ("best", s == best[0])) if on]
        mark = f" ({', '.join(tags)})" if tags else ""
        cell = "n/a" if ms is None else f"{ms:.3f}"
        ratio = "n/a" if ms is None or default is None else f"{default / ms:.2f}x"
        print(f"| {s}{mark} | {cell} | {ratio} | {note} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (what runs without a GPU)")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise SystemExit("error: no CUDA GPU here; use --smoke to check the script in Triton's interpreter")
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    heads, d, w = (16, 128, 256) if not args.smoke else (2, 16, 8)
    prefill_n, train_n, decode_ns = (32768, 16384, (32768, 131072)) if not args.smoke else (64, 64, (100,))
    tiles = BLOCK_TILES if not args.smoke else [(32, 32, 4, 3), (16, 16, 4, 3)]
    decode_tiles = DECODE_TILES if not args.smoke else [(64, 32, 4), (32, 16, 2)]
    repeats = args.repeats if not args.smoke else 1
    scale = d ** -0.5
    gen = torch.Generator(device=device).manual_seed(1)
    print(f"# Triton tile settings ({torch.cuda.get_device_name() if cuda else 'CPU interpreter'}, "
          f"torch {torch.__version__}); heads {heads}, head dim {d}, w = {w}, long-tailed gates, mu_f 7%")

    q, k, v = qkv(1, heads, prefill_n, d, device, dtype)
    hard = long_tailed(1, heads, prefill_n, 0.07, generator=gen, device=device)
    with torch.no_grad():
        sweep(f"Prefill, n = {prefill_n}", tiles,
              lambda s: [aha_prefill_triton(q, k, v, hard, w, scale, *s)], device, repeats)

    q, k, v = qkv(1, heads, train_n, d, device, dtype, grad=True)
    hard = long_tailed(1, heads, train_n, 0.07, generator=gen, device=device)
    up = torch.randn_like(q)

    def train_step(s, dkdv=DKDV_TILES[0]):
        out, _ = aha_train_triton(q, k, v, hard, w, scale, *s, dkdv_rows=dkdv[0], dkdv_warps=dkdv[1])
        return [out.detach(), *torch.autograd.grad((out * up).sum(), [q, k, v])]

    sweep(f"Training forward + backward, n = {train_n}", tiles, train_step, device, repeats)
    # The dK / dV kernel's own (rows, warps), with the default block tiles.
    dkdv_tiles = DKDV_TILES if not args.smoke else [(16, 4), (32, 4)]
    sweep(f"Training forward + backward, n = {train_n}: dK / dV (rows, warps)", dkdv_tiles,
          lambda s: train_step(tiles[0], s), device, repeats)

    for n in decode_ns:
        _, k, v = qkv(8, heads, n, d, device, dtype)
        q = qkv(8, heads, 1, d, device, dtype, seed=1)[0]
        gate = long_tailed(8, heads, 1, 0.07, generator=gen, device=device)[..., 0]
        gate[:, 0] = True  # as in allhere bench: one token per sequence, head 0 global
        with torch.no_grad():
            sweep(f"Decode, B = 8, n = {n}", decode_tiles,
                  lambda s: [aha_decode_triton(q, k, v, gate, w, scale, *s)], device, repeats)


if __name__ == "__main__":
    main()
