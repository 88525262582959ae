#!/usr/bin/env bash
# Set up a fresh machine: a venv in .venv with moeshard and its test tools installed.
# CPU machines get the pinned torch 2.13.0 CPU build; a machine whose python already has a torch
# (a CUDA build, say) keeps it, through --system-site-packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  if "$PYTHON" -c "import torch" 2>/dev/null; then
    "$PYTHON" -m venv --system-site-packages .venv
  else
    "$PYTHON" -m venv .venv
  fi
fi
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q "torch==2.13.0"
.venv/bin/pip install -q -e ".[test]"
# Build moeshard.kernels now (~15 s; a no-op where the CPU lacks AVX512-BF16) rather than inside the
# first engine that serves bf16.
.venv/bin/python -c "from moeshard import kernels; kernels.built()"
