"""Every launch setting the autotuner may pick on this GPU, checked and timed side by side, then the
autotuner itself: what it chose and what its first call cost.

For each kernel (the prefill's sliding and global kernels, the training's dQ and dK / dV kernels, decode),
its candidates pruned for this GPU (``allhere.kernels.tiles.prune``) run pinned one at a time
(``autotune.pinned``); each one's results (prefill and decode outputs; training output and dQ, dK, dV)
are first checked against the dense fp32 reference (``aha_attention_reference`` on fp32 copies of the same
inputs) by relative error: a setting over the tolerance (bf16: 2e-2, as tests/ops/test_gpu.py; fp32 in the
interpreter: 1e-4) is marked WRONG, one the GPU cannot run (shared memory, registers) failed. Since the
autotuner may choose any candidate, every row must say ok. Last, with an empty settings file, the
unpinned calls: the first one's time (tuning included) against the next ones', and the choices.

    python benchmarks/kernel_tiles.py            # CUDA: prefill n = 32k, training n = 16k, decode B = 8
    python benchmarks/kernel_tiles.py --smoke    # no GPU: tiny sizes in Triton's interpreter (checks the script)

Shapes: 16 heads, head dim 128, bf16, w = 256, long-tailed gates at mu_f = 7%.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from allhere.kernels import autotune, tiles  # noqa: E402
from allhere.kernels.aha_decode import aha_decode_triton  # noqa: E402
from allhere.kernels.aha_prefill import aha_prefill_triton  # noqa: E402
from allhere.kernels.aha_train import aha_train_triton  # noqa: E402
from allhere.ops.aha import aha_attention_reference  # noqa: E402
from allhere_recipes.gates import long_tailed  # noqa: E402
from allhere_recipes.timing import median_time, timed_call  # noqa: E402


def qkv(b, h, n, d, device, dtype, grad=False, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(b, h, n, d, device=device, dtype=dtype, generator=g).requires_grad_(grad) for _ in range(3)]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def reference(q, k, v, gate, w, scale, up=None, rows=1024):
    """The dense fp32 reference on fp32 copies: [out], or with ``up`` [out, dq, dk, dv] of sum(out * up).
    One sequence and ``rows`` query rows at a time (rows r0..r1 over keys 0..r1: whole-sequence score
    matrices would not fit at n = 32k); summed over the pieces, the gradients are the whole batch's."""
    q, k, v = (t.detach().float().requires_grad_(up is not None) for t in (q, k, v))
    b, n, off = q.shape[0], q.shape[2], k.shape[2] - q.shape[2]
    outs = []
    for i in range(b):
        row = []
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            piece, keys = slice(i, i + 1), slice(0, off + r1)
            with torch.set_grad_enabled(up is not None):
                out = aha_attention_reference(q[piece, :, r0:r1], k[piece, :, keys], v[piece, :, keys],
                                          gate[piece, :, r0:r1], w, scale)
                if up is not None:
                    (out * up[piece, :, r0:r1].float()).sum().backward()
            row.append(out.detach())
        outs.append(torch.cat(row, 2))
    return [torch.cat(outs, 0)] + ([] if up is None else [q.grad, k.grad, v.grad])


def sweep(name, settings, call, ref, tol, device, repeats):
    """call(setting) -> list of tensors, checked against ``ref`` (the fp32 reference's) by relative error;
    then timed. The first setting is the one ``autotune.pinned()`` gives on this device."""
    rows = []
    for s in settings:
        try:
            err = max(rel(a, b) for a, b in zip(call(s), ref))
            ms = 1e3 * median_time(lambda: call(s), repeats, device=device)
        except Exception as e:  # noqa: BLE001 -- a setting the GPU cannot compile is reported, not fatal
            rows.append((s, None, None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"))
            continue
        rows.append((s, ms, err, "ok" if err < tol else "WRONG"))
    best = min((r for r in rows if r[3] == "ok"), key=lambda r: r[1], default=None)
    print(f"\n## {name}\n\n| setting | ms | vs pinned | rel. err. vs fp32 reference | check (tolerance {tol:g}) |"
          f"\n|---|---|---|---|---|")
    first = rows[0][1]
    for s, ms, err, note in sorted(rows, key=lambda r: (r[1] is None, r[1] or 0)):
        tags = [t for t, on in (("pinned", s == settings[0]), ("best", best is not None and s == best[0])) if on]
        mark = f" ({', '.join(tags)})" if tags else ""
        cell = "n/a" if ms is None else f"{ms:.3f}"
        ratio = "n/a" if ms is None or first is None else f"{first / ms:.2f}x"
        print(f"| {tuple(s.values())}{mark} | {cell} | {ratio} | {'n/a' if err is None else f'{err:.1e}'} | {note} |")


def candidates(kernel, d, dtype, length, smoke):
    """The settings of ``kernel`` the autotuner may time here (``tiles.prune``); tiny ones in the smoke run."""
    if smoke:
        return [dict(SPLIT=64, BLOCK_N=32), dict(SPLIT=32, BLOCK_N=16)] if kernel == "decode" else \
            [dict(BLOCK_M=32, BLOCK_N=32), dict(BLOCK_M=16, BLOCK_N=16)]
    from triton.runtime import driver

    shared = driver.active.utils.get_device_properties(torch.cuda.current_device())["max_shared_mem"]
    return tiles.prune(kernel, d, dtype.itemsize, torch.cuda.get_device_capability(), shared, length)


def first_calls(calls, device):
    """The autotuner from an empty settings file: each call's first time (tuning included) and a later one."""
    print("\n## Autotuned (an empty settings file)\n\n| call | first call s | later call ms |\n|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        autotune.set_store_path(os.path.join(folder, "settings.json"))
        autotune.forget()
        for name, call, grad in calls:
            call = torch.enable_grad()(call) if grad else torch.no_grad()(call)
            _, first = timed_call(call, device)
            print(f"| {name} | {first:.2f} | {1e3 * median_time(call, 3, device=device):.3f} |")
        print("\n| kernel, shape class | chosen | ms | timed | would not run | tuning s |\n|---|---|---|---|---|---|")
        for c in autotune.choices():
            print(f"| {c['id'].split('|', 2)[2]} | {tuple(c['setting'].values())} | {c['ms']} | {c['tried']} | "
                  f"{c['failed']} | {c['tuning_s']} |")
        autotune.set_store_path(None)


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
    repeats = args.repeats if not args.smoke else 1
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    scale = d ** -0.5
    gen = torch.Generator(device=device).manual_seed(1)
    print(f"# Triton launch settings ({torch.cuda.get_device_name() if cuda else 'CPU interpreter'}, "
          f"torch {torch.__version__}); heads {heads}, head dim {d}, w = {w}, long-tailed gates, mu_f 7%")

    def pinned(kernels, call):
        def run(setting):
            with autotune.pinned({name: setting for name in kernels}):
                return call()
        return run

    q, k, v = qkv(1, heads, prefill_n, d, device, dtype)
    hard = long_tailed(1, heads, prefill_n, 0.07, generator=gen, device=device)
    ref = reference(q, k, v, hard, w, scale)
    prefill = lambda: [aha_prefill_triton(q, k, v, hard, w, scale)]  # noqa: E731
    with torch.no_grad():
        for kernel in ("sliding", "global"):
            sweep(f"Prefill, n = {prefill_n}: {kernel} kernel", candidates(kernel, d, dtype, prefill_n, args.smoke),
                  pinned([kernel], prefill), ref, tol, device, repeats)
    calls = [(f"prefill n = {prefill_n}", prefill, False)]

    tq, tk, tv = qkv(1, heads, train_n, d, device, dtype, grad=True)
    thard = long_tailed(1, heads, train_n, 0.07, generator=gen, device=device)
    up = torch.randn_like(tq)

    def train_step():
        out, _ = aha_train_triton(tq, tk, tv, thard, w, scale)
        return [out.detach(), *torch.autograd.grad((out * up).sum(), [tq, tk, tv])]

    ref = reference(tq, tk, tv, thard, w, scale, up)
    for kernels in (("local_dq", "global_dq"), ("dkdv",)):
        sweep(f"Training forward + backward, n = {train_n}: {' and '.join(kernels)}",
              candidates(kernels[0], d, dtype, train_n, args.smoke), pinned(kernels, train_step), ref, tol, device,
              repeats)
    del ref
    calls.append((f"training n = {train_n}", train_step, True))

    for n in decode_ns:
        _, dk, dv = qkv(8, heads, n, d, device, dtype)
        dq = qkv(8, heads, 1, d, device, dtype, seed=1)[0]
        gate = long_tailed(8, heads, 1, 0.07, generator=gen, device=device)[..., 0]
        gate[:, 0] = True  # as in allhere bench: one token per sequence, head 0 global
        ref = reference(dq, dk, dv, gate[..., None], w, scale)
        decode = lambda dq=dq, dk=dk, dv=dv, gate=gate: [aha_decode_triton(dq, dk, dv, gate, w, scale)]  # noqa: E731
        with torch.no_grad():
            sweep(f"Decode, B = 8, n = {n}", candidates("decode", d, dtype, n, args.smoke), pinned(["decode"], decode),
                  ref, tol, device, repeats)
        calls.append((f"decode B = 8, n = {n}", decode, False))
    first_calls(calls, device)


if __name__ == "__main__":
    main()
