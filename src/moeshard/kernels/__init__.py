"""GEMMs on the CPU's AVX-512 units (bf16 on AVX512-BF16, fp32 on FMA), over weights prepacked
once, and attention over the paged cache (cpu.cpp).

Why a kernel of our own (measured on the 2-core development CPU, one thread, docs/perf.md): torch's
bf16 `F.linear` reads a weight at 5–8 GB/s at decode sizes (M = 1–8 rows), and `F.grouped_mm` on
the CPU loops over experts one `mm` at a time (in bf16 and fp32); this kernel streams a weight at
memory bandwidth at M = 1 and reaches oneDNN's throughput from M ≈ 64. Its prepacked weights are
derived tensors (runtime.derived): computed from the weights, rebuilt after every load, update and
wake, released by sleep. Every output element is accumulated over the inputs in one fixed order, so
a row's result does not depend on the other rows of the batch.

The kernel is built on first use with torch's cpp_extension (~20 s, then cached). It runs where the
CPU has AVX512-BF16 (fp32 too: one build, one set of flags); elsewhere, or with
MOESHARD_CPU_KERNELS=0, the engine uses torch's ops.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from moeshard.runtime import derived, invariance

PANEL = 64  # outputs per packed panel (four vectors of 16)
# -fopenmp: at::parallel_for is OpenMP pragmas in torch's headers; without it they run on one thread.
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-fopenmp"]
_STALE_LOCK_S = 600  # a build takes ~20 s
log = logging.getLogger(__name__)


@functools.cache
def built() -> bool:
    """Whether the kernels run here (built on the first call, then cached on disk by cpp_extension)."""
    if os.environ.get("MOESHARD_CPU_KERNELS", "1") == "0" or not torch.cpu._is_avx512_bf16_supported():
        return False
    from torch.utils import cpp_extension

    source = Path(__file__).with_name("cpu.cpp")
    # One build directory per source, flags, torch and Python: two checkouts (or versions) never rebuild each
    # other's library. A build lock older than any build is a killed build's: cpp_extension would
    # wait on it forever.
    built_by = f"{' '.join(_FLAGS)} torch {torch.__version__} python {sys.version}"
    digest = hashlib.sha256(source.read_bytes() + built_by.encode()).hexdigest()[:16]
    directory = Path(cpp_extension.get_default_build_root()) / f"moeshard_cpu_{digest}"
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
        log.warning("moeshard: removing a stale kernel build lock (%s)", lock)
        lock.unlink(missing_ok=True)
    try:
        cpp_extension.load("moeshard_cpu", [str(source)], extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                           build_directory=str(directory), is_python_module=False)
    except Exception as exc:  # no compiler, no ninja: serve with torch's ops rather than not at all
        log.warning("moeshard: the CPU kernels did not build (%s); using torch's ops", exc)
        return False
    torch.library.register_fake("moeshard_cpu::linear")(
        lambda x, w, n, fp32_out: x.new_empty((x.shape[0], n), dtype=torch.float32 if fp32_out else x.dtype)
    )
    torch.library.register_fake("moeshard_cpu::grouped_swiglu")(lambda x, w13, w2, ends: torch.empty_like(x))
    torch.library.register_fake("moeshard_cpu::paged_attention")(
        lambda q, k, v, starts, lens, slots, scale, window: q.new_empty((*q.shape[:2], v.shape[-1]))
    )
    torch.library.register_fake("moeshard_cpu::rms_norm")(lambda x, w, eps: torch.empty_like(x))
    torch.library.register_fake("moeshard_cpu::rotary")(lambda x, cos, sin, positions, interleaved: x.new_empty(x.shape))
    return True


def _step(dtype: torch.dtype) -> int:
    """Inputs the kernel reads per step: bf16 in pairs (one `vdpbf16ps`), fp32 one at a time."""
    return 2 if dtype == torch.bfloat16 else 1


def runs(t: torch.Tensor) -> bool:
    """Whether the kernels take tensors like `t`: bf16 or fp32 on the CPU, on a CPU that has them."""
    return t.dtype in (torch.bfloat16, torch.float32) and t.device.type == "cpu" and built()


def serves(weight: torch.Tensor) -> bool:
    """Whether products with `weight` run on these kernels: `runs`, and its inputs fill whole steps."""
    return runs(weight) and weight.shape[-1] % _step(weight.dtype) == 0


def pack(w_NK: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[..., N, K] → [..., ceil(N/64), K/s, 64, s] (s = `_step`): a panel's 64 outputs' values of
    one step of inputs together (zero outputs pad the last panel). Into `out` if given, copied
    straight from strided views: no scratch the size of the weight."""
    *lead, N, K = w_NK.shape
    panels, s = -(-N // PANEL), _step(w_NK.dtype)
    if out is None:
        out = w_NK.new_empty((*lead, panels, K // s, PANEL, s))
    full, left = divmod(N, PANEL)

    def steps(rows: torch.Tensor) -> torch.Tensor:  # [..., n, K] → [..., K/s, n, s], a view
        return rows.unflatten(-1, (K // s, s)).transpose(-3, -2)

    out[..., :full, :, :, :].copy_(steps(w_NK[..., : full * PANEL, :].unflatten(-2, (full, PANEL))))
    if left:
        last = out[..., full, :, :, :]
        last.zero_()
        last[..., :left, :].copy_(steps(w_NK[..., full * PANEL :, :]))
    return out


def _padded(intermediate: int) -> int:
    return -(-intermediate // (PANEL // 2)) * (PANEL // 2)


def _per_expert(pack_one, w: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`pack_one` of each [.., ..] slice of a [L, .., ..] (or one [.., ..]) weight, into `out`: the
    scratch is one expert's."""
    w = w.reshape(-1, *w.shape[-2:])
    if out is None:
        return torch.stack([pack_one(expert) for expert in w])
    for expert, packed in zip(w, out, strict=True):
        packed.copy_(pack_one(expert))
    return out


def pack_gate_up(gate_up_LFD: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU gate-up weights ([L, 2I, D] or [2I, D], gate rows first) → packed, the intermediate
    size padded to a multiple of 32 with zero rows, gate and up interleaved 16 rows at a time (one
    register tile then holds both halves of its outputs). Always [L, ...]."""

    def pack_one(gate_up_FD: torch.Tensor) -> torch.Tensor:
        I, D = gate_up_FD.shape[0] // 2, gate_up_FD.shape[1]
        halves = [F.pad(h, (0, 0, 0, _padded(I) - I)).view(-1, PANEL // 4, D) for h in gate_up_FD.chunk(2)]
        return pack(torch.stack(halves, dim=1).reshape(2 * _padded(I), D))

    return _per_expert(pack_one, gate_up_LFD, out)


def pack_down(down_LDI: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU down weights ([L, D, I] or [D, I]) → packed, zero columns up to the padded I."""
    return _per_expert(lambda down_DI: pack(F.pad(down_DI, (0, _padded(down_DI.shape[-1]) - down_DI.shape[-1]))),
                       down_LDI, out)


def register_packed(owner: nn.Module, attr: str, weight: torch.Tensor, packer=pack) -> None:
    """`owner.attr` = `packer(weight)` as a derived tensor where these kernels serve `weight`
    (a non-persistent buffer, so compiled graphs see static shapes), else None."""
    owner.register_buffer(attr, None, persistent=False)
    if serves(weight):
        derived.register(owner, attr, functools.partial(packer, weight), in_place=True)
    elif invariance.batch_invariant():
        raise ValueError(
            f"batch-invariant mode runs every product on moeshard's CPU kernels, which cannot take "
            f"{type(owner).__name__}.{attr}'s weight ({list(weight.shape)}, {weight.dtype}, {weight.device})."
        )


def register_swiglu(owner: nn.Module, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    """`owner.gate_up_packed` and `owner.down_packed` (see register_packed) for a SwiGLU's weights."""
    register_packed(owner, "gate_up_packed", gate_up, pack_gate_up)
    register_packed(owner, "down_packed", down, pack_down)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., K] as [M, K] rows the kernels read in steps: unit stride, a row stride of whole steps."""
    rows = x.reshape(-1, x.shape[-1])
    return rows.contiguous() if rows.stride(-1) != 1 or rows.stride(0) % _step(x.dtype) else rows


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, fp32_out: bool = False) -> torch.Tensor:
    """`F.linear(x, w)` for `packed = pack(w)`, in w's dtype, or fp32 (the accumulator) with `fp32_out`."""
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
    its context in a paged cache (bf16 or fp32) (key position p at slot `context_slots_NX[i, p]`), read in
    place; rows past the last sequence's are zero. [T, H, Dv] in q's dtype."""
    return torch.ops.moeshard_cpu.paged_attention(
        q_THd, k_SGd, v_SGe, query_starts_N1, seq_lens_N, context_slots_NX, scale, window or 0
    )


def rms_norm(x: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, as moeshard.models.layers.RMSNorm computes it in torch's ops."""
    return torch.ops.moeshard_cpu.rms_norm(x.reshape(-1, x.shape[-1]), weight_D, eps).view(x.shape)


def rotary(x_THr: torch.Tensor, cos_Xr: torch.Tensor, sin_Xr: torch.Tensor, positions_T: torch.Tensor,
           interleaved: bool) -> torch.Tensor:
    """Rotary embedding at `positions_T` from fp32 tables (see moeshard.models.layers.Rotary)."""
    return torch.ops.moeshard_cpu.rotary(x_THr, cos_Xr, sin_Xr, positions_T, interleaved)
