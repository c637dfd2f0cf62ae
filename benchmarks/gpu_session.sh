#!/usr/bin/env bash
# Every GPU check and measurement of the project, from the repository root, without installing (the lent
# machine's image has torch, triton and transformers; nothing can be fetched there). Logs and reports go
# to $OUT (the device tool's folder) or runs/gpu. Parts, in order (default: all of them):
#   tests  the CUDA tests: kernels compiled for real, bf16 against the fp32 reference (~1-2 min)
#   tiles  benchmarks/kernel_tiles.py: block sizes / warps / stages / decode split of the Triton kernels
#   bench  allhere bench: the prefill / decode / training table against the fastest dense SDPA
#   sft    benchmarks/sft_throughput.py --device cuda: SFT tokens/s, AHA vs SDPA (one document
#          per row, then packed documents of 512 tokens)
#   mechanisms  tests/test_gpu_mechanisms.py: every mechanism in a Decoder against the CPU, the patterns'
#          FlexAttention path (fp32/bf16, segments, KV cache), the AA-MoE op, ring attention on one rank
#          (NCCL); about 20 FlexAttention compilations
#   patterns  benchmarks/patterns_speed.py --device cuda at n = 8192 and 32768, block-sparse then
#          FlexAttention, against the fastest dense SDPA backend
# A device call has 10 minutes: run them as four calls (each part's time is a guess: never run on a GPU;
# the last may need splitting into its two parts),
#   bash benchmarks/gpu_session.sh tests tiles
#   bash benchmarks/gpu_session.sh bench
#   bash benchmarks/gpu_session.sh sft
#   bash benchmarks/gpu_session.sh mechanisms patterns
set -uo pipefail
out="${OUT:-runs/gpu}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests tiles bench sft mechanisms patterns)
for part in "${parts[@]}"; do
  case "$part" in tests|tiles|bench|sft|mechanisms|patterns) ;;
    *) echo "error: unknown part '$part' (tests, tiles, bench, sft, mechanisms, patterns)" >&2; exit 2 ;; esac
done
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$out/versions.txt"
status=0  # non-zero when any part failed (each part still runs)
for part in "${parts[@]}"; do
  case "$part" in
    tests) python3 -m pytest -q tests/test_gpu.py tests/test_kernels.py 2>&1 | tee "$out/tests.log" ;;
    tiles) python3 benchmarks/kernel_tiles.py 2>&1 | tee "$out/tiles.md" ;;
    bench) python3 -m allhere.cli bench --out "$out" 2>&1 | tee "$out/bench.log" ;;
    sft) { python3 benchmarks/sft_throughput.py --device cuda
           python3 benchmarks/sft_throughput.py --device cuda --doc-len 512 --router-init local; } 2>&1 \
           | tee "$out/sft_throughput.log" ;;
    mechanisms) python3 -m pytest -q -rsx --durations=15 tests/test_gpu_mechanisms.py 2>&1 | tee "$out/mechanisms.log" ;;
    patterns) { rc=0
                for n in 8192 32768; do
                  for backend in blocksparse flex; do
                    python3 benchmarks/patterns_speed.py --device cuda --n "$n" --backend "$backend" || rc=1; echo
                  done
                done
                exit $rc; } 2>&1 | tee "$out/patterns.md" ;;
  esac || { echo "gpu_session: part '$part' failed" >&2; status=1; }
done
exit $status
