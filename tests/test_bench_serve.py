"""`moeshard bench serve` end to end on the bundled model: it starts the servers itself, streams a
small random workload, and reports what it measured (no timing is asserted)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moeshard.bundled.arithmetic import MODEL_DIR

SMALL = ["--model", str(MODEL_DIR), "--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "5",
         "--num-warmups", "1"]


def bench_serve(tmp_path, *extra: str) -> dict:
    out = tmp_path / "serve.json"
    done = subprocess.run([sys.executable, "-m", "moeshard", "bench", "serve", *SMALL, *extra, "--json", str(out),
                           "--plot", str(tmp_path / "serve.png")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "serve.png").read_bytes()[:4] == b"\x89PNG"
    return json.loads(out.read_text())


def test_bench_serve_reports_every_request_at_each_concurrency(tmp_path):
    report = bench_serve(tmp_path, "--max-concurrency", "1,3", "--repeats", "1")
    assert [(r["server"], r["concurrency"], r["completed"], r["failed"]) for r in report["runs"]] == [
        ("moeshard", 1, 4, 0), ("moeshard", 3, 4, 0)]
    for run in report["runs"]:
        assert run["output_throughput"] > 0 and run["median_ttft_ms"] > 0 and run["p99_e2el_ms"] >= run["median_e2el_ms"]
        assert run["total_token_throughput"] > run["output_throughput"]
    assert report["memory"]["moeshard"]["rss_mb"] > 0


@pytest.mark.long_pole
def test_bench_serve_against_transformers_serve_agrees_on_greedy_completions(tmp_path):
    # fp32: there every engine's greedy tokens are the same; in bf16 moeshard's kernels round otherwise
    # than torch's bf16 ops, and the completions drift apart after the first differing token
    report = bench_serve(tmp_path, "--against", "transformers", "--max-concurrency", "2", "--repeats", "2",
                         "--dtype", "float32")
    assert sorted((r["server"], r["repetition"], r["completed"]) for r in report["runs"]) == [
        ("moeshard", 0, 4), ("moeshard", 1, 4), ("transformers", 0, 4), ("transformers", 1, 4)]
    assert {row["metric"] for row in report["ratios"]} == {"output tok/s", "median TTFT", "median TPOT"}
    assert all(row["identical_completions"] == 8 and row["identical_tokens"] == 1 and row["median"] > 0
               for row in report["ratios"])
    assert set(report["memory"]) == {"moeshard", "transformers"}


def test_vllm_server_command_and_env_without_vllm_installed(monkeypatch):
    """vLLM's OpenAI server as bench serve starts it: its module (not `vllm serve`), 127.0.0.1, the
    dtype asked for, moeshard's step budget, and the KV cache moeshard reserves, in bytes, from the
    flag alone (VLLM_CPU_KVCACHE_SPACE, which would override it, is not passed on)."""
    from moeshard.bench.servers import server_command, server_env

    monkeypatch.setenv("MOESHARD_VLLM_PYTHON", sys.executable)  # any file: nothing is started
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "40")
    command = server_command("vllm", str(MODEL_DIR), 8123, 2, "bfloat16")
    assert command[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(command[3::2], command[4::2]))
    # 2 sequences × 32 positions, in 16-token blocks; per token: 4 layers × K and V × 2 heads × 32 dims × 2 bytes
    assert flags == {"--model": str(MODEL_DIR), "--dtype": "bfloat16", "--host": "127.0.0.1", "--port": "8123",
                     "--max-num-seqs": "2", "--max-num-batched-tokens": "2048",
                     "--kv-cache-memory-bytes": str(2 * 32 * 4 * 2 * 2 * 32 * 2), "--seed": "0",
                     "--uvicorn-log-level": "warning"}
    for threads, cores in ((1, "0"), (2, "0-1")):
        env = server_env("vllm", threads)
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == cores and "VLLM_CPU_KVCACHE_SPACE" not in env


def test_bench_serve_against_vllm_not_installed_fails_before_starting_anything(tmp_path):
    done = subprocess.run([sys.executable, "-m", "moeshard", "bench", "serve", *SMALL, "--against", "vllm"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MOESHARD_VLLM_PYTHON": str(tmp_path / "missing" / "python")})
    assert done.returncode != 0
    assert "vLLM's CPU build is not installed" in done.stdout + done.stderr


def test_stop_kills_the_server_and_what_it_left_behind():
    """A server whose child outlives it on SIGTERM: stop() still ends both, by PID and process group."""
    from moeshard.serve.launcher import process_tree, stop

    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, time; "
                               "subprocess.Popen(['sleep', '60']); time.sleep(60)"], start_new_session=True)
    deadline = time.monotonic() + 30
    while len(process_tree(parent.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    child = process_tree(parent.pid)[1]
    stop(parent)
    assert parent.returncode is not None
    time.sleep(0.2)  # for init to reap the orphan
    try:
        assert "zombie" in Path(f"/proc/{child}/status").read_text()
    except FileNotFoundError:
        pass  # gone


@pytest.mark.long_pole
def test_bench_serve_prefix_dataset_with_and_without_caching(tmp_path):
    """A shared 64-token prefix: moeshard serve finds it cached, its /metrics count the same hit rate
    as the responses' usage, and the completions equal those of a server without prefix caching."""
    out = tmp_path / "prefix.json"
    done = subprocess.run([sys.executable, "-m", "moeshard", "bench", "serve", "--dataset", "prefix", "--prefix-len",
                           "64", "--num-prompts", "6", "--random-input-len", "8", "--random-output-len", "4",
                           "--num-warmups", "1", "--max-concurrency", "3", "--repeats", "1",
                           "--against", "moeshard-no-cache", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    runs = {r["server"]: r for r in report["runs"]}
    cached, uncached = runs["moeshard"], runs["moeshard-no-cache"]
    # the warm-up request cached the prefix's 4 full blocks: every request finds at least those
    assert cached["prefix_hit_rate"] >= 64 / (64 + 15) - 1e-9  # suffixes of 1 to 15 tokens
    assert cached["prefix_hit_rate"] == cached["metrics_prefix_hit_rate"]
    assert uncached["prefix_hit_rate"] == uncached["metrics_prefix_hit_rate"] == 0
    assert all(row["identical_completions"] == 6 for row in report["ratios"])
