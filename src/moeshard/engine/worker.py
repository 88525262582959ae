"""What each rank runs: its part of the model and a runner, kept between steps in this process.

The driver (the LLM object) sends every rank the step's chunks of every DP group; a rank runs its
own group's (an idle group still steps, on a dummy token, so the MoE collectives stay matched) and
TP rank 0 of each group returns the logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeshard.lifecycle import derived, memory
from moeshard.models.checkpoint import Checkpoint, TensorDict
from moeshard.models.model import load_model
from moeshard.models.runner import Chunk, ModelRunner
from moeshard.moe.config import CommMethod, SelectionPolicy
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


_runner: ModelRunner | None = None
_config: WorkerConfig | None = None
_asleep: "Asleep | None" = None


@dataclass
class Asleep:
    level: int
    shapes: dict[int, torch.Size]  # of every released weight and derived tensor, by id
    backup: list[torch.Tensor] | None  # level 1: the weights, on the host
    released: set[str]  # "weights", "kv_cache": what a wake has not yet re-created


def policy_for(method: str) -> tuple[CommMethod | None, SelectionPolicy]:
    force = CommMethod.parse(method)
    # A forced method runs at every batch size: its capacity is not the limit.
    return force, SelectionPolicy() if force is None else SelectionPolicy(mc2_capacity=1 << 20)


def start(config: WorkerConfig) -> None:
    global _runner, _config
    _config = config
    set_layout(config.layout)
    model = load_model(config.model, getattr(torch, config.dtype))
    force, policy = policy_for(config.moe_comm)
    _runner = ModelRunner(model, config.num_blocks, config.block_size, policy, force, config.compile_backend)


def step(chunks_per_group: list[list[Chunk]]) -> list[torch.Tensor] | None:
    parallel = _runner.model.parallel
    logits = _runner.step(chunks_per_group[parallel.dp_rank])
    return logits if parallel.tp_rank == 0 else None


def set_method(method: str) -> None:
    _runner.set_method(*policy_for(method))


def stop() -> None:
    global _runner, _asleep
    _runner = _asleep = None


def weights() -> list[torch.Tensor]:
    return list(_runner.model.parameters())  # each tensor once (a tied LM head is the embedding)


def sleep(level: int) -> float:
    """Release the KV cache, the derived tensors and the weights (level 1: backed up to the host
    first). Returns this rank's resident memory afterwards, in MiB."""
    global _asleep
    tensors = weights()
    backup = [t.detach().clone() for t in tensors] if level == 1 else None
    shapes = memory.release(tensors + derived.registered_tensors())
    _runner.release_kv_cache()
    memory.return_memory_to_os()
    _asleep = Asleep(level, shapes, backup, {"weights", "kv_cache"})
    return memory.resident_mb()


def wake(tags: list[str], poison: bool, rebuild_derived: bool = True) -> float:
    """Re-create what `tags` name. Weights come back from the backup (level 1) or stay undefined
    until new ones arrive (level 2); derived tensors are recomputed; the KV cache is new."""
    global _asleep
    if _asleep is None:
        return memory.resident_mb()
    if "weights" in tags and "weights" in _asleep.released:
        tensors = weights()
        memory.recreate(tensors + derived.registered_tensors(), _asleep.shapes, poison)
        if _asleep.backup is not None:
            for t, saved in zip(tensors, _asleep.backup, strict=True):
                t.data.copy_(saved)
            _asleep.backup = None
        if rebuild_derived:
            derived.rebuild()
        _asleep.released.discard("weights")
    if "kv_cache" in tags and "kv_cache" in _asleep.released:
        _runner.allocate_kv_cache(poison)
        _asleep.released.discard("kv_cache")
    if not _asleep.released:
        _asleep = None
    return memory.resident_mb()


def reload_weights(rebuild_derived: bool = True) -> None:
    """Read the weights from the model directory again, a part at a time, into the existing tensors."""
    model = _runner.model
    source = Checkpoint(_config.model, model.dtype, model.parallel.device)
    for part in model.parts():
        model.load_part(source, part)
    if rebuild_derived:
        derived.rebuild()


def update_part(part: str | int, tensors: dict[str, torch.Tensor]) -> None:
    """Write one part's new full tensors, sharded as the loader shards them (checked by the driver)."""
    model = _runner.model
    model.load_part(TensorDict(tensors, model.dtype, model.parallel.device), part)


def rebuild_derived() -> int:
    return derived.rebuild()
