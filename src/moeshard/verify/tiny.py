"""Tiny random Hugging Face checkpoints of the four architectures, made by transformers itself.

Weights are re-drawn with enough spread that activations stay O(1) and routing is decisive: the
default 0.02 init makes every router nearly uniform, so a routing bug would change little.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

COMMON = dict(
    vocab_size=101,  # not a multiple of TP: exercises the vocabulary padding
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
QWEN_MOE = dict(num_experts=8, moe_intermediate_size=32, num_experts_per_tok=2)

# name → (transformers config class name, settings beyond COMMON)
VARIANTS: dict[str, tuple[str, dict]] = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(QWEN_MOE, head_dim=12, norm_topk_prob=False)),
    "qwen3_moe_tied": (
        "Qwen3MoeConfig",
        dict(QWEN_MOE, norm_topk_prob=True, num_key_value_heads=1, tie_word_embeddings=True),
    ),
    "qwen2_moe": ("Qwen2MoeConfig", dict(QWEN_MOE, shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    "qwen2_moe_step2": (
        "Qwen2MoeConfig",
        dict(
            QWEN_MOE,
            shared_expert_intermediate_size=48,
            decoder_sparse_step=2,
            norm_topk_prob=True,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2_moe_no_shared": ("Qwen2MoeConfig", dict(QWEN_MOE, shared_expert_intermediate_size=0)),
    "mixtral_top1": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=1)),
    "mixtral_top2": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=7)),
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            num_key_value_heads=4,
            n_routed_experts=8,
            moe_intermediate_size=32,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=12,
            qk_rope_head_dim=8,
            v_head_dim=10,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=64,
                mscale=1.0,
                mscale_all_dim=1.0,
                beta_fast=32,
                beta_slow=1,
            ),
        ),
    ),
    "deepseek_v3_plain": (
        "DeepseekV3Config",
        dict(
            num_key_value_heads=4,
            n_routed_experts=8,
            moe_intermediate_size=32,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=2,
            n_shared_experts=2,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=16,
            rope_interleave=False,
            tie_word_embeddings=True,
        ),
    ),
}


def spread(name: str, fan_in: int) -> tuple[float, float]:
    """(std, mean) of parameter `name` of `fan_in` inputs: unit-scale weights (std 1/√fan_in),
    routers 4× wider, norm weights near 1, small biases."""
    if "norm" in name:
        return 0.2, 1.0
    if name.endswith("bias"):
        return 0.1, 0.0
    if "embed_tokens" in name:
        return 1.0, 0.0
    if name.endswith("gate.weight"):  # a router
        return 4.0 / fan_in**0.5, 0.0
    return 1.0 / max(fan_in, 1) ** 0.5, 0.0


@torch.no_grad()
def spread_init(model: torch.nn.Module, seed: int) -> None:
    """Every parameter drawn normal with its `spread`."""
    g = torch.Generator().manual_seed(seed)

    def draw(t: torch.Tensor, std: float, mean: float = 0.0) -> None:
        t.copy_(torch.randn(t.shape, generator=g) * std + mean)

    for name, p in model.named_parameters():
        draw(p, *spread(name, p.shape[-1]))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            draw(b, 0.05)


def make_tiny_checkpoint(variant: str, directory: str | Path, seed: int = 0, **overrides) -> Path:
    """Write `variant`'s random checkpoint (config.json + model.safetensors) into `directory`;
    `overrides` replace config settings (`max_position_embeddings=512` for long prompts)."""
    import transformers

    if variant not in VARIANTS:
        raise ValueError(f"unknown tiny variant {variant!r}; choose one of {', '.join(VARIANTS)}.")
    transformers.utils.logging.disable_progress_bar()
    config_name, settings = VARIANTS[variant]
    config = getattr(transformers, config_name)(**{**COMMON, **settings, **overrides})
    torch.manual_seed(seed)
    with warnings.catch_warnings():  # a zero-sized shared expert (qwen2_moe_no_shared) warns on init
        warnings.simplefilter("ignore", UserWarning)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    spread_init(model, seed)
    directory = Path(directory)
    model.save_pretrained(directory)
    return directory
