"""Read a Hugging Face checkpoint directory: config.json and one or many *.safetensors files.

Each rank reads only the blocks it holds (`safe_open(...).get_slice(name)[index]`). Every read is
checked against the full shape the config implies, and the reader remembers what was read, so that
`finish` can refuse a checkpoint holding tensors no rank used.
"""

from __future__ import annotations

import json
import re
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


SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


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

    def skips(self, name: str) -> bool:
        """A partial source that does not name `name`: its blocks keep their values."""
        return self.partial and name not in self

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def block(self, name: str, index: tuple) -> torch.Tensor:
        raise NotImplementedError

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

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def block(self, name: str, index: tuple) -> torch.Tensor:
        return self.tensors[name][index] if index else self.tensors[name]


class Checkpoint(TensorSource):
    """The tensors of a checkpoint directory, by name (headers only until a tensor is read)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        super().__init__(f"checkpoint {self.directory.name}")
        self.handles: dict[str, object] = {}
        for path in safetensors_files(self.directory):
            try:
                handle = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"{path.name} is not a readable safetensors file (truncated?): {exc}.") from None
            for name in handle.keys():
                self.handles[name] = handle

    def __contains__(self, name: str) -> bool:
        return name in self.handles

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.handles[name].get_slice(name).get_shape())

    def stored_dtype(self, name: str) -> torch.dtype:
        stored = self.handles[name].get_slice(name).get_dtype()
        if stored not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"tensor {name!r} is stored as {stored}; moeshard reads F32, F16 and BF16.")
        return SAFETENSORS_DTYPES[stored]

    def block(self, name: str, index: tuple) -> torch.Tensor:
        return self.handles[name].get_slice(name)[index] if index else self.handles[name].get_tensor(name)

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
