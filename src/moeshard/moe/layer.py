"""The expert-parallel MoE layer: router → routed experts (live method) → reductions → shared add.

    y = final( shared_point(S(x)) + transform( routed_early( routed(x) ) ) )

`routed(x)` is the custom op `moeshard::routed_experts`: its real implementation reads the live
method from the forward context and runs that method's dispatcher, so one compiled graph serves
every method. The reduction points are inserted by the static plan and decide at run time whether
to reduce (moeshard.moe.reduce).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable

import torch
from torch import nn

from moeshard.kernels import packed
from moeshard.kernels.quant import QuantFormat
from moeshard.runtime import invariance
from moeshard.runtime.graph import serving_op
from moeshard.moe.config import MoEConfig
from moeshard.moe.context import get_forward_context
from moeshard.moe.dispatch import DISPATCHERS
from moeshard.moe.experts import GroupedExperts
from moeshard.moe.reduce import Point, ReductionPlan, reduce_at
from moeshard.moe.router import Router
from moeshard.moe.shared import SharedExperts
from moeshard.moe.weights import MoEShard, MoEWeights, RankShard
from moeshard.parallel.state import get_parallel_state

# Custom ops find their layer by name (a string survives tracing; a module reference does not).
_LAYERS: "weakref.WeakValueDictionary[str, MoELayer]" = weakref.WeakValueDictionary()
_unnamed = itertools.count()


def get_layer(name: str) -> "MoELayer":
    return _LAYERS[name]


class MoELayer(nn.Module):
    """One MoE layer on this rank, for the current parallel layout.

    Input and output: [T, D] — the DP group's rows (replicated over TP), or under SP this rank's
    slice. The output is complete (every partial sum reduced exactly once).

    The parameters are this rank's slices (see RankShard), allocated from `cfg`: with `weights`
    (full MoEWeights) its slices are copied in; with None they are left for a model's loader.
    """

    def __init__(
        self,
        cfg: MoEConfig,
        weights: MoEWeights | None,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        dtype: torch.dtype = torch.float32,
        name: str | None = None,
        formats: tuple[QuantFormat | None, QuantFormat | None] = (None, None),
    ):
        """`formats`: the routed and the shared experts' quantized format, or None (kernels/quant.py)."""
        super().__init__()
        self.cfg = cfg.validate()
        self.parallel = parallel = get_parallel_state()
        layout = parallel.layout
        layout.validate(
            num_experts=cfg.num_experts, intermediate=cfg.intermediate, shared_intermediate=cfg.shared_intermediate
        )
        self.name = name or f"moe.{next(_unnamed)}"
        if self.name in _LAYERS:
            raise ValueError(f"an MoE layer named {self.name!r} already exists; layer names must be unique.")
        _LAYERS[self.name] = self
        self.dtype = dtype
        shard, device = RankShard.of(cfg, parallel), parallel.device
        self.router = Router(cfg.router, cfg.num_experts, cfg.hidden, device)
        self.invariant = invariance.batch_invariant()
        routed_fmt, shared_fmt = formats
        self.experts = GroupedExperts(len(shard.experts), cfg.hidden, cfg.intermediate // shard.parts, dtype, device, routed_fmt)
        self.shared = SharedExperts(cfg, shard, parallel, dtype, shared_fmt) if cfg.has_shared else None
        if weights is not None:
            self.copy_in(weights.shard(shard))
        self.transform = transform
        # The load metric: where this rank's real tokens were routed. TP ranks route the same rows
        # (unless SP splits them), so one of them counts.
        self.experts_per_rank = cfg.num_experts // layout.ep_size
        self.counts_routing = layout.sp or parallel.tp_rank == 0
        self.routed_W = torch.zeros(layout.ep_size, dtype=torch.int64, device=device)
        self.plan = ReductionPlan.for_layer(cfg.shared_layout if cfg.has_shared else None, transform is not None, layout)
        self.dispatchers = {
            method: cls(cfg.num_experts, parallel)
            for method, cls in DISPATCHERS.items()
            if not cls.needs_ep or layout.ep or layout.world_size == 1
        }

    def shard_params(self) -> dict[str, nn.Parameter | None]:
        """The parameter holding each MoEShard field (None where this layer holds none)."""
        shared = self.shared
        return dict(
            router_ED=self.router.weight_ED,
            gate_up_LFD=self.experts.w13_LFD,
            down_LDI=self.experts.w2_LDI,
            score_bias_E=self.router.score_bias_E,
            shared_gate_up_FD=None if shared is None else shared.gate_up_FD,
            shared_down_DI=None if shared is None else shared.down_DI,
            shared_gate_1D=None if shared is None else shared.gate_1D,
        )

    def copy_in(self, shard: MoEShard) -> None:
        """Write this rank's slices into the parameters (converted to their dtype and device)."""
        for name, param in self.shard_params().items():
            t = getattr(shard, name)
            if (param is None) != (t is None) or (t is not None and tuple(t.shape) != param.weight_layout.shape):
                expected = "no tensor" if param is None else f"shape {list(param.weight_layout.shape)}"
                got = "none" if t is None else f"shape {list(t.shape)}"
                raise ValueError(f"MoE layer {self.name!r}: {name} is {got}, but the config implies {expected}.")
            if param is not None:
                packed.assign(param, t)

    def check_input(self, x_TD: torch.Tensor) -> None:
        if x_TD.dim() != 2 or x_TD.shape[1] != self.cfg.hidden or x_TD.dtype != self.dtype:
            raise ValueError(
                f"MoE layer {self.name!r} takes a [tokens, {self.cfg.hidden}] tensor of {self.dtype}, "
                f"got shape {tuple(x_TD.shape)} of {x_TD.dtype}."
            )

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        self.check_input(x_TD)
        if self.invariant:
            topk_ids_TK, topk_weights_TK = fixed_route(x_TD, self.name)
        else:
            topk_ids_TK, topk_weights_TK = self.router(x_TD)
        routed_TD = routed_experts(x_TD, topk_ids_TK, topk_weights_TK, self.name)
        if self.plan.routed_early:
            routed_TD = self.reduce(routed_TD, Point.ROUTED_EARLY)
        if self.transform is not None:
            routed_TD = self.transform(routed_TD)
        out_TD = routed_TD
        if self.shared is not None:
            shared_TD = self.shared(x_TD)
            if self.plan.shared:
                shared_TD = self.reduce(shared_TD, Point.SHARED)
            out_TD = shared_TD + routed_TD
        if self.plan.final:
            out_TD = self.reduce(out_TD, Point.FINAL)
        return out_TD

    def reduce(self, x: torch.Tensor, point: Point) -> torch.Tensor:
        return reduce_at(x, point, self.plan, self.parallel.layout.sp)


@serving_op("moeshard::fixed_route")
def fixed_route(x_TD: torch.Tensor, layer_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The router, as one opaque call: in batch-invariant mode its softmax, top-k and sums run as
    eager torch computes them (per row), never as a compiler re-derives them."""
    return get_layer(layer_name).router(x_TD)


@fixed_route.register_fake
def _(x_TD, layer_name):
    K = get_layer(layer_name).cfg.router.top_k
    return x_TD.new_empty((x_TD.shape[0], K), dtype=torch.int64), x_TD.new_empty((x_TD.shape[0], K), dtype=torch.float32)


@serving_op("moeshard::routed_experts")
def routed_experts(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, layer_name: str) -> torch.Tensor:
    """Dispatch → experts → combine with the method live in this forward's context (recording the
    routing where the context asks: this op runs eagerly even inside a compiled graph)."""
    layer = get_layer(layer_name)
    ctx = get_forward_context()
    if ctx.routing is not None:
        ctx.routing.append(topk_ids_TK.clone())  # a compiled graph may reuse the buffer after this op
    if layer.counts_routing:
        ep_rank_P = topk_ids_TK[: ctx.real_rows].flatten() // layer.experts_per_rank
        layer.routed_W += torch.bincount(ep_rank_P, minlength=layer.routed_W.numel())
    return layer.dispatchers[ctx.method].run(x_TD, topk_ids_TK, topk_weights_TK, layer.experts, ctx.num_tokens)


@routed_experts.register_fake
def _(x_TD, topk_ids_TK, topk_weights_TK, layer_name):
    return torch.empty_like(x_TD)
