"""MC2: ALLTOALL's semantics with fixed-capacity masked buffers.

Every destination rank gets C = R·K slots from every source (enough for all of a rank's pairs to go
to one owner), so every shape depends only on the padded batch: no host sync on split sizes, and
the same buffers can be captured in a CUDA graph. Empty slots carry the label L ("not an expert
here") and come back as zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeshard.moe.config import SelectionPolicy
from moeshard.moe.dispatch.base import Dispatched, ExpertParallelDispatcher, Staged, sum_over_topk, unsort
from moeshard.moe.experts import group_by_expert
from moeshard.parallel import state


def mc2_slots(topk_ids_RK: torch.Tensor, owner_E: torch.Tensor, ep_size: int):
    """Each pair's slot in the [W·C] send buffer: its owner's block, then its order among the pairs
    going there. Returns (slot_P, C)."""
    R, K = topk_ids_RK.shape
    capacity = R * K
    dest_P = owner_E[topk_ids_RK.flatten()]
    onehot_PW = F.one_hot(dest_P, ep_size)
    position_P = (onehot_PW.cumsum(0) * onehot_PW).sum(1) - 1
    return dest_P * capacity + position_P, capacity


class MC2Capacity:
    """MC2's buffers are sized for `policy.mc2_capacity` tokens per rank."""

    @classmethod
    def token_capacity(cls, policy: SelectionPolicy) -> int | None:
        return policy.mc2_capacity


class MC2Dispatcher(MC2Capacity, Staged, ExpertParallelDispatcher):
    name = "mc2"
    auto_priority = 2  # static shapes, no host sync: preferred wherever the batch fits

    def dispatch(self, prepared):
        group, W, L = self.parallel.ep_group, self.parallel.layout.ep_size, self.maps.num_local
        x_RD, ids_RK = prepared.x_RD, prepared.topk_ids_RK
        slot_P, capacity = mc2_slots(ids_RK, self.maps.owner_E, W)
        send_x = x_RD.new_zeros((W * capacity, x_RD.shape[1]))
        send_x[slot_P] = x_RD.repeat_interleave(ids_RK.shape[1], dim=0)
        send_labels = torch.full((W * capacity,), L, dtype=torch.int64, device=x_RD.device)
        send_labels[slot_P] = self.maps.local_index_E[ids_RK.flatten()]
        recv_x_MD = state.all_to_all(send_x, group)
        order_M, group_ends_L = group_by_expert(state.all_to_all(send_labels, group), L)
        return Dispatched(recv_x_MD[order_M], group_ends_L, (slot_P, order_M))

    def combine(self, y_MD, dispatched, prepared):
        slot_P, order_M = dispatched.state
        y_back = state.all_to_all(unsort(y_MD, order_M), self.parallel.ep_group)
        return sum_over_topk(y_back[slot_P], prepared.topk_weights_RK)
