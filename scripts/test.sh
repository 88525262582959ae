#!/usr/bin/env bash
# Set up from nothing (scripts/setup.sh) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -n 2 --dist loadgroup --durations=25 "$@"  # the slowest tests: the suite keeps to 30 min
