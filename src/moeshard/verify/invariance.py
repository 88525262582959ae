"""`moeshard verify invariance`: is every request's output the one it gets alone, whatever runs with it?

A fixed set of requests (prompts of 2 tokens to half the context, every third after a shared
two-block prefix, greedy and seeded sampling, logprobs on) is first run alone, one at a time, on a cold engine of each layout:
the reference. Then, for each layout, MoE method (auto and every method the layout can force) and
eager/compiled, one engine runs the same requests in randomised mixes: shuffled, at concurrencies
from 1 to 64, under a token budget that splits prefills into chunks, with too few KV blocks (so
sequences are preempted and recomputed) and with the prefix cache on. Every request's token ids
and logprobs (the sampled token's and the top one) are compared bit for bit with its reference.
Layouts without TP (1x1, DP × EP) are also compared with one another: the same experts, whole on
a rank, should give the same bits. Without batch-invariant mode the same command shows what
differs today: the negative control.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from moeshard.bundled.arithmetic import MODEL_DIR
from moeshard.engine import LLM, SamplingParams
from moeshard.engine.llm import RequestOutput
from moeshard.models.model import load_config
from moeshard.parallel import Layout

BUDGETS = (16, 64, 256, 2048)  # tokens per step, one per engine in turn
CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64)
BLOCK_SIZE = 4  # small blocks: short contexts still span several, and the prefix cache hits whole ones


@dataclass(frozen=True)
class InvarianceOptions:
    layouts: tuple[Layout, ...] = (Layout(1, 1), Layout(1, 2, True), Layout(2, 2, True))
    methods: tuple[str, ...] = ("auto", "allgather", "alltoall", "mc2", "fused_mc2")
    backends: tuple[str | None, ...] = (None, "inductor")  # None: eager
    requests: int = 24
    mixes: int = 3  # randomised mixes per engine
    batch_invariant: bool = True
    model: str | None = None  # None: the bundled arithmetic model
    dtype: str = "auto"
    seed: int = 0


@dataclass
class MixRow:
    layout: str
    method: str
    compiled: bool
    token_budget: int
    kv_blocks: int
    concurrencies: list[int]
    preemptions: int
    cached_tokens: int  # prompt tokens served from the prefix cache over the mixes
    compared: int  # requests × mixes
    bitwise_equal: int
    max_abs_dlogprob: float
    first_diverging_token: int | None  # the earliest generated position that differs, over every request
    reference: str  # what the outputs were compared with: "alone on <layout>"

    @property
    def passed(self) -> bool:
        return self.bitwise_equal == self.compared


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    params: SamplingParams


def make_requests(n: int, vocab: int, context: int, seed: int) -> list[Request]:
    """Mixed lengths within `context` tokens; every third request starts with a shared prefix of
    two blocks; half greedy, half sampled with a seed of their own."""
    rng = random.Random(seed)
    context = min(context, 128)
    prefix = [rng.randrange(vocab) for _ in range(2 * BLOCK_SIZE)]
    requests = []
    for i in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(2, context // 2 - len(prefix)))]
        if i % 3 == 0:
            prompt = prefix + prompt
        params = SamplingParams(
            temperature=0.0 if i % 2 == 0 else 1.0,
            seed=None if i % 2 == 0 else rng.randrange(1 << 30),
            max_tokens=rng.randint(4, context // 4),
            ignore_eos=True,
            logprobs=1,
        )
        requests.append(Request(prompt, params))
    return requests


@dataclass
class Difference:
    equal: bool
    max_abs_dlogprob: float = 0.0
    first_token: int | None = None


def compare(output: RequestOutput, reference: RequestOutput) -> Difference:
    """Bitwise: the same ids, and for every position the same sampled and top logprobs."""
    if output.error or reference.error:
        raise RuntimeError(f"a request failed: {output.error or reference.error}")
    first, worst = None, 0.0
    for t, (a, b) in enumerate(zip(output.token_ids, reference.token_ids)):
        if a != b:
            return Difference(False, math.inf, t)
        lp_a, lp_b = output.logprobs[t], reference.logprobs[t]
        if lp_a != lp_b:
            first = t if first is None else first
            common = lp_a.keys() & lp_b.keys()
            worst = max([worst, *(abs(lp_a[k] - lp_b[k]) for k in common)] or [math.inf])
    if len(output.token_ids) != len(reference.token_ids):
        return Difference(False, math.inf, min(len(output.token_ids), len(reference.token_ids)))
    return Difference(first is None, worst, first)


def engine_options(options: InvarianceOptions, layout: Layout, **more) -> dict:
    return dict(
        model=options.model,
        tensor_parallel_size=layout.tp,
        data_parallel_size=layout.dp,
        enable_expert_parallel=layout.ep,
        dtype=options.dtype,
        block_size=BLOCK_SIZE,
        batch_invariant=options.batch_invariant,
        max_num_seqs=64,
        **more,
    )


def run_alone(options: InvarianceOptions, layout: Layout, requests: list[Request]) -> list[RequestOutput]:
    """Each request by itself on a cold engine (no prefix cache): the reference."""
    with LLM(**engine_options(options, layout, enable_prefix_caching=False)) as llm:
        return [llm.generate([r.prompt], r.params)[0] for r in requests]


def run_mixes(
    options: InvarianceOptions, layout: Layout, method: str, backend: str | None, budget: int,
    requests: list[Request], reference: list[RequestOutput], rng: random.Random,
) -> MixRow:
    longest = max(len(r.prompt) + r.params.max_tokens for r in requests)
    # Room for the longest request and two blocks more: a mix of several must preempt.
    kv_blocks = -(-longest // BLOCK_SIZE) + 2
    row = MixRow(layout.label(), method, backend is not None, budget, kv_blocks, [], 0, 0, 0, 0, 0.0, None,
                 f"alone on {layout.label()}")
    with LLM(**engine_options(options, layout, moe_comm=method, compile=backend or False, num_kv_blocks=kv_blocks,
                              max_num_batched_tokens=budget)) as llm:
        for _ in range(options.mixes):
            order = rng.sample(range(len(requests)), len(requests))
            concurrency = rng.choice(CONCURRENCIES)
            outputs = llm.generate([requests[i].prompt for i in order], [requests[i].params for i in order],
                                   max_concurrency=concurrency)
            row.concurrencies.append(concurrency)
            for i, output in zip(order, outputs):
                tally(row, compare(output, reference[i]))
                row.cached_tokens += output.num_cached_tokens
        row.preemptions = llm.stats().preemptions
    return row


def tally(row: MixRow, difference: Difference) -> None:
    row.compared += 1
    row.bitwise_equal += difference.equal
    row.max_abs_dlogprob = max(row.max_abs_dlogprob, difference.max_abs_dlogprob)
    if difference.first_token is not None:
        row.first_diverging_token = min(difference.first_token, row.first_diverging_token or difference.first_token)


def across_layouts(layout: Layout, other: Layout, outputs: list[RequestOutput], reference: list[RequestOutput]) -> MixRow:
    row = MixRow(layout.label(), "auto", False, 0, 0, [1], 0, 0, 0, 0, 0.0, None, f"alone on {other.label()}")
    for output, ref in zip(outputs, reference):
        tally(row, compare(output, ref))
    return row


def run_invariance(options: InvarianceOptions, on_row: Callable[[MixRow], None] = lambda row: None) -> list[MixRow]:
    cfg = load_config(Path(options.model) if options.model else MODEL_DIR)[0]
    requests = make_requests(options.requests, cfg.vocab_size, cfg.max_positions, options.seed)
    rng = random.Random(options.seed)
    rows, alone = [], {}
    engines = 0
    for layout in options.layouts:
        alone[layout] = run_alone(options, layout, requests)
        if layout.tp == 1:  # experts whole on a rank: equal to the other TP-free layouts' answers
            for other in (o for o in alone if o.tp == 1 and o != layout):
                rows.append(across_layouts(layout, other, alone[layout], alone[other]))
                on_row(rows[-1])
        for method in methods_for(options, layout):
            for backend in options.backends:
                budget = BUDGETS[engines % len(BUDGETS)]
                engines += 1
                rows.append(run_mixes(options, layout, method, backend, budget, requests, alone[layout], rng))
                on_row(rows[-1])
    return rows


def rows_expected(options: InvarianceOptions) -> int:
    """How many rows `run_invariance` reports: one per engine of mixes, one per pair of TP-free layouts."""
    tp_free = sum(layout.tp == 1 for layout in options.layouts)
    mixes = sum(len(methods_for(options, layout)) * len(options.backends) for layout in options.layouts)
    return mixes + tp_free * (tp_free - 1) // 2


def methods_for(options: InvarianceOptions, layout: Layout) -> list[str]:
    """The methods a layout can run: with EP off on several ranks, auto and ALLGATHER only."""
    return [m for m in options.methods if m in ("auto", "allgather") or layout.ep or layout.world_size == 1]


def summary_table(rows: list[MixRow], options: InvarianceOptions):
    from rich.table import Table

    mode = "batch-invariant" if options.batch_invariant else "default mode (negative control)"
    table = Table(title=f"each request vs. itself alone, bit for bit: {mode}, {options.dtype}")
    columns = ("layout", "method", "run", "vs alone on", "budget", "blocks", "concurrency", "preempt", "cached",
               "equal", "max |Δ lp|", "first Δ")
    for column in columns:
        table.add_column(column, justify="left" if column in ("layout", "method", "run") else "right")
    for r in rows:
        equal = f"{r.bitwise_equal}/{r.compared}"
        table.add_row(
            r.layout, r.method, "compiled" if r.compiled else "eager", r.reference.removeprefix("alone on "),
            str(r.token_budget or "-"), str(r.kv_blocks or "-"), ",".join(map(str, r.concurrencies)),
            str(r.preemptions), str(r.cached_tokens), equal if r.passed else f"[bold red]{equal}[/]",
            f"{r.max_abs_dlogprob:.1e}", "-" if r.first_diverging_token is None else str(r.first_diverging_token),
        )
    return table


def write_json(rows: list[MixRow], path: str) -> None:
    Path(path).write_text(json.dumps([asdict(r) | {"passed": r.passed} for r in rows], indent=1))
