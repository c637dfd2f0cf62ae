"""The launch settings the Triton kernels choose from (plain data: importing this needs no triton).

A setting is a dict of the kernel's tile constants and Triton's launch options. Each kernel family has a
default (the first of its list: what runs under Triton's interpreter and what ``autotune.pinned()``
gives) and a short list of candidates that ``autotune`` times on the GPU the first time a shape class is
seen, after pruning the ones that device cannot run well (``prune``). The lists are a handful each so that
the first call stays cheap: the points of Triton's fused-attention tutorial's space (BLOCK_M {64, 128} x
BLOCK_N {32, 64, 128} x stages {2, 3, 4} x warps {4, 8}) that are its usual winners for head dims 64-128.
"""

from __future__ import annotations


def _block(m: int, n: int, warps: int, stages: int, tma: bool = False) -> dict:
    return dict(BLOCK_M=m, BLOCK_N=n, num_warps=warps, num_stages=stages, **({"TMA": True} if tma else {}))


# The lists below were trimmed by what each setting costs when compiled for sm_90 at head dims 64 and 128
# (``benchmarks/kernel_compile.py``: registers, spills, shared memory): settings that spilled hundreds of
# bytes at both head dims are out. TMA: the key and value tiles fetched through tensor descriptors (Hopper
# and later; ``prune`` drops them elsewhere).
# The forward kernels (sliding window over every query; the packed global queries). The first was the
# only setting before autotuning (no register spills in any forward kernel on sm_90).
# (32, 64, 4, 3): for short sequences only (SMALL_TILES_UNTIL): at 4k with mu_f 7% the global queries fill under
# 80 tiles of 64 rows, under one wave of an H200's 132 SMs (the tuner timed that kernel at ~55 TFLOP/s).
FORWARD = [_block(64, 64, 8, 3), _block(128, 128, 8, 3), _block(128, 128, 8, 2), _block(64, 64, 4, 4),
           _block(64, 64, 4, 3), _block(128, 64, 4, 3), _block(64, 32, 4, 2), _block(128, 128, 8, 3, tma=True),
           _block(64, 64, 4, 3, tma=True), _block(32, 64, 4, 3)]
SMALL_TILES_UNTIL = 8192  # positions: forward query tiles of 32 rows are timed up to this length only
# The dQ kernels of the backward (q, dO and a [BLOCK_M, D] fp32 accumulator stay in registers).
DQ = [_block(64, 64, 8, 3), _block(64, 64, 4, 3), _block(128, 128, 8, 2), _block(32, 64, 4, 3), _block(64, 32, 4, 2),
      _block(64, 64, 4, 3, tma=True)]
# The dK / dV kernel: one key block of BLOCK_N keys, query rows BLOCK_M at a time (its two [BLOCK_N, D] fp32
# accumulators leave fewer registers: 64 rows with 64 keys spill on sm_90, so 32 rows come first). Out:
# (32, 128, 8 warps, 3 stages) and (16, 64, 4, 3), whose gradients were 6e-2 and 3e-2 off the fp32 reference
# on an H200 with triton 3.6 (``benchmarks/kernel_tiles.py``; every other setting 2e-3 to 3e-3, and both
# exact in the interpreter): the only ones with four times as many keys as query rows in a tile.
DKDV = [_block(32, 64, 8, 3), _block(32, 64, 4, 3), _block(32, 32, 4, 2), _block(64, 64, 8, 3)]
# The decode kernel: SPLIT keys per program (the cache is split across programs), BLOCK_N keys per step.
DECODE = [dict(SPLIT=512, BLOCK_N=64, num_warps=4, num_stages=2),
          dict(SPLIT=256, BLOCK_N=64, num_warps=4, num_stages=2),
          dict(SPLIT=1024, BLOCK_N=64, num_warps=4, num_stages=3),
          dict(SPLIT=2048, BLOCK_N=128, num_warps=4, num_stages=3),
          dict(SPLIT=512, BLOCK_N=128, num_warps=8, num_stages=2),
          dict(SPLIT=1024, BLOCK_N=128, num_warps=8, num_stages=3),
          dict(SPLIT=256, BLOCK_N=32, num_warps=2, num_stages=2)]

HOPPER_RULE = ("sliding", "global", "local_dq", "global_dq")
SPACES = {"sliding": FORWARD, "global": FORWARD, "local_dq": DQ, "global_dq": DQ, "dkdv": DKDV, "decode": DECODE}


def default(kernel: str) -> dict:
    """The kernel's default setting (a copy)."""
    return dict(SPACES[kernel][0])


def shared_bytes(setting: dict, head_dim: int, elem: int) -> int:
    """A lower bound of the shared memory a block kernel's setting needs: the pipelined key and value
    tiles (num_stages of each) and the resident query tile. Triton may need more (it then refuses to
    compile, and the tuner skips the setting); a setting over the device's limit is not even tried."""
    if "SPLIT" in setting:
        return setting["num_stages"] * 2 * setting["BLOCK_N"] * head_dim * elem
    return (setting["num_stages"] * 2 * setting["BLOCK_N"] + setting["BLOCK_M"]) * head_dim * elem


def tma_possible(capability: tuple[int, int]) -> bool:
    """Whether tensor descriptors can be used: a GPU of compute capability 9.0 or later (the copy engine)
    and a triton that builds them in a kernel."""
    if capability[0] < 9:
        return False
    try:
        import triton.language as tl
    except ImportError:
        return False
    return hasattr(tl, "make_tensor_descriptor")


def prune(kernel: str, head_dim: int, elem: int, capability: tuple[int, int], max_shared: int,
          length: int | None = None) -> list[dict]:
    """The candidates of ``kernel`` worth timing on a device of compute ``capability`` with ``max_shared``
    bytes of shared memory per block, for head dim ``head_dim`` in ``elem``-byte numbers: those whose
    tiles fit (``shared_bytes``); tensor descriptors only where ``tma_possible``; on Hopper (capability 9.x),
    for the kernels whose dots are [BLOCK_M, BLOCK_N] query-by-key tiles, not 8 warps on a tile under
    128 x 128 (the rule of Triton's fused-attention tutorial: too few rows for two warp groups); not a query
    tile longer than the sequence ``length`` (it would be mostly empty), nor a decode split above it, nor a
    forward query tile under 64 rows past SMALL_TILES_UNTIL (it helps only a grid too small for the GPU).
    Never empty: the default stays when nothing else does."""
    keep = []
    for s in SPACES[kernel]:
        if shared_bytes(s, head_dim, elem) > max_shared or (s.get("TMA") and not tma_possible(capability)):
            continue
        if (capability[0] == 9 and kernel in HOPPER_RULE and s["num_warps"] == 8
                and s["BLOCK_M"] * s["BLOCK_N"] < 128 * 128):
            continue
        if length is not None and (s.get("BLOCK_M", 0) > max(length, 16) or s.get("SPLIT", 0) > max(length, 256)):
            continue
        if kernel in ("sliding", "global") and s["BLOCK_M"] < 64 and (length is None or length > SMALL_TILES_UNTIL):
            continue
        keep.append(dict(s))
    return keep or [default(kernel)]
