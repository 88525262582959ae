"""How the driver reaches the ranks: each step and each control call over torch.distributed.

Rank 0 is the driver (the LLM's process) and holds a Worker itself; every other rank runs
`serve_forever`, a headless loop that waits for the driver's next command. The ranks are spawned
on this machine (`Ranks.spawn`) or started by torchrun on one or more machines (`Ranks.torchrun`);
past start-up both are the same `Ranks` over the same process groups. A one-rank engine needs none
of this: `LocalRanks` holds its Worker in the caller's process.

Each command starts with a header [command, length] broadcast from rank 0 on the control group:
  EXECUTE: the step's plan (int64, moeshard.engine.plan) is broadcast on the step group, every rank
    runs it, and TP rank 0 of each DP group sends its samples (float64, length first) to rank 0.
    Only these tensors cross on the step path: no pickles, nothing vocabulary-sized.
  CALL: (method, args) as one object broadcast — control calls only (open, close, sleep, wake,
    weight updates); each rank's result or error is gathered to rank 0.
  EXIT: the headless loop returns.
The control group has no practical timeout (an idle engine waits for requests); the step group and
the model's groups time out after COLLECTIVE_TIMEOUT. A rank that raises mid-step writes its error
to the store and exits; the others see its connections close (or, if it hangs, time out) and stop,
so a failed step ends every rank within COLLECTIVE_TIMEOUT, with one RankError naming the rank.
A rank that vanishes without a word (killed, or its machine lost) is named from its exit code when
spawned; under torchrun, from its heartbeat in the store, which stops with it.

Rank 0 does not wait for a step to learn of a loss: a watch thread sees a spawned rank's process
exit the moment it happens, and a torchrun rank's heartbeat stop within LOST_AFTER_S. The first
loss, however it is found, is logged at error level once, handed to `on_lost` (the async front end
ends its requests at once), and raised by the engine's next call. Spawned ranks end with their
parent, even one killed outright; torchrun ranks see rank 0's connections close.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing.connection
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moeshard.engine.worker import Worker, WorkerConfig
from moeshard.parallel import Layout, state
from moeshard.parallel.launch import RankError, start_spawned_rank

EXECUTE, CALL, EXIT = range(3)
ERROR_KEY = "moeshard/rank-error"
HEARTBEAT_KEY, STOPPED_KEY, HEARTBEAT_S = "moeshard/heartbeat/{}", "moeshard/stopped/{}", 0.5
NODE_KEY = "moeshard/node/{}"  # where a torchrun rank runs: "node N, host H"
LOST_AFTER_S = 3.0  # a heartbeat unchanged this long: the rank is gone
REPORTED_KEY, REPORT_WAIT = "moeshard/reported", datetime.timedelta(seconds=10)
IDLE_FOREVER = datetime.timedelta(days=365)
LOSS_GRACE_S = 2.0  # after a loss, how long surviving spawned ranks get to exit before they are killed

log = logging.getLogger("moeshard")


class Host:
    """What a rank holds between commands: the Worker of the engine that is open, if any."""

    def __init__(self):
        self.worker: Worker | None = None

    def open(self, config: WorkerConfig) -> None:
        self.worker = Worker(config)

    def close(self) -> None:
        self.worker = None

    def call(self, method: str, args: tuple):
        if method in ("open", "close"):
            return getattr(self, method)(*args)
        state.set_layout(self.worker.config.layout)  # another engine of this process may have set its own
        return getattr(self.worker, method)(*args)

    def answer(self, method: str, args: tuple) -> tuple[bool, object]:
        """(True, result) or (False, (kind, message, traceback)): a refused call keeps the rank up."""
        try:
            return True, self.call(method, args)
        except Exception as exc:
            return False, (type(exc).__name__, str(exc), traceback.format_exc())


class RankZero:
    """The driver's own rank: its Worker is in this process."""

    host: Host
    on_lost: Callable[[RankError], None] | None = None  # told, from a watch thread, when a rank is lost

    @property
    def forward_s(self) -> float:
        """Rank 0's time in the model's forward, all steps (0 once the engine is closed)."""
        return self.host.worker.forward_s if self.host.worker is not None else 0.0


class LocalRanks(RankZero):
    """One rank: its Worker lives in this process (and only this engine's)."""

    world_size = 1

    def __init__(self, config: WorkerConfig):
        self.host = Host()
        self.host.open(config)

    def call(self, method: str, *args) -> list:
        return [self.host.call(method, args)]

    def execute(self, plan_P: torch.Tensor) -> list[torch.Tensor]:
        return [self.host.worker.execute(plan_P)]

    def close(self) -> None:
        self.host.close()


class Channel:
    """The groups every rank creates, in the same order, once it has joined the world."""

    def __init__(self):
        world = list(range(dist.get_world_size()))
        self.control = dist.new_group(world, timeout=IDLE_FOREVER)
        self.step = dist.new_group(world, timeout=state.COLLECTIVE_TIMEOUT)
        self.store = dist.distributed_c10d._get_default_store()

    def header(self, command: int = 0, length: int = 0) -> tuple[int, int]:
        header = torch.tensor([command, length], dtype=torch.int64)
        dist.broadcast(header, 0, group=self.control)
        return int(header[0]), int(header[1])

    def plan(self, plan_P: torch.Tensor | None = None, length: int = 0) -> torch.Tensor:
        plan_P = torch.empty(length, dtype=torch.int64) if plan_P is None else plan_P
        dist.broadcast(plan_P, 0, group=self.step)
        return plan_P

    def send_samples(self, samples_R: torch.Tensor) -> None:
        dist.send(torch.tensor([samples_R.numel()], dtype=torch.int64), 0, group=self.step)
        dist.send(samples_R, 0, group=self.step)

    def receive_samples(self, rank: int) -> torch.Tensor:
        length = torch.empty(1, dtype=torch.int64)
        dist.recv(length, rank, group=self.step)
        samples_R = torch.empty(int(length), dtype=torch.float64)
        dist.recv(samples_R, rank, group=self.step)
        return samples_R

    def call(self, request: list) -> list:
        dist.broadcast_object_list(request, 0, group=self.step)
        return request

    def gather(self, answer, world_size: int | None = None) -> list | None:
        answers = [None] * world_size if world_size else None
        dist.gather_object(answer, answers, 0, group=self.step)
        return answers

    def rank_error(self) -> RankError | None:
        """The error a failed rank left in the store, if one did."""
        if not self.store.check([ERROR_KEY]):
            return None
        rank, kind, message = self.store.get(ERROR_KEY).decode().split(": ", 2)
        return RankError(int(rank.split()[1]), kind, message)


_channel: Channel | None = None  # under torchrun: made once, kept for every engine of the process
_channel_failed = False


def serve_forever(channel: Channel) -> None:
    """A headless rank: run the driver's commands until it says EXIT. A failed step ends the process."""
    host, rank = Host(), dist.get_rank()
    while True:
        command, length = channel.header()
        if command == EXIT:
            return
        if command == CALL:
            method, args = channel.call([None, None])
            channel.gather(host.answer(method, args))
            continue
        try:
            samples_R = host.worker.execute(channel.plan(length=length))
            if samples_R is not None:
                channel.send_samples(samples_R)
        except BaseException as exc:
            if not lost_peer(exc):  # the cause: the driver reports it from the store
                channel.store.set(ERROR_KEY, f"rank {rank}: {type(exc).__name__}: {exc}")
                raise
            stop_for_lost_peer(channel.store, rank)


def stop_for_lost_peer(store, rank: int) -> None:
    """Another rank failed: say this one is not lost, and leave the report to the driver (exiting
    quietly once it has, so torchrun does not end the driver before it speaks)."""
    try:
        store.set(STOPPED_KEY.format(rank), "1")
        store.wait([REPORTED_KEY], REPORT_WAIT)
    except RuntimeError:  # the store's host (rank 0's machine) is gone, or rank 0 never reported
        raise RankError(rank, "DriverLost", "its peers went away mid-step and rank 0 did not say why: the driver's process or machine is gone") from None
    raise SystemExit(1)


def exit_reason(code: int | None) -> str:
    if code is None:
        return "process exited"
    return f"process killed by signal {-code}" if code < 0 else f"process exited with code {code}"


def node_of(store, rank: int) -> str:
    """" (node N, host H)" for a torchrun rank that said where it runs; "" otherwise."""
    key = NODE_KEY.format(rank)
    try:
        return f" ({store.get(key).decode()})" if store.check([key]) else ""
    except RuntimeError:  # the store's host is gone
        return ""


def beat(store, rank: int, done: threading.Event) -> None:
    """Under torchrun: say this rank is alive, until it is done (or the store's host is gone)."""
    count = 0
    while not done.is_set():
        count += 1
        try:
            store.set(HEARTBEAT_KEY.format(rank), str(count))
        except RuntimeError:
            return
        done.wait(HEARTBEAT_S)


def lost_peer(exc: BaseException) -> bool:
    """Did this collective fail because another rank went away (or stopped answering)?"""
    return isinstance(exc, RuntimeError) and any(
        sign in str(exc) for sign in ("Connection reset", "Connection closed", "Timed out", "timed out")
    )


class Ranks(RankZero):
    """Rank 0's view of a multi-rank engine; `spawn` or `torchrun` make one."""

    def __init__(self, layout: Layout, channel: Channel, config: WorkerConfig, processes=(), restore=None):
        self.layout, self.channel, self.processes, self.restore = layout, channel, list(processes), restore
        self.world_size, self.dead = layout.world_size, False
        self.lost: RankError | None = None  # the first loss, however it was found
        self.loss_lock = threading.Lock()
        self.reap_lock = threading.Lock()  # joins of the spawned processes, one thread at a time
        self.watching = threading.Event()  # set: stop watching (closing, or already lost)
        self.host = Host()
        try:
            self.call("open", config)
        except BaseException:
            self.close()
            raise
        watch = self.watch_processes if self.processes else self.watch_heartbeats
        threading.Thread(target=watch, name="moeshard-rank-watch", daemon=True).start()

    @classmethod
    def spawn(cls, layout: Layout, config: WorkerConfig, threads_per_rank: int = 1) -> "Ranks":
        """Start ranks 1 … N-1 on this machine; this process joins as rank 0, with the same thread count."""
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already in use in this process; close the other multi-rank engine first.")
        store = state.local_store(layout.world_size)
        ctx = mp.get_context("spawn")
        processes = [
            ctx.Process(
                target=_spawned_main, args=(r, layout.world_size, store.port, threads_per_rank, os.getpid()), daemon=True
            )
            for r in range(1, layout.world_size)
        ]
        for p in processes:
            p.start()
        threads = torch.get_num_threads()
        torch.set_num_threads(threads_per_rank)
        state.init_distributed(0, layout.world_size, store=store)
        return cls(layout, Channel(), config, processes, threads)

    def lose(self, error: RankError) -> RankError:
        """Record the engine's loss (the first one found wins); log it and tell `on_lost`, once."""
        with self.loss_lock:
            if self.lost is not None:
                return self.lost
            self.lost = error
        log.error("moeshard: the engine lost a rank: %s", error)
        if self.on_lost is not None:
            self.on_lost(error)
        return error

    def watch_processes(self) -> None:
        """Spawned ranks: a process sentinel fires the moment its rank exits, idle or stepping."""
        rank_of = {p.sentinel: rank for rank, p in enumerate(self.processes, start=1)}
        while not self.watching.is_set():
            ready = multiprocessing.connection.wait(list(rank_of), timeout=0.5)
            if ready and not self.watching.is_set():
                rank = rank_of[ready[0]]
                code = self.exit_codes(wait_s=1.0, ranks=[rank]).get(rank)
                # A rank that raised said why before it exited; one that was killed did not.
                self.lose(self.channel.rank_error() or RankError(rank, "RankDied", exit_reason(code)))
                return

    def exit_codes(self, wait_s: float, ranks: list[int] | None = None) -> dict[int, int]:
        """Rank → exit code of the spawned ranks (of `ranks`, default all) that have exited, each
        waited for up to `wait_s`. One thread at a time: two threads reaping one process at once can
        lose its exit code (the second one's waitpid finds nothing)."""
        with self.reap_lock:
            chosen = {r: p for r, p in enumerate(self.processes, start=1) if ranks is None or r in ranks}
            for p in chosen.values():
                p.join(timeout=wait_s)
            return {rank: p.exitcode for rank, p in chosen.items() if p.exitcode is not None}

    def watch_heartbeats(self) -> None:
        """Torchrun ranks: a heartbeat that stops changing for LOST_AFTER_S, from a rank that did not
        say it stopped for a lost peer, is a lost rank (its process or its machine)."""
        store, changed = self.channel.store, {}
        while not self.watching.wait(HEARTBEAT_S):
            now, silent = time.monotonic(), []
            try:
                for rank in range(1, self.world_size):
                    key = HEARTBEAT_KEY.format(rank)
                    count = store.get(key) if store.check([key]) else None
                    if changed.get(rank, (None,))[0] != count:
                        changed[rank] = (count, now)
                    elif now - changed[rank][1] > LOST_AFTER_S and not store.check([STOPPED_KEY.format(rank)]):
                        silent.append(rank)
            except RuntimeError:  # the store's host is gone: torchrun's own agents stop every rank
                return
            if silent and not self.watching.is_set():
                also = f" (silent too: ranks {', '.join(map(str, silent[1:]))})" if len(silent) > 1 else ""
                where = node_of(store, silent[0])
                self.lose(RankError(silent[0], "RankLost", f"its heartbeat stopped: its process or machine is gone{where}{also}"))
                return

    @classmethod
    def torchrun(cls, layout: Layout, config: WorkerConfig) -> "Ranks":
        return cls(layout, torchrun_channel(), config)

    def call(self, method: str, *args) -> list:
        """Run a Worker method on every rank; each rank's result, or a RankError naming the first that raised."""
        answers = self.guarded(self.broadcast_call, method, args)
        for rank, (ok, payload) in enumerate(answers):
            if not ok:
                raise RankError(rank, *payload)
        return [payload for _, payload in answers]

    def broadcast_call(self, method: str, args: tuple) -> list:
        self.channel.header(CALL)
        self.channel.call([method, args])
        return self.channel.gather(self.host.answer(method, args), self.world_size)

    def execute(self, plan_P: torch.Tensor) -> list[torch.Tensor]:
        """Run a step on every rank; each DP group's samples."""
        return self.guarded(self.broadcast_step, plan_P)

    def broadcast_step(self, plan_P: torch.Tensor) -> list[torch.Tensor]:
        self.channel.header(EXECUTE, plan_P.numel())
        own = self.host.worker.execute(self.channel.plan(plan_P))
        samplers = [self.layout.rank(d, 0) for d in range(self.layout.dp)]
        return [own if rank == 0 else self.channel.receive_samples(rank) for rank in samplers]

    def guarded(self, fn, *args):
        """Run a command on the ranks; after a loss (found now or by the watch), stop them all and
        raise the loss: the same RankError for the call in progress and every later one."""
        if self.dead:
            raise RuntimeError(f"the engine's ranks stopped after an earlier failure ({self.lost}); start a new engine.")
        cause = None
        if self.lost is None:
            try:
                return fn(*args)
            except Exception as exc:
                self.lose(self.failure(exc))
                cause = exc
        self.stop_after_loss()
        raise self.lost from cause

    def stop_after_loss(self) -> None:
        global _channel_failed
        self.dead = True
        self.watching.set()
        _channel_failed = self.channel is _channel  # torchrun: this process exits; the others see it go
        try:
            self.channel.store.set(REPORTED_KEY, str(self.lost))  # headless ranks wait for it to exit quietly
        except RuntimeError:  # the store's host is gone with the lost machine
            pass
        self.stop()

    def failure(self, exc: Exception) -> RankError:
        """Name the rank that failed: a spawned rank killed by a signal, else the error a rank left
        in the store, else this rank's own (under torchrun: the lost connection, with its address)."""
        exits = list(self.exit_codes(wait_s=0.5).items())
        for rank, code in exits:
            if code < 0:
                return RankError(rank, "RankDied", f"{exit_reason(code)} mid-step")
        reported = self.channel.rank_error()
        if reported is not None:
            return reported
        if lost_peer(exc) and exits:
            return RankError(exits[0][0], "RankDied", f"{exit_reason(exits[0][1])} mid-step")
        lost = self.silent_ranks() if lost_peer(exc) and not self.processes else []
        if lost:
            also = f" (lost: ranks {', '.join(map(str, lost))})" if len(lost) > 1 else ""
            where = node_of(self.channel.store, lost[0])
            return RankError(lost[0], "RankLost", f"stopped answering mid-step: its process or machine is gone{where}{also}")
        return RankError(0, type(exc).__name__, str(exc).splitlines()[0])

    def silent_ranks(self) -> list[int]:
        """Torchrun ranks whose heartbeat stopped, though they did not stop for a lost peer."""
        store, ranks = self.channel.store, range(1, self.world_size)

        def heartbeats() -> list[bytes | None]:
            return [store.get(key) if store.check([key]) else None for key in map(HEARTBEAT_KEY.format, ranks)]

        try:
            before = heartbeats()
            time.sleep(4 * HEARTBEAT_S)
            after = heartbeats()
            return [r for r, b, a in zip(ranks, before, after) if a == b and not store.check([STOPPED_KEY.format(r)])]
        except RuntimeError:  # the store's host went with them
            return []

    def close(self) -> None:
        if self.dead:
            return
        self.watching.set()  # ranks exiting from here on are the close, not a loss
        if self.lost is not None:  # lost while idle: nobody to say EXIT to
            self.stop_after_loss()
            return
        try:
            if self.processes:
                self.channel.header(EXIT)
            else:
                self.guarded(self.broadcast_call, "close", ())
        finally:
            self.dead = True
            self.stop()

    def stop(self) -> None:
        """Spawned ranks: wait for them (kill what does not exit), then leave their world."""
        self.host.close()
        if self.restore is None:
            return
        # After a loss the survivors may wait on rank 0 for ever: a short grace, then they are killed.
        deadline = time.monotonic() + (LOSS_GRACE_S if self.lost is not None else 10)
        with self.reap_lock:
            for p in self.processes:
                p.join(timeout=max(deadline - time.monotonic(), 0))
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
        state.leave_distributed()
        torch.set_num_threads(self.restore)
        self.restore = None


def _spawned_main(rank: int, world_size: int, store_port: int, threads: int, parent_pid: int) -> None:
    start_spawned_rank(rank, world_size, store_port, threads, parent_pid)
    serve_forever(Channel())
    state.leave_distributed()


def torchrun_channel() -> Channel:
    """This torchrun rank's channel, joining the world the first time."""
    global _channel
    if _channel is None:
        if not dist.is_initialized():
            state.init_from_env()
        _channel = Channel()
    return _channel


def serve_torchrun() -> None:
    """A torchrun rank other than 0: serve the driver's engines until it exits."""
    channel, done = torchrun_channel(), threading.Event()
    where = f"node {os.environ.get('GROUP_RANK', '?')}, host {socket.gethostname()}"
    channel.store.set(NODE_KEY.format(dist.get_rank()), where)
    heart = threading.Thread(target=beat, args=(channel.store, dist.get_rank(), done), daemon=True)
    heart.start()
    try:
        serve_forever(channel)
    finally:
        # a store call still running at interpreter exit aborts the process (std::terminate)
        done.set()
        heart.join(timeout=4 * HEARTBEAT_S)
    state.leave_distributed()


def release_torchrun() -> None:
    """On torchrun's rank 0, when the command is done (or failed before any engine started): let the
    headless ranks exit. After a failed step they are already going."""
    global _channel
    if not _channel_failed:
        torchrun_channel().header(EXIT)
        state.leave_distributed()
    _channel = None
