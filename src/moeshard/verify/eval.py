"""`moeshard eval`: held-out arithmetic through the engine on every layout, method and concurrency.

Exact-match accuracy per run, and the check the seed documents could not make: every prompt's
greedy output is the same in every run (layout, method, eager/compiled, concurrency) as in the
first one. One engine serves each (layout, eager/compiled): a compiled graph is traced once and then
runs under every method and concurrency.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass

from moeshard.bundled.arithmetic import ANSWER_TOKENS, HELD_OUT, exact_matches, held_out
from moeshard.engine import LLM, SamplingParams
from moeshard.moe import CommMethod
from moeshard.moe.context import check_method
from moeshard.parallel import Layout

GREEDY = SamplingParams(temperature=0, max_tokens=ANSWER_TOKENS)
WITH_LOGPROBS = SamplingParams(temperature=0, max_tokens=ANSWER_TOKENS, logprobs=0)  # the generated token's


@dataclass
class EvalRow:
    layout: str
    method: str
    compiled: bool
    concurrency: int
    n: int
    accuracy: float
    identical_to_reference: bool
    outputs_sha256: str  # of every output text in prompt order: equal digests, equal outputs, across commands
    # Every generated token's logprob equal, bit for bit, to this engine's first run (its lowest
    # concurrency): held in batch-invariant mode; None where not measured (--url).
    logprobs_identical: bool | None = None


def run_eval(
    layouts: list[Layout],
    concurrencies: list[int],
    methods: list[str],
    backends: list[str | None],
    n: int,
    model: str | None = None,
    on_row: Callable[[EvalRow], None] = lambda row: None,
    dtype: str = "auto",
    batch_invariant: bool = False,
    quantization: dict | None = None,
) -> list[EvalRow]:
    """`backends`: None for eager, else a torch.compile backend; each layout runs each of them.
    `quantization`: LLM's quantization options (docs/quantization.md), for every run."""
    if not 1 <= n <= HELD_OUT:
        raise ValueError(f"-n must be between 1 and {HELD_OUT} (the held-out problems never trained on), got {n}.")
    for layout in layouts:
        for method in methods:
            check_method(CommMethod.parse(method), layout)
    problems = held_out(n)
    prompts = [p.prompt for p in problems]
    reference: list[str] | None = None
    rows = []
    for layout in layouts:
        for backend in backends:
            with LLM(
                model,
                tensor_parallel_size=layout.tp,
                data_parallel_size=layout.dp,
                enable_expert_parallel=layout.ep,
                enable_sequence_parallel=layout.sp,
                moe_comm=methods[0],
                compile=backend or False,
                max_num_seqs=max(concurrencies),
                dtype=dtype,
                batch_invariant=batch_invariant,
                **(quantization or {}),
            ) as llm:
                for method in methods:
                    llm.set_moe_comm(method)
                    first_logprobs = None
                    for concurrency in concurrencies:
                        outputs = llm.generate(prompts, WITH_LOGPROBS, max_concurrency=concurrency)
                        texts, logprobs = [o.text for o in outputs], [o.logprobs for o in outputs]
                        reference = reference or texts
                        first_logprobs = first_logprobs or logprobs
                        row = EvalRow(
                            layout.label(), method, backend is not None, concurrency, n,
                            exact_matches(texts, problems) / n,
                            texts == reference, digest(texts), logprobs == first_logprobs,
                        )
                        rows.append(row)
                        on_row(row)
    return rows


def run_eval_url(
    url: str,
    concurrencies: list[int],
    n: int,
    api_key: str | None = None,
    on_row: Callable[[EvalRow], None] = lambda row: None,
) -> list[EvalRow]:
    """The same eval against a running server, as the seeds measured it: the openai client,
    streaming, `concurrency` requests in flight at a time."""
    import asyncio

    import openai

    if not 1 <= n <= HELD_OUT:
        raise ValueError(f"-n must be between 1 and {HELD_OUT} (the held-out problems never trained on), got {n}.")
    problems = held_out(n)

    async def complete(client, model: str, prompt: str, slots: asyncio.Semaphore) -> str:
        async with slots:
            stream = await client.completions.create(
                model=model, prompt=prompt, stream=True, temperature=GREEDY.temperature, max_tokens=GREEDY.max_tokens
            )
            return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def run() -> list[EvalRow]:
        rows, reference = [], None
        base = url.rstrip("/") + "/v1"
        async with openai.AsyncOpenAI(base_url=base, api_key=api_key or "none", max_retries=0, timeout=600) as client:
            model = (await client.models.list()).data[0].id
            for concurrency in concurrencies:
                slots = asyncio.Semaphore(concurrency)
                texts = await asyncio.gather(*(complete(client, model, p.prompt, slots) for p in problems))
                reference = reference or texts
                accuracy = exact_matches(texts, problems) / n
                row = EvalRow(url, "served", False, concurrency, n, accuracy, texts == reference, digest(texts))
                rows.append(row)
                on_row(row)
        return rows

    try:
        return asyncio.run(run())
    except openai.APIConnectionError as exc:
        raise RuntimeError(f"no server answered at {url}: {exc}") from None


def digest(texts: list[str]) -> str:
    return hashlib.sha256(json.dumps(texts).encode()).hexdigest()


def to_json(rows: list[EvalRow]) -> list[dict]:
    return [asdict(r) for r in rows]
