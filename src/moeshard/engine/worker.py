"""What each rank runs: its part of the model and a runner, kept between steps.

The driver (rank 0, in the LLM's process) sends every rank the step's plan for every DP group; a
rank runs its own group's chunks (an idle group still steps, on a dummy token, so the MoE
collectives stay matched) and TP rank 0 of each group samples where the logits are, with each
request's own generator, and returns only the tokens and the logprobs asked for. The other ranks
hold their Worker in moeshard.engine.ranks' headless loop. Sleep, wake and weight updates are the
rank's half of moeshard.engine.lifecycle.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from moeshard.engine.lifecycle import RankLifecycle
from moeshard.engine.plan import Routing, decode_plan, encode_results
from moeshard.engine.sampling import SamplingParams, sample_batch
from moeshard.engine.weight_sync import RankWeightSync, WeightsGroup
from moeshard.models.model import load_model
from moeshard.models.runner import ModelRunner
from moeshard.moe.context import method_policy
from moeshard.kernels.packed import Quantization
from moeshard.parallel import Layout, set_layout
from moeshard.runtime import invariance


@dataclass(frozen=True)
class WorkerConfig:
    model: str
    layout: Layout
    dtype: str
    num_blocks: int
    block_size: int
    moe_comm: str
    compile_backend: str | None
    batch_invariant: bool = False
    quantization: Quantization | None = None  # quantized at load (kernels.packed.Quantization)


@dataclass
class Sampler:
    """A request's sampling state on the rank that samples it."""

    params: SamplingParams
    generator: torch.Generator
    suppressed: tuple[int, ...]  # ids it may not sample before params.min_tokens
    drawn: int = 0  # tokens sampled so far (a recompute's prefill samples only its next token)


class Worker(RankLifecycle, RankWeightSync):
    def __init__(self, config: WorkerConfig):
        self.config, self.model_dir = config, config.model
        set_layout(config.layout)
        invariance.set_batch_invariant(config.batch_invariant)  # before the model: its modules read it
        model = load_model(config.model, getattr(torch, config.dtype), config.quantization)
        force, policy = method_policy(config.moe_comm)
        self.runner = ModelRunner(model, config.num_blocks, config.block_size, policy, force, config.compile_backend)
        self.samplers: dict[int, Sampler] = {}  # on TP rank 0: its group's requests
        self.forward_s = 0.0  # time in the model's forward, all steps
        self.weight_groups: dict[str, WeightsGroup] = {}  # the trainers' groups this rank joined, by name

    @property
    def model(self):
        return self.runner.model

    def execute(self, plan_P: torch.Tensor) -> torch.Tensor | None:
        """Run this rank's DP group's chunks of the step (every rank, in lock-step); TP rank 0 of
        the group samples them and returns the encoded samples and the routing its chunks recorded
        (moeshard.engine.plan)."""
        set_layout(self.config.layout)
        invariance.set_batch_invariant(self.config.batch_invariant)  # another engine may share the process
        plan = decode_plan(plan_P)
        parallel = self.model.parallel
        group = plan.groups[parallel.dp_rank]
        chunks = [c.chunk for c in group.chunks]
        # Every TP rank of the group decodes the same plan, so all of them agree to record (and gather).
        records = any(c.records_routing for c in group.chunks)
        start = time.perf_counter()
        if records:
            logits, routed = self.runner.run_chunks(chunks, record_routing=True)
        else:
            logits, routed = self.runner.run_chunks(chunks), []
        self.forward_s += time.perf_counter() - start
        if parallel.tp_rank != 0:
            return None
        for request_id in plan.finished:
            self.samplers.pop(request_id, None)
        for r in group.new:
            self.samplers[r.id] = Sampler(r.params, torch.Generator().manual_seed(r.seed), r.suppressed)
        routing = [
            Routing(c.request_id, c.chunk.start, experts_TYK)
            for c, experts_TYK in zip(group.chunks, routed)
            if c.records_routing
        ]
        ready = [i for i, c in enumerate(group.chunks) if c.samples]
        if not ready:
            return encode_results([], routing)
        samplers = [self.samplers[group.chunks[i].request_id] for i in ready]
        logits_NV = logits if len(ready) == len(logits) else logits[ready]
        suppressed = [s.suppressed if s.drawn < s.params.min_tokens else () for s in samplers]
        samples = sample_batch(logits_NV, [s.params for s in samplers], [s.generator for s in samplers], suppressed)
        for sampler in samplers:
            sampler.drawn += 1
        return encode_results(samples, routing)

    def moe_stats(self) -> tuple[dict[str, int], list[int]]:
        """Steps by MoE method, and the (token, expert) pairs this rank routed to each EP rank."""
        return dict(self.runner.method_steps), self.model.routed_per_ep_rank()

    def set_method(self, method: str) -> None:
        self.runner.set_method(*method_policy(method))
