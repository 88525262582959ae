"""Requests and the scheduler of one DP group: waiting and running queues, chunked prefill under a
token budget, mixed prefill + decode steps, preemption by recompute when KV blocks run out.

The scheduler owns a request's progress: `schedule` says what each request computes this step,
and `postprocess` takes the step's sampled tokens and advances every request — tokens computed,
tokens appended, and the decision to finish (EOS, a stop string, max_tokens, the context length).
The driver only schedules, runs and hands results over.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moeshard.engine.block_manager import BlockManager, Prefix
from moeshard.engine.sampling import Sample, SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    id: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int = 0  # the sampler's, on the rank that samples
    output_ids: list[int] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    status: Status = Status.WAITING
    finish_reason: str | None = None
    text: str = ""
    preemptions: int = 0
    cache_salt: str | None = None  # part of its blocks' keys: only requests with the same salt share them
    prefix: Prefix = Prefix()  # its blocks keyed in the prefix cache so far
    cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache
    weight_version: str = ""  # the weights it runs on (the engine's when it arrived, or its last update's)
    # Which weights sampled which output tokens: [version, start, end) spans in order, covering the
    # output once (a weight update while the request was parked starts a new span).
    version_spans: list[list] = field(default_factory=list)
    matched: int | str | None = None  # what ended it with reason "stop": the token id or the stop string
    # With params.return_routed_experts: by position, the global expert ids [MoE layer][top_k] it
    # was routed to (a recompute after preemption rewrites the same positions).
    routed_experts: list[list[list[int]]] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def append_token(self, sample: Sample) -> None:
        self.output_ids.append(sample.token)
        self.samples.append(sample)
        end, spans = len(self.output_ids), self.version_spans
        if spans and spans[-1][0] == self.weight_version:
            spans[-1][2] = end
        else:
            spans.append([self.weight_version, end - 1, end])

    @property
    def weight_versions(self) -> list[dict]:
        return [{"version": v, "start": start, "end": end} for v, start, end in self.version_spans]

    def record_routing(self, start: int, experts_TYK: torch.Tensor) -> None:
        """Positions [start, start + rows) were routed to `experts_TYK` ([rows, MoE layers, top_k]).
        Such a request's chunks start at position 0 (it skips the prefix cache), so none is skipped."""
        self.routed_experts[start : start + len(experts_TYK)] = experts_TYK.tolist()


@dataclass(frozen=True)
class Scheduled:
    """`num_tokens` of `request`'s tokens computed this step."""

    request: Request
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Does this chunk reach the request's last known token, so that a new one is sampled?"""
        return self.request.num_computed + self.num_tokens == self.request.num_tokens


@dataclass(frozen=True)
class StopRules:
    """When a request ends, besides its own max_tokens and stop strings."""

    eos: frozenset[int]
    max_model_len: int
    decode: Callable[[list[int]], str]  # token ids → text, for stop strings and the final text


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, token_budget: int, rules: StopRules):
        self.blocks, self.max_num_seqs, self.token_budget = blocks, max_num_seqs, token_budget
        self.rules = rules
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0  # since the engine started

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def preempt(self, request: Request) -> None:
        """Free its blocks; it recomputes its prompt and output so far when it runs again."""
        self.recompute(request)
        request.preemptions += 1
        self.num_preemptions += 1

    def recompute(self, request: Request) -> None:
        """Drop a running request's K/V: its prompt and output so far are computed again (under the
        weights then in force, keyed by their version in the prefix cache) before its next token."""
        if request.status is not Status.RUNNING:
            return  # waiting: it holds no K/V
        self.blocks.release(request.blocks)
        request.num_computed, request.status, request.prefix = 0, Status.WAITING, Prefix()
        self.running.remove(request)
        self.waiting.appendleft(request)

    def schedule(self) -> list[Scheduled]:
        """This step's (request, new tokens): running requests first (oldest first), then waiting
        ones while sequence slots, token budget and blocks last; a waiting request starts after the
        blocks the prefix cache holds for it. The newest running request is preempted when an older
        one needs a block. Blocks this step fills are keyed now: a request admitted later in the same
        step may share them, since each layer writes the step's K/V before any attention reads."""
        budget = self.token_budget
        scheduled: list[Scheduled] = []
        for request in list(self.running):
            if request.status is not Status.RUNNING:
                continue  # preempted for an older request in this loop
            n = min(request.num_tokens - request.num_computed, budget)
            if n == 0:
                continue
            while not self.blocks.can_grow(request.blocks, request.num_computed + n):
                self.preempt(self.running[-1])
                if request.status is not Status.RUNNING:
                    break
            else:
                self.grow(request, n)
                scheduled.append(Scheduled(request, n))
                budget -= n
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            request = self.waiting[0]
            tokens = request.tokens
            hits, prefix = self.blocks.lookup(tokens, request.cache_salt)
            if request.params.return_routed_experts:  # a cached block is not recomputed, so not routed
                hits, prefix = [], Prefix()
            cached = len(hits) * self.blocks.block_size
            n = min(len(tokens) - cached, budget)
            if not self.blocks.can_take(hits, cached + n):
                break
            self.waiting.popleft()
            self.blocks.count_query(len(tokens), cached)
            if request.preemptions == 0:
                request.cached_tokens = cached
            self.blocks.take(request.blocks, hits)
            request.num_computed, request.prefix, request.status = cached, prefix, Status.RUNNING
            self.running.append(request)
            self.grow(request, n)
            scheduled.append(Scheduled(request, n))
            budget -= n
        return scheduled

    def grow(self, request: Request, n: int) -> None:
        """Blocks for `request`'s next `n` tokens; the blocks they fill join the prefix cache."""
        upto = request.num_computed + n
        self.blocks.grow(request.blocks, upto)
        if self.blocks.caching and upto // self.blocks.block_size > request.prefix.blocks:  # a block fills up
            request.prefix = self.blocks.cache(request.blocks, request.tokens, upto, request.prefix, request.cache_salt)

    def postprocess(self, scheduled: list[Scheduled], samples: list[Sample]) -> None:
        """Advance every request of the step; `samples` holds one token per chunk that `samples`, in order."""
        drawn = iter(samples)
        for chunk in scheduled:
            sampled = chunk.samples
            chunk.request.num_computed += chunk.num_tokens
            if sampled:
                self.append(chunk.request, next(drawn))

    def append(self, request: Request, sample: Sample) -> None:
        params, rules = request.params, self.rules
        request.append_token(sample)
        if (sample.token in rules.eos and not params.ignore_eos) or sample.token in params.stop_token_ids:
            return self.finish(request, "stop", matched=sample.token)
        if params.stop:
            text = rules.decode(request.output_ids)
            for stop in params.stop:
                if stop in text:
                    return self.finish(request, "stop", text[: text.index(stop)], stop)
        if len(request.output_ids) >= params.max_tokens or request.num_tokens >= rules.max_model_len:
            self.finish(request, "length")

    def finish(self, request: Request, reason: str, text: str | None = None, matched: int | str | None = None) -> None:
        """End `request` (running, or still waiting when aborted); its blocks are free at once."""
        (self.running if request.status is Status.RUNNING else self.waiting).remove(request)
        request.status, request.finish_reason, request.matched = Status.FINISHED, reason, matched
        request.text = self.rules.decode(request.output_ids) if text is None else text
        self.blocks.release(request.blocks)
