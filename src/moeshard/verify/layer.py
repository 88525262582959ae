"""`moeshard verify layer`: the parity matrix of the MoE layer against the single-device reference.

A *group* fixes everything a compiled graph depends on (layout, shared experts, transform, router);
a *case* adds the method and eager/compiled. Each group's layer is compiled once, while the first
method is live, and then run with every method live — so every compiled row is also a replay of a
graph traced under another method. Every case runs two batches: a decode-sized one (uneven across
DP, one DP group empty where there are several) and a prefill-sized one; with method `auto` the
policy's MC2 capacity sits between them, so both MC2 and ALLTOALL are chosen.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import asdict, dataclass

import torch
from torch import nn

from moeshard.runtime.graph import compile_for_serving
from moeshard.moe import (
    CommMethod,
    MoEConfig,
    MoELayer,
    MoEWeights,
    RouterConfig,
    SelectionPolicy,
    SharedLayout,
    moe_forward_context,
    reference_moe,
)
from moeshard.parallel import Layout, RankError, open_ranks, set_layout
from moeshard.parallel.launch import under_torchrun

TOLERANCE = 1e-5  # max |error| / max |reference|, fp32
SHARED_KINDS = ("none", "tp", "dp", "gated")
TRANSFORMS = ("none", "nonlinear")
ROUTERS = ("softmax_topk", "grouped_sigmoid")
AUTO_POLICY = SelectionPolicy(mc2_capacity=8)
FORCED_POLICY = SelectionPolicy(mc2_capacity=1 << 20)
DECODE_TOKENS = (5, 0, 3, 7)  # per DP group, cycled
PREFILL_TOKENS = (41, 37, 50, 33)


class RMSNormTransform(nn.Module):
    """A routed transform that is wrong on a partial sum: it must see the complete routed output."""

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return x_TD * torch.rsqrt(x_TD.pow(2).mean(-1, keepdim=True) + 1e-6)


@dataclass(frozen=True)
class Group:
    layout: Layout
    shared: str
    transform: str
    router: str

    def config(self) -> MoEConfig:
        router = (
            RouterConfig(top_k=2, scoring="softmax", renormalize=True)
            if self.router == "softmax_topk"
            else RouterConfig(top_k=3, scoring="sigmoid", n_group=4, topk_group=2, score_bias=True, routed_scaling=2.5)
        )
        return MoEConfig(
            hidden=64,
            num_experts=8,
            intermediate=32,
            router=router,
            shared_intermediate=0 if self.shared == "none" else 64,
            shared_gate=self.shared == "gated",
            shared_layout=SharedLayout.DATA_PARALLEL if self.shared == "dp" else SharedLayout.TENSOR_PARALLEL,
        )

    def methods(self) -> list[str]:
        runnable = self.layout.ep or self.layout.world_size == 1
        return ["auto", "allgather"] + (["alltoall", "mc2", "fused_mc2"] if runnable else [])


@dataclass
class CaseResult:
    method: str
    tp: int
    dp: int
    ep: bool
    sp: bool
    shared: str
    transform: str
    router: str
    compiled: bool
    max_abs_err: float
    passed: bool
    rel_err: float = 0.0
    error: str = ""

    def to_json(self) -> dict:
        row = asdict(self)
        del row["rel_err"], row["error"]
        return row


def layouts_for(world_size: int) -> list[Layout]:
    """TP only, DP only and DP×TP splits of `world_size`, EP on/off, SP on/off where TP > 1."""
    out = []
    for tp in (t for t in range(world_size, 0, -1) if world_size % t == 0):
        for ep, sp in itertools.product((True, False), (False, True)):
            if sp and tp == 1:
                continue
            out.append(Layout(tp=tp, dp=world_size // tp, ep=ep, sp=sp))
    return out


def groups_for(world_size: int, alternate_routers: bool = False) -> list[Group]:
    """Every layout × shared kind × transform, each with every router; or (`alternate_routers`, half
    the groups) with one router, alternating, so that each router still meets every pair of layout,
    shared kind and transform."""
    groups = []
    for i, layout in enumerate(layouts_for(world_size)):
        for j, shared in enumerate(SHARED_KINDS):
            for k, transform in enumerate(TRANSFORMS):
                routers = [ROUTERS[(i + j + k) % 2]] if alternate_routers else ROUTERS
                groups += [Group(layout, shared, transform, router) for router in routers]
    return groups


def batch_for(layout: Layout, dp_rank: int, sizes: tuple[int, ...], hidden: int, seed: int) -> torch.Tensor:
    tokens = sizes[dp_rank % len(sizes)] if layout.dp > 1 else max(sizes[0], 1)
    g = torch.Generator().manual_seed(seed * 1000 + dp_rank)
    return torch.randn(tokens, hidden, generator=g)


def sp_slice(x_TD: torch.Tensor, tp: int, tp_rank: int) -> tuple[torch.Tensor, int]:
    """This TP rank's padded SP slice of the DP group's rows, and how many of its rows are real."""
    rows = -(-x_TD.shape[0] // tp)
    start = tp_rank * rows
    real = max(0, min(rows, x_TD.shape[0] - start))
    padded = torch.nn.functional.pad(x_TD, (0, 0, 0, rows * tp - x_TD.shape[0]))
    return padded[start : start + rows], real


@dataclass
class Built:
    """One rank's view of a group: its layer inputs and the reference rows they must produce."""

    cfg: MoEConfig
    weights: MoEWeights
    transform: nn.Module | None
    batches: list[tuple[torch.Tensor, torch.Tensor, int]]  # (x_TD, reference rows, real rows)

    def layer(self, layer_cls: type[MoELayer] = MoELayer) -> MoELayer:
        return layer_cls(self.cfg, self.weights, transform=self.transform)


def build(group: Group, seed: int) -> Built:
    """Make `group`'s layout current and build this rank's inputs and reference outputs.

    Prefill comes first: a compiled layer is traced on its first call, and Dynamo would specialise
    a dimension of 0 or 1 rows (the decode sizes include an empty DP group).
    """
    parallel = set_layout(group.layout)
    cfg = group.config()
    weights = MoEWeights.random(cfg, seed=seed)
    transform = RMSNormTransform() if group.transform == "nonlinear" else None
    batches = []
    for i, sizes in enumerate((PREFILL_TOKENS, DECODE_TOKENS)):
        x_TD = batch_for(group.layout, parallel.dp_rank, sizes, cfg.hidden, seed + i)
        ref_TD = reference_moe(x_TD, cfg, weights, transform)
        real = x_TD.shape[0]
        if group.layout.sp:
            x_TD, real = sp_slice(x_TD, group.layout.tp, parallel.tp_rank)
            ref_TD, _ = sp_slice(ref_TD, group.layout.tp, parallel.tp_rank)
        batches.append((x_TD, ref_TD[:real], real))
    return Built(cfg, weights, transform, batches)


def case_error(forward, built: Built, method: str) -> tuple[float, float]:
    """Run every batch with `method` live; return (max |error|, max |reference|) on this rank."""
    force = CommMethod.parse(method)
    policy = AUTO_POLICY if force is None else FORCED_POLICY
    err = scale = 0.0
    for x_TD, ref_TD, real in built.batches:
        with moe_forward_context(x_TD.shape[0], policy, force):
            y_TD = forward(x_TD)[:real]
        if real:
            err = max(err, (y_TD - ref_TD).abs().max().item())
            scale = max(scale, ref_TD.abs().max().item())
    return err, scale


def run_group(group: Group, seed: int, backend: str = "aot_eager") -> list[tuple[str, bool, float, float]]:
    """On one rank: every case of `group`. Returns (method, compiled, max |err|, max |ref|) per case.

    The compiled layer is traced once, under the first method; every later method replays it
    (a recompile would raise).
    """
    built = build(group, seed)
    results = []
    for compiled in (False, True):
        layer = built.layer()
        forward = compile_for_serving(layer, backend) if compiled else layer
        try:
            for i, method in enumerate(group.methods()):
                results.append((method, compiled, *case_error(forward, built, method)))
                if compiled and i == 0:
                    torch.compiler.set_stance("fail_on_recompile")
        finally:
            torch.compiler.set_stance("default")
    return results


def merge(group: Group, per_rank: list[list[tuple[str, bool, float, float]]]) -> list[CaseResult]:
    """Combine the ranks' errors: a case's error is its worst rank's, relative to the largest output."""
    rows = []
    for cases in zip(*per_rank):
        method, compiled = cases[0][0], cases[0][1]
        err = max(c[2] for c in cases)
        scale = max(max(c[3] for c in cases), 1e-30)
        layout = group.layout
        rows.append(
            CaseResult(
                method, layout.tp, layout.dp, layout.ep, layout.sp, group.shared, group.transform, group.router,
                compiled, err, err / scale <= TOLERANCE, err / scale,
            )
        )
    return rows


def failed_group(group: Group, message: str) -> list[CaseResult]:
    layout = group.layout
    return [
        CaseResult(m, layout.tp, layout.dp, layout.ep, layout.sp, group.shared, group.transform, group.router,
                   compiled, float("nan"), False, float("nan"), message)
        for compiled in (False, True)
        for m in group.methods()
    ]


def world_sizes_to_run(requested: list[int]) -> list[int]:
    """The requested world sizes (under torchrun: the one it started), refused unless the matrix's
    experts split evenly over each."""
    world_sizes = [int(os.environ["WORLD_SIZE"])] if under_torchrun() else requested
    num_experts = Group(Layout(), "none", "none", ROUTERS[0]).config().num_experts
    for world_size in world_sizes:
        Layout(dp=world_size, ep=True).validate(num_experts=num_experts)
    return world_sizes


def run_matrix(
    world_sizes: list[int], seed: int = 0, on_group=None, alternate_routers: bool = False
) -> list[CaseResult]:
    """Every group of every world size (`groups_for`); `on_group(group, rows)` is called as each finishes."""
    rows: list[CaseResult] = []
    for world_size in world_sizes:
        ranks = open_ranks(world_size)
        try:
            for i, group in enumerate(groups_for(world_size, alternate_routers)):
                try:
                    group_rows = merge(group, ranks.run(run_group, group, seed + i))
                except RankError as exc:
                    group_rows = failed_group(group, str(exc))
                    if not ranks.alive:
                        ranks = open_ranks(world_size)
                rows += group_rows
                if on_group is not None:
                    on_group(group, group_rows)
        finally:
            ranks.close()
    return rows
