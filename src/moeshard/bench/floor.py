"""A decode step against its physical floors: the bytes the step must read, divided by the machine's
read bandwidth, and the multiply-adds it must do, divided by the machine's GEMM throughput, both
measured in the same run.

The bytes: every weight outside the routed experts (attention, norms, shared experts, the LM head;
the embedding only where the LM head is the embedding), the routed experts the step actually
touched (read off the routers' choices in that step), and each sequence's K/V context. A step can
go below this floor only by reading fewer bytes. The multiply-adds: every matrix product each
sequence's token goes through (dense weights, its top-k experts, the LM head) and its attention over
its context; the throughput is the kernel's (or torch's) at a compute-bound GEMM in the serving dtype.
On a CPU whose vector units are slow next to its memory (no AMX), the compute floor is the higher one
at large batches. The engine runs `sequences` requests until all are
decoding, times whole engine steps (schedule, forward, sampling, bookkeeping), then aborts them.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch

from moeshard import kernels
from moeshard.engine import SamplingParams
from moeshard.moe.experts import GroupedExperts
from moeshard.moe.layer import MoELayer
from moeshard.moe.router import Router


@dataclass(frozen=True)
class DecodeFloor:
    threads: int
    sequences: int
    context: int  # prompt tokens per sequence when decoding starts
    step_ms: float  # median engine step
    weight_mb: float  # weights the step read: dense + touched experts
    kv_mb: float
    bandwidth_gbs: float  # read bandwidth measured in this run, at this thread count
    gflop: float  # multiply-adds ×2 the step must do
    gemm_gflops: float  # a compute-bound GEMM's throughput in this run, this dtype and thread count

    @property
    def floor_ms(self) -> float:
        return (self.weight_mb + self.kv_mb) * 1e6 / (self.bandwidth_gbs * 1e9) * 1e3

    @property
    def ratio(self) -> float:
        return self.step_ms / self.floor_ms

    @property
    def compute_floor_ms(self) -> float:
        return self.gflop / self.gemm_gflops * 1e3

    @property
    def compute_ratio(self) -> float:
        return self.step_ms / self.compute_floor_ms


def median_ms(fn, repeats: int, warmup: int = 0) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def read_bandwidth_gbs(mib: int = 512, repeats: int = 5) -> float:
    """The best of `repeats` sums over a buffer far larger than the caches, at the current torch
    thread count: what one step's worth of weight streaming can get."""
    buffer = torch.ones(mib * 2**20 // 4)
    seconds = min(median_ms(buffer.sum, 1) for _ in range(repeats)) / 1e3
    return buffer.numel() * 4 / seconds / 1e9


def gemm_gflops(dtype: torch.dtype, repeats: int = 5) -> float:
    """The best of `repeats` timings of a [256, 2048] × [2048, 2048] product in `dtype` (compute-bound:
    the weight stays in cache), on moeshard.kernels where they serve it, else torch's."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(256, 2048, generator=g).to(dtype), torch.randn(2048, 2048, generator=g).to(dtype)
    if kernels.serves(w):
        packed = kernels.pack(w)
        product = lambda: kernels.linear(x, packed, 2048)  # noqa: E731
    else:
        product = lambda: torch.nn.functional.linear(x, w)  # noqa: E731
    seconds = min(median_ms(product, 3, warmup=1) for _ in range(repeats)) / 1e3
    return 2 * 256 * 2048 * 2048 / seconds / 1e9


def bytes_of(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def step_bytes(model, touched_experts: list[int], sequences: int, context: int) -> tuple[int, int]:
    """(weight bytes, KV bytes) a decode step of `sequences` at `context` must read."""
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    expert_ids = {id(p) for m in experts for p in m.parameters()}
    skip = expert_ids | ({id(p) for p in model.embed.parameters()} if model.lm_head is not model.embed else set())
    dense = bytes_of(p for p in model.parameters() if id(p) not in skip)
    per_expert = [bytes_of(m.parameters()) // m.w13_LFD.shape[0] for m in experts]
    routed = sum(n * size for n, size in zip(touched_experts, per_expert, strict=True))
    kv = sum(bytes_of([layer.attn.cache.k_SGd[:1], layer.attn.cache.v_SGe[:1]]) for layer in model.layers)
    return dense + routed, kv * sequences * context


def step_gflop(model, sequences: int, context: int) -> float:
    """Multiply-adds ×2 of a decode step: each sequence's token through every matrix (dense, its
    top-k experts, the LM head) and its attention (scores and values) over `context` positions."""
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    skip = {id(p) for m in experts for p in m.parameters()} | {id(p) for p in model.embed.parameters()}
    weights = lambda params: sum(math.prod(p.weight_layout.shape) for p in params if len(p.weight_layout.shape) >= 2)  # noqa: E731
    matrices = weights(p for p in model.parameters() if id(p) not in skip)
    if model.lm_head is model.embed:
        matrices += weights([model.embed.weight_VD])
    routed = sum(m.cfg.router.top_k * weights(m.experts.parameters()) // m.experts.w13_LFD.shape[0]
                 for m in model.modules() if isinstance(m, MoELayer))
    attention = 0
    for layer in model.layers:
        spec = layer.attn.cache_spec()
        attention += layer.attn.num_heads * (spec.k_dim + spec.v_dim) * context
    return 2 * sequences * (matrices + routed + attention) / 1e9


def decode_floor(llm, sequences: int, context: int, vocab: int, repeats: int = 5, seed: int = 0) -> DecodeFloor:
    """Needs a one-rank engine (its model runs in this process) with room for `context + repeats + 3`
    tokens per sequence."""
    core, g = llm.core, torch.Generator().manual_seed(seed)
    model = llm.ranks.host.worker.model
    params = SamplingParams(temperature=0, max_tokens=repeats + 3, ignore_eos=True)
    ids = [core.add_request(torch.randint(3, vocab, (context,), generator=g).tolist(), params)
           for _ in range(sequences)]
    try:
        decoding: set[int] = set()
        while len(decoding) < sequences:  # prefill, chunked by the token budget
            decoding |= {d.request_id for d in core.step()}
        step_ms = median_ms(core.step, repeats)
        chosen: list[torch.Tensor] = []
        hooks = [m.register_forward_hook(lambda mod, args, out: chosen.append(out[0]))
                 for m in model.modules() if isinstance(m, Router)]
        try:
            core.step()
        finally:
            for hook in hooks:
                hook.remove()
        touched = [int(ids_TK[:sequences].unique().numel()) for ids_TK in chosen]
    finally:
        for request_id in ids:
            core.abort(request_id)
        core.step()  # reports the aborts; frees nothing more
    weights, kv = step_bytes(model, touched, sequences, context + repeats + 1)
    return DecodeFloor(torch.get_num_threads(), sequences, context, step_ms, weights / 1e6, kv / 1e6,
                       read_bandwidth_gbs(), step_gflop(model, sequences, context + repeats + 1),
                       gemm_gflops(model.dtype))
