"""`moeshard bench serve`: a serving benchmark client in the shape of `vllm bench serve`.

Random prompts (token ids drawn from the model's tokenizer, sent as text), input and output lengths
uniform over [len·(1−r), len·(1+r)], greedy, EOS ignored, streamed `/v1/completions`. Requests go out
at `--request-rate` (Poisson arrivals; inf: all at once) and at most `--max-concurrency` at a time.
Per request: TTFT (first text), ITL (between text chunks), TPOT ((E2EL − TTFT) / (output tokens − 1))
and E2EL; output tokens are the server's own count (`usage`, asked for with `include_usage`).
Each repetition sends new prompts (the same to every server), after `--num-warmups` requests of its
own that are not timed: with prefix caching on, a repeated prompt would skip its prefill.

Without `--base-url` it starts `moeshard serve` itself; `--against transformers` also starts
`transformers serve --continuous-batching`, `--against vllm` vLLM's OpenAI server (its CPU build,
scripts/peers.sh), on the same weights in the same dtype, runs the same workload on both in an
order that rotates every repetition, reports ratios (median and spread over repetitions), each
server's resident memory, and how far the greedy completions agree with moeshard's (the share of
identical tokens, position by position, the completions' text tokenized again with the model's
tokenizer: exact for the random model, whose every token is one word).

`--dataset prefix` gives every prompt one shared prefix of `--prefix-len` tokens (a long system
prompt) before its own random part; `--against moeshard-no-cache` runs moeshard serve without prefix
caching beside it, and the report adds the prefix-cache hit rate, as the responses' usage counts it
(`prompt_tokens_details.cached_tokens`) and as moeshard's /metrics does.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx
import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from moeshard.bench.peers import vllm_python
from moeshard.bench.servers import PEERS, Target, resident_mb, sigterm_unwinds, started

REQUEST_TIMEOUT_S = 600  # per request, whole stream: a server that stalls fails the request, not the run
LATENCIES = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class RandomDataset:
    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float
    seed: int = 0

    def lengths(self, rng: random.Random, mean: int) -> list[int]:
        low, high = max(1, math.floor(mean * (1 - self.range_ratio))), math.ceil(mean * (1 + self.range_ratio))
        return [rng.randint(low, high) for _ in range(self.num_prompts)]

    prefix_len: int = 0  # tokens every prompt starts with (the prefix dataset)

    def make(self, tokenizer) -> list[tuple[str, int]]:
        """(prompt text, output tokens asked for) per request; prompts avoid the special tokens."""
        rng = random.Random(self.seed)
        special = set(tokenizer.get_added_tokens_decoder())
        ordinary = [i for i in range(tokenizer.get_vocab_size()) if i not in special]
        prefix = [rng.choice(ordinary) for _ in range(self.prefix_len)]
        inputs, outputs = self.lengths(rng, self.input_len), self.lengths(rng, self.output_len)
        return [(tokenizer.decode(prefix + [rng.choice(ordinary) for _ in range(n)]), m) for n, m in zip(inputs, outputs)]

    @property
    def max_model_len(self) -> int:
        """The context the longest request needs."""
        return self.prefix_len + math.ceil(self.input_len * (1 + self.range_ratio)) + math.ceil(
            self.output_len * (1 + self.range_ratio))


@dataclass
class Outcome:
    ok: bool = False
    error: str = ""
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # of the prompt's, served from the prefix cache (None: not reported)
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0

    @property
    def tpot(self) -> float | None:
        return (self.e2el - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def send(client: httpx.AsyncClient, target: Target, prompt: str, max_tokens: int) -> Outcome:
    body = {"model": target.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **target.extra_body}
    outcome, start = Outcome(), time.perf_counter()
    last = start
    try:
        async with client.stream("POST", f"{target.base_url}/completions", json=body) as response:
            if response.status_code != 200:
                outcome.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return outcome
            async for line in response.aiter_lines():
                if not line.startswith("data:") or (data := line[5:].strip()) == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    outcome.error = str(chunk["error"])[:200]
                    return outcome
                if usage := chunk.get("usage"):
                    outcome.prompt_tokens, outcome.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
                    outcome.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                text = "".join(choice.get("text") or "" for choice in chunk.get("choices", []))
                if text:
                    now = time.perf_counter()
                    if outcome.text:
                        outcome.itl.append(now - last)
                    else:
                        outcome.ttft = now - start
                    outcome.text, last = outcome.text + text, now
    except httpx.HTTPError as e:
        outcome.error = f"{type(e).__name__}: {e}"
        return outcome
    outcome.e2el = time.perf_counter() - start
    outcome.ok = outcome.output_tokens > 0
    outcome.error = "" if outcome.ok else "no usage in the stream"
    return outcome


async def run_workload(target: Target, requests: list[tuple[str, int]], max_concurrency: int,
                       request_rate: float, seed: int, advance) -> tuple[list[Outcome], float]:
    rng, gate = random.Random(seed), asyncio.Semaphore(max_concurrency)
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:

        async def one(prompt: str, max_tokens: int) -> Outcome:
            async with gate:
                try:
                    async with asyncio.timeout(REQUEST_TIMEOUT_S):
                        outcome = await send(client, target, prompt, max_tokens)
                except TimeoutError:
                    outcome = Outcome(error=f"no complete answer within {REQUEST_TIMEOUT_S} s")
            advance()
            return outcome

        start, tasks = time.perf_counter(), []
        for prompt, max_tokens in requests:
            tasks.append(asyncio.create_task(one(prompt, max_tokens)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
        outcomes = await asyncio.gather(*tasks)
    return outcomes, time.perf_counter() - start


def summarize(outcomes: list[Outcome], duration_s: float) -> dict:
    done = [o for o in outcomes if o.ok]
    output = sum(o.output_tokens for o in done)
    metrics = {
        "completed": len(done), "failed": len(outcomes) - len(done), "duration_s": duration_s,
        "request_throughput": len(done) / duration_s, "output_throughput": output / duration_s,
        "total_token_throughput": (output + sum(o.prompt_tokens for o in done)) / duration_s,
        "prefix_hit_rate": (sum(o.cached_tokens for o in done) / max(sum(o.prompt_tokens for o in done), 1)
                            if done and all(o.cached_tokens is not None for o in done) else math.nan),
    }
    for name, values in latencies(done).items():
        ms = np.array(values or [math.nan]) * 1e3
        metrics |= {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
                    f"p99_{name}_ms": float(np.percentile(ms, 99))}
    return metrics


def latencies(done: list[Outcome]) -> dict[str, list[float]]:
    return {"ttft": [o.ttft for o in done], "tpot": [o.tpot for o in done if o.tpot is not None],
            "itl": [gap for o in done for gap in o.itl], "e2el": [o.e2el for o in done]}


@dataclass(frozen=True)
class Run:
    server: str
    concurrency: int
    repetition: int
    metrics: dict
    tokens: list[list[int]] = field(repr=False)  # each completion's text tokenized again
    latencies: dict = field(repr=False)


def prefix_counters(target: Target) -> tuple[float, float] | None:
    """moeshard's prefix-cache (queries, hits) from its /metrics, in tokens; None for another server."""
    if not target.name.startswith("moeshard"):
        return None
    text = httpx.get(target.base_url.removesuffix("/v1") + "/metrics", timeout=30).text
    values = {line.split()[0].split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("moeshard:prefix_cache_")}
    return values["moeshard:prefix_cache_queries_total"], values["moeshard:prefix_cache_hits_total"]


def workloads(dataset: RandomDataset, tokenizer, args) -> list[list[tuple[str, int]]]:
    """Each repetition's requests, the warm-ups first: new prompts every repetition (a server's prefix
    cache would otherwise serve a repetition the prompts of the one before), the same for every server."""
    return [replace(dataset, seed=dataset.seed + repetition, num_prompts=args.num_warmups + args.num_prompts)
            .make(tokenizer) for repetition in range(args.repeats)]


def bench_targets(targets, workloads, args, console, encode) -> list[Run]:
    runs = []
    total = args.repeats * len(args.max_concurrency) * len(targets) * len(workloads[0])
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("bench serve", total=total)
        for repetition in range(args.repeats):
            order = targets[repetition % len(targets):] + targets[:repetition % len(targets)]
            warmups, requests = workloads[repetition][:args.num_warmups], workloads[repetition][args.num_warmups:]
            for c in args.max_concurrency:
                for target in order:
                    progress.update(task, description=f"{target.name}, concurrency {c}, repetition {repetition + 1}")
                    asyncio.run(run_workload(target, warmups, 1, math.inf, args.seed,
                                             lambda: progress.advance(task)))
                    before = prefix_counters(target)
                    outcomes, duration = asyncio.run(run_workload(
                        target, requests, c, args.request_rate, args.seed, lambda: progress.advance(task)))
                    metrics = summarize(outcomes, duration)
                    if before is not None:  # the server's own count over the same requests
                        queries, hits = (a - b for a, b in zip(prefix_counters(target), before))
                        metrics["metrics_prefix_hit_rate"] = hits / queries if queries else math.nan
                    failures = [o.error for o in outcomes if not o.ok]
                    if failures:
                        console.print(f"{target.name}: {len(failures)} request(s) failed, first: {failures[0]}")
                    runs.append(Run(target.name, c, repetition, metrics,
                                    [encode(o.text) for o in outcomes], latencies([o for o in outcomes if o.ok])))
    return runs


def median_of(runs: list[Run], server: str, c: int, key: str) -> float:
    """NaN where the server does not report `key`."""
    return statistics.median(r.metrics.get(key, math.nan) for r in runs if r.server == server and r.concurrency == c)


RATIOS = {  # moeshard / peer, each oriented so that above 1 means moeshard is better
    "output tok/s": ("output_throughput", False),
    "median TTFT": ("median_ttft_ms", True),
    "median TPOT": ("median_tpot_ms", True),
}


def ratios(runs: list[Run], peer: str) -> list[dict]:
    rows = []
    for c in sorted({r.concurrency for r in runs}):
        pairs = [(mine, theirs) for mine in runs if mine.server == "moeshard" and mine.concurrency == c
                 for theirs in runs if theirs.server == peer and theirs.concurrency == c
                 and theirs.repetition == mine.repetition]
        # by tokens, not text: detokenizers differ in the spaces between words (vLLM's and moeshard's do)
        identical = sum(a == b for mine, theirs in pairs for a, b in zip(mine.tokens, theirs.tokens))
        same, compared = 0, 0  # positions holding the same token, of the longer completion's length
        for mine, theirs in pairs:
            for a, b in zip(mine.tokens, theirs.tokens):
                same, compared = same + sum(x == y for x, y in zip(a, b)), compared + max(len(a), len(b))
        for label, (key, lower_is_better) in RATIOS.items():
            per_rep = [(theirs.metrics[key] / mine.metrics[key]) if lower_is_better
                       else (mine.metrics[key] / theirs.metrics[key]) for mine, theirs in pairs]
            rows.append({"peer": peer, "concurrency": c, "metric": label, "median": statistics.median(per_rep),
                         "low": min(per_rep), "high": max(per_rep), "identical_completions": identical,
                         "identical_tokens": same / compared if compared else math.nan})
    return rows


SHOWN = [("completed", "{:.0f}"), ("failed", "{:.0f}"), ("request_throughput", "{:.2f}"),
         ("output_throughput", "{:.1f}"), ("total_token_throughput", "{:.1f}"), ("prefix_hit_rate", "{:.1%}"),
         ("metrics_prefix_hit_rate", "{:.1%}")] + [
    (f"{stat}_{name}_ms", "{:.1f}") for name in LATENCIES for stat in ("mean", "median", "p99")]


def print_tables(console, runs: list[Run], memory: dict, ratio_rows: list[dict], args) -> None:
    servers = list(dict.fromkeys(r.server for r in runs))
    for c in args.max_concurrency:
        table = Table(title=f"bench serve — max concurrency {c}, request rate {args.request_rate}/s, "
                            f"median of {args.repeats} repetition(s)")
        table.add_column("metric")
        for server in servers:
            table.add_column(server, justify="right")
        for key, fmt in SHOWN:
            values = [median_of(runs, s, c, key) for s in servers]
            table.add_row(key, *("–" if math.isnan(v) else fmt.format(v) for v in values))
        console.print(table)
        console.print(summary_table(runs, memory, [r for r in ratio_rows if r["concurrency"] == c], c, args))


def summary_table(runs: list[Run], memory: dict, ratio_rows: list[dict], c: int, args) -> Table:
    """One row per server: what the issue asks of moeshard, and (for a peer) moeshard / peer, each
    ratio above 1 where moeshard is better; memory is measured once, after every repetition."""
    threads = f"{args.threads} thread(s) each" if memory else "a running server"
    table = Table(title=f"concurrency {c}, {threads}: median of {args.repeats} repetition(s) "
                        "(ratios: moeshard / peer, above 1 moeshard better; lowest–highest)")
    columns = ["server", "output tok/s", "median TTFT ms", "median TPOT ms", "PSS MiB", "peak RSS MiB"]
    peers = bool(ratio_rows)
    if peers:
        columns += ["output tok/s ×", "TTFT ×", "TPOT ×", "memory ×", "same tokens", "same completions"]
    for column in columns:
        table.add_column(column, justify="right")
    for server in dict.fromkeys(r.server for r in runs):
        by_metric = {row["metric"]: row for row in ratio_rows if row["peer"] == server}
        mem = memory.get(server, {})
        cells = [server, f"{median_of(runs, server, c, 'output_throughput'):.1f}",
                 f"{median_of(runs, server, c, 'median_ttft_ms'):.1f}",
                 f"{median_of(runs, server, c, 'median_tpot_ms'):.1f}",
                 f"{mem['rss_mb']:,.0f}" if mem else "–", f"{mem['peak_rss_mb']:,.0f}" if mem else "–"]
        if peers and server == "moeshard":
            cells += ["1"] * 4 + ["", ""]
        elif peers:
            cells += [f"{row['median']:.2f} ({row['low']:.2f}–{row['high']:.2f})" for row in by_metric.values()]
            cells.append(f"{memory[server]['rss_mb'] / memory['moeshard']['rss_mb']:.2f}" if memory else "–")
            any_row = next(iter(by_metric.values()))
            cells += [f"{any_row['identical_tokens']:.1%}",
                      f"{any_row['identical_completions']}/{args.repeats * args.num_prompts}"]
        table.add_row(*cells)
    return table


def plot(runs: list[Run], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = list(dict.fromkeys(r.server for r in runs))
    concurrencies = sorted({r.concurrency for r in runs})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for server in servers:
        values = [[r.metrics["output_throughput"] for r in runs if r.server == server and r.concurrency == c]
                  for c in concurrencies]
        mid = [statistics.median(v) for v in values]
        axes[0].errorbar(concurrencies, mid, yerr=[[m - min(v) for m, v in zip(mid, values)],
                                                   [max(v) - m for m, v in zip(mid, values)]],
                         marker="o", capsize=3, label=server)
    axes[0].set(xscale="log", xlabel="max concurrency", ylabel="output tokens/s", title="throughput")
    axes[0].legend()
    for ax, name in zip(axes[1:], ("ttft", "tpot")):
        groups = [(f"{s}\nc={c}", [x * 1e3 for r in runs if r.server == s and r.concurrency == c
                                    for x in r.latencies[name]]) for c in concurrencies for s in servers]
        ax.boxplot([g[1] for g in groups], tick_labels=[g[0] for g in groups], showfliers=False)
        ax.set(ylabel="ms", title=f"{name.upper()} per request (all repetitions)")
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_bench_serve(args) -> int:
    from tokenizers import Tokenizer

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    peers = [p for p in (args.against or "").split(",") if p]
    unknown = set(peers) - set(PEERS)
    if unknown or (peers and args.base_url):
        console.print(f"moeshard: error: --against takes {', '.join(PEERS)} (not with --base-url), "
                      f"got {args.against}.")
        return 2
    if "vllm" in peers and not args.base_url:
        vllm_python()  # fails now, with its one sentence, rather than after moeshard serve has started
    dataset = RandomDataset(args.num_prompts, args.random_input_len, args.random_output_len,
                            args.random_range_ratio, args.seed, args.prefix_len if args.dataset == "prefix" else 0)
    with tempfile.TemporaryDirectory() as tmp:
        # Twice the longest request: a server may bound a prompt's tokens by its characters (vLLM does,
        # at ~5 a token), and the random tokenizer's words take 6 with their space. At least bench e2e's 512.
        context = max(2 * dataset.max_model_len, 512)
        model_dir = args.model or random_model(Path(tmp) / "model", getattr(torch, args.dtype), context)
        tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        requests = workloads(dataset, tokenizer, args)
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
        if args.base_url:
            targets, memory = [url_target(args.base_url)], {}
            runs = bench_targets(targets, requests, args, console, encode)
        else:
            runs, memory = bench_started(model_dir, peers, requests, args, console, Path(tmp), encode)
    ratio_rows = [row for peer in peers for row in ratios(runs, peer)]
    print_tables(console, runs, memory, ratio_rows, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dataset": asdict(dataset), "request_rate": args.request_rate, "threads": args.threads,
                       "runs": [{"server": r.server, "concurrency": r.concurrency, "repetition": r.repetition,
                                 **r.metrics} for r in runs],
                       "memory": memory, "ratios": ratio_rows}, f, indent=1)
    if args.plot:
        plot(runs, args.plot)
    failed = sum(r.metrics["failed"] for r in runs)
    if failed:
        console.print(f"moeshard: error: {failed} request(s) failed; see above.")
        return 1
    return 0


def bench_started(model_dir: str, peers, requests, args, console, log_dir: Path, encode) -> tuple[list[Run], dict]:
    """One long-lived server per contender for the whole run, each stopped by its PID however the run ends."""
    kinds = ["moeshard", *peers]
    with sigterm_unwinds(), ExitStack() as servers:
        targets = []
        for kind in kinds:
            start = time.perf_counter()
            with console.status(f"starting {kind} serve ({args.threads} thread(s), {args.dtype})"):
                targets.append(servers.enter_context(started(kind, model_dir, args.threads, max(args.max_concurrency),
                                                             log_dir, dtype=args.dtype)))
            console.print(f"{kind} serve: healthy after {time.perf_counter() - start:.0f} s (PID {targets[-1].pid})")
        runs = bench_targets(targets, requests, args, console, encode)
        return runs, {t.name: measure_memory(t) for t in targets}


def measure_memory(target: Target) -> dict:
    return {"rss_mb": resident_mb(target.pid), "peak_rss_mb": resident_mb(target.pid, "VmHWM", "status")}


def url_target(base_url: str) -> Target:
    base_url = base_url.rstrip("/").removesuffix("/v1") + "/v1"
    model = httpx.get(f"{base_url}/models", timeout=10).json()["data"][0]["id"]
    return Target("server", base_url, model, {"ignore_eos": True})


def random_model(directory: Path, dtype: torch.dtype = torch.float32, max_positions: int | None = None) -> str:
    """The issue's random Qwen3-MoE (see `bench e2e`) with a tokenizer whose every id is one word
    "t<id>", so that random ids survive the trip through text exactly."""
    from moeshard.bench.e2e import LARGER_QWEN3_MOE, larger_model

    larger_model(str(directory), dtype=dtype, max_positions=max_positions)
    word_tokenizer(directory, LARGER_QWEN3_MOE["vocab_size"])
    return str(directory)


def word_tokenizer(directory: Path, vocab: int) -> None:
    """Save into `directory` a tokenizer of `vocab` ids, each one word "t<id>" but the specials."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>"]
    words = specials + [f"t{i}" for i in range(len(specials), vocab)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(specials)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<bos>",
                            eos_token="<eos>").save_pretrained(directory)
