"""Batch-invariant mode (`moeshard verify invariance`): every request bitwise equal to its run alone
in randomised mixes, on every method, eager and compiled, and across TP-free layouts; and the
harness's negative control: without the mode it sees the differences that exist."""

import subprocess
import sys

import pytest
import torch

from moeshard import LLM, SamplingParams
from moeshard.parallel import Layout
from moeshard.parallel.state import ordered_sum
from moeshard.verify.invariance import InvarianceOptions, run_invariance

pytestmark = pytest.mark.xdist_group("invariance")


def test_every_request_is_bitwise_its_run_alone_in_batch_invariant_mode():
    options = InvarianceOptions(
        layouts=(Layout(1, 1), Layout(1, 2, True)), methods=("auto", "allgather", "alltoall"),
        backends=(None, "aot_eager"), requests=12, mixes=1, dtype="float32",
    )  # one randomised mix per engine: 12 mixes in all, each at its own concurrency, order and token budget
    rows = run_invariance(options)
    assert len(rows) == 1 + 2 * 3 * 2
    across = [r for r in rows if r.reference == "alone on 1x1" and r.layout == "1x2-ep"]
    assert len(across) == 1 and across[0].compared == 12  # the layouts agree bit for bit
    assert sum(r.preemptions for r in rows) > 0 and sum(r.cached_tokens for r in rows) > 0
    assert {r.token_budget for r in rows if r.token_budget} >= {16, 64, 256}
    failed = [r for r in rows if not r.passed]
    assert not failed, failed


def test_without_the_mode_the_harness_sees_the_differences():
    options = InvarianceOptions(layouts=(Layout(1, 1),), methods=("auto",), backends=(None,), requests=12, mixes=1,
                                dtype="float32", batch_invariant=False)
    (row,) = run_invariance(options)
    assert row.bitwise_equal < row.compared and row.max_abs_dlogprob > 0 and row.first_diverging_token is not None


def test_the_command_reports_a_difference_with_exit_status_1(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "moeshard", "verify", "invariance", "--layouts", "1x1", "--moe-comm", "mc2",
         "--no-compile", "--requests", "8", "--mixes", "1", "--no-batch-invariant", "--json", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert "default mode (negative control)" in result.stdout and (tmp_path / "r.json").is_file()


def test_ordered_sum_adds_in_rank_order():
    parts = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(ordered_sum(parts), (parts[0] + parts[1]) + parts[2])
    assert not torch.equal(ordered_sum(parts), ordered_sum(parts.flip(0)))  # the order shows in the bits


def test_batch_invariant_logprobs_do_not_depend_on_the_batch_in_bf16():
    prompts = [[1 + (i * 7 + j) % 13 for j in range(3 + i % 9)] for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True)
    with LLM(dtype="bfloat16", batch_invariant=True, block_size=4) as llm:
        alone = [llm.generate([p], params)[0] for p in prompts]
        together = llm.generate(prompts, params)
    assert [(o.token_ids, o.logprobs) for o in alone] == [(o.token_ids, o.logprobs) for o in together]


def test_batch_invariant_mode_needs_the_kernels(monkeypatch):
    from moeshard import kernels

    monkeypatch.setattr(kernels, "built", lambda: False)
    with pytest.raises(ValueError, match="batch-invariant mode needs moeshard's CPU kernels"):
        LLM(batch_invariant=True)


def test_serve_batch_invariant_streams_the_same_bits_alone_and_together(tmp_path):
    """Over HTTP (the engine in its own process): each completion's logprobs are the same bits sent
    alone and among concurrent requests, and equal to the offline engine's in the same mode."""
    import asyncio
    import os

    import openai
    from processes import free_port, stop_tree, wait_listening

    from moeshard.bundled.arithmetic import held_out

    prompts = [p.prompt for p in held_out(6)]
    port, log = free_port(), tmp_path / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moeshard", "serve", "--port", str(port), "--batch-invariant", "--dtype", "float32"],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=open(log, "w"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_listening(port, proc, 300, "moeshard serve --batch-invariant")

        async def complete(client, prompt):
            model = (await client.models.list()).data[0].id
            got = await client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=6, logprobs=1)
            return got.choices[0].logprobs.token_logprobs

        async def run():
            async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                                          timeout=120) as client:
                alone = [await complete(client, p) for p in prompts]
                together = await asyncio.gather(*(complete(client, p) for p in prompts))
            return alone, list(together)

        alone, together = asyncio.run(run())
    finally:
        assert stop_tree(proc, timeout_s=60) == (0, []), log.read_text()[-3000:]
    assert alone == together
    with LLM(dtype="float32", batch_invariant=True) as llm:
        offline = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, logprobs=0))
    assert [[next(iter(top.values())) for top in o.logprobs] for o in offline] == alone
