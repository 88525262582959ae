"""Benchmarks run end to end at small sizes (their timings are reported, never asserted)."""

import subprocess
import sys


def test_bench_lm_head_runs_and_checks_parity():
    proc = subprocess.run(
        [sys.executable, "-m", "moeshard", "bench", "lm-head", "--vocab", "1000", "--hidden", "64", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "vocab-parallel" in proc.stdout and "ratio" in proc.stdout
