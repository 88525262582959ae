"""`moeshard bench checkpoint` (bench/random_checkpoint.py): a random int4 checkpoint written tensor by
tensor reads back, through safetensors' own reader and moeshard's compressed-tensors reader, as the
values it stores, with the spread the bf16 bench models have; the engine loads it held in int4 and
generates from it, text through its tokenizer included."""

import math

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

from moeshard import LLM, SamplingParams
from moeshard.bench.random_checkpoint import LAYOUT, int4_words, pieces, write_random_int4
from moeshard.models.checkpoint import read_config
from moeshard.models.quantized_checkpoint import open_checkpoint

# Every K a whole number of groups of 128: hidden 256, attention 4 × 64, experts' intermediate 128.
TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
            max_position_embeddings=256)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    directory = write_random_int4(tmp_path_factory.mktemp("int4") / "model", transformers.Qwen3MoeConfig(**TINY))
    stored = {}
    for path in sorted(directory.glob("*.safetensors")):
        stored |= load_file(str(path))
    return directory, stored


def signed_levels(words: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' unpacking, written out: field i of a word is bits 4i…4i+3, stored + 8."""
    u = words.numpy().view(np.uint32).astype(np.int64)[..., None]
    return torch.from_numpy(((u >> (4 * np.arange(8))) & 15).reshape(*words.shape[:-1], -1) - 8)


def test_written_checkpoint_reads_back_as_stored(written):
    directory, stored = written
    config = read_config(directory)
    assert config["quantization_config"] == LAYOUT.config() and config["num_hidden_layers"] == 2
    assert len(list(directory.glob("*.safetensors"))) == 3  # one shard per layer, one for the rest
    source = open_checkpoint(directory)
    quantized = [n.removesuffix("_packed") for n in stored if n.endswith(".weight_packed")]
    # attention and experts int4; the routers, the LM head, the embedding and the norms bf16
    assert len(quantized) == 2 * (4 + 3 * 4)
    assert not any(".gate." in n or "lm_head" in n or "embed" in n for n in quantized)
    for name in quantized:
        N, K = stored[name + "_shape"].tolist()
        levels = signed_levels(stored[name + "_packed"])
        scale = stored[name + "_scale"]
        assert levels.shape == (N, K) and scale.shape == (N, K // 128)
        q = source.read_quantized(name, (N, K))
        assert torch.equal(q.values.long(), levels) and torch.equal(q.scale, scale.float())
        # zero mean (−8…7's −½ would shift every output of a layer alike), the bench models' spread
        assert levels.min() >= -7 and levels.max() <= 7 and abs(levels.float().mean()) < 0.05
        dequantized_std = (levels.float() * scale.float().repeat_interleave(128, 1)).std()
        assert dequantized_std == pytest.approx(1 / math.sqrt(K), rel=0.05)
    for name, tensor in stored.items():
        if not any(name.startswith(q) for q in quantized):
            assert tensor.dtype == torch.bfloat16 and torch.equal(source.read(name, tuple(tensor.shape)), tensor)
    assert stored["model.norm.weight"].float().mean() == pytest.approx(1.0, abs=0.1)


def test_engine_loads_it_in_int4_and_generates(written):
    directory, stored = written
    with LLM(str(directory), max_num_seqs=2, max_model_len=64) as llm:
        assert llm.dtype == "bfloat16"  # dtype "auto": a quantized checkpoint computes in bf16, whatever it counts
        held = llm.memory_held_mb()[0]["weights"]
        params = SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True)
        out = llm.generate([[5, 6, 7, 8], [9, 10, 11], "t9 t10 t11"], params)
    int4_as_bf16 = sum(math.prod(t.tolist()) * 2 for n, t in stored.items() if n.endswith("_shape")) / 2**20
    bf16 = sum(t.numel() * 2 for t in stored.values() if t.dtype == torch.bfloat16) / 2**20
    assert held < bf16 + 0.5 * int4_as_bf16  # the int4 weights held as such
    assert out[2].token_ids == out[1].token_ids  # the tokenizer: one word an id
    for o in out:
        assert len(o.token_ids) == 6 and all(math.isfinite(lp[t]) for lp, t in zip(o.logprobs, o.token_ids))


def test_words_and_pieces():
    g = torch.Generator().manual_seed(1)
    levels = signed_levels(int4_words((64, 32), g))
    counts = torch.bincount(levels.flatten() + 8, minlength=16)
    assert counts[0] == 0 and counts[8] > 1.5 * counts[1:8].float().mean()  # −8 drawn as 0
    assert sum(pieces((10_000, 4096), torch.bfloat16)) == 10_000
    assert max(pieces((10_000, 4096), torch.bfloat16)) * 4096 * 2 <= 64 * 2**20
