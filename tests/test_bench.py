"""Benchmarks run end to end at small sizes (their timings are reported, never asserted)."""

import json
import subprocess
import sys

import pytest


def test_bench_lm_head_runs_and_checks_parity():
    proc = subprocess.run(
        [sys.executable, "-m", "moeshard", "bench", "lm-head", "--vocab", "1000", "--hidden", "64", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "vocab-parallel" in proc.stdout and "ratio" in proc.stdout


@pytest.mark.long_pole
def test_bench_e2e_alternates_contenders_with_identical_tokens(tmp_path):
    out = tmp_path / "e2e.json"
    proc = subprocess.run(
        [sys.executable, "-m", "moeshard", "bench", "e2e", "--concurrency", "1,3", "--threads", "1",
         "--num-requests", "5", "--prompt-lens", "4", "9", "--output-lens", "2", "7", "--repeats", "2",
         "--dtype", "float32", "--plot", str(tmp_path / "e2e.png"), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "e2e.png").stat().st_size > 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert result["workload"]["num_requests"] == 5
    assert {(r["concurrency"], r["contender"]) for r in rows} == {
        (c, name) for c in (1, 3) for name in ("moeshard", "transformers static", "transformers continuous")
    }
    assert all(r["identical"] and r["same_tokens"] == 1 for r in rows)  # fp32: every contender made moeshard's tokens
    assert all(r["tok_s_low"] <= r["tok_s"] <= r["tok_s_high"] and r["ratio_low"] <= r["ratio"] for r in rows)
    floors = result["decode_floors"]
    assert [f["sequences"] for f in floors] == [1, 3]
    # The random Qwen3-MoE: 4 layers of 32 experts (top-4) of 3 × 512 × 256 fp32 weights; one sequence
    # touches 4 per layer, three touch 4 to 12, and every step reads all the dense weights.
    expert_mb = 3 * 512 * 256 * 4 / 1e6
    one, three = (f["weight_mb"] for f in floors)
    assert 16 * expert_mb < one and 16 * expert_mb <= three - one + 16 * expert_mb <= 48 * expert_mb
    assert all(f["bandwidth_gbs"] > 0 and f["floor_ms"] > 0 and f["kv_mb"] > 0 for f in floors)
    # Multiply-adds scale with the sequences (each token its own top-k, the same context length);
    # the routed part alone is 2 × 4 layers × top-4 × 3 × 512 × 256 per token.
    assert floors[1]["gflop"] == pytest.approx(3 * floors[0]["gflop"])
    assert floors[0]["gflop"] > 2 * 4 * 4 * 3 * 512 * 256 / 1e9 and all(f["compute_floor_ms"] > 0 for f in floors)


@pytest.mark.long_pole
def test_bench_layer_alternates_contenders_and_replays_its_own_gemms(tmp_path):
    out = tmp_path / "layer.json"
    done = subprocess.run([sys.executable, "-m", "moeshard", "bench", "layer", "--repeats", "2", "--decode-tokens", "4",
                           "--prefill-tokens", "24", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]  # 1 if a transformers variant disagreed
    rows = {(r["shape"], r["impl"]): r for r in json.loads(out.read_text())}
    for shape, tokens in (("decode", 4), ("prefill", 24)):
        assert rows[shape, "moeshard"]["ratio_to_moeshard"] == 1 and rows[shape, "moeshard"]["tokens"] == tokens
        for impl in ("moeshard GEMMs alone", "transformers/eager", "dense GEMM"):
            row = rows[shape, impl]
            assert row["median_ms"] > 0 and row["ratio_low"] <= row["ratio_to_moeshard"] <= row["ratio_high"]
    assert "its own GEMMs alone" in done.stdout
