"""The negative control: an MoE layer that decides its reductions in Python from the live method.

This is the first seed's bug. Eagerly it is correct, because the Python branch runs every forward.
Compiled once, the branch is evaluated while tracing and frozen into the graph, so a graph traced
under one method and replayed under another reduces twice or not at all. The replay check runs it
beside the real layer to show that the check catches exactly this.
"""

from __future__ import annotations

import torch

from moeshard.moe.context import get_forward_context
from moeshard.moe.layer import MoELayer
from moeshard.moe.reduce import Point, reduces_now
from moeshard.parallel import ops


class NaiveMoELayer(MoELayer):
    def reduce(self, x: torch.Tensor, point: Point) -> torch.Tensor:
        sp = self.parallel.layout.sp
        if reduces_now(point, get_forward_context().method, sp, self.plan.routed_early):
            return ops.tp_reduce_scatter(x) if sp else ops.tp_all_reduce(x)
        return x
