"""A decode step against its floor: the larger of the time to read the bytes the step must read and
the time its kernels need for its products with every byte already in cache, both measured in the
same run, for the weights as the engine holds them (bf16, fp32, or quantized: fp8, int8, int4).

- **Bytes**: every weight outside the routed experts (attention, norms, shared experts, dense MLPs,
  the LM head; the embedding only where the LM head is the embedding), the routed experts the step
  touched (read off the routers' choices in that step), and each sequence's K/V context — counted
  from the parameters as held (a quantized weight: its values, scales and zero points, as one
  byte tensor) — at the read bandwidth measured in the run. A step goes below it only by reading
  fewer bytes.
- **Compute**: each matrix of the step at the rate of the kernel that serves its format, at the
  rows each of its weights meets (the sequences; a routed expert's weight: the sequences × top-k
  over the experts the step touched), that rate measured in the run on a [2048 × 2048] block held
  in cache (`seconds_per_weight`: the engine's own layout and product for that format); attention's
  scores and values at the model dtype's rate over 64 rows. A quantized kernel dequantizes every
  weight it reads (~10 vector operations per 32 weights), so at one row its compute, not its bytes,
  can bind.

The floor is one figure, the larger of the two, and says which binds. Both are given per part of
the step (LM head, routed experts, attention projections, attention over K/V, router, the rest), so
`bench step` can set each part's measured time beside its own floor. The engine runs `sequences`
requests until all are decoding, times whole engine steps (schedule, forward, sampling,
bookkeeping), then aborts them.
"""

from __future__ import annotations

import contextlib
import functools
import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from moeshard.engine import SamplingParams
from moeshard.kernels import packed
from moeshard.kernels.quant import QuantFormat
from moeshard.models.attention import AttentionBase
from moeshard.moe.experts import GroupedExperts
from moeshard.moe.layer import MoELayer
from moeshard.moe.router import Router

BLOCK = 2048  # the block a kernel's rate is measured on: [BLOCK × BLOCK], 8 MB in bf16, cache-resident between calls
BEST_ROWS = 64  # rows at which a kernel's rate is its best (attention's products are counted at it)
PARTS = ("LM head", "routed experts", "attention projections", "attention over K/V", "router", "other weights")


@dataclass(frozen=True)
class Part:
    """One part of a decode step (PARTS): what it reads and its floor's two halves."""

    name: str
    mb: float  # bytes it must read, as held
    gflop: float  # its multiply-adds × 2
    bytes_ms: float  # mb at the measured bandwidth
    compute_ms: float  # its products at its kernels' measured rates

    @property
    def floor_ms(self) -> float:
        return max(self.bytes_ms, self.compute_ms)


@dataclass(frozen=True)
class DecodeFloor:
    threads: int
    sequences: int
    context: int  # prompt tokens per sequence when decoding starts
    step_ms: float  # median engine step
    bandwidth_gbs: float  # read bandwidth measured in this run, at this thread count
    parts: tuple[Part, ...]

    def total(self, attr: str, kv: bool | None = None) -> float:
        """`attr` summed over the parts (kv: only the K/V part, or all but it)."""
        return sum(getattr(p, attr) for p in self.parts if kv is None or (p.name == "attention over K/V") == kv)

    @property
    def weight_mb(self) -> float:
        return self.total("mb", kv=False)

    @property
    def kv_mb(self) -> float:
        return self.total("mb", kv=True)

    @property
    def gflop(self) -> float:
        return self.total("gflop")

    @property
    def byte_floor_ms(self) -> float:
        return self.total("bytes_ms")

    @property
    def compute_floor_ms(self) -> float:
        return self.total("compute_ms")

    @property
    def floor_ms(self) -> float:
        return max(self.byte_floor_ms, self.compute_floor_ms)

    @property
    def binds(self) -> str:
        return "bytes" if self.byte_floor_ms >= self.compute_floor_ms else "compute"

    @property
    def ratio(self) -> float:
        return self.step_ms / self.floor_ms

    def summary(self) -> dict:
        """Its fields and figures, for JSON."""
        return asdict(self) | {name: getattr(self, name) for name in (
            "weight_mb", "kv_mb", "gflop", "byte_floor_ms", "compute_floor_ms", "floor_ms", "binds", "ratio")}


def median_ms(fn, repeats: int, warmup: int = 0, clock=time.perf_counter) -> float:
    """The median of `repeats` timings of `fn` by `clock` (wall time; `time.process_time`: this
    process's CPU time, what a busy machine's other work does not inflate)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times) * 1e3


def read_bandwidth_gbs(mib: int = 512, repeats: int = 5) -> float:
    """The best of `repeats` sums over a buffer far larger than the caches, at the current torch
    thread count: what one step's worth of weight streaming can get."""
    buffer = torch.ones(mib * 2**20 // 4)
    seconds = min(median_ms(buffer.sum, 1) for _ in range(repeats)) / 1e3
    return buffer.numel() * 4 / seconds / 1e9


Kind = QuantFormat | torch.dtype  # a weight's format: quantized, or held in a dtype


def weight_kind(param: torch.Tensor) -> Kind:
    layout = param.weight_layout
    return layout.fmt if isinstance(layout, packed.QuantizedPanels) else param.dtype


@functools.cache
def seconds_per_weight(kind: Kind, rows: int, threads: int, repeats: int = 5) -> float:
    """The best of `repeats` median timings of a product of `rows` rows with a [BLOCK × BLOCK]
    weight of `kind`, held and multiplied as the engine does (its layout's `linear`: the kernels'
    panels, quantized or not, or torch's op), per weight; measured once per run at `threads`
    threads (the current torch setting, which the caller passes so that it keys the cache)."""
    g = torch.Generator().manual_seed(0)
    quantized = isinstance(kind, QuantFormat)
    dtype = torch.bfloat16 if quantized else kind
    layout = packed.for_linear((BLOCK, BLOCK), dtype, torch.device("cpu"), "the floor's block", kind if quantized else None)
    storage = torch.empty(layout.storage_shape(), dtype=layout.storage_dtype(dtype))
    layout.write(storage, (), (torch.randn(BLOCK, BLOCK, generator=g) * 0.02).to(dtype))
    x = torch.randn(rows, BLOCK, generator=g).to(dtype)
    seconds = min(median_ms(lambda: layout.linear(x, storage), 3, warmup=1) for _ in range(repeats)) / 1e3
    return seconds / BLOCK**2


def matrix_weights(param: torch.Tensor) -> int:
    shape = param.weight_layout.shape
    return math.prod(shape) if len(shape) >= 2 else 0


def part_names(model) -> dict[int, str]:
    """Each parameter a decode step reads (by id) → its part; the embedding is left out unless it
    is the LM head (a lookup reads a few rows)."""
    names = {id(p): "LM head" for p in model.lm_head.parameters()}
    for module in model.modules():
        name = ("routed experts" if isinstance(module, GroupedExperts) else "router" if isinstance(module, Router)
                else "attention projections" if isinstance(module, AttentionBase) else None)
        for p in module.parameters() if name else ():
            names.setdefault(id(p), name)
    skip = {id(p) for p in model.embed.parameters()} - set(names)
    for p in model.parameters():
        if id(p) not in skip:
            names.setdefault(id(p), "other weights")
    return names


def step_parts(model, touched_experts: list[int], sequences: int, context: int, bandwidth_gbs: float) -> list[Part]:
    """The parts (PARTS) of a decode step of `sequences` at `context` positions each, whose MoE
    layers touched `touched_experts` experts each (in model order)."""
    threads = torch.get_num_threads()
    names = part_names(model)
    moe = [m for m in model.modules() if isinstance(m, MoELayer)]
    # a routed expert's weights: the share of the layer's experts it touched, and the rows each met
    share, rows = {}, {}
    for layer, touched in zip(moe, touched_experts, strict=True):
        experts = layer.experts
        for p in experts.parameters():
            share[id(p)] = touched / experts.w13_LFD.weight_layout.shape[0]
            rows[id(p)] = sequences * layer.cfg.router.top_k / max(touched, 1)
    mb, gflop, compute_s = dict.fromkeys(PARTS, 0.0), dict.fromkeys(PARTS, 0.0), dict.fromkeys(PARTS, 0.0)
    for p in model.parameters():
        name = names.get(id(p))
        if name is None:
            continue
        part, r = share.get(id(p), 1.0), rows.get(id(p), sequences)
        mb[name] += p.numel() * p.element_size() * part / 1e6
        if matrix_weights(p):
            weights = matrix_weights(p) * part
            gflop[name] += 2 * weights * r / 1e9
            compute_s[name] += weights * seconds_per_weight(weight_kind(p), max(1, round(r)), threads)
    name = "attention over K/V"
    for layer in model.layers:
        cache, spec = layer.attn.cache, layer.attn.cache_spec()
        mb[name] += (cache.k_SGd[:1].nbytes + cache.v_SGe[:1].nbytes) * sequences * context / 1e6
        gflop[name] += 2 * sequences * layer.attn.num_heads * (spec.k_dim + spec.v_dim) * context / 1e9
    # its multiply-adds at the model dtype's best rate (2 flop a weight a row)
    compute_s[name] = gflop[name] * 1e9 / 2 * seconds_per_weight(model.dtype, BEST_ROWS, threads) / BEST_ROWS
    return [Part(n, mb[n], gflop[n], mb[n] / bandwidth_gbs, compute_s[n] * 1e3) for n in PARTS]


@contextlib.contextmanager
def decoding(llm, sequences: int, context: int, vocab: int, steps: int, seed: int = 0):
    """`sequences` requests of `context` random prompt tokens, prefilled (chunked by the token
    budget) until every one is decoding, with room for `steps` more decode steps; yields the engine
    core, then aborts them."""
    core, g = llm.core, torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    ids = [core.add_request(torch.randint(3, vocab, (context,), generator=g).tolist(), params)
           for _ in range(sequences)]
    try:
        decoding_: set[int] = set()
        while len(decoding_) < sequences:
            decoding_ |= {d.request_id for d in core.step()}
        yield core
    finally:
        for request_id in ids:
            core.abort(request_id)
        core.step()  # reports the aborts; frees nothing more


def touched_experts(core, model, sequences: int) -> list[int]:
    """One more engine step, recording each MoE layer's distinct experts among the sequences' choices."""
    chosen: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda mod, args, out: chosen.append(out[0]))
             for m in model.modules() if isinstance(m, Router)]
    try:
        core.step()
    finally:
        for hook in hooks:
            hook.remove()
    return [int(ids_TK[:sequences].unique().numel()) for ids_TK in chosen]


def decode_floor(llm, sequences: int, context: int, vocab: int, repeats: int = 5, seed: int = 0) -> DecodeFloor:
    """Needs a one-rank engine (its model runs in this process) with room for `context + repeats + 3`
    tokens per sequence."""
    model = llm.ranks.host.worker.model
    with decoding(llm, sequences, context, vocab, repeats + 1, seed) as core:
        step_ms = median_ms(core.step, repeats)
        touched = touched_experts(core, model, sequences)
    bandwidth = read_bandwidth_gbs()
    parts = step_parts(model, touched, sequences, context + repeats + 1, bandwidth)
    return DecodeFloor(torch.get_num_threads(), sequences, context, step_ms, bandwidth, tuple(parts))
