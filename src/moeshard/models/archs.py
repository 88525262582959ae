"""The four supported architectures: how each reads its config.json and names its tensors.

Everything architecture-specific lives here; the model code (moeshard.models.model) is shared.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from moeshard.models.quantized_checkpoint import layout_of
from moeshard.models.config import AttentionConfig, LayerConfig, ModelConfig, ModelConfigError, RopeConfig
from moeshard.moe.config import MoEConfig, RouterConfig


@dataclass(frozen=True)
class CheckpointNames:
    """Where an architecture keeps its MoE tensors, relative to `model.layers.{i}`."""

    moe_block: str = "mlp"
    expert_proj: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down
    shared_block: str | None = None
    shared_gate: str | None = None


@dataclass(frozen=True)
class Architecture:
    name: str
    parse: Callable[[dict], ModelConfig]
    names: CheckpointNames


def need(hf: dict, key: str):
    if hf.get(key) is None:
        raise ModelConfigError(f"config.json has no {key!r}, which {hf.get('architectures', ['this model'])[0]} needs.")
    return hf[key]


def rope_config(hf: dict, dim: int, interleaved: bool = False) -> RopeConfig:
    """Read `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (older checkpoints)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelConfigError("partial rotary embeddings (partial_rotary_factor < 1) are not supported.")
    if kind == "default":
        return RopeConfig(dim=dim, theta=theta, interleaved=interleaved)
    if kind != "yarn":
        raise ModelConfigError(f"rope type {kind!r} is not supported; moeshard supports default and yarn.")
    max_positions = hf.get("max_position_embeddings", 4096)
    original = int(params.get("original_max_position_embeddings") or max_positions)
    return RopeConfig(
        dim=dim,
        theta=theta,
        kind="yarn",
        factor=float(params.get("factor") or max_positions / original),
        original_max_positions=original,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
        interleaved=interleaved,
    )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def gqa_attention(hf: dict, qkv_bias: bool, qk_norm: bool = False) -> AttentionConfig:
    heads = need(hf, "num_attention_heads")
    head_dim = hf.get("head_dim") or need(hf, "hidden_size") // heads
    return AttentionConfig(
        heads=heads,
        kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        qkv_bias=qkv_bias,
        o_bias=False,
        qk_norm=qk_norm,
    )


def common(hf: dict, attention: AttentionConfig, rope: RopeConfig, layers: list[LayerConfig]) -> ModelConfig:
    return ModelConfig(
        architecture=hf["architectures"][0],
        vocab_size=need(hf, "vocab_size"),
        hidden=need(hf, "hidden_size"),
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        attention=attention,
        rope=rope,
        layers=tuple(layers),
        max_positions=hf.get("max_position_embeddings", 4096),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def num_experts(hf: dict) -> int:
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if hf.get(key):
            return hf[key]
    raise ModelConfigError("config.json gives no number of experts (num_experts / num_local_experts).")


def qwen_layers(hf: dict, shared: bool) -> list[LayerConfig]:
    """Qwen2-MoE and Qwen3-MoE: a layer is sparse unless in `mlp_only_layers` or off `decoder_sparse_step`."""
    hidden, n = need(hf, "hidden_size"), need(hf, "num_hidden_layers")
    moe = MoEConfig(
        hidden=hidden,
        num_experts=num_experts(hf),
        intermediate=need(hf, "moe_intermediate_size"),
        router=RouterConfig(top_k=need(hf, "num_experts_per_tok"), renormalize=bool(hf.get("norm_topk_prob", False))),
        shared_intermediate=hf.get("shared_expert_intermediate_size", 0) if shared else 0,
        shared_gate=shared and hf.get("shared_expert_intermediate_size", 0) > 0,
    )
    dense_only = set(hf.get("mlp_only_layers") or [])
    step = hf.get("decoder_sparse_step", 1) or 1
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    types = hf.get("layer_types") or ["sliding_attention" if window else "full_attention"] * n
    return [
        LayerConfig(
            moe=moe if i not in dense_only and (i + 1) % step == 0 else None,
            dense_intermediate=need(hf, "intermediate_size"),
            sliding_window=window if types[i] == "sliding_attention" else None,
        )
        for i in range(n)
    ]


def parse_qwen2_moe(hf: dict) -> ModelConfig:
    attention = gqa_attention(hf, qkv_bias=bool(hf.get("qkv_bias", True)))
    return common(hf, attention, rope_config(hf, attention.head_dim), qwen_layers(hf, shared=True))


def parse_qwen3_moe(hf: dict) -> ModelConfig:
    attention = gqa_attention(hf, qkv_bias=bool(hf.get("attention_bias", False)), qk_norm=True)
    attention = dataclasses.replace(attention, o_bias=attention.qkv_bias)
    return common(hf, attention, rope_config(hf, attention.head_dim), qwen_layers(hf, shared=False))


def parse_mixtral(hf: dict) -> ModelConfig:
    attention = gqa_attention(hf, qkv_bias=False)
    moe = MoEConfig(
        hidden=need(hf, "hidden_size"),
        num_experts=num_experts(hf),
        intermediate=need(hf, "intermediate_size"),
        router=RouterConfig(top_k=need(hf, "num_experts_per_tok"), renormalize=True),
    )
    layers = [LayerConfig(moe=moe, sliding_window=hf.get("sliding_window"))] * need(hf, "num_hidden_layers")
    return common(hf, attention, rope_config(hf, attention.head_dim), layers)


def parse_deepseek_v3(hf: dict) -> ModelConfig:
    heads = need(hf, "num_attention_heads")
    nope, rope_dim, v_dim = need(hf, "qk_nope_head_dim"), need(hf, "qk_rope_head_dim"), need(hf, "v_head_dim")
    rope = rope_config(hf, rope_dim, interleaved=bool(hf.get("rope_interleave", True)))
    scale = (nope + rope_dim) ** -0.5
    if rope.kind == "yarn" and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    attention = AttentionConfig(
        heads=heads,
        kv_heads=heads,
        head_dim=nope + rope_dim,
        v_head_dim=v_dim,
        qkv_bias=bool(hf.get("attention_bias", False)),
        o_bias=bool(hf.get("attention_bias", False)),
        q_lora_rank=hf.get("q_lora_rank") or 0,
        kv_lora_rank=need(hf, "kv_lora_rank"),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        scale=scale,
    )
    E = num_experts(hf)
    moe = MoEConfig(
        hidden=need(hf, "hidden_size"),
        num_experts=E,
        intermediate=need(hf, "moe_intermediate_size"),
        router=RouterConfig(
            top_k=need(hf, "num_experts_per_tok"),
            scoring="sigmoid",
            renormalize=bool(hf.get("norm_topk_prob", True)),
            n_group=hf.get("n_group") or 1,
            topk_group=hf.get("topk_group") or 1,
            score_bias=True,
            routed_scaling=float(hf.get("routed_scaling_factor", 1.0)),
        ),
        shared_intermediate=need(hf, "moe_intermediate_size") * (hf.get("n_shared_experts") or 0),
    )
    first_dense = hf.get("first_k_dense_replace") or 0
    layers = [
        LayerConfig(moe=None if i < first_dense else moe, dense_intermediate=need(hf, "intermediate_size"))
        for i in range(need(hf, "num_hidden_layers"))
    ]
    return common(hf, attention, rope, layers)


ARCHITECTURES = {
    arch.name: arch
    for arch in (
        Architecture(
            "Qwen2MoeForCausalLM",
            parse_qwen2_moe,
            CheckpointNames(shared_block="shared_expert", shared_gate="shared_expert_gate"),
        ),
        Architecture("Qwen3MoeForCausalLM", parse_qwen3_moe, CheckpointNames()),
        Architecture("MixtralForCausalLM", parse_mixtral, CheckpointNames("block_sparse_moe", ("w1", "w3", "w2"))),
        Architecture("DeepseekV3ForCausalLM", parse_deepseek_v3, CheckpointNames(shared_block="shared_experts")),
    )
}


def architecture_of(hf: dict) -> Architecture:
    names = hf.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    known = ", ".join(ARCHITECTURES)
    raise ModelConfigError(
        f"architecture {names[0] if names else hf.get('model_type', '?')!r} is not supported; moeshard runs {known}."
    )


def parse_config(hf: dict) -> tuple[ModelConfig, Architecture]:
    arch = architecture_of(hf)
    layout_of(hf)  # a quantized checkpoint's layout: one moeshard reads (models.quantized_checkpoint), or refused here
    if hf.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"hidden_act {hf['hidden_act']!r} is not supported; moeshard's MLPs are SwiGLU (silu).")
    cfg = arch.parse(hf)
    for layer in cfg.layers:
        if layer.moe is not None:
            try:
                layer.moe.validate()
            except ValueError as exc:
                raise ModelConfigError(f"config.json's MoE settings are invalid: {exc}") from None
    return cfg, arch
