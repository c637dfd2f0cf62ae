"""Where FlexAttention's time goes for the sparse patterns: the tiles it visits, or the predicate it evaluates
in them.

    python benchmarks/flex_mask_cost.py --device cuda             # n = 32768, bf16 (what a GPU session runs)
    python benchmarks/flex_mask_cost.py --device cpu --n 512      # a smoke test of the script (unfused, fp32)

On an H200 at 32k (torch 2.11, 8 heads, 2 KV heads, head dim 64) FlexAttention ran sliding windows at 9.1x
dense and sinks at 6.3x, but Longformer at 0.75x, BigBird at 1.2x and a multi-dilation layer at 0.54x.
Sinks and Longformer visit the same tiles (a window and the first key tile); the slow three were the
predicates that read captured tables per score (global flags, random blocks, per-head strides, the
latter also divided by an int64 stride). Longformer's global tokens are comparisons now, and per-head
strides int32; this script tells whether that was the cost.

For each pattern one BlockMask is built as the pattern layers build it (``allhere.ops.flex.flex_block_mask``),
and flex_attention is timed on its tiles with:

- ``pattern``: the pattern's predicate as the mechanisms run it;
- ``table``: Longformer's global flags looked up in a captured table per score (its form before);
- ``table (int64)``: the per-head strides as an int64 table (the form before: a 64-bit division per score);
- ``constants``: the per-head strides without a table: one test per distinct stride, a division by a
  constant each, selected by comparing the head;
- ``no mask``: a predicate that keeps everything, on the same tiles: what visiting them costs.

The tiles column counts the tiles FlexAttention visits per query tile and head: partial (the predicate is
evaluated) + full (it is not); the tile limit is causal's count over the pattern's. Times are the fastest of
``--repeats`` calls after a compiling warm-up, against the fastest dense SDPA backend and FlexAttention's own
causal attention of the same run. On the CPU flex_attention runs unfused (no compilation): a smoke test.
"""

from __future__ import annotations

import argparse
import os

import torch
from patterns_speed import fastest_dense
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from allhere.masks import (
    as_mask,
    bigbird,
    causal,
    dilated_window,
    longformer,
    or_masks,
    sliding_window,
    sliding_with_sinks,
)
from allhere.ops.flex import flex_block_mask, flex_pattern_attention
from allhere_recipes.timing import best_time


def table_global(flags: torch.Tensor):
    """Global tokens as a lookup of ``flags`` [n] per score (the form before comparisons)."""
    n = flags.numel()

    def pred(b, h, q_idx, kv_idx):
        at = lambda p: flags[p.clamp(0, n - 1)] & (p >= 0) & (p < n)  # noqa: E731
        return (at(q_idx) | at(kv_idx)) & (kv_idx <= q_idx)

    return pred


def table_dilated(window: int, strides: torch.Tensor):
    """A dilated window whose stride is looked up per head in ``strides`` per score."""
    def pred(b, h, q_idx, kv_idx):
        d = strides[h]
        diff = q_idx - kv_idx
        return (diff >= 0) & (diff % d == 0) & (diff <= (window - 1) * d)

    return pred


def constant_dilated(window: int, dils: tuple):
    """A dilated window with one test per distinct stride (a constant divisor), selected by the head."""
    def pred(b, h, q_idx, kv_idx):
        diff = q_idx - kv_idx
        out = None
        for d in sorted(set(dils)):
            mine = None
            for i, di in enumerate(dils):
                if di == d:
                    mine = (h == i) if mine is None else mine | (h == i)
            part = mine & (diff >= 0) & (diff % d == 0) & (diff <= (window - 1) * d)
            out = part if out is None else out | part
        return out

    return pred


def keep_all(b, h, q_idx, kv_idx):
    return q_idx >= 0


def cases(n: int, heads: int, kv_heads: int, device) -> dict:
    """{pattern: (its predicate, {variant: predicate on the same tiles})}."""
    w = 512
    dils = (1, 2, 4, 8) * (heads // 4)
    flags = (torch.arange(n) < 16).to(device)
    strides = torch.tensor(dils, device=device)
    return {
        f"sinks w={w} s=4": (sliding_with_sinks(w, 4), {}),
        f"longformer w={w} g=16": (longformer(w, torch.arange(n) < 16),
                                   {"table": or_masks(sliding_window(w), table_global(flags))}),
        f"dilated w={w // 4} d=(1,2,4,8)x": (dilated_window(w // 4, dils),
                                             {"table (int64)": table_dilated(w // 4, strides),
                                              "constants": constant_dilated(w // 4, dils)}),
        "bigbird b=64 w=3 g=1 r=3": (bigbird(64, 3, 1, 3, seed=0, heads_per_draw=heads // kv_heads), {}),
    }


def same_tiles(mask: BlockMask, mask_mod) -> BlockMask:
    """``mask``'s tile lists with another predicate (a ``Mask``'s plain function, as ``flex_block_mask`` gives)."""
    mask_mod = as_mask(mask_mod).pred
    lists = (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices)
    try:
        return BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=mask.BLOCK_SIZE, mask_mod=mask_mod,
                                        seq_lengths=mask.seq_lengths)
    except TypeError:  # a torch whose BlockMask has no seq_lengths: the lengths are the tiles'
        return BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=mask.BLOCK_SIZE, mask_mod=mask_mod)


def tiles_per_row(mask: BlockMask) -> tuple[float, float]:
    """(partial, full) tiles visited per query tile and head."""
    rows = mask.kv_num_blocks.numel()
    full = 0.0 if mask.full_kv_num_blocks is None else mask.full_kv_num_blocks.sum().item() / rows
    return mask.kv_num_blocks.sum().item() / rows, full


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--n", type=int, default=None, help="sequence length (default 32768 on CUDA, 512 on the CPU)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device here")
    if args.heads % 4 or args.heads % args.kv_heads:
        p.error("--heads must be a multiple of 4 (the dilations 1, 2, 4, 8) and of --kv-heads")
    n = args.n or (32768 if cuda else 512)
    h, hkv, dev = args.heads, args.kv_heads, torch.device(args.device)
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, x, n, args.dim, generator=g).to(dev, dtype) for x in (h, hkv, hkv))
    attend = flex_pattern_attention if cuda else (
        lambda q, k, v, mask: flex_attention(q, k, v, block_mask=mask, enable_gqa=h != hkv))

    def timed(mask) -> float:
        if cuda:
            torch._dynamo.reset()  # one compilation per variant: never past dynamo's recompile limit
        return best_time(lambda: attend(q, k, v, mask), args.repeats, device=args.device)

    print(f"# {'SMOKE TEST (CPU, unfused flex_attention): not a measurement; ' if not cuda else ''}n={n} heads={h} "
          f"kv_heads={hkv} dim={args.dim} device={torch.cuda.get_device_name(dev) if cuda else 'cpu'} "
          f"torch {torch.__version__}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with torch.no_grad():
        if cuda:
            dense_name, dense_call = fastest_dense(q, k, v, args.repeats)
        else:
            dense_name = "SDPA (math)"
            dense_call = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                q, k, v, is_causal=True, enable_gqa=hkv != h)
        dense = best_time(dense_call, args.repeats, device=args.device)
        causal_mask = flex_block_mask(causal, n, n, heads=h, device=dev, per_batch=False, per_head=False)
        flex_causal = timed(causal_mask)
        causal_tiles = sum(tiles_per_row(causal_mask))
        print(f"dense: {dense_name} {1e3 * dense:.3f} ms; FlexAttention causal {1e3 * flex_causal:.3f} ms "
              f"({causal_tiles:.1f} tiles per query tile)\n")
        print("| pattern | predicate | tiles per query tile: partial + full | tile limit | ms | vs dense SDPA | "
              "vs Flex causal |")
        print("|---|---|---|---|---|---|---|")
        for name, (pred, others) in cases(n, h, hkv, dev).items():
            mask = flex_block_mask(pred, n, n, heads=h, device=dev, per_batch=False,
                                   per_head=pred.per_head)
            partial, full = tiles_per_row(mask)
            variants = {"pattern": mask, **{k: same_tiles(mask, m) for k, m in others.items()},
                        "no mask": same_tiles(mask, keep_all)}
            for label, m in variants.items():
                t = timed(m)
                print(f"| {name} | {label} | {partial:.2f} + {full:.2f} | {causal_tiles / (partial + full):.1f}x "
                      f"| {1e3 * t:.3f} | {dense / t:.2f}x | {flex_causal / t:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
