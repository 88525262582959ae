"""The dense building blocks: RMSNorm, rotary embeddings, TP linears, vocab-parallel embedding and
LM head, the dense SwiGLU MLP. Each allocates its rank's shard of its weights and names the
checkpoint blocks they are read from (moeshard.models.loader).

TP conventions (Megatron's): a column-parallel linear holds a block of output rows and needs no
communication; a row-parallel one holds a block of input columns and its output is a partial sum
over TP, reduced by `tp_reduce`. Under SP the rows between blocks are this rank's slice of the TP
group's rows: `tp_gather_rows` before a column-parallel block, a reduce-scatter after it.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from moeshard import kernels
from moeshard.kernels import packed
from moeshard.runtime import derived
from moeshard.models.archs import yarn_mscale
from moeshard.models.config import RopeConfig
from moeshard.models.loader import Alloc, Block
from moeshard.moe.functional import swiglu
from moeshard.parallel import ops
from moeshard.parallel.state import ParallelState


def block(n: int, part: int, parts: int) -> slice:
    """Part `part` of `parts` equal blocks of range(n)."""
    size = n // parts
    return slice(part * size, (part + 1) * size)


def size(rows: slice, n: int) -> int:
    """How many of range(n) `rows` takes."""
    return len(range(*rows.indices(n)))


class TPComm:
    """The TP collectives a dense block needs, fixed when the model is built (static)."""

    def __init__(self, parallel: ParallelState):
        self.tp, self.sp = parallel.layout.tp, parallel.layout.sp

    def reduce(self, x_TD: torch.Tensor) -> torch.Tensor:
        """Complete a partial sum over TP: all-reduce, or under SP reduce-scatter to this rank's rows."""
        if self.tp == 1:
            return x_TD
        return ops.tp_reduce_scatter(x_TD) if self.sp else ops.tp_all_reduce(x_TD)

    def gather_rows(self, x_TD: torch.Tensor) -> torch.Tensor:
        """Under SP, this rank's rows → the TP group's rows; otherwise nothing to do."""
        return ops.tp_all_gather(x_TD) if self.sp and self.tp > 1 else x_TD


class RMSNorm(nn.Module):
    def __init__(self, alloc: Alloc, prefix: str, dim: int, eps: float):
        super().__init__()
        self.weight_D, self.eps = alloc((dim,), Block(f"{prefix}.weight", (dim,))), eps
        # Decided here, not per call: a call into the kernels' checks would break a compiled graph.
        self.fused = kernels.runs(self.weight_D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dtype == self.weight_D.dtype:
            return kernels.rms_norm(x, self.weight_D, self.eps)
        x32 = x.float()
        return self.weight_D * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope_inv_freq(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [Dr/2] and the cos/sin scale, as transformers computes them."""
    dim = rope.dim
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if rope.kind == "default":
        return 1.0 / pos_freqs, 1.0
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(rope.factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_table(rope: RopeConfig, max_positions: int, device: torch.device, fn) -> torch.Tensor:
    """fn (torch.cos or torch.sin) of every position's angles, scaled: [X, r] (X = max_positions)."""
    inv_freq, scale = rope_inv_freq(rope)
    freqs_Xr = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return (fn(torch.cat([freqs_Xr, freqs_Xr], dim=-1)) * scale).to(device)


class Rotary(nn.Module):
    """cos/sin tables for every position: derived tensors (registered), not weights.

    Kept as module buffers: a compiled graph treats buffers' shapes as static; a plain tensor
    attribute's dims would be dynamic, and Dynamo could unify one with the batch size."""

    def __init__(self, rope: RopeConfig, max_positions: int, device: torch.device):
        super().__init__()
        self.interleaved = rope.interleaved
        self.fused_dtypes = kernels.dtypes() if device.type == "cpu" else ()  # see RMSNorm
        self.fused = bool(self.fused_dtypes)
        for name, fn in (("cos_Xr", torch.cos), ("sin_Xr", torch.sin)):
            self.register_buffer(name, None, persistent=False)
            derived.register(self, name, functools.partial(rope_table, rope, max_positions, device, fn))

    def forward(self, x_THr: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
        if self.fused and x_THr.dtype in self.fused_dtypes:
            return kernels.rotary(x_THr, self.cos_Xr, self.sin_Xr, positions_T, self.interleaved)
        cos = self.cos_Xr[positions_T].unsqueeze(1).to(x_THr.dtype)
        sin = self.sin_Xr[positions_T].unsqueeze(1).to(x_THr.dtype)
        if self.interleaved:  # pairs (x0, x1), (x2, x3), …; the output lists evens, then odds
            half = cos.shape[-1] // 2
            cos, sin = cos[..., :half], sin[..., :half]
            x1, x2 = x_THr[..., 0::2], x_THr[..., 1::2]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        x1, x2 = x_THr.chunk(2, dim=-1)
        return x_THr * cos + torch.cat([-x2, x1], dim=-1) * sin


class VocabParallelEmbedding(nn.Module):
    """Rows of the (padded) vocabulary split over TP; the LM head is one too (`logits`), or shares
    the embedding's when tied. An LM head's weight is stored as the kernels' panels where they serve
    it (a tied embedding then gathers its rows out of the panels).

    Chosen over a replicated table (`moeshard bench lm-head`, 152k × 2048 bf16, TP=2, 2-core CPU):
    each rank holds half the weight (297 vs 594 MiB, twice that untied), and decode-sized logits
    are 1.7-1.8× faster since the GEMM is bound by reading the weight; at 256 rows the gather makes
    it 0.92×, and an engine computes logits only for each sequence's last row.
    """

    def __init__(self, alloc: Alloc, name: str, vocab: int, hidden: int, parallel: ParallelState, head: bool):
        super().__init__()
        tp, t = parallel.layout.tp, parallel.tp_rank
        self.vocab, self.rows = vocab, -(-vocab // tp)
        self.start = t * self.rows
        real = max(0, min(self.rows, vocab - self.start))
        mine = Block(name, (vocab, hidden), (slice(self.start, self.start + real),), (slice(0, real),))
        shape = (self.rows, hidden)
        fmt = alloc.quantized("lm_head") if head else None
        tied = head and name != "lm_head.weight"
        # A tied head shares the embedding's table, which lookups read in the model's dtype: quantized,
        # the head is a copy of it (derived, below).
        self.layout = packed.for_linear(shape, alloc.dtype, alloc.device, "the LM head", None if tied else fmt) \
            if head else packed.Plain(shape)
        self.weight_VD = alloc(shape, mine, padding=(slice(real, None),), layout=self.layout)
        self.head_layout = self.layout
        if tied and fmt is not None:
            self.head_layout = packed.quantized_layout(shape, fmt, "linear", alloc.dtype, "the LM head")
            self.weight_VD.data.zero_()  # the copy made now, before loading, quantizes zeros (not garbage)
            self.register_buffer("head_VD", None, persistent=False)
            derived.register(self, "head_VD", functools.partial(quantized_copy, self.weight_VD, self.head_layout),
                             in_place=True)
        self.comm = TPComm(parallel)

    def forward(self, ids_T: torch.Tensor) -> torch.Tensor:
        if self.comm.tp == 1:
            return self.layout.rows(self.weight_VD, ids_T)
        local_T = ids_T - self.start
        mine_T = (local_T >= 0) & (local_T < self.rows)
        # Rows of other ranks' ids are filled, not multiplied, with 0: the row read for them is
        # never trusted to be finite.
        x_TD = self.layout.rows(self.weight_VD, local_T.clamp(0, self.rows - 1)).masked_fill(~mine_T.unsqueeze(-1), 0)
        return self.comm.reduce(x_TD)

    def logits(self, x_ND: torch.Tensor) -> torch.Tensor:
        """[N, D] (every row, not an SP slice) → [N, vocab]: each rank's block of columns, gathered."""
        # On the kernels, logits come out of the fp32 accumulator, never rounded to bf16.
        weight = self.weight_VD if self.head_layout is self.layout else self.head_VD
        logits_NV = self.head_layout.linear(x_ND, weight, fp32_out=True)
        if self.comm.tp > 1:
            logits_NV = ops.tp_all_gather(logits_NV.T.contiguous()).T
        return logits_NV[:, : self.vocab]


def quantized_copy(table: nn.Parameter, layout: packed.QuantizedPanels, out: torch.Tensor | None = None) -> torch.Tensor:
    """`table`'s weight (as its layout holds it now) quantized into `layout`'s storage (`out`, or a
    new one): a tied LM head's quantized copy. The scratch is one bf16 read of the table."""
    out = torch.empty(layout.storage_shape(), dtype=torch.uint8, device=table.device) if out is None else out
    layout.zero_padding(out)
    layout.write(out, (), packed.logical(table))
    return out


def swiglu_blocks(
    prefix: str,
    hidden: int,
    intermediate: int,
    rows: slice,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    at: tuple = (),
) -> tuple[tuple[Block, Block], Block]:
    """A SwiGLU's gate and up rows `rows`, fused (gate first) into [F, D] at `at`, and the matching
    down columns [D, I] at `at`: (gate-up blocks, down block)."""
    gate, up, down = (f"{prefix}.{name}.weight" for name in names)
    n = size(rows, intermediate)
    gate_up = (
        Block(gate, (intermediate, hidden), (rows,), (*at, slice(0, n))),
        Block(up, (intermediate, hidden), (rows,), (*at, slice(n, 2 * n))),
    )
    return gate_up, Block(down, (hidden, intermediate), (slice(None), rows), at)


class DenseMLP(nn.Module):
    """SwiGLU with gate/up column-parallel and down row-parallel over TP."""

    def __init__(self, alloc: Alloc, prefix: str, hidden: int, intermediate: int, parallel: ParallelState):
        super().__init__()
        rows = block(intermediate, parallel.tp_rank, parallel.layout.tp)
        gate_up, down = swiglu_blocks(prefix, hidden, intermediate, rows)
        I = size(rows, intermediate)
        gate_up_layout, down_layout = packed.for_swiglu(
            (2 * I, hidden), (hidden, I), alloc.dtype, alloc.device, prefix, alloc.quantized(prefix)
        )
        self.gate_up_FD = alloc((2 * I, hidden), *gate_up, layout=gate_up_layout)
        self.down_DI = alloc((hidden, I), down, layout=down_layout)
        self.packed = gate_up_layout.served
        self.comm = TPComm(parallel)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        gate_up, down = packed.operand(self.gate_up_FD), packed.operand(self.down_DI)
        return self.comm.reduce(swiglu(self.comm.gather_rows(x_TD), gate_up, down, self.packed))
