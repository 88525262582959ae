"""A weight's storage, and the one copy of it the engine holds (docs/DESIGN.md §5): Hugging Face's
[out, in] layout (`Plain`), or where moeshard.kernels serve the weight their packed panels
(`Panels`, `GateUpPanels`), with no [out, in] copy beside them.

A layout knows a weight's logical shape ([..., N, K], as a checkpoint stores it; a parameter's name
gives that shape), the shape of its storage, and
- `write(storage, dest, values)`: a block of the logical weight (`dest` indexes it) into the
  storage: the loader's one path, at start-up, for every update and every reload;
- `zero_padding(storage)`: the storage no block writes (a panel's outputs past N, inputs past K,
  the SwiGLU's intermediate padding), zeroed on every load, so a poisoned wake leaves no garbage;
- `read(storage)`: the logical weight back (a new tensor), for whatever compares or exports it;
- `linear(x, storage)` (`rows(storage, ids)` for an embedding table): its product.
A parameter carries its layout (`param.weight_layout`: `layout` is torch's own attribute); sleep and
wake change its storage, not its layout.

A block goes into panels through strided views, panel by panel (whole panels in one call), with
`pack_rows` (pack.cpp) doing the transposition; a block whose inputs do not fill whole steps (an
odd intermediate size) is padded first, the only scratch (one block). A quantized layout (values,
scales and zero points of kernels/quant.py, as panels) is one more class with these methods
(`QuantizedPanels`): its storage is one flat byte tensor, so a quantized weight is still one parameter.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from moeshard import kernels
from moeshard.kernels.quant import QuantFormat, Quantized, dequantize, quantize
from moeshard.runtime import invariance

PANEL = kernels.PANEL
TILE = PANEL // 4  # pack_gate_up interleaves gate and up rows 16 at a time


def block_shape(shape: tuple[int, ...], dest: tuple) -> tuple[int, ...]:
    return tuple(torch.empty(shape, device="meta")[dest].shape)


def split_index(shape: tuple[int, ...], dest: tuple) -> tuple[tuple, range, range]:
    """`dest` (ints and unit-step slices into a [*lead, N, K] weight) → (lead index, rows, inputs)."""
    *lead, rows, cols = tuple(dest) + (slice(None),) * (len(shape) - len(dest))
    rows, cols = range(*rows.indices(shape[-2])), range(*cols.indices(shape[-1]))
    if rows.step != 1 or cols.step != 1:
        raise ValueError(f"a block of a packed weight is a range of rows and of inputs, got {dest}.")
    return tuple(lead), rows, cols


def copy_rows(out: torch.Tensor, rows: torch.Tensor) -> None:
    """out [..., K/s, n, s] = rows [..., n, K] in steps of s (any strides)."""
    if out.dim() > 4:
        for o, r in zip(out, rows, strict=True):
            copy_rows(o, r)
        return
    if out.dim() == 3:
        out, rows = out.unsqueeze(0), rows.unsqueeze(0)
    if kernels.built() and out.dtype == rows.dtype and rows.stride(-1) == 1 and out.stride(-1) == 1:
        torch.ops.moeshard_cpu.pack_rows(out, rows)
    else:  # a conversion (a bf16 checkpoint into fp32 weights), or zeros (an expanded scalar)
        out.copy_(rows.unflatten(-1, (out.shape[-3], out.shape[-1])).transpose(-3, -2))


def write_panel_rows(panels: torch.Tensor, first: int, values: torch.Tensor, steps: slice) -> None:
    """Rows `first`, `first` + 1, … of the padded outputs of `panels` [..., P, K/s, 64, s] (their
    inputs `steps`) = `values` [..., n, K]: whole panels in one call, a part of one per call."""
    n, done = values.shape[-2], 0
    while done < n:
        p, row = divmod(first + done, PANEL)
        whole = (n - done) // PANEL if row == 0 else 0
        if whole:
            chunk = values[..., done : done + whole * PANEL, :].unflatten(-2, (whole, PANEL))
            copy_rows(panels[..., p : p + whole, steps, :, :], chunk)
            done += whole * PANEL
        else:
            take = min(PANEL - row, n - done)
            copy_rows(panels[..., p, steps, row : row + take, :], values[..., done : done + take, :])
            done += take


def input_steps(cols: range, values: torch.Tensor, step: int) -> tuple[slice, torch.Tensor]:
    """The steps a block's inputs `cols` fill, and its values padded with zero inputs to whole steps
    (a scratch of the block, only where its width is not a multiple of the step)."""
    if cols.start % step:
        raise ValueError(f"a block of a packed weight starts on a whole step of {step} inputs, not at input {cols.start}.")
    if len(cols) % step:
        values = F.pad(values, (0, step - len(cols) % step))
    return slice(cols.start // step, cols.start // step + values.shape[-1] // step), values


class InComputeDtype:
    """A layout whose storage holds the weight in the model's dtype."""

    def storage_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype


@dataclass(frozen=True)
class Plain(InComputeDtype):
    """Hugging Face's layout: the storage is the logical weight."""

    shape: tuple[int, ...]
    packed = False
    served = False  # its products run on moeshard.kernels

    def storage_shape(self) -> tuple[int, ...]:
        return self.shape

    def write(self, storage: torch.Tensor, dest: tuple, values: torch.Tensor) -> None:
        storage[dest].copy_(values)

    def zero_padding(self, storage: torch.Tensor) -> None:
        pass

    def read(self, storage: torch.Tensor) -> torch.Tensor:
        return storage.detach().clone()

    def linear(self, x: torch.Tensor, storage: torch.Tensor, fp32_out: bool = False) -> torch.Tensor:
        y = F.linear(x, storage)
        return y.float() if fp32_out else y

    def rows(self, storage: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, storage)


@dataclass(frozen=True)
class Panels(InComputeDtype):
    """kernels.pack's layout: [*lead, ceil(N/64), inputs/s, 64, s], `inputs` = K, or more where the
    kernels read zero inputs past K (a SwiGLU's down projection: its intermediate size padded)."""

    shape: tuple[int, ...]
    step: int
    inputs: int
    packed = served = True

    def storage_shape(self) -> tuple[int, ...]:
        *lead, N, _ = self.shape
        return (*lead, -(-N // PANEL), self.inputs // self.step, PANEL, self.step)

    def write(self, storage: torch.Tensor, dest: tuple, values: torch.Tensor) -> None:
        lead, rows, cols = split_index(self.shape, dest)
        steps, values = input_steps(cols, values.expand(block_shape(self.shape, dest)), self.step)
        write_panel_rows(storage[lead], rows.start, values, steps)

    def padded(self) -> bool:
        """The storage holds padding (outputs past N, inputs past K)."""
        N, K = self.shape[-2:]
        return bool(N % PANEL) or self.inputs > K

    def zero_padding(self, storage: torch.Tensor, value: int = 0) -> None:
        """Zeros (or `value`: a quantized layout's byte of level 0) where no block writes."""
        N, K = self.shape[-2:]
        if N % PANEL:
            storage[..., -1, :, N % PANEL :, :].fill_(value)
        if self.inputs > K:
            storage[..., K // self.step, :, K % self.step :].fill_(value)
            storage[..., K // self.step + 1 :, :, :].fill_(value)

    def read(self, storage: torch.Tensor) -> torch.Tensor:
        *lead, N, K = self.shape
        return storage.transpose(-3, -2).reshape(*lead, -1, self.inputs)[..., :N, :K].contiguous()

    def linear(self, x: torch.Tensor, storage: torch.Tensor, fp32_out: bool = False) -> torch.Tensor:
        return kernels.linear(x, storage, self.shape[-2], fp32_out)

    def rows(self, storage: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """An embedding table's rows `ids`, gathered out of the panels."""
        return storage[ids // PANEL, :, ids % PANEL, :].flatten(-2)[..., : self.shape[-1]]


@dataclass(frozen=True)
class GateUpPanels(InComputeDtype):
    """kernels.pack_gate_up's layout of a SwiGLU's fused gate-up weight [*lead, 2I, D] (gate rows
    first): the intermediate size padded to a multiple of 32, gate and up rows interleaved 16 at a
    time, then packed: [*lead, padded(I)/32, D/s, 64, s]."""

    shape: tuple[int, ...]
    step: int
    packed = served = True

    @property
    def intermediate(self) -> int:
        return self.shape[-2] // 2

    def storage_shape(self) -> tuple[int, ...]:
        *lead, _, D = self.shape
        return (*lead, kernels.padded_intermediate(self.intermediate) // (2 * TILE), D // self.step, PANEL, self.step)

    def write(self, storage: torch.Tensor, dest: tuple, values: torch.Tensor) -> None:
        lead, rows, cols = split_index(self.shape, dest)
        steps, values = input_steps(cols, values.expand(block_shape(self.shape, dest)), self.step)
        I = self.intermediate
        for half, start in enumerate((0, I)):
            first, last = max(rows.start, start), min(rows.stop, start + I)
            if first < last:
                self.write_half(storage[lead], half, first - start, values[..., first - rows.start : last - rows.start, :], steps)

    def write_half(self, panels: torch.Tensor, half: int, first: int, values: torch.Tensor, steps: slice) -> None:
        """Rows `first`, … of the gate (half 0) or up (half 1) projection = `values` [..., n, D]."""
        n, done = values.shape[-2], 0
        while done < n:
            i = first + done
            pairs = (n - done) // (2 * TILE) if i % (2 * TILE) == 0 else 0
            if pairs:  # whole panels: 32 rows of this half, as two tiles of 16, in each
                out = panels[..., i // (2 * TILE) : i // (2 * TILE) + pairs, steps, :, :].unflatten(-2, (2, 2, TILE))
                chunk = values[..., done : done + pairs * 2 * TILE, :].unflatten(-2, (pairs, 2, TILE))
                for tile in range(2):
                    copy_rows(out[..., tile, half, :, :], chunk[..., tile, :, :])
                done += pairs * 2 * TILE
            else:  # part of one tile of 16 rows
                tile, row = divmod(i, TILE)
                take = min(TILE - row, n - done)
                write_panel_rows(panels, tile * 2 * TILE + half * TILE + row, values[..., done : done + take, :], steps)
                done += take

    def padded(self) -> bool:
        """The storage holds padding (the intermediate size padded to a multiple of 32)."""
        return kernels.padded_intermediate(self.intermediate) > self.intermediate

    def zero_padding(self, storage: torch.Tensor, value: int = 0) -> None:
        *lead, _, D = self.shape
        I = self.intermediate
        pad = kernels.padded_intermediate(I) - I
        if pad:
            for half in range(2):
                self.write_half(storage, half, I, torch.full((), value, dtype=storage.dtype).expand(*lead, pad, D), slice(None))

    def read(self, storage: torch.Tensor) -> torch.Tensor:
        *lead, _, D = self.shape
        I, padded = self.intermediate, kernels.padded_intermediate(self.intermediate)
        tiles = storage.transpose(-3, -2).reshape(*lead, padded // TILE, 2, TILE, D)
        return torch.cat([tiles[..., half, :, :].reshape(*lead, padded, D)[..., :I, :] for half in range(2)], dim=-2)


@dataclass(frozen=True)
class TransposedPanels(InComputeDtype):
    """A [*lead, N, K] weight whose product takes N inputs to K outputs (`x @ w`, MLA's absorbed key
    projection): the panels of its transpose (`panels`, of shape [*lead, K, N])."""

    shape: tuple[int, ...]
    panels: Panels
    packed = served = True

    def storage_shape(self) -> tuple[int, ...]:
        return self.panels.storage_shape()

    def write(self, storage: torch.Tensor, dest: tuple, values: torch.Tensor) -> None:
        lead, rows, cols = split_index(self.shape, dest)
        swapped = (*lead, slice(cols.start, cols.stop), slice(rows.start, rows.stop))
        self.panels.write(storage, swapped, values.expand(block_shape(self.shape, dest)).transpose(-1, -2))

    def zero_padding(self, storage: torch.Tensor) -> None:
        self.panels.zero_padding(storage)

    def read(self, storage: torch.Tensor) -> torch.Tensor:
        return self.panels.read(storage).transpose(-1, -2).contiguous()

    def linear(self, x: torch.Tensor, storage: torch.Tensor, fp32_out: bool = False) -> torch.Tensor:
        return self.panels.linear(x, storage, fp32_out)


def aligned(n: int) -> int:
    return -(-n // 4) * 4


@dataclass(frozen=True)
class QuantizedPanels:
    """A quantized weight [*lead, N, K] (kernels/quant.py's format `fmt`) as the kernels read it
    (kernels.PackedQuantized), `kind` "linear", "gate_up" (a SwiGLU's fused gate-up) or "down" (its
    down projection): values, then fp32 scales (at a 4-byte boundary), then zero points, in one flat
    byte tensor, so that sleep, wake, digests and held bytes see one parameter as for any weight.

    Values lie as `Panels`/`GateUpPanels` lay bf16 weights out in steps of 2 (one byte each; int4
    two a byte, `kernels.fold_int4`; with int8 activations in steps of `kernels.value_step`, 4 or 8,
    unsigned), scales and zero points as they lay a [*lead, N, K/G] weight out in steps of 1: a
    block is written through those layouts. A block is a canonical `Quantized` one
    in `fmt` (a published checkpoint's) or a bf16/fp32 one, quantized here (`quantize`); its inputs
    must be whole groups. Padding holds zero values and scales (an fp8 byte of garbage may be NaN).
    int4 goes through one leading index's values one a byte (`kernels.unfold_int4`): the only scratch
    (and symmetric int8 with int8 activations through one offset copy of the block)."""

    shape: tuple[int, ...]
    fmt: QuantFormat
    kind: str = "linear"
    packed = True

    @property
    def served(self) -> bool:
        return kernels.built()

    def __post_init__(self):
        if self.shape[-1] % self.fmt.group:
            raise ValueError(f"a weight of {self.shape[-1]} inputs is not whole groups of {self.fmt.group}.")

    def layouts(self) -> tuple:
        """(values' layout, one byte a weight; the [*lead, N, K/G] scales' and zero points' layout)."""
        *lead, N, K = self.shape
        groups = (*lead, N, K // self.fmt.group)
        step = kernels.value_step(self.fmt)
        if self.kind == "gate_up":
            return GateUpPanels(self.shape, step), GateUpPanels(groups, 1)
        inputs = kernels.padded_intermediate(K) if self.kind == "down" else K
        return Panels(self.shape, step, inputs), Panels(groups, 1, -(-inputs // self.fmt.group))

    def sizes(self) -> tuple[int, int, int]:
        """Bytes of values, scales and zero points."""
        values, groups = (math.prod(layout.storage_shape()) for layout in self.layouts())
        return values * self.fmt.bits // 8, 4 * groups, groups if self.fmt.zero_point else 0

    def storage_shape(self) -> tuple[int, ...]:
        values, scales, zeros_ = self.sizes()
        return (aligned(values) + scales + zeros_,)

    def storage_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.uint8

    def parts(self, storage: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Views of `storage`: values (kernels.values_shape of their panels), scales and zero
        points ([..., B, X, 64, 1])."""
        value_layout, group_layout = self.layouts()
        n_values, n_scales, n_zeros = self.sizes()
        start = aligned(n_values)
        values = storage[:n_values].view(kernels.values_shape(value_layout.storage_shape(), self.fmt))
        scale = storage[start : start + n_scales].view(torch.float32).view(group_layout.storage_shape())
        zero = storage[start + n_scales :].view(group_layout.storage_shape()) if n_zeros else None
        return values, scale, zero

    def panels(self, storage: torch.Tensor) -> kernels.PackedQuantized:
        values, scale, zero = self.parts(storage)
        layout = "linear" if self.kind == "linear" else self.kind
        return kernels.PackedQuantized(values, scale.squeeze(-1), None if zero is None else zero.squeeze(-1), self.fmt,
                                       self.shape, layout)

    def quantized(self, dest: tuple, values: torch.Tensor | Quantized) -> Quantized:
        if isinstance(values, Quantized):
            if values.fmt != self.fmt:
                raise ValueError(f"a {values.fmt} block cannot be written into a {self.fmt} weight.")
            return values
        return quantize(values.expand(block_shape(self.shape, dest)), self.fmt)

    def write(self, storage: torch.Tensor, dest: tuple, values: torch.Tensor | Quantized) -> None:
        lead, rows, cols = split_index(self.shape, dest)
        G = self.fmt.group
        if cols.start % G or len(cols) % G:
            raise ValueError(f"a block of a weight quantized in groups of {G} inputs must hold whole groups, got inputs {cols.start}…{cols.stop}.")
        q = self.quantized(dest, values)
        kernels.check_packable(q)
        value_layout, group_layout = self.layouts()
        values_s, scale_s, zero_s = self.parts(storage)
        block = (*lead, slice(rows.start, rows.stop), slice(cols.start, cols.stop))
        groups = (*lead, slice(rows.start, rows.stop), slice(cols.start // G, cols.stop // G))
        levels, offset = q.values.view(torch.uint8), kernels.level_offset(self.fmt)
        if self.fmt.kind == "int4":  # through one leading index's values one a byte (the only scratch)
            scratch = kernels.unfold_int4(values_s[lead], self.fmt)
            kept = tuple(slice(None) for d in lead if isinstance(d, slice))  # the lead dims a slice keeps
            within = replace(value_layout, shape=block_shape(value_layout.shape, lead))
            within.write(scratch, (*kept, *block[len(lead):]), (levels ^ offset) & 15)
            kernels.fold_int4(scratch, values_s[lead], self.fmt)
        else:
            value_layout.write(values_s, block, levels ^ offset if offset else levels)
        group_layout.write(scale_s, groups, q.scale)
        if zero_s is not None:
            group_layout.write(zero_s, groups, q.zero.view(torch.uint8))

    def zero_padding(self, storage: torch.Tensor) -> None:
        value_layout, group_layout = self.layouts()
        values, scale, zero = self.parts(storage)
        if self.fmt.kind != "int4":  # level 0's byte (128 for symmetric int8 with int8 activations), as the kernels' packing pads
            value_layout.zero_padding(values, kernels.level_offset(self.fmt))
        elif value_layout.padded():  # every load writes the same bytes: digests compare padding too
            offset = kernels.level_offset(self.fmt)
            scratch = kernels.unfold_int4(values, self.fmt) ^ offset
            value_layout.zero_padding(scratch)
            kernels.fold_int4(scratch ^ offset, values, self.fmt)
        group_layout.zero_padding(scale)
        if zero is not None:
            group_layout.zero_padding(zero)

    def read(self, storage: torch.Tensor) -> torch.Tensor:
        """The dequantized bf16 weight (kernels/quant.py's `dequantize`)."""
        return dequantize(kernels.unpack_quantized(self.panels(storage)))

    def operand(self, storage: torch.Tensor) -> kernels.PackedQuantized | torch.Tensor:
        """What a product takes: the panels on the kernels, else the dequantized weight (torch's ops)."""
        return self.panels(storage) if self.served else self.read(storage)

    def linear(self, x: torch.Tensor, storage: torch.Tensor, fp32_out: bool = False) -> torch.Tensor:
        if self.served:
            return kernels.linear(x, self.panels(storage), self.shape[-2], fp32_out)
        y = F.linear(x, self.read(storage).to(x.dtype))
        return y.float() if fp32_out else y


def operand(param: torch.Tensor) -> torch.Tensor | kernels.PackedQuantized:
    """What a product with a parameter takes: its storage, or a quantized weight's `operand`."""
    layout = param.weight_layout
    return layout.operand(param.data) if isinstance(layout, QuantizedPanels) else param


def logical(param: torch.Tensor) -> torch.Tensor:
    """A parameter's logical weight, read back out of its layout (a new tensor)."""
    return param.weight_layout.read(param.data)


def assign(param: torch.Tensor, values: torch.Tensor) -> None:
    """Write a whole logical weight into a parameter's storage (padding included)."""
    param.weight_layout.zero_padding(param.data)
    param.weight_layout.write(param.data, (), values)


def serves(shape: tuple[int, ...], dtype: torch.dtype, device) -> bool:
    """Whether products with a [..., N, K] weight of `dtype` on `device` run on moeshard.kernels."""
    return kernels.runs(torch.empty(0, dtype=dtype, device=device)) and shape[-1] % kernels.step(dtype) == 0


def check_served(served: bool, what: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> None:
    if not served and invariance.batch_invariant():
        raise ValueError(
            f"batch-invariant mode runs every product on moeshard's CPU kernels, which cannot take {what} "
            f"({list(shape)}, {dtype}, {device})."
        )


@dataclass(frozen=True)
class Quantization:
    """`LLM(quantization=...)`: the format weights are quantized in at load, except those whose
    checkpoint module name (e.g. "lm_head", "model.layers.0.self_attn.q_proj",
    "model.layers.1.mlp.experts") matches an entry of `skip`: a name, a dotted suffix of one
    ("o_proj", "mlp.experts") or an fnmatch pattern ("model.layers.0.*")."""

    fmt: QuantFormat
    skip: tuple[str, ...] = ()

    def format_for(self, name: str) -> QuantFormat | None:
        skipped = any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, f"*.{p}") for p in self.skip)
        return None if skipped else self.fmt


def quantized_layout(shape: tuple[int, ...], fmt: QuantFormat, kind: str, dtype: torch.dtype, what: str) -> QuantizedPanels:
    if dtype != torch.bfloat16:
        raise ValueError(f"quantized weights compute in bfloat16, so {what} cannot be quantized in a {dtype} model.")
    if shape[-1] % fmt.group:
        raise ValueError(f"{what} has {shape[-1]} inputs, not whole quantization groups of {fmt.group}.")
    if fmt.activations == "int8" and not kernels.built():
        raise ValueError("int8 activations run on moeshard's CPU kernels only, which do not run here "
                         "(MOESHARD_CPU_KERNELS=0, no AVX2, or no compiler).")
    return QuantizedPanels(tuple(shape), fmt, kind)


def for_linear(shape: tuple[int, ...], dtype: torch.dtype, device, what: str,
               fmt: QuantFormat | None = None) -> Plain | Panels | QuantizedPanels:
    """Panels where moeshard.kernels serve a [..., N, K] weight, else Plain (batch-invariant mode
    refuses a weight the kernels cannot take: `what` names it); quantized panels with `fmt`."""
    if fmt is not None:
        return quantized_layout(shape, fmt, "linear", dtype, what)
    served = serves(shape, dtype, device)
    check_served(served, what, shape, dtype, device)
    return Panels(tuple(shape), kernels.step(dtype), shape[-1]) if served else Plain(tuple(shape))


def for_swiglu(
    gate_up_shape: tuple[int, ...], down_shape: tuple[int, ...], dtype: torch.dtype, device, what: str,
    fmt: QuantFormat | None = None,
) -> tuple[Plain, Plain] | tuple[GateUpPanels, Panels] | tuple[QuantizedPanels, QuantizedPanels]:
    """A SwiGLU's gate-up [.., 2I, D] and down [.., D, I] layouts: packed where the kernels serve it
    (any I: the kernels read zero rows and inputs up to the padded one); quantized with `fmt`."""
    if fmt is not None:
        return (quantized_layout(gate_up_shape, fmt, "gate_up", dtype, what),
                quantized_layout(down_shape, fmt, "down", dtype, what))
    served = serves(gate_up_shape, dtype, device)
    check_served(served, what, gate_up_shape, dtype, device)
    if not served:
        return Plain(tuple(gate_up_shape)), Plain(tuple(down_shape))
    s, padded = kernels.step(dtype), kernels.padded_intermediate(down_shape[-1])
    return GateUpPanels(tuple(gate_up_shape), s), Panels(tuple(down_shape), s, padded)
