#!/usr/bin/env bash
# Every GPU check and measurement of the project in one device call (well inside its 10 minutes):
# the CUDA tests (kernels compiled for real, bf16 against the fp32 reference), `allhere bench` (the
# prefill / decode / training table) and the SFT throughput of issue 4. Runs from the repository root
# without installing (the lent machine's image has torch, triton and transformers; nothing can be
# fetched there). Logs and reports go to $OUT (the device tool's folder) or runs/gpu.
#
#   bash benchmarks/gpu_session.sh
set -uo pipefail
out="${OUT:-runs/gpu}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$out/versions.txt"
python3 -m pytest -q tests/test_gpu.py tests/test_kernels.py 2>&1 | tee "$out/tests.log"
python3 -m allhere.cli bench --out "$out" 2>&1 | tee "$out/bench.log"
python3 benchmarks/sft_throughput.py --device cuda 2>&1 | tee "$out/sft_throughput.log"
