"""bf16 GEMMs on the CPU's AVX512-BF16 units, over weights prepacked once (cpu_bf16.cpp).

Why a kernel of our own (measured on the 2-core development CPU, one thread, bf16, docs/perf.md):
torch's bf16 `F.linear` reads a weight at 5–8 GB/s at decode sizes (M = 1–8 rows), and
`F.grouped_mm` on the CPU loops over experts one `mm` at a time; this kernel streams a weight at
memory bandwidth at M = 1 and reaches oneDNN's throughput from M ≈ 64. Its prepacked weights are
derived tensors (runtime.derived): computed from the weights, rebuilt after every load, update and
wake, released by sleep. Every output element is accumulated over the inputs in one fixed order, so
a row's result does not depend on the other rows of the batch.

The kernel is built on first use with torch's cpp_extension (~15 s, then cached). It runs where the
CPU has AVX512-BF16; elsewhere, or with MOESHARD_CPU_KERNELS=0, the engine uses torch's ops.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from moeshard.runtime import derived

PANEL = 64  # outputs per packed panel (four vectors of 16)
# -fopenmp: at::parallel_for is OpenMP pragmas in torch's headers; without it they run on one thread.
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-fopenmp"]
log = logging.getLogger(__name__)


@functools.cache
def built() -> bool:
    """Whether the kernels run here (built on the first call, then cached on disk by cpp_extension)."""
    if os.environ.get("MOESHARD_CPU_KERNELS", "1") == "0" or not torch.cpu._is_avx512_bf16_supported():
        return False
    from torch.utils import cpp_extension

    source = Path(__file__).with_name("cpu_bf16.cpp")
    try:
        cpp_extension.load("moeshard_cpu_bf16", [str(source)], extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                           is_python_module=False)
    except Exception as exc:  # no compiler, no ninja: serve with torch's ops rather than not at all
        log.warning("moeshard: the bf16 CPU kernels did not build (%s); using torch's bf16 ops", exc)
        return False
    torch.library.register_fake("moeshard_cpu::linear")(
        lambda x, w, n, fp32_out: x.new_empty((x.shape[0], n), dtype=torch.float32 if fp32_out else x.dtype)
    )
    torch.library.register_fake("moeshard_cpu::grouped_swiglu")(lambda x, w13, w2, ends: torch.empty_like(x))
    torch.library.register_fake("moeshard_cpu::paged_attention")(
        lambda q, k, v, starts, lens, slots, scale, window: q.new_empty((*q.shape[:2], v.shape[-1]))
    )
    return True


def serves(weight: torch.Tensor) -> bool:
    """Whether products with `weight` run on these kernels: bf16 on a CPU that has them, an even
    number of inputs (the kernel reads inputs in pairs)."""
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.shape[-1] % 2 == 0 and built()


def pack(w_NK: torch.Tensor) -> torch.Tensor:
    """[..., N, K] → [..., ceil(N/64), K/2, 64, 2]: a panel's 64 outputs' values of one input pair
    together (zero outputs pad the last panel)."""
    *lead, N, K = w_NK.shape
    panels = -(-N // PANEL)
    w = F.pad(w_NK, (0, 0, 0, panels * PANEL - N))
    return w.view(*lead, panels, PANEL, K // 2, 2).transpose(-3, -2).contiguous()


def _padded(intermediate: int) -> int:
    return -(-intermediate // (PANEL // 2)) * (PANEL // 2)


def pack_gate_up(gate_up_LFD: torch.Tensor) -> torch.Tensor:
    """SwiGLU gate-up weights ([L, 2I, D] or [2I, D], gate rows first) → packed, the intermediate
    size padded to a multiple of 32 with zero rows, gate and up interleaved 16 rows at a time (one
    register tile then holds both halves of its outputs). Always [L, ...]."""
    gate_up_LFD = gate_up_LFD.reshape(-1, *gate_up_LFD.shape[-2:])
    L, F2, D = gate_up_LFD.shape
    I = F2 // 2
    halves = (F.pad(h, (0, 0, 0, _padded(I) - I)).view(L, -1, PANEL // 4, D) for h in gate_up_LFD.chunk(2, 1))
    return pack(torch.stack(list(halves), dim=2).reshape(L, 2 * _padded(I), D))


def pack_down(down_LDI: torch.Tensor) -> torch.Tensor:
    """SwiGLU down weights ([L, D, I] or [D, I]) → packed, zero columns up to the padded I."""
    down_LDI = down_LDI.reshape(-1, *down_LDI.shape[-2:])
    I = down_LDI.shape[-1]
    return pack(F.pad(down_LDI, (0, _padded(I) - I)))


def register_packed(owner: nn.Module, attr: str, weight: torch.Tensor, packer=pack) -> None:
    """`owner.attr` = `packer(weight)` as a derived tensor where these kernels serve `weight`
    (a non-persistent buffer, so compiled graphs see static shapes), else None."""
    owner.register_buffer(attr, None, persistent=False)
    if serves(weight):
        derived.register(owner, attr, functools.partial(packer, weight))


def register_swiglu(owner: nn.Module, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    """`owner.gate_up_packed` and `owner.down_packed` (see register_packed) for a SwiGLU's weights."""
    register_packed(owner, "gate_up_packed", gate_up, pack_gate_up)
    register_packed(owner, "down_packed", down, pack_down)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., K] as [M, K] rows the kernels read in pairs: unit stride, an even row stride."""
    rows = x.reshape(-1, x.shape[-1])
    return rows.contiguous() if rows.stride(-1) != 1 or rows.stride(0) % 2 else rows


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, fp32_out: bool = False) -> torch.Tensor:
    """`F.linear(x, w)` for `packed = pack(w)`; bf16 out, or fp32 (the accumulator) with `fp32_out`."""
    out = torch.ops.moeshard_cpu.linear(_rows(x), packed, out_features, fp32_out)
    return out.view(*x.shape[:-1], out_features)


def grouped_swiglu(
    x_MD: torch.Tensor, gate_up_packed: torch.Tensor, down_packed: torch.Tensor, group_ends_L: torch.Tensor
) -> torch.Tensor:
    """Rows sorted by expert (`pack_gate_up`, `pack_down` weights); rows past the last end are zero."""
    return torch.ops.moeshard_cpu.grouped_swiglu(_rows(x_MD), gate_up_packed, down_packed, group_ends_L)


def swiglu(x_TD: torch.Tensor, gate_up_packed: torch.Tensor, down_packed: torch.Tensor) -> torch.Tensor:
    """One SwiGLU (packed as one expert) over every row."""
    rows_TD = _rows(x_TD)
    ends_1 = torch.full((1,), rows_TD.shape[0], dtype=torch.int32)
    return grouped_swiglu(rows_TD, gate_up_packed, down_packed, ends_1).view(x_TD.shape)


def paged_attention(
    q_THd: torch.Tensor,
    k_SGd: torch.Tensor,
    v_SGe: torch.Tensor,
    query_starts_N1: torch.Tensor,
    seq_lens_N: torch.Tensor,
    context_slots_NX: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens (rows `query_starts_N1[i]` … `[i+1]`) over
    its context in a bf16 paged cache (key position p at slot `context_slots_NX[i, p]`), read in
    place; rows past the last sequence's are zero. [T, H, Dv] in q's dtype."""
    return torch.ops.moeshard_cpu.paged_attention(
        q_THd, k_SGd, v_SGe, query_starts_N1, seq_lens_N, context_slots_NX, scale, window or 0
    )
