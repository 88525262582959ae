"""`moeshard bench soak`: a long run of a served engine under the traffic that wears servers down.

`--concurrency` clients loop until `--minutes` are up. Each request is, by draw: a bad one
(`--bad`: a wrong type, a prompt over the context, a token id outside the vocabulary, an unknown
model, a body over the size limit, a body that is not JSON), one whose client goes away after the
first chunk (`--disconnect`), or a good one: a held-out arithmetic problem, streamed, greedy, whose
answer is checked (the bundled model answers all of them). The server's process tree is measured
(PSS) all along. It passes when no answer is a 5xx, every good answer is right, every bad one gets
the 4xx it should, the resident memory at the end is within `--max-growth` of its value after the
first third of the run, and the engine is idle afterwards (running 0, waiting 0, KV usage 0).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from moeshard.bench.servers import resident_mb, started
from moeshard.bundled.arithmetic import MODEL_DIR, held_out

IDLE_WAIT_S = 15.0
SAMPLE_EVERY_S = 2.0
REQUEST_TIMEOUT_S = 120.0

# (what, body, the status it must get); the context of the bundled model holds 32 tokens.
BAD_REQUESTS = [
    ("max_tokens is a string", {"prompt": "123+456=", "max_tokens": "6"}, 400),
    ("prompt over the context", {"prompt": "1" * 200}, 400),
    ("token id outside the vocabulary", {"prompt": [10**6]}, 400),
    ("unknown model", {"model": "no-such-model", "prompt": "1+1="}, 404),
    ("body over the size limit", {"prompt": "1" * (2 << 20)}, 413),
    ("body that is not JSON", b"{", 400),
]


@dataclass
class Tally:
    good: int = 0
    wrong: list[str] = field(default_factory=list)  # "prompt -> text" of wrong answers
    disconnected: int = 0
    bad: Counter = field(default_factory=Counter)  # what → answered as it should
    unexpected: list[str] = field(default_factory=list)  # statuses that should not have come
    server_errors: int = 0  # 5xx answers, and streams that ended in an error event


async def good(client: httpx.AsyncClient, model: str, problem, tally: Tally, disconnect: bool) -> None:
    body = {"model": model, "prompt": problem.prompt, "max_tokens": 6, "temperature": 0, "stream": True}
    if disconnect:  # long enough that the client leaves mid-generation
        body.update(max_tokens=20, ignore_eos=True)
    text = ""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            tally.server_errors += response.status_code >= 500
            tally.unexpected.append(f"good request: HTTP {response.status_code}")
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:") or (data := line[5:].strip()) == "[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                tally.server_errors += 1
                tally.unexpected.append(f"stream error: {chunk['error']['message']}")
                return
            if disconnect:  # the first chunk came: go away (the response is closed on leaving the block)
                tally.disconnected += 1
                return
            text += "".join(choice["text"] for choice in chunk["choices"])
    tally.good += 1
    if text != problem.answer:
        tally.wrong.append(f"{problem.prompt} -> {text!r}")


async def bad(client: httpx.AsyncClient, what: str, body, status: int, tally: Tally) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = await client.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    if response.status_code == status and "error" in response.json():
        tally.bad[what] += 1
    else:
        tally.server_errors += response.status_code >= 500
        tally.unexpected.append(f"{what}: HTTP {response.status_code} (expected {status})")


async def client_loop(base: str, model: str, args, seed: int, deadline: float, tally: Tally) -> None:
    rng, problems = random.Random(seed), held_out(500)
    async with httpx.AsyncClient(base_url=base, timeout=REQUEST_TIMEOUT_S) as client:
        while time.monotonic() < deadline:
            draw = rng.random()
            if draw < args.bad:
                what, body, status = rng.choice(BAD_REQUESTS)
                await bad(client, what, body, status, tally)
            else:
                await good(client, model, rng.choice(problems), tally, disconnect=draw < args.bad + args.disconnect)


async def sample_memory(pid: int, deadline: float, samples: list[tuple[float, float]]) -> None:
    start = time.monotonic()
    while time.monotonic() < deadline:
        samples.append((time.monotonic() - start, resident_mb(pid)))
        await asyncio.sleep(SAMPLE_EVERY_S)


async def idle_metrics(base: str) -> dict[str, float]:
    """The engine's gauges once it has settled (or as they stand after IDLE_WAIT_S)."""
    names = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    deadline, values = time.monotonic() + IDLE_WAIT_S, {}
    async with httpx.AsyncClient(base_url=base, timeout=10) as client:
        while True:
            text = (await client.get("/metrics")).text
            values = {n: float(line.split()[-1]) for line in text.splitlines() for n in names
                      if line.startswith(f"moeshard:{n}{{")}
            if not any(values.values()) or time.monotonic() > deadline:
                return values
            await asyncio.sleep(0.5)


async def soak(base: str, pid: int, args) -> dict:
    model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
    duration = args.minutes * 60
    deadline, tally, samples = time.monotonic() + duration, Tally(), []
    started_at = time.monotonic()
    await asyncio.gather(
        sample_memory(pid, deadline, samples),
        *(client_loop(base, model, args, args.seed + i, deadline, tally) for i in range(args.concurrency)),
    )
    elapsed = time.monotonic() - started_at
    after_third = next((mb for t, mb in samples if t >= duration / 3), samples[-1][1])
    end = resident_mb(pid)
    return {
        "minutes": elapsed / 60, "concurrency": args.concurrency, "good": tally.good, "wrong": tally.wrong,
        "disconnected": tally.disconnected, "bad_answered_as_expected": dict(tally.bad),
        "unexpected": tally.unexpected, "server_errors": tally.server_errors,
        "rss_mb_after_first_third": after_third, "rss_mb_end": end, "rss_growth": end / after_third - 1,
        "rss_samples": samples, "idle_metrics": await idle_metrics(base),
    }


def verdict(result: dict, max_growth: float) -> list[str]:
    failures = []
    if result["server_errors"]:
        failures.append(f"{result['server_errors']} 5xx answers or stream errors")
    if result["wrong"]:
        failures.append(f"{len(result['wrong'])} wrong answers, e.g. {result['wrong'][0]}")
    if result["unexpected"]:
        failures.append(f"{len(result['unexpected'])} unexpected answers, e.g. {result['unexpected'][0]}")
    if result["rss_growth"] > max_growth:
        failures.append(f"resident memory grew {result['rss_growth']:.1%} (limit {max_growth:.0%})")
    if any(result["idle_metrics"].values()) or not result["idle_metrics"]:
        failures.append(f"not idle afterwards: {result['idle_metrics']}")
    return failures


def print_result(console: Console, result: dict, failures: list[str]) -> None:
    table = Table(title=f"bench soak: {result['minutes']:.1f} min, {result['concurrency']} clients")
    table.add_column("what")
    table.add_column("value", justify="right")
    rows = [
        ("good answers (all checked)", result["good"]),
        ("wrong answers", len(result["wrong"])),
        ("clients gone after the first chunk", result["disconnected"]),
        ("bad requests answered as expected", sum(result["bad_answered_as_expected"].values())),
        ("5xx answers or stream errors", result["server_errors"]),
        ("unexpected answers", len(result["unexpected"])),
        ("PSS after the first third (MiB)", f"{result['rss_mb_after_first_third']:.0f}"),
        ("PSS at the end (MiB)", f"{result['rss_mb_end']:.0f}"),
        ("growth", f"{result['rss_growth']:+.1%}"),
        ("idle afterwards (running, waiting, KV usage)", ", ".join(f"{v:g}" for v in result["idle_metrics"].values())),
    ]
    for what, value in rows:
        table.add_row(what, str(value))
    console.print(table)
    console.print("PASS" if not failures else "FAIL: " + "; ".join(failures))


def run_bench_soak(args) -> int:
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 120)
    serve_args = ("--dp", str(args.dp), "--ep" if args.ep else "--no-ep")
    with tempfile.TemporaryDirectory() as log_dir, console.status(f"bench soak: {args.minutes:g} min"):
        with started("moeshard", str(MODEL_DIR), args.threads, 64, Path(log_dir), serve_args) as target:
            result = asyncio.run(soak(target.base_url.removesuffix("/v1"), target.pid, args))
    failures = verdict(result, args.max_growth)
    print_result(console, result, failures)
    if args.json:
        Path(args.json).write_text(json.dumps({**result, "failures": failures, "args": asdict_args(args)}, indent=1))
    return 1 if failures else 0


def asdict_args(args) -> dict:
    return {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))}
