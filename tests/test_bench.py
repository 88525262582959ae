"""Benchmarks run end to end at small sizes (their timings are reported, never asserted)."""

import json
import subprocess
import sys

import pytest

from moeshard.bench.step import PIECES, Clocks
from moeshard.cli import main


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
         "--dtype", "float32", "--quantization", "int4", "--plot", str(tmp_path / "e2e.png"), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "e2e.png").stat().st_size > 0
    result = json.loads(out.read_text())
    rows = {(r["concurrency"], r["contender"]): r for r in result["rows"]}
    assert result["workload"]["num_requests"] == 5
    assert set(rows) == {
        (c, name) for c in (1, 3)
        for name in ("moeshard fp32", "moeshard int4", "transformers static", "transformers continuous")
    }
    exact = [r for r in rows.values() if r["contender"] != "moeshard int4"]
    assert all(r["identical"] and r["same_tokens"] == 1 for r in exact)  # fp32: every contender made moeshard's tokens
    assert all(rows[c, "moeshard int4"]["dtype"] == "bfloat16" and 0 <= rows[c, "moeshard int4"]["same_tokens"] <= 1
               for c in (1, 3))  # int4 computes in bf16: its agreement is reported, not required
    assert all(r["tok_s_low"] <= r["tok_s"] <= r["tok_s_high"] and r["ratio_low"] <= r["ratio"] for r in rows.values())
    assert [(p["concurrency"], p["first"], p["second"]) for p in result["pairs"]] == [
        (c, "moeshard int4", "moeshard fp32") for c in (1, 3)]
    floors = {(f["engine"], f["sequences"]): f for f in result["decode_floors"]}
    assert set(floors) == {(e, c) for e in ("moeshard fp32", "moeshard int4") for c in (1, 3)}
    # The random Qwen3-MoE: 4 layers of 32 experts (top-4) of 3 × 512 × 256 fp32 weights; one sequence
    # touches 4 per layer, three touch 4 to 12, and every step reads all the dense weights.
    expert_mb = 3 * 512 * 256 * 4 / 1e6
    one, three = (floors["moeshard fp32", c]["weight_mb"] for c in (1, 3))
    assert 16 * expert_mb < one and 16 * expert_mb <= three - one + 16 * expert_mb <= 48 * expert_mb
    # int4 weights as held: half a byte a weight and an fp32 scale per 128 (K = 512), against 4 bytes
    # (bytes counted as bf16, or experts' bytes spread over their flat byte tensor, fall outside)
    assert 0.1 < floors["moeshard int4", 1]["weight_mb"] / one < 0.2
    for f in floors.values():
        assert f["bandwidth_gbs"] > 0 and f["kv_mb"] > 0 and f["byte_floor_ms"] > 0 and f["compute_floor_ms"] > 0
        assert f["floor_ms"] == max(f["byte_floor_ms"], f["compute_floor_ms"])
        assert f["binds"] == ("bytes" if f["byte_floor_ms"] >= f["compute_floor_ms"] else "compute")
    # Multiply-adds scale with the sequences (each token its own top-k, the same context length);
    # the routed part alone is 2 × 4 layers × top-4 × 3 × 512 × 256 per token.
    fp32 = [floors["moeshard fp32", c] for c in (1, 3)]
    assert fp32[1]["gflop"] == pytest.approx(3 * fp32[0]["gflop"])
    assert fp32[0]["gflop"] > 2 * 4 * 4 * 3 * 512 * 256 / 1e9


def test_bench_e2e_refuses_bf16_in_a_float32_run(capsys):
    assert main(["bench", "e2e", "--dtype", "float32", "--quantization", "bf16,int4"]) == 2
    assert "leave bf16 out of --quantization" in capsys.readouterr().out


def test_bench_step_attributes_a_decode_step_to_its_parts(tmp_path):
    out = tmp_path / "step.json"
    proc = subprocess.run(
        [sys.executable, "-m", "moeshard", "bench", "step", "--model-shape", "small", "--quantization", "int4",
         "--concurrency", "2", "--context", "8", "--steps", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (profile,) = json.loads(out.read_text())
    assert profile["engine"] == "moeshard int4" and profile["floor"]["sequences"] == 2
    pieces = profile["pieces_ms"]
    assert [name for name, _ in PIECES] == list(pieces)
    # every piece is an inclusive clock less the clocks inside it, and together they are the step
    assert all(ms >= 0 for ms in pieces.values()) and sum(pieces.values()) == pytest.approx(profile["mean_step_ms"])
    assert pieces["LM head"] > 0 and pieces["routed experts"] > 0 and pieces["attention projections"] > 0
    assert "× its floor" in proc.stdout


def test_clocks_time_their_targets_and_leave_nothing_behind():
    class Target:
        def work(self, x):
            return x + 1

    target, clocks = Target(), Clocks()
    with clocks.around([(target, "work", "work")]):
        assert target.work(1) == 2 and "work" in vars(target)
    assert "work" not in vars(target) and clocks.seconds["work"] > 0
    assert target.work(1) == 2 and list(clocks.seconds) == ["work"]  # no longer timed
    with pytest.raises(ZeroDivisionError), clocks.around([(target, "work", "work")]):
        1 / 0
    assert "work" not in vars(target)


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
