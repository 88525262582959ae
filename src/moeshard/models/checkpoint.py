"""Read a Hugging Face checkpoint directory: config.json and one or many *.safetensors files.

Each rank reads only the blocks it holds, as views of the file mapped into memory (no copy: the
loader writes a block straight into its parameter), and hands each tensor's pages back once its
block is written, so a load holds the weights plus one tensor of the file at a time. Every read is
checked against the full shape the config implies, and the reader remembers what was read, so that
`finish` can refuse a checkpoint holding tensors no rank used.
"""

from __future__ import annotations

import json
import mmap
import re
import struct
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open

from moeshard.parallel.state import get_parallel_state, group_size

# Tensors real checkpoints carry that inference does not use.
IGNORED = (re.compile(r".*rotary_emb\.inv_freq$"),)


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; one sentence naming the tensor or file."""


def read_config(directory: str | Path) -> dict:
    path = Path(directory) / "config.json"
    if not Path(directory).is_dir():
        raise CheckpointError(f"model directory {directory} does not exist.")
    if not path.is_file():
        raise CheckpointError(f"{directory} has no config.json; point --model at a Hugging Face model directory.")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}).") from None


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({directory / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index.name} lists {missing[0]}, which is not in {directory}.")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory} has no *.safetensors files.")
    return files


# Weights' dtypes, and those the quantized layouts store (moeshard.models.quantized_checkpoint).
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                      "F8_E4M3": torch.float8_e4m3fn, "I8": torch.int8, "U8": torch.uint8, "I32": torch.int32,
                      "I64": torch.int64}


class TensorSource:
    """Named full tensors, read a block at a time: every read checked against the full shape the
    config implies and remembered (`read_names`). Blocks come as stored: the copy into a parameter
    converts them to its dtype and device, so no converted copy is made on the way.

    The sources take a `dtype` and `device` argument, which they ignore: the engine's workers pass
    the model's.
    """

    partial = False  # names only some tensors: a parameter reads the blocks it finds, keeps the rest

    def __init__(self, label: str):
        self.label = label
        self.read_names: set[str] = set()

    def __contains__(self, name: str) -> bool:
        raise NotImplementedError

    def names(self) -> list[str]:
        """Every tensor's name."""
        raise NotImplementedError

    def skips(self, name: str) -> bool:
        """A partial source that does not name `name`: its blocks keep their values."""
        return self.partial and name not in self

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def block(self, name: str, index: tuple) -> torch.Tensor:
        raise NotImplementedError

    def release(self, block: torch.Tensor) -> None:
        """`block` (as `block` returned it) is written: memory held only to read it may go."""

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        """Refuse a missing tensor or one whose full shape is not `shape`; count it as read."""
        if name not in self:
            raise CheckpointError(f"{self.label} has no tensor {name!r}.")
        actual = self.shape(name)
        if actual != tuple(shape):
            raise CheckpointError(f"tensor {name!r} has shape {list(actual)}, but the config implies {list(shape)}.")
        self.read_names.add(name)

    def read(self, name: str, shape: tuple[int, ...], index: tuple = ()) -> torch.Tensor:
        """The block `index` of tensor `name`, whose full shape must be `shape`."""
        self.check(name, shape)
        return self.block(name, index)


class TensorDict(TensorSource):
    """Tensors in memory (a weight update), read like a checkpoint; a block is a view, not a copy."""

    def __init__(self, tensors: dict[str, torch.Tensor], partial: bool = False):
        super().__init__("the update")
        self.tensors, self.partial = tensors, partial

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def block(self, name: str, index: tuple) -> torch.Tensor:
        return self.tensors[name][index] if index else self.tensors[name]


class MappedFile:
    """A safetensors file mapped into memory: each tensor a view of the mapping (pages are read on
    first touch, and `release` hands a view's pages back: the file stays in the page cache, out
    of this process's resident memory)."""

    def __init__(self, path: Path):
        with open(path, "rb") as f:
            (header_bytes,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_bytes))
            # Copy-on-write (nothing writes it): torch.frombuffer takes a writable buffer without a warning.
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.start = 8 + header_bytes
        self.entries = {name: e for name, e in header.items() if name != "__metadata__"}
        self.address = torch.frombuffer(self.map, dtype=torch.uint8, count=1).data_ptr()  # of the mapping's first byte

    def tensor(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        begin, end = entry["data_offsets"]
        dtype = SAFETENSORS_DTYPES[entry["dtype"]]
        flat = torch.frombuffer(self.map, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=self.start + begin) \
            if end > begin else torch.empty(0, dtype=dtype)
        return flat.view(entry["shape"])

    def release(self, view: torch.Tensor) -> None:
        """Hand back the pages a view of the mapping spans (the file stays in the page cache: a later
        read of them faults them in again)."""
        if view.numel() == 0:
            return
        begin = view.data_ptr() - self.address
        end = begin + (sum((n - 1) * s for n, s in zip(view.shape, view.stride())) + 1) * view.element_size()
        first = begin - begin % mmap.PAGESIZE
        self.map.madvise(mmap.MADV_DONTNEED, first, end - first)


class Checkpoint(TensorSource):
    """The tensors of a checkpoint directory, by name (headers only until a tensor is read)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        super().__init__(f"checkpoint {self.directory.name}")
        self.handles: dict[str, object] = {}
        self.files: dict[str, MappedFile] = {}
        self.mapped: list[MappedFile] = []
        for path in safetensors_files(self.directory):
            try:
                handle = safe_open(str(path), framework="pt")  # checks the header against the file
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"{path.name} is not a readable safetensors file (truncated?): {exc}.") from None
            mapped = MappedFile(path)
            self.mapped.append(mapped)
            for name in handle.keys():
                self.handles[name], self.files[name] = handle, mapped

    def __contains__(self, name: str) -> bool:
        return name in self.handles

    def names(self) -> list[str]:
        return list(self.handles)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.handles[name].get_slice(name).get_shape())

    def stored_dtype(self, name: str) -> torch.dtype:
        stored = self.handles[name].get_slice(name).get_dtype()
        if stored not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"tensor {name!r} is stored as {stored}; moeshard reads {', '.join(SAFETENSORS_DTYPES)}.")
        return SAFETENSORS_DTYPES[stored]

    def block(self, name: str, index: tuple) -> torch.Tensor:
        """A view of the mapped file: read from disk (or the page cache) as it is copied."""
        self.stored_dtype(name)
        full = self.files[name].tensor(name)
        return full[index] if index else full

    def release(self, block: torch.Tensor) -> None:
        for mapped in self.mapped:
            if 0 <= block.data_ptr() - mapped.address < len(mapped.map):
                mapped.release(block)

    def finish(self, unused_ok: Callable[[str], bool] = lambda name: False, error: str | None = None) -> None:
        """Refuse tensors that no rank read, unless `unused_ok`; raise any rank's `error`.

        Every rank calls this (it exchanges what each read), also a rank whose loading failed, so
        that all ranks raise the same error instead of the others waiting on the failed one.
        """
        reports = [(set(self.read_names), error)]
        world = get_parallel_state().ep_group  # this engine's ranks (None: one rank, even if others run here)
        if group_size(world) > 1:
            reports = [None] * group_size(world)
            dist.all_gather_object(reports, (self.read_names, error), group=world)
        errors = [e for _, e in reports if e is not None]
        if errors:
            raise CheckpointError(errors[0])
        read = set().union(*(names for names, _ in reports))
        extra = sorted(
            n for n in self.handles if n not in read and not unused_ok(n) and not any(p.fullmatch(n) for p in IGNORED)
        )
        if extra:
            more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
            raise CheckpointError(
                f"checkpoint {self.directory.name} has tensor {extra[0]!r}{more}, which the config does not use."
            )
