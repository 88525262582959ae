"""Process groups for a layout, and the few collectives the MoE path uses.

One `ParallelState` is current per process (as in Megatron's and vLLM's parallel state). Layers read
it when they are built; the custom ops read it when they run.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeshard.runtime import invariance
from moeshard.parallel.layout import Layout

# A collective that waits longer than this raises instead of hanging (a peer died).
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("MOESHARD_COLLECTIVE_TIMEOUT_S", "25")))


@dataclass(frozen=True)
class ParallelState:
    layout: Layout
    rank: int
    tp_group: dist.ProcessGroup | None  # this rank's DP group's TP ranks
    dp_group: dist.ProcessGroup | None  # ranks with this rank's tp_rank, one per DP group
    ep_group: dist.ProcessGroup | None  # the whole world
    device: torch.device = torch.device("cpu")

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank(self.rank)

    @property
    def ep_rank(self) -> int:
        return self.rank if self.layout.ep else 0


_current: ParallelState | None = None
_group_cache: dict[Layout, ParallelState] = {}


STORE_TIMEOUT = datetime.timedelta(seconds=300)  # ranks starting up: importing torch, loading a model


def local_store(world_size: int, port: int | None = None) -> dist.TCPStore:
    """The rendezvous store of ranks on this machine, on 127.0.0.1: served by this process on a free
    port (`port` None), or joined at `port`. A TCP store leaves no file behind, however a process
    ends (a file store in the temp folder outlives a SIGKILL)."""
    serve = port is None
    return dist.TCPStore(
        "127.0.0.1", 0 if serve else port, world_size, is_master=serve, timeout=STORE_TIMEOUT, wait_for_workers=False
    )


def init_distributed(
    rank: int, world_size: int, init_method: str | None = None, device: str = "cpu", store: dist.Store | None = None
) -> None:
    """Join the default process group (through `init_method` or `store`): gloo on CPU, NCCL on CUDA."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(
        backend, init_method=init_method, store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT
    )


def init_from_env() -> None:
    """Join under `torchrun` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment)."""
    device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu"
    init_distributed(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", device)


def leave_distributed() -> None:
    """Leave the default process group; the groups made for it go with it."""
    global _current
    _current = None
    _group_cache.clear()
    if dist.is_initialized():
        dist.destroy_process_group()


def set_layout(layout: Layout) -> ParallelState:
    """Make `layout` current, creating (once per layout) its TP and DP groups.

    Every rank must call this with the same layout: group creation is collective.
    """
    global _current
    if layout not in _group_cache:
        _group_cache[layout] = _build(layout)
    _current = _group_cache[layout]
    return _current


def _build(layout: Layout) -> ParallelState:
    if not dist.is_initialized() or layout.world_size == 1:
        if layout.world_size != 1:
            raise RuntimeError(f"layout {layout.label()} needs {layout.world_size} ranks, but torch.distributed is not initialised.")
        return ParallelState(layout, 0, None, None, None)
    world = dist.get_world_size()
    layout.validate(world_size=world)
    rank = dist.get_rank()
    tp_group = dp_group = None
    for d in range(layout.dp):
        group = dist.new_group(layout.tp_group_ranks(d))
        if layout.dp_rank(rank) == d:
            tp_group = group
    for t in range(layout.tp):
        group = dist.new_group(layout.dp_group_ranks(t))
        if layout.tp_rank(rank) == t:
            dp_group = group
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    return ParallelState(layout, rank, tp_group, dp_group, dist.group.WORLD, device)


def get_parallel_state() -> ParallelState:
    if _current is None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError("no parallel layout is set on this rank; call set_layout(layout) on every rank first.")
        return set_layout(Layout())
    return _current


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum over `group`, out of place."""
    n = group_size(group)
    if n > 1 and invariance.batch_invariant():
        return ordered_sum(all_gather(x, group).view(n, *x.shape))
    out = x.clone()
    if n > 1:
        dist.all_reduce(out, group=group)
    return out


def all_gather(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate equal-shaped `x` from every rank of `group` along dim 0, in rank order."""
    n = group_size(group)
    if n == 1:
        return x.clone()
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    dist.all_gather_single(out, x.contiguous(), group=group)
    return out


def reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum over `group`, then keep this rank's equal dim-0 chunk."""
    n = group_size(group)
    if n == 1:
        return x.clone()
    if invariance.batch_invariant():  # each rank's chunk j goes to rank j, then a rank-ordered sum
        return ordered_sum(all_to_all(x, group).view(n, x.shape[0] // n, *x.shape[1:]))
    out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    dist.reduce_scatter_single(out, x.contiguous(), group=group)
    return out


def ordered_sum(parts_W: torch.Tensor) -> torch.Tensor:
    """parts[0] + parts[1] + … in rank order: the same rounding whatever the collective's algorithm
    (gloo's and NCCL's split a buffer into chunks by its size, so their order follows the batch)."""
    out = parts_W[0].clone()
    for part in parts_W[1:]:
        out += part
    return out


def all_to_all(
    x: torch.Tensor,
    group: dist.ProcessGroup | None,
    send_counts: list[int] | None = None,
    recv_counts: list[int] | None = None,
) -> torch.Tensor:
    """Exchange dim-0 chunks over `group`: equal chunks when no counts are given, else variable ones."""
    if group_size(group) == 1:
        return x.clone()
    rows = x.shape[0] if recv_counts is None else sum(recv_counts)
    out = x.new_empty((rows, *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group)
    return out


def gather_ints(value: int, group: dist.ProcessGroup | None) -> list[int]:
    """Every rank's `value`, in rank order (a host sync: run it outside compiled code)."""
    mine = torch.tensor([value], dtype=torch.int64, device=get_parallel_state().device)
    return all_gather(mine, group).tolist()
