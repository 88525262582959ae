"""The engine: greedy generations equal transformers' `generate`, on every layout; scheduling under
pressure (chunked prefill, preemption); sampling; bad requests refused alone."""

import pytest
import torch
import transformers

from moeshard import LLM, SamplingParams
from moeshard.engine.block_manager import BlockManager
from moeshard.engine.sampling import Sample
from moeshard.engine.scheduler import Request, Scheduler, StopRules
from moeshard.verify.tiny import make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
LENGTHS = (5, 17, 3, 9, 30, 2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    return {
        v: str(make_tiny_checkpoint(v, root / v, seed=3))
        for v in ("qwen3_moe", "qwen2_moe", "mixtral_top2", "deepseek_v3")
    }


def prompts(vocab=101):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def hf_greedy(model_dir, prompt_list, max_new_tokens=10):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for p in prompt_list:
        ids_1N = torch.tensor([p])
        # With a pad token and no mask transformers would mask every prompt token equal to it.
        ids = model.generate(
            ids_1N,
            attention_mask=torch.ones_like(ids_1N),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        out.append(ids[0, len(p) :].tolist())
    return out


# Tight limits on purpose: a token budget below the longest prompt (chunked prefill) and too few KV
# blocks for three sequences at full length (preemption by recompute).
TIGHT = dict(max_num_seqs=3, max_num_batched_tokens=16, num_kv_blocks=12, block_size=4)
ENGINE_CASES = [
    ("qwen3_moe", 1, 1, False, "auto", False),
    ("qwen2_moe", 1, 1, False, "auto", "aot_eager"),
    ("mixtral_top2", 2, 1, False, "auto", False),
    ("deepseek_v3", 1, 2, True, "alltoall", False),
    ("qwen3_moe", 2, 2, True, "mc2", "aot_eager"),
    ("qwen2_moe", 2, 2, True, "fused_mc2", False),
]


@pytest.mark.parametrize("variant, tp, dp, ep, method, compile", ENGINE_CASES)
def test_greedy_equals_transformers_generate(tiny, variant, tp, dp, ep, method, compile):
    with LLM(tiny[variant], tp, dp, ep, moe_comm=method, compile=compile, **TIGHT) as llm:
        outs = llm.generate(prompts(), GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(tiny[variant], prompts())
    assert all(o.finish_reason == "length" and o.error is None for o in outs)


def test_scheduler_chunks_and_preempts():
    """Four requests, a 6-token budget, blocks for ~two: prefills are chunked, decodes run beside
    them, the newest request is preempted and later recomputed."""
    blocks = BlockManager(num_blocks=5, block_size=4)
    sched = Scheduler(blocks, max_num_seqs=4, token_budget=6, rules=StopRules(frozenset(), 64, str))
    reqs = [Request(i, list(range(n)), SamplingParams(max_tokens=8)) for i, n in enumerate((9, 3, 4, 2))]
    for r in reqs:
        sched.add(r)
    mixed = preempted = False
    for _ in range(40):
        plan = sched.schedule()
        if not plan:
            break
        kinds = {c.request.num_computed >= len(c.request.prompt_ids) for c in plan}
        mixed |= kinds == {True, False}
        assert sum(c.num_tokens for c in plan) <= 6
        sched.postprocess(plan, [Sample(0) for c in plan if c.samples])
        preempted |= any(r.preemptions for r in reqs)
        assert blocks.num_free + sum(len(r.blocks) for r in sched.running) == 5
    assert not sched.has_work and mixed and preempted
    assert reqs[0].num_computed == 9 + 8 - 1


def test_seeded_sampling_ignores_the_rest_of_the_batch(tiny):
    seeded = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_tokens=8, seed=7, ignore_eos=True)
    with LLM(tiny["qwen3_moe"], max_num_seqs=4) as llm:
        alone = llm.generate([prompts()[0]], seeded)[0]
        crowd = llm.generate(prompts(), [seeded] + [SamplingParams(temperature=1.0, max_tokens=8)] * 5)
        again = llm.generate(prompts()[:2], [seeded, dict(temperature=0.7, max_tokens=3, seed=1)])
    assert alone.token_ids == crowd[0].token_ids == again[0].token_ids
    other = LLM(tiny["qwen3_moe"])
    try:
        different = other.generate([prompts()[0]], SamplingParams(**{**seeded.__dict__, "seed": 8}))[0]
    finally:
        other.close()
    assert different.token_ids != alone.token_ids


def test_logprobs_and_stop(tiny):
    with LLM(tiny["mixtral_top2"]) as llm:
        out = llm.generate([prompts()[1]], SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 5
    for token, top in zip(out.token_ids, out.logprobs):
        assert token in top and max(top.values()) == top[token] and all(v <= 0 for v in top.values())


def test_bad_requests_fail_alone(tiny):
    with LLM(tiny["qwen3_moe"], max_model_len=40) as llm:
        outs = llm.generate(
            [prompts()[0], [], list(range(45)), prompts()[1], prompts()[2], "text"],
            [GREEDY, GREEDY, GREEDY, dict(max_tokens=0), dict(temprature=0.5), GREEDY],
        )
    good = outs[0]
    assert good.error is None and good.token_ids == hf_greedy(tiny["qwen3_moe"], [prompts()[0]])[0]
    assert "prompt is empty" in outs[1].error
    assert "the prompt has 45 tokens; the context holds 40" in outs[2].error
    assert "max_tokens must be positive" in outs[3].error
    assert "unknown sampling option(s) temprature" in outs[4].error
    assert "no tokenizer.json" in outs[5].error


def test_sequence_parallel_serves_the_same_outputs():
    from moeshard.bundled.arithmetic import held_out

    prompts = [p.prompt for p in held_out(24)]
    greedy = SamplingParams(temperature=0)
    with LLM() as llm:
        reference = [o.text for o in llm.generate(prompts, greedy)]
    with LLM(tensor_parallel_size=2, enable_expert_parallel=True, enable_sequence_parallel=True, compile="aot_eager",
             max_num_seqs=5) as llm:
        assert [o.text for o in llm.generate(prompts, greedy)] == reference
