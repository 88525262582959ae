"""Prefix caching: full KV blocks reused by content, keyed by the weights' version, so outputs are
those of an engine without it, and a block computed under older weights never matches again."""

import pytest
import torch

from moeshard import LLM, SamplingParams
from moeshard.engine.block_manager import BlockManager, Prefix
from moeshard.verify.tiny import make_tiny_checkpoint

LOGPROB_TOLERANCE = 1e-3  # fp32, as every other proof


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("prefix") / "qwen3_moe", seed=3))


def test_blocks_are_shared_evicted_last_used_first_and_keyed_by_version_and_salt():
    blocks = BlockManager(num_blocks=4, block_size=2)
    tokens = [1, 2, 3, 4, 5]
    table: list[int] = []
    blocks.grow(table, 5)
    prefix = blocks.cache(table, tokens, 5, Prefix(), None)
    assert prefix.blocks == 2 and blocks.num_free == 1
    hits, found = blocks.lookup(tokens, None)
    assert hits == table[:2] and found == prefix
    assert blocks.lookup([1, 2, 3, 9, 5], None)[0] == table[:1]  # the second block differs
    assert blocks.lookup([1, 2, 3, 4], None)[0] == table[:1]  # a token is always left to compute
    assert blocks.lookup(tokens, "other salt")[0] == []
    first, second = list(table[:2])
    blocks.release(table)
    assert blocks.num_free == 4 and list(blocks.evictable) == [second, first]  # the tail goes first
    other: list[int] = []
    blocks.take(other, [first])
    blocks.grow(other, 8)  # two never-keyed blocks first, then the cached tail is evicted
    assert second in other and blocks.lookup(tokens, None)[0] == [first]
    blocks.version += 1  # new weights: nothing computed before matches
    assert blocks.lookup(tokens, None)[0] == []
    blocks.release(other)
    blocks.reset()
    assert blocks.num_free == 4 and not blocks.evictable and not blocks.block_of


def test_a_private_duplicate_keeps_the_chain():
    """Two sequences computing the same prefix at once: the second's block stays private, and its
    later blocks chain on from the first's serial, so both lookups agree."""
    blocks = BlockManager(num_blocks=6, block_size=2)
    a, b = [], []
    blocks.grow(a, 3)
    blocks.grow(b, 5)
    pa = blocks.cache(a, [7, 7, 8], 3, Prefix(), None)
    pb = blocks.cache(b, [7, 7, 9, 9, 1], 5, Prefix(), None)
    assert pb.blocks == 2 and b[0] not in blocks.key_of
    assert blocks.lookup([7, 7, 9, 9, 1], None)[0] == [a[0], b[1]] and pa.blocks == 1


def shared_prefix_prompts(vocab=101):
    """A 23-token prefix most prompts share (a system prompt), distinct suffixes of mixed lengths,
    a prompt twice, and one that is only a prefix of another."""
    g = torch.Generator().manual_seed(1)
    system = torch.randint(0, vocab, (23,), generator=g).tolist()
    suffixes = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 6, 13, 4, 9)]
    own = torch.randint(0, vocab, (11,), generator=g).tolist()
    return [system + s for s in suffixes] + [system + suffixes[2], own, system[:9]]


GREEDY_LOGPROBS = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
# A budget below the longest prompt (chunked prefill), too few blocks for all at full length
# (preemption, eviction).
TIGHT = dict(max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=14, block_size=4)


def run_twice(llm: LLM, prompts, n: int) -> list:
    """The prompts, each n times (as n choices), then again: hits within a step and across calls."""
    many = [p for p in prompts for _ in range(n)]
    return llm.generate(many, GREEDY_LOGPROBS) + llm.generate(many, GREEDY_LOGPROBS, max_concurrency=3)


def assert_same_outputs(cached, uncached) -> None:
    for c, u in zip(cached, uncached, strict=True):
        assert c.token_ids == u.token_ids
        for cached_top, uncached_top in zip(c.logprobs, u.logprobs, strict=True):
            assert cached_top.keys() == uncached_top.keys()
            assert max(abs(cached_top[t] - uncached_top[t]) for t in cached_top) <= LOGPROB_TOLERANCE


@pytest.mark.long_pole
@pytest.mark.parametrize(
    "layout, method, compile",
    [
        ("1x1", "auto", False),
        ("1x1", "auto", "aot_eager"),
        ("1x2-ep", "alltoall", False),
        ("1x2-ep", "mc2", "aot_eager"),
        ("2x2-ep", "auto", False),
        ("2x2-ep", "fused_mc2", "aot_eager"),
    ],
)
def test_outputs_equal_an_engine_without_caching(tiny, layout, method, compile):
    tp, rest = layout.split("x")
    dp, ep = int(rest.split("-")[0]), rest.endswith("-ep")
    outputs, stats = {}, {}
    for caching in (True, False):
        with LLM(tiny, int(tp), dp, ep, moe_comm=method, compile=compile, enable_prefix_caching=caching, **TIGHT) as llm:
            outputs[caching] = run_twice(llm, shared_prefix_prompts(), n=2)
            stats[caching] = llm.stats()
    assert_same_outputs(outputs[True], outputs[False])
    assert stats[False].prefix_cache_hits == 0
    hits, queries = stats[True].prefix_cache_hits, stats[True].prefix_cache_queries
    assert hits >= 100 and queries > hits, (hits, queries)
    assert sum(o.num_cached_tokens for o in outputs[True]) > 0 and stats[True].preemptions > 0


def test_cache_salt_reset_and_sleep(tiny):
    """Only requests with the same salt share blocks; a reset and a sleep (the KV cache's memory
    goes) leave nothing to hit."""
    prompt = list(range(1, 30))  # 29 tokens: 7 full blocks of 4, the last token always computed
    with LLM(tiny, block_size=4) as llm:

        def hits(salt=None) -> int:
            before = llm.stats().prefix_cache_hits
            llm.core.add_request(prompt, SamplingParams(max_tokens=1), cache_salt=salt)
            while llm.core.has_unfinished:
                llm.core.step()
            return llm.stats().prefix_cache_hits - before

        assert [hits(), hits(), hits("a"), hits("a"), hits("b")] == [0, 28, 0, 28, 0]
        llm.reset_prefix_cache()
        assert [hits(), hits()] == [0, 28]
        llm.sleep(level=1)
        llm.wake_up()
        assert [hits(), hits()] == [0, 28]
