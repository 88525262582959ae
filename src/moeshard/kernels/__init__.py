"""GEMMs on the CPU's vector units over weights prepacked once (bf16 and fp32), and attention over
the paged cache, RMSNorm and rotary (cpu.cpp): on AVX512-BF16, or on AVX2 + FMA (x86-64-v3).

Why a kernel of our own (measured on the 2-core development CPU, one thread, docs/perf.md): torch's
bf16 `F.linear` reads a weight at 5–8 GB/s at decode sizes (M = 1–8 rows), and `F.grouped_mm` on
the CPU loops over experts one `mm` at a time (in bf16 and fp32); this kernel streams a weight at
memory bandwidth at M = 1 and reaches oneDNN's throughput from M ≈ 64. A weight they serve is
held only in their packed layout (packed.py: the loader writes checkpoint blocks straight into it).
Every output element is accumulated over the inputs in one fixed order, so
a row's result does not depend on the other rows of the batch: batch-invariant mode
(runtime.invariance) runs every product on these kernels, and refuses to start where they do not run.

The kernels are built on first use with torch's cpp_extension (~20 s, then cached), one source
with the flags of the CPU's build (`FLAGS`, `isa`):
- "avx512_bf16" (the CPU has AVX512-BF16): they serve bf16 and fp32, in every mode;
- "avx2" (AVX2 + FMA, no AVX512-BF16: cpu.cpp's 16 lanes as two 256-bit halves; bits that differ from
  the AVX-512 build's, as deterministic and row-independent): they serve bf16 in every mode (1.4–4.9×
  torch's bf16 ops there) and fp32 in batch-invariant mode only, where nothing else keeps a row's bits
  (no consistent gain over torch's fp32 ops, 0.6–0.9× on the larger dense products: docs/perf.md);
- elsewhere, or with MOESHARD_CPU_KERNELS=0, nothing: the engine uses torch's ops and batch-invariant
  mode refuses to start. MOESHARD_CPU_KERNELS=avx2 takes the AVX2 build on an AVX512-BF16 CPU too.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from moeshard.runtime import invariance

PANEL = 64  # outputs per packed panel (four vectors of 16)
# One source, two builds (cpu.cpp picks its vector layer from the target the flags give the compiler).
# -fopenmp: at::parallel_for is OpenMP pragmas in torch's headers; without it they run on one thread.
FLAGS = {
    "avx512_bf16": ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-fopenmp"],
    "avx2": ["-O3", "-mavx2", "-mfma", "-fopenmp"],  # x86-64-v3's vector units: 16 lanes as two __m256
}
log = logging.getLogger(__name__)


@functools.cache
def _cpu_isa() -> str | None:
    """The best build this CPU runs: "avx512_bf16" (AVX512-BF16), "avx2" (AVX2 and FMA: torch's
    "AVX2" capability, or its "AVX512", which has both), or None (another CPU)."""
    if torch.cpu._is_avx512_bf16_supported():
        return "avx512_bf16"
    return "avx2" if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else None


def isa() -> str | None:
    """The build the kernels use here: the CPU's (`_cpu_isa`); None with MOESHARD_CPU_KERNELS=0;
    "avx2" with MOESHARD_CPU_KERNELS=avx2 on a CPU that has AVX2 (the portable build, on any x86-64-v3 CPU)."""
    setting = os.environ.get("MOESHARD_CPU_KERNELS", "1")
    if setting not in ("0", "1", "avx2"):
        raise ValueError(f"MOESHARD_CPU_KERNELS must be 0, 1 or avx2, got {setting!r}.")
    if setting == "0" or _cpu_isa() is None:
        return None
    return "avx2" if setting == "avx2" else _cpu_isa()


_SOURCE = Path(__file__).with_name("cpu.cpp").resolve()
_SOURCES = (_SOURCE, _SOURCE.with_name("pack.cpp"))  # the kernels; writing blocks into packed panels (packed.py)


def build_directory(build: str) -> Path:
    """Where `build` of this checkout's cpu.cpp is built: one directory per source file (its path too:
    build.ninja names it, so two checkouts of one source sharing a directory would rebuild it in
    turn), flags, torch and Python."""
    from torch.utils import cpp_extension

    built_by = f"{_SOURCES} {' '.join(FLAGS[build])} torch {torch.__version__} python {sys.version}"
    digest = hashlib.sha256(b"".join(s.read_bytes() for s in _SOURCES) + built_by.encode()).hexdigest()[:16]
    return Path(cpp_extension.get_default_build_root()) / f"moeshard_cpu_{digest}"


@contextlib.contextmanager
def _building(directory: Path):
    """Holds `directory`'s flock while cpp_extension builds or loads there, one process at a time.

    Every load, even of a built library, takes cpp_extension's `lock` file for a moment, and a
    process killed meanwhile (a server stopped as it starts, a rank of a failed engine) leaves it
    there: cpp_extension would then wait on it forever, in every later process. The flock is the
    kernel's, released when its holder dies; whoever holds it knows a `lock` file left there is such
    a dead process's, and removes it."""
    import fcntl

    with open(directory / "build.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"
            if stale.exists():
                log.warning("moeshard: removing a killed process's kernel build lock (%s)", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


@functools.cache
def built() -> bool:
    """Whether the kernels run here (built on the first call, then cached on disk by cpp_extension)."""
    build = isa()
    if build is None:
        return False
    from torch.utils import cpp_extension

    flags, directory = FLAGS[build], build_directory(build)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        with _building(directory):
            cpp_extension.load("moeshard_cpu", [str(s) for s in _SOURCES], extra_cflags=flags, extra_ldflags=["-fopenmp"],
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


def step(dtype: torch.dtype) -> int:
    """Inputs the kernel reads per step: bf16 in pairs (one `vdpbf16ps`), fp32 one at a time."""
    return 2 if dtype == torch.bfloat16 else 1


def dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes the engine runs on the kernels (CPU tensors): bf16 and fp32 where they are built;
    on the AVX2 build fp32 only in batch-invariant mode (see the module's docstring)."""
    if not built():
        return ()
    if isa() == "avx512_bf16" or invariance.batch_invariant():
        return (torch.bfloat16, torch.float32)
    return (torch.bfloat16,)


def runs(t: torch.Tensor) -> bool:
    """Whether the engine runs tensors like `t` on the kernels: a CPU tensor of one of `dtypes()`."""
    return t.device.type == "cpu" and t.dtype in dtypes()


def serves(weight: torch.Tensor) -> bool:
    """Whether products with `weight` run on these kernels: `runs`, and its inputs fill whole steps."""
    return runs(weight) and weight.shape[-1] % step(weight.dtype) == 0


def pack(w_NK: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[..., N, K] → [..., ceil(N/64), K/s, 64, s] (s = `step`): a panel's 64 outputs' values of
    one step of inputs together (zero outputs pad the last panel). Into `out` if given, copied
    straight from strided views: no scratch the size of the weight."""
    *lead, N, K = w_NK.shape
    panels, s = -(-N // PANEL), step(w_NK.dtype)
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


def padded_intermediate(intermediate: int) -> int:
    """A SwiGLU's intermediate size as the kernels read it: a multiple of 32 (zero rows and inputs past it)."""
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
        halves = [F.pad(h, (0, 0, 0, padded_intermediate(I) - I)).view(-1, PANEL // 4, D) for h in gate_up_FD.chunk(2)]
        return pack(torch.stack(halves, dim=1).reshape(2 * padded_intermediate(I), D))

    return _per_expert(pack_one, gate_up_LFD, out)


def pack_down(down_LDI: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU down weights ([L, D, I] or [D, I]) → packed, zero columns up to the padded I."""
    return _per_expert(lambda down_DI: pack(F.pad(down_DI, (0, padded_intermediate(down_DI.shape[-1]) - down_DI.shape[-1]))),
                       down_LDI, out)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., K] as [M, K] rows the kernels read in steps: unit stride, a row stride of whole steps."""
    rows = x.reshape(-1, x.shape[-1])
    return rows.contiguous() if rows.stride(-1) != 1 or rows.stride(0) % step(x.dtype) else rows


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
    """One SwiGLU over every row: its weights packed as one expert ([1, ...]), or without the
    expert dim (a dense MLP's packed weights, packed.GateUpPanels and Panels with no leading dim)."""
    rows_TD = _rows(x_TD)
    ends_1 = torch.full((1,), rows_TD.shape[0], dtype=torch.int32)
    one = lambda w: w if w.dim() == 5 else w.unsqueeze(0)  # noqa: E731
    return grouped_swiglu(rows_TD, one(gate_up_packed), one(down_packed), ends_1).view(x_TD.shape)


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
