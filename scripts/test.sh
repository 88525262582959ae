#!/usr/bin/env bash
# Set up from nothing (scripts/setup.sh) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# SkyRL's rollout client (~30 s) for tests/test_rl_clients.py; AReaL's (~2.5 min: ray, hydra, numba)
# only where `bash scripts/rl_clients.sh areal` was run, else its tests skip and say so.
bash scripts/rl_clients.sh skyrl
.venv/bin/python -m pytest -n 2 --dist loadgroup --durations=25 "$@"  # the slowest tests: the suite keeps to 35 min
