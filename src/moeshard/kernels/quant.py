"""Quantized weights in one canonical form — what every checkpoint layout is read into, what
quantizing a bf16 weight at load produces, what the kernels pack — and the one definition of
dequantization that the kernels reproduce bit for bit (docs/DESIGN.md §10).

A weight [..., N, K] (N outputs, K inputs) of format `fmt`, in groups of G = fmt.group inputs:
- values [..., N, K]: int8 holding integers (int8: −128…127, or uint8 0…255 with zero points; int4: −8…7, or 0…15 with zero points),
  or torch.float8_e4m3fn (fp8);
- scale [..., N, K/G] fp32: one per output per group (a checkpoint's 128 × 128 FP8 blocks are
  repeated over their rows: a rank's block of rows need not start on a block);
- zero [..., N, K/G] int8 (uint8 for int8 with zero points), or None: the zero point (int formats with `zero_point`).

Dequantized, w[n, k] = bf16(fp32(values[n, k] − zero[n, k/G]) · scale[n, k/G]): the difference is
exact, the product one fp32 multiply (as the kernels do it, in registers), the result rounded to
bf16 once, to nearest even. A quantized product equals the bf16 product on these weights.

Shape letters: N outputs, K inputs, G inputs per group (K/G groups).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

FP8_MAX = 448.0  # the largest finite float8_e4m3fn


@dataclass(frozen=True)
class QuantFormat:
    """How a weight is quantized: `kind`, G = `group` inputs per scale, and zero points or not
    (int kinds only); `activations` "int8" (int kinds only): its products quantize each row of
    activations to int8 per group and multiply integers (kernels.PackedQuantized's a8 layout,
    LLM(quantize_activations=True)), where "bf16" multiplies the dequantized weights exactly."""

    kind: Literal["fp8", "int8", "int4"]
    group: int = 128
    zero_point: bool = False
    activations: Literal["bf16", "int8"] = "bf16"

    def __post_init__(self):
        if self.kind not in ("fp8", "int8", "int4"):
            raise ValueError(f"quantization must be fp8, int8 or int4, got {self.kind!r}.")
        if self.group < 1:
            raise ValueError(f"a quantization group must hold at least one input, got {self.group}.")
        if self.zero_point and self.kind == "fp8":
            raise ValueError("fp8 weights have no zero points.")
        if self.activations not in ("bf16", "int8"):
            raise ValueError(f"activations are bf16 or int8, got {self.activations!r}.")
        if self.activations == "int8" and self.kind == "fp8":
            raise ValueError("int8 activations (quantize_activations) take int8 or int4 weights, not fp8.")

    @property
    def bits(self) -> int:
        return 4 if self.kind == "int4" else 8

    @property
    def levels(self) -> tuple[int, int]:
        """The integers `values` may hold (int kinds)."""
        if self.kind == "int8":
            return (0, 255) if self.zero_point else (-128, 127)
        return (0, 15) if self.zero_point else (-8, 7)


@dataclass
class Quantized:
    """One weight in canonical form (see the module's docstring)."""

    values: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    fmt: QuantFormat

    def __post_init__(self):
        *lead, N, K = self.values.shape
        if K % self.fmt.group:
            raise ValueError(f"a weight of {K} inputs is not whole groups of {self.fmt.group}.")
        groups = (*lead, N, K // self.fmt.group)
        if tuple(self.scale.shape) != groups or (self.zero is not None and tuple(self.zero.shape) != groups):
            raise ValueError(f"scales and zero points of a {list(self.values.shape)} weight must be {list(groups)}.")
        if (self.zero is not None) != self.fmt.zero_point:
            raise ValueError(f"{self.fmt} {'needs' if self.fmt.zero_point else 'has no'} zero points.")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)


def per_input(t_NG: torch.Tensor, group: int) -> torch.Tensor:
    """[..., N, K/G] → [..., N, K]: each group's value repeated over its inputs."""
    return t_NG.repeat_interleave(group, dim=-1)


def dequantize(q: Quantized) -> torch.Tensor:
    """The bf16 weight [..., N, K] a quantized one stands for (the module's docstring's formula)."""
    levels = q.values.float()
    if q.zero is not None:
        levels = levels - per_input(q.zero.float(), q.fmt.group)
    return (levels * per_input(q.scale, q.fmt.group)).to(torch.bfloat16)


def quantize(w_NK: torch.Tensor, fmt: QuantFormat) -> Quantized:
    """A bf16 (or fp32) weight quantized at load, per output per group of inputs: symmetric
    (scale = max |w| / the largest level) or, with zero points, over [min, max] (zero = the level
    of 0.0). Computed in fp32, rounding to nearest even; an all-zero group gets scale 0."""
    *lead, N, K = w_NK.shape
    if K % fmt.group:
        raise ValueError(f"a weight of {K} inputs is not whole groups of {fmt.group}.")
    w = w_NK.float().reshape(*lead, N, K // fmt.group, fmt.group)
    if fmt.kind == "fp8":
        scale = w.abs().amax(-1) / FP8_MAX
        safe = torch.where(scale > 0, scale, 1.0).unsqueeze(-1)
        values = (w / safe).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return Quantized(values.reshape(w_NK.shape), scale, None, fmt)
    low, high = fmt.levels
    if fmt.zero_point:
        lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)  # 0.0 is a level exactly
        scale = (hi - lo) / (high - low)
        safe = torch.where(scale > 0, scale, 1.0)
        zero = torch.round(-lo / safe).clamp(low, high)
        levels = torch.round(w / safe.unsqueeze(-1)) + zero.unsqueeze(-1)
        zero_t = zero.to(torch.int8) if high <= 127 else zero.to(torch.uint8)
    else:
        scale = w.abs().amax(-1) / high
        safe = torch.where(scale > 0, scale, 1.0)
        levels, zero_t = torch.round(w / safe.unsqueeze(-1)), None
    values = levels.clamp(low, high).to(torch.int8 if high <= 127 else torch.uint8)
    return Quantized(values.reshape(w_NK.shape), scale, zero_t, fmt)
