"""What each rank runs: its part of the model and a runner, kept between steps.

The driver (the LLM object) sends every rank the step's chunks of every DP group; a rank runs its
own group's (an idle group still steps, on a dummy token, so the MoE collectives stay matched) and
TP rank 0 of each group returns the logits. A spawned rank holds one Worker (`call` reaches it);
a one-rank engine holds its own in the caller's process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeshard.runtime import derived, memory
from moeshard.models.checkpoint import Checkpoint, TensorDict
from moeshard.models.model import load_model
from moeshard.models.runner import Chunk, ModelRunner
from moeshard.moe.context import method_policy
from moeshard.moe.layer import MoELayer
from moeshard.parallel import Layout, set_layout


@dataclass(frozen=True)
class WorkerConfig:
    model: str
    layout: Layout
    dtype: str
    num_blocks: int
    block_size: int
    moe_comm: str
    compile_backend: str | None


@dataclass
class Asleep:
    level: int
    shapes: dict[int, torch.Size]  # of every released weight and derived tensor, by id
    backup: list[torch.Tensor] | None  # level 1: the weights, on the host
    released: set[str]  # "weights", "kv_cache": what a wake has not yet re-created


class Worker:
    def __init__(self, config: WorkerConfig):
        self.config = config
        set_layout(config.layout)
        model = load_model(config.model, getattr(torch, config.dtype))
        force, policy = method_policy(config.moe_comm)
        self.runner = ModelRunner(model, config.num_blocks, config.block_size, policy, force, config.compile_backend)
        self.asleep: Asleep | None = None

    @property
    def model(self):
        return self.runner.model

    def step(self, chunks_per_group: list[list[Chunk]]) -> list[torch.Tensor] | None:
        parallel = self.model.parallel
        logits = self.runner.step(chunks_per_group[parallel.dp_rank])
        return logits if parallel.tp_rank == 0 else None

    def set_method(self, method: str) -> None:
        self.runner.set_method(*method_policy(method))

    def weights(self) -> list[torch.Tensor]:
        return list(self.model.parameters())  # each tensor once (a tied LM head is the embedding)

    def derived_owners(self) -> set[int]:
        """This model's registered owners: its modules and its MoE layers' dispatchers (another
        engine in the same process keeps its own)."""
        modules = list(self.model.modules())
        dispatchers = [d for m in modules if isinstance(m, MoELayer) for d in m.dispatchers.values()]
        return {id(o) for o in modules + dispatchers}

    def derived_tensors(self) -> list[torch.Tensor]:
        return derived.registered_tensors(self.derived_owners())

    def resident_mb(self) -> float:
        return memory.resident_mb()

    def sleep(self, level: int) -> float:
        """Release the KV cache, the derived tensors and the weights (level 1: backed up to the
        host first). Returns this rank's resident memory afterwards, in MiB."""
        tensors = self.weights()
        backup = [t.detach().clone() for t in tensors] if level == 1 else None
        shapes = memory.release(tensors + self.derived_tensors())
        self.runner.release_kv_cache()
        memory.return_memory_to_os()
        self.asleep = Asleep(level, shapes, backup, {"weights", "kv_cache"})
        return memory.resident_mb()

    def wake(self, tags: list[str], poison: bool, rebuild_derived: bool = True) -> float:
        """Re-create what `tags` name. Weights come back from the backup (level 1) or stay undefined
        until new ones arrive (level 2); derived tensors are recomputed; the KV cache is new."""
        asleep = self.asleep
        if asleep is None:
            return memory.resident_mb()
        if "weights" in tags and "weights" in asleep.released:
            tensors = self.weights()
            memory.recreate(tensors + self.derived_tensors(), asleep.shapes, poison)
            if asleep.backup is not None:
                for t, saved in zip(tensors, asleep.backup, strict=True):
                    t.data.copy_(saved)
                asleep.backup = None
            if rebuild_derived:
                self.rebuild_derived()
            asleep.released.discard("weights")
        if "kv_cache" in tags and "kv_cache" in asleep.released:
            self.runner.allocate_kv_cache(poison)
            asleep.released.discard("kv_cache")
        if not asleep.released:
            self.asleep = None
        return memory.resident_mb()

    def reload_weights(self, rebuild_derived: bool = True) -> None:
        """Read the weights from the model directory again, a part at a time, into the existing tensors."""
        source = Checkpoint(self.config.model, self.model.dtype, self.model.parallel.device)
        for part in self.model.parts():
            self.model.load_part(source, part)
        if rebuild_derived:
            self.rebuild_derived()

    def update_part(self, part: str | int, tensors: dict[str, torch.Tensor]) -> None:
        """Write one part's new full tensors, sharded as the loader shards them (checked by the driver)."""
        self.model.load_part(TensorDict(tensors, self.model.dtype, self.model.parallel.device), part)

    def rebuild_derived(self) -> int:
        return derived.rebuild(self.derived_owners())


_worker: Worker | None = None  # a spawned rank's


def start(config: WorkerConfig) -> None:
    global _worker
    _worker = Worker(config)


def call(method: str, *args):
    return getattr(_worker, method)(*args)


def stop() -> None:
    global _worker
    _worker = None
