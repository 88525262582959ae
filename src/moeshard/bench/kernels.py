"""`moeshard bench kernels`: moeshard.kernels against torch's ops (bf16 or fp32) on the shapes a decode or
prefill step runs, in the same process, alternating, repeated (medians and spread of the ratios).

Weights are cycled over up to `LAYERS` copies (more bytes than the caches hold), as a step reads
each layer's once: the time then includes streaming them from memory, as in the engine. Times are
per copy (per layer).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from moeshard import kernels

LAYERS = 8


@dataclass(frozen=True)
class Case:
    layers: int  # weight copies cycled; times are per copy
    name: str
    rows: int
    bytes_read: int  # weights a call must read
    flops: int
    torch_ms: float
    kernel_ms: float
    ratio_low: float
    ratio_high: float

    @property
    def ratio(self) -> float:
        return self.torch_ms / self.kernel_ms


def timed(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def compare(layers, name, rows, bytes_read, flops, ours, theirs, repeats) -> Case:
    ours(), theirs()
    calls = max(1, int(20 / max(timed(theirs, 1), 1e-3)))  # ~20 ms a measurement
    mine, peer = [], []
    for rep in range(repeats):
        for fn, out in ((ours, mine), (theirs, peer))[:: 1 if rep % 2 == 0 else -1]:
            out.append(timed(fn, calls))
    ratios = [p / m for p, m in zip(peer, mine)]
    return Case(layers, name, rows, bytes_read, flops, statistics.median(peer) / layers, statistics.median(mine) / layers,
                min(ratios), max(ratios))


def copies(layer_bytes: int) -> int:
    """Enough layers to overflow the caches (256 MB), at most LAYERS."""
    return max(1, min(LAYERS, 256_000_000 // layer_bytes))


def linear_case(rows: int, k: int, n: int, dtype: torch.dtype, repeats: int) -> Case:
    g, size = torch.Generator().manual_seed(0), dtype.itemsize
    x = torch.randn(rows, k, generator=g).to(dtype)
    weights = [torch.randn(n, k, generator=g).to(dtype) for _ in range(copies(n * k * size))]
    packed = [kernels.pack(w) for w in weights]
    return compare(
        len(weights), f"linear [{rows}, {k}] × [{k}, {n}]", rows, n * k * size, 2 * rows * k * n,
        lambda: [kernels.linear(x, p, n) for p in packed], lambda: [F.linear(x, w) for w in weights], repeats,
    )


def experts_case(rows: int, experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype, repeats: int) -> Case:
    g, size = torch.Generator().manual_seed(0), dtype.itemsize
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    labels = torch.randint(0, experts, (rows,), generator=g).sort().values
    ends = torch.bincount(labels, minlength=experts).cumsum(0).to(torch.int32)
    touched = int((torch.bincount(labels, minlength=experts) > 0).sum())
    layers = copies(experts * 3 * hidden * inter * size)
    w13 = [(torch.randn(experts, 2 * inter, hidden, generator=g) * 0.05).to(dtype) for _ in range(layers)]
    w2 = [(torch.randn(experts, hidden, inter, generator=g) * 0.05).to(dtype) for _ in range(layers)]
    packed = [(kernels.pack_gate_up(a), kernels.pack_down(b)) for a, b in zip(w13, w2)]

    def theirs():
        for a, b in zip(w13, w2):
            gate, up = F.grouped_mm(x, a.transpose(1, 2), offs=ends).chunk(2, dim=-1)
            F.grouped_mm(F.silu(gate) * up, b.transpose(1, 2), offs=ends)

    return compare(
        layers, f"experts: {rows} rows ({rows // top_k} tokens × top-{top_k}) over {experts} × [{hidden}, {inter}]", rows,
        touched * 3 * hidden * inter * size, 2 * rows * 3 * hidden * inter,
        lambda: [kernels.grouped_swiglu(x, a, b, ends) for a, b in packed], theirs, repeats,
    )


def kernels_console(width: int) -> Console | None:
    """A console for a kernel benchmark's table; None (the reason printed) where the kernels do not run."""
    console = Console(highlight=False, width=None if sys.stdout.isatty() else width)
    if kernels.built():
        return console
    console.print("moeshard: error: this CPU has neither AVX512-BF16 nor AVX2 + FMA (or the kernels did not "
                  "build): nothing to compare.")
    return None


def run_bench_kernels(args) -> int:
    console = kernels_console(160)
    if console is None:
        return 2
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    cases = [linear_case(r, 512, 512, dtype, args.repeats) for r in (1, 8, 64)]
    cases += [linear_case(r, 2048, 2048, dtype, args.repeats) for r in (1, 256)]
    cases += [experts_case(r, 32, 512, 256, 4, dtype, args.repeats) for r in (16, 64, 256, 1024)]
    cases += [experts_case(r, 128, 2048, 768, 8, dtype, args.repeats) for r in (8, 128, 512)]
    table = Table(title=f"moeshard.kernels ({kernels.isa()} build) vs torch {args.dtype}, {args.threads} thread(s), "
                        "per layer, layers' weights cycled (ratio: torch time / kernel time; median, lowest–highest)")
    for column in ("case", "torch ms", "kernel ms", "ratio", "spread", "kernel GB/s", "kernel GF/s"):
        table.add_column(column, justify="right")
    for c in cases:
        table.add_row(c.name, f"{c.torch_ms:.3f}", f"{c.kernel_ms:.3f}", f"{c.ratio:.2f}",
                      f"{c.ratio_low:.2f}–{c.ratio_high:.2f}", f"{c.bytes_read / c.kernel_ms / 1e6:.1f}",
                      f"{c.flops / c.kernel_ms / 1e6:.0f}")
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**asdict(c), "ratio": c.ratio} for c in cases], f, indent=1)
    return 0
