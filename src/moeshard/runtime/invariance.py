"""Batch-invariant mode (docs/DESIGN.md §11): a switch every level reads, set per rank by its worker.

In this mode every reduction that produces a request's numbers runs in an order fixed by the
request alone, never by the batch around it: GEMMs on moeshard.kernels (each output accumulated
over its inputs in one order, whatever the rows), the router's logits on those kernels and its
top-k outside compiled code, each token's K expert outputs summed in k order, every cross-rank sum
gathered and added in rank order. Modules read the switch when they are built; the collectives and
the top-k combine read it when they run, so a worker sets it again before every step.
"""

from __future__ import annotations

_batch_invariant = False


def set_batch_invariant(on: bool) -> None:
    global _batch_invariant
    _batch_invariant = bool(on)


def batch_invariant() -> bool:
    return _batch_invariant
