"""Routing replay (SamplingParams.return_routed_experts): the experts the engine returns for each token
equal transformers' own routers on the same tokens, and are the same on every layout, compiled or
eager, chunked or not; a request without the flag gets none."""

import pytest
import torch
import transformers

from moeshard import LLM, SamplingParams
from moeshard.bundled.arithmetic import MODEL_DIR
from moeshard.verify.tiny import make_tiny_checkpoint

transformers.utils.logging.disable_progress_bar()

ROUTED = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, return_routed_experts=True)
PLAIN = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
LENGTHS = (5, 23, 9, 31)  # over a budget of 8 tokens: prefills in chunks
CHUNKED = dict(dtype="float32", max_num_batched_tokens=8)
BUNDLED_VOCAB = transformers.AutoConfig.from_pretrained(MODEL_DIR).vocab_size


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


@torch.no_grad()
def transformers_routing(model, tokens: list[int]) -> torch.Tensor:
    """[tokens, MoE layers, top_k]: what each MoE layer's router (its `mlp.gate`, whose third output is
    the top-k ids, grouped and biased for DeepSeek-V3) picked for each token."""
    picked = []
    gates = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
    hooks = [g.register_forward_hook(lambda _module, _args, out: picked.append(out[2])) for g in gates]
    try:
        model(torch.tensor([tokens]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(picked, dim=1)


def agreement(ours_TYK: torch.Tensor, reference_TYK: torch.Tensor) -> float:
    """The share of (token, MoE layer) pairs routed to the same set of experts."""
    same_TY = (ours_TYK.sort(-1).values == reference_TYK.sort(-1).values).all(-1)
    return same_TY.float().mean().item()


@pytest.mark.parametrize("variant", ["bundled", "qwen2_moe", "mixtral_top2", "deepseek_v3"])
def test_routing_equals_transformers_routers(variant, tmp_path):
    model_dir = MODEL_DIR if variant == "bundled" else make_tiny_checkpoint(variant, tmp_path, seed=3)
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = prompts(reference.config.vocab_size)
    with LLM(str(model_dir), **CHUNKED) as llm:
        outs = llm.generate(batch, [PLAIN if i == 1 else ROUTED for i in range(len(batch))])
    assert outs[1].routed_experts is None
    ours, reference_rows = [], []
    for i in (0, 2, 3):
        tokens = batch[i] + outs[i].token_ids[:-1]  # the last generated token was never fed in
        ours.append(torch.tensor(outs[i].routed_experts))
        reference_rows.append(transformers_routing(reference, tokens))
        assert ours[-1].shape == reference_rows[-1].shape
    ours_TYK, reference_TYK = torch.cat(ours), torch.cat(reference_rows)
    rate = agreement(ours_TYK, reference_TYK)
    print(f"{variant}: {rate:.4f} of {reference_TYK.shape[0] * reference_TYK.shape[1]} (token, MoE layer) pairs")
    assert rate >= 0.999


def routing(llm: LLM, batch: list[list[int]]) -> list[list]:
    return [out.routed_experts for out in llm.generate(batch, ROUTED)]


def test_routing_is_the_same_on_every_layout_compiled_cached_and_preempted():
    batch = prompts(vocab=BUNDLED_VOCAB)
    with LLM(**CHUNKED) as llm:
        outs = llm.generate(batch, ROUTED)
        one_rank = [out.routed_experts for out in outs]
        # The prompts' full blocks are cached now: a request that records routing recomputes them.
        again = llm.generate(batch, ROUTED)
        assert [out.routed_experts for out in again] == one_rank
        assert [out.num_cached_tokens for out in again] == [0] * len(LENGTHS)
        assert llm.generate(batch[1:2], PLAIN)[0].num_cached_tokens == 16
    assert [len(rows) for rows in one_rank] == [len(p) + len(out.token_ids) - 1 for p, out in zip(batch, outs)]
    for layout in (
        dict(data_parallel_size=2, enable_expert_parallel=True),
        dict(tensor_parallel_size=2, enable_sequence_parallel=True),
        dict(compile="aot_eager"),
    ):
        with LLM(**CHUNKED, **layout) as llm:
            assert routing(llm, batch) == one_rank, layout
    with LLM(**CHUNKED, block_size=4, num_kv_blocks=12) as llm:  # too few blocks for all four at once
        assert routing(llm, batch) == one_rank
        assert llm.stats().preemptions > 0  # a recompute rewrote the positions it had recorded


def test_batch_invariant_routing_is_the_same_alone_and_in_a_batch():
    batch = prompts(vocab=BUNDLED_VOCAB)
    with LLM(dtype="float32", batch_invariant=True) as llm:
        together = routing(llm, batch)
        assert [routing(llm, [p])[0] for p in batch] == together

