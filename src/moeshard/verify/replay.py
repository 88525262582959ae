"""Graph replay: compile once under one method, run under every other; all pairs must be exact.

For each trace method A, a fresh layer is compiled as a serving engine compiles it (dynamic shapes,
guards dropped) and traced with A live; then each run method B is made live and the same compiled
code runs. The runtime-aware layer must match the reference for every (A, B); the naive layer
(verify.naive) must not, or the check would be unable to see the bug it exists for.
"""

from __future__ import annotations

import torch

from moeshard.runtime.graph import compile_for_serving
from moeshard.moe import CommMethod, MoELayer
from moeshard.verify.layer import Group, build, case_error
from moeshard.verify.naive import NaiveMoELayer

EP_METHODS = [m.value for m in CommMethod]


def run_replay(group: Group, seed: int, naive: bool, backend: str = "aot_eager") -> list[tuple[str, str, float, float]]:
    """On one rank: (trace method, run method, max |err|, max |ref|) for every pair."""
    built = build(group, seed)
    results = []
    for traced in EP_METHODS:
        compiled = compile_for_serving(built.layer(NaiveMoELayer if naive else MoELayer), backend)
        try:
            results.append((traced, traced, *case_error(compiled, built, traced)))
            torch.compiler.set_stance("fail_on_recompile")
            for run in EP_METHODS:
                if run != traced:
                    results.append((traced, run, *case_error(compiled, built, run)))
        finally:
            torch.compiler.set_stance("default")
    return results


def merge_pairs(per_rank: list[list[tuple[str, str, float, float]]]) -> dict[tuple[str, str], float]:
    """Relative error of each (trace, run) pair: worst rank's error over the largest output."""
    out = {}
    for cases in zip(*per_rank):
        scale = max(max(c[3] for c in cases), 1e-30)
        out[(cases[0][0], cases[0][1])] = max(c[2] for c in cases) / scale
    return out
