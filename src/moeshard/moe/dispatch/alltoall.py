"""ALLTOALL: each TP rank sends its slice's (token, expert) pairs to the experts' owners with
variable split sizes (one host sync per step to agree on them), the receiver labels what arrives
with the local-expert table and sorts it by local expert (the second permute), and everything goes
back the same way.
"""

from __future__ import annotations

import torch

from moeshard.moe.dispatch.base import Dispatched, ExpertParallelDispatcher, Staged, sum_over_topk, unsort
from moeshard.moe.experts import group_by_expert
from moeshard.parallel import state


class AllToAllDispatcher(Staged, ExpertParallelDispatcher):
    name = "alltoall"
    auto_priority = 1  # any batch size, at the price of a host sync

    def dispatch(self, prepared):
        group, W = self.parallel.ep_group, self.parallel.layout.ep_size
        K = prepared.topk_ids_RK.shape[1]
        ids_P = prepared.topk_ids_RK.flatten()
        # Experts are numbered contiguously per owner, so sorting by expert also sorts by owner.
        order_P = torch.argsort(ids_P, stable=True)
        send_counts_W = torch.bincount(self.maps.owner_E[ids_P], minlength=W)
        recv_counts_W = state.all_to_all(send_counts_W, group)
        send_counts, recv_counts = send_counts_W.tolist(), recv_counts_W.tolist()
        recv_x_MD = state.all_to_all(prepared.x_RD[order_P // K], group, send_counts, recv_counts)
        recv_ids_M = state.all_to_all(ids_P[order_P], group, send_counts, recv_counts)
        labels_M = self.maps.local_index_E[recv_ids_M]
        order_M, group_ends_L = group_by_expert(labels_M, self.maps.num_local)
        return Dispatched(recv_x_MD[order_M], group_ends_L, (order_P, order_M, send_counts, recv_counts))

    def combine(self, y_MD, dispatched, prepared):
        order_P, order_M, send_counts, recv_counts = dispatched.state
        y_back = state.all_to_all(unsort(y_MD, order_M), self.parallel.ep_group, recv_counts, send_counts)
        return sum_over_topk(unsort(y_back, order_P), prepared.topk_weights_RK)
