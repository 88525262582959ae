"""What an MoE layer is: sizes, router, shared experts. Frozen; hashable; no tensors.

Shape legend used across moeshard.moe (and models/, which adds its own letters; docs/DESIGN.md §10):
    T  tokens on this rank (the layer's input rows)     D  hidden size
    E  experts (global)                                  L  experts on this rank
    K  experts per token (top-k)                         I  expert intermediate size (this rank's shard)
    F  2 × I: gate and up projections, fused             P  (token, expert) pairs = rows × K
    R  rows where a method computes (after prepare)      M  rows handed to the grouped expert GEMM
    W  ranks in a group                                  C  MC2 slots per destination rank
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class SharedLayout(enum.Enum):
    TENSOR_PARALLEL = "tp"  # weights sharded over TP along the intermediate dim; output is a partial sum
    DATA_PARALLEL = "dp"  # weights replicated; each TP rank computes a token slice; all-gathered


@dataclass(frozen=True)
class RouterConfig:
    top_k: int = 2
    scoring: str = "softmax"  # "softmax" | "sigmoid"
    renormalize: bool = True  # top-k weights sum to 1 (before routed_scaling)
    n_group: int = 1  # grouped top-k (DeepSeek-V3): experts in n_group groups ...
    topk_group: int = 1  # ... of which the best topk_group are eligible
    score_bias: bool = False  # e_score_correction_bias: steers selection, not the weights
    routed_scaling: float = 1.0

    def validate(self, num_experts: int) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"router scoring must be 'softmax' or 'sigmoid', got {self.scoring!r}.")
        if not 1 <= self.top_k <= num_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and the number of experts ({num_experts}).")
        if num_experts % self.n_group:
            raise ValueError(f"n_group={self.n_group} does not divide the number of experts ({num_experts}).")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group={self.topk_group} must be between 1 and n_group={self.n_group}.")
        if self.topk_group * (num_experts // self.n_group) < self.top_k:
            raise ValueError(
                f"top_k={self.top_k} exceeds the {self.topk_group * (num_experts // self.n_group)} experts "
                f"in the {self.topk_group} eligible groups."
            )


@dataclass(frozen=True)
class MoEConfig:
    hidden: int
    num_experts: int
    intermediate: int  # per routed expert
    router: RouterConfig = RouterConfig()
    shared_intermediate: int = 0  # 0: no shared experts
    shared_gate: bool = False  # Qwen2-MoE: shared output × sigmoid(x · g)
    shared_layout: SharedLayout = SharedLayout.TENSOR_PARALLEL

    @property
    def has_shared(self) -> bool:
        return self.shared_intermediate > 0

    def validate(self) -> "MoEConfig":
        for name in ("hidden", "num_experts", "intermediate"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}.")
        self.router.validate(self.num_experts)
        return self


@dataclass(frozen=True)
class SelectionPolicy:
    """How the communication method is chosen per forward (docs/DESIGN.md §2)."""

    mc2_capacity: int = 256  # max tokens per rank an MC2 buffer holds
    fused_mc2: bool = False  # prefer FUSED_MC2 where MC2 would be chosen
