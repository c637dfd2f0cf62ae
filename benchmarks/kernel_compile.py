"""Compile every Triton kernel of the project for a GPU that is not here, and print what each tile
setting costs it: registers per thread, bytes spilled to local memory, shared memory, whether Hopper's
wgmma instructions are used, and whether the setting can launch at all on that GPU. The settings are each
kernel's candidates in ``allhere/kernels/tiles.py`` pruned for that GPU (``tiles.prune``: what the
autotuner would time there).

    python benchmarks/kernel_compile.py                 # sm_90 (H100): every candidate the autotuner may time there
    python benchmarks/kernel_compile.py --default-only  # per kernel the setting autotune.pinned() gives there
                                                        # (a test runs this)
    python benchmarks/kernel_compile.py --arch 80       # A100
    python benchmarks/kernel_compile.py --default-only --arch 89 --head-dim 64 --dtype float16

No GPU is needed: Triton compiles through its own LLVM and the ptxas it ships with; only the launch is
left out (a stand-in driver reports the target, and every launch becomes a compile-only warmup). This is
the check that the kernels build for a real GPU with the Triton installed here (the CPU test suite runs
them in Triton's interpreter, which is not the compiler). It measures no speed.

Shapes follow the speed goals unless told otherwise: head dim 128, bf16, w = 256, GQA (8 query heads on 2 kv heads).
``dar_latent``'s decode kernel has one launch setting and no candidates: it is compiled with it at d_c = 64 and
512 (its latent tile the widest at Llama-3.2-1B's d_c), with 8 rotated numbers (4 pairs) per KV head.
"""

from __future__ import annotations

import argparse
import inspect
import os
import subprocess
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for real, before triton is imported

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from allhere.kernels import aha_pack, autotune, tiles  # noqa: E402
from allhere.kernels.aha_decode import aha_decode_triton  # noqa: E402
from allhere.kernels.aha_prefill import aha_prefill_triton  # noqa: E402
from allhere.kernels.aha_train import aha_train_triton  # noqa: E402
from allhere.masks import segment_starts  # noqa: E402
from allhere_recipes.gates import long_tailed  # noqa: E402

# Shared memory one block may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin), per compute capability.
MAX_SHARED = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
REGISTERS_PER_SM = 65536


def segment_mask(n: int) -> torch.Tensor:
    """[1, 1, n, n]: 16 padding positions, then documents of n // 4 tokens, causal within each."""
    pos = torch.arange(n)
    doc = torch.where(pos < 16, -1, pos // (n // 4))
    return ((pos[None, :] <= pos[:, None]) & (doc[None, :] == doc[:, None]) & (doc[:, None] >= 0))[None, None]


class TargetOnly:
    """A stand-in for Triton's CUDA driver: names the target GPU; there is no device to launch on."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target


# Exit status when this Triton's internals do not fit the stand-in (the test then skips, saying so).
UNSUPPORTED_TRITON = 3


def compile_only(log: list):
    """Make every kernel launch compile and skip the launch; each compiled kernel is appended to ``log``.
    Relies on Triton internals (``JITFunction.run(*args, grid, warmup, **kwargs)``, ``driver.set_active``)."""
    launch = JITFunction.run
    params = inspect.signature(launch).parameters
    if not {"grid", "warmup"} <= params.keys() or not hasattr(driver, "set_active"):
        raise SystemExit(UNSUPPORTED_TRITON)

    def run(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        log.append((self.fn.__name__, kernel))
        return kernel

    JITFunction.run = run


def resources(kernel) -> dict:
    """Registers and local (spill) bytes from the cubin (the cuobjdump Triton ships), shared bytes and warps
    from Triton's metadata, and whether the PTX uses wgmma."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    fields = dict(part.split(":", 1) for part in usage.split() if ":" in part and part.split(":")[0].isupper())
    meta = kernel.metadata
    return dict(regs=int(fields["REG"]), local=int(fields["LOCAL"]), stack=int(fields["STACK"]),
                shared=meta.shared + int(fields["SHARED"]), warps=meta.num_warps,
                wgmma="wgmma.mma_async" in kernel.asm["ptx"])


def fits(r: dict, arch: int) -> str:
    """"ok", or why this kernel cannot launch on that GPU."""
    limit = MAX_SHARED.get(arch, MAX_SHARED[80])
    problems = []
    if r["shared"] > limit:
        problems.append(f"shared {r['shared'] // 1024} KiB > {limit // 1024} KiB")
    if r["regs"] * 32 * r["warps"] > REGISTERS_PER_SM:
        problems.append("registers")
    return "; ".join(problems) or "ok"


LATENT_WIDTHS = (64, 512)  # dar_latent's d_c: SmolLM2's served shape, Llama-3.2-1B's (d_c + 2 r G = G d_h)
LATENT_SETTING = dict(split=512, block_n=32, warps=4, stages=3)  # dar_latent_decode_triton's (stages: Triton's default)


def latent_decode(q: torch.Tensor, d_c: int, w: int, e_r: int = 8, n: int = 1024) -> None:
    """One call of dar_latent's decode kernel (values meaningless): q [b, h, 1, d] over 2 KV heads."""
    from allhere.kernels.dar_latent_decode import dar_latent_decode_triton
    from allhere.ops.dar_latent.check import pack_rows

    b, h, _, d = q.shape
    g = 2
    r = lambda *shape: torch.randn(*shape, dtype=q.dtype)  # noqa: E731
    dar_latent_decode_triton(q, r(b, h, 1, d), r(b, g, w, d), r(b, g, w, d), pack_rows(r(b, n, d_c), r(b, g, n, e_r)),
                             torch.randn(g, d - e_r, d_c), torch.randn(g, d, d_c), w)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (default 90: H100)")
    ap.add_argument("--default-only", action="store_true", help="only the kernels' default tile settings")
    ap.add_argument("--head-dim", type=int, default=128, help="head dim (a power of two >= 16; default 128)")
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    log: list = []
    compile_only(log)
    driver.set_active(TargetOnly(args.arch))

    b, h, hkv, n, d, w = 1, 8, 2, 1024, args.head_dim, 256
    q = torch.randn(b, h, n, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, hkv, n, d, dtype=dtype, requires_grad=True) for _ in range(2))
    hard = long_tailed(b, h, n, 0.07, generator=torch.Generator().manual_seed(0))
    decode_q = torch.randn(2, h, 1, d, dtype=dtype)
    gate = torch.ones(2, h, dtype=torch.bool)

    segments = segment_starts(segment_mask(n), n, n)  # 16 padding positions, then packed documents
    scale = d ** -0.5

    def prefill(starts):
        with torch.no_grad():
            aha_prefill_triton(q, k, v, hard, w, scale, row_start=starts)

    def train(starts):
        out, _ = aha_train_triton(q, k, v, hard, w, scale, row_start=starts)
        torch.autograd.grad(out.sum(), [q, k, v])  # the three backward kernels (values are meaningless)

    def decode(starts):  # with segments: per-sequence starts and lengths on the device
        lens = None if starts is None else dict(kv_start=torch.tensor([0, 16]), kv_len=torch.tensor([n, n - 8]))
        aha_decode_triton(decode_q, k.detach(), v.detach(), gate, w, scale, **(lens or {}))

    # Each kernel's candidates pruned for the target (what the autotuner would time on it), pinned one at a
    # time for that kernel alone (the others run their interpreter defaults, not recorded).
    calls = {"sliding": ("prefill", prefill, "_sliding_kernel"), "global": ("prefill", prefill, "_global_kernel"),
             "local_dq": ("training", train, "_local_dq_kernel"), "global_dq": ("training", train, "_global_dq_kernel"),
             "dkdv": ("training", train, "_dkdv_kernel"), "decode": ("decode", decode, None)}
    capability, shared = divmod(args.arch, 10), MAX_SHARED.get(args.arch, MAX_SHARED[80])
    rows = []
    for kernel, (part, call, only) in calls.items():
        settings = tiles.prune(kernel, d, dtype.itemsize, capability, shared, n)
        for setting in settings[:1] if args.default_only else settings:
            for starts in (None, segments):
                start = len(log)
                # the global kernels' two orders: fixed without segments, sorted (longest first) with them
                aha_pack.SORT_FROM = n + 1 if starts is None else 0
                with autotune.pinned({kernel: setting}):
                    call(starts)
                seg = "" if starts is None else ", segments"
                rows.extend((f"{name} ({part}{seg})", setting, resources(compiled)) for name, compiled in log[start:]
                            if only in (None, name))

    # dar_latent's decode kernel: one fixed launch setting (no candidates), at a small and a large latent
    for d_c in LATENT_WIDTHS:
        start = len(log)
        latent_decode(decode_q, d_c, w)
        rows.extend((f"{name} (dar_latent decode, d_c {d_c})", LATENT_SETTING, resources(compiled))
                    for name, compiled in log[start:])

    print(f"# Triton kernels compiled for sm_{args.arch} (triton {triton.__version__}, no GPU; head dim {d}, "
          f"{args.dtype})\n\nSettings: (BLOCK_M, BLOCK_N, warps, stages); decode: (SPLIT, BLOCK_N, warps, stages).\n")
    print("| kernel | tiles | registers | spilled B | shared KiB | wgmma | launches |\n|---|---|---|---|---|---|---|")
    for label, setting, r in rows:
        print(f"| {label} | {tuple(setting.values())} | {r['regs']} | {r['local'] + r['stack']} "
              f"| {r['shared'] / 1024:.0f} | {'yes' if r['wgmma'] else 'no'} | {fits(r, args.arch)} |")


if __name__ == "__main__":
    main()
