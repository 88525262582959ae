"""Row-wise helpers that the routed path, the shared experts and the dense MLP all use."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeshard import kernels


def swiglu(x_TD: torch.Tensor, gate_up_FD: torch.Tensor, down_DI: torch.Tensor, packed=None) -> torch.Tensor:
    """`down(silu(gate(x)) * up(x))`, weights in [out, in] layout, gate rows before up rows;
    `packed`: (gate-up, down) packed for moeshard.kernels, where they serve these weights."""
    if packed is not None and packed[0] is not None:
        return kernels.swiglu(x_TD, *packed)
    gate_TI, up_TI = F.linear(x_TD, gate_up_FD).chunk(2, dim=-1)
    return F.linear(F.silu(gate_TI) * up_TI, down_DI)


def pad_rows(x_TD: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero rows appended up to `rows`."""
    return F.pad(x_TD, (0, 0, 0, rows - x_TD.shape[0]))
