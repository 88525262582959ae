"""What each rank runs: its part of the model and a runner, kept between steps.

The driver (the LLM object) sends every rank the step's chunks of every DP group; a rank runs its
own group's (an idle group still steps, on a dummy token, so the MoE collectives stay matched) and
TP rank 0 of each group returns the logits. A spawned rank holds one Worker (`call` reaches it);
a one-rank engine holds its own in the caller's process. Sleep, wake and weight updates are the
rank's half of moeshard.engine.lifecycle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeshard.engine.lifecycle import RankLifecycle
from moeshard.models.model import load_model
from moeshard.models.runner import Chunk, ModelRunner
from moeshard.moe.context import method_policy
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


class Worker(RankLifecycle):
    def __init__(self, config: WorkerConfig):
        self.config, self.model_dir = config, config.model
        set_layout(config.layout)
        model = load_model(config.model, getattr(torch, config.dtype))
        force, policy = method_policy(config.moe_comm)
        self.runner = ModelRunner(model, config.num_blocks, config.block_size, policy, force, config.compile_backend)

    @property
    def model(self):
        return self.runner.model

    def execute(self, chunks_per_group: list[list[Chunk]]) -> list[torch.Tensor] | None:
        """Run this rank's DP group's chunks (every rank, in lock-step); TP rank 0 returns the logits."""
        parallel = self.model.parallel
        logits = self.runner.run_chunks(chunks_per_group[parallel.dp_rank])
        return logits if parallel.tp_rank == 0 else None

    def set_method(self, method: str) -> None:
        self.runner.set_method(*method_policy(method))


_worker: Worker | None = None  # a spawned rank's


def start(config: WorkerConfig) -> None:
    global _worker
    _worker = Worker(config)


def call(method: str, *args):
    return getattr(_worker, method)(*args)
