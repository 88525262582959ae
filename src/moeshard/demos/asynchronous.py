"""`moeshard rl --disaggregated --async`: the GRPO loop with rollouts that never wait for a step.

AReaL / PipelineRL style. A rollout thread (an asyncio loop over the openai client) sends GRPO
groups (G samples of one problem, one request each) to `moeshard serve` whenever fewer than
`capacity` groups are out (in flight, or back and not yet taken; default: one step's worth, P); a
group that comes back goes on a queue. The trainer takes P groups a step from the queue, oldest
first — each one it takes frees a slot, so the next group is sent while it trains — and then sends
the new weights with pause(keep) → update_weights_from_distributed (version `step-N`) → continue:
the requests in flight are parked for that one update and go on under the new weights, keeping
their K/V (`kv_after_update="keep"`) or recomputing it first (`"recompute"`). So a sample's tokens
may come from several versions; each choice's `weight_versions` spans say which.

Versions: the server's starting weights are 0, `step-N` is N; the trainer's weights at step s are
version s − 1, and a sample is s − 1 − (its oldest token's version) versions stale. With
`capacity` = P a step trains on the groups sent while the step before trained: 1 version stale,
or 0 if the server is the slower side.

- Staleness bound (PipelineRL's max lag; AReaL's max_head_offpolicyness bounds it by admission,
  as `capacity` does): a group with a sample more than `max_staleness` versions stale is dropped
  whole (its advantages are relative to each other) and the trainer takes the next one.
- Importance weights: PPO's ratio is taken to the engine's logprobs, the policy that sampled each
  token whatever its version (the gap check shows they are the trainer's under that version), and
  clipped at 1 ± ε as in every step: a stale token counts with weight π_now / π_sampled, and one
  the policy has already moved past the clip stops pulling.
- The gap check runs per version: the trainer keeps the weights of the last `max_staleness + 1`
  versions and recomputes every sampled token's logprob as the engine computed it — under the
  version that sampled it, over the K/V that each earlier position's own forward wrote (keep) or
  over K/V of that version throughout (recompute) — and compares it with the engine's: max |Δ| per
  version; over the tolerance the run stops (LogprobGapError) before training on it.
"""

from __future__ import annotations

import asyncio
import copy
import queue
import random
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import openai
import torch

from moeshard.bundled.arithmetic import ANSWER_TOKENS, Problem
from moeshard.demos.common import LogprobGapError, RLOptions, StepRecord, reward, training_problems
from moeshard.demos.disaggregated import Session, held_out_split, rollout_of, serving, train_loop, version_name, version_number
from moeshard.demos.grpo import EngineMirror, Trainer, logprob_gap, sampled_lengths

GIL_SWITCH_S = 0.0005


@dataclass(frozen=True)
class AsyncOptions:
    max_staleness: int = 1  # versions a sample's oldest token may be behind the trainer's weights
    capacity: int | None = None  # groups sent and not yet taken by the trainer (None: RLOptions.problems)
    kv_after_update: str = "keep"  # what the parked requests' K/V does at an update (moeshard serve --kv-after-update)


def token_versions(spans: list[dict], tokens: int) -> list[int]:
    """Each completion token's version from a choice's `weight_versions`, checked to cover its
    tokens exactly once, in order, with versions that never go back."""
    versions: list[int] = []
    for span in spans:
        if span["start"] != len(versions) or span["end"] <= span["start"]:
            break
        versions += [version_number(span["version"])] * (span["end"] - span["start"])
    if len(versions) != tokens or versions != sorted(versions):
        raise RuntimeError(f"the weight_versions {spans} do not cover the choice's {tokens} tokens once, in order.")
    return versions


@dataclass
class Group:
    """One problem's G samples as the server returned them, and each sample's token versions."""

    problem: Problem
    choices: list
    versions: list[list[int]]

    def staleness(self, current: int) -> list[int]:
        return [current - min(v) for v in self.versions]


class Rollouts:
    """Groups sent from a thread of its own (an asyncio loop over the openai client) while fewer than
    `capacity` are out — in flight, or back and not yet taken; `take()` the next one back, which
    frees its slot."""

    def __init__(self, session: Session, options: RLOptions, capacity: int, problems: random.Random, excluded: set[str]):
        self.session, self.options, self.problems, self.excluded = session, options, problems, excluded
        self.back: queue.Queue = queue.Queue()  # Groups, or the exception a request raised
        self.slots = asyncio.Semaphore(capacity)
        self.sent = self.in_flight = 0  # groups sent (for their seeds), and of them in flight
        self.tokens = 0  # completion tokens the server sampled for the groups back so far
        self.idle_s, self.idle_since = 0.0, time.perf_counter()  # time with no request in flight: all slots full
        self.loop = asyncio.new_event_loop()
        self.main = self.loop.create_task(self.keep_sending(str(session.client.base_url)))
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        try:
            self.loop.run_until_complete(self.main)
        except asyncio.CancelledError:
            pass  # close()
        finally:
            self.loop.close()

    async def keep_sending(self, url: str) -> None:
        async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600) as client:
            async with asyncio.TaskGroup() as requests:
                while True:
                    await self.slots.acquire()
                    [problem] = training_problems(self.problems, 1, self.excluded)
                    requests.create_task(self.sample(client, problem, (self.options.seed * 1_000_003 + self.sent) * self.options.group))
                    self.sent += 1

    async def sample(self, client, problem: Problem, seed: int) -> None:
        if not self.in_flight:
            self.idle_s += time.perf_counter() - self.idle_since
        self.in_flight += 1
        try:
            answer = await client.completions.create(
                model=self.session.model, prompt=problem.prompt, max_tokens=ANSWER_TOKENS, **self.session.sampling(seed)
            )
            choices = sorted(answer.choices, key=lambda c: c.index)
            group = Group(problem, choices, [token_versions(c.weight_versions, len(c.token_ids)) for c in choices])
            self.tokens += sum(len(c.token_ids) for c in choices)
        except Exception as exc:  # re-raised by take(), in the trainer's thread
            group = exc
        self.in_flight -= 1
        if not self.in_flight:
            self.idle_since = time.perf_counter()
        self.back.put(group)

    def take(self) -> Group:
        group = self.back.get()
        if isinstance(group, Exception):
            raise RuntimeError(f"a rollout request failed: {group}") from group
        self.loop.call_soon_threadsafe(self.slots.release)
        return group

    def close(self) -> None:
        """Cancel the requests in flight (the server aborts them as their clients leave)."""
        self.loop.call_soon_threadsafe(self.main.cancel)
        self.thread.join()


class Versions:
    """The trainer's weights of the last few versions, and each sampled token's logprob recomputed
    as the engine computed it (the module's docstring): with transformers, as the trainer computes
    its own, or in batch-invariant mode with the engine's own code (EngineMirror), bit for bit."""

    def __init__(self, trainer: Trainer, kept: int):
        self.trainer, self.kept = trainer, kept
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        # one kept version's weights at a time
        self.mirror = EngineMirror(trainer.model_dir) if trainer.mirror is not None else None
        self.model = copy.deepcopy(trainer.model) if self.mirror is None else None
        self.loaded: int | None = None
        self.save(0)

    def save(self, version: int) -> None:
        """The trainer's weights as `version`; the oldest beyond `kept` are forgotten."""
        weights = self.trainer.model.state_dict() if self.mirror is None else self.trainer.checkpoint_weights()
        self.weights[version] = {n: t.detach().clone() for n, t in weights.items()}
        for old in [v for v in self.weights if v <= version - self.kept]:
            del self.weights[old]

    def load(self, version: int) -> None:
        if version not in self.weights:
            raise RuntimeError(f"the trainer no longer keeps version {version}'s weights (it keeps {sorted(self.weights)}).")
        if self.loaded != version:
            if self.mirror is None:
                self.model.load_state_dict(self.weights[version])
            else:
                self.mirror.load(self.weights[version])
            self.loaded = version

    @torch.no_grad()
    def logprobs(self, tokens_NS: torch.Tensor, lengths_N: torch.Tensor, segments: list[tuple[int, int, int]]) -> torch.Tensor:
        """Every token's logprob given the ones before it (through `lengths_N`), each run of
        positions [start, end) computed under its version over the K/V of the runs before it."""
        if self.mirror is not None:
            return self.mirror.sampled_logprobs(tokens_NS, lengths_N, segments, self.load)
        from transformers import DynamicCache

        cache, logits = DynamicCache(), []
        for version, start, end in segments:
            self.load(version)
            logits.append(self.model(input_ids=tokens_NS[:, start:end], cache=cache, use_cache=True).logits.float())
        logprobs_NS = torch.cat(logits, 1)[:, :-1].log_softmax(-1).gather(-1, tokens_NS[:, 1:, None]).squeeze(-1)
        return torch.nn.functional.pad(logprobs_NS, (1, 0))

    def as_sampled(self, tokens_NS: torch.Tensor, sampled_NS: torch.Tensor, forward_NS: torch.Tensor, kv: str) -> torch.Tensor:
        """Each sampled token's logprob under the version that sampled it (`sampled_NS`, −1 where
        none): with `keep`, over the K/V each position's own forward wrote (`forward_NS`); with
        `recompute`, over K/V recomputed under the sampling version."""
        out_NS = torch.zeros(tokens_NS.shape)
        jobs: dict[tuple, list[int]] = {}  # rows computed alike → their rows
        for i in range(len(tokens_NS)):
            if kv == "keep":
                jobs.setdefault(tuple(runs(forward_NS[i].tolist())), []).append(i)
            else:
                for version in sampled_NS[i].unique().tolist():
                    if version >= 0:
                        jobs.setdefault(((version, 0, tokens_NS.shape[1]),), []).append(i)
        for segments, rows in jobs.items():
            logprobs_NS = self.logprobs(tokens_NS[rows], sampled_lengths(sampled_NS[rows] >= 0), list(segments))
            # keep: every sampled token of these rows; recompute: the job's version's tokens
            mask_NS = sampled_NS[rows] >= 0 if kv == "keep" else sampled_NS[rows] == segments[0][0]
            out_NS[rows] = torch.where(mask_NS, logprobs_NS, out_NS[rows])
        return out_NS


def runs(values: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values."""
    out: list[tuple[int, int, int]] = []
    for i, value in enumerate(values):
        if out and out[-1][0] == value:
            out[-1] = (value, out[-1][1], i + 1)
        else:
            out.append((value, i, i + 1))
    return out


def version_tensors(samples: list[tuple[int, list[int]]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From each sample's (prompt length, completion tokens' versions), [N, S] int64: the version
    that sampled each token (−1: prompt and padding), and the version each position's forward ran
    under in the engine — the prefill's (which sampled the first token) for the prompt, and for each
    sampled token the one that sampled the next (its forward did); the last token is never fed
    back, so it and the padding repeat the last."""
    sampled, forward = [], []
    for prompt, versions in samples:
        sampled.append([-1] * prompt + versions + [-1] * (width - prompt - len(versions)))
        ran = [versions[0]] * prompt + versions[1:]
        forward.append(ran + [ran[-1]] * (width - len(ran)))
    return torch.tensor(sampled), torch.tensor(forward)


class AsyncLoop:
    """The trainer's step: take P groups within the staleness bound, check the gap per version,
    train, send the weights under pause(keep)."""

    def __init__(self, session: Session, options: RLOptions, asynchronous: AsyncOptions, excluded: set[str]):
        self.session, self.options, self.asynchronous, self.excluded = session, options, asynchronous, excluded
        self.versions = Versions(session.trainer, asynchronous.max_staleness + 1)
        self.rollouts: Rollouts | None = None

    def begin(self) -> None:
        """Start the rollouts (after step 0's accuracy)."""
        capacity = self.asynchronous.capacity or self.options.problems
        self.rollouts = Rollouts(self.session, self.options, capacity, random.Random(self.options.seed), self.excluded)
        self.tokens, self.idle_s, self.since = 0, 0.0, time.perf_counter()  # the rollouts' figures at the last step, and when

    def close(self) -> None:
        if self.rollouts is not None:
            self.rollouts.close()

    def take(self, current: int) -> tuple[list[Group], int]:
        """P groups, oldest first, within the bound; and how many samples were dropped over it."""
        kept, dropped = [], 0
        while len(kept) < self.options.problems:
            group = self.rollouts.take()
            if max(group.staleness(current)) > self.asynchronous.max_staleness:
                dropped += len(group.choices)
            else:
                kept.append(group)
        return kept, dropped

    def step(self, step: int) -> StepRecord:
        trainer, current = self.session.trainer, step - 1
        groups, dropped = self.take(current)
        choices = [c for g in groups for c in g.choices]
        rewards = [reward(g.problem, c.text) for g in groups for c in g.choices]
        rollout, _ = rollout_of(choices, rewards, self.options.group, 0, 0)
        samples = [(len(c.prompt_token_ids), v) for g in groups for c, v in zip(g.choices, g.versions)]
        sampled_NS, forward_NS = version_tensors(samples, rollout.tokens_NS.shape[1])

        t0 = time.perf_counter()
        overall, gaps = self.check(step, rollout, sampled_NS, forward_NS)
        trainer.train(rollout, rollout.engine_logprobs_NS)  # the ratio to the policy that sampled each token
        train_s = time.perf_counter() - t0

        update_s, pause_s = self.session.send_weights(step, pause=True)
        self.versions.save(step)
        staleness = [s for g in groups for s in g.staleness(current)]
        now, tokens, idle_s = time.perf_counter(), self.rollouts.tokens, self.rollouts.idle_s
        produced, idle, seconds = tokens - self.tokens, idle_s - self.idle_s, now - self.since
        self.tokens, self.idle_s, self.since = tokens, idle_s, now
        return StepRecord(
            step=step, reward_mean=sum(rewards) / len(rewards), max_abs_dlogprob=overall["max_abs_dlogprob"],
            mean_abs_dlogprob=overall["mean_abs_dlogprob"], max_ratio_deviation=overall["max_ratio_deviation"],
            rollout_tokens=produced, rollout_tok_s=produced / seconds, update_s=update_s, pause_s=pause_s, idle_s=idle,
            train_s=train_s, dropped=dropped, staleness=[staleness.count(k) for k in range(max(staleness) + 1)],
            spanning=sum(len(set(v)) > 1 for g in groups for v in g.versions),
            version_gaps={version_name(v): gap for v, gap in gaps.items()},
        )

    def check(self, step: int, rollout, sampled_NS: torch.Tensor, forward_NS: torch.Tensor) -> tuple[dict, dict[int, float]]:
        """The gap between the engine's logprobs and the trainer's under the weights that sampled
        each token: over every token, and its max per version; over the tolerance, LogprobGapError."""
        as_sampled_NS = self.versions.as_sampled(rollout.tokens_NS, sampled_NS, forward_NS, self.asynchronous.kv_after_update)
        overall = logprob_gap(as_sampled_NS, rollout.engine_logprobs_NS, rollout.completion_NS)
        gaps = {v: logprob_gap(as_sampled_NS, rollout.engine_logprobs_NS, sampled_NS == v)["max_abs_dlogprob"]
                for v in sampled_NS.unique().tolist() if v >= 0}
        tolerance = self.options.grpo.tolerance
        if overall["max_abs_dlogprob"] > tolerance:
            raise LogprobGapError(
                f"step {step}: the engine's logprobs differ from the trainer's under the weights that sampled them by up "
                f"to {overall['max_abs_dlogprob']:.3g} on the tokens of version {version_name(max(gaps, key=gaps.get))} "
                f"(tolerance {tolerance:g}); the rollout was not trained on."
            )
        return overall, gaps


def run_async(options: RLOptions, asynchronous: AsyncOptions, log_dir: Path, on_step=lambda record: None) -> list[StepRecord]:
    """The asynchronous loop against a `moeshard serve` it starts; one record per step (step 0: the start)."""
    if options.mismatched:
        raise ValueError("--async does not take --quantization or --dtype bfloat16 yet: its per-version gap check has no "
                         "importance-sampling correction.")
    start = time.monotonic()
    _, excluded = held_out_split(options)
    with beside_rollouts():
        trainer = Trainer(str(options.model), options.grpo, options.seed)
        with serving(options, log_dir, "--kv-after-update", asynchronous.kv_after_update) as base:
            session = Session(base, trainer, options)
            loop = AsyncLoop(session, options, asynchronous, excluded)
            try:
                records = train_loop(session, options, loop.step, start, on_step, begin=loop.begin)
            finally:
                loop.close()
            session.close()
    return records


@contextmanager
def beside_rollouts() -> Iterator[None]:
    """This process's settings while the rollouts run beside the trainer. One OpenMP thread for the
    trainer: the server's ranks hold the other cores, and a second thread would wait on them
    (measured here: a forward of 256 samples 0.6 s on 1 thread, 4.8 s on 2). A GIL switch interval
    of 0.5 ms: at 5 ms, the rollout thread's parsing holds the trainer back at each of a forward's
    many small ops (measured: a forward 35% slower beside a thread busy 10% of the time; 0.5 ms: none)."""
    threads, interval = torch.get_num_threads(), sys.getswitchinterval()
    torch.set_num_threads(1)
    sys.setswitchinterval(GIL_SWITCH_S)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        sys.setswitchinterval(interval)
