"""`moeshard bench serve` end to end on the bundled model: it starts the servers itself, streams a
small random workload, and reports what it measured (no timing is asserted)."""

import json
import subprocess
import sys

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


def test_bench_serve_against_transformers_serve_agrees_on_greedy_completions(tmp_path):
    report = bench_serve(tmp_path, "--against", "transformers", "--max-concurrency", "2", "--repeats", "2")
    assert sorted((r["server"], r["repetition"], r["completed"]) for r in report["runs"]) == [
        ("moeshard", 0, 4), ("moeshard", 1, 4), ("transformers", 0, 4), ("transformers", 1, 4)]
    assert {row["metric"] for row in report["ratios"]} == {"output tok/s", "median TTFT", "median TPOT"}
    assert all(row["identical_completions"] == 8 and row["median"] > 0 for row in report["ratios"])
    assert set(report["memory"]) == {"moeshard", "transformers"}
