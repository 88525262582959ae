"""`moeshard verify hf`: a Hugging Face checkpoint on a layout, step by step against transformers.

A few prompts of different lengths run in one batch: a prefill, then greedy decode steps. Each DP
group serves its own share of the prompts (round-robin), so under DP×EP the MoE collectives mix
tokens of different requests. Every step's logits are compared with transformers' forward on the
same tokens (prefill: every position; decode: the new one), in the same dtype.

fp32 is the exact proof: transformers runs its own greedy continuation, every logit must be within
1e-3 and every greedy token the same. bf16 cannot be. Two engines round differently, and where a
token's router is near a tie, one engine's rounding sends it to another expert than the other's:
that position's logits move by up to ~90% of their scale, later positions that attend to it move
too, and a greedy token can change, after which the continuations part. So in bf16 transformers is
teacher-forced on moeshard's tokens; in the prefill and over the decode steps, three positions in
four must be within the bf16 tolerance (of 16 prompts by default: shares want a sample); and the
share of greedy tokens both engines choose alike is reported, not required.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from moeshard.engine.block_manager import BlockManager
from moeshard.models.checkpoint import Checkpoint, read_config
from moeshard.models.model import check_layout, load_config, load_model
from moeshard.models.runner import Chunk, ModelRunner
from moeshard.moe import CommMethod
from moeshard.moe.context import check_method, method_policy
from moeshard.parallel import Layout, set_layout
from moeshard.parallel.launch import open_layout

TOLERANCE = 1e-3  # fp32: max |Δlogit| over every position
# bf16: a position is within when max |Δlogit| ≤ 2^-4 · max |logit| (the reference's, at that
# position), and three in four must be, in the prefill and over the decode steps. bf16 keeps 8
# significant bits: on the tiny checkpoints the engines differ by 1-2% of the scale at the 75th
# percentile, as transformers' own bf16 differs from its fp32, and ≥ 91% of positions are within; an
# expert swapped with its neighbour in one layer leaves ≤ 69% of the decode positions within
# (docs/perf.md). A checkpoint whose bf16 is noisier gets twice transformers' own rounding at the
# same share instead: if moeshard is no further from exact than transformers, it is at most that far
# from transformers.
BF16_TOLERANCE = 2**-4
BF16_WITHIN = 0.75
DTYPES = ("float32", "bfloat16")
PROMPT_LENGTHS = (7, 13, 3, 10)
# bf16 is judged on shares of positions, and a near-tie that sends a token to another expert moves
# all of that prompt's later positions: with 16 prompts one such prompt is 1/16 of the decode
# positions, not a quarter.
BF16_PROMPT_LENGTHS = (7, 13, 3, 10, 5, 16, 2, 11, 8, 14, 4, 9, 12, 6, 15, 17)
BLOCK_SIZE = 4  # small, so every prompt spans several blocks


@dataclass(frozen=True)
class Request:
    model: str
    layout: Layout
    method: str = "auto"
    compile_backend: str | None = None  # None: eager
    prompt_lengths: tuple[int, ...] | None = None  # None: PROMPT_LENGTHS, or in bf16 BF16_PROMPT_LENGTHS
    steps: int = 8  # decode steps after the prefill
    seed: int = 0
    dtype: str = "float32"  # or "bfloat16": both engines serve it
    # The checkpoint transformers runs, if not `model`: a quantized checkpoint's weights dequantized
    # (moeshard.verify.quantized writes one), which transformers loads plainly on a CPU.
    reference: str | None = None

    def __post_init__(self):
        if self.prompt_lengths is None:
            lengths = PROMPT_LENGTHS if self.dtype == "float32" else BF16_PROMPT_LENGTHS
            object.__setattr__(self, "prompt_lengths", lengths)


@dataclass
class StepResult:
    step: int  # 0: prefill
    max_abs_diff: float  # over the step's positions and the vocabulary
    positions: int
    within: int  # positions within the tolerance
    tokens_agreeing: int  # prompts whose greedy token here is the reference's (the last step chooses none)
    tokens_match: bool  # all of them


@dataclass
class Comparison:
    dtype: str
    tolerance: float  # fp32: on max |Δlogit|; bf16: on max |Δlogit| / max |logit|, per position
    rounding: float | None  # bf16: transformers' own bf16 vs its fp32, the same measure, BF16_WITHIN quantile
    steps: list[StepResult]

    @property
    def passed(self) -> bool:
        if self.dtype == "float32":
            return all(r.tokens_match and r.max_abs_diff <= TOLERANCE for r in self.steps)
        parts = [self.steps[:1], self.steps[1:]]  # the prefill; the decode steps
        enough = all(sum(r.within for r in p) >= BF16_WITHIN * sum(r.positions for r in p) for p in parts if p)
        return enough and all(math.isfinite(r.max_abs_diff) for r in self.steps)  # a NaN anywhere fails

    @property
    def token_agreement(self) -> float:
        """The share of greedy tokens where moeshard's is the reference's (1.0 with no decode steps)."""
        chosen = sum(r.positions for r in self.steps[1:])  # one per prompt and decode step
        return sum(r.tokens_agreeing for r in self.steps) / chosen if chosen else 1.0


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
    model = load_model(request.model, getattr(torch, request.dtype))
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
def reference_run(
    request: Request, prompts: list[list[int]], forced: list[list[int]] | None = None
) -> list[tuple[list[torch.Tensor], list[int]]]:
    """transformers in the request's dtype, one prompt at a time: its own greedy continuation, the whole
    sequence recomputed each step; or, given `forced` (moeshard's tokens), teacher-forced on them and
    choosing, at each step, the token its own logits there would."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    # An fp32 checkpoint is cast on load, as moeshard casts it.
    model = transformers.AutoModelForCausalLM.from_pretrained(request.model, dtype=getattr(torch, request.dtype))
    model.eval()
    if forced is not None:
        return [teacher_forced(model, prompt, tokens) for prompt, tokens in zip(prompts, forced)]
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


def teacher_forced(model, prompt: list[int], generated: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    """One forward over prompt + generated, cut into the steps moeshard ran (the last generated token
    is only read, by the last step)."""
    logits = model(torch.tensor([prompt + generated])).logits[0].float()
    n = len(prompt)
    steps = [logits[:n]] + [logits[n + s - 1 : n + s] for s in range(1, len(generated) + 1)]
    return steps, [int(logits[n - 1 + s].argmax()) for s in range(len(generated))]


def relative_diffs(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> torch.Tensor:
    """Per position: max |Δlogit| / max |reference logit|."""
    ours_PV, ref_PV = torch.cat(ours), torch.cat(reference)
    return (ours_PV - ref_PV).abs().amax(-1) / ref_PV.abs().amax(-1)


def compare(ours: dict, reference: list, steps: int, exact: list | None = None) -> Comparison:
    """`exact`: for a bf16 reference, the same in fp32 (teacher-forced on the same tokens), whose
    difference from the reference can raise the bf16 tolerance; None compares in fp32."""
    if exact is None:
        dtype, tolerance, rounding = "float32", TOLERANCE, None
    else:
        every = [relative_diffs(ref[0], ex[0]) for ref, ex in zip(reference, exact)]
        dtype, rounding = "bfloat16", torch.cat(every).quantile(BF16_WITHIN).item()
        tolerance = max(BF16_TOLERANCE, 2 * rounding)
    results = []
    for step in range(steps + 1):
        ours_at, ref_at = [ours[i][0][step] for i in range(len(reference))], [ref[0][step] for ref in reference]
        abs_P = torch.cat([(o - r).abs().amax(-1) for o, r in zip(ours_at, ref_at)])
        measure_P = abs_P if exact is None else relative_diffs(ours_at, ref_at)
        # Step s's logits choose token s; a mismatch there shows in step s (and, in fp32, makes later steps moot).
        agreeing = 0 if step == steps else sum(ours[i][1][step] == ref[1][step] for i, ref in enumerate(reference))
        results.append(StepResult(
            step, abs_P.max().item(), len(abs_P), int((measure_P <= tolerance).sum()), agreeing,
            step == steps or agreeing == len(reference),
        ))
    return Comparison(dtype, tolerance, rounding, results)


def check_request(request: Request) -> None:
    """Refuse bad input in the calling process, before any rank starts."""
    cfg, _ = load_config(request.model)
    check_layout(cfg, request.layout)
    check_method(CommMethod.parse(request.method), request.layout)
    Checkpoint(request.model)  # every file opens (a truncated one does not)
    if read_config(request.model).get("quantization_config"):
        if request.reference is None:
            raise ValueError(f"{request.model} is quantized, which transformers does not run on a CPU: give the "
                             f"checkpoint of its dequantized weights as the reference.")
    if request.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {request.dtype!r}.")
    if request.steps < 0 or not request.prompt_lengths or min(request.prompt_lengths) < 1:
        raise ValueError("prompt lengths must be positive and steps must not be negative.")
    if len(request.prompt_lengths) < request.layout.dp:
        raise ValueError(
            f"{len(request.prompt_lengths)} prompts cannot give each of the {request.layout.dp} DP groups one."
        )
    if max(request.prompt_lengths) + request.steps > cfg.max_positions:
        raise ValueError(f"a prompt plus {request.steps} steps exceeds the model's {cfg.max_positions} positions.")


def verify_hf(request: Request, ranks=None) -> Comparison:
    """Run `request` on its layout's ranks (`ranks`: a pool to reuse) and compare with transformers."""
    check_request(request)
    owned = ranks is None
    ranks = open_layout(request.layout) if owned else ranks
    try:
        per_rank = ranks.run(rank_run, request)
    finally:
        if owned:
            ranks.close()
    ours = {i: result for rank in per_rank for i, result in rank.items()}
    return compare_with_transformers(request, ours, request.reference)


def compare_with_transformers(request: Request, ours: dict, reference_model: str | None = None) -> Comparison:
    """`ours` (rank_run's results for `request`) against transformers on the same checkpoint, or
    on `reference_model` (the negative controls)."""
    cfg, _ = load_config(request.model)
    prompts = prompts_for(request, cfg.vocab_size)
    reference_request = replace(request, model=reference_model or request.model)
    if request.dtype == "float32":
        return compare(ours, reference_run(reference_request, prompts), request.steps)
    generated = [ours[i][1] for i in range(len(prompts))]
    reference = reference_run(reference_request, prompts, generated)
    exact = reference_run(replace(reference_request, dtype="float32"), prompts, generated)
    return compare(ours, reference, request.steps, exact)


def to_json(request: Request, comparison: Comparison) -> dict:
    return {
        "model": str(Path(request.model)),
        "layout": request.layout.label(),
        "method": request.method,
        "compiled": request.compile_backend is not None,
        "dtype": request.dtype,
        "tolerance": comparison.tolerance,
        "tolerance_of": "max |Δlogit|" if request.dtype == "float32" else "max |Δlogit| / max |logit|, per position",
        "transformers_bf16_rounding": comparison.rounding,
        "token_agreement": comparison.token_agreement,
        "passed": comparison.passed,
        "steps": [asdict(r) for r in comparison.steps],
    }
