"""A decoder-only MoE model on this rank, its parameters filled from a Hugging Face checkpoint.

    ids → embed → [ x += attn(norm(x)); x += mlp_or_moe(norm(x)) ] × layers → norm → (logits)

The forward takes a flat batch (tokens of several sequences, one position each) and returns the
final hidden rows; `logits` projects the rows that need them. Between blocks the rows are the DP
group's (replicated over TP), or under SP this rank's equal slice of them, so the caller pads the
batch to a multiple of TP. The step's attention metadata and MoE context are set by the caller.

Built from the config alone (every parameter this rank's shard, empty, knowing its checkpoint
blocks); start-up, updates and reloads all fill it with moeshard.models.loader.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from moeshard.kernels.packed import Quantization
from moeshard.runtime import derived
from moeshard.models.archs import Architecture, CheckpointNames, parse_config
from moeshard.models.attention import Attention, LatentAttention, check_heads
from moeshard.models.checkpoint import Checkpoint, CheckpointError, TensorSource, read_config
from moeshard.models.config import LayerConfig, ModelConfig
from moeshard.models.kv_cache import CacheSpec, KVCache
from moeshard.models.layers import DenseMLP, RMSNorm, Rotary, TPComm, VocabParallelEmbedding, block, swiglu_blocks
from moeshard.models.loader import Alloc, Block, attach, check_only, load_weights
from moeshard.models.quantized_checkpoint import QuantizedSource, StoredFormats, open_checkpoint
from moeshard.moe.config import MoEConfig
from moeshard.moe.layer import MoELayer
from moeshard.moe.weights import RankShard
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


@dataclass(frozen=True)
class MoEFormat:
    """How a checkpoint stores one MoE layer, decided from the names it holds."""

    block: str  # the MoE block's prefix
    stacked: bool  # 3-D experts.gate_up_proj [E, 2I, D] and experts.down_proj [E, D, I], not per expert
    shared: bool  # shared-expert tensors are stored

    @classmethod
    def of(cls, stored: Container[str], names: CheckpointNames, prefix: str, cfg: MoEConfig) -> "MoEFormat":
        # transformers 5 itself names every MoE block `mlp` (Mixtral's checkpoints say block_sparse_moe).
        moe = next(
            (f"{prefix}.{b}" for b in (names.moe_block, "mlp") if f"{prefix}.{b}.gate.weight" in stored),
            f"{prefix}.{names.moe_block}",
        )
        # S = 0 (Qwen2-MoE without a shared expert) still stores empty tensors and a gate.
        shared = bool(names.shared_block) and bool(
            cfg.shared_intermediate or f"{moe}.{names.shared_block}.gate_proj.weight" in stored
        )
        return cls(moe, f"{moe}.experts.gate_up_proj" in stored, shared)


def expert_blocks(fmt: MoEFormat, names: CheckpointNames, cfg: MoEConfig, shard: RankShard) -> dict[str, tuple]:
    """The blocks of this rank's routed experts: MoEShard field → blocks."""
    D, E, I = cfg.hidden, cfg.num_experts, cfg.intermediate
    rows = block(I, shard.part, shard.parts)
    if fmt.stacked:
        name, n = f"{fmt.block}.experts.gate_up_proj", rows.stop - rows.start
        experts, up = slice(shard.experts.start, shard.experts.stop), slice(I + rows.start, I + rows.stop)
        return dict(
            gate_up_LFD=(
                Block(name, (E, 2 * I, D), (experts, rows), (slice(None), slice(0, n))),
                Block(name, (E, 2 * I, D), (experts, up), (slice(None), slice(n, 2 * n))),
            ),
            down_LDI=(Block(f"{fmt.block}.experts.down_proj", (E, D, I), (experts, slice(None), rows)),),
        )
    per_expert = [
        swiglu_blocks(f"{fmt.block}.experts.{e}", D, I, rows, names.expert_proj, at=(l,))
        for l, e in enumerate(shard.experts)
    ]
    return dict(
        gate_up_LFD=tuple(b for gate_up, _ in per_expert for b in gate_up),
        down_LDI=tuple(down for _, down in per_expert),
    )


def attach_moe_blocks(moe: MoELayer, fmt: MoEFormat, names: CheckpointNames, shard: RankShard) -> None:
    """Tell each parameter of `moe` its checkpoint blocks (see moeshard.models.loader)."""
    cfg = moe.cfg
    D, E, S = cfg.hidden, cfg.num_experts, cfg.shared_intermediate
    blocks = dict(
        router_ED=(Block(f"{fmt.block}.gate.weight", (E, D)),),
        score_bias_E=(Block(f"{fmt.block}.gate.e_score_correction_bias", (E,)),),
        **expert_blocks(fmt, names, cfg, shard),
    )
    if fmt.shared:
        prefix = f"{fmt.block}.{names.shared_block}"
        gate_up, down = swiglu_blocks(prefix, D, S, block(S, shard.shared_part, shard.shared_parts))
        gate = (Block(f"{fmt.block}.{names.shared_gate}.weight", (1, D)),) if names.shared_gate else ()
        shared = dict(shared_gate_up_FD=gate_up, shared_down_DI=(down,), shared_gate_1D=gate)
        if S:
            blocks.update(shared)
        else:
            check_only(moe, *(b for group in shared.values() for b in group))
    for field, param in moe.shard_params().items():
        if param is not None:
            attach(param, *blocks[field])


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        arch: Architecture,
        i: int,
        name: str,
        parallel: ParallelState,
        dtype: torch.dtype,
        stored: Container[str],
        quantization: Quantization | None = None,
    ):
        super().__init__()
        layer: LayerConfig = cfg.layers[i]
        prefix, alloc = f"model.layers.{i}", Alloc(dtype, parallel.device, quantization)
        self.input_norm = RMSNorm(alloc, f"{prefix}.input_layernorm", cfg.hidden, cfg.rms_eps)
        self.post_attention_norm = RMSNorm(alloc, f"{prefix}.post_attention_layernorm", cfg.hidden, cfg.rms_eps)
        attention = LatentAttention if cfg.attention.is_mla else Attention
        self.attn = attention(alloc, f"{prefix}.self_attn", f"{name}.attn", cfg, layer.sliding_window, parallel)
        if layer.moe is None:
            self.mlp = DenseMLP(alloc, f"{prefix}.mlp", cfg.hidden, layer.dense_intermediate, parallel)
        else:
            block = f"{prefix}.{arch.names.moe_block}"  # checkpoint module names, as quantization_skip matches them
            shared = f"{block}.{arch.names.shared_block}" if arch.names.shared_block else None
            formats = (alloc.quantized(f"{block}.experts"), shared and alloc.quantized(shared))
            self.mlp = MoELayer(layer.moe, None, dtype=dtype, name=f"{name}.moe", formats=formats)
            fmt = MoEFormat.of(stored, arch.names, prefix, layer.moe)
            attach_moe_blocks(self.mlp, fmt, arch.names, RankShard.of(layer.moe, parallel))

    def forward(self, x_TD: torch.Tensor, positions_T: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        h_TD = x_TD + self.attn(self.input_norm(x_TD), positions_T, rotary)
        return h_TD + self.mlp(self.post_attention_norm(h_TD))


class CausalLM(nn.Module):
    """`stored`: the names of the start-up checkpoint's tensors, which decide how MoE layers are
    read (Mixtral's or transformers 5's block name, stacked or per-expert); no tensor is read."""

    def __init__(
        self, cfg: ModelConfig, arch: Architecture, parallel: ParallelState, dtype: torch.dtype, stored: Container[str],
        quantization: Quantization | None = None,
    ):
        super().__init__()
        check_layout(cfg, parallel.layout)
        self.cfg, self.arch, self.parallel, self.dtype = cfg, arch, parallel, dtype
        # A published quantized checkpoint's weights as it stores them (load_model sets it; None: any other model).
        self.stored: StoredFormats | None = None
        alloc = Alloc(dtype, parallel.device, quantization)
        tied = cfg.tie_embeddings
        self.embed = VocabParallelEmbedding(alloc, "model.embed_tokens.weight", cfg.vocab_size, cfg.hidden, parallel, tied)
        self.rotary = Rotary(cfg.rope, cfg.max_positions, parallel.device)
        # Layer names are unique per process: the attention op and the MoE op find layers by name.
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, arch, i, f"model{next(_instances)}.{i}", parallel, dtype, stored, quantization)
            for i in range(len(cfg.layers))
        )
        self.norm = RMSNorm(alloc, "model.norm", cfg.hidden, cfg.rms_eps)
        self.lm_head = (
            self.embed if tied else VocabParallelEmbedding(alloc, "lm_head.weight", cfg.vocab_size, cfg.hidden, parallel, True)
        )
        self.comm = TPComm(parallel)

    def parts(self) -> list[str | int]:
        """The model's pieces as the loader fills them: "embed", each layer's index, "norm", "lm_head"."""
        return ["embed", *range(len(self.layers)), "norm"] + ([] if self.cfg.tie_embeddings else ["lm_head"])

    def part(self, part: str | int) -> nn.Module:
        return self.layers[part] if isinstance(part, int) else getattr(self, part)

    def reads(self, update: TensorSource) -> TensorSource:
        """An update's tensors as this model reads them: those of a weight a published quantized
        checkpoint stores quantized in its layout (StoredFormats.as_stored has turned plain ones into it)."""
        return update if self.stored is None else QuantizedSource(update, self.stored.layout)

    def load_part(self, source: TensorSource, part: str | int) -> None:
        """Read `part` again from `source` (this rank's blocks, as at start-up) into the existing
        parameters, a block at a time."""
        load_weights(self, source, [part])

    def forward(self, ids_T: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
        """[T] token ids and positions (T a multiple of TP under SP) → final hidden rows [T, D]."""
        x_TD = self.embed(ids_T)
        for layer in self.layers:
            x_TD = layer(x_TD, positions_T, self.rotary)
        return self.comm.gather_rows(self.norm(x_TD))

    def logits(self, hidden_ND: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden_ND).float()

    def derived_owners(self) -> list[object]:
        """The objects that own this model's derived tensors (runtime.derived): its modules and its
        MoE layers' dispatchers. Another model in the same process owns its own."""
        modules = list(self.modules())
        return modules + [d for m in modules if isinstance(m, MoELayer) for d in m.dispatchers.values()]

    def routed_per_ep_rank(self) -> list[int]:
        """(token, expert) assignments this rank routed to each EP rank's experts, all MoE layers."""
        counts = [m.routed_W for m in self.modules() if isinstance(m, MoELayer)]
        return torch.stack(counts).sum(0).tolist() if counts else []

    def cache_specs(self) -> list[CacheSpec]:
        return [layer.attn.cache_spec() for layer in self.layers]

    def set_kv_caches(self, caches: list[KVCache] | None) -> None:
        for i, layer in enumerate(self.layers):
            layer.attn.set_cache(None if caches is None else caches[i])


def load_config(directory: str | Path) -> tuple[ModelConfig, Architecture]:
    return parse_config(read_config(directory))


def load_model(directory: str | Path, dtype: torch.dtype = torch.float32, quantization: Quantization | None = None) -> CausalLM:
    """This rank's part of the model in `directory`, for the current layout (every rank calls this),
    its linear weights quantized at load with `quantization` (docs/quantization.md)."""
    cfg, arch = load_config(directory)
    parallel = get_parallel_state()
    ckpt, stored = open_checkpoint(directory), None
    if isinstance(ckpt, QuantizedSource):  # a published quantized checkpoint: held in its own formats
        if quantization is not None:
            raise CheckpointError(f"{Path(directory).name} is quantized already ({type(ckpt.layout).__name__}); "
                                  f"load it without quantization=.")
        stored = StoredFormats(ckpt)
        # In fp32 its weights are read dequantized, exact (verify hf's fp32 proof); else held as stored.
        quantization = None if dtype == torch.float32 else stored
    model, error = CausalLM(cfg, arch, parallel, dtype, stored=ckpt, quantization=quantization), None
    model.stored = stored
    try:
        load_weights(model, ckpt)
    except CheckpointError as exc:
        error = str(exc)
    ckpt.finish(unused_ok=lambda name: unused_by_design(name, cfg), error=error)
    derived.rebuild(model.derived_owners())  # what is computed from the weights, from the loaded ones
    return model.eval()


def part_of(name: str) -> str | int | None:
    """The part (see CausalLM.parts) whose parameters are read from checkpoint tensor `name` (a
    weight's own, or one its module stores it quantized as: `lm_head.qweight`)."""
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    if layer is not None:
        return int(layer[1])
    module = name.rpartition(".")[0]
    return {"model.embed_tokens": "embed", "model.norm": "norm", "lm_head": "lm_head"}.get(module)


def unused_by_design(name: str, cfg: ModelConfig) -> bool:
    """A tied model's copy of the LM head; DeepSeek-V3's multi-token-prediction layers, which
    checkpoints append after the last decoder layer."""
    if cfg.tie_embeddings and name == "lm_head.weight":
        return True
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    return layer is not None and int(layer[1]) >= len(cfg.layers)
