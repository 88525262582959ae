"""Requests and the scheduler of one DP group: waiting and running queues, chunked prefill under a
token budget, mixed prefill + decode steps, preemption by recompute when KV blocks run out.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

import torch

from moeshard.engine.block_manager import BlockManager
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
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    status: Status = Status.WAITING
    finish_reason: str | None = None
    text: str = ""
    preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, token_budget: int):
        self.blocks, self.max_num_seqs, self.token_budget = blocks, max_num_seqs, token_budget
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def preempt(self, request: Request) -> None:
        """Free its blocks; it recomputes its prompt and output so far when it runs again."""
        self.blocks.release(request.blocks)
        request.num_computed, request.status = 0, Status.WAITING
        request.preemptions += 1
        self.running.remove(request)
        self.waiting.appendleft(request)

    def schedule(self) -> list[tuple[Request, int]]:
        """This step's (request, new tokens): running requests first (oldest first), then waiting
        ones while sequence slots, token budget and blocks last. The newest running request is
        preempted when an older one needs a block."""
        budget = self.token_budget
        scheduled: list[tuple[Request, int]] = []
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
                self.blocks.grow(request.blocks, request.num_computed + n)
                scheduled.append((request, n))
                budget -= n
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            request = self.waiting[0]
            n = min(request.num_tokens, budget)
            if not self.blocks.can_grow(request.blocks, n):
                break
            self.waiting.popleft()
            request.status = Status.RUNNING
            self.running.append(request)
            self.blocks.grow(request.blocks, n)
            scheduled.append((request, n))
            budget -= n
        return scheduled

    def finish(self, request: Request, reason: str) -> None:
        request.status, request.finish_reason = Status.FINISHED, reason
        self.blocks.release(request.blocks)
        self.running.remove(request)
