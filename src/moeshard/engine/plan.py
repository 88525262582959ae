"""A step's plan and its results as flat tensors: what crosses between the driver and the ranks.

The plan (int64) carries, per DP group, the requests the ranks have not seen yet (their sampling
parameters and seed), then the step's chunks (request, first position, tokens, block table, whether
the chunk samples and whether it records its routing); last, the requests that finished, so the
ranks drop their samplers. Floats travel as their float64 bits. The results (float64) carry, per
sampled chunk in plan order, the token, its logprob (NaN when not asked for), N and the top-N
(token, logprob) pairs; then, per chunk that records routing, its rows' routed expert ids (small
integers: float64 holds them exactly). Nothing hidden- or vocabulary-sized is in either.

    plan    = [num_groups, num_finished, finished ids…, group 0, group 1, …]
    group   = [num_new, new request…, num_chunks, chunk…]
    new     = [id, seed, temperature bits, top_k, top_p bits, logprobs (-1: none), logprobs mode]
    chunk   = [id, start, samples, records_routing, num_tokens, num_blocks, tokens…, blocks…]
    results = [num_samples, sample…, routing…]
    sample  = [token, logprob, N, (token, logprob) × N]
    routing = [id, start, rows, moe_layers, top_k, expert ids (rows × moe_layers × top_k)…]
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from moeshard.engine.sampling import LOGPROBS_MODES, Sample, SamplingParams
from moeshard.models.runner import Chunk

NO_LOGPROBS = -1


@dataclass(frozen=True)
class NewRequest:
    id: int
    seed: int
    params: SamplingParams  # only the sampler's fields travel: temperature, top_k, top_p, logprobs and their mode


@dataclass(frozen=True)
class PlannedChunk:
    request_id: int
    chunk: Chunk
    samples: bool  # the chunk reaches the request's last token: sample the next one
    records_routing: bool = False  # return where its tokens were routed (SamplingParams.return_routed_experts)


@dataclass(frozen=True)
class GroupPlan:
    new: list[NewRequest]
    chunks: list[PlannedChunk]


@dataclass(frozen=True)
class StepPlan:
    groups: list[GroupPlan]
    finished: list[int]  # requests the ranks know and may forget


def float_bits(x: float) -> int:
    return int(torch.tensor([x], dtype=torch.float64).view(torch.int64))


def bits_float(bits: int) -> float:
    return float(torch.tensor([bits], dtype=torch.int64).view(torch.float64))


def encode_plan(plan: StepPlan) -> torch.Tensor:
    out = [len(plan.groups), len(plan.finished), *plan.finished]
    for group in plan.groups:
        out.append(len(group.new))
        for r in group.new:
            p = r.params
            logprobs = NO_LOGPROBS if p.logprobs is None else p.logprobs
            mode = LOGPROBS_MODES.index(p.logprobs_mode)
            out += [r.id, r.seed, float_bits(p.temperature), p.top_k, float_bits(p.top_p), logprobs, mode]
        out.append(len(group.chunks))
        for c in group.chunks:
            out += [c.request_id, c.chunk.start, int(c.samples), int(c.records_routing)]
            out += [len(c.chunk.token_ids), len(c.chunk.blocks)]
            out += c.chunk.token_ids + c.chunk.blocks
    return torch.tensor(out, dtype=torch.int64)


def decode_plan(plan_P: torch.Tensor) -> StepPlan:
    values = iter(plan_P.tolist())

    def take(n: int) -> list[int]:
        return [next(values) for _ in range(n)]

    num_groups, num_finished = take(2)
    finished = take(num_finished)
    groups = []
    for _ in range(num_groups):
        new = []
        for _ in range(next(values)):
            rid, seed, temperature, top_k, top_p, logprobs, mode = take(7)
            params = SamplingParams(
                temperature=bits_float(temperature), top_k=top_k, top_p=bits_float(top_p),
                logprobs=None if logprobs == NO_LOGPROBS else logprobs, logprobs_mode=LOGPROBS_MODES[mode],
            )
            new.append(NewRequest(rid, seed, params))
        chunks = []
        for _ in range(next(values)):
            rid, start, samples, records, num_tokens, num_blocks = take(6)
            chunk = Chunk(take(num_tokens), start, take(num_blocks))
            chunks.append(PlannedChunk(rid, chunk, bool(samples), bool(records)))
        groups.append(GroupPlan(new, chunks))
    return StepPlan(groups, finished)


@dataclass(frozen=True)
class Routing:
    """Where a chunk's tokens were routed: row i is position `start + i`."""

    request_id: int
    start: int
    experts_TYK: torch.Tensor  # int64 global expert ids, [rows, MoE layers, top_k]


def encode_results(samples: list[Sample], routing: list[Routing]) -> torch.Tensor:
    out = [len(samples)]
    for s in samples:
        out += [s.token, math.nan if s.logprob is None else s.logprob, len(s.top_logprobs)]
        for token, logprob in s.top_logprobs.items():
            out += [token, logprob]
    parts = [torch.tensor(out, dtype=torch.float64)]
    for r in routing:
        parts.append(torch.tensor([r.request_id, r.start, *r.experts_TYK.shape], dtype=torch.float64))
        parts.append(r.experts_TYK.flatten().to("cpu", torch.float64))
    return torch.cat(parts)


def decode_results(results_R: torch.Tensor) -> tuple[list[Sample], list[Routing]]:
    values = iter(results_R.tolist())
    samples = []
    for _ in range(int(next(values))):
        token, logprob, num_top = next(values), next(values), int(next(values))
        top = {}
        for _ in range(num_top):
            token_id = int(next(values))
            top[token_id] = next(values)
        samples.append(Sample(int(token), None if math.isnan(logprob) else logprob, top))
    routing = []
    for request_id in values:
        start, *shape = (int(next(values)) for _ in range(4))
        experts = torch.tensor(list(itertools.islice(values, math.prod(shape))), dtype=torch.int64)
        routing.append(Routing(int(request_id), start, experts.view(shape)))
    return samples, routing
