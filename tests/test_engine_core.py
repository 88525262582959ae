"""The engine core online: requests join while others decode, some are aborted mid-stream, and every
surviving request's tokens equal the same request run alone (greedy and seeded sampling); an
aborted request's KV blocks are free the moment abort returns."""

import asyncio

import pytest

from moeshard import LLM, SamplingParams
from moeshard.bundled.arithmetic import held_out
from moeshard.engine.async_llm import AsyncLLM

PROMPTS = [p.prompt for p in held_out(16)]
STREAMS = 16


def params_of(i: int) -> SamplingParams:
    """Long enough streams (EOS ignored) that later requests join mid-decode; half greedy, half seeded."""
    if i % 2:
        return SamplingParams(temperature=1.0, top_k=8, seed=100 + i, max_tokens=12, ignore_eos=True)
    return SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def aborted(i: int) -> bool:
    return i % 4 == 1


def test_abort_frees_blocks_at_once():
    with LLM(max_num_seqs=4, block_size=4) as llm:
        core = llm.core
        ids = [core.add_request(llm.encode(p), params_of(0)) for p in PROMPTS[:3]]
        for _ in range(4):
            core.step()
        group = core.groups[0]
        victim = core.requests[ids[1]][0]
        held, free = len(victim.blocks), group.blocks.num_free
        assert held > 0
        core.abort(ids[1])
        assert group.blocks.num_free == free + held
        reported = core.step()
        assert any(d.request_id == ids[1] and d.finished and d.finish_reason == "abort" for d in reported)
        while core.has_unfinished:
            core.step()
        assert group.blocks.num_free == llm.num_blocks


async def stream(engine: AsyncLLM, i: int, started: list[asyncio.Event]) -> list[int]:
    if i:  # join only once the previous request is decoding
        await started[i - 1].wait()
    tokens = []
    async for delta in engine.generate(PROMPTS[i], params_of(i)):
        tokens += delta.token_ids
        if len(tokens) >= 2:
            started[i].set()
        if aborted(i) and len(tokens) >= 3:
            break  # the consumer leaves mid-stream: the request is aborted
    started[i].set()
    return tokens


async def serve_all(engine: AsyncLLM) -> tuple[list[list[int]], object]:
    started = [asyncio.Event() for _ in range(STREAMS)]
    results = await asyncio.gather(*(stream(engine, i, started) for i in range(STREAMS)))
    for _ in range(200):  # the loop applies the last aborts at its next turn
        if engine.num_unfinished() == 0:
            break
        await asyncio.sleep(0.01)
    return results, await engine.call("stats")


@pytest.mark.parametrize("tp", [1, 2])
def test_streams_join_and_abort_mid_decode(tp):
    """Streams join mid-decode and leave early: each stream's tokens are its tokens alone, and every
    block is free after. (The engine in a process of its own runs the same loop: tests/test_serve.py.)"""
    llm = LLM(tensor_parallel_size=tp, data_parallel_size=2, enable_expert_parallel=True, max_num_seqs=STREAMS)
    alone = [llm.generate([PROMPTS[i]], params_of(i))[0].token_ids for i in range(STREAMS)]
    engine = AsyncLLM.in_process(llm)
    try:
        results, stats = asyncio.run(serve_all(engine))
    finally:
        engine.close()
    for i, tokens in enumerate(results):
        if aborted(i):
            assert tokens == alone[i][: len(tokens)] and len(tokens) < 12, i
        else:
            assert tokens == alone[i], i
    assert (stats.running, stats.waiting, stats.kv_usage) == (0, 0, 0.0)
