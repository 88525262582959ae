"""Shared experts: a dense SwiGLU every token goes through, optionally gated (Qwen2-MoE).

TENSOR_PARALLEL: weights sharded over TP along the intermediate dim; the output is a partial sum
over TP, reduced (or not) by reduction point 2. Under SP the rank's slice is first gathered over TP,
so the partial covers the TP group's rows and point 2 reduce-scatters it back to the slice.
DATA_PARALLEL: weights replicated; each TP rank computes a contiguous slice of the tokens and the
slices are all-gathered, so the output is complete (under SP the rank's slice already is one).
"""

from __future__ import annotations

import torch
from torch import nn

from moeshard.moe.config import MoEConfig, SharedLayout
from moeshard import kernels
from moeshard.kernels import packed
from moeshard.kernels.quant import QuantFormat
from moeshard.moe.functional import pad_rows, sigmoid, swiglu
from moeshard.moe.weights import RankShard, empty_param
from moeshard.parallel import ops
from moeshard.parallel.state import ParallelState
from moeshard.runtime import invariance


class SharedExperts(nn.Module):
    """Allocated empty (this rank's part, see RankShard); filled by the MoE layer or a loader."""

    def __init__(self, cfg: MoEConfig, shard: RankShard, parallel: ParallelState, dtype: torch.dtype,
                 fmt: QuantFormat | None = None):
        super().__init__()
        self.layout = cfg.shared_layout
        self.tp, self.tp_rank, self.sp = parallel.layout.tp, parallel.tp_rank, parallel.layout.sp
        D, S, device = cfg.hidden, cfg.shared_intermediate // shard.shared_parts, parallel.device
        gate_up, down = packed.for_swiglu((2 * S, D), (D, S), dtype, device, "the shared experts", fmt)
        self.gate_up_FD, self.down_DI = empty_param((2 * S, D), dtype, device, gate_up), empty_param((D, S), dtype, device, down)
        self.packed = gate_up.served
        self.gate_1D, self.gate_packed = None, False
        if cfg.shared_gate:  # on the kernels in batch-invariant mode only: see moeshard.moe.router
            gate = packed.for_linear((1, D), dtype, device, "the shared experts' gate") if invariance.batch_invariant() else None
            self.gate_1D, self.gate_packed = empty_param((1, D), dtype, device, gate), gate is not None

    def mlp(self, x_TD: torch.Tensor) -> torch.Tensor:
        y_TD = swiglu(x_TD, packed.operand(self.gate_up_FD), packed.operand(self.down_DI), self.packed)
        if self.gate_1D is not None:
            # A per-token scalar, so it may multiply a partial sum before the reduction.
            if self.gate_packed:
                gate_T1 = kernels.linear(x_TD, self.gate_1D, 1)
            else:
                gate_T1 = x_TD @ self.gate_1D.T
            y_TD = y_TD * sigmoid(gate_T1)
        return y_TD

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        if self.layout is SharedLayout.TENSOR_PARALLEL:
            return self.mlp(ops.tp_all_gather(x_TD) if self.sp and self.tp > 1 else x_TD)
        if self.sp or self.tp == 1:
            return self.mlp(x_TD)
        T = x_TD.shape[0]
        rows = (T + self.tp - 1) // self.tp
        mine_RD = pad_rows(x_TD, rows * self.tp)[self.tp_rank * rows : (self.tp_rank + 1) * rows]
        return ops.tp_all_gather(self.mlp(mine_RD))[:T]
