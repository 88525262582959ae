"""Run a function on N local ranks: a pool of spawned processes, or the ranks `torchrun` started.

`open_ranks(n)` gives an object with `.run(fn, *args) -> [result of rank 0, …, rank n-1]`.
Spawned pools stay up between calls (tests and commands reuse one pool for many cases). If a rank
dies or raises while others wait in a collective, every rank is stopped and `RankError` is raised
within a bounded time: a dead peer never hangs the caller.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moeshard.parallel import state
from moeshard.parallel.layout import Layout

# After one rank fails, how long the others get to report (they may be blocked in a collective).
FAILURE_GRACE_S = 10.0


class RankError(RuntimeError):
    """A rank raised or died; `.rank` names it, `.kind` is the exception's type name."""

    def __init__(self, rank: int, kind: str, message: str, detail: str = ""):
        super().__init__(f"rank {rank}: {kind}: {message}")
        self.rank, self.kind, self.message, self.detail = rank, kind, message, detail


def exit_with_parent(parent_pid: int) -> None:
    """In a spawned rank: end this process once its parent is gone. A parent killed outright
    (SIGKILL) cannot stop its children, and no rank may outlive the process that drives it."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="moeshard-parent-watch", daemon=True).start()


def start_spawned_rank(rank: int, world_size: int, store_port: int, threads: int, parent_pid: int) -> None:
    """What every spawned rank does first: follow its parent, set its threads, join the world."""
    exit_with_parent(parent_pid)
    torch.set_num_threads(threads)
    state.init_distributed(rank, world_size, store=state.local_store(world_size, store_port))


def _rank_main(rank: int, world_size: int, store_port: int, threads: int, parent_pid: int, tasks, results) -> None:
    start_spawned_rank(rank, world_size, store_port, threads, parent_pid)
    while (task := tasks.get()) is not None:
        seq, fn, args = task
        try:
            results.put((seq, rank, True, fn(*args)))
        except BaseException as exc:  # reported to the parent, which decides
            results.put((seq, rank, False, (type(exc).__name__, str(exc), traceback.format_exc())))
    dist.destroy_process_group()


class RankPool:
    """`world_size` spawned processes in one gloo world, kept until `close()`."""

    def __init__(self, world_size: int, threads_per_rank: int = 1):
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self._store = state.local_store(world_size)  # every rank is a child: this process only serves the store
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_rank_main,
                args=(r, world_size, self._store.port, threads_per_rank, os.getpid(), self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._seq = 0
        self._closed = False

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Run `fn(*args)` on every rank; return the results in rank order."""
        if self._closed:
            raise RuntimeError("this rank pool was stopped after an earlier failure; open a new one.")
        self._seq += 1
        for q in self._tasks:
            q.put((self._seq, fn, args))
        done: dict[int, Any] = {}
        failure: RankError | None = None
        deadline = None
        while len(done) < self.world_size:
            try:
                seq, rank, ok, payload = self._results.get(timeout=0.1)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if p.exitcode is not None]
                if dead:
                    self.close(force=True)
                    r, code = dead[0]
                    seen = f"; then {failure}" if failure else ""
                    raise RankError(r, "RankDied", f"process exited with code {code} mid-task{seen}") from None
                if deadline is not None and time.monotonic() > deadline:
                    self.close(force=True)
                    raise failure from None
                continue
            if seq != self._seq:
                continue
            done[rank] = payload
            if not ok and failure is None:
                failure = RankError(rank, *payload)
                deadline = time.monotonic() + FAILURE_GRACE_S
        if failure is not None:
            raise failure  # every rank answered, so the pool is still usable
        return [done[r] for r in range(self.world_size)]

    @property
    def alive(self) -> bool:
        return not self._closed

    def close(self, force: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if not force:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        self._store = None

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TorchrunRanks:
    """The ranks `torchrun` started: each runs `fn` itself; every rank gets all ranks' results."""

    def __init__(self, world_size: int):
        if not dist.is_initialized():
            state.init_from_env()
        if dist.get_world_size() != world_size:
            raise RuntimeError(f"torchrun started {dist.get_world_size()} ranks but {world_size} are needed.")
        self.world_size = world_size

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        results: list[Any] = [None] * self.world_size
        dist.all_gather_object(results, fn(*args))
        return results

    alive = True

    def close(self) -> None:
        pass

    def __enter__(self) -> "TorchrunRanks":
        return self

    def __exit__(self, *exc) -> None:
        pass


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def open_ranks(world_size: int) -> RankPool | TorchrunRanks:
    return TorchrunRanks(world_size) if under_torchrun() else RankPool(world_size)


def open_layout(layout: Layout, **sizes: int) -> RankPool | TorchrunRanks:
    """Ranks for `layout`, after refusing (before any process starts) a layout `sizes` cannot run on.

    `sizes`: any of num_experts, intermediate, shared_intermediate, world_size (see Layout.validate).
    """
    layout.validate(**sizes)
    return open_ranks(layout.world_size)


def is_reporting_rank() -> bool:
    """True where output should be printed: always for a spawned pool's parent, rank 0 under torchrun."""
    return not under_torchrun() or int(os.environ.get("RANK", "0")) == 0
