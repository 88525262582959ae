"""TP collectives as `torch.library` custom ops, so compiled graphs keep them as opaque calls.

Each reads the current ParallelState when it runs. Fake implementations return new tensors of the
output's shape, never an input (an aliasing fake lets the compiler reuse a buffer wrongly).
"""

from __future__ import annotations

import torch

from moeshard.runtime.graph import serving_op
from moeshard.parallel import state


@serving_op("moeshard::tp_all_gather")
def tp_all_gather(x: torch.Tensor) -> torch.Tensor:
    """[T, ...] on each TP rank → [TP·T, ...], in TP-rank order."""
    return state.all_gather(x, state.get_parallel_state().tp_group)


@tp_all_gather.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((state.get_parallel_state().layout.tp * x.shape[0], *x.shape[1:]))


@serving_op("moeshard::tp_all_reduce")
def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the TP group, unconditionally."""
    return state.all_reduce(x, state.get_parallel_state().tp_group)


@tp_all_reduce.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@serving_op("moeshard::tp_reduce_scatter")
def tp_reduce_scatter(x: torch.Tensor) -> torch.Tensor:
    """Sum over the TP group and keep this rank's dim-0 chunk, unconditionally."""
    return state.reduce_scatter(x, state.get_parallel_state().tp_group)


@tp_reduce_scatter.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0] // state.get_parallel_state().layout.tp, *x.shape[1:]))
