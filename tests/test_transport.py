"""The step on the wire: plans and samples as small tensors (nothing vocabulary-sized), the codec
round-trips, and a rank that raises or dies mid-step stops the engine with one error naming it."""

import os
import signal
import threading
import time

import pytest
import torch

from moeshard import LLM, SamplingParams
from moeshard.bundled.arithmetic import held_out
from moeshard.engine.plan import (
    GroupPlan, NewRequest, PlannedChunk, Routing, StepPlan, decode_plan, decode_results, encode_plan, encode_results,
)  # fmt: skip
from moeshard.engine.sampling import Sample
from moeshard.models.runner import Chunk
from moeshard.parallel import RankError

PROMPTS = [p.prompt for p in held_out(16)]


def test_plan_and_samples_round_trip():
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, logprobs=2)
    plan = StepPlan(
        [
            GroupPlan([NewRequest(3, 2**62 - 1, params)], [PlannedChunk(3, Chunk([5, 6, 7], 0, [9]), True)]),
            GroupPlan([], [PlannedChunk(1, Chunk([4], 17, [2, 0]), False, True), PlannedChunk(2, Chunk([8], 3, [1]), True)]),
        ],
        finished=[0, 4],
    )
    back = decode_plan(encode_plan(plan))
    assert back.finished == plan.finished and back.groups[1] == plan.groups[1]
    (new,) = back.groups[0].new
    assert (new.id, new.seed) == (3, 2**62 - 1)
    assert (new.params.temperature, new.params.top_k, new.params.top_p, new.params.logprobs) == (0.7, 5, 0.9, 2)
    samples = [Sample(7), Sample(2, -0.25, {2: -0.25, 9: -1.5}), Sample(0, -3.0, {})]
    routing = [Routing(1, 17, torch.tensor([[[7, 0], [3, 255]]])), Routing(3, 0, torch.arange(24).view(3, 4, 2))]
    samples_back, routing_back = decode_results(encode_results(samples, routing))
    assert samples_back == samples
    assert [(r.request_id, r.start) for r in routing_back] == [(1, 17), (3, 0)]
    assert all(torch.equal(a.experts_TYK, b.experts_TYK) for a, b in zip(routing, routing_back))


def test_a_decode_step_moves_a_few_bytes_per_sequence():
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(tensor_parallel_size=2, enable_expert_parallel=True) as llm:
        llm.generate(PROMPTS, params)
        stats = llm.core.stats
    assert stats.decode_steps > 0
    # The count, then per sampled sequence: token, logprob slot, N (float64); every step here samples 16.
    assert stats.decode_sample_bytes == stats.decode_steps * (1 + 16 * 3) * 8
    assert stats.decode_plan_bytes / stats.decode_steps < 16 * 10 * 8  # id, start, flags, 1 token, ~2 blocks each
    # the other steps carried the prompts (chunks of more than one token): bench e2e's prefill rate
    assert stats.prefill_steps == stats.steps - stats.decode_steps >= 1 and stats.prefill_s > 0
    assert stats.prefill_tokens >= 2 * len(PROMPTS)


def test_seeded_and_logprob_requests_equal_one_rank():
    params = [
        SamplingParams(temperature=1.0, top_p=0.8, seed=i, max_tokens=8, logprobs=3) if i % 2
        else SamplingParams(temperature=0, max_tokens=8, logprobs=0)
        for i in range(len(PROMPTS))
    ]  # fmt: skip
    with LLM(dtype="float32") as llm:
        alone = llm.generate(PROMPTS, params)
    with LLM(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True, dtype="float32") as llm:
        spread = llm.generate(PROMPTS, params)
    for a, b in zip(alone, spread):
        assert a.token_ids == b.token_ids
        assert [list(x) for x in a.logprobs] == [list(x) for x in b.logprobs]
        assert all(abs(x[t] - y[t]) < 1e-4 for x, y in zip(a.logprobs, b.logprobs) for t in x)


def test_a_rank_that_raises_mid_step_is_named():
    llm = LLM(data_parallel_size=2, enable_expert_parallel=True)
    try:
        llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=2))  # both groups are warm
        # Group 1's chunk names a KV block past the cache: rank 1 raises inside its forward.
        bad = StepPlan([GroupPlan([], []), GroupPlan([], [PlannedChunk(0, Chunk([3], 0, [10**6]), False)])], [])
        start = time.monotonic()
        with pytest.raises(RankError) as failure:
            llm.ranks.execute(encode_plan(bad))
        assert time.monotonic() - start < 30
        assert failure.value.rank == 1 and failure.value.kind != "RankDied", failure.value
        assert not any(p.is_alive() for p in llm.ranks.processes)
        with pytest.raises(RuntimeError, match="stopped after an earlier failure"):
            llm.generate(PROMPTS[:1])
    finally:
        llm.close()
    assert not torch.distributed.is_initialized()


def test_a_rank_killed_mid_run_is_named():
    llm = LLM(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True)
    try:
        victim = llm.ranks.processes[1]  # rank 2
        killer = threading.Timer(1.0, os.kill, (victim.pid, signal.SIGKILL))
        killer.start()
        start = time.monotonic()
        with pytest.raises(RankError, match="rank 2: RankDied: process killed by signal 9"):
            for _ in range(200):
                llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        assert time.monotonic() - start < 30
        assert not any(p.is_alive() for p in llm.ranks.processes)
    finally:
        killer.cancel()
        llm.close()
    with LLM(data_parallel_size=2, enable_expert_parallel=True) as again:  # the process can open a new engine
        assert again.generate(PROMPTS[:1])[0].text
