"""`moeshard bench checkpoint`: a random model of a bench shape (bench e2e's MODEL_SHAPES) at any
depth, written as a published int4 checkpoint ships — compressed-tensors `pack-quantized` W4A16,
groups of 128, symmetric (models/quantized_checkpoint.py's `PackQuantized`), the LM head and the
routers left bf16 (its `ignore` list), the embedding table and the norms bf16 too — so a full-depth
Qwen3-30B-A3B (48 layers: ~61 GB in bf16, ~16 GB so) is written without ever being held.

Tensors are written as they are drawn, a piece of at most 64 MiB at a time, straight into their
safetensors file (one shard per decoder layer, one for the rest, and the index), the headers
computed first. Tensor names and shapes are transformers' own (its model on the meta device, named
as `save_pretrained` names them). Values: an int4 weight's integers uniform over −8…7 (random words),
one scale per group, so that the dequantized weight has `verify.tiny.spread`'s std (1/√fan_in, as
the bf16 bench models are drawn); the bf16 tensors drawn normal with their `spread`. Beside them a
tokenizer whose every id is one word "t<id>" (`bench serve`'s), so `moeshard serve` takes text.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import transformers
from rich.console import Console
from rich.progress import Progress

from moeshard.bench.serve import word_tokenizer
from moeshard.models.checkpoint import SAFETENSORS_DTYPES
from moeshard.models.quantized_checkpoint import PackQuantized
from moeshard.verify.tiny import spread

# What llm-compressor's W4A16 recipe leaves as shipped: the LM head and the MoE routers.
LAYOUT = PackQuantized(("lm_head", "re:.*mlp.gate$"), bits=4, group_size=128, symmetric=True)
NIBBLES = 0x1111111111111111  # the lowest bit of each of an int64's 16 nibbles
LEVEL_STD = math.sqrt(2 * sum(k * k for k in range(1, 8)) / 16)  # of `int4_words`' integers
PIECE_BYTES = 64 * 2**20
STORED_DTYPES = {".weight_packed": torch.int32, ".weight_scale": LAYOUT.scale_dtype, ".weight_shape": torch.int64}
SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def weight_shapes(config: transformers.PretrainedConfig) -> tuple[str, dict[str, tuple[int, ...]]]:
    """The architecture and the tensors transformers' `save_pretrained` writes for `config`, with
    their shapes (its model built on the meta device: nothing is allocated)."""
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(t.shape) for name, t in revert_weight_conversion(model, model.state_dict()).items()}
    return type(model).__name__, shapes


def quantizes(name: str, shape: tuple[int, ...]) -> bool:
    module = name.removesuffix(".weight")
    return module != name and len(shape) == 2 and "embed_tokens" not in module and not LAYOUT.skips(module)


def stored(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The tensors weight `name` is stored as: its int4 layout's, or itself in `dtype`."""
    if not quantizes(name, shape):
        return {name: (dtype, shape)}
    module = name.removesuffix(".weight")
    return {module + suffix: (STORED_DTYPES[suffix], s) for suffix, s in LAYOUT.stored_shapes(*shape).items()}


def pieces(shape: tuple[int, ...], dtype: torch.dtype) -> Iterator[int]:
    """Rows per piece of at most PIECE_BYTES, cutting a tensor along its first dim."""
    row = math.prod(shape[1:]) * dtype.itemsize
    rows, step = shape[0] if shape else 1, max(1, PIECE_BYTES // max(row, 1))
    for first in range(0, rows, step):
        yield min(step, rows - first)


def draw(name: str, dtype: torch.dtype, shape: tuple[int, ...], weight: str, weight_shape: tuple[int, ...],
         g: torch.Generator) -> Iterator[torch.Tensor]:
    """Stored tensor `name` (of weight `weight`, shaped `weight_shape`), a piece at a time."""
    std, mean = spread(weight, weight_shape[-1])
    if name.endswith(".weight_shape"):
        yield torch.tensor(weight_shape, dtype=torch.int64)
    elif name.endswith(".weight_scale"):
        yield torch.full(shape, std / LEVEL_STD, dtype=dtype)
    elif name.endswith(".weight_packed"):
        for n in pieces(shape, dtype):
            yield int4_words((n, shape[1]), g)
    else:
        for n in pieces(shape, dtype):
            yield (torch.randn((n, *shape[1:]), generator=g) * std + mean).to(dtype)


def int4_words(shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    """int32 words [N, W], 8 int4 integers each (stored + 8), over −7…7 with 0 twice as likely: zero
    mean, so no layer adds the same offset to every output (−8…7's mean, −½, would, and 48 such
    layers make every hidden state alike)."""
    x = torch.randint(-2**63, 2**63 - 1, (shape[0], shape[1] // 2), dtype=torch.int64, generator=g)
    stored_zero = ~(x | (x >> 1) | (x >> 2) | (x >> 3)) & NIBBLES  # a nibble 0 (−8) → 8 (0)
    return (x | (stored_zero << 3)).view(torch.int32)


def write_safetensors(path: Path, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]], fill) -> int:
    """A safetensors file of `tensors` (name → dtype, shape), whose values `fill(name)` yields a piece
    at a time, in order; the header first. Returns the bytes of the tensors."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = math.prod(shape) * dtype.itemsize
        header[name] = dict(dtype=SAFETENSORS_NAMES[dtype], shape=list(shape), data_offsets=[offset, offset + size])
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for name, (dtype, shape) in tensors.items():
            written = 0
            for piece in fill(name):
                f.write(piece.contiguous().view(torch.uint8).numpy().data)
                written += piece.numel() * piece.element_size()
            if written != header[name]["data_offsets"][1] - header[name]["data_offsets"][0]:
                raise RuntimeError(f"{name}: {written} bytes drawn for a {list(shape)} {dtype} tensor.")
    return offset


def shard_of(name: str) -> int:
    """Decoder layer L's tensors go to shard L + 1, the rest to shard 0."""
    parts = name.split(".")
    return int(parts[2]) + 1 if parts[:2] == ["model", "layers"] else 0


def write_random_int4(directory: str | Path, config: transformers.PretrainedConfig, seed: int = 0,
                      progress: Progress | None = None) -> Path:
    """Write `config`'s model, random, as an int4 checkpoint into `directory` (see the module)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16
    architecture, weights = weight_shapes(config)
    shards: list[dict[str, tuple[torch.dtype, tuple[int, ...]]]] = [{} for _ in range(config.num_hidden_layers + 1)]
    of_weight = {}
    for name, shape in weights.items():
        for stored_name, spec in stored(name, shape, dtype).items():
            shards[shard_of(name)][stored_name] = spec
            of_weight[stored_name] = name, shape
    g = torch.Generator().manual_seed(seed)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    task = progress.add_task("writing int4 shards", total=len(shards)) if progress else None
    total = 0
    for file, tensors in zip(files, shards):
        total += write_safetensors(directory / file, tensors, lambda n: draw(n, *tensors[n], *of_weight[n], g))
        if progress:
            progress.advance(task)
    weight_map = {name: file for file, tensors in zip(files, shards) for name in tensors}
    (directory / "model.safetensors.index.json").write_text(
        json.dumps(dict(metadata=dict(total_size=total), weight_map=weight_map), indent=1))
    (directory / "config.json").write_text(json.dumps(
        config.to_dict() | dict(architectures=[architecture], dtype="bfloat16", quantization_config=LAYOUT.config()), indent=2))
    word_tokenizer(directory, config.vocab_size)
    return directory


def run_bench_checkpoint(args) -> int:
    from moeshard.bench.e2e import MODEL_SHAPES

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    if args.model_shape not in MODEL_SHAPES:
        console.print(f"moeshard: error: --model-shape takes {', '.join(MODEL_SHAPES)}, got {args.model_shape}.")
        return 2
    config = transformers.Qwen3MoeConfig(**{**MODEL_SHAPES[args.model_shape], "num_hidden_layers": args.layers})
    torch.set_num_threads(1)  # drawing is cheap: on a busy machine a second thread mostly spins, waiting
    with Progress(console=console, transient=True) as progress:
        directory = write_random_int4(args.directory, config, args.seed, progress)
    size = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    console.print(f"{directory}: {args.model_shape} with {args.layers} layers, int4 (compressed-tensors W4A16, "
                  f"groups of {LAYOUT.group_size}), {size / 2**30:.2f} GiB")
    return 0
