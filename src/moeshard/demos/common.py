"""What the `moeshard rl` loops share, the colocated one (rl.py) and the disaggregated ones
(disaggregated.py, asynchronous.py): their options, a step's record, the task's reward and training problems, and
the trainer's step behind its logprob check.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

from moeshard.bundled.arithmetic import Problem, random_problem
from moeshard.demos.grpo import GRPOConfig, Rollout
from moeshard.parallel import Layout

WEAK_MODEL_DIR = Path(__file__).parents[1] / "bundled" / "arithmetic_moe_weak"


class LogprobGapError(RuntimeError):
    """The engine's logprobs disagree with the trainer's on the tokens the engine sampled."""


@dataclass(frozen=True)
class RLOptions:
    steps: int | None = None  # None: as many as `minutes` allow
    minutes: float = 5.0  # the loop's time budget (start-up and the last accuracy come on top)
    problems: int = 32  # P per step
    group: int = 8  # G completions per problem
    eval_every: int = 25
    eval_problems: int = 500
    layout: Layout = Layout(1, 2, True)
    moe_comm: str = "alltoall"
    compile: bool | str = False
    seed: int = 0
    # The G samples of a problem share its prompt's KV blocks; the prompts are ~9 tokens, so blocks of 4.
    prefix_caching: bool = True
    block_size: int = 4
    model: Path = WEAK_MODEL_DIR
    grpo: GRPOConfig = GRPOConfig()
    # The engine's numbers. float32 is the trainer's, so any gap is a bug and refused; bfloat16 or
    # quantized weights (quantized again at every sync: docs/quantization.md) sample from a policy
    # that differs from the trainer's on purpose, which grpo.tis_cap corrects (docs/rl.md).
    dtype: str | None = None  # None: float32, or bfloat16 with quantization (quantized weights compute in it)
    quantization: str | None = None
    quantization_skip: tuple[str, ...] = ()
    quantization_group: int = 128
    quantize_activations: bool = False

    def __post_init__(self):
        if self.grpo.tis_cap is not None and not self.mismatched:
            raise ValueError(
                "truncated importance sampling (tis_cap) corrects rollouts computed otherwise than the trainer "
                "(quantization, or dtype bfloat16); with float32 rollouts any gap over the tolerance is refused instead."
            )
        if self.mismatched and self.grpo.batch_invariant:
            raise ValueError("batch_invariant trains on the engine's float32 logprobs bit for bit; it cannot run with "
                             f"dtype={self.engine_dtype!r}, quantization={self.quantization!r}.")

    @property
    def engine_dtype(self) -> str:
        return self.dtype or ("bfloat16" if self.quantization else "float32")

    @property
    def mismatched(self) -> bool:
        """The engine samples from a policy other than the trainer's float32 one, on purpose."""
        return self.engine_dtype != "float32" or self.quantization is not None

    def engine_options(self) -> dict:
        """LLM's numeric options: dtype and quantization."""
        return dict(dtype=self.engine_dtype, quantization=self.quantization, quantization_skip=self.quantization_skip,
                    quantization_group=self.quantization_group, quantize_activations=self.quantize_activations)

    @property
    def per_group(self) -> int:
        """A step's rollouts per DP group: the engine runs them all at once."""
        return -(-self.problems * self.group // self.layout.dp)


@dataclass
class StepRecord:
    step: int  # 0: the starting policy, before any update
    reward_mean: float | None = None
    accuracy: float | None = None  # held-out greedy exact match after this step's update (None: not measured)
    max_abs_dlogprob: float | None = None  # engine vs trainer on this step's sampled tokens
    mean_abs_dlogprob: float | None = None
    max_ratio_deviation: float | None = None  # max |exp(trainer − engine) − 1|: the importance ratio's error
    tis_mean: float | None = None  # with truncated importance sampling: the sampled tokens' mean weight
    tis_truncated_share: float | None = None  # … and the share of them whose ratio was over the cap
    rollout_tokens: int | None = None  # completion tokens the server sampled for this step (async: since the step before)
    rollout_tok_s: float | None = None
    sleep_s: float | None = None
    update_s: float | None = None
    wake_s: float | None = None
    train_s: float | None = None
    rss_engine_awake_mb: float | None = None  # all engine ranks together
    rss_engine_asleep_mb: float | None = None
    rss_trainer_awake_mb: float | None = None
    rss_trainer_asleep_mb: float | None = None
    engine_held_mb: float | None = None  # the engine's weights, derived tensors and KV cache, all ranks
    routing_disagreement: float | None = None  # with routing replay: share of (token, MoE layer) the trainer would route otherwise
    # The asynchronous loop (--async) only:
    pause_s: float | None = None  # generation paused around this step's weights sync (pause → continue answered)
    idle_s: float | None = None  # time since the step before with no rollout in flight (every slot out: sent, not taken)
    staleness: list[int] | None = None  # trained samples by how many versions their oldest token is behind: [0, 1, …]
    dropped: int | None = None  # samples over the staleness bound, not trained on
    spanning: int | None = None  # trained samples whose tokens came from two versions or more
    version_gaps: dict[str, float] | None = None  # max |Δ logprob| per version, over the tokens that version sampled
    elapsed_s: float = 0.0


def reward(problem: Problem, text: str) -> float:
    """Exact match. No format reward: every completion of the starting policy is already a
    well-formed number, so one would add a constant and teach nothing."""
    return float(text == problem.answer)


def training_problems(rng: random.Random, n: int, excluded: set[str]) -> list[Problem]:
    problems = []
    while len(problems) < n:
        problem = random_problem(rng)
        if problem.prompt not in excluded:
            problems.append(problem)
    return problems


def train_on(trainer, rollout: Rollout, step: int, tolerance: float) -> tuple[dict, float]:
    """The trainer's report on `rollout` and its seconds; a LogprobGapError if it refused to train."""
    t0 = time.perf_counter()
    report = trainer.step(rollout)
    if not report["trained"]:
        raise LogprobGapError(
            f"step {step}: the engine's logprobs differ from the trainer's on the tokens it sampled by up to "
            f"{report['max_abs_dlogprob']:.3g} (tolerance {tolerance:g}, importance ratio off by "
            f"{report['max_ratio_deviation']:.3g}); the rollout was not trained on."
        )
    return report, time.perf_counter() - t0


def mismatch(report: dict) -> dict:
    """A step record's engine-vs-trainer fields from the trainer's report (TIS's where it applied them)."""
    fields = ("max_abs_dlogprob", "mean_abs_dlogprob", "max_ratio_deviation", "tis_mean", "tis_truncated_share")
    return {k: report.get(k) for k in fields}
