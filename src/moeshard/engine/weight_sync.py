"""Weights from a trainer that runs somewhere else: a process group of its own (docs/DESIGN.md §5).

The trainer and every engine rank join a second process group, set up the way SGLang's
`init_custom_process_group` and OpenRLHF set it up, so an existing trainer-side client works
unchanged: a TCP store at `master_address:master_port` (hosted by the trainer, rank 0), the group
name as the store's prefix, engine rank r at `rank_offset + r`, `world_size` = 1 + the engine's
ranks; gloo on CPU, NCCL on CUDA. The trainer announces the tensors (names, dtypes, shapes) and
broadcasts each one (or, with SGLang's `load_format="flattened_bucket"`, all of them as one flat
buffer: torch.cat of the tensors in the announced order, one broadcast); every rank receives all
of them and keeps only the blocks it holds (`ShardBuffer`). Nothing is written until every tensor
has arrived on every rank and the whole update is known good, so a refused or broken update
changes nothing. A refused update is still received (and dropped), so the trainer's broadcasts
finish and the group stays usable. A tensor (a flat buffer) that has not arrived `timeout_s` after
the engine began to wait for it breaks the update off: a trainer that goes quiet holds the engine
(paused for the update) that long, not longer. A broken-off update closes the group; destroying
it afterwards succeeds, as a framework's teardown expects.

    # the trainer, while the engine's /init_weights_update_group call runs:
    group = WeightsGroup.join(GroupSpec("127.0.0.1", port, 0, 1 + engine_ranks), rank=0)
    # while the engine's /update_weights_from_distributed call (names, dtypes, shapes) runs:
    for name, tensor in weights.items():
        group.broadcast(tensor)
"""

from __future__ import annotations

import datetime
import itertools
from dataclasses import dataclass

import torch
from torch.distributed import BroadcastOptions, PrefixStore, rendezvous
from torch.distributed.distributed_c10d import ProcessGroupGloo

from moeshard.engine.lifecycle import UPDATE_IN_FLIGHT
from moeshard.engine.payloads import FLATTENED, PACKED, TensorMeta, flat_dtype, packed_buffers, unflatten, unpack
from moeshard.models.checkpoint import TensorSource
from moeshard.models.loader import load_weights

BACKENDS = {"gloo": "cpu", "nccl": "cuda"}  # backend → the device its tensors live on
TENSOR_TIMEOUT_S = 60.0  # the engine's wait for each broadcast tensor (or flat buffer), by default


@dataclass(frozen=True)
class GroupSpec:
    master_address: str
    master_port: int
    rank_offset: int  # the engine's rank 0 joins as this rank; the trainer is rank 0
    world_size: int  # 1 (the trainer) + the engine's ranks
    group_name: str = "weight_update_group"
    backend: str = "gloo"
    timeout_s: float = 600.0  # a rendezvous that waits longer fails; so does a trainer's broadcast

    def check(self, engine_ranks: int, device: torch.device) -> None:
        """Refuse a group the engine cannot join, before any rank tries to."""
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be gloo or nccl, got {self.backend!r}.")
        if BACKENDS[self.backend] != device.type:
            raise ValueError(f"backend {self.backend} sends {BACKENDS[self.backend]} tensors, but this engine runs on {device.type}.")
        if self.rank_offset < 1 or self.rank_offset + engine_ranks > self.world_size:
            raise ValueError(
                f"the engine's {engine_ranks} ranks cannot join as ranks {self.rank_offset}…"
                f"{self.rank_offset + engine_ranks - 1} of a group of {self.world_size} (the trainer is rank 0)."
            )
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1…65535, got {self.master_port}.")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}.")


class WeightsGroup:
    """One side's handle on the group: the trainer's (rank 0, it broadcasts) or an engine rank's."""

    def __init__(self, group, device: torch.device):
        self.group, self.device = group, device

    @classmethod
    def join(cls, spec: GroupSpec, rank: int) -> "WeightsGroup":
        """Rendezvous with the other members (rank 0 hosts the store) and build the group's backend
        under the store prefixes torch's own `_new_process_group_helper` uses, as SGLang's does."""
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        url = f"tcp://{spec.master_address}:{spec.master_port}"
        store, _, _ = next(rendezvous(url, rank, spec.world_size, timeout=timeout))
        store.set_timeout(timeout)
        device = BACKENDS[spec.backend]
        store = PrefixStore(f"{device}/", PrefixStore(f"{spec.group_name}/", PrefixStore(spec.group_name, store)))
        if spec.backend == "gloo":
            return cls(ProcessGroupGloo(store, rank, spec.world_size, timeout), torch.device("cpu"))
        from torch.distributed.distributed_c10d import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        return cls(ProcessGroupNCCL(store, rank, spec.world_size, options), torch.device("cuda", torch.cuda.current_device()))

    def broadcast(self, tensor: torch.Tensor, timeout_s: float | None = None) -> torch.Tensor:
        """Rank 0 sends `tensor`; the others receive into theirs (same shape and dtype). It fails
        after `timeout_s` (default: the group's timeout)."""
        options = BroadcastOptions()
        if timeout_s is not None:
            options.timeout = datetime.timedelta(seconds=timeout_s)
        self.group.broadcast([tensor], options).wait()
        return tensor

    def receive(self, shape: tuple[int, ...], dtype: torch.dtype, timeout_s: float) -> torch.Tensor:
        return self.broadcast(torch.empty(shape, dtype=dtype, device=self.device), timeout_s)


class ShardBuffer(TensorSource):
    """An update's tensors as one rank holds them: only the blocks its parameters read (see
    moeshard.models.loader), copied out of each full tensor as it arrives. Read like a checkpoint
    that may name only some tensors: a parameter reads the blocks it finds here and keeps the rest.
    A weight a published quantized checkpoint stores quantized is kept whole in its stored form
    (quantized here if it came plain): its blocks are read through the layout, not by row."""

    partial = True

    def __init__(self, model):
        super().__init__("the update")
        self.stored = model.stored
        self.whole: dict[str, torch.Tensor] = {}
        self.given_stored: set[str] = set()  # modules whose stored tensors came as they are (checked before writing)
        self.wanted: dict[str, list[tuple]] = {}  # name → this rank's block indexes (slices: compared, not hashed)
        for part in model.parts():
            for module in model.part(part).modules():
                for param in module.parameters(recurse=False):
                    for b in param.shard_load.blocks:
                        indexes = self.wanted.setdefault(b.name, [])
                        if b.index not in indexes:
                            indexes.append(b.index)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.blocks: dict[str, list[tuple[tuple, torch.Tensor]]] = {}

    def keep(self, name: str, tensor: torch.Tensor) -> None:
        module = None if self.stored is None else self.stored.module_of(name)
        if module is not None:
            if not self.stored.is_plain(name, tensor.dtype):
                self.given_stored.add(module)
            for n, t in self.stored.as_stored({name: tensor}).items():
                self.shapes[n], self.whole[n] = tuple(t.shape), t
            return
        self.shapes[name] = tuple(tensor.shape)
        self.blocks[name] = [(index, tensor[index].clone() if index else tensor) for index in self.wanted.get(name, ())]

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def names(self) -> list[str]:
        return list(self.shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def block(self, name: str, index: tuple) -> torch.Tensor:
        if name in self.whole:
            return self.whole[name][index] if index else self.whole[name]
        return next(t for i, t in self.blocks[name] if i == index)


class EngineWeightSync:
    """The driver's half (the LLM object): the calls a trainer's client makes. Expects what
    moeshard.engine.lifecycle.EngineLifecycle provides (`ranks`, `schema`, `quiesce`, …) and
    `device`, the engine's; call `init_weight_sync()` from the constructor."""

    def init_weight_sync(self) -> None:
        self.weight_groups: set[str] = set()
        self.broken_groups: set[str] = set()  # closed by a broadcast that broke off, not yet destroyed

    def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int,
        group_name: str = "weight_update_group", backend: str = "gloo", timeout_s: float = 600.0,
    ) -> None:
        """Join the trainer's group (every rank; returns once the trainer has joined too, or after
        `timeout_s`)."""
        spec = GroupSpec(master_address, master_port, rank_offset, world_size, group_name, backend, timeout_s)
        spec.check(self.ranks.world_size, self.device)
        if group_name in self.weight_groups:
            raise ValueError(f"the engine is already in a weights group named {group_name!r}; destroy it first.")
        try:
            self.ranks.call("join_weights_group", spec)
        except RuntimeError as exc:  # a rank could not join: none stays half in the group
            self.ranks.call("leave_weights_group", group_name)
            raise RuntimeError(f"joining weights group {group_name!r} at {master_address}:{master_port} failed: {exc}") from None
        self.weight_groups.add(group_name)
        self.broken_groups.discard(group_name)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        """Leave the group. One a broken-off broadcast closed is already gone: that succeeds too (a
        framework's teardown calls this after a failed update); a group never joined is refused, as
        SGLang refuses it."""
        if group_name in self.broken_groups:
            self.broken_groups.discard(group_name)
            return
        self.check_group(group_name)
        self.ranks.call("leave_weights_group", group_name)
        self.weight_groups.discard(group_name)

    def check_group(self, group_name: str) -> None:
        if group_name not in self.weight_groups:
            raise ValueError(f"the engine is in no weights group named {group_name!r}; call init_weights_update_group first.")

    def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str = "weight_update_group",
        load_format: str | None = None, timeout_s: float = TENSOR_TIMEOUT_S, weight_version: str | None = None,
        abort_running: bool = False,
    ) -> int | None:
        """Receive the tensors the trainer broadcasts on `group_name`, in the announced order (with
        `load_format="flattened_bucket"`, as one flat buffer; with "packed", as vLLM's packed uint8
        buffers), and write them (any of the weights;
        the others keep their values). Every tensor is received before anything is written; a
        refused update is received too and dropped, so the trainer's broadcasts finish either way.
        A broadcast that breaks off, or a tensor that has not arrived after `timeout_s`, closes the group."""
        metas = TensorMeta.parse(names, dtypes, shapes)
        if load_format not in (None, FLATTENED, PACKED):
            raise ValueError(f"load_format must be {FLATTENED!r}, {PACKED!r} or absent, got {load_format!r}.")
        if load_format == FLATTENED and not metas:
            raise ValueError("a flattened bucket must announce at least one tensor.")
        if load_format == FLATTENED:
            flat_dtype(metas)  # refuses a conversion that would lose bits, before anything is sent
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}.")
        self.check_group(group_name)
        refusal: Exception | None = None
        try:
            self.check_weights_present()
            self.schema.check_announced(metas)
            self.quiesce(abort_running, UPDATE_IN_FLIGHT, parked_may_stay=True)
        except (ValueError, RuntimeError) as exc:
            refusal = exc
        try:
            self.ranks.call("receive_weights", group_name, metas, refusal is None, load_format, timeout_s)
        except RuntimeError as exc:
            self.ranks.call("drop_received")
            self.ranks.call("leave_weights_group", group_name)
            self.weight_groups.discard(group_name)
            self.broken_groups.add(group_name)
            raise RuntimeError(
                f"the weights broadcast on {group_name!r} broke off ({exc}); nothing was written, and the group is "
                "closed: init it again."
            ) from None
        if refusal is not None:
            raise refusal
        self.core.weights_changed()
        self.ranks.call("write_received")
        return self.weights_written(weight_version)


class RankWeightSync:
    """A rank's half (the Worker): its membership of each weights group and the update it received.
    Expects `self.runner` (its ModelRunner) and `self.weight_groups`, a dict."""

    weight_groups: dict[str, WeightsGroup]
    received: ShardBuffer | None = None

    def join_weights_group(self, spec: GroupSpec) -> None:
        rank = spec.rank_offset + self.runner.model.parallel.rank
        self.weight_groups[spec.group_name] = WeightsGroup.join(spec, rank)

    def leave_weights_group(self, group_name: str) -> None:
        self.weight_groups.pop(group_name, None)

    def receive_weights(self, group_name: str, metas: list[TensorMeta], keep: bool, load_format: str | None,
                        timeout_s: float) -> None:
        group = self.weight_groups[group_name]
        buffer = ShardBuffer(self.runner.model) if keep else None
        if load_format == FLATTENED:  # one flat buffer; the tensors are views of it
            starts = [0, *itertools.accumulate(m.numel for m in metas)][:-1]
            flat = group.receive((sum(m.numel for m in metas),), flat_dtype(metas), timeout_s)
            received = unflatten(flat, metas, starts)
        elif load_format == PACKED:  # uint8 buffers in turn, the tensors views of each
            received = (
                pair for part in packed_buffers(metas)
                for pair in unpack(group.receive((sum(m.nbytes for m in part),), torch.uint8, timeout_s), part)
            )
        else:
            received = ((m.name, group.receive(m.shape, m.dtype, timeout_s)) for m in metas)
        for name, tensor in received:
            if buffer is not None:
                buffer.keep(name, tensor)
        self.received = buffer

    def write_received(self) -> None:
        model, received = self.runner.model, self.received
        self.received = None
        if model.stored is not None:  # every rank received the same, so every rank refuses alike, before writing
            model.stored.validate(received, received.given_stored)
        load_weights(model, model.reads(received))

    def drop_received(self) -> None:
        self.received = None
