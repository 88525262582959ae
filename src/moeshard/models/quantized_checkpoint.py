"""Quantized checkpoints as published, read into the canonical form (moeshard.kernels.quant).

A checkpoint's config.json `quantization_config` names its layout; `layout_of` reads it into one
of four layouts, each able to read a block of a weight's rows and columns (what a tensor- or
expert-parallel rank holds) as a canonical `Quantized`, reading only the stored bytes that block
needs (safetensors slices), and to write one (the test checkpoints of moeshard.verify.quantized):

| layout | quant_method | a weight X [N, K] is stored as | followed |
|---|---|---|---|
| `Fp8Block` | fp8 (DeepSeek-V3, Qwen3-*-FP8) | X.weight float8_e4m3fn [N, K], X.weight_scale_inv fp32 [⌈N/bn⌉, ⌈K/bk⌉] | DeepSeek-V3 inference/kernel.py `weight_dequant`; transformers integrations/finegrained_fp8.py |
| `PackQuantized` | compressed-tensors, format pack-quantized (W4A16, W8A16) | X.weight_packed int32 [N, K/p], X.weight_scale [N, ⌈K/G⌉], X.weight_zero_point int32 [⌈N/p⌉, ⌈K/G⌉] (asymmetric), X.weight_shape [2] | compressed_tensors compressors/quantized_compressors/pack_quantized.py, quantization/lifecycle/forward.py `_dequantize` |
| `Gptq` | gptq (desc_act false) | X.qweight int32 [K/p, N], X.qzeros int32 [⌈K/G⌉, N/p], X.scales fp16 [⌈K/G⌉, N], X.g_idx [K] | GPTQModel nn_modules/qlinear/__init__.py `dequantize_weight`, utils/model.py `convert_gptq_v1_to_v2_format_module` |
| `Awq` | awq, version gemm | X.qweight int32 [K, N/8], X.qzeros int32 [⌈K/G⌉, N/8], X.scales fp16 [⌈K/G⌉, N] | AutoAWQ awq/utils/packing_utils.py `dequantize_gemm` |

p = 32 / bits integers per int32 word, the first in the lowest bits (AWQ: in the order
`AWQ_PACK_ORDER`). Canonical integers: a symmetric layout gives signed values without zero points
(int4 −8…7, int8 −128…127: the stored level minus 2^(bits−1), which is its zero point); an
asymmetric one the stored unsigned levels and zero points (GPTQ v1 stores each zero point minus
one). Scales are exact in fp32, so dequantizing the canonical form gives each reference's exact
product (level − zero) · scale rounded once to bf16. (References that multiply in fp16 or bf16
themselves — AWQ's and GPTQ's torch paths, transformers' FP8 backward — round that product once
more first; the product itself is exact in fp32.)

Groups: a checkpoint's scale covers G inputs (an FP8 block: bk inputs × bn outputs), the last
group of a row possibly short (⌈K/G⌉ groups). The canonical group is g = gcd(G, K), each stored
scale repeated over the canonical groups it covers (g = G whenever G divides K, as in published
checkpoints); FP8 block scales are repeated over their rows.

Which weights are quantized: those whose packed tensors the checkpoint holds (DeepSeek-V3 lists no
modules, yet its routers and LM head are bf16). Each layout also reads its config's list of
modules left as shipped, with its reference's matching rule, and a weight both listed and packed
is refused.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import torch

from moeshard.kernels.quant import FP8_MAX, QuantFormat, Quantized, dequantize, quantize
from moeshard.models.checkpoint import Checkpoint, CheckpointError, TensorSource, read_config

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's AWQ_ORDER: word field i holds column AWQ_PACK_ORDER[i]
STRAIGHT = tuple(range(8))


def field_shifts(bits: int, order: tuple[int, ...]) -> torch.Tensor:
    """The bit offset, within its int32 word, of each of the word's 32/bits integers in logical order."""
    return torch.tensor([bits * order.index(j) for j in range(32 // bits)], dtype=torch.int32)


def unpack(words: torch.Tensor, bits: int, order: tuple[int, ...] = STRAIGHT) -> torch.Tensor:
    """int32 [..., W] → the unsigned integers they pack, [..., W·32/bits] (int32)."""
    fields = (words.unsqueeze(-1) >> field_shifts(bits, order)) & ((1 << bits) - 1)
    return fields.flatten(-2)


def pack(levels: torch.Tensor, bits: int, order: tuple[int, ...] = STRAIGHT) -> torch.Tensor:
    """Unsigned integers [..., L] → int32 [..., ⌈L·bits/32⌉], the last word padded with zeros."""
    per = 32 // bits
    padded = torch.nn.functional.pad(levels.long(), (0, -levels.shape[-1] % per))
    word = (padded.unflatten(-1, (-1, per)) << field_shifts(bits, order).long()).sum(-1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)  # the bit pattern as int32


def words_of(span: range, per: int) -> tuple[slice, slice]:
    """The packed words that hold integers `span` (packed `per` to a word), and where `span` lies
    among their unpacked integers."""
    first = span.start // per
    start = span.start - first * per
    return slice(first, -(-span.stop // per)), slice(start, start + len(span))


def group_map(span: range, stored: int, canonical: int) -> tuple[slice, torch.Tensor]:
    """Canonical groups of `canonical` inputs over `span` → the stored groups (of `stored`) to read,
    and which of them each canonical group takes."""
    first = span.start // stored
    last = (span.stop - 1) // stored
    return slice(first, last + 1), torch.arange(span.start, span.stop, canonical) // stored - first


def coarsen(t_NG: torch.Tensor, K: int, stored: int, canonical: int) -> torch.Tensor:
    """Per canonical group [N, K/canonical] → per stored group [N, ⌈K/stored⌉] (the inverse of
    `group_map`), refusing values that differ within a stored group."""
    _, pick = group_map(range(K), stored, canonical)
    coarse = t_NG[:, torch.arange(0, K, stored) // canonical]
    if not torch.equal(coarse[:, pick], t_NG):
        raise ValueError(f"these scales or zero points are not constant over stored groups of {stored} inputs.")
    return coarse


def whole_groups(span: range, K: int, group: int, name: str) -> None:
    if span.start % group or (span.stop % group and span.stop != K):
        raise CheckpointError(
            f"columns {span.start}:{span.stop} of {name} are not whole quantization groups of {group} inputs."
        )


def to_range(index, size: int, what: str, name: str) -> range:
    if not isinstance(index, slice) or index.step not in (None, 1):
        raise CheckpointError(f"{name} is quantized: its {what} are read as one contiguous slice, not {index!r}.")
    return range(*index.indices(size))


def int_values(levels: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """Integers in `fmt.levels` in the canonical dtype (uint8 for int8 with zero points, else int8)."""
    return levels.to(torch.uint8 if fmt.levels[1] > 127 else torch.int8)


@dataclass(frozen=True)
class Layout:
    """How one checkpoint stores its quantized weights (one subclass per published layout)."""

    ignore: tuple[str, ...] = ()  # modules left as shipped, in the layout's own syntax (see `skips`)

    marker: ClassVar[str] = ""  # the suffix whose tensor says a weight is stored quantized
    scale: ClassVar[str] = ""  # the suffix of its scales
    suffixes: ClassVar[tuple[str, ...]] = ()  # every suffix a quantized weight may store

    def kind(self) -> str:
        raise NotImplementedError

    def group(self) -> int:
        """G: inputs per stored scale."""
        raise NotImplementedError

    def zero_point(self) -> bool:
        return False

    def fmt(self, K: int) -> QuantFormat:
        """The canonical format of a weight of K inputs."""
        return QuantFormat(self.kind(), math.gcd(self.group(), K), self.zero_point())

    def skips(self, module: str) -> bool:
        """`module` is listed in the config as not quantized."""
        raise NotImplementedError

    def config(self) -> dict:
        """The `quantization_config` a checkpoint of this layout carries."""
        raise NotImplementedError

    def shape(self, source: TensorSource, module: str) -> tuple[int, int]:
        """The weight's logical [N, K]."""
        raise NotImplementedError

    def stored_shapes(self, N: int, K: int) -> dict[str, tuple[int, ...]]:
        """The tensors a weight [N, K] must store, by suffix, and their shapes."""
        raise NotImplementedError

    def read(self, source: TensorSource, module: str, rows: range, cols: range, K: int) -> Quantized:
        """Rows `rows`, columns `cols` (whole canonical groups) of the weight, as stored in `source`."""
        raise NotImplementedError

    def encode(self, q: Quantized) -> dict[str, torch.Tensor]:
        """A whole weight [N, K] in canonical form → its stored tensors, by suffix."""
        raise NotImplementedError

    def quantize(self, w_NK: torch.Tensor) -> Quantized:
        """A bf16/fp32 weight [N, K] quantized as this layout stores it (the form `encode` takes):
        what a checkpoint of this layout holds for it, and what a bf16 update is written as."""
        raise NotImplementedError

    def storing_scales(self, dtype: torch.dtype) -> "Layout":
        """This layout, its `quantize` rounding scales to `dtype` (as a checkpoint stores them)."""
        return self


@dataclass(frozen=True)
class Fp8Block(Layout):
    """Block FP8: `weight_block_size` [bn, bk], one fp32 `weight_scale_inv` per block, by which the
    fp8 weight is multiplied (the name notwithstanding). DeepSeek-V3's `weight_dequant` multiplies
    in fp32 and stores bf16: the canonical definition."""

    block: tuple[int, int] = (128, 128)

    marker = scale = ".weight_scale_inv"
    suffixes = (".weight", ".weight_scale_inv")
    scale_dtype: ClassVar[torch.dtype] = torch.float32

    def kind(self) -> str:
        return "fp8"

    def group(self) -> int:
        return self.block[1]

    def skips(self, module: str) -> bool:
        # transformers quantizers/quantizers_utils.py `should_convert_module` (modules_to_not_convert):
        # a regex from the start up to a module boundary, or a suffix.
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        return any(re.match(rf"(?:{key}){boundary}", module) or module.endswith(key) for key in self.ignore)

    def config(self) -> dict:
        cfg = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=list(self.block))
        return cfg | ({"modules_to_not_convert": list(self.ignore)} if self.ignore else {})

    def shape(self, source, module):
        return tuple(source.shape(f"{module}.weight"))

    def stored_shapes(self, N, K):
        bn, bk = self.block
        return {".weight": (N, K), ".weight_scale_inv": (-(-N // bn), -(-K // bk))}

    def read(self, source, module, rows, cols, K):
        bn, bk = self.block
        values = source.block(f"{module}.weight", (slice(rows.start, rows.stop), slice(cols.start, cols.stop)))
        if values.dtype != torch.float8_e4m3fn:
            raise CheckpointError(f"{module}.weight is stored as {values.dtype}; block FP8 weights are float8_e4m3fn.")
        fmt = self.fmt(K)
        block_rows, pick_rows = group_map(rows, bn, 1)
        block_cols, pick_cols = group_map(cols, bk, fmt.group)
        scale = source.block(f"{module}.weight_scale_inv", (block_rows, block_cols)).float()
        return Quantized(values, scale[pick_rows][:, pick_cols], None, fmt)

    def quantize(self, w_NK):
        """One scale per bn × bk block (the last ones short), max |w| / 448, as DeepSeek-V3's FP8 is made."""
        (N, K), (bn, bk) = w_NK.shape, self.block
        padded = torch.nn.functional.pad(w_NK.float(), (0, -K % bk, 0, -N % bn))
        scale = padded.unflatten(0, (-1, bn)).unflatten(2, (-1, bk)).abs().amax((1, 3)) / FP8_MAX
        safe = torch.where(scale > 0, scale, 1.0).repeat_interleave(bn, 0).repeat_interleave(bk, 1)
        values = (padded / safe).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)[:N, :K]
        fmt = self.fmt(K)
        _, rows = group_map(range(N), bn, 1)
        _, cols = group_map(range(K), bk, fmt.group)
        return Quantized(values, scale[rows][:, cols], None, fmt)

    def encode(self, q):
        (N, K), (bn, bk) = q.shape, self.block
        per_row_block = coarsen(q.scale, K, bk, q.fmt.group)
        scale_inv = coarsen(per_row_block.T, N, bn, 1).T
        return {".weight": q.values, ".weight_scale_inv": scale_inv.float().contiguous()}


@dataclass(frozen=True)
class IntLayout(Layout):
    """The integer layouts: `bits` 4 or 8, G = `group_size` inputs per scale."""

    bits: int = 4
    group_size: int = 128
    symmetric: bool = True
    # How `encode` stores scales; a checkpoint's are read as they are, so the config does not say.
    scale_dtype: torch.dtype = field(default=torch.float16, compare=False)

    def kind(self) -> str:
        return f"int{self.bits}"

    def group(self) -> int:
        return self.group_size

    def zero_point(self) -> bool:
        return not self.symmetric

    @property
    def per(self) -> int:
        return 32 // self.bits

    @property
    def middle(self) -> int:
        return 1 << (self.bits - 1)

    def canonical(self, levels: torch.Tensor, zero: torch.Tensor | None, scale: torch.Tensor, fmt, module: str):
        """Unsigned stored levels and zero points [N, K'] → canonical (symmetric: signed, no zeros)."""
        if self.symmetric:
            if zero is not None and not bool((zero == self.middle).all()):
                raise CheckpointError(f"{module} is declared symmetric, but its zero points are not all {self.middle}.")
            return Quantized((levels - self.middle).to(torch.int8), scale, None, fmt)
        return Quantized(int_values(levels, fmt), scale, int_values(zero, fmt), fmt)

    def quantize(self, w_NK):
        """kernels.quant.quantize over groups of G (the last one short: padding with zeros moves
        neither max |w| nor [min, max], which include 0), scales rounded to `scale_dtype`."""
        N, K = w_NK.shape
        fmt, G = self.fmt(K), self.group_size
        whole = quantize(torch.nn.functional.pad(w_NK.float(), (0, -K % G)), QuantFormat(fmt.kind, G, fmt.zero_point))
        _, cols = group_map(range(K), G, fmt.group)
        zero = None if whole.zero is None else whole.zero[:, cols]
        return Quantized(whole.values[:, :K], whole.scale.to(self.scale_dtype).float()[:, cols], zero, fmt)

    def storing_scales(self, dtype):
        return replace(self, scale_dtype=dtype)

    def common_config(self, method: str) -> dict:
        """What GPTQ's and AWQ's configs share."""
        return dict(quant_method=method, bits=self.bits, group_size=self.group_size)

    def stored_levels(self, q: Quantized) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Canonical → unsigned levels [N, K], and per stored group [N, ⌈K/G⌉] the zero points (a
        symmetric weight's: the middle level) and scales, in the layout's dtype."""
        K = q.shape[1]
        scale = coarsen(q.scale, K, self.group_size, q.fmt.group).to(self.scale_dtype)
        if self.symmetric:
            return q.values.long() + self.middle, torch.full(scale.shape, self.middle, dtype=torch.long), scale
        return q.values.long(), coarsen(q.zero.long(), K, self.group_size, q.fmt.group), scale


@dataclass(frozen=True)
class PackQuantized(IntLayout):
    """compressed-tensors `pack-quantized`: rows of int32 words along K, stored integers offset by
    2^(bits−1) (`pack_to_int32`), asymmetric zero points packed along N."""

    scale_dtype: torch.dtype = field(default=torch.bfloat16, compare=False)

    marker = ".weight_packed"
    scale = ".weight_scale"
    suffixes = (".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_shape")

    def skips(self, module: str) -> bool:
        # compressed_tensors utils/match.py `_match_name`: "re:" + a regex matched from the start, or the exact name.
        return any(
            re.match(entry[3:], module) if entry.startswith("re:") else entry == module for entry in self.ignore
        )

    def config(self) -> dict:
        weights = dict(
            num_bits=self.bits,
            type="int",
            symmetric=self.symmetric,
            strategy="group",
            group_size=self.group_size,
            dynamic=False,
            actorder=None,
            observer="minmax",
        )
        return dict(
            quant_method="compressed-tensors",
            format="pack-quantized",
            quantization_status="compressed",
            config_groups=dict(
                group_0=dict(targets=["Linear"], weights=weights, input_activations=None, output_activations=None)
            ),
            ignore=list(self.ignore),
            kv_cache_scheme=None,
            sparsity_config={},
        )

    def shape(self, source, module):
        return tuple(int(n) for n in source.block(f"{module}.weight_shape", ()))

    def stored_shapes(self, N, K):
        groups, p = -(-K // self.group_size), self.per
        zero = {} if self.symmetric else {".weight_zero_point": (-(-N // p), groups)}
        return {".weight_packed": (N, -(-K // p)), ".weight_scale": (N, groups), ".weight_shape": (2,)} | zero

    def read(self, source, module, rows, cols, K):
        fmt = self.fmt(K)
        words, within = words_of(cols, self.per)
        levels = unpack(source.block(f"{module}.weight_packed", (slice(rows.start, rows.stop), words)), self.bits)
        groups, pick = group_map(cols, self.group_size, fmt.group)
        scale = source.block(f"{module}.weight_scale", (slice(rows.start, rows.stop), groups)).float()[:, pick]
        zero = None
        if not self.symmetric:
            zwords, zwithin = words_of(rows, self.per)
            zero = unpack(source.block(f"{module}.weight_zero_point", (zwords, groups)).T, self.bits)
            zero = zero[:, zwithin].T[:, pick]
        return self.canonical(levels[:, within], zero, scale, fmt, module)

    def encode(self, q):
        levels, zero, scale = self.stored_levels(q)
        stored = {
            ".weight_packed": pack(levels, self.bits),
            ".weight_scale": scale,
            ".weight_shape": torch.tensor(q.shape, dtype=torch.int64),
        }
        if not self.symmetric:
            stored[".weight_zero_point"] = pack(zero.T, self.bits).T.contiguous()
        return stored


@dataclass(frozen=True)
class Gptq(IntLayout):
    """GPTQ (AutoGPTQ, GPTQModel): qweight packed along K, qzeros along N, [K-groups, N] scales;
    `v1` (checkpoint_format "gptq") stores each zero point minus one. Act-order is refused."""

    v1: bool = True
    lm_head: bool = False  # GPTQModel's flag: the LM head is quantized too

    marker = ".qweight"
    scale = ".scales"
    suffixes = (".qweight", ".qzeros", ".scales", ".g_idx")

    def skips(self, module: str) -> bool:
        # GPTQModel's `dynamic`: "-:" + a regex (re.match) excludes a module; `lm_head` false leaves it.
        return (module == "lm_head" and not self.lm_head) or any(re.match(p, module) for p in self.ignore)

    def config(self) -> dict:
        return self.common_config("gptq") | dict(
            desc_act=False,
            sym=self.symmetric,
            static_groups=False,
            true_sequential=True,
            lm_head=self.lm_head,
            checkpoint_format="gptq" if self.v1 else "gptq_v2",
            dynamic={f"-:{p}": {} for p in self.ignore} or None,
        )

    def shape(self, source, module):
        K_words, N = source.shape(f"{module}.qweight")
        return N, K_words * self.per

    def stored_shapes(self, N, K):
        groups, p = -(-K // self.group_size), self.per
        return {".qweight": (-(-K // p), N), ".qzeros": (groups, -(-N // p)), ".scales": (groups, N)}

    def read(self, source, module, rows, cols, K):
        fmt, n = self.fmt(K), slice(rows.start, rows.stop)
        g_idx = source.block(f"{module}.g_idx", (slice(cols.start, cols.stop),)) if f"{module}.g_idx" in source else None
        if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(cols.start, cols.stop) // self.group_size):
            raise CheckpointError(f"{module}.g_idx is not in input order (act-order, desc_act), which moeshard does not read.")
        words, within = words_of(cols, self.per)
        levels = unpack(source.block(f"{module}.qweight", (words, n)).T, self.bits)[:, within]
        groups, pick = group_map(cols, self.group_size, fmt.group)
        scale = source.block(f"{module}.scales", (groups, n)).float().T[:, pick]
        zwords, zwithin = words_of(rows, self.per)
        zero = unpack(source.block(f"{module}.qzeros", (groups, zwords)), self.bits)[:, zwithin]
        if self.v1:
            zero = (zero + 1) & ((1 << self.bits) - 1)
        return self.canonical(levels, zero.T[:, pick], scale, fmt, module)

    def encode(self, q):
        levels, zero, scale = self.stored_levels(q)
        if self.v1:
            zero = (zero - 1) & ((1 << self.bits) - 1)
        K = q.shape[1]
        return {
            ".qweight": pack(levels, self.bits).T.contiguous(),
            ".qzeros": pack(zero.T, self.bits),
            ".scales": scale.T.contiguous(),
            ".g_idx": (torch.arange(K) // self.group_size).to(torch.int32),
        }


@dataclass(frozen=True)
class Awq(IntLayout):
    """AWQ GEMM (AutoAWQ): qweight [K, N/8] and qzeros packed along N in AWQ's field order, always
    with zero points; 4 bits."""

    bits: int = 4
    symmetric: bool = False

    marker = ".qweight"
    scale = ".scales"
    suffixes = (".qweight", ".qzeros", ".scales")

    def skips(self, module: str) -> bool:
        # AutoAWQ `exclude_layers_to_not_quantize` and vLLM `is_layer_skipped_awq`: a substring.
        return any(entry in module for entry in self.ignore)

    def config(self) -> dict:
        return self.common_config("awq") | dict(
            zero_point=True,
            version="gemm",
            modules_to_not_convert=list(self.ignore) or None,
        )

    def shape(self, source, module):
        K, N_words = source.shape(f"{module}.qweight")
        return N_words * self.per, K

    def stored_shapes(self, N, K):
        groups, words = -(-K // self.group_size), -(-N // self.per)
        return {".qweight": (K, words), ".qzeros": (groups, words), ".scales": (groups, N)}

    def read(self, source, module, rows, cols, K):
        fmt = self.fmt(K)
        words, within = words_of(rows, self.per)
        qweight = source.block(f"{module}.qweight", (slice(cols.start, cols.stop), words))
        levels = unpack(qweight, self.bits, AWQ_PACK_ORDER)[:, within].T
        groups, pick = group_map(cols, self.group_size, fmt.group)
        scale = source.block(f"{module}.scales", (groups, slice(rows.start, rows.stop))).float().T[:, pick]
        zero = unpack(source.block(f"{module}.qzeros", (groups, words)), self.bits, AWQ_PACK_ORDER)[:, within]
        return self.canonical(levels, zero.T[:, pick], scale, fmt, module)

    def encode(self, q):
        levels, zero, scale = self.stored_levels(q)
        return {
            ".qweight": pack(levels.T, self.bits, AWQ_PACK_ORDER),
            ".qzeros": pack(zero.T, self.bits, AWQ_PACK_ORDER),
            ".scales": scale.T.contiguous(),
        }


def fp8_layout(qc: dict) -> Fp8Block:
    block = qc.get("weight_block_size")
    if block is None:
        raise CheckpointError("per-tensor FP8 checkpoints (no weight_block_size) are not supported; moeshard reads block-scaled FP8.")
    if len(block) != 2 or min(block) < 1:
        raise CheckpointError(f"weight_block_size must be two positive sizes, got {block}.")
    if str(qc.get("fmt", "e4m3")).lower() not in ("e4m3", "float8_e4m3fn"):
        raise CheckpointError(f"FP8 format {qc['fmt']!r} is not supported; moeshard reads e4m3 weights.")
    if qc.get("scale_fmt", "float") != "float":
        raise CheckpointError(f"FP8 scales stored as {qc['scale_fmt']!r} are not supported; moeshard reads fp32 weight_scale_inv.")
    if str(qc.get("activation_scheme", "dynamic")).lower() != "dynamic":
        raise CheckpointError("FP8 checkpoints with static activation scales are not supported; moeshard reads activation_scheme dynamic.")
    ignore = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()
    return Fp8Block(tuple(ignore), (int(block[0]), int(block[1])))


def pack_quantized_layout(qc: dict) -> PackQuantized:
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise CheckpointError("this compressed-tensors checkpoint has no config_groups, so no quantized weights.")
    if qc.get("transform_config") or qc.get("kv_cache_scheme") or (qc.get("sparsity_config") or {}).get("format", "dense") != "dense":
        raise CheckpointError("compressed-tensors transforms, sparsity and quantized KV caches are not supported; moeshard reads weight-only quantization.")
    schemes = set()
    for group in groups:
        fmt, w = group.get("format") or qc.get("format"), group.get("weights") or {}
        if fmt != "pack-quantized":
            raise CheckpointError(f"compressed-tensors format {fmt!r} is not supported; moeshard reads pack-quantized.")
        if group.get("input_activations") or group.get("output_activations"):
            raise CheckpointError("compressed-tensors checkpoints with quantized activations are not supported; moeshard reads weight-only (W4A16, W8A16).")
        if w.get("type", "int") != "int" or w.get("num_bits") not in (4, 8):
            raise CheckpointError(f"{w.get('type', 'int')} weights of {w.get('num_bits')} bits are not supported; moeshard reads int4 and int8.")
        if w.get("strategy") != "group" or not w.get("group_size"):
            raise CheckpointError(f"compressed-tensors strategy {w.get('strategy')!r} is not supported; moeshard reads per-group scales.")
        if w.get("actorder") not in (None, "weight", "static"):
            raise CheckpointError(f"compressed-tensors actorder {w['actorder']!r} (a g_idx per weight) is not supported.")
        if w.get("dynamic"):
            raise CheckpointError("dynamically quantized weights are not supported; moeshard reads weights quantized in the checkpoint.")
        schemes.add((w["num_bits"], int(w["group_size"]), bool(w.get("symmetric", True))))
    if len(schemes) > 1:
        raise CheckpointError(f"this compressed-tensors checkpoint mixes weight schemes {sorted(schemes)}; moeshard reads one per checkpoint.")
    (bits, group, symmetric), = schemes
    return PackQuantized(tuple(qc.get("ignore") or ()), bits, group, symmetric)


def gptq_layout(qc: dict) -> Gptq:
    bits, group = qc.get("bits"), qc.get("group_size", 128)
    if bits not in (4, 8):
        raise CheckpointError(f"GPTQ weights of {bits} bits are not supported; moeshard reads 4- and 8-bit weights.")
    if qc.get("desc_act"):
        raise CheckpointError("act-order GPTQ checkpoints (desc_act true) are not supported; quantize with desc_act false.")
    if group is None or group < 1:
        raise CheckpointError(f"GPTQ group_size {group} (one scale per output) is not supported; moeshard reads per-group scales.")
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise CheckpointError(f"GPTQ checkpoint format {fmt!r} is not supported; moeshard reads gptq and gptq_v2.")
    if qc.get("pack_dtype", "int32") != "int32":
        raise CheckpointError(f"GPTQ weights packed in {qc['pack_dtype']} are not supported; moeshard reads int32 words.")
    dynamic = qc.get("dynamic") or {}
    if any(not key.startswith("-:") for key in dynamic):
        raise CheckpointError("per-module GPTQ overrides (dynamic) are not supported; moeshard reads one scheme per checkpoint.")
    ignore = tuple(key[2:] for key in dynamic)
    return Gptq(
        ignore, bits, group, bool(qc.get("sym", True)), v1=fmt == "gptq", lm_head=bool(qc.get("lm_head", False))
    )


def awq_layout(qc: dict) -> Awq:
    bits, version = qc.get("bits", qc.get("w_bit")), str(qc.get("version", "gemm")).lower()
    if bits != 4:
        raise CheckpointError(f"AWQ weights of {bits} bits are not supported; moeshard reads 4-bit AWQ.")
    if version != "gemm":
        raise CheckpointError(f"the AWQ {version} layout is not supported; moeshard reads the gemm layout.")
    if not qc.get("zero_point", True):
        raise CheckpointError("AWQ without zero points is not supported; moeshard reads zero_point true.")
    group = qc.get("group_size", qc.get("q_group_size", 128))
    return Awq(tuple(qc.get("modules_to_not_convert") or ()), group_size=int(group))


LAYOUTS = {"fp8": fp8_layout, "compressed-tensors": pack_quantized_layout, "gptq": gptq_layout, "awq": awq_layout}


def layout_of(config: dict) -> Layout | None:
    """The quantized layout a checkpoint's config.json declares (None: not quantized)."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in LAYOUTS:
        raise CheckpointError(f"quantization method {method!r} is not supported; moeshard reads {', '.join(LAYOUTS)} checkpoints.")
    return LAYOUTS[method](qc)


class QuantizedSource(TensorSource):
    """A TensorSource over a quantized checkpoint's stored tensors (or an update in that layout).

    A weight `X.weight` stored quantized (`quantized(name)` gives its canonical format) is read as
    a canonical block with `read_quantized`, or, through `read`, dequantized to bf16 (what a bf16
    parameter takes). Reading it counts every tensor the weight is stored as (`stored_names`), so
    `finish` does not refuse its scales and zero points as unused. Other tensors pass through.
    """

    def __init__(self, stored: TensorSource, layout: Layout):
        super().__init__(stored.label)
        self.stored, self.layout, self.partial = stored, layout, stored.partial

    def module_of(self, name: str) -> str | None:
        """The module whose weight `name` is stored quantized, or None."""
        module = name.removesuffix(".weight")
        if module == name or module + self.layout.marker not in self.stored:
            return None
        if self.layout.skips(module):
            raise CheckpointError(f"{module} is stored quantized, but the checkpoint's quantization_config lists it as not quantized.")
        return module

    def quantized(self, name: str) -> QuantFormat | None:
        """The canonical format of weight `name` if the checkpoint stores it quantized, else None."""
        module = self.module_of(name)
        return None if module is None else self.layout.fmt(self.layout.shape(self.stored, module)[1])

    def stored_names(self, name: str) -> tuple[str, ...]:
        module = self.module_of(name)
        if module is None:
            return (name,)
        return tuple(module + s for s in self.layout.suffixes if module + s in self.stored)

    def __contains__(self, name: str) -> bool:
        return name in self.stored or self.module_of(name) is not None

    def names(self) -> list[str]:
        return self.stored.names()

    def shape(self, name: str) -> tuple[int, ...]:
        module = self.module_of(name)
        return self.stored.shape(name) if module is None else self.layout.shape(self.stored, module)

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        super().check(name, shape)
        self.stored.read_names.update(self.stored_names(name))

    def read_quantized(self, name: str, shape: tuple[int, ...], index: tuple = ()) -> Quantized:
        """Block `index` (a slice of rows, and maybe one of columns: whole groups) of the quantized
        weight `name`, whose full shape must be `shape`."""
        module = self.module_of(name)
        if module is None:
            raise CheckpointError(f"{self.label} does not store {name!r} quantized.")
        self.check(name, shape)
        N, K = shape
        rows, cols = (*index, slice(None), slice(None))[:2]
        rows, cols = to_range(rows, N, "rows", name), to_range(cols, K, "columns", name)
        for suffix, expected in self.layout.stored_shapes(N, K).items():
            stored = module + suffix
            if stored not in self.stored:
                raise CheckpointError(f"{self.label} has no tensor {stored!r}, which a quantized {name} needs.")
            if tuple(self.stored.shape(stored)) != expected:
                raise CheckpointError(
                    f"tensor {stored!r} has shape {list(self.stored.shape(stored))}, but {type(self.layout).__name__} "
                    f"stores a {list(shape)} weight's as {list(expected)} (is the config's group size right?)."
                )
        whole_groups(cols, K, self.layout.fmt(K).group, name)
        return self.layout.read(self.stored, module, rows, cols, K)

    def block(self, name: str, index: tuple) -> torch.Tensor:
        module = self.module_of(name)
        if module is None:
            return self.stored.block(name, index)
        return dequantize(self.read_quantized(name, self.shape(name), index))

    def release(self, block: torch.Tensor) -> None:
        self.stored.release(block)

    def release_quantized(self, name: str) -> None:
        """Weight `name`'s stored tensors are read: the memory held to read them may go."""
        for stored in self.stored_names(name):
            self.stored.release(self.stored.block(stored, ()))

    def finish(self, *args, **kwargs) -> None:
        self.stored.finish(*args, **kwargs)


PLAIN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # a quantized weight given plain, to quantize


class StoredFormats:
    """The weights a published quantized checkpoint stores quantized, and the formats they are held
    in (what `Quantization` is for weights quantized at load): a module group's (`model.layers.1.mlp.experts`,
    `lm_head`, …) is the one format every weight stored quantized under its name has; None where it
    has none, or several (those weights are then read dequantized into bf16 ones: correct, held larger).

    An update names such a weight as the checkpoint stores it — all of its stored tensors in one
    call (`check_whole`) — or plainly, `X.weight` in bf16 (fp16, fp32), which `encode` quantizes as
    the checkpoint stores it (its layout, its scales' dtype): then it is the same update as the
    stored tensors of a checkpoint quantized from those weights."""

    def __init__(self, source: QuantizedSource):
        stored, layout = source.stored, source.layout
        modules = [n.removesuffix(layout.marker) for n in stored.names() if n.endswith(layout.marker)]
        for m in modules:
            source.module_of(f"{m}.weight")  # refuses a weight both stored quantized and listed as not
        self.layout = layout
        self.shapes = {m: tuple(layout.shape(stored, m)) for m in modules}  # logical [N, K]
        self.names = {m: source.stored_names(f"{m}.weight") for m in modules}  # what the checkpoint stores for each
        self.layouts = {m: layout.storing_scales(stored.block(m + layout.scale, ()).dtype) for m in modules}
        by_prefix: dict[str, set[QuantFormat]] = {}
        for m, (_, K) in self.shapes.items():
            parts = m.split(".")
            for i in range(1, len(parts) + 1):
                by_prefix.setdefault(".".join(parts[:i]), set()).add(layout.fmt(K))
        self.formats = {prefix: formats.pop() for prefix, formats in by_prefix.items() if len(formats) == 1}

    def format_for(self, name: str) -> QuantFormat | None:
        return self.formats.get(name)

    def module_of(self, name: str) -> str | None:
        """The module whose stored tensor, or plain weight, `name` is (None: not a weight stored quantized)."""
        for suffix in (".weight", *self.layout.suffixes):
            if name.endswith(suffix) and name.removesuffix(suffix) in self.shapes:
                return name.removesuffix(suffix)
        return None

    def plain(self, name: str) -> str | None:
        """The module if `name` is the plain weight (`X.weight`) of one stored quantized."""
        module = name.removesuffix(".weight")
        return module if module != name and module in self.shapes else None

    def is_plain(self, name: str, dtype: torch.dtype) -> bool:
        return self.plain(name) is not None and dtype in PLAIN_DTYPES

    def check_whole(self, named: list[tuple[str, torch.dtype]]) -> set[str]:
        """Refuse an update that gives a weight stored quantized in part: some of its stored tensors
        without the others, or those and its plain weight too. Returns the modules given plainly."""
        given: dict[str, list[str]] = {}
        plain = set()
        for name, dtype in named:
            module = self.module_of(name)
            if module is None:
                continue
            if self.is_plain(name, dtype):
                plain.add(module)
            else:
                given.setdefault(module, []).append(name)
        for module, names in given.items():
            if module in plain:
                raise ValueError(f"the update gives {module} both as a plain weight and as its stored tensors; nothing was written.")
            missing = [n for n in self.names[module] if n not in names]
            if missing:
                raise ValueError(
                    f"update tensor {names[0]!r} comes without {missing[0]!r}: a weight stored quantized is updated "
                    "with all of its stored tensors in one call; nothing was written."
                )
        return plain

    def encode(self, name: str, w_NK: torch.Tensor) -> dict[str, torch.Tensor]:
        """The plain weight `name` of a module stored quantized → the tensors the checkpoint would store."""
        module = self.plain(name)
        layout = self.layouts[module]
        return {module + suffix: t for suffix, t in layout.encode(layout.quantize(w_NK)).items()}

    def as_stored(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """An update's tensors, each plain weight of a module stored quantized replaced by its stored tensors."""
        out = {}
        for name, tensor in tensors.items():
            out.update(self.encode(name, tensor) if self.is_plain(name, tensor.dtype) else {name: tensor})
        return out

    def validate(self, tensors: TensorSource, modules) -> None:
        """Read each of `modules` whole from an update's stored tensors, refusing what a load would
        refuse (act-order, zero points off the middle of a symmetric layout, …) before any is written."""
        source = QuantizedSource(tensors, self.layout)
        for module in modules:
            try:
                source.read_quantized(f"{module}.weight", self.shapes[module])
            except CheckpointError as exc:
                raise ValueError(f"{str(exc).rstrip('.')}; nothing was written.") from None


def open_checkpoint(directory: str | Path) -> TensorSource:
    """A checkpoint directory as a TensorSource: quantized weights read as `QuantizedSource` reads them."""
    layout = layout_of(read_config(directory))
    return Checkpoint(directory) if layout is None else QuantizedSource(Checkpoint(directory), layout)
