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

The kernels are built on first use with torch's cpp_extension (~20 s, then cached), one library
(cpu.cpp, and pack.cpp: a block of rows into panels) with the flags of the CPU's build (`FLAGS`, `isa`):
- "avx512_bf16" (the CPU has AVX512-BF16 and AVX512-VNNI): they serve bf16 and fp32, in every mode;
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
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from moeshard.kernels.quant import QuantFormat, Quantized
from moeshard.runtime import invariance

PANEL = 64  # outputs per packed panel (four vectors of 16)
# One source, two builds (cpu.cpp picks its vector layer from the target the flags give the compiler).
# -fopenmp: at::parallel_for is OpenMP pragmas in torch's headers; without it they run on one thread.
FLAGS = {
    "avx512_bf16": ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni", "-mfma",
                    "-fopenmp"],
    "avx2": ["-O3", "-mavx2", "-mfma", "-fopenmp"],  # x86-64-v3's vector units: 16 lanes as two __m256
}
log = logging.getLogger(__name__)


@functools.cache
def _cpu_isa() -> str | None:
    """The best build this CPU runs: "avx512_bf16" (AVX512-BF16 and AVX512-VNNI, which every CPU
    with the first has), "avx2" (AVX2 and FMA: torch's "AVX2" capability, or its "AVX512", which
    has both), or None (another CPU)."""
    if torch.cpu._is_avx512_bf16_supported() and torch.cpu._is_vnni_supported():
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
    torch.library.register_fake("moeshard_cpu::linear_quantized")(
        lambda x, values, scale, zero, kind, group, n, fp32_out, int8_activations:
        x.new_empty((x.shape[0], n), dtype=torch.float32 if fp32_out else x.dtype)
    )
    torch.library.register_fake("moeshard_cpu::grouped_swiglu_quantized")(lambda x, *weights_and_ends: torch.empty_like(x))
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
    return _panels(w_NK, step(w_NK.dtype), out)


def _panels(w_NK: torch.Tensor, s: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """`pack`'s layout for steps of s inputs, any dtype: [..., N, K] → [..., ceil(N/64), K/s, 64, s]."""
    *lead, N, K = w_NK.shape
    panels = -(-N // PANEL)
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


def unpack(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The weight [..., N, K] that `pack` packed into `packed` (N = `out_features`): a new tensor."""
    return _unpanels(packed, out_features)


def _unpanels(panels: torch.Tensor, n: int) -> torch.Tensor:
    """`_panels`'s inverse: [..., B, K/s, 64, s] → [..., n, K], a new tensor."""
    *lead, B, P, _, s = panels.shape
    return panels.transpose(-3, -2).reshape(*lead, B * PANEL, P * s)[..., :n, :].clone()


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


def _interleaved(gate_up_FX: torch.Tensor) -> torch.Tensor:
    """[2I, X] (gate rows first) → [2·Ip, X]: each half padded to Ip rows with zeros (`_padded`),
    then 16 gate rows and 16 up rows in turn."""
    I, X = gate_up_FX.shape[0] // 2, gate_up_FX.shape[1]
    halves = [F.pad(h, (0, 0, 0, padded_intermediate(I) - I)).view(-1, PANEL // 4, X) for h in gate_up_FX.chunk(2)]
    return torch.stack(halves, dim=1).reshape(2 * padded_intermediate(I), X)


def _deinterleaved(rows_FX: torch.Tensor, intermediate: int) -> torch.Tensor:
    """`_interleaved`'s inverse over the last two dims: [..., 2·Ip, X] → [..., 2I, X]."""
    *lead, rows, X = rows_FX.shape
    halves = rows_FX.reshape(*lead, rows // PANEL * 2, 2, PANEL // 4, X)
    gate, up = (halves[..., h, :, :].reshape(*lead, rows // 2, X)[..., :intermediate, :] for h in (0, 1))
    return torch.cat([gate, up], dim=-2)


def pack_gate_up(gate_up_LFD: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU gate-up weights ([L, 2I, D] or [2I, D], gate rows first) → packed, the intermediate
    size padded to a multiple of 32 with zero rows, gate and up interleaved 16 rows at a time (one
    register tile then holds both halves of its outputs). Always [L, ...]."""
    return _per_expert(lambda gate_up_FD: pack(_interleaved(gate_up_FD)), gate_up_LFD, out)


def pack_down(down_LDI: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU down weights ([L, D, I] or [D, I]) → packed, zero columns up to the padded I."""
    return _per_expert(lambda down_DI: pack(F.pad(down_DI, (0, padded_intermediate(down_DI.shape[-1]) - down_DI.shape[-1]))),
                       down_LDI, out)


def unpack_gate_up(packed: torch.Tensor, intermediate: int) -> torch.Tensor:
    """The [L, 2I, D] gate-up weights that `pack_gate_up` packed (I = `intermediate`): a new tensor."""
    return _deinterleaved(_unpanels(packed, packed.shape[1] * PANEL), intermediate)


def unpack_down(packed: torch.Tensor, intermediate: int, hidden: int) -> torch.Tensor:
    """The [L, D, I] down weights that `pack_down` packed (D = `hidden`, I = `intermediate`): a new tensor."""
    return unpack(packed, hidden)[..., :intermediate].clone()


# ---- Quantized weights (moeshard.kernels.quant's canonical form) in the kernels' panels ----------


@dataclass(frozen=True)
class PackedQuantized:
    """A quantized weight as the kernels read it (`pack_quantized`, `pack_gate_up_quantized`,
    `pack_down_quantized`), [...] its leading dims, B = ceil(N/64) panels, P = K/2 steps:
    - values [..., B, P, 64, 2] uint8: `pack`'s bf16 layout, one byte a weight (fp8's bits, int8's
      two's complement, uint8 with zero points); int4: [..., B, P, 64], two a byte: in each step
      and block of 16 outputs, byte t holds the block's weight t in its low nibble and weight
      t + 16 in its high one (weights numbered 2·output + input, as in a bf16 step), symmetric
      int4 as offset binary (v + 8);
      with int8 activations (fmt.activations, the "a8" layout, cpu.cpp's A8Panels) P = K/4 steps
      of 4 inputs (int8) or K/8 of 8 (int4), values [..., B, P, 64, 4]: `pack`'s layout for steps
      of 4 inputs, each output's 4 levels in one 32-bit lane as `vpdpbusd` reads them, unsigned
      (symmetric int8 as v + 128); int4 as two nibbles a byte, byte i of an output's lane holding
      inputs i (low) and i + 4 (high) of its step;
    - scale [..., B, X, 64] fp32, X = ceil(K/G) groups (a padded tail of K is zero groups): per
      group the panel's 64 outputs' scales, 0 past N; zero [..., B, X, 64] uint8 (zero points) or None;
    - fmt; `shape` the canonical weight's ([L, 2I, D] for gate-up, [L, D, I] for down); `layout`
      "linear", "gate_up" or "down" (what `unpack_quantized` undoes).
    Kernels' constraints: K and G multiples of the step (2; a8: 4 or 8: a step never straddles two
    groups), K a multiple of G (Quantized checks it), fp8 scales below 256 (the kernel scales fp8's
    bits by 2¹²⁰ · scale, exactly, in one multiply)."""

    values: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    fmt: QuantFormat
    shape: tuple[int, ...]
    layout: str = "linear"

    def expert(self, l: int) -> PackedQuantized:
        """Expert l's panels (views) of a [L, ...] weight."""
        return replace(self, values=self.values[l], scale=self.scale[l],
                       zero=None if self.zero is None else self.zero[l], shape=self.shape[1:])


FP8_SCALE_LIMIT = 256.0  # 2¹²⁰ · scale must be finite in fp32
_VALUE_DTYPES = {("fp8", False): torch.float8_e4m3fn, ("int8", False): torch.int8, ("int8", True): torch.uint8,
                 ("int4", False): torch.int8, ("int4", True): torch.int8}


def check_packable(q: Quantized) -> None:
    fmt, want = q.fmt, _VALUE_DTYPES[(q.fmt.kind, q.fmt.zero_point)]
    if q.values.dtype != want:
        raise ValueError(f"{fmt.kind} weights{' with zero points' if fmt.zero_point else ''} hold {want} values, got {q.values.dtype}.")
    if q.scale.dtype != torch.float32:
        raise ValueError(f"quantization scales must be float32, got {q.scale.dtype}.")
    if q.zero is not None and q.zero.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"zero points must be int8 or uint8, got {q.zero.dtype}.")
    if fmt.group % value_step(fmt):
        raise ValueError(f"the kernels read inputs {value_step(fmt)} at a time here, so a quantization group must be a "
                         f"multiple of {value_step(fmt)}, got {fmt.group}.")
    if fmt.kind == "fp8" and not bool((q.scale.abs() < FP8_SCALE_LIMIT).all()):
        raise ValueError(f"the fp8 kernel takes scales below {FP8_SCALE_LIMIT:g} (weights below ±114688), got larger.")


def value_step(fmt: QuantFormat) -> int:
    """Inputs per step of a quantized weight's panels: 2 (a bf16 step), or with int8 activations 4
    (int8) or 8 (int4: one 32-bit lane of nibbles)."""
    if fmt.activations == "int8":
        return 8 if fmt.kind == "int4" else 4
    return 2


def level_offset(fmt: QuantFormat) -> int:
    """What a stored value adds to a weight's level: 8 for symmetric int4 (offset binary), 128 for
    symmetric int8 with int8 activations (`vpdpbusd` multiplies unsigned weights), else 0."""
    if fmt.zero_point or fmt.kind == "fp8":
        return 0
    return 8 if fmt.kind == "int4" else 128 if fmt.activations == "int8" else 0


def values_shape(panels: tuple[int, ...], fmt: QuantFormat) -> tuple[int, ...]:
    """The stored shape of values whose panels one byte a weight are `panels` [..., B, P, 64, s]:
    int4 two a byte ([..., B, P, 64]; a8: [..., B, P, 64, 4])."""
    if fmt.kind != "int4":
        return tuple(panels)
    return tuple(panels[:-1]) if fmt.activations == "bf16" else (*panels[:-1], 4)


def fold_int4(values8: torch.Tensor, out: torch.Tensor, fmt: QuantFormat) -> None:
    """int4 levels one a byte (offset applied), panels [..., B, P, 64, s] → `out`, two a byte (see
    PackedQuantized: a8 lanes, or the bf16 steps' weights t and t + 16 of each block of 16)."""
    if fmt.activations == "int8":
        out.copy_(values8[..., :4] | (values8[..., 4:] << 4))
        return
    blocks = values8.flatten(-2).unflatten(-1, (PANEL // 16, 2, 16))
    out.view(*out.shape[:-1], PANEL // 16, 16).copy_(blocks[..., 0, :] | (blocks[..., 1, :] << 4))


def unfold_int4(values4: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """`fold_int4`'s inverse: a new [..., B, P, 64, s] tensor."""
    if fmt.activations == "int8":
        return torch.cat([values4 & 15, values4 >> 4], dim=-1)
    nibbles = values4.view(*values4.shape[:-1], PANEL // 16, 1, 16)
    return torch.cat([nibbles & 15, nibbles >> 4], dim=-2).view(*values4.shape, 2)


def _empty_packed(lead: tuple[int, ...], N: int, K: int, fmt: QuantFormat, shape, layout: str) -> PackedQuantized:
    s = value_step(fmt)
    B, P, X = -(-N // PANEL), K // s, -(-K // fmt.group)
    values = torch.empty(values_shape((*lead, B, P, PANEL, s), fmt), dtype=torch.uint8)
    scale = torch.empty((*lead, B, X, PANEL))
    zero = torch.empty((*lead, B, X, PANEL), dtype=torch.uint8) if fmt.zero_point else None
    return PackedQuantized(values, scale, zero, fmt, tuple(shape), layout)


INT4_CHUNK = 16  # panels whose nibbles are joined at a time (the scratch of `_pack_int4`)


def _pack_int4(values_NK: torch.Tensor, fmt: QuantFormat, out: torch.Tensor) -> None:
    """int4 values [..., N, K] (uint8 view of int8) → `out`, two a byte (see PackedQuantized),
    `level_offset` added (8: symmetric → offset binary), a few panels at a time."""
    N, K = values_NK.shape[-2:]
    s, offset = value_step(fmt), level_offset(fmt)
    panel_dims = len(values_shape((0, 0, 0, 0), fmt))
    for one, one_out in zip(values_NK.reshape(-1, N, K), out.view(-1, *out.shape[-panel_dims:]), strict=True):
        for b0 in range(0, one_out.shape[0], INT4_CHUNK):
            b1 = min(b0 + INT4_CHUNK, one_out.shape[0])
            fold_int4((_panels(one[b0 * PANEL : b1 * PANEL], s) ^ offset) & 15, one_out[b0:b1], fmt)


def _pack_into(values_NK: torch.Tensor, scale_NX: torch.Tensor, zero_NX: torch.Tensor | None,
               out: PackedQuantized) -> PackedQuantized:
    """Canonical tensors (any leading dims, rows already arranged) → `out`'s panels, from strided
    views; padding holds level 0 (`level_offset`'s byte)."""
    fmt = out.fmt
    if fmt.kind == "int4":
        _pack_int4(values_NK.view(torch.uint8), fmt, out.values)
    else:
        _panels(values_NK.view(torch.uint8), value_step(fmt), out.values)
        if level_offset(fmt):
            out.values.bitwise_xor_(level_offset(fmt))
    _panels(scale_NX, 1, out.scale.unsqueeze(-1))
    if zero_NX is not None:
        _panels(zero_NX.view(torch.uint8), 1, out.zero.unsqueeze(-1))
    return out


def pack_quantized(q: Quantized, out: PackedQuantized | None = None) -> PackedQuantized:
    """A quantized weight [..., N, K] → its panels (PackedQuantized, layout "linear"), into `out`
    if given: copied straight from strided views, the only scratch a few panels (int4)."""
    check_packable(q)
    *lead, N, K = q.shape
    out = out if out is not None else _empty_packed(tuple(lead), N, K, q.fmt, q.shape, "linear")
    return _pack_into(q.values, q.scale, q.zero, out)


def _pack_quantized_experts(q: Quantized, out: PackedQuantized | None, layout: str, rows_out: int, K_out: int,
                            arrange_values, arrange_groups) -> PackedQuantized:
    check_packable(q)
    L = q.values.reshape(-1, *q.shape[-2:]).shape[0]
    shape = (L, *q.shape[-2:])
    out = out if out is not None else _empty_packed((L,), rows_out, K_out, q.fmt, shape, layout)
    flat = [t if t is None else t.reshape(L, *t.shape[-2:]) for t in (q.values, q.scale, q.zero)]
    for l in range(L):  # the scratch is one expert's
        one = Quantized(flat[0][l], flat[1][l], None if flat[2] is None else flat[2][l], q.fmt)
        _pack_into(arrange_values(one.values.view(torch.uint8)), arrange_groups(one.scale),
                   None if one.zero is None else arrange_groups(one.zero.view(torch.uint8)), out.expert(l))
    return out


def pack_gate_up_quantized(q: Quantized, out: PackedQuantized | None = None) -> PackedQuantized:
    """`pack_gate_up` for a quantized [L, 2I, D] (or [2I, D]) weight: rows padded and interleaved
    as there (padded rows: zero values and scales), always [L, ...]."""
    I, D = q.shape[-2] // 2, q.shape[-1]
    return _pack_quantized_experts(q, out, "gate_up", 2 * padded_intermediate(I), D, _interleaved, _interleaved)


def pack_down_quantized(q: Quantized, out: PackedQuantized | None = None) -> PackedQuantized:
    """`pack_down` for a quantized [L, D, I] (or [D, I]) weight: inputs padded to the padded I with
    zero values in groups of zero scale (the last may be partial), always [L, ...]."""
    D, I = q.shape[-2:]
    Ip, G = padded_intermediate(I), q.fmt.group
    return _pack_quantized_experts(q, out, "down", D, Ip, lambda v: F.pad(v, (0, Ip - I)),
                                   lambda t: F.pad(t, (0, -(-Ip // G) - I // G)))


def unpack_quantized(packed: PackedQuantized) -> Quantized:
    """The canonical weight that was packed into `packed` (its `shape`; new tensors)."""
    fmt, shape = packed.fmt, packed.shape
    values = unfold_int4(packed.values, fmt) if fmt.kind == "int4" else packed.values
    rows = values.shape[-4] * PANEL
    values, scale = _unpanels(values, rows), _unpanels(packed.scale.unsqueeze(-1), rows)
    zero = None if packed.zero is None else _unpanels(packed.zero.unsqueeze(-1), rows)
    N, K = shape[-2:]
    if packed.layout == "gate_up":
        values, scale, zero = (t if t is None else _deinterleaved(t, N // 2) for t in (values, scale, zero))
    values, scale, zero = (t if t is None else t[..., :N, :] for t in (values, scale, zero))
    values, scale, zero = values[..., :K], scale[..., : K // fmt.group], None if zero is None else zero[..., : K // fmt.group]
    if fmt.kind == "int4":
        values = values.to(torch.int8) - level_offset(fmt)
    elif level_offset(fmt):
        values = values ^ level_offset(fmt)
    values = values.contiguous().view(_VALUE_DTYPES[(fmt.kind, fmt.zero_point)])
    zero = None if zero is None else zero.contiguous().view(torch.uint8 if fmt.kind == "int8" else torch.int8)
    return Quantized(values, scale.contiguous(), zero, fmt)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., K] as [M, K] rows the kernels read in steps: unit stride, a row stride of whole steps."""
    rows = x.reshape(-1, x.shape[-1])
    return rows.contiguous() if rows.stride(-1) != 1 or rows.stride(0) % step(x.dtype) else rows


def linear(x: torch.Tensor, packed: torch.Tensor | PackedQuantized, out_features: int, fp32_out: bool = False) -> torch.Tensor:
    """`F.linear(x, w)` for `packed = pack(w)`, in w's dtype, or fp32 (the accumulator) with `fp32_out`;
    for `packed = pack_quantized(q)` (bf16 x), bitwise the bf16 product with `quant.dequantize(q)`;
    with int8 activations (q.fmt.activations), the integer product of x's rows quantized to int8
    (cpu.cpp's A8Panels: docs/quantization.md)."""
    if isinstance(packed, PackedQuantized):
        fmt = packed.fmt
        out = torch.ops.moeshard_cpu.linear_quantized(_rows(x), packed.values, packed.scale, packed.zero, fmt.kind,
                                                      fmt.group, out_features, fp32_out, fmt.activations == "int8")
    else:
        out = torch.ops.moeshard_cpu.linear(_rows(x), packed, out_features, fp32_out)
    return out.view(*x.shape[:-1], out_features)


def grouped_swiglu(
    x_MD: torch.Tensor, gate_up_packed: torch.Tensor | PackedQuantized, down_packed: torch.Tensor | PackedQuantized,
    group_ends_L: torch.Tensor,
) -> torch.Tensor:
    """Rows sorted by expert (`pack_gate_up`, `pack_down` weights, or their quantized packings, of one
    format); rows past the last end are zero."""
    if isinstance(gate_up_packed, PackedQuantized):
        w13, w2 = gate_up_packed, down_packed
        if not isinstance(w2, PackedQuantized) or w2.fmt != w13.fmt:
            raise ValueError(f"gate-up and down weights must be quantized alike, got {w13.fmt} and {getattr(w2, 'fmt', 'unquantized')}.")
        return torch.ops.moeshard_cpu.grouped_swiglu_quantized(
            _rows(x_MD), w13.values, w13.scale, w13.zero, w2.values, w2.scale, w2.zero, w13.fmt.kind, w13.fmt.group, group_ends_L,
            w13.fmt.activations == "int8",
        )
    return torch.ops.moeshard_cpu.grouped_swiglu(_rows(x_MD), gate_up_packed, down_packed, group_ends_L)


def _one_expert(w: torch.Tensor | PackedQuantized) -> torch.Tensor | PackedQuantized:
    """A SwiGLU weight packed without the expert dim, as one expert ([1, ...]); one with it as it is."""
    if isinstance(w, PackedQuantized):
        if len(w.shape) == 3:
            return w
        lead = lambda t: None if t is None else t.unsqueeze(0)  # noqa: E731
        return replace(w, values=lead(w.values), scale=lead(w.scale), zero=lead(w.zero), shape=(1, *w.shape))
    return w if w.dim() == 5 else w.unsqueeze(0)


def swiglu(x_TD: torch.Tensor, gate_up_packed: torch.Tensor | PackedQuantized,
           down_packed: torch.Tensor | PackedQuantized) -> torch.Tensor:
    """One SwiGLU over every row: its weights packed as one expert ([1, ...]), or without the
    expert dim (a dense MLP's packed weights, packed.GateUpPanels and Panels with no leading dim)."""
    rows_TD = _rows(x_TD)
    ends_1 = torch.full((1,), rows_TD.shape[0], dtype=torch.int32)
    return grouped_swiglu(rows_TD, _one_expert(gate_up_packed), _one_expert(down_packed), ends_1).view(x_TD.shape)


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
