"""Runtime-aware reductions: docs/DESIGN.md §3, in one place.

A point *exists* in the graph by the layer's static configuration (decided in Python, also while
tracing). Whether an existing point *all-reduces* depends on the live communication method, so that
decision is made only inside the custom op `moeshard::maybe_reduce`, at run time.

    point          exists when (static)                         all-reduces over TP when (runtime)
    routed early   shared layout is DATA_PARALLEL, or a routed  routed output not already reduced
                   transform exists with SP off and (TP>1 or EP>1)
    shared         shared experts in TENSOR_PARALLEL layout     routed was reduced early or already reduced
    final          SP off and no routed-early point             routed output not already reduced

Order: routed → (routed early) → routed transform → (shared) on shared → add → (final) → return.
Under SP a reduction lands on the rank's own slice (a reduce-scatter); only the shared point can
reduce there, since every method's routed output is already reduced under SP.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from moeshard.runtime.graph import serving_op
from moeshard.moe.config import SharedLayout
from moeshard.moe.context import get_forward_context
from moeshard.moe.dispatch import DISPATCHERS, CommMethod
from moeshard.parallel import state
from moeshard.parallel.layout import Layout


class Point(enum.Enum):
    ROUTED_EARLY = "routed_early"
    SHARED = "shared"
    FINAL = "final"


def already_reduced(method: CommMethod, sp: bool) -> bool:
    """Is the routed output complete (not a partial sum over TP) when `method` returns it? Each
    method declares it: ALLGATHER only under SP; ALLTOALL, MC2 and FUSED_MC2 always."""
    return DISPATCHERS[method].output_is_reduced(sp)


@dataclass(frozen=True)
class ReductionPlan:
    """Which points exist: static, from the layer's configuration."""

    routed_early: bool
    shared: bool
    final: bool

    @classmethod
    def for_layer(cls, shared_layout: SharedLayout | None, has_transform: bool, layout: Layout) -> "ReductionPlan":
        routed_early = shared_layout is SharedLayout.DATA_PARALLEL or (
            has_transform and not layout.sp and (layout.tp > 1 or layout.ep_size > 1)
        )
        return cls(
            routed_early=routed_early,
            shared=shared_layout is SharedLayout.TENSOR_PARALLEL,
            final=not layout.sp and not routed_early,
        )


def reduces_now(point: Point, method: CommMethod, sp: bool, routed_early: bool) -> bool:
    """Does an existing `point` all-reduce under the live `method`? (`routed_early`: that point exists.)"""
    reduced = already_reduced(method, sp)
    if point is Point.SHARED:
        return routed_early or reduced
    return not reduced


def reduce_over_tp(x: torch.Tensor, sp: bool) -> torch.Tensor:
    tp_group = state.get_parallel_state().tp_group
    return state.reduce_scatter(x, tp_group) if sp else state.all_reduce(x, tp_group)


@serving_op("moeshard::maybe_reduce")
def maybe_reduce(x: torch.Tensor, point: str, routed_early: bool, sp: bool) -> torch.Tensor:
    """Reduce `x` over TP at `point` if the live method requires it; otherwise return a copy."""
    if reduces_now(Point(point), get_forward_context().method, sp, routed_early):
        return reduce_over_tp(x, sp)
    return x.clone()


@maybe_reduce.register_fake
def _(x, point, routed_early, sp):
    if sp and point == Point.SHARED.value:  # the shared point always reduces under SP
        return x.new_empty((x.shape[0] // state.get_parallel_state().layout.tp, *x.shape[1:]))
    return torch.empty_like(x)


def reduce_at(x: torch.Tensor, point: Point, plan: ReductionPlan, sp: bool) -> torch.Tensor:
    """Insert `point` into the graph (the caller checked that it exists)."""
    return maybe_reduce(x, point.value, plan.routed_early, sp)
