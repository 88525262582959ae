"""`moeshard rl --disaggregated`: the GRPO loop with the engine as a server and the trainer elsewhere.

The way most RL frameworks run: `moeshard serve` is a process of its own with its own ranks
(1x2-ep by default), and this process is the trainer. Each step the trainer asks the server for
the rollouts over HTTP with the openai client (G seeded completions of P problems, token ids and
logprobs, and with routing replay each token's routed experts), checks that every answer names
the weight version it sent last, recomputes the logprobs (the gap check of `moeshard rl`), trains,
and sends the new weights over the weights group (`update_weights_from_distributed`, one broadcast
per tensor, received by every engine rank at once) under the next version. Neither side sleeps:
they hold different devices.

Routing replay (R3): the trainer's MoE routers take the experts the engine chose for each token
instead of their own top-k (the router's weights still get their gradient through the gathered
probabilities), so a near-tie the two sides round differently cannot send a token to different
experts in training than in the rollout.
"""

from __future__ import annotations

import itertools
import os
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import torch

from moeshard.bundled.arithmetic import ANSWER_TOKENS, HELD_OUT, exact_matches, held_out
from moeshard.demos.common import RLOptions, StepRecord, mismatch, reward, train_on, training_problems
from moeshard.demos.grpo import Rollout, Trainer, group_advantages
from moeshard.demos.remote import RemoteEngine
from moeshard.engine.core import INITIAL_VERSION
from moeshard.serve.launcher import free_port, running, serve_command

SERVER_THREADS = 2  # OMP threads of the server's process (each rank then runs 1)


class RoutingReplay:
    """Forward hooks on the trainer's MoE routers (transformers' top-k router modules, which return
    (logits, top-k weights, top-k ids)): while a replay is set, every token the engine routed takes
    the engine's experts, weighted by the router's own probabilities of them."""

    def __init__(self, model):
        self.routers = [m for m in model.modules() if hasattr(m, "top_k") and hasattr(m, "norm_topk_prob")]
        if not self.routers:
            raise ValueError(f"routing replay: {type(model).__name__} has no top-k router modules to replay into.")
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(lambda module, args, out, layer=layer: self.replace(module, out, layer))
        self.experts_NSYK: torch.Tensor | None = None  # -1 where the engine did not route the token
        self.disagreed = self.compared = 0  # (token, layer) pairs whose own top-k differed from the engine's

    def disagreement(self) -> float:
        if not self.compared:
            raise RuntimeError("routing replay compared no routed token: the replay did not reach the routers.")
        return self.disagreed / self.compared

    def replace(self, router, out, layer: int):
        if self.experts_NSYK is None:
            return out
        logits_TE, _, own_TK = out
        engine_TK = self.experts_NSYK[:, :, layer].reshape(own_TK.shape)
        known_T = engine_TK[:, 0] >= 0
        self.compared += int(known_T.sum())
        self.disagreed += int((own_TK.sort(-1).values != engine_TK.sort(-1).values).any(-1)[known_T].sum())
        chosen_TK = torch.where(known_T[:, None], engine_TK, own_TK)
        weights_TK = logits_TE.float().softmax(-1).gather(1, chosen_TK)
        if router.norm_topk_prob:
            weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
        return logits_TE, weights_TK.to(logits_TE.dtype), chosen_TK


class ReplayTrainer(Trainer):
    """The colocated loop's trainer, its routers replaying the rollout's routing."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.replay = RoutingReplay(self.model)
        self.routed_NSYK: torch.Tensor | None = None

    def logprobs(self, rollout: Rollout, rows: torch.Tensor | None = None) -> torch.Tensor:
        self.replay.experts_NSYK = self.routed_NSYK if rows is None else self.routed_NSYK[rows]
        try:
            return super().logprobs(rollout, rows)
        finally:
            self.replay.experts_NSYK = None


def rollout_of(choices, rewards: list[float], group: int, layers: int, top_k: int):
    """The sampled sequences (prompt then completion, right-padded) from the server's choices, and
    each token's routed experts [N, S, MoE layers, top_k] (-1 where none: padding, and the last token)."""
    sequences = [c.prompt_token_ids + c.token_ids for c in choices]
    width = max(map(len, sequences))
    tokens_NS = torch.zeros(len(choices), width, dtype=torch.int64)
    completion_NS = torch.zeros(len(choices), width, dtype=torch.bool)
    engine_NS = torch.zeros(len(choices), width)
    routed_NSYK = torch.full((len(choices), width, layers, top_k), -1, dtype=torch.int64)
    for i, (c, seq) in enumerate(zip(choices, sequences)):
        start = len(seq) - len(c.token_ids)
        tokens_NS[i, : len(seq)] = torch.tensor(seq)
        completion_NS[i, start : len(seq)] = True
        engine_NS[i, start : len(seq)] = torch.tensor(c.logprobs.token_logprobs)
        if layers:
            routed_NSYK[i, : len(c.routed_experts)] = torch.tensor(c.routed_experts)
    advantages_N = group_advantages(torch.tensor(rewards).view(-1, group))
    return Rollout(tokens_NS, completion_NS, engine_NS, advantages_N), routed_NSYK


def server_flags(options: RLOptions) -> tuple[str, ...]:
    """`moeshard serve`'s arguments for the loop's layout and engine options (its --dtype aside)."""
    layout, per_group = options.layout, options.per_group
    return (
        "--tp", str(layout.tp), "--dp", str(layout.dp), "--ep" if layout.ep else "--no-ep", "--moe-comm", options.moe_comm,
        "--enable-sleep-mode", "--block-size", str(options.block_size), "--max-num-batched-tokens", str(max(per_group * 8, 512)), *(("--sp",) if layout.sp else ()),
        *(("--no-enable-prefix-caching",) if not options.prefix_caching else ()),
        *(("--compile", "--compile-backend", options.compile) if options.compile else ()),
        *(("--batch-invariant",) if options.grpo.batch_invariant else ()),
        *(("--quantization", options.quantization, "--quantization-group", str(options.quantization_group))
          if options.quantization else ()),
        *(arg for name in options.quantization_skip for arg in ("--quantization-skip", name)),
        *(("--quantize-activations",) if options.quantize_activations else ()),
    )


def version_name(step: int) -> str:
    """The weights after `step` (0: the server's own) as the loop names them to the server."""
    return INITIAL_VERSION if step == 0 else f"step-{step}"


def version_number(name: str) -> int:
    return 0 if name == INITIAL_VERSION else int(name.removeprefix("step-"))


@contextmanager
def serving(options: RLOptions, log_dir: Path, *flags: str) -> Iterator[str]:
    """A `moeshard serve` for the loop (server_flags, then `flags`), its base URL while the block runs."""
    port = free_port()
    command = serve_command(str(options.model), port, max(options.per_group, 16), options.engine_dtype, (*server_flags(options), *flags))
    env = {**os.environ, "OMP_NUM_THREADS": str(SERVER_THREADS)}
    with running("moeshard", command, env, port, log_dir / "moeshard-serve.log"):
        yield f"http://127.0.0.1:{port}"


class Session:
    """The trainer's side of the loop: the server's address, the weights group, the current version."""

    def __init__(self, base: str, trainer: Trainer, options: RLOptions, replay: bool = False):
        # the model's name on the server: moeshard serve names it by its --model
        self.model, self.trainer, self.options, self.replay = str(options.model), trainer, options, replay
        self.client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600)
        self.remote = RemoteEngine(base)
        self.remote.join_weights_group(free_port())
        self.version = version_name(0)
        self.replay_shape = (len(trainer.replay.routers), trainer.replay.routers[0].top_k) if replay else (0, 0)  # Y, K

    def sampling(self, seed: int) -> dict:
        """The completion options of a rollout: G samples a prompt at temperature 1, seeded from
        `seed`, with their token ids and logprobs (and routed experts, to replay)."""
        return dict(n=self.options.group, temperature=1.0, logprobs=0, seed=seed,
                    extra_body={"return_token_ids": True, "return_routed_experts": self.replay})

    def completions(self, problems, step: int, **options) -> list:
        """The server's choices for `problems`, in order, each checked to come from `self.version`."""
        answer = self.client.completions.create(
            model=self.model, prompt=[p.prompt for p in problems], max_tokens=ANSWER_TOKENS, **options
        )
        choices = sorted(answer.choices, key=lambda c: c.index)
        wrong = {c.weight_version for c in choices} - {self.version}
        if wrong:
            raise RuntimeError(f"step {step}: the server answered with weight version(s) {sorted(wrong)}, not {self.version!r}.")
        return choices

    def accuracy(self, problems, step: int) -> float:
        choices = self.completions(problems, step, temperature=0)
        return exact_matches([c.text for c in choices], problems) / len(problems)

    def send_weights(self, step: int, pause: bool = False) -> tuple[float, float | None]:
        """The trainer's weights to the server as version `step-N`: the update's seconds, and with
        `pause` the seconds generation stood still around it — pause(keep) parks the requests in
        flight, which go on under the new weights once generation continues."""
        weights = self.trainer.checkpoint_weights()  # before the pause: it is the trainer's work
        version, t0 = version_name(step), time.perf_counter()
        if pause:
            self.remote.call("/pause_generation", {"mode": "keep"})
        try:
            _, update_s = self.remote.send_weights(weights, version)
        finally:
            if pause:
                self.remote.call("/continue_generation")
        self.version = version
        return update_s, time.perf_counter() - t0 if pause else None

    def step(self, step: int, problems) -> StepRecord:
        """Rollouts from the server, the gap check and training, then the new weights to the server."""
        group, trainer = self.options.group, self.trainer
        t0 = time.perf_counter()
        choices = self.completions(problems, step, **self.sampling((self.options.seed * 1_000_003 + step) * group))
        rollout_s = time.perf_counter() - t0
        if self.replay and any(getattr(c, "routed_experts", None) is None for c in choices):
            raise RuntimeError(f"step {step}: the server returned no routed_experts to replay.")
        rewards = [reward(p, c.text) for p, c in zip([p for p in problems for _ in range(group)], choices)]
        rollout, routed_NSYK = rollout_of(choices, rewards, group, *self.replay_shape)
        if self.replay:
            trainer.routed_NSYK, trainer.replay.disagreed, trainer.replay.compared = routed_NSYK, 0, 0
        report, train_s = train_on(trainer, rollout, step, self.options.grpo.tolerance)
        update_s, _ = self.send_weights(step)
        tokens = int(rollout.completion_NS.sum())
        return StepRecord(
            step=step, reward_mean=sum(rewards) / len(rewards), **mismatch(report), rollout_tokens=tokens,
            rollout_tok_s=tokens / rollout_s, update_s=update_s, train_s=train_s,
            routing_disagreement=trainer.replay.disagreement() if self.replay else None,
        )

    def close(self) -> None:
        self.remote.leave_weights_group()
        self.remote.close()


def held_out_split(options: RLOptions) -> tuple[list, set[str]]:
    """The held-out problems accuracy is measured on, and every held-out prompt (never trained on)."""
    held = held_out(HELD_OUT)
    return held[: options.eval_problems], {p.prompt for p in held}


def train_loop(session: Session, options: RLOptions, step_fn: Callable[[int], StepRecord], start: float,
               on_step=lambda record: None, begin=lambda: None) -> list[StepRecord]:
    """Step 0's accuracy, `begin()`, then `step_fn(step)` until `options.steps` or the time budget,
    with the held-out accuracy every `eval_every` steps and after the last; one record per step."""
    eval_set, _ = held_out_split(options)
    records = [StepRecord(0, accuracy=session.accuracy(eval_set, 0))]
    begin()
    records[0].elapsed_s = time.monotonic() - start  # the steps' clock starts here
    on_step(records[0])
    budget_end = time.monotonic() + options.minutes * 60
    for step in itertools.count(1):
        record = step_fn(step)
        last = step == options.steps or time.monotonic() >= budget_end
        if step % options.eval_every == 0 or last:
            record.accuracy = session.accuracy(eval_set, step)
        record.elapsed_s = time.monotonic() - start
        records.append(record)
        on_step(record)
        if last:
            return records


def run_disaggregated(options: RLOptions, replay: bool, log_dir: Path, on_step=lambda record: None) -> list[StepRecord]:
    """The loop against a `moeshard serve` it starts; one record per step (step 0: the start)."""
    start = time.monotonic()
    _, excluded = held_out_split(options)
    rng = random.Random(options.seed)
    trainer = (ReplayTrainer if replay else Trainer)(str(options.model), options.grpo, options.seed)
    with serving(options, log_dir) as base:
        session = Session(base, trainer, options, replay)
        records = train_loop(session, options, lambda step: session.step(step, training_problems(rng, options.problems, excluded)),
                             start, on_step)
        session.close()
    return records
