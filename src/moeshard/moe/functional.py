"""Row-wise helpers that the routed path, the shared experts and the dense MLP all use."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeshard import kernels
from moeshard.runtime import invariance
from moeshard.runtime.graph import serving_op


def swiglu(x_TD: torch.Tensor, gate_up_FD: torch.Tensor, down_DI: torch.Tensor, packed: bool = False) -> torch.Tensor:
    """`down(silu(gate(x)) * up(x))`, gate rows before up rows; the weights in [out, in] layout, or
    with `packed` stored as moeshard.kernels' panels (kernels.packed.for_swiglu)."""
    if packed:
        return kernels.swiglu(x_TD, gate_up_FD, down_DI)
    gate_TI, up_TI = F.linear(x_TD, gate_up_FD).chunk(2, dim=-1)
    return F.linear(F.silu(gate_TI) * up_TI, down_DI)


def pad_rows(x_TD: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero rows appended up to `rows`."""
    return F.pad(x_TD, (0, 0, 0, rows - x_TD.shape[0]))


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """`torch.sigmoid`; in batch-invariant mode `fixed_sigmoid`."""
    return fixed_sigmoid(x) if invariance.batch_invariant() else torch.sigmoid(x)


@serving_op("moeshard::fixed_sigmoid")
def fixed_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """`1 / (1 + exp(-x))`, as one opaque call: torch's CPU sigmoid rounds differently in its vector
    loop and in its scalar tail, so an element's value would follow its place in the batch (its exp
    does not), and a compiler's own exp rounds differently from eager's."""
    return 1 / (1 + torch.exp(-x))


@fixed_sigmoid.register_fake
def _(x):
    return torch.empty_like(x)
