"""Model parts on their own: RoPE/yarn tables, config parsing, the paged cache and its attention op."""

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from moeshard.models.archs import parse_config, rope_config
from moeshard.models.config import ModelConfigError
from moeshard.models.kv_cache import AttentionMetadata, CacheSpec, allocate, attention_context, null_slot, register
from moeshard.models.layers import rope_inv_freq

YARN = [
    dict(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0),  # DeepSeek-V3
    dict(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=0.707),
    dict(factor=4.0, original_max_position_embeddings=32768),  # Qwen's recipe: attention factor from factor
    dict(factor=8.0, original_max_position_embeddings=2048, attention_factor=1.3, beta_fast=16, beta_slow=2),
]


@pytest.mark.parametrize("params", YARN)
def test_yarn_matches_transformers(params):
    hf_params = dict(rope_type="yarn", rope_theta=10000.0, **params)
    cfg = transformers.DeepseekV3Config(rope_parameters=dict(hf_params), max_position_embeddings=163840)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    ours, our_factor = rope_inv_freq(rope_config({"rope_parameters": hf_params, "max_position_embeddings": 163840}, 64))
    torch.testing.assert_close(ours, inv_freq, rtol=0, atol=0)
    assert our_factor == pytest.approx(factor, rel=1e-12)


def test_older_config_keys():
    """rope_theta + rope_scaling at the top level, num_experts, no qkv_bias key (Qwen2-MoE's default: on)."""
    hf = dict(
        architectures=["Qwen2MoeForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=4, shared_expert_intermediate_size=8, rope_theta=1e6,
        rope_scaling={"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024},
    )
    cfg, _ = parse_config(hf)
    assert cfg.rope.theta == 1e6 and cfg.rope.kind == "yarn" and cfg.rope.factor == 2.0
    assert cfg.attention.qkv_bias and cfg.layers[0].moe.num_experts == 4 and cfg.layers[0].moe.shared_gate


def test_refuses_unsupported_configs():
    base = dict(architectures=["MixtralForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
                num_hidden_layers=1, num_attention_heads=2, num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(ModelConfigError, match="rope type 'longrope' is not supported"):
        parse_config({**base, "rope_parameters": {"rope_type": "longrope"}})
    with pytest.raises(ValueError, match="quantization method 'bitsandbytes' is not supported"):
        parse_config({**base, "quantization_config": {"quant_method": "bitsandbytes"}})
    with pytest.raises(ModelConfigError, match="hidden_act 'gelu'"):
        parse_config({**base, "hidden_act": "gelu"})
    with pytest.raises(ModelConfigError, match="no 'num_attention_heads'"):
        parse_config({k: v for k, v in base.items() if k != "num_attention_heads"})


def dense_attention(q_nHd, k_LGd, v_LGe, first_pos, scale, window):
    """The query at position first_pos + i sees keys j ≤ first_pos + i, and within the window."""
    n, H, _ = q_nHd.shape
    L, G, _ = k_LGd.shape
    mask = torch.ones(n, L, dtype=torch.bool).tril(first_pos)
    if window is not None:
        mask &= ~torch.ones(n, L, dtype=torch.bool).tril(first_pos - window)
    k, v = (t.repeat_interleave(H // G, dim=1).transpose(0, 1) for t in (k_LGd, v_LGe))
    out = torch.nn.functional.scaled_dot_product_attention(q_nHd.transpose(0, 1), k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


class _Layer:
    def __init__(self, cache, window):
        self.cache, self.scale, self.window = cache, 0.5, window


@pytest.mark.parametrize("window", [None, 3])
def test_paged_attention_equals_dense_causal_attention(window):
    """Two sequences with scattered blocks, written over two steps (prefill, then two tokens each)."""
    g = torch.Generator().manual_seed(0)
    H, G, d, e, bs = 4, 2, 8, 6, 2
    cache = allocate(CacheSpec(G, d, e), num_blocks=12, block_size=bs, dtype=torch.float32, device="cpu")
    layer = _Layer(cache, window)
    register(f"test.paged.{window}", layer)
    tables = [[7, 2, 9, 0], [5, 11, 3]]
    lengths = [(5, 7), (3, 5)]  # (after prefill, after the second step)
    q = [torch.randn(7, H, d, generator=g), torch.randn(5, H, d, generator=g)]
    k = [torch.randn(7, G, d, generator=g), torch.randn(5, G, d, generator=g)]
    v = [torch.randn(7, G, e, generator=g), torch.randn(5, G, e, generator=g)]
    for step in range(2):
        spans = [(0 if step == 0 else lens[0], lens[step]) for lens in lengths]
        meta = AttentionMetadata.build([b - a for a, b in spans], [b for _, b in spans], tables, bs, null_slot(12, bs))
        rows = lambda xs: torch.cat([x[a:b] for x, (a, b) in zip(xs, spans)])  # noqa: E731
        pad = 10 - sum(b - a for a, b in spans)
        args = [torch.cat([rows(x), torch.zeros(pad, *x[0].shape[1:])]) for x in (q, k, v)]
        with attention_context(meta):
            out = torch.ops.moeshard.paged_attention(*args, f"test.paged.{window}")
        assert out[10 - pad :].abs().max() == 0  # padding rows: written nowhere, output zero
        for i, (a, b) in enumerate(spans):
            expected = dense_attention(q[i][a:b], k[i][:b], v[i][:b], a, 0.5, window)
            start = meta.query_starts[i]
            torch.testing.assert_close(out[start : start + b - a], expected)
