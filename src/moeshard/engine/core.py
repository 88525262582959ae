"""The engine core: persistent per-DP-group schedulers and one `step` over every rank (docs/DESIGN.md §7).

`add_request` queues a request on the DP group with the fewest unfinished requests, `abort` ends one
at once (its KV blocks are free when it returns), and `step` runs one step of every group in
lock-step on all ranks and returns what each request gained: its new tokens and text, and whether it
finished and why. Offline `LLM.generate` and online serving both drive this one loop.

The core is not thread-safe: one thread steps it (the async front end's loop thread, or the caller).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from moeshard.engine.block_manager import BlockManager
from moeshard.engine.sampling import SamplingParams, sample_batch
from moeshard.engine.scheduler import Request, Scheduled, Scheduler, Status, StopRules
from moeshard.models.runner import Chunk
from moeshard.parallel import Layout


@dataclass
class RequestDelta:
    """What one request gained in one step."""

    request_id: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] | None = None  # per new token: top-N token → logprob, and the sampled one
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error


@dataclass(frozen=True)
class CoreLimits:
    num_blocks: int
    block_size: int
    max_num_seqs: int  # per DP group
    token_budget: int  # per DP group and step


class EngineCore:
    def __init__(self, ranks, layout: Layout, limits: CoreLimits, rules: StopRules, seed: int = 0):
        """`ranks.call(method, *args)` runs a Worker method on every rank and returns each rank's result."""
        self.ranks, self.layout, self.rules = ranks, layout, rules
        self.groups = [
            Scheduler(
                BlockManager(limits.num_blocks, limits.block_size), limits.max_num_seqs, limits.token_budget, rules
            )
            for _ in range(layout.dp)
        ]
        self.requests: dict[int, tuple[Request, Scheduler]] = {}
        self.emitted: dict[int, tuple[int, int]] = {}  # request id → (tokens, characters) already handed out
        self.ids = itertools.count()
        self.seed_generator = torch.Generator().manual_seed(seed)
        self.finished: list[RequestDelta] = []  # aborted between steps, reported by the next step

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: int | None = None) -> int:
        """Queue a checked request (the caller validated prompt and limits); returns its id."""
        request_id = next(self.ids) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id} is already in use.")
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self.seed_generator))
        request = Request(request_id, list(prompt_ids), params, torch.Generator().manual_seed(seed))
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

    @property
    def has_unfinished(self) -> bool:
        return any(g.has_work for g in self.groups) or bool(self.finished)

    def num_unfinished(self) -> int:
        return sum(len(g.waiting) + len(g.running) for g in self.groups)

    def step(self) -> list[RequestDelta]:
        """One step of every DP group (an idle group still steps, so collectives stay matched)."""
        deltas, self.finished = self.finished, []
        if not any(g.has_work for g in self.groups):
            return deltas
        plans = [group.schedule() for group in self.groups]
        per_rank = self.ranks.call("execute", [[chunk_of(s) for s in plan] for plan in plans])
        for d, (group, plan) in enumerate(zip(self.groups, plans)):
            logits = per_rank[self.layout.rank(d, 0)]
            ready = [i for i, scheduled in enumerate(plan) if scheduled.samples]
            requests = [plan[i].request for i in ready]
            samples = []
            if ready:
                rows = torch.stack([logits[i] for i in ready])
                samples = sample_batch(rows, [r.params for r in requests], [r.generator for r in requests])
            group.postprocess(plan, samples)
            deltas += [self.delta(r) for r in requests]
        return deltas

    def delta(self, request: Request) -> RequestDelta:
        """The tokens and text `request` has not yet handed out. While it runs, text that could be the
        start of a stop string is held back, so no stop string is ever streamed."""
        tokens_out, chars_out = self.emitted[request.id]
        finished = request.status is Status.FINISHED
        text = request.text if finished else self.rules.decode(request.output_ids)
        if not finished and request.params.stop:
            text = text[: max(chars_out, len(text) - max(len(s) for s in request.params.stop) + 1)]
        new_ids = request.output_ids[tokens_out:]
        delta = RequestDelta(request.id, new_ids, text[chars_out:], None, finished, request.finish_reason)
        if request.params.logprobs is not None:
            delta.logprobs = [s.top_logprobs | {s.token: s.logprob} for s in request.samples[tokens_out:]]
        self.emitted[request.id] = (len(request.output_ids), max(chars_out, len(text)))
        if finished:
            del self.requests[request.id], self.emitted[request.id]
        return delta


def chunk_of(scheduled: Scheduled) -> Chunk:
    request, start = scheduled.request, scheduled.request.num_computed
    return Chunk(request.tokens[start : start + scheduled.num_tokens], start, list(request.blocks))

