"""The engine core: persistent per-DP-group schedulers and one `step` over every rank (docs/DESIGN.md §7).

`add_request` queues a request on the DP group with the fewest unfinished requests, `abort` ends one
at once (its KV blocks are free when it returns), and `step` runs one step of every group in
lock-step on all ranks and returns what each request gained: its new tokens and text, and whether it
finished and why. Offline `LLM.generate` and online serving both drive this one loop.

The core is not thread-safe: one thread steps it (the async front end's loop thread, or the caller).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from moeshard.engine.block_manager import BlockManager
from moeshard.engine.plan import GroupPlan, NewRequest, PlannedChunk, StepPlan, decode_results, encode_plan
from moeshard.engine.sampling import SamplingParams
from moeshard.engine.scheduler import Request, Scheduled, Scheduler, Status, StopRules
from moeshard.models.runner import Chunk
from moeshard.parallel import Layout

INITIAL_VERSION = "default"  # the weight version of the model directory's weights (SGLang's name for them)


@dataclass
class RequestDelta:
    """What one request gained in one step."""

    request_id: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] | None = None  # per new token: top-N token → logprob, and the sampled one
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache
    weight_version: str = ""  # the weights in force for the request now
    # Which weights sampled which of its output tokens so far: [{version, start, end}] (end exclusive),
    # covering every token once; more than one span only after an update while it was parked.
    weight_versions: list[dict] = field(default_factory=list)
    matched: int | str | None = None  # finished with reason "stop": the token id or stop string that ended it
    # On the finished delta, with SamplingParams.return_routed_experts: [token][MoE layer][top_k] global
    # expert ids, for every token the model read (prompt + output but the last); an aborted request's
    # rows so far.
    routed_experts: list[list[list[int]]] | None = None


@dataclass
class StepStats:
    """Where the driver's steps went, for `moeshard bench e2e`: step wall time against rank 0's model
    forward (the rest is scheduling, plan transport, sampling and detokenizing), and the bytes a
    decode step moves between the driver and the ranks."""

    steps: int = 0
    step_s: float = 0.0
    forward_s: float = 0.0  # rank 0's (it runs in the driver's process)
    prefill_steps: int = 0  # steps that carried prompt chunks (of more than one token)
    prefill_s: float = 0.0
    prefill_tokens: int = 0  # the prompt tokens they carried
    decode_steps: int = 0
    decode_plan_bytes: int = 0  # broadcast to every rank
    decode_sample_bytes: int = 0  # sent back, all groups together

    @property
    def overhead_share(self) -> float:
        return 1 - self.forward_s / self.step_s if self.step_s else 0.0


@dataclass(frozen=True)
class EngineStats:
    """The engine's state between two steps, for /metrics."""

    running: int
    waiting: int
    kv_usage: float  # blocks in use / blocks, all DP groups
    preemptions: int  # since start
    moe_steps: dict[str, int]  # steps by MoE communication method (every rank runs the same one)
    routed_per_ep_rank: list[int]  # (token, expert) assignments each EP rank's experts received
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0  # of them, found there


@dataclass(frozen=True)
class CoreLimits:
    num_blocks: int
    block_size: int
    max_num_seqs: int  # per DP group
    token_budget: int  # per DP group and step
    prefix_caching: bool = True  # reuse full KV blocks by content (moeshard.engine.block_manager)


class EngineCore:
    def __init__(self, ranks, layout: Layout, limits: CoreLimits, rules: StopRules, seed: int = 0):
        """`ranks.execute(plan)` runs a step on every rank and returns each DP group's samples;
        `ranks.call(method, *args)` runs a Worker method on every rank (moeshard.engine.ranks)."""
        self.ranks, self.layout, self.rules = ranks, layout, rules
        self.groups = [
            Scheduler(
                BlockManager(limits.num_blocks, limits.block_size, caching=limits.prefix_caching),
                limits.max_num_seqs, limits.token_budget, rules,
            )
            for _ in range(layout.dp)
        ]
        self.requests: dict[int, tuple[Request, Scheduler]] = {}
        self.emitted: dict[int, tuple[int, int]] = {}  # request id → (tokens, characters) already handed out
        self.ids = itertools.count()
        self.seed_generator = torch.Generator().manual_seed(seed)
        self.finished: list[RequestDelta] = []  # aborted between steps, reported by the next step
        self.announced: set[int] = set()  # requests whose sampler the ranks hold
        self.forget: list[int] = []  # finished requests whose samplers the next step drops
        self.stats = StepStats()
        # Stamped on each request as it arrives; weights change while none runs (none is in flight, or
        # those in flight are parked by a pause: see `weights_updated`).
        self.weight_version = INITIAL_VERSION
        self.paused: str | None = None  # the pause mode in force (no step runs; requests in flight are parked)

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, request_id: int | None = None, cache_salt: str | None = None
    ) -> int:
        """Queue a checked request (the caller validated prompt and limits); returns its id.
        `cache_salt`: only requests with the same salt share prefix-cache blocks."""
        request_id = next(self.ids) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id} is already in use.")
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self.seed_generator))
        request = Request(request_id, list(prompt_ids), params, seed, cache_salt=cache_salt, weight_version=self.weight_version)
        group = min(self.groups, key=lambda g: len(g.waiting) + len(g.running))
        group.add(request)
        self.requests[request_id] = (request, group)
        self.emitted[request_id] = (0, 0)
        return request_id

    def abort(self, request_id: int) -> None:
        """End the request now, with reason "abort"; its blocks are free when this returns. The next
        `step` reports it. Unknown or finished ids are ignored (the request may have just ended)."""
        entry = self.requests.get(request_id)
        if entry is None or entry[0].status is Status.FINISHED:
            return
        request, group = entry
        group.finish(request, "abort")
        self.finished.append(self.delta(request))

    def weights_changed(self) -> None:
        """The weights are about to change (an update, a reload, a sleep that drops them): no block
        computed before can match a later lookup."""
        for group in self.groups:
            group.blocks.version += 1

    def name_weights(self, weight_version: str) -> None:
        """The weights in force are `weight_version` from here on: for new requests, and for the next
        tokens of those in flight."""
        self.weight_version = weight_version
        for request, _ in self.requests.values():
            request.weight_version = weight_version

    def weights_updated(self, kv_after_update: str) -> None:
        """New weights are in: every parked request runs on them from its next token, and its K/V is
        kept or (by its own kv_after_update, else the engine's) recomputed under them first."""
        for request, group in self.requests.values():
            request.weight_version = self.weight_version
            if (request.params.kv_after_update or kv_after_update) == "recompute":
                group.recompute(request)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (their memory is free at once; running requests keep theirs)."""
        for group in self.groups:
            group.blocks.reset()

    def take_finished(self) -> list[RequestDelta]:
        """The deltas of requests aborted since the last step, without stepping."""
        deltas, self.finished = self.finished, []
        return deltas

    @property
    def has_unfinished(self) -> bool:
        return any(g.has_work for g in self.groups) or bool(self.finished)

    def live_request_ids(self) -> list[int]:
        return [r.id for g in self.groups for r in [*g.running, *g.waiting]]

    def engine_stats(self, moe_steps: dict[str, int], routed_per_ep_rank: list[int]) -> EngineStats:
        used = sum(g.blocks.num_blocks - g.blocks.num_free for g in self.groups)
        return EngineStats(
            running=sum(len(g.running) for g in self.groups),
            waiting=sum(len(g.waiting) for g in self.groups),
            kv_usage=used / sum(g.blocks.num_blocks for g in self.groups),
            preemptions=sum(g.num_preemptions for g in self.groups),
            moe_steps=moe_steps,
            routed_per_ep_rank=routed_per_ep_rank,
            prefix_cache_queries=sum(g.blocks.queried_tokens for g in self.groups),
            prefix_cache_hits=sum(g.blocks.hit_tokens for g in self.groups),
        )

    def step(self) -> list[RequestDelta]:
        """One step of every DP group (an idle group still steps, so collectives stay matched)."""
        deltas = self.take_finished()
        if not any(g.has_work for g in self.groups):
            return deltas
        start, forward_s = time.perf_counter(), self.ranks.forward_s
        scheduled = [group.schedule() for group in self.groups]
        plan = StepPlan([self.plan_group(s) for s in scheduled], self.forget)
        self.forget = []
        plan_P = encode_plan(plan)
        try:
            results = self.ranks.execute(plan_P)
        except BaseException:
            self.reset_prefix_cache()  # blocks keyed for this step may hold nothing
            raise
        for group, chunks, results_R in zip(self.groups, scheduled, results):
            sampled = [s.request for s in chunks if s.samples]
            samples, routing = decode_results(results_R)
            for r in routing:
                self.requests[r.request_id][0].record_routing(r.start, r.experts_TYK)
            group.postprocess(chunks, samples)
            deltas += [self.delta(r) for r in sampled]
        self.count(plan, plan_P, results, time.perf_counter() - start, self.ranks.forward_s - forward_s)
        return deltas

    def count(self, plan: StepPlan, plan_P, results, step_s: float, forward_s: float) -> None:
        stats = self.stats
        stats.steps, stats.step_s, stats.forward_s = stats.steps + 1, stats.step_s + step_s, stats.forward_s + forward_s
        lengths = [len(c.chunk.token_ids) for g in plan.groups for c in g.chunks]
        if all(n == 1 for n in lengths):
            stats.decode_steps += 1
            stats.decode_plan_bytes += plan_P.numel() * plan_P.element_size()
            stats.decode_sample_bytes += sum(r.numel() * r.element_size() for r in results)
        else:
            stats.prefill_steps, stats.prefill_s = stats.prefill_steps + 1, stats.prefill_s + step_s
            stats.prefill_tokens += sum(n for n in lengths if n > 1)

    def plan_group(self, scheduled: list[Scheduled]) -> GroupPlan:
        """The group's chunks, with the requests its sampling rank meets for the first time."""
        new = []
        for s in scheduled:
            if s.request.id not in self.announced:
                self.announced.add(s.request.id)
                new.append(NewRequest(s.request.id, s.request.seed, s.request.params, self.suppressed(s.request.params)))
        chunks = [
            PlannedChunk(s.request.id, chunk_of(s), s.samples, s.request.params.return_routed_experts) for s in scheduled
        ]
        return GroupPlan(new, chunks)

    def suppressed(self, params: SamplingParams) -> tuple[int, ...]:
        """The ids a request may not sample before its min_tokens: EOS (unless ignored) and its stop ids."""
        if not params.min_tokens:
            return ()
        return tuple(sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else self.rules.eos)))

    def delta(self, request: Request) -> RequestDelta:
        """The tokens and text `request` has not yet handed out. While it runs, text that could be the
        start of a stop string is held back, so no stop string is ever streamed."""
        tokens_out, chars_out = self.emitted[request.id]
        finished = request.status is Status.FINISHED
        text = request.text if finished else self.rules.decode(request.output_ids)
        if not finished and request.params.stop:
            text = text[: max(chars_out, len(text) - max(len(s) for s in request.params.stop) + 1)]
        new_ids = request.output_ids[tokens_out:]
        delta = RequestDelta(
            request.id, new_ids, text[chars_out:], None, finished, request.finish_reason, request.cached_tokens,
            request.weight_version, request.weight_versions, request.matched,
        )
        if request.params.logprobs is not None:
            delta.logprobs = [s.top_logprobs | {s.token: s.logprob} for s in request.samples[tokens_out:]]
        if finished and request.params.return_routed_experts:
            delta.routed_experts = request.routed_experts
        self.emitted[request.id] = (len(request.output_ids), max(chars_out, len(text)))
        if finished:
            del self.requests[request.id], self.emitted[request.id]
            if request.id in self.announced:
                self.announced.remove(request.id)
                self.forget.append(request.id)
        return delta


def chunk_of(scheduled: Scheduled) -> Chunk:
    request, start = scheduled.request, scheduled.request.num_computed
    return Chunk(request.tokens[start : start + scheduled.num_tokens], start, list(request.blocks))

