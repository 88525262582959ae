#!/usr/bin/env bash
# The RL frameworks' own rollout clients, each in its own venv under .peers/ (never a dependency of
# moeshard), for tests/test_rl_clients.py: SkyRL's RemoteInferenceClient and AReaL's SGLang engine.
#     bash scripts/rl_clients.sh [skyrl] [areal]     (default: both)
# Each framework is installed unmodified with --no-deps (their full dependency sets pin CUDA builds,
# vLLM or SGLang, and an older torch), then only what their client modules import:
# - SkyRL 0.3.0, the newest that installs on Python 3.11: remote_inference_client.py imports only
#   aiohttp (and two stdlib-only skyrl modules). Its trainer side is vLLM's NCCL weight-transfer
#   engine, which needs CUDA: the test's trainer runs in moeshard's venv instead (gloo).
# - AReaL 1.0.4: areal/engine/sglang_remote.py imports areal.api and areal.infra, whose package
#   __init__s pull in ray, hydra, transformers, flask and more; the list below is what that import
#   needs, found by importing it until nothing was missing. AReaL pins torch<2.11; the torch
#   moeshard pins (2.13.0) runs its client code as well.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

venv() {  # venv NAME: a venv of its own under .peers/
  [ -x ".peers/$1/bin/python" ] || "$PYTHON" -m venv ".peers/$1"
}

skyrl() {  # about 30 s on a fresh machine
  venv skyrl
  .peers/skyrl/bin/pip install -q --no-deps "skyrl==0.3.0"
  .peers/skyrl/bin/pip install -q "aiohttp==3.14.5"
  .peers/skyrl/bin/python -c "import aiohttp, importlib.metadata as m; print('SkyRL', m.version('skyrl'), 'in .peers/skyrl')"
}

areal() {  # about 2.5 min on a fresh machine (torch, ray, transformers, numba)
  venv areal
  .peers/areal/bin/pip install -q --no-deps "areal==1.0.4"
  .peers/areal/bin/pip install -q "torch==2.13.0" "numpy" "pybase64" "aiohttp==3.14.5" "aiofiles" "httpx" "requests" \
    "colorlog" "tenacity" "flask" "torchdata==0.11.0" "lark" "uvloop" "pyyaml" "hydra-core==1.4.0.dev1" \
    "omegaconf==2.4.0.dev2" "transformers==5.3.0" "ray" "numba" "pillow" "orjson" "einops" "openai"
  .peers/areal/bin/python -c "import areal.engine.sglang_remote, importlib.metadata as m; print('AReaL', m.version('areal'), 'in .peers/areal')"
}

[ $# -gt 0 ] || set -- skyrl areal
for name in "$@"; do
  case $name in
    skyrl|areal) "$name" ;;
    *) echo "unknown client $name: skyrl or areal" >&2; exit 2 ;;
  esac
done
