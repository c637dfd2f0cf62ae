"""The tile settings of the Triton kernels that the kernel benchmarks try (``benchmarks/kernel_tiles.py``
times them on a GPU, ``benchmarks/kernel_compile.py`` compiles them for a GPU that is not here). The
first of each list is the kernels' default. Plain data: importing this needs no triton."""

# (block_m, block_n, num_warps, num_stages) of the prefill and training kernels.
# The default (8 warps) is the setting with no register spills in any forward kernel on sm_90
# (kernel_compile.py); it has not been timed. Its 3 stages are what the kernels pick on an H100 or A100
# (allhere.kernels.pipeline_stages; 2 on GPUs with 99 KiB of shared memory per block).
BLOCK_TILES = [(64, 64, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2), (64, 128, 4, 3), (64, 128, 8, 3), (32, 64, 4, 3),
               (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 2)]
# (split, block_n, num_warps) of the decode kernel.
DECODE_TILES = [(512, 64, 4)] + [(s, bn, w) for s in (256, 512, 1024, 2048) for bn in (32, 64, 128)
                                 for w in (2, 4) if (s, bn, w) != (512, 64, 4)]
# (rows, num_warps) of the dK / dV kernel (its block_n and stages are the block tiles').
DKDV_TILES = [(32, 8), (32, 4), (16, 4), (64, 8), (64, 4)]
