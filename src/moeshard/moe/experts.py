"""This rank's routed experts, computed grouped: rows arrive sorted by expert, one GEMM per expert.

With EP on, the rank holds L = E / W whole experts; with EP off, all E experts, each sharded along
the intermediate dimension over TP. Either way the computation is the same: a SwiGLU per group of
contiguous rows, via `grouped_mm` where the build and the shapes allow, else one GEMM per slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeshard import kernels
from moeshard.kernels import packed
from moeshard.kernels.quant import QuantFormat
from moeshard.moe.weights import empty_param

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def group_by_expert(labels_M: torch.Tensor, num_groups: int):
    """Order rows by label; labels equal to `num_groups` mean "not computed here" and go last.

    Returns (order_M, group_ends_L): rows `order_M[group_ends_L[l-1]:group_ends_L[l]]` have label l.
    Fixed shapes and no host sync, so it runs the same under CUDA-graph capture.
    """
    order_M = torch.argsort(labels_M, stable=True)
    counts = torch.zeros(num_groups + 1, dtype=torch.int64, device=labels_M.device)
    counts.scatter_add_(0, labels_M, torch.ones_like(labels_M))
    return order_M, counts[:num_groups].cumsum(0).to(torch.int32)


def _grouped_mm_fits(x_MD: torch.Tensor, w: torch.Tensor) -> bool:
    # grouped_mm needs 16-byte aligned row strides and a float type it has kernels for.
    align = 16 // x_MD.element_size()
    return (
        hasattr(F, "grouped_mm")
        and x_MD.dtype in _GROUPED_MM_DTYPES
        and x_MD.shape[-1] % align == 0
        and w.shape[-1] % align == 0
    )


def grouped_linear(x_MD: torch.Tensor, w_LDN: torch.Tensor, group_ends_L: torch.Tensor) -> torch.Tensor:
    """Rows of group l times `w_LDN[l]`; rows past the last group end are left undefined."""
    if _grouped_mm_fits(x_MD, w_LDN):
        return F.grouped_mm(x_MD, w_LDN, offs=group_ends_L)
    out = x_MD.new_empty((x_MD.shape[0], w_LDN.shape[-1]))  # w_LDN may be a transposed view
    start = 0
    for l, end in enumerate(group_ends_L.tolist()):
        torch.matmul(x_MD[start:end], w_LDN[l], out=out[start:end])
        start = end
    return out


class GroupedExperts(nn.Module):
    """SwiGLU experts: `down(silu(gate(x)) * up(x))`; allocated empty, filled by the layer or a loader."""

    def __init__(self, num_local: int, hidden: int, intermediate: int, dtype: torch.dtype, device,
                 fmt: QuantFormat | None = None):
        super().__init__()
        L, D, I = num_local, hidden, intermediate
        # Stored as moeshard.kernels' panels where they serve them; else in Hugging Face's [out, in]
        # layout, read through transposed views: on CPUs without native bf16, a contiguous [in, out]
        # operand takes a matmul path several times slower.
        gate_up, down = packed.for_swiglu((L, 2 * I, D), (L, D, I), dtype, device, "the routed experts", fmt)
        self.w13_LFD = empty_param((L, 2 * I, D), dtype, device, gate_up)
        self.w2_LDI = empty_param((L, D, I), dtype, device, down)
        self.packed = gate_up.served

    def forward(self, x_MD: torch.Tensor, group_ends_L: torch.Tensor) -> torch.Tensor:
        return grouped_swiglu(x_MD, packed.operand(self.w13_LFD), packed.operand(self.w2_LDI), group_ends_L, self.packed)


def grouped_swiglu(x_MD, w13_LFD, w2_LDI, group_ends_L: torch.Tensor, packed: bool = False) -> torch.Tensor:
    """Rows sorted by local expert; rows past `group_ends_L[-1]` come back undefined (see
    `zero_rows_past_groups_` for a caller that reads them). With `packed` (the weights stored as
    moeshard.kernels' panels), the kernels compute it."""
    if packed:
        return kernels.grouped_swiglu(x_MD, w13_LFD, w2_LDI, group_ends_L)
    gate_MI, up_MI = grouped_linear(x_MD, w13_LFD.transpose(1, 2), group_ends_L).chunk(2, dim=-1)
    return grouped_linear(F.silu(gate_MI) * up_MI, w2_LDI.transpose(1, 2), group_ends_L)


def zero_rows_past_groups_(y_MD: torch.Tensor, group_ends_L: torch.Tensor) -> torch.Tensor:
    """Zero, in place, the rows no group computed (without a host sync)."""
    past_M1 = (torch.arange(y_MD.shape[0], device=y_MD.device) >= group_ends_L[-1]).unsqueeze(1)
    return y_MD.masked_fill_(past_M1, 0)
