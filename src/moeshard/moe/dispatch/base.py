"""The one dispatcher protocol: prepare → dispatch → experts → combine → finalize.

prepare   pad this rank's rows to the step's row count and bring them where the method computes
          (all-gather for ALLGATHER, the rank's TP slice for the EP methods).
dispatch  send (token, expert) pairs to the ranks owning the experts; sort them by local expert.
experts   the grouped GEMMs (GroupedExperts), shared by every method.
combine   bring expert outputs back to their tokens and sum each token's K weighted outputs.
finalize  undo prepare: reduce-scatter or TP all-gather, then drop the padding.

A dispatcher is built once per layer and method; its expert maps are derived tensors (computed from
the layout, kept outside the weights), built by `build_expert_maps` and registered in
moeshard.runtime.derived.
"""

from __future__ import annotations

import abc
import enum
import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from moeshard.moe.config import SelectionPolicy
from moeshard.moe.experts import GroupedExperts
from moeshard.moe.functional import pad_rows
from moeshard.parallel import state
from moeshard.parallel.state import ParallelState
from moeshard.runtime import derived, invariance


class MethodEnum(enum.Enum):
    """The base of `CommMethod`, whose members moe/dispatch/__init__.py makes from the registered
    dispatchers' names."""

    @classmethod
    def parse(cls, text: str) -> "MethodEnum | None":
        """`auto` → None (the policy chooses); otherwise the method of that name."""
        if text == "auto":
            return None
        try:
            return cls(text.lower())
        except ValueError:
            names = ", ".join(["auto", *(m.value for m in cls)])
            raise ValueError(f"unknown communication method {text!r}; choose one of {names}.") from None


@dataclass(frozen=True)
class Prepared:
    x_RD: torch.Tensor  # R rows, where this method computes
    topk_ids_RK: torch.Tensor
    topk_weights_RK: torch.Tensor
    input_rows: int  # T: rows the caller passed in


@dataclass(frozen=True)
class Dispatched:
    x_MD: torch.Tensor  # rows sorted by local expert; rows past group_ends_L[-1] are not computed
    group_ends_L: torch.Tensor
    state: Any  # what combine needs to route the outputs back


@dataclass(frozen=True)
class ExpertMaps:
    owner_E: torch.Tensor  # EP rank that owns each global expert
    local_index_E: torch.Tensor  # the local-expert table: index of each expert on its owner
    label_E: torch.Tensor  # this rank's label for each expert: local index, or L when not owned here
    num_local: int


def build_expert_maps(num_experts: int, parallel: ParallelState) -> ExpertMaps:
    ep_size = parallel.layout.ep_size
    L = num_experts // ep_size
    experts_E = torch.arange(num_experts, device=parallel.device)
    owner_E = experts_E // L
    local_index_E = experts_E % L
    label_E = torch.where(owner_E == parallel.ep_rank, local_index_E, L)
    return ExpertMaps(owner_E, local_index_E, label_E, L)


def sum_over_topk(y_PD: torch.Tensor, topk_weights_RK: torch.Tensor) -> torch.Tensor:
    """Pairs in (row, k) order → each row's weighted sum of its K expert outputs (in fp32)."""
    R, K = topk_weights_RK.shape
    if invariance.batch_invariant():
        # In k order, one pass per k: the order does not depend on which rank computed a pair or
        # on the batch (bmm's kernel choice may follow the shapes).
        y_RKD, w_RK = y_PD.view(R, K, -1), topk_weights_RK.float()
        y_RD = y_RKD[:, 0].float() * w_RK[:, :1]
        for k in range(1, K):
            y_RD += y_RKD[:, k].float() * w_RK[:, k : k + 1]
        return y_RD.to(y_PD.dtype)
    # One batched [1, K] @ [K, D] per row: a single pass over the pairs, no [R, K, D] temporary.
    y_R1D = torch.bmm(topk_weights_RK.float().unsqueeze(1), y_PD.view(R, K, -1).float())
    return y_R1D.squeeze(1).to(y_PD.dtype)


class TokenDispatcher(abc.ABC):
    """prepare → routed (dispatch → experts → combine) → finalize, and the method's facts."""

    name: ClassVar[str]  # the method's name: `--moe-comm NAME`, CommMethod(NAME)
    needs_ep: ClassVar[bool] = True  # runs only when expert parallelism is on (or on one rank)
    auto_priority: ClassVar[int] = 0  # among the methods that can run a step, selection takes the highest

    def __init__(self, num_experts: int, parallel: ParallelState):
        self.num_experts = num_experts
        self.parallel = parallel
        derived.register(self, "maps", functools.partial(build_expert_maps, num_experts, parallel))

    @classmethod
    @abc.abstractmethod
    def output_is_reduced(cls, sp: bool) -> bool:
        """Is the routed output complete (not a partial sum over TP) when this method returns it?"""

    @classmethod
    def token_capacity(cls, policy: SelectionPolicy) -> int | None:
        """The most tokens per rank one step may bring (None: no limit)."""
        return None

    @classmethod
    def auto_enabled(cls, policy: SelectionPolicy) -> bool:
        """May automatic selection pick this method under `policy`?"""
        return True

    @abc.abstractmethod
    def prepare(self, x_TD: torch.Tensor, topk_ids_TK, topk_weights_TK, num_tokens: int) -> Prepared:
        """Pad to the step's `num_tokens` rows (the max over ranks) and bring the rows where this method computes."""

    @abc.abstractmethod
    def routed(self, prepared: Prepared, experts: GroupedExperts) -> torch.Tensor:
        """Each prepared row's weighted sum of its K experts' outputs."""

    @abc.abstractmethod
    def finalize(self, y_RD: torch.Tensor, prepared: Prepared) -> torch.Tensor: ...

    def run(self, x_TD, topk_ids_TK, topk_weights_TK, experts: GroupedExperts, num_tokens: int) -> torch.Tensor:
        if num_tokens == 0:  # every rank agrees: nothing to send
            return torch.zeros_like(x_TD)
        prepared = self.prepare(x_TD, topk_ids_TK, topk_weights_TK, num_tokens)
        return self.finalize(self.routed(prepared, experts), prepared)


class Staged(abc.ABC):
    """`routed` as three steps: dispatch pairs to the experts' owners, run the experts, combine."""

    @abc.abstractmethod
    def dispatch(self, prepared: Prepared) -> Dispatched: ...

    @abc.abstractmethod
    def combine(self, y_MD: torch.Tensor, dispatched: Dispatched, prepared: Prepared) -> torch.Tensor: ...

    def routed(self, prepared: Prepared, experts: GroupedExperts) -> torch.Tensor:
        dispatched = self.dispatch(prepared)
        return self.combine(experts(dispatched.x_MD, dispatched.group_ends_L), dispatched, prepared)


def pad_routing(x_TD, topk_ids_TK, topk_weights_TK, rows: int):
    """Pad to `rows`; padding rows route to expert 0 with weight 0 (sent, computed, discarded)."""
    return pad_rows(x_TD, rows), pad_rows(topk_ids_TK, rows), pad_rows(topk_weights_TK, rows)


class ExpertParallelDispatcher(TokenDispatcher):
    """Shared prepare/finalize of ALLTOALL, MC2 and FUSED_MC2: each TP rank sends its own slice.

    Without SP the DP group's rows are replicated over TP, so TP rank t takes slice t, and the
    complete outputs of all slices are all-gathered over TP at the end. Under SP the rank's rows
    already are its slice.
    """

    @classmethod
    def output_is_reduced(cls, sp):
        return True

    def prepare(self, x_TD, topk_ids_TK, topk_weights_TK, num_tokens):
        layout, t = self.parallel.layout, self.parallel.tp_rank
        split = not layout.sp and layout.tp > 1
        rows = -(-num_tokens // layout.tp) if split else num_tokens
        padded = pad_routing(x_TD, topk_ids_TK, topk_weights_TK, rows * layout.tp if split else rows)
        if split:
            padded = tuple(tensor[t * rows : (t + 1) * rows] for tensor in padded)
        return Prepared(*padded, input_rows=x_TD.shape[0])

    def finalize(self, y_RD, prepared):
        if not self.parallel.layout.sp:
            y_RD = state.all_gather(y_RD, self.parallel.tp_group)
        return y_RD[: prepared.input_rows]


def unsort(y_MD: torch.Tensor, order_M: torch.Tensor) -> torch.Tensor:
    """Inverse of `y = x[order]`."""
    out = torch.empty_like(y_MD)
    out[order_M] = y_MD
    return out
