"""FUSED_MC2: MC2 with dispatch, expert FFN and combine as one opaque op.

Each slot's row and its expert label travel as one packed byte row, so one exchange goes out and
one comes back (MC2 needs two out). The op is a `torch.library` custom op: compiled graphs see a
single call, and a device kernel can replace its implementation without touching the layer.
"""

from __future__ import annotations

import torch

from moeshard.runtime.graph import serving_op
from moeshard.moe.config import SelectionPolicy
from moeshard.moe.dispatch.base import ExpertParallelDispatcher, sum_over_topk, unsort
from moeshard.moe.dispatch.mc2 import MC2Capacity, mc2_slots
from moeshard.moe.experts import group_by_expert, grouped_swiglu
from moeshard.parallel import state


@serving_op("moeshard::fused_mc2")
def fused_mc2(
    x_RD: torch.Tensor,
    topk_ids_RK: torch.Tensor,
    topk_weights_RK: torch.Tensor,
    w13_LFD: torch.Tensor,
    w2_LDI: torch.Tensor,
    owner_E: torch.Tensor,
    local_index_E: torch.Tensor,
    packed: bool,
) -> torch.Tensor:
    parallel = state.get_parallel_state()
    group, W, L = parallel.ep_group, parallel.layout.ep_size, w13_LFD.shape[0]
    D, K = x_RD.shape[1], topk_ids_RK.shape[1]
    slot_P, capacity = mc2_slots(topk_ids_RK, owner_E, W)
    row_bytes = D * x_RD.element_size()
    send = torch.empty((W * capacity, row_bytes + 4), dtype=torch.uint8, device=x_RD.device)
    send[:, :row_bytes] = 0
    send[:, row_bytes:] = torch.full((W * capacity, 1), L, dtype=torch.int32, device=x_RD.device).view(torch.uint8)
    send[slot_P, :row_bytes] = x_RD.repeat_interleave(K, dim=0).view(torch.uint8)
    labels_P1 = local_index_E[topk_ids_RK.flatten()].to(torch.int32).unsqueeze(1)
    send[slot_P, row_bytes:] = labels_P1.view(torch.uint8)
    recv = state.all_to_all(send, group)
    recv_x_MD = recv[:, :row_bytes].contiguous().view(x_RD.dtype)
    labels_M = recv[:, row_bytes:].contiguous().view(torch.int32).flatten().long()
    order_M, group_ends_L = group_by_expert(labels_M, L)
    y_MD = grouped_swiglu(recv_x_MD[order_M], w13_LFD, w2_LDI, group_ends_L, packed)
    y_back = state.all_to_all(unsort(y_MD, order_M), group)
    return sum_over_topk(y_back[slot_P], topk_weights_RK)


@fused_mc2.register_fake
def _(x_RD, topk_ids_RK, topk_weights_RK, w13_LFD, w2_LDI, owner_E, local_index_E, packed):
    return x_RD.new_empty(x_RD.shape)


class FusedMC2Dispatcher(MC2Capacity, ExpertParallelDispatcher):
    name = "fused_mc2"
    auto_priority = 3  # where MC2 fits and the policy opts in

    @classmethod
    def auto_enabled(cls, policy: SelectionPolicy) -> bool:
        return policy.fused_mc2

    def routed(self, prepared, experts):
        return fused_mc2(
            prepared.x_RD,
            prepared.topk_ids_RK,
            prepared.topk_weights_RK,
            experts.w13_LFD,
            experts.w2_LDI,
            self.maps.owner_E,
            self.maps.local_index_E,
            experts.packed,
        )
