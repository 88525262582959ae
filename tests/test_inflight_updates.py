"""Weights that change under a request (docs/DESIGN.md §10), and partial rollouts by abort and resubmit.

Eight streams are parked by pause_generation(keep), the weights are updated, generation continues:
each request's version spans cover its tokens once and name the right versions; with recompute,
every token after the update is (bitwise, in batch-invariant mode) what a fresh engine on the new
weights answers for the same prompt + prefix. A greedy request aborted part-way and resubmitted
with its tokens so far equals the uninterrupted one, routes included, on every layout.
"""

import asyncio

import pytest
import torch

from moeshard import LLM, SamplingParams
from moeshard.bundled.arithmetic import held_out
from moeshard.engine.async_llm import AsyncLLM
from moeshard.models.checkpoint import Checkpoint
from test_serve import perturbed_checkpoint

PROMPTS = [p.prompt for p in held_out(8)]
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory):
    directory = perturbed_checkpoint(tmp_path_factory.mktemp("inflight") / "new", seed=3)
    ckpt = Checkpoint(directory)
    return directory, [(name, ckpt.block(name, ())) for name in ckpt.handles]


async def parked_update(engine: AsyncLLM, params: SamplingParams, update: list | None, before: int = 3) -> list[list]:
    """Start a stream per prompt; once each has `before` tokens, pause(keep), update (unless None),
    continue; each stream's deltas."""
    deltas: list[list] = [[] for _ in PROMPTS]
    ready = [asyncio.Event() for _ in PROMPTS]

    async def stream(i: int) -> None:
        async for delta in engine.generate(PROMPTS[i], params):
            deltas[i].append(delta)
            if sum(len(d.token_ids) for d in deltas[i]) >= before:
                ready[i].set()

    tasks = [asyncio.create_task(stream(i)) for i in range(len(PROMPTS))]
    await asyncio.wait_for(asyncio.gather(*(r.wait() for r in ready)), 60)
    await engine.call("pause_generation", "keep")
    if update is not None:
        await engine.call("update_weights", update, "v2")
    await engine.call("continue_generation")
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    return deltas


def run_parked(llm: LLM, params: SamplingParams, update: list | None) -> list[list]:
    async def main():
        engine = AsyncLLM.in_process(llm)
        return await parked_update(engine, params, update)

    return asyncio.run(main())


def tokens(deltas: list) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def check_spans(deltas: list, versions: list[str]) -> int:
    """Spans cover the output once, in order, naming `versions`; returns where the last one starts."""
    spans = deltas[-1].weight_versions
    assert [s["version"] for s in spans] == versions
    assert spans[0]["start"] == 0 and spans[-1]["end"] == len(tokens(deltas))
    assert all(a["end"] == b["start"] for a, b in zip(spans, spans[1:]))
    # every streamed delta's tokens were sampled by the version its spans name for them
    done = 0
    for d in deltas:
        for position in range(done, done + len(d.token_ids)):
            assert any(s["start"] <= position < s["end"] for s in d.weight_versions)
        done += len(d.token_ids)
    return spans[-1]["start"]


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_parked_requests_continue_under_new_weights(new_weights, mode):
    directory, update = new_weights
    with LLM(dtype="float32", batch_invariant=True, block_size=4, kv_after_update=mode) as llm:
        alone = llm.generate(PROMPTS, GREEDY)
        parked = run_parked(llm, GREEDY, update)
    assert all(d[-1].finish_reason == "length" for d in parked)
    with LLM(str(directory), dtype="float32", batch_invariant=True, block_size=4) as fresh:
        for prompt, before, deltas in zip(PROMPTS, alone, parked):
            out = tokens(deltas)
            switch = check_spans(deltas, ["default", "v2"])
            assert out[:switch] == before.token_ids[:switch]  # the old weights' tokens, as they were
            if mode == "recompute":  # from the switch on, a fresh engine on the new weights, bit for bit
                prefix = fresh.encode(prompt) + out[:switch]
                again = fresh.generate([prefix], SamplingParams(**{**vars(GREEDY), "max_tokens": MAX_TOKENS - switch}))[0]
                assert out[switch:] == again.token_ids
                lps = [lp for d in deltas for lp in d.logprobs][switch:]
                assert lps == again.logprobs


def test_a_request_may_ask_for_its_own_kv_policy(new_weights):
    """The engine keeps K/V by default; a request that asks for recompute gets a fresh engine's tokens."""
    directory, update = new_weights
    params = SamplingParams(**{**vars(GREEDY), "kv_after_update": "recompute"})
    with LLM(dtype="float32", batch_invariant=True, block_size=4) as llm:
        parked = run_parked(llm, params, update)
    with LLM(str(directory), dtype="float32", batch_invariant=True, block_size=4) as fresh:
        for prompt, deltas in zip(PROMPTS, parked):
            out, switch = tokens(deltas), check_spans(deltas, ["default", "v2"])
            again = fresh.generate([fresh.encode(prompt) + out[:switch]], SamplingParams(**{**vars(GREEDY), "max_tokens": MAX_TOKENS - switch}))
            assert out[switch:] == again[0].token_ids


def test_pause_and_continue_without_an_update_change_nothing():
    with LLM(dtype="float32", batch_invariant=True, block_size=4) as llm:
        alone = llm.generate(PROMPTS, GREEDY)
        parked = run_parked(llm, GREEDY, None)
    for before, deltas in zip(alone, parked):
        assert tokens(deltas) == before.token_ids
        assert [lp for d in deltas for lp in d.logprobs] == before.logprobs
        assert deltas[-1].weight_versions == [{"version": "default", "start": 0, "end": MAX_TOKENS}]


def test_an_update_refused_while_requests_run_unparked(new_weights):
    _, update = new_weights
    with LLM(dtype="float32") as llm:
        llm.core.add_request(llm.encode(PROMPTS[0]), GREEDY)
        llm.core.step()
        with pytest.raises(RuntimeError, match="pause generation"):
            llm.update_weights(update)
        assert llm.weight_version == "default"


def test_recompute_never_reads_a_block_of_the_old_weights(new_weights):
    """A parked request's blocks are cached under the old version; after the update, its recompute
    (and a new request with the same prompt) find none of them."""
    directory, update = new_weights
    prompt = list(range(1, 14))  # three full blocks of 4
    with LLM(dtype="float32", block_size=4, kv_after_update="recompute") as llm:
        core = llm.core
        rid = core.add_request(prompt, GREEDY)
        core.step()
        core.paused = "keep"
        llm.update_weights(update, "v2")
        core.paused = None
        hits_before = core.engine_stats({}, []).prefix_cache_hits
        while core.has_unfinished:
            core.step()
        assert core.engine_stats({}, []).prefix_cache_hits == hits_before
        fresh_prompt = llm.generate([prompt], GREEDY)[0]
    assert fresh_prompt.num_cached_tokens == 12  # the recompute's blocks, of the new version, are shared
    del rid


def aborted_at(llm: LLM, ids: list[int], params: SamplingParams, k: int):
    """Run one request until it has k tokens, then abort it: its output so far."""
    core, out = llm.core, []
    rid = core.add_request(ids, params)
    while len(out) < k:
        out += [t for d in core.step() if d.request_id == rid for t in d.token_ids]
    core.abort(rid)
    (delta,) = [d for d in core.step() if d.request_id == rid]
    assert delta.finish_reason == "abort"
    return out + delta.token_ids, delta.routed_experts


@pytest.mark.parametrize("layout", [(1, 1, False, False), (1, 2, True, False), (2, 1, False, True)],
                         ids=["1x1", "1x2-ep", "2x1-sp"])
def test_abort_and_resubmit_equals_the_uninterrupted_request(layout):
    tp, dp, ep, sp = layout
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0, return_routed_experts=True)
    with LLM(dtype="float32", batch_invariant=True, block_size=4, tensor_parallel_size=tp, data_parallel_size=dp,
             enable_expert_parallel=ep, enable_sequence_parallel=sp) as llm:
        for prompt in PROMPTS[:2]:
            ids = llm.encode(prompt)
            whole = llm.generate([ids], params)[0]
            partial, first_routes = aborted_at(llm, ids, params, 4)
            rest = llm.generate([ids + partial], SamplingParams(**{**vars(params), "max_tokens": MAX_TOKENS - len(partial)}))[0]
            assert partial + rest.token_ids == whole.token_ids
            assert whole.logprobs[len(partial):] == rest.logprobs
            assert first_routes == whole.routed_experts[: len(first_routes)]  # the aborted one's rows so far
            assert rest.routed_experts == whole.routed_experts  # the resubmission reads the same tokens
            assert torch.tensor(rest.routed_experts).shape[0] == len(ids) + MAX_TOKENS - 1
