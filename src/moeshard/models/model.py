"""A decoder-only MoE model on this rank, built from its blocks of a Hugging Face checkpoint.

    ids → embed → [ x += attn(norm(x)); x += mlp_or_moe(norm(x)) ] × layers → norm → (logits)

The forward takes a flat batch (tokens of several sequences, one position each) and returns the
final hidden rows; `logits` projects the rows that need them. Between blocks the rows are the DP
group's (replicated over TP), or under SP this rank's equal slice of them, so the caller pads the
batch to a multiple of TP. The step's attention metadata and MoE context are set by the caller.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import torch
from torch import nn

from moeshard.models.archs import Architecture, parse_config
from moeshard.models.attention import Attention, LatentAttention, check_heads
from moeshard.models.checkpoint import Checkpoint, CheckpointError, TensorSource, read_config
from moeshard.models.config import LayerConfig, ModelConfig
from moeshard.models.kv_cache import CacheSpec, KVCache
from moeshard.models.layers import DenseMLP, RMSNorm, Rotary, TPComm, VocabParallelEmbedding, block, read_swiglu
from moeshard.moe.config import MoEConfig
from moeshard.moe.layer import MoELayer
from moeshard.moe.weights import MoEWeights, RankShard
from moeshard.parallel.layout import Layout, LayoutError
from moeshard.parallel.state import ParallelState, get_parallel_state

_instances = itertools.count()


def check_layout(cfg: ModelConfig, layout: Layout) -> None:
    """Refuse, with one sentence, a layout this model cannot be split over."""
    check_heads(cfg.attention, layout.tp)
    for i, layer in enumerate(cfg.layers):
        if layer.moe is None:
            if layer.dense_intermediate % layout.tp:
                raise LayoutError(
                    f"TP={layout.tp} does not divide layer {i}'s MLP intermediate size {layer.dense_intermediate}."
                )
        else:
            m = layer.moe
            layout.validate(
                num_experts=m.num_experts, intermediate=m.intermediate, shared_intermediate=m.shared_intermediate
            )


def read_moe_weights(ckpt: Checkpoint, arch: Architecture, prefix: str, cfg: MoEConfig, shard: RankShard) -> MoEWeights:
    """This rank's slices of one MoE layer, from per-expert tensors or stacked 3-D ones."""
    names = arch.names
    # transformers 5 itself names every MoE block `mlp` (Mixtral's checkpoints say block_sparse_moe).
    moe = next(
        (f"{prefix}.{b}" for b in (names.moe_block, "mlp") if f"{prefix}.{b}.gate.weight" in ckpt),
        f"{prefix}.{names.moe_block}",
    )
    D, E, I, S = cfg.hidden, cfg.num_experts, cfg.intermediate, cfg.shared_intermediate
    rows = block(I, shard.part, shard.parts)
    experts = slice(shard.experts.start, shard.experts.stop)
    if f"{moe}.experts.gate_up_proj" in ckpt:
        gate_up = f"{moe}.experts.gate_up_proj"
        gate = ckpt.read(gate_up, (E, 2 * I, D), (experts, rows))
        up = ckpt.read(gate_up, (E, 2 * I, D), (experts, slice(I + rows.start, I + rows.stop)))
        gate_up_EFD = torch.cat([gate, up], dim=1)
        down_EDI = ckpt.read(f"{moe}.experts.down_proj", (E, D, I), (experts, slice(None), rows))
    else:
        per_expert = [read_swiglu(ckpt, f"{moe}.experts.{e}", D, I, rows, names.expert_proj) for e in shard.experts]
        gate_up_EFD = torch.stack([gate_up_FD for gate_up_FD, _ in per_expert])
        down_EDI = torch.stack([down_DI for _, down_DI in per_expert])
    shared = {}
    if names.shared_block and (S or f"{moe}.{names.shared_block}.gate_proj.weight" in ckpt):
        # S = 0 (Qwen2-MoE without a shared expert) still stores empty tensors and a gate.
        gate_up_FD, down_DI = read_swiglu(
            ckpt, f"{moe}.{names.shared_block}", D, S, block(S, shard.shared_part, shard.shared_parts)
        )
        gate_1D = ckpt.read(f"{moe}.{names.shared_gate}.weight", (1, D)) if names.shared_gate else None
        if S:
            shared = dict(shared_gate_up_FD=gate_up_FD, shared_down_DI=down_DI, shared_gate_1D=gate_1D)
    return MoEWeights(
        router_ED=ckpt.read(f"{moe}.gate.weight", (E, D), dtype=torch.float32),
        gate_up_EFD=gate_up_EFD,
        down_EDI=down_EDI,
        score_bias_E=ckpt.read(f"{moe}.gate.e_score_correction_bias", (E,), dtype=torch.float32)
        if cfg.router.score_bias
        else None,
        **shared,
    )


class DecoderLayer(nn.Module):
    def __init__(
        self, ckpt: Checkpoint, arch: Architecture, cfg: ModelConfig, i: int, name: str, parallel: ParallelState, dtype
    ):
        super().__init__()
        layer: LayerConfig = cfg.layers[i]
        prefix = f"model.layers.{i}"
        self.input_norm = RMSNorm(ckpt.read(f"{prefix}.input_layernorm.weight", (cfg.hidden,)), cfg.rms_eps)
        self.post_attention_norm = RMSNorm(
            ckpt.read(f"{prefix}.post_attention_layernorm.weight", (cfg.hidden,)), cfg.rms_eps
        )
        attention = LatentAttention if cfg.attention.is_mla else Attention
        self.attn = attention(ckpt, f"{prefix}.self_attn", f"{name}.attn", cfg, layer.sliding_window, parallel)
        if layer.moe is None:
            self.mlp = DenseMLP(ckpt, f"{prefix}.mlp", cfg.hidden, layer.dense_intermediate, parallel)
        else:
            weights = read_moe_weights(ckpt, arch, prefix, layer.moe, RankShard.of(layer.moe, parallel))
            self.mlp = MoELayer(layer.moe, weights, dtype=dtype, name=f"{name}.moe", sharded=True)

    def forward(self, x_TD: torch.Tensor, positions_T: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        h_TD = x_TD + self.attn(self.input_norm(x_TD), positions_T, rotary)
        return h_TD + self.mlp(self.post_attention_norm(h_TD))


class CausalLM(nn.Module):
    def __init__(
        self, ckpt: Checkpoint, arch: Architecture, cfg: ModelConfig, parallel: ParallelState, dtype: torch.dtype
    ):
        super().__init__()
        check_layout(cfg, parallel.layout)
        self.cfg, self.arch, self.parallel, self.dtype = cfg, arch, parallel, dtype
        self.embed = self.build_part(ckpt, "embed")
        self.rotary = Rotary(cfg.rope, cfg.max_positions, parallel.device)
        self.layers = nn.ModuleList(self.build_part(ckpt, i) for i in range(len(cfg.layers)))
        self.norm = self.build_part(ckpt, "norm")
        self.lm_head = self.embed if cfg.tie_embeddings else self.build_part(ckpt, "lm_head")
        self.comm = TPComm(parallel)

    def parts(self) -> list[str | int]:
        """The model's pieces as the loader builds them: "embed", each layer's index, "norm", "lm_head"."""
        return ["embed", *range(len(self.layers)), "norm"] + ([] if self.cfg.tie_embeddings else ["lm_head"])

    def build_part(self, source: TensorSource, part: str | int) -> nn.Module:
        cfg, parallel = self.cfg, self.parallel
        if part == "embed":
            return VocabParallelEmbedding(source, "model.embed_tokens.weight", cfg.vocab_size, cfg.hidden, parallel)
        if part == "lm_head":
            return VocabParallelEmbedding(source, "lm_head.weight", cfg.vocab_size, cfg.hidden, parallel)
        if part == "norm":
            return RMSNorm(source.read("model.norm.weight", (cfg.hidden,)), cfg.rms_eps)
        # Layer names are unique per process: the attention op and the MoE op find layers by name.
        return DecoderLayer(source, self.arch, cfg, part, f"model{next(_instances)}.{part}", parallel, self.dtype)

    def load_part(self, source: TensorSource, part: str | int) -> None:
        """Read `part` again from `source` (this rank's blocks, as at start-up), into the existing tensors:
        the extra memory is one part."""
        current = self.layers[part] if isinstance(part, int) else getattr(self, part)
        fresh = self.build_part(source, part)
        for mine, new in zip(current.parameters(), fresh.parameters(), strict=True):
            mine.data.copy_(new)

    def forward(self, ids_T: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
        """[T] token ids and positions (T a multiple of TP under SP) → final hidden rows [T, D]."""
        x_TD = self.embed(ids_T)
        for layer in self.layers:
            x_TD = layer(x_TD, positions_T, self.rotary)
        return self.comm.gather_rows(self.norm(x_TD))

    def logits(self, hidden_ND: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden_ND).float()

    def cache_specs(self) -> list[CacheSpec]:
        return [layer.attn.cache_spec() for layer in self.layers]

    def set_kv_caches(self, caches: list[KVCache] | None) -> None:
        for i, layer in enumerate(self.layers):
            layer.attn.set_cache(None if caches is None else caches[i])


def load_config(directory: str | Path) -> tuple[ModelConfig, Architecture]:
    return parse_config(read_config(directory))


def load_model(directory: str | Path, dtype: torch.dtype = torch.float32) -> CausalLM:
    """This rank's part of the model in `directory`, for the current layout (every rank calls this)."""
    cfg, arch = load_config(directory)
    parallel = get_parallel_state()
    ckpt = Checkpoint(directory, dtype, parallel.device)
    model, error = None, None
    try:
        model = CausalLM(ckpt, arch, cfg, parallel, dtype)
    except CheckpointError as exc:
        error = str(exc)
    ckpt.finish(unused_ok=lambda name: unused_by_design(name, cfg), error=error)
    return model.eval()


def part_of(name: str) -> str | int | None:
    """The part (see CausalLM.parts) whose construction reads checkpoint tensor `name`."""
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    if layer is not None:
        return int(layer[1])
    return {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}.get(name)


def unused_by_design(name: str, cfg: ModelConfig) -> bool:
    """A tied model's copy of the LM head; DeepSeek-V3's multi-token-prediction layers, which
    checkpoints append after the last decoder layer."""
    if cfg.tie_embeddings and name == "lm_head.weight":
        return True
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    return layer is not None and int(layer[1]) >= len(cfg.layers)
