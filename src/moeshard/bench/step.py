"""`moeshard bench step`: where a decode step's time goes, part by part, beside each part's floor
(bench/floor.py), for each weight format.

For each format of `--quantization` (bf16: unquantized) an engine of its own, one at a time, on
bench e2e's random model (or `--model`); at each concurrency c, c sequences of `--context` random
prompt tokens are prefilled until all decode, then `--steps` engine steps are timed whole, with a
clock around each piece of the step (the forward of the engine's own objects, wrapped for the
measurement and restored after; inclusive times, the rest by subtraction):

- driver: the engine step less its rank's `execute` (scheduling, the plan, the deltas);
- sampling: `execute` less `run_chunks` (sampling, encoding the samples);
- step inputs: `run_chunks` less the model's forward and the LM head (metadata, index tables);
- LM head: `model.logits`;
- attention projections: the q/k/v/o `Linear`s; attention's rest: its norms, rotary and the paged
  attention over the K/V cache;
- router; routed experts (the grouped SwiGLU); MoE dispatch and combine (the MoE layer less those);
- embedding, norms, residuals: the model's forward less its attention and MoE layers.

The clocks add ~1 µs per piece per layer, nothing next to a step of milliseconds. Each part's floor
is its own bytes at the measured bandwidth or its products at its kernels' measured rates,
whichever is larger; a part without weights or K/V (sampling, the driver) has none. On a machine
shared with other work the absolute times inflate: the shares are the figures to read.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from moeshard.bench.e2e import MODEL_SHAPES, engine_settings, larger_model
from moeshard.bench.floor import DecodeFloor, decoding, median_ms, read_bandwidth_gbs, step_parts, touched_experts
from moeshard.engine import LLM, SamplingParams
from moeshard.models.attention import AttentionBase, Linear
from moeshard.moe.experts import GroupedExperts
from moeshard.moe.layer import MoELayer
from moeshard.moe.router import Router

# the attribution's rows: (name, the floor part it sits beside or None)
PIECES = (
    ("driver (schedule, plan, deltas)", None),
    ("sampling", None),
    ("step inputs (metadata, index tables)", None),
    ("LM head", "LM head"),
    ("attention projections", "attention projections"),
    ("attention: norms, rotary, paged attention", "attention over K/V"),
    ("router", "router"),
    ("routed experts", "routed experts"),
    ("MoE dispatch and combine", None),
    ("embedding, norms, residuals", "other weights"),
)


class Clocks:
    """Inclusive seconds spent in wrapped callables, by key."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def around(self, targets: list[tuple[object, str, str]]):
        """Time each (object, attribute, key) while inside: the object's attribute is shadowed by a
        timed wrapper, which is removed on the way out."""
        try:
            for obj, attr, key in targets:
                setattr(obj, attr, self.timed(getattr(obj, attr), key))
            yield self
        finally:
            for obj, attr, _ in targets:
                if attr in vars(obj):
                    delattr(obj, attr)

    def timed(self, fn, key: str):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - start

        return wrapper


def step_targets(llm) -> list[tuple[object, str, str]]:
    worker = llm.ranks.host.worker
    model = worker.model
    targets = [(worker, "execute", "execute"), (worker.runner, "run_chunks", "run_chunks"), (model, "forward", "forward"),
               (model, "logits", "LM head")]
    for module in model.modules():
        if isinstance(module, AttentionBase):
            targets.append((module, "forward", "attention"))
            targets += [(child, "forward", "attention projections") for child in module.children()
                        if isinstance(child, Linear)]
        key = ("router" if isinstance(module, Router) else "routed experts" if isinstance(module, GroupedExperts)
               else "MoE" if isinstance(module, MoELayer) else None)
        if key:
            targets.append((module, "forward", key))
    return targets


def attribution(seconds: dict[str, float], step_s: float) -> dict[str, float]:
    """PIECES' exclusive seconds from the clocks' inclusive ones and the whole steps' `step_s`."""
    s = defaultdict(float, seconds)
    return dict(zip([name for name, _ in PIECES], (
        step_s - s["execute"], s["execute"] - s["run_chunks"], s["run_chunks"] - s["forward"] - s["LM head"],
        s["LM head"], s["attention projections"], s["attention"] - s["attention projections"], s["router"],
        s["routed experts"], s["MoE"] - s["router"] - s["routed experts"], s["forward"] - s["attention"] - s["MoE"],
    ), strict=True))


@dataclass
class StepProfile:
    engine: str
    floor: DecodeFloor  # its step_ms: the median step, clocks on
    mean_step_ms: float
    pieces_ms: dict[str, float]  # PIECES' mean ms per step


def profile_step(llm, engine: str, sequences: int, context: int, vocab: int, steps: int) -> StepProfile:
    model = llm.ranks.host.worker.model
    clocks = Clocks()
    with decoding(llm, sequences, context, vocab, steps + 1) as core, clocks.around(step_targets(llm)):
        times = [median_ms(core.step, 1) for _ in range(steps)]
        seconds = dict(clocks.seconds)
        touched = touched_experts(core, model, sequences)
    mean_s = sum(times) / 1e3
    pieces = {name: s / steps * 1e3 for name, s in attribution(seconds, mean_s).items()}
    bandwidth = read_bandwidth_gbs()
    parts = step_parts(model, touched, sequences, context + steps + 1, bandwidth)
    floor = DecodeFloor(torch.get_num_threads(), sequences, context, statistics.median(times), bandwidth, tuple(parts))
    return StepProfile(engine, floor, mean_s / steps * 1e3, pieces)


def print_profile(console, shape: str, p: StepProfile) -> None:
    f = p.floor
    table = Table(title=f"{shape}, {p.engine}, {f.threads} thread(s), {f.sequences} sequence(s) at {f.context}+ tokens: "
                        f"a decode step {p.mean_step_ms:.1f} ms (median {f.step_ms:.1f}), floor {f.floor_ms:.1f} ms "
                        f"({f.binds} bind: bytes {f.byte_floor_ms:.1f}, compute {f.compute_floor_ms:.1f}; "
                        f"{f.bandwidth_gbs:.1f} GB/s), step / floor {p.mean_step_ms / f.floor_ms:.2f}")
    for column in ("part", "ms / step", "share", "MB read", "floor ms", "binds", "× its floor"):
        table.add_column(column, justify="right")
    parts = {part.name: part for part in f.parts}
    for name, floor_part in PIECES:
        ms, part = p.pieces_ms[name], parts.get(floor_part)
        table.add_row(name, f"{ms:.2f}", f"{ms / p.mean_step_ms:.0%}", f"{part.mb:.1f}" if part else "",
                      f"{part.floor_ms:.2f}" if part else "",
                      ("bytes" if part.bytes_ms >= part.compute_ms else "compute") if part else "",
                      f"{ms / part.floor_ms:.1f}" if part and part.floor_ms else "")
    console.print(table)


def run_bench_step(args) -> int:
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    formats = args.quantization or ["bf16"]
    vocab = MODEL_SHAPES[args.model_shape]["vocab_size"]
    torch.set_num_threads(args.threads)
    profiles = []
    with ExitStack() as stack, Progress(console=console, transient=True) as progress:
        directory = args.model
        if directory is None:
            progress.add_task(f"{args.model_shape}: writing random weights", total=None)
            directory = larger_model(stack.enter_context(tempfile.TemporaryDirectory()) + "/model", args.model_shape,
                                     torch.bfloat16)
        task = progress.add_task("bench step", total=len(formats) * len(args.concurrency))
        for weights in formats:  # one engine in memory at a time
            progress.update(task, description=f"loading moeshard {weights}")
            dtype, options = engine_settings(args, weights, "bfloat16")
            with LLM(directory, dtype=dtype, max_num_seqs=max(args.concurrency), max_num_batched_tokens=2048,
                     max_model_len=args.context + args.steps + 8, **options) as llm:
                llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up
                for c in args.concurrency:
                    progress.update(task, description=f"moeshard {weights}, {c} sequence(s)")
                    profiles.append(profile_step(llm, f"moeshard {weights}", c, args.context, vocab, args.steps))
                    progress.advance(task)
    for p in profiles:
        print_profile(console, args.model_shape, p)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(p) | {"floor": p.floor.summary()} for p in profiles], f, indent=1)
    return 0
