"""The oracle: a single-process MoE forward on the full weights, written plainly.

Each expert is applied to the tokens routed to it by index; nothing here is shared with the
sharded path except the router (tested against transformers' routers on its own).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from moeshard.moe.config import MoEConfig
from moeshard.moe.router import route
from moeshard.moe.weights import MoEWeights


def swiglu(x_TD: torch.Tensor, gate_up_FD: torch.Tensor, down_DI: torch.Tensor) -> torch.Tensor:
    gate_TI, up_TI = F.linear(x_TD, gate_up_FD).chunk(2, dim=-1)
    return F.linear(F.silu(gate_TI) * up_TI, down_DI)


def reference_moe(
    x_TD: torch.Tensor,
    cfg: MoEConfig,
    weights: MoEWeights,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    w = weights.to(x_TD.dtype, x_TD.device)
    topk_ids_TK, topk_weights_TK = route(x_TD.float() @ w.router_ED.float().T, cfg.router, w.score_bias_E)
    routed_TD = torch.zeros_like(x_TD)
    for e in range(cfg.num_experts):
        token_N, slot_N = (topk_ids_TK == e).nonzero(as_tuple=True)
        if token_N.numel():
            y_ND = swiglu(x_TD[token_N], w.gate_up_EFD[e], w.down_EDI[e])
            routed_TD.index_add_(0, token_N, y_ND * topk_weights_TK[token_N, slot_N, None].to(x_TD.dtype))
    if transform is not None:
        routed_TD = transform(routed_TD)
    if not cfg.has_shared:
        return routed_TD
    shared_TD = swiglu(x_TD, w.shared_gate_up_FD, w.shared_down_DI)
    if w.shared_gate_1D is not None:
        shared_TD = shared_TD * torch.sigmoid(F.linear(x_TD, w.shared_gate_1D))
    return shared_TD + routed_TD
