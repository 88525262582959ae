"""ALLGATHER: gather every token to every rank, compute the local experts, reduce-scatter back.

The gather group is the set of ranks whose tokens differ while their experts (or expert shards)
are disjoint:
    EP on,  no SP: the DP group (one rank per DP group with this tp_rank) — output partial over TP
    EP on,  SP:    the whole EP group                                      — output complete
    EP off, no SP: none: rows are already replicated over TP               — output partial over TP
    EP off, SP:    the TP group                                            — output complete

In batch-invariant mode with EP on, what travels back is each (token, expert) pair's output, not
each rank's partial sum over its experts: a pair is computed on one rank only, so the cross-rank
sums add zeros (exact), and each token then sums its K pairs in k order on its own rank, as the
other methods do. The output is then complete (reduced over TP too), and equal to theirs bit for bit.
"""

from __future__ import annotations

from moeshard.moe.dispatch.base import Dispatched, Prepared, Staged, TokenDispatcher, pad_routing, sum_over_topk, unsort
from moeshard.moe.experts import group_by_expert, zero_rows_past_groups_
from moeshard.parallel import state
from moeshard.runtime import invariance


class AllGatherDispatcher(Staged, TokenDispatcher):
    name = "allgather"
    needs_ep = False  # the only method for EP off; with EP on, selection prefers the others

    def __init__(self, num_experts, parallel):
        super().__init__(num_experts, parallel)
        layout = parallel.layout
        if layout.sp:
            self.group = parallel.ep_group if layout.ep else parallel.tp_group
        else:
            self.group = parallel.dp_group if layout.ep else None
        self.pairs_travel = layout.ep and invariance.batch_invariant()
        self.member = parallel.ep_rank if layout.sp else parallel.dp_rank  # this rank's place in the group

    @classmethod
    def output_is_reduced(cls, sp):
        # Without SP each TP rank computes every row with its slice of the experts: a partial sum,
        # unless the pairs travel (batch-invariant mode, EP on: see the module docstring).
        return sp or (invariance.batch_invariant() and state.get_parallel_state().layout.ep)

    def prepare(self, x_TD, topk_ids_TK, topk_weights_TK, num_tokens):
        padded = pad_routing(x_TD, topk_ids_TK, topk_weights_TK, num_tokens)
        if self.group is not None:
            padded = tuple(state.all_gather(tensor, self.group) for tensor in padded)
        return Prepared(*padded, input_rows=x_TD.shape[0])

    def dispatch(self, prepared):
        K = prepared.topk_ids_RK.shape[1]
        labels_P = self.maps.label_E[prepared.topk_ids_RK.flatten()]
        order_P, group_ends_L = group_by_expert(labels_P, self.maps.num_local)
        return Dispatched(prepared.x_RD[order_P // K], group_ends_L, order_P)

    def combine(self, y_MD, dispatched, prepared):
        if self.maps.num_local < self.num_experts:
            # Pairs whose expert lives elsewhere were not computed here: they add zeros.
            zero_rows_past_groups_(y_MD, dispatched.group_ends_L)
        y_PD = unsort(y_MD, dispatched.state)
        return y_PD if self.pairs_travel else sum_over_topk(y_PD, prepared.topk_weights_RK)

    def finalize(self, y_RD, prepared):
        """y_RD: prepared rows' sums (or, when pairs travel, their pairs) → this rank's rows'."""
        if self.group is not None:
            y_RD = state.reduce_scatter(y_RD, self.group)
        if self.pairs_travel:
            parallel, rows = self.parallel, y_RD.shape[0] // prepared.topk_ids_RK.shape[1]
            if not parallel.layout.sp:
                y_RD = state.all_reduce(y_RD, parallel.tp_group)
            mine = slice(self.member * rows, (self.member + 1) * rows) if self.group is not None else slice(None)
            y_RD = sum_over_topk(y_RD, prepared.topk_weights_RK[mine])
        return y_RD[: prepared.input_rows]
