"""The bundled model through the engine: accuracy, and identical outputs on every layout, method,
concurrency, eager and compiled (`moeshard eval`, as users run it)."""

import json
import subprocess
import sys

import pytest

from moeshard import LLM, SamplingParams
from moeshard.bundled.arithmetic import MODEL_DIR, Problem, held_out
from moeshard.parallel import Layout
from moeshard.verify.eval import run_eval

EP_METHODS = "auto,allgather,alltoall,mc2,fused_mc2"


def test_bundled_model_is_small_and_complete():
    files = {p.name: p.stat().st_size for p in MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    assert sum(files.values()) < 5 * 2**20


def test_held_out_problems_are_fixed_and_distinct():
    problems = held_out(500)
    assert len(set(problems)) == 500 and problems == held_out(500) and held_out(2000)[:500] == problems
    assert all(Problem.value_of(p.answer) == p.value for p in problems)


@pytest.mark.parametrize(
    "a, op, b, uncarried",
    [(195, "+", 5, 190), (999, "+", 999, 1888), (123, "+", 456, 579), (404, "-", 6, 408), (6, "-", 404, -408),
     (100, "-", 1, 109), (150, "-", 61, 199), (5, "-", 5, 0)],
)
def test_a_pupil_who_never_carries(a, op, b, uncarried):
    """The training script's imperfect teacher (for the RL start) works each column on its own."""
    assert Problem(a, op, b).uncarried_value == uncarried


def test_accuracy_on_500_held_out_problems_one_rank():
    (row,) = run_eval([Layout()], [16], ["auto"], [None], n=500)
    assert row.accuracy >= 0.95, row


def test_stop_strings_and_text(tmp_path):
    with LLM() as llm:
        plain, stopped = llm.generate(
            ["123+456=", "123+456="], [SamplingParams(temperature=0), SamplingParams(temperature=0, stop="7")]
        )
    assert plain.text == Problem(123, "+", 456).answer and plain.finish_reason == "stop"
    assert stopped.text == plain.text[: plain.text.index("7")] and stopped.finish_reason == "stop"


@pytest.mark.long_pole
@pytest.mark.parametrize("layouts, methods", [("1x1,1x2-ep,2x2-ep", EP_METHODS), ("1x1,2x1", "auto,allgather")])
def test_eval_identical_everywhere(tmp_path, layouts, methods):
    out = tmp_path / "eval.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "moeshard",
            "eval",
            "--layouts",
            layouts,
            "--concurrency",
            "1,4,16",
            "--moe-comm",
            methods,
            "--compile",
            "--compile-backend",
            "aot_eager",
            "-n",
            # Most of the time goes to c = 1 (one request at a time, one DP group empty): 12 prompts are
            # 12 such runs per method; c = 4 still has requests join as others finish, c = 16 takes all.
            "12",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert all(
        set(r) == {"layout", "method", "compiled", "concurrency", "n", "accuracy", "identical_to_reference", "outputs_sha256",
               "logprobs_identical"}
        for r in rows
    )
    n_layouts, n_methods = len(layouts.split(",")), len(methods.split(","))
    assert len(rows) == n_layouts * n_methods * 3 * 2
    assert all(r["identical_to_reference"] for r in rows)
    assert len({r["accuracy"] for r in rows}) == 1 and rows[0]["accuracy"] >= 0.9
