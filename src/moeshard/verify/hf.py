"""`moeshard verify hf`: a Hugging Face checkpoint on a layout, step by step against transformers.

A few prompts of different lengths run in one batch: a prefill, then greedy decode steps. Each DP
group serves its own share of the prompts (round-robin), so under DP×EP the MoE collectives mix
tokens of different requests. Every step's logits are compared with transformers' forward on the
same tokens (prefill: every position; decode: the new one), and moeshard's greedy tokens with
transformers' own greedy continuation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from moeshard.engine.block_manager import BlockManager
from moeshard.models.checkpoint import Checkpoint
from moeshard.models.model import check_layout, load_config, load_model
from moeshard.models.runner import Chunk, ModelRunner
from moeshard.moe import CommMethod
from moeshard.moe.context import check_method, method_policy
from moeshard.parallel import Layout, set_layout
from moeshard.parallel.launch import open_layout

TOLERANCE = 1e-3  # max |Δlogit|, fp32
PROMPT_LENGTHS = (7, 13, 3, 10)
BLOCK_SIZE = 4  # small, so every prompt spans several blocks


@dataclass(frozen=True)
class Request:
    model: str
    layout: Layout
    method: str = "auto"
    compile_backend: str | None = None  # None: eager
    prompt_lengths: tuple[int, ...] = PROMPT_LENGTHS
    steps: int = 8  # decode steps after the prefill
    seed: int = 0


@dataclass
class StepResult:
    step: int  # 0: prefill
    max_abs_diff: float
    tokens_match: bool


def prompts_for(request: Request, vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(request.seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in request.prompt_lengths]


def rank_run(request: Request) -> dict[int, tuple[list[torch.Tensor], list[int]]]:
    """On one rank: load, then prefill and decode this DP group's prompts greedily.

    Returns {prompt index: (logits per step, generated tokens)} from TP rank 0 of each DP group.
    """
    parallel = set_layout(request.layout)
    cfg, _ = load_config(request.model)
    mine = list(range(parallel.dp_rank, len(request.prompt_lengths), request.layout.dp))
    prompts = [prompts_for(request, cfg.vocab_size)[i] for i in mine]
    model = load_model(request.model)
    force, policy = method_policy(request.method)
    num_blocks = sum(-(-(len(p) + request.steps) // BLOCK_SIZE) for p in prompts)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(parallel.rank)).tolist()
    blocks = BlockManager(num_blocks, BLOCK_SIZE, order)
    runner = ModelRunner(model, num_blocks, BLOCK_SIZE, policy, force, request.compile_backend)
    tables = [[] for _ in prompts]
    for table, prompt in zip(tables, prompts):
        blocks.grow(table, len(prompt))
    logits = [[step] for step in runner.run_chunks([Chunk(p, 0, t) for p, t in zip(prompts, tables)], all_logits=True)]
    generated: list[list[int]] = [[] for _ in prompts]
    for _ in range(request.steps):
        chunks = []
        for prompt, gen, steps, table in zip(prompts, generated, logits, tables):
            gen.append(int(steps[-1][-1].argmax()))
            blocks.grow(table, len(prompt) + len(gen))
            chunks.append(Chunk(gen[-1:], len(prompt) + len(gen) - 1, table))
        for steps, step_logits in zip(logits, runner.run_chunks(chunks)):
            steps.append(step_logits.unsqueeze(0))
    if parallel.tp_rank != 0:
        return {}
    return {i: (steps, gen) for i, steps, gen in zip(mine, logits, generated)}


@torch.no_grad()
def reference_run(request: Request, prompts: list[list[int]]) -> list[tuple[list[torch.Tensor], list[int]]]:
    """transformers, one prompt at a time, the whole sequence recomputed each step."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(request.model, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        tokens, steps, generated = list(prompt), [], []
        for step in range(request.steps + 1):
            logits = model(torch.tensor([tokens])).logits[0].float()
            steps.append(logits if step == 0 else logits[-1:])
            if step < request.steps:
                generated.append(int(logits[-1].argmax()))
                tokens.append(generated[-1])
        out.append((steps, generated))
    return out


def compare(ours: dict, reference: list, steps: int) -> list[StepResult]:
    results = []
    for step in range(steps + 1):
        diff = max((ours[i][0][step] - ref[0][step]).abs().max().item() for i, ref in enumerate(reference))
        # Step s's logits choose token s; a mismatch there shows in step s (and makes later steps moot).
        match = step == steps or all(ours[i][1][step] == ref[1][step] for i, ref in enumerate(reference))
        results.append(StepResult(step, diff, match))
    return results


def check_request(request: Request) -> None:
    """Refuse bad input in the calling process, before any rank starts."""
    cfg, _ = load_config(request.model)
    check_layout(cfg, request.layout)
    check_method(CommMethod.parse(request.method), request.layout)
    Checkpoint(request.model)  # every file opens (a truncated one does not)
    if request.steps < 0 or not request.prompt_lengths or min(request.prompt_lengths) < 1:
        raise ValueError("prompt lengths must be positive and steps must not be negative.")
    if len(request.prompt_lengths) < request.layout.dp:
        raise ValueError(
            f"{len(request.prompt_lengths)} prompts cannot give each of the {request.layout.dp} DP groups one."
        )
    if max(request.prompt_lengths) + request.steps > cfg.max_positions:
        raise ValueError(f"a prompt plus {request.steps} steps exceeds the model's {cfg.max_positions} positions.")


def verify_hf(request: Request, ranks=None) -> list[StepResult]:
    """Run `request` on its layout's ranks (`ranks`: a pool to reuse) and compare with transformers."""
    check_request(request)
    cfg, _ = load_config(request.model)
    owned = ranks is None
    ranks = open_layout(request.layout) if owned else ranks
    try:
        per_rank = ranks.run(rank_run, request)
    finally:
        if owned:
            ranks.close()
    ours = {i: result for rank in per_rank for i, result in rank.items()}
    reference = reference_run(request, prompts_for(request, cfg.vocab_size))
    return compare(ours, reference, request.steps)


def passed(results: list[StepResult]) -> bool:
    return all(r.tokens_match and r.max_abs_diff <= TOLERANCE for r in results)


def to_json(request: Request, results: list[StepResult]) -> dict:
    return {
        "model": str(Path(request.model)),
        "layout": request.layout.label(),
        "method": request.method,
        "compiled": request.compile_backend is not None,
        "passed": passed(results),
        "steps": [asdict(r) for r in results],
    }
