"""A decode step against its own GEMMs alone: the floor a step cannot go below without faster GEMMs.

The engine runs `sequences` requests until every one is decoding, times whole engine steps (schedule,
forward, sampling, bookkeeping), records the matmul-family calls of one more step with their real
operands, and replays only those calls, timed in the same run. The requests are aborted afterwards.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moeshard.engine import SamplingParams

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


@dataclass(frozen=True)
class DecodeFloor:
    threads: int
    sequences: int
    context: int  # prompt tokens per sequence when decoding starts
    step_ms: float  # median engine step
    gemms_ms: float  # median replay of that step's matmuls alone
    gemm_calls: int

    @property
    def ratio(self) -> float:
        return self.step_ms / self.gemms_ms


def median_ms(fn, repeats: int, warmup: int = 0) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def decode_floor(llm, sequences: int, context: int, vocab: int, repeats: int = 5, seed: int = 0) -> DecodeFloor:
    """Needs a one-rank engine (its forward runs in this process, where the recorder sees it) with
    room for `context + repeats + 3` tokens per sequence."""
    core, g = llm.core, torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0, max_tokens=repeats + 3, ignore_eos=True)
    ids = [core.add_request(torch.randint(3, vocab, (context,), generator=g).tolist(), params)
           for _ in range(sequences)]
    try:
        decoding: set[int] = set()
        while len(decoding) < sequences:  # prefill, chunked by the token budget
            decoding |= {d.request_id for d in core.step()}
        step_ms = median_ms(core.step, repeats)
        with RecordMatmuls() as recorder:
            core.step()
        gemms_ms = median_ms(recorder.replay, repeats)
    finally:
        for request_id in ids:
            core.abort(request_id)
        core.step()  # reports the aborts; frees nothing more
    return DecodeFloor(torch.get_num_threads(), sequences, context, step_ms, gemms_ms, len(recorder.calls))
