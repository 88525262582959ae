"""`moeshard bench e2e`: output tokens/s of the engine vs. transformers `generate`, same weights, same run.

At each concurrency c, c requests are in flight at once: the engine gets every prompt with
max_concurrency=c; transformers generates them in batches of c (left-padded). Every request makes
exactly `--tokens` tokens (EOS ignored; capped by the context: the bundled model has 32 positions),
so both sides do the same work. Models: the bundled arithmetic model, and a larger random Qwen3-MoE
written for the run.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import transformers
from rich.console import Console
from rich.table import Table

from moeshard.bundled.arithmetic import MODEL_DIR
from moeshard.engine import LLM, SamplingParams
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
PROMPT_TOKENS = 8


@dataclass
class Row:
    model: str
    concurrency: int
    requests: int
    tokens_per_request: int
    moeshard_tok_s: float
    transformers_tok_s: float
    overhead_share: float  # of moeshard's step time outside the model forward
    plan_bytes: float  # per decode step, driver → ranks
    sample_bytes: float  # per decode step, ranks → driver

    @property
    def ratio(self) -> float:
        return self.moeshard_tok_s / self.transformers_tok_s


def larger_model(directory: str) -> str:
    config = transformers.Qwen3MoeConfig(**LARGER_QWEN3_MOE)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    spread_init(model, seed=0)
    model.save_pretrained(directory)
    return directory


def transformers_tok_s(model, prompts: list[list[int]], concurrency: int, tokens: int, pad: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        batch = prompts[i : i + concurrency]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        model.generate(
            ids,
            attention_mask=(torch.arange(width) >= width - torch.tensor([len(p) for p in batch])[:, None]).long(),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=pad,
        )
    return len(prompts) * tokens / (time.perf_counter() - start)


def bench_model(name: str, directory, concurrencies, tokens: int, console) -> list[Row]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    tokens = min(tokens, hf.config.max_position_embeddings - PROMPT_TOKENS)  # the bundled model's context is 32
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    rows = []
    with LLM(str(directory), max_num_seqs=max(concurrencies), max_num_batched_tokens=2048) as llm:
        llm.generate([[1, 2, 3]], params)  # warm-up
        for c in concurrencies:
            prompts = [torch.randint(3, vocab, (PROMPT_TOKENS,), generator=g).tolist() for _ in range(max(4, c))]
            llm.core.stats = stats = StepStats()
            start = time.perf_counter()
            outs = llm.generate(prompts, params, max_concurrency=c)
            ours = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)
            with torch.inference_mode():
                theirs = transformers_tok_s(hf, prompts, c, tokens, pad=0)
            decode = max(stats.decode_steps, 1)
            rows.append(Row(name, c, len(prompts), tokens, ours, theirs, stats.overhead_share,
                            stats.decode_plan_bytes / decode, stats.decode_sample_bytes / decode))
            console.print(f"{name} c={c}: moeshard {ours:,.0f} tok/s, transformers {theirs:,.0f} tok/s, "
                          f"{stats.overhead_share:.1%} of the step outside the forward")
    return rows


def run_bench_e2e(args) -> int:
    console = Console(highlight=False)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {"bundled arithmetic (Qwen2-MoE)": MODEL_DIR, "random Qwen3-MoE (larger)": larger_model(tmp)}
        for name, directory in models.items():
            rows += bench_model(name, directory, args.concurrency, args.tokens, console)
    table = Table(title="output tokens/s, 1 rank, fp32, same weights (ratio: moeshard / transformers)")
    columns = ("model", "concurrency", "requests", "tokens each", "moeshard tok/s", "transformers tok/s", "ratio",
               "outside forward", "plan B/step", "samples B/step")
    for column in columns:
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            r.model,
            str(r.concurrency),
            str(r.requests),
            str(r.tokens_per_request),
            f"{r.moeshard_tok_s:,.0f}",
            f"{r.transformers_tok_s:,.0f}",
            f"{r.ratio:.2f}",
            f"{r.overhead_share:.1%}",
            f"{r.plan_bytes:,.0f}",
            f"{r.sample_bytes:,.0f}",
        )
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) | {"ratio": r.ratio} for r in rows], f, indent=1)
    return 0
