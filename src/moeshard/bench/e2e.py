"""`moeshard bench e2e`: useful output tokens/s of the engine against transformers' static batching
(`generate` in batches of c), its continuous batching, vLLM's CPU engine (`--against vllm`) and
llama.cpp (`--against llama.cpp`), each peer in its own venv and process, on one realistic workload,
same weights, same dtype — for llama.cpp, the same weights converted to GGUF in each of
`--llama-formats` (bf16 and quantized: Q8_0, Q4_0, Q4_K_M), each format a contender. moeshard
itself runs one engine per weight format of `--quantization` (fp8, int8, int4, quantized at load
with the command's other quantization options; bf16 is the unquantized engine, which always runs:
it is the reference every ratio and every greedy agreement is taken against), and a second table
pairs the contenders at the same bits a weight (moeshard bf16 ~ llama.cpp bf16, int8 ~ Q8_0,
int4 ~ Q4_0 and Q4_K_M) and each quantized engine against the unquantized one.

The workload: `--num-requests` prompts of random token ids, prompt and output lengths uniform over
their ranges, EOS ignored, greedy. The models (`--model-shapes`), written random for the run in the
benchmark's dtype: `small`, a Qwen3-MoE with hidden 512, 32 experts top-4, 4 layers, vocab 4096;
`qwen3-30b-a3b`, Qwen3-30B-A3B's layer shapes (hidden 2048, 32 query / 4 KV heads of 128, 128
experts top-8, expert intermediate 768, vocab 151,936) with 2 layers. At each thread count and
concurrency c the contenders run one after the other, in an order that rotates every repetition, so
a noisy machine slows each of them alike; a ratio is taken within one repetition, and the table
shows medians and the spread (lowest–highest). Greedy agreement: in fp32 every contender must
produce moeshard's tokens, request for request (a difference fails the run); in bf16 the kernels
round differently and greedy paths drift apart, so the share of tokens equal to moeshard's, position
by position, is reported (a quantized engine computes in bf16: its share is reported in an fp32
run too). Each moeshard engine's decode step is set against its floor (bench/floor.py), the
larger of its byte and compute floors for its weights as held. At c = 1 the prefill rate is
quoted too: prompt tokens over the time to their first tokens (moeshard: its steps that carried
prompt tokens, each also sampling the first).

Every run of moeshard and of vLLM starts with an empty prefix cache: the workload repeats its
prompts across runs, and a cached prompt would skip its prefill (`bench serve --dataset prefix`
measures that).

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
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from moeshard.engine import LLM, SamplingParams
from moeshard.bench.floor import DecodeFloor, decode_floor
from moeshard.bench.peers import LLAMA_FORMATS, LlamaCpp, VllmOffline, gguf_files, llamacpp_python, vllm_python
from moeshard.commandline import quantization_options
from moeshard.engine.core import StepStats
from moeshard.models.checkpoint import read_config
from moeshard.verify.tiny import spread_init

MODEL_SHAPES = {
    "small": dict(
        vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256,
        max_position_embeddings=512,
    ),
    "qwen3-30b-a3b": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        max_position_embeddings=4096,
    ),
}
LARGER_QWEN3_MOE = MODEL_SHAPES["small"]
PAD = 0
BITS = {"fp32": 32, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4}  # a weight's, by moeshard's formats


def larger_model(
    directory: str, shape: str = "small", dtype: torch.dtype = torch.float32, max_positions: int | None = None
) -> str:
    """A random Qwen3-MoE of `shape` (MODEL_SHAPES), stored in `dtype`; `max_positions` overrides its context."""
    config = transformers.Qwen3MoeConfig(**{**MODEL_SHAPES[shape], **({"max_position_embeddings": max_positions}
                                                                        if max_positions else {})})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
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
    """moeshard in this process, on one rank: `weights` names what it holds ("bf16", "fp32", or a
    quantized format), `bits` its bits a weight (same-bits pairs with llama.cpp's formats)."""

    def __init__(self, llm: LLM, name: str = "moeshard", weights: str = "bf16"):
        self.llm, self.name, self.weights = llm, name, weights
        self.bits = BITS[weights]
        self.dtype = "float32" if weights == "fp32" else "bfloat16"  # quantized weights compute in bf16
        self.stats = StepStats()
        self.concurrency = 1

    @classmethod
    def start(cls, directory, dtype: str, weights: str, concurrency: int, context: int, options: dict,
              name: str) -> "Moeshard":
        """An engine of its own on the run's checkpoint, warmed up; `options`: LLM's quantization options."""
        llm = LLM(directory, dtype=dtype, max_num_seqs=concurrency, max_num_batched_tokens=2048, max_model_len=context,
                  **options)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up
        return cls(llm, name, weights)

    @property
    def prefill_tok_s(self) -> float | None:
        """At c = 1 a step either prefills the one prompt (and samples its first token) or decodes."""
        stats = self.stats
        return stats.prefill_tokens / stats.prefill_s if self.concurrency == 1 and stats.prefill_s else None

    def run(self, prompts, outputs, concurrency) -> tuple[list[list[int]], float]:
        self.llm.core.stats = self.stats = StepStats()
        self.concurrency = concurrency
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
        self.llm.reset_prefix_cache()  # every run is a new workload: no prompt's blocks from the last one
        start = time.perf_counter()
        done = self.llm.generate(prompts, params, max_concurrency=concurrency)
        return [o.token_ids for o in done], time.perf_counter() - start

    def close(self):
        self.llm.close()


def engine_settings(args, weights: str, dtype: str) -> tuple[str, dict]:
    """(dtype, LLM's quantization options) of moeshard's engine holding `weights`: unquantized
    ("bf16", "fp32") in the run's `dtype`, else computing in bf16, quantized at load with the
    command's quantization options (`commandline.add_quantization`)."""
    if weights in ("bf16", "fp32"):
        return dtype, {}
    return "bfloat16", quantization_options(args) | {"quantization": weights}


def moeshard_engines(directory, args, context: int) -> list[Moeshard]:
    """The unquantized engine (the reference: the run's dtype), then one per quantized format of
    `--quantization`. Without quantized formats the one engine is named "moeshard"; with them each
    is named by its weights."""
    plain = "fp32" if args.dtype == "float32" else "bf16"
    formats = [f for f in args.quantization if f != "bf16"]
    engines = []
    try:
        for weights in [plain, *formats]:
            dtype, options = engine_settings(args, weights, args.dtype)
            engines.append(Moeshard.start(directory, dtype, weights, max(args.concurrency), context, options,
                                          f"moeshard {weights}" if formats else "moeshard"))
    except BaseException:
        for engine in engines:
            engine.close()
        raise
    return engines


class MoeshardBatchInvariant(Moeshard):
    """The same model in batch-invariant mode: what the mode costs, measured beside the default."""

    def __init__(self, directory, dtype, concurrency, context):
        super().__init__(LLM(directory, dtype=dtype, max_num_seqs=concurrency, max_num_batched_tokens=2048,
                             max_model_len=context, batch_invariant=True), "moeshard batch-invariant",
                         "fp32" if dtype == "float32" else "bf16")
        self.llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up


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
    model: str
    dtype: str  # what the contender computes in (moeshard's quantized weights: bf16)
    threads: int
    concurrency: int
    contender: str
    tok_s: float  # median over repetitions, useful output tokens
    tok_s_low: float
    tok_s_high: float
    ratio: float  # median of the reference (moeshard's unquantized engine) / this contender, within each repetition
    ratio_low: float
    ratio_high: float
    identical: bool  # every request's tokens equal the reference's
    same_tokens: float  # share of output positions whose token equals the reference's (last repetition)
    prefill_tok_s: float | None = None  # median over repetitions, at c = 1 (prompt tokens to first tokens)
    overhead_share: float | None = None  # moeshard: of its step time outside the model forward
    plan_bytes: float | None = None  # moeshard: per decode step, driver → ranks
    sample_bytes: float | None = None  # moeshard: per decode step, ranks → driver


@dataclass
class Pair:
    """Two contenders of one point: `first`'s tok/s over `second`'s, within each repetition."""

    model: str
    threads: int
    concurrency: int
    first: str
    second: str
    ratio: float
    ratio_low: float
    ratio_high: float


def same_token_share(reference: list[list[int]], tokens: list[list[int]]) -> float:
    pairs = [(a, b) for ref, got in zip(reference, tokens, strict=True) for a, b in zip(ref, got)]
    total = sum(map(len, reference))
    return sum(a == b for a, b in pairs) / total if total else 1.0


def spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def same_bits_pairs(contenders, tok_s: dict[str, list[float]], label, concurrency) -> list[Pair]:
    """Each moeshard engine against each peer holding its weights in as many bits (bf16 ~ bf16,
    int8 ~ Q8_0, int4 ~ Q4_0 and Q4_K_M), and each quantized moeshard engine against the unquantized
    one (the first contender)."""
    ours = [c for c in contenders if isinstance(c, Moeshard) and not isinstance(c, MoeshardBatchInvariant)]
    peers = [c for c in contenders if not isinstance(c, Moeshard) and getattr(c, "bits", None)]
    pairs = [(m, p) for m in ours for p in peers if p.bits == m.bits] + [(m, ours[0]) for m in ours[1:]]
    model, _, threads = label
    return [Pair(model, threads, concurrency, a.name, b.name,
                 *spread([x / y for x, y in zip(tok_s[a.name], tok_s[b.name])])) for a, b in pairs]


def bench_point(contenders, prompts, outputs, label, concurrency, repeats, progress, task) -> tuple[list[Row], list[Pair]]:
    """`label`: (model shape, dtype, threads); the first contender is the reference (moeshard's unquantized engine)."""
    tok_s = {c.name: [] for c in contenders}
    prefill = {c.name: [] for c in contenders}
    same = {c.name: True for c in contenders}
    share = {}
    reference = contenders[0].name
    for rep in range(repeats):
        order = contenders[rep % len(contenders):] + contenders[: rep % len(contenders)]
        tokens = {}
        for contender in order:
            tokens[contender.name], seconds = contender.run(prompts, outputs, concurrency)
            tok_s[contender.name].append(sum(outputs) / seconds)
            if getattr(contender, "prefill_tok_s", None) is not None:
                prefill[contender.name].append(contender.prefill_tok_s)
            progress.advance(task)
        for name, got in tokens.items():
            same[name] &= got == tokens[reference]
            share[name] = same_token_share(tokens[reference], got)
    model, dtype, threads = label
    rows = []
    for c in contenders:
        ratios = [a / b for a, b in zip(tok_s[reference], tok_s[c.name])]
        row = Row(model, getattr(c, "dtype", dtype), threads, concurrency, c.name, *spread(tok_s[c.name]),
                  *spread(ratios), same[c.name], share[c.name],
                  statistics.median(prefill[c.name]) if prefill[c.name] else None)
        if isinstance(c, Moeshard):  # the last repetition's
            decode = max(c.stats.decode_steps, 1)
            row.overhead_share = c.stats.overhead_share
            row.plan_bytes, row.sample_bytes = c.stats.decode_plan_bytes / decode, c.stats.decode_sample_bytes / decode
        rows.append(row)
    return rows, same_bits_pairs(contenders, tok_s, label, concurrency)


def print_table(console, rows: list[Row], workload: Workload, reference: str) -> None:
    table = Table(title=f"useful output tokens/s, random Qwen3-MoE, 1 rank, {workload.num_requests} requests, "
                        f"prompts {workload.prompt_lens[0]}–{workload.prompt_lens[1]}, outputs "
                        f"{workload.output_lens[0]}–{workload.output_lens[1]}, greedy (ratio: moeshard's unquantized "
                        f"engine / contender; same tokens: as that engine's)")
    for column in ("model", "dtype", "threads", "concurrency", "contender", "tok/s median", "tok/s spread",
                   "ratio median", "ratio spread", "same tokens", "prefill tok/s", "outside forward", "plan B/step"):
        table.add_column(column, justify="right")
    for r in rows:
        ours, itself = r.overhead_share is not None, r.contender == reference
        agreement = "" if itself else ("all" if r.identical else f"{r.same_tokens:.0%}")
        table.add_row(
            r.model, r.dtype, str(r.threads), str(r.concurrency), r.contender, f"{r.tok_s:,.1f}",
            f"{r.tok_s_low:,.1f}–{r.tok_s_high:,.1f}", "" if itself else f"{r.ratio:.2f}",
            "" if itself else f"{r.ratio_low:.2f}–{r.ratio_high:.2f}", agreement,
            "" if r.prefill_tok_s is None else f"{r.prefill_tok_s:,.0f}",
            f"{r.overhead_share:.1%}" if ours else "", f"{r.plan_bytes:,.0f}" if ours else "",
        )
    console.print(table)


def print_pairs(console, pairs: list[Pair]) -> None:
    table = Table(title="at the same bits a weight, and each quantized format against moeshard's unquantized engine: "
                        "first / second tok/s within each repetition (above 1: the first is faster)")
    for column in ("model", "threads", "concurrency", "first", "second", "× median", "× spread"):
        table.add_column(column, justify="right")
    for p in pairs:
        table.add_row(p.model, str(p.threads), str(p.concurrency), p.first, p.second, f"{p.ratio:.2f}",
                      f"{p.ratio_low:.2f}–{p.ratio_high:.2f}")
    console.print(table)


def print_floors(console, floors: list[tuple[str, str, DecodeFloor]]) -> None:
    table = Table(title="a moeshard decode step against its floor, the larger of its bytes (weights as held, touched "
                        "experts, K/V) at the read bandwidth and its products at its kernels' rates in cache, both "
                        "measured in this run")
    for column in ("model", "engine", "threads", "sequences", "context", "step ms", "weights MB", "K/V MB", "GB/s",
                   "byte floor ms", "GFLOP", "compute floor ms", "floor ms", "binds", "step / floor"):
        table.add_column(column, justify="right")
    for model, engine, f in floors:
        table.add_row(model, engine, str(f.threads), str(f.sequences), str(f.context), f"{f.step_ms:.1f}",
                      f"{f.weight_mb:.0f}", f"{f.kv_mb:.1f}", f"{f.bandwidth_gbs:.1f}", f"{f.byte_floor_ms:.1f}",
                      f"{f.gflop:.2f}", f"{f.compute_floor_ms:.1f}", f"{f.floor_ms:.1f}", f.binds, f"{f.ratio:.2f}")
    console.print(table)


def plot(path: str, rows: list[Row]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r.model, r.dtype, r.threads) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (model, dtype, threads) in zip(axes[0], panels):
        mine = [r for r in rows if (r.model, r.dtype, r.threads) == (model, dtype, threads)]
        for name in dict.fromkeys(r.contender for r in mine):
            points = sorted((r.concurrency, r.tok_s, r.tok_s_low, r.tok_s_high) for r in mine if r.contender == name)
            c, y, low, high = zip(*points)
            ax.errorbar(c, y, yerr=[[a - b for a, b in zip(y, low)], [b - a for a, b in zip(y, high)]], marker="o",
                        capsize=3, label=name)
        ax.set(xscale="log", xlabel="concurrency", ylabel="useful output tokens/s",
               title=f"{model}, {dtype}, {threads} thread(s)")
        ax.set_xticks(sorted({r.concurrency for r in mine}), [str(c) for c in sorted({r.concurrency for r in mine})])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def contenders_for(against: list[str], engines: list[Moeshard], hf, directory, dtype, threads, args, context, log_dir,
                   ggufs) -> list:
    """moeshard's `engines` (kept for the whole run), then the peers started for `threads`;
    `ggufs`: the checkpoint's GGUF files by format, for llama.cpp."""
    contenders = list(engines)
    if "moeshard-batch-invariant" in against:
        contenders.append(MoeshardBatchInvariant(directory, dtype, max(args.concurrency), context))
    if "transformers" in against:
        contenders += [TransformersStatic(hf), TransformersContinuous(hf)]
    if "vllm" in against:
        contenders.append(VllmOffline(directory, dtype, threads, max(args.concurrency), context,
                                      Path(log_dir) / f"vllm-{threads}.log"))
    for fmt, gguf in ggufs.items():
        contenders.append(LlamaCpp(fmt, gguf, threads, max(args.concurrency), context, Path(log_dir)))
    return contenders


def refusal(args, against: list[str], formats: list[str]) -> str | None:
    """Why the run's settings cannot run, in one sentence, before any model is written."""
    unknown = set(against) - {"transformers", "vllm", "llama.cpp", "moeshard-batch-invariant"}
    if unknown:
        return (f"--against takes transformers, vllm, llama.cpp and moeshard-batch-invariant, "
                f"got {', '.join(sorted(unknown))}.")
    if set(formats) - set(LLAMA_FORMATS):
        return f"--llama-formats takes {', '.join(LLAMA_FORMATS)}, got {', '.join(sorted(set(formats) - set(LLAMA_FORMATS)))}."
    if formats and args.dtype == "float32":
        return ("llama.cpp serves bf16 and quantized GGUFs, never this run's float32 (where every contender must "
                "match moeshard's tokens): run it with --dtype bfloat16.")
    if "bf16" in args.quantization and args.dtype == "float32":
        return ("in a float32 run moeshard's unquantized engine holds float32 weights: leave bf16 out of "
                "--quantization (the unquantized engine always runs).")
    return None


def run_bench_e2e(args) -> int:
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    workload = Workload(args.num_requests, tuple(args.prompt_lens), tuple(args.output_lens), args.seed)
    against = [a for a in args.against.split(",") if a]
    formats = (args.llama_formats or list(LLAMA_FORMATS)) if "llama.cpp" in against else []
    refused = refusal(args, against, formats)
    if refused:
        console.print(f"moeshard: error: {refused}")
        return 2
    # each peer fails now, with its one sentence, rather than after the first model
    if "vllm" in against:
        vllm_python()
    if formats:
        llamacpp_python(need_server=max(args.concurrency) > 1)
    rows, pairs, floors = [], [], []
    dtype = getattr(torch, args.dtype)
    context = workload.prompt_lens[1] + workload.output_lens[1]
    engines_count = 1 + len([f for f in args.quantization if f != "bf16"])
    points = len(args.threads) * len(args.concurrency) * args.repeats * (
        engines_count + 2 * ("transformers" in against) + ("vllm" in against) + ("moeshard-batch-invariant" in against)
        + len(formats))
    reference = ""
    with Progress(console=console, transient=True) as progress:
        shapes = [args.model] if args.model else args.model_shapes
        task = progress.add_task("bench e2e", total=len(shapes) * points)
        for shape in shapes:
            with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
                progress.update(task, description=f"{shape}: writing random weights")
                directory = args.model or larger_model(tmp + "/model", shape, dtype)
                vocab = read_config(directory)["vocab_size"]
                hf = (transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
                      if "transformers" in against else None)
                prompts, outputs = workload.make(vocab)
                if formats:
                    progress.update(task, description=f"{shape}: converting to GGUF ({', '.join(formats)})")
                ggufs = gguf_files(directory, formats, max(args.threads), Path(tmp) / "llamacpp-convert.log") if formats else {}
                progress.update(task, description=f"{shape}: loading moeshard ({engines_count} engine(s))")
                engines = moeshard_engines(directory, args, context)
                for engine in engines:
                    stack.callback(engine.close)
                reference = engines[0].name
                for threads in args.threads:
                    torch.set_num_threads(threads)
                    progress.update(task, description=f"{shape}: starting the contenders")
                    contenders = contenders_for(against, engines, hf, directory, args.dtype, threads, args, context, tmp,
                                                ggufs)
                    try:
                        for c in args.concurrency:
                            progress.update(task, description=f"{shape}, {threads} thread(s), concurrency {c}")
                            point_rows, point_pairs = bench_point(contenders, prompts, outputs, (shape, args.dtype, threads),
                                                                  c, args.repeats, progress, task)
                            rows += point_rows
                            pairs += point_pairs
                    finally:
                        for contender in contenders[len(engines):]:
                            getattr(contender, "close", lambda: None)()
                    # Decoding starts from the mean prompt; halfway through the mean output is the typical step.
                    typical = sum(workload.prompt_lens) // 2 + sum(workload.output_lens) // 4
                    for engine in engines:
                        progress.update(task, description=f"{shape}, {threads} thread(s): {engine.name}'s floors")
                        floors += [(shape, engine.name, decode_floor(
                            engine.llm, c, min(typical, context - args.repeats - 3), vocab,
                            args.repeats)) for c in args.concurrency]
                del hf
    print_table(console, rows, workload, reference)
    if pairs:
        print_pairs(console, pairs)
    print_floors(console, floors)
    if args.plot:
        plot(args.plot, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": asdict(workload), "rows": [asdict(r) for r in rows], "pairs": [asdict(p) for p in pairs],
                       "decode_floors": [{"model": m, "engine": e, **f.summary()} for m, e, f in floors]}, f, indent=1)
    bad = [f"{r.contender} on {r.model} at {r.threads} thread(s), concurrency {r.concurrency}"
           for r in rows if not r.identical and r.dtype == "float32"]
    if bad:
        console.print(f"moeshard: error: fp32 greedy tokens differ from {reference}'s: {'; '.join(bad)}.")
        return 1
    return 0
