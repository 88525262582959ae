"""`moeshard bench quant`: the quantized kernels (fp8, int8, int4 weights dequantized to bf16 in
registers, moeshard.kernels.PackedQuantized; "int8-a8", "int4-a8": int8 and int4 weights times
activations quantized to int8, `vpdpbusd`) against the bf16 kernel on Qwen3-30B-A3B's shapes: the
LM head [151936 × 2048] and the routed experts (128 × gate-up [1536 × 2048] and down [2048 × 768],
top-8), at 1, 16 and 64 tokens. All formats run in one process, alternating, repeated; ratios are
taken within each repetition (median, lowest–highest); "best" is each contender's fastest
measurement, the figure to read on a machine shared with other work.

The panels are random (bit patterns that are finite weights: the kernels' time does not depend on
the values; their bits are tested in tests/test_kernels_quant.py). At one token the experts' calls
cycle over 16 disjoint sets of 8 experts, so every call streams its weights from memory as a decode
step does (8 int4 experts would otherwise fit the last-level cache).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass

import torch
from rich.table import Table

from moeshard import kernels
from moeshard.bench.kernels import kernels_console, timed
from moeshard.kernels.quant import QuantFormat

VOCAB, HIDDEN, EXPERTS, INTER, TOP_K = 151936, 2048, 128, 768, 8
FORMATS = {"fp8": QuantFormat("fp8"), "int8": QuantFormat("int8"), "int4": QuantFormat("int4"),
           "int8-zp": QuantFormat("int8", zero_point=True), "int4-zp": QuantFormat("int4", zero_point=True),
           "int8-a8": QuantFormat("int8", activations="int8"), "int4-a8": QuantFormat("int4", activations="int8")}


@dataclass(frozen=True)
class Result:
    case: str
    threads: int
    format: str
    weights_read: int  # weights a call reads
    bytes_read: int  # their bytes in this format (scales and zero points included)
    ms: float  # median per call
    ratio: float  # bf16 ms / this format's ms, median over repetitions (1 for bf16)
    ratio_low: float
    ratio_high: float
    best_ms: float  # the fastest call of all repetitions: what the kernel does when it has the core
    best_ratio: float  # bf16's best / this format's best


def random_bf16(shape) -> torch.Tensor:
    return torch.randn(shape).bfloat16()


def random_packed(lead: tuple[int, ...], N: int, K: int, fmt: QuantFormat, layout: str) -> kernels.PackedQuantized:
    """PackedQuantized panels of random finite weights ([lead], N outputs, K inputs in the panels)."""
    s = kernels.value_step(fmt)
    B, P, X = -(-N // kernels.PANEL), K // s, -(-K // fmt.group)
    shape = kernels.values_shape((*lead, B, P, kernels.PANEL, s), fmt)
    if fmt.kind == "fp8":  # e4m3 bits of a spread of values, no NaN
        values = torch.empty(shape, dtype=torch.uint8)
        for one in values.view(-1, *shape[-3:]):
            one.copy_((torch.randn(one.shape) * 64).to(torch.float8_e4m3fn).view(torch.uint8))
    else:
        values = torch.randint(0, 256, shape, dtype=torch.uint8)
    scale = torch.rand((*lead, B, X, kernels.PANEL)) * 1e-3
    zero = torch.randint(0, 2**fmt.bits, (*lead, B, X, kernels.PANEL), dtype=torch.uint8) if fmt.zero_point else None
    return kernels.PackedQuantized(values, scale, zero, fmt, (*lead, N, K), layout)


def packed_bytes(packed) -> int:
    if isinstance(packed, torch.Tensor):
        return packed.nbytes
    return sum(t.nbytes for t in (packed.values, packed.scale, packed.zero) if t is not None)


def measure(calls: dict, repeats: int) -> tuple[dict, dict]:
    """Per contender: ms per call of each repetition, and the bf16/this ratios of each repetition."""
    for fn in calls.values():
        fn()
    per_measurement = max(1, int(20 / max(timed(calls["bf16"], 1), 1e-3)))  # ~20 ms of bf16 calls
    ms = {name: [] for name in calls}
    names = list(calls)
    for rep in range(repeats):
        shift = rep % len(names)  # each contender first in turn
        for name in names[shift:] + names[:shift]:
            ms[name].append(timed(calls[name], per_measurement))
    ratios = {name: [b / m for b, m in zip(ms["bf16"], ms[name])] for name in calls}
    return ms, ratios


def lm_head_weights(formats: list[str]) -> dict:
    weights = {"bf16": random_bf16((-(-VOCAB // kernels.PANEL), HIDDEN // 2, kernels.PANEL, 2))}
    return weights | {name: random_packed((), VOCAB, HIDDEN, FORMATS[name], "linear") for name in formats}


def lm_head_calls(rows: int, weights: dict) -> tuple[dict, dict, int]:
    x = torch.randn(rows, HIDDEN).bfloat16()
    calls = {name: (lambda w=w: kernels.linear(x, w, VOCAB, fp32_out=True)) for name, w in weights.items()}
    return calls, {name: packed_bytes(w) for name, w in weights.items()}, VOCAB * HIDDEN


def experts_calls(tokens: int, experts: dict) -> tuple[dict, dict, int]:
    g = torch.Generator().manual_seed(tokens)
    if tokens == 1:  # 16 disjoint sets of 8 experts, one call each in turn
        sets = torch.randperm(EXPERTS, generator=g).view(-1, TOP_K)
        labels = [s.sort().values for s in sets]
    else:
        labels = [torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)]).flatten().sort().values]
    ends = [torch.bincount(l, minlength=EXPERTS).cumsum(0).to(torch.int32) for l in labels]
    touched = statistics.mean(int((torch.bincount(l, minlength=EXPERTS) > 0).sum()) for l in labels)
    x = torch.randn(tokens * TOP_K, HIDDEN).bfloat16()

    def call(w13, w2):
        turn = [0]

        def one():
            kernels.grouped_swiglu(x, w13, w2, ends[turn[0] % len(ends)])
            turn[0] += 1

        return one

    calls = {name: call(*w) for name, w in experts.items()}
    per_expert = {name: (packed_bytes(a) + packed_bytes(b)) / EXPERTS for name, (a, b) in experts.items()}
    return calls, {name: int(touched * b) for name, b in per_expert.items()}, int(touched * 3 * HIDDEN * INTER)


def expert_weights(formats: list[str]) -> dict:
    ip = kernels.padded_intermediate(INTER)
    weights = {"bf16": (random_bf16((EXPERTS, ip // 32, HIDDEN // 2, kernels.PANEL, 2)),
                        random_bf16((EXPERTS, -(-HIDDEN // kernels.PANEL), ip // 2, kernels.PANEL, 2)))}
    for name in formats:
        fmt = FORMATS[name]
        weights[name] = (random_packed((EXPERTS,), 2 * ip, HIDDEN, fmt, "gate_up"),
                         random_packed((EXPERTS,), HIDDEN, ip, fmt, "down"))
    return weights


def run_bench_quant(args) -> int:
    console = kernels_console(200)
    if console is None:
        return 2
    formats = args.formats
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"--formats takes {', '.join(FORMATS)}; got {', '.join(unknown)}.")
    results = []
    shapes = {"lm-head": (f"LM head [{VOCAB} × {HIDDEN}]", lm_head_weights, lm_head_calls),
              "experts": (f"experts {EXPERTS} × [{2 * INTER}/{INTER} × {HIDDEN}] top-{TOP_K}", expert_weights, experts_calls)}
    for case in args.cases:
        title, make_weights, make_calls = shapes[case]
        weights = make_weights(formats)  # one shape's weights in memory at a time
        for tokens in args.tokens:
            calls, bytes_read, weights_read = make_calls(tokens, weights)
            for threads in args.threads:
                torch.set_num_threads(threads)
                ms, ratios = measure(calls, args.repeats)
                results += [Result(f"{title}, {tokens} tokens", threads, f, weights_read, bytes_read[f],
                                   statistics.median(ms[f]), statistics.median(ratios[f]), min(ratios[f]), max(ratios[f]),
                                   min(ms[f]), min(ms["bf16"]) / min(ms[f])) for f in calls]
        del weights
    table = Table(title=f"quantized kernels vs the bf16 kernel ({kernels.isa()} build), Qwen3-30B-A3B shapes, groups of "
                        f"{FORMATS['int8'].group} (ratio: bf16 time / format's time; median, lowest–highest)")
    for column in ("case", "threads", "format", "ms", "G weights/s", "GB/s", "× bf16", "spread", "best ms", "best × bf16"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(r.case, str(r.threads), r.format, f"{r.ms:.3f}", f"{r.weights_read / r.ms / 1e6:.2f}",
                      f"{r.bytes_read / r.ms / 1e6:.1f}", f"{r.ratio:.2f}", f"{r.ratio_low:.2f}–{r.ratio_high:.2f}",
                      f"{r.best_ms:.3f}", f"{r.best_ratio:.2f}")
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    return 0
