"""Full (unsharded) MoE weights, in Hugging Face's layout (`y = x @ W.T`), their random init, and
one rank's slices of them.

The layer copies in its rank's slices (`MoEWeights.shard`); the reference runs on them whole.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

from moeshard.kernels.packed import Plain
from moeshard.moe.config import MoEConfig, SharedLayout
from moeshard.parallel.state import ParallelState


def empty_param(shape: tuple[int, ...], dtype: torch.dtype, device, layout=None) -> nn.Parameter:
    """An inference weight of logical shape `shape` with undefined contents, to be filled in place
    (its identity stays), stored in `layout` (kernels.packed; Hugging Face's by default)."""
    layout = layout or Plain(tuple(shape))
    if tuple(layout.shape) != tuple(shape):
        raise ValueError(f"a layout of shape {list(layout.shape)} cannot hold a weight of shape {list(shape)}.")
    storage = torch.empty(layout.storage_shape(), dtype=layout.storage_dtype(dtype), device=device)
    param = nn.Parameter(storage, requires_grad=False)
    param.weight_layout = layout  # on the parameter object itself: sleep and wake change only its storage
    return param


@dataclass(frozen=True)
class RankShard:
    """Which part of an MoE layer's weights one rank holds.

    EP on: a contiguous block of whole experts. EP off: every expert, its intermediate dim split in
    `parts`. Shared experts in the TENSOR_PARALLEL layout are split over TP; otherwise whole.
    """

    experts: range
    part: int
    parts: int
    shared_part: int
    shared_parts: int

    @classmethod
    def of(cls, cfg: MoEConfig, parallel: ParallelState) -> "RankShard":
        layout, t = parallel.layout, parallel.tp_rank
        if layout.ep:
            L = cfg.num_experts // layout.ep_size
            experts, part, parts = range(parallel.ep_rank * L, (parallel.ep_rank + 1) * L), 0, 1
        else:
            experts, part, parts = range(cfg.num_experts), t, layout.tp
        shared_tp = cfg.shared_layout is SharedLayout.TENSOR_PARALLEL
        return cls(experts, part, parts, t if shared_tp else 0, layout.tp if shared_tp else 1)


@dataclass
class MoEWeights:
    router_ED: torch.Tensor
    gate_up_EFD: torch.Tensor  # rows [0, I) gate, [I, 2I) up
    down_EDI: torch.Tensor
    score_bias_E: torch.Tensor | None = None
    shared_gate_up_FD: torch.Tensor | None = None
    shared_down_DI: torch.Tensor | None = None
    shared_gate_1D: torch.Tensor | None = None

    def to(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> "MoEWeights":
        """A copy in `dtype` on `device`; router weights and the score bias stay fp32."""
        keep_fp32 = {"router_ED", "score_bias_E"}

        def convert(name: str, t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device=device, dtype=torch.float32 if name in keep_fp32 else dtype)

        return MoEWeights(**{f.name: convert(f.name, getattr(self, f.name)) for f in fields(self)})

    def shard(self, shard: RankShard) -> "MoEShard":
        """This rank's slices (see RankShard) of full weights."""
        block = slice(shard.experts.start, shard.experts.stop)
        shared = self.shared_gate_up_FD is not None
        return MoEShard(
            router_ED=self.router_ED,
            gate_up_LFD=shard_gate_up(self.gate_up_EFD[block], shard.part, shard.parts),
            down_LDI=shard_down(self.down_EDI[block], shard.part, shard.parts),
            score_bias_E=self.score_bias_E,
            shared_gate_up_FD=shard_gate_up(self.shared_gate_up_FD, shard.shared_part, shard.shared_parts) if shared else None,
            shared_down_DI=shard_down(self.shared_down_DI, shard.shared_part, shard.shared_parts) if shared else None,
            shared_gate_1D=self.shared_gate_1D,
        )

    @classmethod
    def random(cls, cfg: MoEConfig, seed: int = 0, spread: float = 1.0) -> "MoEWeights":
        """Weights scaled so activations stay O(1) and routing is decisive (not near-uniform)."""
        g = torch.Generator().manual_seed(seed)
        D, E, I, S = cfg.hidden, cfg.num_experts, cfg.intermediate, cfg.shared_intermediate

        def normal(*shape: int, fan_in: int, scale: float = 1.0) -> torch.Tensor:
            return torch.randn(*shape, generator=g) * (scale / fan_in**0.5)

        return cls(
            router_ED=normal(E, D, fan_in=D, scale=2.0 * spread),
            gate_up_EFD=normal(E, 2 * I, D, fan_in=D),
            down_EDI=normal(E, D, I, fan_in=I),
            score_bias_E=torch.randn(E, generator=g) * 0.1 if cfg.router.score_bias else None,
            shared_gate_up_FD=normal(2 * S, D, fan_in=D) if S else None,
            shared_down_DI=normal(D, S, fan_in=S) if S else None,
            shared_gate_1D=normal(1, D, fan_in=D) if S and cfg.shared_gate else None,
        )


@dataclass
class MoEShard:
    """One rank's slices of MoEWeights: the L experts it holds, each expert's and the shared
    experts' intermediate dim cut to this rank's part (F = 2 × I of the part)."""

    router_ED: torch.Tensor
    gate_up_LFD: torch.Tensor
    down_LDI: torch.Tensor
    score_bias_E: torch.Tensor | None = None
    shared_gate_up_FD: torch.Tensor | None = None
    shared_down_DI: torch.Tensor | None = None
    shared_gate_1D: torch.Tensor | None = None


def shard_gate_up(gate_up_FD: torch.Tensor, part: int, parts: int) -> torch.Tensor:
    """This part's rows of the gate and of the up projection (dim -2), fused again: [..., F/parts, D]."""
    gate, up = gate_up_FD.chunk(2, dim=-2)
    return torch.cat([gate.chunk(parts, dim=-2)[part], up.chunk(parts, dim=-2)[part]], dim=-2)


def shard_down(down_DI: torch.Tensor, part: int, parts: int) -> torch.Tensor:
    """This part's columns of the down projection (dim -1): [..., D, I/parts]."""
    return down_DI.chunk(parts, dim=-1)[part]
