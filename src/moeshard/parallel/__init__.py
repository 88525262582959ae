"""Parallel layout, process groups and rank launching."""

from moeshard.parallel.launch import RankError, RankPool, open_ranks
from moeshard.parallel.layout import Layout, LayoutError
from moeshard.parallel.state import ParallelState, get_parallel_state, set_layout

__all__ = [
    "Layout",
    "LayoutError",
    "ParallelState",
    "RankError",
    "RankPool",
    "get_parallel_state",
    "open_ranks",
    "set_layout",
]
