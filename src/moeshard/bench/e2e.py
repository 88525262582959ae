"""`moeshard bench e2e`: useful output tokens/s of the engine against transformers' static batching
(`generate` in batches of c) and its continuous batching, on one realistic workload, same weights,
same process.

The workload: `--num-requests` prompts of random token ids, prompt and output lengths uniform over
their ranges, EOS ignored, greedy. The model: a random Qwen3-MoE (hidden 512, 32 experts top-4,
4 layers, vocab 4096) written for the run. At each thread count and concurrency c the contenders run
one after the other, in an order that rotates every repetition, so a noisy machine slows each of
them alike; a ratio is taken within one repetition, and the table shows medians and the spread
(lowest–highest). Every contender must produce moeshard's greedy tokens, request for request: a
difference is reported and the run fails.

Static batching generates each batch to its longest output (the tail tokens are wasted work, as in
a real static server); only the tokens each request asked for count as useful.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import transformers
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from moeshard.engine import LLM, SamplingParams
from moeshard.bench.floor import DecodeFloor, decode_floor
from moeshard.engine.core import StepStats
from moeshard.verify.tiny import spread_init

LARGER_QWEN3_MOE = dict(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=256,
    max_position_embeddings=512,
)
PAD = 0


def larger_model(directory: str) -> str:
    config = transformers.Qwen3MoeConfig(**LARGER_QWEN3_MOE)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    spread_init(model, seed=0)
    model.save_pretrained(directory)
    return directory


@dataclass(frozen=True)
class Workload:
    num_requests: int
    prompt_lens: tuple[int, int]  # inclusive range
    output_lens: tuple[int, int]
    seed: int = 0

    def make(self, vocab: int) -> tuple[list[list[int]], list[int]]:
        g = torch.Generator().manual_seed(self.seed)

        def draw(low_high):
            return int(torch.randint(low_high[0], low_high[1] + 1, (1,), generator=g))

        prompts = [torch.randint(3, vocab, (draw(self.prompt_lens),), generator=g).tolist()
                   for _ in range(self.num_requests)]
        return prompts, [draw(self.output_lens) for _ in prompts]


class Moeshard:
    name = "moeshard"

    def __init__(self, llm: LLM):
        self.llm = llm
        self.stats = StepStats()

    def run(self, prompts, outputs, concurrency) -> tuple[list[list[int]], float]:
        self.llm.core.stats = self.stats = StepStats()
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
        start = time.perf_counter()
        done = self.llm.generate(prompts, params, max_concurrency=concurrency)
        return [o.token_ids for o in done], time.perf_counter() - start


class TransformersStatic:
    name = "transformers static"

    def __init__(self, model):
        self.model = model

    @torch.inference_mode()
    def run(self, prompts, outputs, concurrency) -> tuple[list[list[int]], float]:
        tokens, start = [], time.perf_counter()
        for i in range(0, len(prompts), concurrency):
            batch, wanted = prompts[i : i + concurrency], outputs[i : i + concurrency]
            width, longest = max(map(len, batch)), max(wanted)
            ids = torch.tensor([[PAD] * (width - len(p)) + p for p in batch])
            mask = (torch.arange(width) >= width - torch.tensor([len(p) for p in batch])[:, None]).long()
            out = self.model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                                      do_sample=False, pad_token_id=PAD)
            tokens += [row[width : width + n].tolist() for row, n in zip(out, wanted)]
        return tokens, time.perf_counter() - start


class TransformersContinuous:
    name = "transformers continuous"

    def __init__(self, model):
        self.model = model
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # CPU memory notes

    def run(self, prompts, outputs, concurrency) -> tuple[list[list[int]], float]:
        config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=PAD, max_new_tokens=max(outputs))
        batching = ContinuousBatchingConfig(max_requests_per_batch=concurrency)
        with self.model.continuous_batching_context_manager(
            generation_config=config, continuous_batching_config=batching, block=True, timeout=5
        ) as manager:
            # Its warm-up happens on entering the context; only serving the requests is timed.
            start = time.perf_counter()
            for i, (p, n) in enumerate(zip(prompts, outputs)):
                manager.add_request(p, request_id=str(i), max_new_tokens=n)
            results = {}
            deadline = start + 3600
            while len(results) < len(prompts) and time.perf_counter() < deadline:
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
            seconds = time.perf_counter() - start
        if len(results) < len(prompts):
            raise RuntimeError(f"transformers continuous batching finished {len(results)} of {len(prompts)} requests.")
        return [list(results[str(i)].generated_tokens) for i in range(len(prompts))], seconds


@dataclass
class Row:
    threads: int
    concurrency: int
    contender: str
    tok_s: float  # median over repetitions, useful output tokens
    tok_s_low: float
    tok_s_high: float
    ratio: float  # median of moeshard / this contender, within each repetition
    ratio_low: float
    ratio_high: float
    identical: bool  # every request's tokens equal moeshard's
    overhead_share: float | None = None  # moeshard: of its step time outside the model forward
    plan_bytes: float | None = None  # moeshard: per decode step, driver → ranks
    sample_bytes: float | None = None  # moeshard: per decode step, ranks → driver


def differing(reference: list[list[int]], tokens: list[list[int]]) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(reference, tokens, strict=True)) if a != b]


def bench_point(contenders, prompts, outputs, threads, concurrency, repeats, progress, task) -> list[Row]:
    tok_s = {c.name: [] for c in contenders}
    same = {c.name: True for c in contenders}
    for rep in range(repeats):
        order = contenders[rep % len(contenders):] + contenders[: rep % len(contenders)]
        tokens = {}
        for contender in order:
            tokens[contender.name], seconds = contender.run(prompts, outputs, concurrency)
            tok_s[contender.name].append(sum(outputs) / seconds)
            progress.advance(task)
        for name, got in tokens.items():
            same[name] &= not differing(tokens["moeshard"], got)
    ours = tok_s["moeshard"]
    rows = []
    for c in contenders:
        ratios = [a / b for a, b in zip(ours, tok_s[c.name])]
        rows.append(Row(threads, concurrency, c.name, statistics.median(tok_s[c.name]), min(tok_s[c.name]),
                        max(tok_s[c.name]), statistics.median(ratios), min(ratios), max(ratios), same[c.name]))
    stats = contenders[0].stats  # the last repetition's
    decode = max(stats.decode_steps, 1)
    rows[0].overhead_share = stats.overhead_share
    rows[0].plan_bytes, rows[0].sample_bytes = stats.decode_plan_bytes / decode, stats.decode_sample_bytes / decode
    return rows


def print_table(console, rows: list[Row], workload: Workload) -> None:
    table = Table(title=f"useful output tokens/s, random Qwen3-MoE, 1 rank, fp32, {workload.num_requests} requests, "
                        f"prompts {workload.prompt_lens[0]}–{workload.prompt_lens[1]}, outputs "
                        f"{workload.output_lens[0]}–{workload.output_lens[1]}, greedy (ratio: moeshard / contender)")
    for column in ("threads", "concurrency", "contender", "tok/s median", "tok/s spread", "ratio median",
                   "ratio spread", "same tokens", "outside forward", "plan B/step", "samples B/step"):
        table.add_column(column, justify="right")
    for r in rows:
        ours = r.contender == "moeshard"
        table.add_row(
            str(r.threads), str(r.concurrency), r.contender, f"{r.tok_s:,.0f}", f"{r.tok_s_low:,.0f}–{r.tok_s_high:,.0f}",
            "" if ours else f"{r.ratio:.2f}", "" if ours else f"{r.ratio_low:.2f}–{r.ratio_high:.2f}",
            "" if ours else ("yes" if r.identical else "NO"),
            f"{r.overhead_share:.1%}" if ours else "", f"{r.plan_bytes:,.0f}" if ours else "",
            f"{r.sample_bytes:,.0f}" if ours else "",
        )
    console.print(table)


def print_floors(console, floors: list[DecodeFloor]) -> None:
    table = Table(title="a decode step against its own GEMMs alone (the step's matmuls replayed; medians)")
    for column in ("threads", "sequences", "context", "step ms", "GEMMs ms", "step / GEMMs", "GEMM calls"):
        table.add_column(column, justify="right")
    for f in floors:
        table.add_row(str(f.threads), str(f.sequences), str(f.context), f"{f.step_ms:.1f}", f"{f.gemms_ms:.1f}",
                      f"{f.ratio:.2f}", str(f.gemm_calls))
    console.print(table)


def run_bench_e2e(args) -> int:
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 180)
    workload = Workload(args.num_requests, tuple(args.prompt_lens), tuple(args.output_lens), args.seed)
    rows, floors = [], []
    with tempfile.TemporaryDirectory() as tmp:
        directory = larger_model(tmp)
        hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        prompts, outputs = workload.make(hf.config.vocab_size)
        context = workload.prompt_lens[1] + workload.output_lens[1]
        with LLM(directory, max_num_seqs=max(args.concurrency), max_num_batched_tokens=2048,
                 max_model_len=context) as llm, Progress(console=console, transient=True) as progress:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up
            contenders = [Moeshard(llm), TransformersStatic(hf), TransformersContinuous(hf)]
            task = progress.add_task("bench e2e", total=len(args.threads) * len(args.concurrency) * args.repeats
                                     * len(contenders))
            for threads in args.threads:
                torch.set_num_threads(threads)
                for c in args.concurrency:
                    progress.update(task, description=f"{threads} thread(s), concurrency {c}")
                    rows += bench_point(contenders, prompts, outputs, threads, c, args.repeats, progress, task)
                # Decoding starts from the mean prompt; halfway through the mean output is the typical step.
                typical = sum(workload.prompt_lens) // 2 + sum(workload.output_lens) // 4
                for c in args.concurrency:
                    floors.append(decode_floor(llm, c, min(typical, context - args.repeats - 3),
                                               hf.config.vocab_size, args.repeats))
    print_table(console, rows, workload)
    print_floors(console, floors)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": asdict(workload), "rows": [asdict(r) for r in rows],
                       "decode_floors": [{**asdict(f), "ratio": f.ratio} for f in floors]}, f, indent=1)
    bad = [f"{r.contender} at {r.threads} thread(s), concurrency {r.concurrency}" for r in rows if not r.identical]
    if bad:
        console.print(f"moeshard: error: greedy tokens differ from moeshard's: {'; '.join(bad)}.")
        return 1
    return 0
