"""Functions the spawned ranks run for the tests (importable by name in the child processes)."""

import os
import time

import torch

from moeshard.moe import (
    CommMethod,
    MoEConfig,
    MoELayer,
    MoEWeights,
    RouterConfig,
    SelectionPolicy,
    moe_forward_context,
    reference_moe,
)
from moeshard.parallel import Layout, set_layout
from moeshard.verify.layer import sp_slice


def forced_run(layout: Layout, method: str, tokens: int, capacity: int):
    """Run a small layer with `method` forced; raises whatever the layer raises."""
    set_layout(layout)
    cfg = MoEConfig(hidden=16, num_experts=4, intermediate=8)
    layer = MoELayer(cfg, MoEWeights.random(cfg))
    x = torch.randn(tokens, 16)
    with moe_forward_context(tokens, SelectionPolicy(mc2_capacity=capacity), CommMethod.parse(method)):
        return layer(x).shape


def die_in_collective(dying_rank: int):
    if torch.distributed.get_rank() == dying_rank:
        time.sleep(0.5)
        os._exit(3)
    torch.distributed.all_reduce(torch.ones(1))  # waits for a peer that never comes


def raise_everywhere():
    raise ValueError(f"bad input seen on rank {torch.distributed.get_rank()}")


def rank_of_process():
    return torch.distributed.get_rank()


def property_case(layout: Layout, num_experts: int, top_k: int, tokens_per_dp: list[int], routing: str, method: str, seed: int):
    """One example: a layer on `layout` vs. the reference. Returns (max |err|, max |ref|) on this rank.

    routing: "learned" (random router), "one_expert" (every token's top-1 is expert E-1 and the rest
    are the next ones down), "one_rank" (every token's experts all live on the last EP rank).
    """
    parallel = set_layout(layout)
    router = RouterConfig(top_k=top_k, scoring="sigmoid" if routing != "learned" else "softmax", score_bias=routing != "learned")
    cfg = MoEConfig(hidden=16, num_experts=num_experts, intermediate=8, router=router, shared_intermediate=8 * layout.tp)
    weights = MoEWeights.random(cfg, seed=seed)
    if routing != "learned":
        # Zero logits make every sigmoid score 0.5; the bias alone then picks the experts.
        weights.router_ED.zero_()
        bias = torch.zeros(num_experts)
        if routing == "one_expert":
            bias[num_experts - top_k :] = torch.arange(1, top_k + 1, dtype=torch.float32)
        else:
            L = num_experts // layout.ep_size
            bias[num_experts - L :] = torch.arange(1, L + 1, dtype=torch.float32)
        weights.score_bias_E = bias
    layer = MoELayer(cfg, weights)
    g = torch.Generator().manual_seed(seed)
    batches = [torch.randn(t, cfg.hidden, generator=g) for t in tokens_per_dp]
    x_TD = batches[parallel.dp_rank]
    ref_TD = reference_moe(x_TD, cfg, weights)
    real = x_TD.shape[0]
    if layout.sp:
        x_TD, real = sp_slice(x_TD, layout.tp, parallel.tp_rank)
        ref_TD, _ = sp_slice(ref_TD, layout.tp, parallel.tp_rank)
    force = CommMethod.parse(method)
    # auto: a capacity inside the drawn token counts, so both MC2 and ALLTOALL get chosen.
    policy = SelectionPolicy(mc2_capacity=4 if force is None else 1 << 20)
    with moe_forward_context(x_TD.shape[0], policy, force) as ctx:
        y_TD = layer(x_TD)
    assert y_TD.shape == x_TD.shape
    err = (y_TD[:real] - ref_TD[:real]).abs().max().item() if real else 0.0
    scale = ref_TD[:real].abs().max().item() if real else 0.0
    return err, scale, ctx.method.value
