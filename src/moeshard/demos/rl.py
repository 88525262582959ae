"""`moeshard rl`: a colocated GRPO loop on the bundled arithmetic task, engine and trainer side by side.

Each step the engine samples G completions of P training problems (temperature 1, every request
seeded); the reward is exact match; the engine sleeps (level 2: weights and KV cache released); the
trainer (moeshard.demos.grpo, its own process) recomputes the logprobs of the sampled tokens,
checks them against the engine's, and takes clipped policy-gradient steps; the engine wakes with
poisoned memory, takes the new weights over the pipe and samples again. Every K steps the engine
measures greedy exact-match accuracy on held-out problems.

The policy starts from `arithmetic_moe_weak/`: the bundled architecture trained by the training
script on an imperfect teacher, one that forgets to carry in 3 answers of 5
(`--uncarried 0.6`). Greedy, it answers every problem that needs a carry the teacher's way (held-out
accuracy 0.29), yet it samples the right answer 2 times in 5: what RL with a verifier is for. It
is float32, so trainer and engine hold the same numbers. A gap between the engine's logprobs and
the trainer's over the tolerance stops the run with an error naming it, before the trainer trains
on it. With quantized (or bf16) rollouts the engine's policy differs from the trainer's on purpose:
the engine quantizes the trainer's float32 weights at every sync, and instead of refusing the gap
the trainer weights each sampled token by min(π_trainer / π_engine, C) (token-level truncated
importance sampling, C = 2 as verl's rollout correction), each step quoting the mismatch.
"""

from __future__ import annotations

import itertools
import json
import math
import multiprocessing as mp
import os
import random
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from moeshard.bundled.arithmetic import ANSWER_TOKENS, HELD_OUT, Problem, exact_matches, held_out
from moeshard.demos.common import (WEAK_MODEL_DIR, LogprobGapError, RLOptions, StepRecord, mismatch, reward, train_on,
                                   training_problems)
from moeshard.demos.asynchronous import AsyncOptions, run_async
from moeshard.demos.disaggregated import run_disaggregated, version_number
from moeshard.demos.grpo import TIS_CAP, GRPOConfig, Rollout, group_advantages, receive_weights, serve_trainer
from moeshard.engine import LLM, SamplingParams
from moeshard.parallel import Layout
from moeshard.verify.eval import GREEDY

def accuracy(llm: LLM, problems: list[Problem]) -> float:
    outputs = llm.generate([p.prompt for p in problems], GREEDY)
    return exact_matches([o.text for o in outputs], problems) / len(problems)


def rollout_of(llm: LLM, outputs, rewards: list[float], group: int) -> Rollout:
    """The sampled sequences as tensors: prompt then completion, right-padded."""
    sequences = [llm.encode(o.prompt) + o.token_ids for o in outputs]
    width = max(map(len, sequences))
    tokens_NS = torch.zeros(len(outputs), width, dtype=torch.int64)
    completion_NS = torch.zeros(len(outputs), width, dtype=torch.bool)
    engine_NS = torch.zeros(len(outputs), width)
    for i, (o, seq) in enumerate(zip(outputs, sequences)):
        start = len(seq) - len(o.token_ids)
        tokens_NS[i, : len(seq)] = torch.tensor(seq)
        completion_NS[i, start : len(seq)] = True
        engine_NS[i, start : len(seq)] = torch.tensor([top[t] for t, top in zip(o.token_ids, o.logprobs)])
    advantages_N = group_advantages(torch.tensor(rewards).view(-1, group))
    return Rollout(tokens_NS, completion_NS, engine_NS, advantages_N)


class TrainerProcess:
    """The trainer's process and its end of the pipe: JSON reports, safetensors tensors."""

    def __init__(self, options: RLOptions):
        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        args = (theirs, str(options.model), asdict(options.grpo), options.seed)
        self.proc = ctx.Process(target=serve_trainer, args=args, daemon=True)
        self.proc.start()
        theirs.close()
        self.ready = self.report()

    def report(self) -> dict:
        try:
            report = json.loads(self.conn.recv_bytes())
        except EOFError:
            self.proc.join(timeout=5)
            raise RuntimeError(f"the trainer process died (exit code {self.proc.exitcode}).") from None
        if "error" in report:
            raise RuntimeError(f"the trainer failed: {report['error']}")
        return report

    def step(self, rollout: Rollout) -> dict:
        self.conn.send_bytes(json.dumps({"cmd": "step"}).encode())
        self.conn.send_bytes(rollout.to_bytes())
        return self.report()

    def close(self) -> None:
        try:
            self.conn.send_bytes(json.dumps({"cmd": "stop"}).encode())
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def run_rl(options: RLOptions, on_step=lambda record: None) -> list[StepRecord]:
    """The loop; one record per step, and step 0 for the starting policy's accuracy."""
    start = time.monotonic()
    held = held_out(HELD_OUT)
    eval_set, excluded = held[: options.eval_problems], {p.prompt for p in held}
    rng = random.Random(options.seed)
    per_group = options.per_group
    trainer = TrainerProcess(options)
    records: list[StepRecord] = []
    try:
        with LLM(
            str(options.model),
            tensor_parallel_size=options.layout.tp,
            data_parallel_size=options.layout.dp,
            enable_expert_parallel=options.layout.ep,
            enable_sequence_parallel=options.layout.sp,
            moe_comm=options.moe_comm,
            compile=options.compile,
            # float32 by default, the trainer's: the on-policy check compares the two logprob for logprob
            **options.engine_options(),
            max_num_seqs=max(per_group, 16),
            max_num_batched_tokens=max(per_group * 8, 512),
            seed=options.seed,
            enable_prefix_caching=options.prefix_caching,
            block_size=options.block_size,
            batch_invariant=options.grpo.batch_invariant,
        ) as llm:
            held_mb = sum(sum(held.values()) for held in llm.memory_held_mb())
            records.append(StepRecord(0, accuracy=accuracy(llm, eval_set), engine_held_mb=held_mb))
            on_step(records[0])
            budget_end = time.monotonic() + options.minutes * 60
            for step in itertools.count(1):
                records.append(one_step(llm, trainer, options, step, rng, excluded))
                records[-1].engine_held_mb = held_mb
                last = step == options.steps or time.monotonic() >= budget_end
                if step % options.eval_every == 0 or last:
                    records[-1].accuracy = accuracy(llm, eval_set)
                records[-1].elapsed_s = time.monotonic() - start
                on_step(records[-1])
                if last:
                    break
    finally:
        trainer.close()
    return records


def one_step(llm: LLM, trainer: TrainerProcess, options: RLOptions, step: int, rng, excluded) -> StepRecord:
    problems = training_problems(rng, options.problems, excluded)
    grouped = [p for p in problems for _ in range(options.group)]
    first_seed = (options.seed * 1_000_003 + step) * len(grouped)
    params = [
        SamplingParams(temperature=1.0, max_tokens=ANSWER_TOKENS, logprobs=0, seed=first_seed + i)
        for i in range(len(grouped))
    ]
    t0 = time.perf_counter()
    outputs = llm.generate([p.prompt for p in grouped], params)
    rollout_s = time.perf_counter() - t0
    failed = [o.error for o in outputs if o.error]
    if failed:
        raise RuntimeError(f"step {step}: the engine refused a rollout request: {failed[0]}")
    rewards = [reward(p, o.text) for p, o in zip(grouped, outputs)]
    rollout = rollout_of(llm, outputs, rewards, options.group)

    awake = sum(llm.resident_mb())
    t0 = time.perf_counter()
    asleep = sum(llm.sleep(level=2))
    sleep_s = time.perf_counter() - t0
    report, train_s = train_on(trainer, rollout, step, options.grpo.tolerance)
    # Under the negative control (derived tensors not rebuilt) only in-range poison: NaN or an id
    # out of range would stop the engine loudly, and the point is that the logprob check alone
    # catches the silent kind.
    poison = True if llm.rebuild_derived else "in_range"
    t0 = time.perf_counter()
    llm.wake_up(["weights"], poison=poison)
    wake_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.update_weights(receive_weights(trainer.conn))
    update_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.wake_up(["kv_cache"], poison=poison)
    wake_s += time.perf_counter() - t0
    return StepRecord(
        step=step,
        reward_mean=sum(rewards) / len(rewards),
        **mismatch(report),
        rollout_tokens=int(rollout.completion_NS.sum()),
        rollout_tok_s=int(rollout.completion_NS.sum()) / rollout_s,
        sleep_s=sleep_s,
        update_s=update_s,
        wake_s=wake_s,
        train_s=train_s,
        rss_engine_awake_mb=awake,
        rss_engine_asleep_mb=asleep,
        rss_trainer_awake_mb=report["rss_trainer_awake_mb"],
        rss_trainer_asleep_mb=report["rss_trainer_asleep_mb"],
    )


def truncated(record: StepRecord) -> int:
    """The step's sampled tokens whose importance weight was truncated at the cap."""
    return round(record.tis_truncated_share * record.rollout_tokens)


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def summary(records: list[StepRecord]) -> dict:
    steps = [r for r in records if r.step > 0]
    measured = [r for r in records if r.accuracy is not None]
    out = {
        "accuracy_start": measured[0].accuracy,
        "accuracy_end": measured[-1].accuracy,
        "worst_max_abs_dlogprob": max(r.max_abs_dlogprob for r in steps),
        "worst_max_ratio_deviation": max(r.max_ratio_deviation for r in steps),
        "median_rollout_tok_s": median([r.rollout_tok_s for r in steps]),
        "median_update_s": median([r.update_s for r in steps]),
        "max_update_s": max(r.update_s for r in steps),
        "elapsed_s": records[-1].elapsed_s,
        # what the server sampled for rollouts, per second of the steps (step 1 to the last)
        "loop_rollout_tok_s": sum(r.rollout_tokens for r in steps) / (records[-1].elapsed_s - records[0].elapsed_s),
    }
    if steps[0].pause_s is not None:
        out.update(async_figures(steps))
    if steps[0].tis_mean is not None:  # rollouts corrected by truncated importance sampling
        out.update(median_mean_abs_dlogprob=median([r.mean_abs_dlogprob for r in steps]),
                   mean_tis_mean=sum(r.tis_mean for r in steps) / len(steps),
                   tis_truncated=sum(truncated(r) for r in steps), sampled=sum(r.rollout_tokens for r in steps))
    if steps[0].rss_engine_asleep_mb is not None:  # colocated: what the engine released asleep
        # From step 2 on, the KV cache has been written whole (a poisoned wake touches every page);
        # before, untouched zero pages of a fresh cache are not resident and cannot be released.
        after_wake = [r for r in steps if r.step > 1] or steps
        out["min_engine_drop_mb"] = min(r.rss_engine_awake_mb - r.rss_engine_asleep_mb for r in after_wake)
        out["engine_held_mb"] = records[0].engine_held_mb
    return out


def async_figures(steps: list[StepRecord]) -> dict:
    """The async loop's figures: pauses, staleness of the trained samples (share 0, 1, … versions
    behind), dropped share, and the worst |Δ logprob| of the tokens sampled k versions behind."""
    trained = [sum(r.staleness[k] for r in steps if k < len(r.staleness)) for k in range(max(len(r.staleness) for r in steps))]
    dropped = sum(r.dropped for r in steps)
    gaps: dict[int, float] = {}
    for r in steps:
        for version, gap in r.version_gaps.items():
            behind = r.step - 1 - version_number(version)
            gaps[behind] = max(gaps.get(behind, 0.0), gap)
    return {
        "median_pause_s": median([r.pause_s for r in steps]),
        "max_pause_s": max(r.pause_s for r in steps),
        "staleness_share": [n / sum(trained) for n in trained],
        "dropped_share": dropped / (dropped + sum(trained)),
        "spanning_share": sum(r.spanning for r in steps) / sum(trained),
        "max_abs_dlogprob_by_staleness": [gaps.get(k, 0.0) for k in range(max(gaps) + 1)],
    }


def plot_async(records: list[StepRecord], path: str, title: str) -> None:
    """Reward and held-out accuracy against time; each step's samples by staleness, and the dropped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in records if r.step > 0]
    measured = [r for r in records if r.accuracy is not None]
    minutes = [r.elapsed_s / 60 for r in steps]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    top.plot(minutes, [r.reward_mean for r in steps], lw=0.8, alpha=0.6, label="mean reward (rollouts, T=1)")
    top.plot([r.elapsed_s / 60 for r in measured], [r.accuracy for r in measured], "o-", label="held-out greedy accuracy")
    top.set_ylabel("exact match")
    top.set_ylim(0, 1)
    top.legend(loc="lower right")
    top.set_title(title, fontsize="small")
    depth = max(len(r.staleness) for r in steps)
    totals = [sum(r.staleness) + r.dropped for r in steps]
    shares = [[(r.staleness[k] if k < len(r.staleness) else 0) / t for r, t in zip(steps, totals)] for k in range(depth)]
    labels = [f"trained, {k} version{'' if k == 1 else 's'} stale" for k in range(depth)]
    bottom.stackplot(minutes, *shares, [r.dropped / t for r, t in zip(steps, totals)], labels=[*labels, "dropped (too stale)"], alpha=0.8)
    bottom.plot(minutes, [r.spanning / t for r, t in zip(steps, totals)], color="black", lw=0.8,
                label="trained, tokens from two versions")
    bottom.set_ylim(0, 1)
    bottom.set_ylabel("share of the samples a step took")
    bottom.set_xlabel("minutes")
    bottom.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(records: list[StepRecord], path: str, title: str, grpo: GRPOConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in records if r.step > 0]
    measured = [r for r in records if r.accuracy is not None]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    top.plot([r.step for r in steps], [r.reward_mean for r in steps], lw=0.8, alpha=0.6, label="mean reward (rollouts, T=1)")
    top.plot([r.step for r in measured], [r.accuracy for r in measured], "o-", label="held-out greedy accuracy")
    top.set_ylabel("exact match")
    top.set_ylim(0, 1)
    top.legend(loc="lower right")
    top.set_title(title, fontsize="small")
    bottom.plot([r.step for r in steps], [r.max_abs_dlogprob for r in steps], lw=0.8, label="max |Δ logprob|")
    bottom.plot([r.step for r in steps], [r.mean_abs_dlogprob for r in steps], lw=0.8, label="mean |Δ logprob|")
    if grpo.tis_cap is None:
        bottom.set_yscale("symlog", linthresh=1e-9)  # log above 1e-9, and an exact 0 (most steps) still shows
        bottom.set_ylim(0, 1e-3)
        bottom.axhline(grpo.tolerance, color="red", ls="--", lw=0.8, label=f"tolerance {grpo.tolerance:g}")
    else:  # a deliberate mismatch, corrected token by token rather than refused
        bottom.set_yscale("log")
        bottom.set_ylim(1e-7, 10)
        bottom.plot([r.step for r in steps], [abs(1 - r.tis_mean) for r in steps], lw=0.8, label="|1 − mean TIS weight|")
        bottom.axhline(math.log(grpo.tis_cap), color="red", ls="--", lw=0.8,
                       label=f"ln C = ln {grpo.tis_cap:g}: weights truncated above (trainer over engine)")
    if all(r.max_abs_dlogprob == 0 for r in steps):
        bottom.text(0.5, 0.5, "max |Δ logprob| = 0.0 at every step", transform=bottom.transAxes, ha="center")
    bottom.set_ylabel("engine vs trainer, sampled tokens")
    bottom.set_xlabel("GRPO step")
    bottom.legend(**(dict(loc="upper right") if grpo.tis_cap is None else dict(loc="lower right", fontsize="small")))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def step_table(records: list[StepRecord], title: str, disaggregated: bool):
    """The measured steps: colocated, with the sleep + update + wake seconds and each side's resident
    MiB awake → asleep; disaggregated, with the weights' sync seconds (async: the pause around it,
    and the step's samples by staleness, and dropped)."""
    from rich.table import Table

    table = Table(title=title)
    asynchronous = records[-1].pause_s is not None
    corrected = records[-1].tis_mean is not None
    extra = ("sync s", "routing Δ") if disaggregated else ("lifecycle s", "engine MiB", "trainer MiB")
    if asynchronous:
        extra = ("sync s", "pause s", "staleness 0/1/…", "dropped")
    mismatch_columns = ("mean |Δ lp|", "TIS mean", "tokens truncated") if corrected else ()
    for column in ("step", "accuracy", "reward", "max |Δ lp|", *mismatch_columns, "tok/s", *extra):
        table.add_column(column, justify="right")
    for r in records:
        if r.accuracy is None or r.step == 0:
            continue
        cells = [str(r.step), f"{r.accuracy:.3f}", f"{r.reward_mean:.3f}", f"{r.max_abs_dlogprob:.1e}"]
        if corrected:
            cells += [f"{r.mean_abs_dlogprob:.1e}", f"{r.tis_mean:.4f}", str(truncated(r))]
        cells.append(f"{r.rollout_tok_s:.0f}")
        if asynchronous:
            cells += [f"{r.update_s:.3f}", f"{r.pause_s:.3f}", "/".join(map(str, r.staleness)), str(r.dropped)]
        elif disaggregated:
            cells += [f"{r.update_s:.3f}", "–" if r.routing_disagreement is None else f"{r.routing_disagreement:.1e}"]
        else:
            cells += [f"{r.sleep_s + r.update_s + r.wake_s:.3f}", f"{r.rss_engine_awake_mb:.0f}→{r.rss_engine_asleep_mb:.0f}",
                      f"{r.rss_trainer_awake_mb:.0f}→{r.rss_trainer_asleep_mb:.0f}"]
        table.add_row(*cells)
    return table


def tis_cap_of(text: str, mismatched: bool) -> float | None:
    """`--tis-cap`: "auto" (C = 2 where the rollouts differ from the trainer on purpose, else none),
    "none" or a number."""
    if text == "auto":
        return TIS_CAP if mismatched else None
    if text == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"--tis-cap takes a positive number, auto or none, not {text!r}.") from None


def rl_command(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from moeshard.commandline import quantization_options

    console = Console(highlight=False)
    if args.negative_control:
        os.environ["MOESHARD_UNSAFE_SKIP_DERIVED_REBUILD"] = "1"  # read by the engine it builds
    mismatched = args.dtype == "bfloat16" or args.quantization is not None
    options = RLOptions(
        steps=args.steps,
        minutes=args.minutes,
        problems=args.problems,
        group=args.group,
        eval_every=args.eval_every,
        eval_problems=args.eval_problems,
        layout=Layout.parse(args.layout),
        moe_comm=args.moe_comm,
        compile=args.compile_backend if args.compile else False,
        seed=args.seed,
        prefix_caching=args.prefix_caching,
        model=Path(args.model) if args.model else WEAK_MODEL_DIR,
        # Batch-invariant: the trainer's logprobs are the engine's bit for bit, so any difference stops the run.
        grpo=GRPOConfig(lr=args.lr, batch_invariant=args.batch_invariant,
                        tolerance=0.0 if args.batch_invariant else GRPOConfig.tolerance,
                        tis_cap=tis_cap_of(args.tis_cap, mismatched)),
        dtype=args.dtype,
        **quantization_options(args),
    )
    if args.disaggregated and args.negative_control:
        raise ValueError("--negative-control is for the colocated loop (its poisoned wakes); drop --disaggregated.")
    if args.routing_replay and not args.disaggregated:
        raise ValueError("--routing-replay needs --disaggregated (the routes return each token's experts).")
    if args.asynchronous and not args.disaggregated:
        raise ValueError("--async needs --disaggregated (its rollouts come from a moeshard serve).")
    given = {"kv_after_update": args.kv_after_update, "max_staleness": args.max_staleness, "capacity": args.rollout_capacity}
    given = {k: v for k, v in given.items() if v is not None}
    if given and not args.asynchronous:
        raise ValueError("--kv-after-update, --max-staleness and --rollout-capacity are options of --async.")
    if args.asynchronous and args.routing_replay:
        raise ValueError("--async does not take --routing-replay yet: its per-version gap check does not replay the routes.")
    asynchronous = AsyncOptions(**given)
    title = (
        f"GRPO on {options.layout.label()}{' (moeshard serve)' if args.disaggregated else ''}, {options.moe_comm}"
        f"{', compiled' if options.compile else ''}{', batch-invariant' if options.grpo.batch_invariant else ''}"
        f"{', routing replay' if args.routing_replay else ''}"
        f"{f', {options.quantization} weights' if options.quantization else ''}{', bf16' if options.engine_dtype == 'bfloat16' else ''}"
        f"{f', TIS C = {options.grpo.tis_cap:g}' if options.grpo.tis_cap is not None else ''}"
        f"{f', async ({asynchronous.kv_after_update}, max staleness {asynchronous.max_staleness})' if args.asynchronous else ''}"
        f": {options.problems} problems × {options.group} completions a step"
    )
    with Progress(
        TextColumn("[bold]rl[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
        TimeElapsedColumn(), console=console,
    ) as progress:
        task = progress.add_task("starting engine and trainer", total=options.steps)

        def on_step(r: StepRecord) -> None:
            if r.accuracy is not None:
                progress.console.print(f"step {r.step}: held-out accuracy {r.accuracy:.3f} ({r.elapsed_s / 60:.1f} min)")
            if r.step:
                progress.update(
                    task, completed=r.step,
                    description=f"reward {r.reward_mean:.3f}, max |Δ logprob| {r.max_abs_dlogprob:.1e}",
                )

        try:
            if args.disaggregated:
                log_dir = Path(tempfile.mkdtemp(prefix="moeshard-rl-"))
                progress.console.print(f"the server's log: {log_dir}/moeshard-serve.log")
                records = (run_async(options, asynchronous, log_dir, on_step) if args.asynchronous
                           else run_disaggregated(options, args.routing_replay, log_dir, on_step))
            else:
                records = run_rl(options, on_step)
        except LogprobGapError as exc:
            console.print(f"[bold red]stopped[/]: {exc}")
            if options.mismatched:
                console.print("rollouts in bfloat16 or quantized differ from the float32 trainer on purpose: "
                              "--tis-cap C corrects them token by token (default 2) instead of refusing the gap.")
            return 1
    console.print(step_table(records, title, args.disaggregated))
    s = summary(records)
    where = (
        f"weights sync over update_weights_from_distributed {s['median_update_s']:.3f} s a step (median; max "
        f"{s['max_update_s']:.3f} s)" if args.disaggregated else
        f"the engine released ≥ {s['min_engine_drop_mb']:.0f} MiB asleep (it holds {s['engine_held_mb']:.0f} MiB of "
        "weights and KV cache)"
    )
    console.print(
        f"held-out accuracy {s['accuracy_start']:.3f} → {s['accuracy_end']:.3f} in {s['elapsed_s'] / 60:.1f} min; "
        f"worst max |Δ logprob| {s['worst_max_abs_dlogprob']:.2e} (importance ratio within "
        f"{s['worst_max_ratio_deviation']:.2e} of 1); {where}"
    )
    if "mean_tis_mean" in s:
        console.print(
            f"mismatch corrected by truncated importance sampling (C = {options.grpo.tis_cap:g}): mean |Δ logprob| "
            f"{s['median_mean_abs_dlogprob']:.2e} (median of the steps), mean TIS weight {s['mean_tis_mean']:.4f}, "
            f"{s['tis_truncated']} of the {s['sampled']} sampled tokens over the cap"
        )
    if args.asynchronous:
        console.print(
            f"rollouts paused {s['median_pause_s']:.3f} s a sync (median; max {s['max_pause_s']:.3f} s), one weights "
            f"update each; trained samples by staleness (0, 1, … versions behind) "
            f"{' / '.join(f'{x:.1%}' for x in s['staleness_share'])}, {s['dropped_share']:.1%} dropped, "
            f"{s['spanning_share']:.1%} spanning two versions or more; worst |Δ logprob| per version, by staleness: "
            f"{' / '.join(f'{x:.1e}' for x in s['max_abs_dlogprob_by_staleness'])}"
        )
    console.print(f"rollouts: {s['loop_rollout_tok_s']:.0f} completion tokens/s sampled over the steps")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in records], indent=1) + "\n")
    if args.plot and args.asynchronous:
        plot_async(records, args.plot, title)
    elif args.plot:
        plot(records, args.plot, title, options.grpo)
    return 0
