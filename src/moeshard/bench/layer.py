"""`moeshard bench layer`: one rank's MoE layer vs. transformers' Qwen3-MoE block, a dense GEMM,
and the layer's own GEMMs alone (its floor: the same matmul calls on the same operands, replayed).

Every contender runs in this process on the same random weights and inputs, and each transformers
variant's output is checked against moeshard's before it is timed, so the table compares equal work.
The contenders take turns, one call each per repetition, and every ratio is a median of
per-repetition ratios with its spread: a noisy machine slows neighbours alike.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from transformers import Qwen3MoeConfig
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from moeshard.bench.floor import median_ms
from moeshard.moe import MoEConfig, MoELayer, MoEWeights, RouterConfig, moe_forward_context

CFG = MoEConfig(hidden=1024, num_experts=64, intermediate=256, router=RouterConfig(top_k=8, scoring="softmax", renormalize=True))
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Outputs are O(1); bf16 carries ~3 significant digits, so a few ulps at |y| ≈ 2-4 is ~5e-2.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
WARMUP = 2
# These kernels exist only for Hopper-class CUDA GPUs; this benchmark runs on the CPU.
CUDA_ONLY = {
    "deepgemm": "CUDA-only (SM90+ hub kernel)",
    "sonicmoe": "CUDA-only (SM90+ CuteDSL kernels)",
}


aten = torch.ops.aten
MATMULS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._grouped_mm}


class RecordMatmuls(TorchDispatchMode):
    """Runs every op as usual and keeps each matmul call (op and operands) for replay."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in MATMULS:
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)

    def replay(self) -> None:
        """The recorded matmuls alone, on the same operands."""
        for func, args, kwargs in self.calls:
            func(*args, **kwargs)


MOESHARD, FLOOR, DENSE = "moeshard", "moeshard GEMMs alone", "dense GEMM"


@dataclass
class Row:
    shape: str
    tokens: int
    impl: str
    median_ms: float
    ratio_to_moeshard: float  # median over repetitions of (its time / moeshard's time)
    ratio_low: float
    ratio_high: float


def hf_block(weights: MoEWeights, impl: str, dtype: torch.dtype) -> Qwen3MoeSparseMoeBlock:
    config = Qwen3MoeConfig(
        hidden_size=CFG.hidden, num_experts=CFG.num_experts, num_experts_per_tok=CFG.router.top_k,
        moe_intermediate_size=CFG.intermediate, norm_topk_prob=CFG.router.renormalize, experts_implementation=impl,
    )
    block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        block.gate.weight.copy_(weights.router_ED)
        block.experts.gate_up_proj.copy_(weights.gate_up_EFD)
        block.experts.down_proj.copy_(weights.down_EDI)
    return block.to(dtype).eval()


def skip_reason(impl: str, tokens: int, dtype: torch.dtype) -> str | None:
    if impl in CUDA_ONLY:
        return CUDA_ONLY[impl]
    if impl == "batched_mm":
        # batched_mm gathers a private copy of the gate/up and down weights for every (token, expert) pair.
        need = tokens * CFG.router.top_k * 3 * CFG.hidden * CFG.intermediate * dtype.itemsize
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if need > free // 2:
            return f"per-pair weight copies: {need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"
    return None


def parity(layer: MoELayer, block: Qwen3MoeSparseMoeBlock, x_TD: torch.Tensor, y_TD: torch.Tensor) -> tuple[float, int]:
    """(max |Δ| over tokens both route alike, tokens routed differently).

    transformers scores the router in the activation dtype, moeshard in fp32, so in bf16 near-tied
    experts can swap; such tokens do the same amount of work but cannot be compared.
    """
    ids_TK, _ = layer.router(x_TD)
    _, _, hf_ids_TK = block.gate(x_TD)
    same_T = (ids_TK.sort(dim=1).values == hf_ids_TK.sort(dim=1).values).all(dim=1)
    diff_TD = (block(x_TD.unsqueeze(0)).squeeze(0).float() - y_TD.float()).abs()
    return diff_TD[same_T].max().item(), int((~same_T).sum())


def dense_gemm(tokens: int, dtype: torch.dtype, g: torch.Generator) -> Callable[[], torch.Tensor]:
    """One matmul with the experts' FLOPs: each (token, expert) pair costs D·2I + I·D = 3·D·I MACs,
    so [T·K, D] @ [D, 3I] has them all with the same M as the grouped GEMMs, through one weight.

    The weight is stored [3I, D] as nn.Linear stores it: on CPUs without native bf16 a row-major
    [D, 3I] operand takes a path several times slower, which would flatter the MoE layers."""
    x_PD = torch.randn(tokens * CFG.router.top_k, CFG.hidden, generator=g).to(dtype)
    w_ND = torch.randn(3 * CFG.intermediate, CFG.hidden, generator=g).to(dtype)
    return lambda: torch.nn.functional.linear(x_PD, w_ND)


def bench_shape(shape, tokens, layer, weights, dtype, repeats, advance) -> tuple[list[Row], dict[str, str]]:
    """Rows for moeshard, its GEMMs alone, every runnable transformers variant and the dense GEMM;
    notes per transformers variant."""
    g = torch.Generator().manual_seed(1)
    x_TD = torch.randn(tokens, CFG.hidden, generator=g).to(dtype)
    # One context around the timing: the engine enters it once per step, not once per layer.
    with moe_forward_context(tokens):
        y_TD = layer(x_TD)
        with RecordMatmuls() as recorder:
            layer(x_TD)
    contenders: dict[str, Callable] = {MOESHARD: lambda: layer(x_TD), FLOOR: recorder.replay}
    notes = {}
    for impl in ["eager", *ALL_EXPERTS_FUNCTIONS.valid_keys()]:
        name = f"transformers/{impl}"
        notes[name] = skip_reason(impl, tokens, dtype)
        if notes[name] is None:
            block = hf_block(weights, impl, dtype)
            max_diff, rerouted = parity(layer, block, x_TD, y_TD)
            ok = max_diff <= TOLERANCE[dtype]
            notes[name] = f"{'ok' if ok else 'DISAGREES'}, max|Δ| {max_diff:.1e}" + (f"; {rerouted} rerouted" if rerouted else "")
            contenders[name] = lambda block=block: block(x_TD.unsqueeze(0))
    contenders[DENSE] = dense_gemm(tokens, dtype, g)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    with moe_forward_context(tokens):
        for fn in contenders.values():
            for _ in range(WARMUP):
                fn()
        for r in range(repeats):
            for name, fn in contenders.items():
                times[name].append(median_ms(fn, 1))
            advance(f"{shape}: repetition {r + 1}/{repeats}")
    rows = []
    for name, ms in times.items():
        ratios = [t / m for t, m in zip(ms, times[MOESHARD])]
        rows.append(Row(shape, tokens, name, statistics.median(ms), statistics.median(ratios), min(ratios), max(ratios)))
    return rows, notes


def shape_table(rows: list[Row], notes: dict[str, str], dtype_name: str) -> Table:
    table = Table(title=f"{rows[0].shape}: T={rows[0].tokens}, {dtype_name}")
    table.add_column("implementation", no_wrap=True)
    for column in ("median ms", "ratio", "spread", "tokens/s"):
        table.add_column(column, justify="right")
    table.add_column("parity vs moeshard")
    timed = {r.impl: r for r in rows}
    for impl in [MOESHARD, FLOOR, *notes, DENSE]:
        r = timed.get(impl)
        note = notes.get(impl) or ("reference" if impl == MOESHARD else "—")
        if r is None:
            table.add_row(impl, "—", "—", "—", "—", f"skipped: {note}")
        else:
            style = "red" if note.startswith("DISAGREES") else None
            table.add_row(impl, f"{r.median_ms:.3f}", f"{r.ratio_to_moeshard:.2f}", f"{r.ratio_low:.2f}–{r.ratio_high:.2f}",
                          f"{r.tokens / r.median_ms * 1e3:,.0f}", note, style=style)
    return table


def run_bench_layer(args) -> int:
    dtype = DTYPES[args.dtype]
    shapes = {"decode": args.decode_tokens, "prefill": args.prefill_tokens}
    weights = MoEWeights.random(CFG, seed=0)
    layer = MoELayer(CFG, weights, dtype=dtype, name="bench.layer")
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    rows, disagreed = [], False
    with torch.inference_mode(), Progress(
        TextColumn("[bold]bench layer[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
        TimeElapsedColumn(), console=console,
    ) as progress:
        task = progress.add_task("", total=len(shapes) * args.repeats)
        for shape, tokens in shapes.items():
            progress.update(task, description=f"{shape}: parity checks")
            shape_rows, notes = bench_shape(
                shape, tokens, layer, weights, dtype, args.repeats,
                lambda what: progress.update(task, advance=1, description=what),
            )
            rows += shape_rows
            disagreed |= any(n and n.startswith("DISAGREES") for n in notes.values())
            progress.console.print(shape_table(shape_rows, notes, args.dtype))
            by_impl = {r.impl: r for r in shape_rows}
            floor, dense = by_impl[FLOOR], by_impl[DENSE]
            progress.console.print(
                f"moeshard takes {1 / floor.ratio_to_moeshard:.2f}× the time of its own GEMMs alone "
                f"({floor.median_ms:.3f} ms) and {1 / dense.ratio_to_moeshard:.1f}× that of one dense GEMM of the same "
                f"FLOPs, [{tokens * CFG.router.top_k}, {CFG.hidden}] @ [{CFG.hidden}, {3 * CFG.intermediate}] "
                f"({dense.median_ms:.3f} ms)\n"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
    return 1 if disagreed else 0
