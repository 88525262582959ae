"""What each rank runs: its part of the model and a runner, kept between steps in this process.

The driver (the LLM object) sends every rank the step's chunks of every DP group; a rank runs its
own group's (an idle group still steps, on a dummy token, so the MoE collectives stay matched) and
TP rank 0 of each group returns the logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def policy_for(method: str) -> tuple[CommMethod | None, SelectionPolicy]:
    force = CommMethod.parse(method)
    # A forced method runs at every batch size: its capacity is not the limit.
    return force, SelectionPolicy() if force is None else SelectionPolicy(mc2_capacity=1 << 20)


def start(config: WorkerConfig) -> None:
    global _runner
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
    global _runner
    _runner = None
