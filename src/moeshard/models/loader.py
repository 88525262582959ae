"""Every parameter knows its shard; one loader writes them, at start-up and for every update.

A module allocates its parameters from the config's shapes alone (this rank's shard shapes) and
attaches to each one a `ShardLoad`: which blocks of which checkpoint tensors it is made of, and
where each block goes. `load_weights` reads one block at a time from a TensorSource (a checkpoint
directory or an update's tensors) and writes it into the parameter's existing storage through the
parameter's layout (moeshard.kernels.packed: Hugging Face's, or the kernels' packed panels), so:

- no module is built during a load (layer names, the KV-cache registry and derived tensors are
  left alone), and parameters keep their identity (compiled graphs and sleep/wake hold them);
- the extra memory is small: a checkpoint's block is a view of the file, mapped, written
  `PIECE_BYTES` at a time, each piece's pages handed back once written; an update's block is a view
  of the update's tensor (none).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from moeshard.kernels.packed import Quantization, QuantizedPanels
from moeshard.kernels.quant import QuantFormat
from moeshard.models.checkpoint import CheckpointError, TensorSource
from moeshard.models.quantized_checkpoint import QuantizedSource
from moeshard.moe.weights import empty_param

PIECE_BYTES = 64 * 2**20  # a block is written this much at a time (whole 64-row panels where it can)
PANEL_ROWS = 64


@dataclass(frozen=True)
class Block:
    """Block `index` of checkpoint tensor `name` (full shape `shape`, as the config implies),
    written to `param[dest]`; reshaped to `view` and cut to `pick` first where those are given."""

    name: str
    shape: tuple[int, ...]
    index: tuple = ()
    dest: tuple = ()
    view: tuple[int, ...] | None = None
    pick: tuple = ()


@dataclass(frozen=True)
class ShardLoad:
    blocks: tuple[Block, ...]
    # Rows no block writes (the vocabulary's padding): zeroed on every load, since after a poisoned
    # wake the memory holds garbage.
    padding: tuple | None = None


@dataclass(frozen=True)
class Alloc:
    """Allocates a model's parameters: empty, in its dtype, on its device, each with its blocks, in
    `layout` (a kernels.packed layout of `shape`; Hugging Face's by default)."""

    dtype: torch.dtype
    device: torch.device | str
    quantization: Quantization | None = None

    def quantized(self, name: str) -> QuantFormat | None:
        """The format checkpoint module `name`'s weight is quantized in at load, if any."""
        return None if self.quantization is None else self.quantization.format_for(name)

    def __call__(
        self, shape: tuple[int, ...], *blocks: Block, padding: tuple | None = None, dtype: torch.dtype | None = None,
        layout=None,
    ) -> nn.Parameter:
        return attach(empty_param(shape, dtype or self.dtype, self.device, layout), *blocks, padding=padding)


def attach(param: nn.Parameter, *blocks: Block, padding: tuple | None = None) -> nn.Parameter:
    # On the parameter object itself: releasing and re-creating its storage (sleep/wake) keeps it.
    param.shard_load = ShardLoad(blocks, padding)
    return param


def check_only(module: nn.Module, *blocks: Block) -> None:
    """Tensors a checkpoint stores for `module` that it does not hold (Qwen2-MoE's empty shared
    expert): each load checks their shapes and counts them as read."""
    module.checked_blocks = blocks


def write(param: nn.Parameter, load: ShardLoad, source: TensorSource) -> None:
    layout = param.weight_layout
    layout.zero_padding(param.data)
    if load.padding is not None:
        layout.write(param.data, load.padding, torch.zeros((), dtype=torch.float32 if layout.packed else param.dtype))
    for b in load.blocks:
        if source.skips(b.name):
            continue
        if isinstance(layout, QuantizedPanels) and isinstance(source, QuantizedSource) and source.quantized(b.name):
            # A weight the checkpoint stores quantized, into quantized panels: as stored, not through bf16.
            if b.view is not None or b.pick:
                raise CheckpointError(f"{b.name} is stored quantized, and moeshard reads it only as whole blocks.")
            layout.write(param.data, b.dest, source.read_quantized(b.name, b.shape, b.index))
            source.release_quantized(b.name)
            continue
        block = source.read(b.name, b.shape, b.index)
        if b.view is not None:
            block = block.reshape(b.view)
        for dest, piece in pieces(b.dest, block[b.pick], layout.shape):
            layout.write(param.data, dest, piece)
            source.release(piece)


def pieces(dest: tuple, values: torch.Tensor, shape: tuple[int, ...]):
    """`values` (the block at `dest` of a weight of logical shape `shape`) as (dest, piece) pairs of
    at most ~PIECE_BYTES, cut along the block's first dim (the first dim `dest` slices)."""
    full = tuple(dest) + (slice(None),) * (len(shape) - len(dest))
    at = next((i for i, d in enumerate(full) if isinstance(d, slice)), None)
    row_bytes = values[0].numel() * values.element_size() if values.dim() else 0
    if at is None or values.numel() * values.element_size() <= PIECE_BYTES or row_bytes == 0:
        yield dest, values
        return
    rows = range(*full[at].indices(shape[at]))
    step = max(1, PIECE_BYTES // row_bytes)
    step = step // PANEL_ROWS * PANEL_ROWS or step
    for first in range(0, len(rows), step):
        last = min(first + step, len(rows))
        yield (*full[:at], slice(rows.start + first, rows.start + last), *full[at + 1 :]), values[first:last]


def load_module(module: nn.Module, source: TensorSource) -> None:
    """Every parameter of `module` (and its submodules), straight from `source`."""
    for m in module.modules():
        for b in getattr(m, "checked_blocks", ()):
            if not source.skips(b.name):
                source.check(b.name, b.shape)
        for param in m.parameters(recurse=False):
            write(param, param.shard_load, source)


def load_weights(model, source: TensorSource, parts: Iterable[str | int] | None = None) -> None:
    """The parameters of `parts` (every part of the model if None; see CausalLM.parts) from `source`."""
    for part in model.parts() if parts is None else parts:
        load_module(model.part(part), source)
