"""`AsyncLLM`: requests that join while others run, each streamed back as it is generated.

One thread owns the engine core, the `EngineLoop`: it applies the requests, aborts and control
calls that arrived since the last step, steps while any request is live, and reports each step's
deltas to its sink. `AsyncLLM` is the sink on the asyncio side: every delta goes to its request's
queue, with one wake-up of each event loop per step. The loop runs in the caller's process
(`AsyncLLM.in_process`) or in an engine process of its own (`in_engine_process` of
moeshard.engine.engine_process), where a forward never waits for the GIL behind HTTP and JSON: the
split of vLLM's API server and engine core. Both take the same calls and report the same events;
a control call names a method of the LLM, so that it can cross the process boundary.

A consumer that stops listening (cancelled, or the stream closed early) aborts its request, which
frees its KV blocks before the next step.

    engine = AsyncLLM.in_process(LLM(tensor_parallel_size=2, enable_expert_parallel=True))
    async for delta in engine.generate("123+456=", SamplingParams(temperature=0)):
        print(delta.text, end="")
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from moeshard.engine.core import RequestDelta
from moeshard.engine.inputs import Inputs
from moeshard.engine.sampling import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine's loop stopped on an error (a rank failed); no request can be served."""


class EngineAsleepError(RuntimeError):
    """The engine went to sleep between a request's check and its admission; it was not run."""


@dataclass(frozen=True)
class Readiness:
    """The engine's state after a control call, mirrored where requests are checked."""

    is_sleeping: bool = False
    not_ready: str | None = None  # why no request can run now
    paused: str | None = None  # the pause_generation mode in force: abort, wait or keep


class Sink(Protocol):
    """Where an EngineLoop reports, from its thread."""

    def deliver(self, deltas: list[RequestDelta]) -> None: ...
    def refuse(self, request_id: int, message: str) -> None: ...  # asleep at admission
    def resolve(self, call_id: int, ok: bool, value: Any, readiness: Readiness) -> None: ...
    def fail(self, error: BaseException) -> None: ...  # the engine is lost for good


PAUSE_MODES = ("abort", "wait", "keep")


class EngineLoop:
    """The thread that owns `llm.core`; everything else reaches the core through it.

    Control calls name a method of the LLM, run between two steps, except the loop's own two:
    `pause_generation(mode)` stops stepping (abort: requests in flight end with reason "abort";
    wait: they finish first, and the call returns once they have; keep: they stay parked with their
    KV blocks) and `continue_generation()` resumes. Requests that arrive during a pause are held,
    and admitted by the continue.
    """

    def __init__(self, llm, sink: Sink):
        self.llm, self.core, self.sink = llm, llm.core, sink
        self.lock = threading.Condition()
        self.adds: list[tuple[int, list[int], SamplingParams, str | None]] = []
        self.aborts: list[int] = []
        self.calls: list[tuple[int, str, tuple]] = []
        self.lost: BaseException | None = None  # a rank lost while the loop may be idle
        self.closing = False
        self.draining: int | None = None  # the call id of a pause(mode=wait) whose requests still run
        self.held: list[tuple[int, list[int], SamplingParams, str | None]] = []  # arrived during a pause
        llm.on_rank_lost(self.notice_loss)
        self.thread = threading.Thread(target=self.run, name="moeshard-engine", daemon=True)
        self.thread.start()

    def add(self, request_id: int, ids: list[int], params: SamplingParams, cache_salt: str | None) -> None:
        self.put(self.adds, (request_id, ids, params, cache_salt))

    def abort(self, request_id: int) -> None:
        self.put(self.aborts, request_id)

    def call(self, call_id: int, method: str, args: tuple) -> None:
        self.put(self.calls, (call_id, method, args))

    @property
    def paused(self) -> str | None:
        """The pause mode in force; the core keeps it, so that an update knows its requests are parked."""
        return self.core.paused

    @paused.setter
    def paused(self, mode: str | None) -> None:
        self.core.paused = mode

    def put(self, queue: list, item) -> None:
        with self.lock:
            queue.append(item)
            self.lock.notify()

    def notice_loss(self, error: BaseException) -> None:
        """A rank is gone (the ranks' watch says so): end every request now, not at the next step."""
        with self.lock:
            self.lost = error
            self.lock.notify()

    def close(self, timeout: float) -> None:
        """Abort what is in flight, stop the thread and close the engine."""
        with self.lock:
            self.closing = True
            self.lock.notify()
        self.thread.join(timeout)
        self.llm.close()

    def run(self) -> None:
        try:
            while True:
                adds, aborts, calls, closing = self.take()
                self.apply(adds, aborts, calls)
                if closing:
                    self.paused = None
                    self.abort_held()
                    for request_id in self.core.live_request_ids():
                        self.core.abort(request_id)
                if self.core.has_unfinished:
                    self.sink.deliver(self.core.take_finished() if self.paused else self.core.step())
                if self.draining is not None and not self.core.live_request_ids():  # pause(mode=wait) takes effect
                    self.paused, call_id, self.draining = "wait", self.draining, None
                    self.resolve(call_id, True, None)
                if closing and not self.core.has_unfinished:
                    return
        except BaseException as exc:  # a failed rank: the sink ends every request and call
            self.sink.fail(exc)

    def has_work(self) -> bool:
        """Anything for the loop to do without a new message: a step to run, or aborts to report."""
        return self.core.has_unfinished and not (self.paused and not self.core.finished)

    def take(self):
        with self.lock:
            while not (self.adds or self.aborts or self.calls or self.closing or self.lost or self.has_work()):
                self.lock.wait()
            if self.lost is not None:
                raise self.lost
            taken = self.adds, self.aborts, self.calls, self.closing
            self.adds, self.aborts, self.calls = [], [], []
            return taken

    def apply(self, adds, aborts, calls) -> None:
        if self.paused or self.draining is not None:
            self.held += adds
        else:
            self.admit(adds)
        for request_id in aborts:
            self.core.abort(request_id)
            self.abort_held(request_id)
        for call_id, method, args in calls:
            if method in ("pause_generation", "continue_generation"):
                getattr(self, method)(call_id, *args)
                continue
            try:
                ok, value = True, getattr(self.llm, method)(*args)
            except Exception as exc:
                ok, value = False, exc
            self.resolve(call_id, ok, value)

    def admit(self, adds) -> None:
        for request_id, ids, params, cache_salt in adds:
            if (reason := self.llm.not_ready()) is not None:  # a sleep may have run since the request's check
                self.sink.refuse(request_id, reason)
                continue
            self.core.add_request(ids, params, request_id, cache_salt)

    def abort_held(self, request_id: int | None = None) -> None:
        """End held requests (`request_id`, or all) before they ever ran."""
        ended = [add[0] for add in self.held if request_id in (None, add[0])]
        self.held = [add for add in self.held if add[0] not in ended]
        if ended:
            self.sink.deliver([RequestDelta(rid, finished=True, finish_reason="abort") for rid in ended])

    def resolve(self, call_id: int, ok: bool, value) -> None:
        readiness = Readiness(self.llm.is_sleeping, self.llm.not_ready(), self.paused)
        self.sink.resolve(call_id, ok, value, readiness)

    def pause_generation(self, call_id: int, mode: str = "abort") -> None:
        if mode not in PAUSE_MODES:
            return self.resolve(call_id, False, ValueError(f"mode must be abort, wait or keep, got {mode!r}."))
        if mode == "abort":
            for request_id in self.core.live_request_ids():
                self.core.abort(request_id)
        if mode == "wait" and self.core.live_request_ids():
            self.draining = call_id  # `run` settles the call once they have finished
            return
        self.paused = mode
        self.resolve(call_id, True, None)

    def continue_generation(self, call_id: int) -> None:
        if self.draining is not None:  # a pause still waiting for its requests is called off
            self.resolve(self.draining, False, RuntimeError("continue_generation was called before the pause took effect."))
        self.paused = self.draining = None
        held, self.held = self.held, []
        self.admit(held)
        self.resolve(call_id, True, None)


class AsyncLLM:
    """`inputs` checks and tokenizes requests here; `start(sink)` starts the loop that runs them."""

    def __init__(self, inputs: Inputs, start):
        self.inputs = inputs
        self.ids, self.call_ids = itertools.count(), itertools.count()
        self.lock = threading.Lock()
        self.streams: dict[int, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self.pending_calls: dict[int, tuple[asyncio.Future, asyncio.AbstractEventLoop]] = {}
        self.readiness = Readiness()
        self.error: BaseException | None = None
        self.failed = threading.Event()  # set with `error`: the engine is lost for good
        self.closing = False
        self.backend = start(self)

    @classmethod
    def in_process(cls, llm) -> "AsyncLLM":
        """The loop in a thread of this process, over `llm` (an LLM)."""
        return cls(llm, lambda sink: EngineLoop(llm, sink))

    # --- the asyncio side -----------------------------------------------------------------------

    async def generate(
        self, prompt: str | list[int], params: SamplingParams | dict | None = None, request_id: int | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """The request's deltas as they are generated, the last with `finished`. A bad request raises
        ValueError before anything is queued; leaving the loop early aborts the request. `cache_salt`:
        only requests with the same salt share prefix-cache blocks."""
        ids, params = self.inputs.check_request(prompt, params or SamplingParams())
        self.check_ready()
        request_id = next(self.ids) if request_id is None else request_id
        queue: asyncio.Queue = asyncio.Queue()
        with self.lock:
            self.raise_if_dead()
            self.streams[request_id] = (queue, asyncio.get_running_loop())
        self.backend.add(request_id, ids, params, cache_salt)
        finished = False
        try:
            while not finished:
                delta = await queue.get()
                if isinstance(delta, EngineAsleepError):
                    raise delta
                if isinstance(delta, BaseException):
                    raise EngineDeadError(f"the engine stopped: {delta}") from delta
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: int) -> None:
        """End a request (reason "abort"); its blocks are free before the next step."""
        self.backend.abort(request_id)

    async def call(self, method: str, *args) -> Any:
        """Run the LLM's `method(*args)` between two steps (sleep, wake, weight updates, stats) and
        return its result."""
        call_id, future = next(self.call_ids), asyncio.get_running_loop().create_future()
        with self.lock:
            self.raise_if_dead()
            self.pending_calls[call_id] = (future, asyncio.get_running_loop())
        self.backend.call(call_id, method, args)
        return await future

    def check_ready(self) -> None:
        if self.readiness.not_ready is not None:
            raise RuntimeError(self.readiness.not_ready)

    @property
    def is_sleeping(self) -> bool:
        return self.readiness.is_sleeping

    def num_unfinished(self) -> int:
        with self.lock:
            return len(self.streams)

    def raise_if_dead(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error}")
        if self.closing:
            raise EngineDeadError("the engine is shutting down.")

    def close(self, timeout: float = 30.0) -> None:
        """Abort what is in flight, stop the loop and close the engine."""
        self.closing = True
        self.backend.close(timeout)

    # --- the sink: called from the loop's thread ------------------------------------------------

    def deliver(self, deltas: list[RequestDelta]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestDelta]]] = {}
        with self.lock:
            for delta in deltas:
                queue, loop = self.streams.pop(delta.request_id) if delta.finished else self.streams[delta.request_id]
                by_loop.setdefault(loop, []).append((queue, delta))
        for loop, items in by_loop.items():
            post(loop, put_all, items)

    def refuse(self, request_id: int, message: str) -> None:
        with self.lock:
            queue, loop = self.streams.pop(request_id)
        post(loop, queue.put_nowait, EngineAsleepError(message))

    def resolve(self, call_id: int, ok: bool, value: Any, readiness: Readiness) -> None:
        with self.lock:
            self.readiness = readiness
            future, loop = self.pending_calls.pop(call_id)
        post(loop, settle, future, ok, value)

    def fail(self, error: BaseException) -> None:
        with self.lock:
            self.error = error
            self.failed.set()
            streams, self.streams = list(self.streams.values()), {}
            calls, self.pending_calls = list(self.pending_calls.values()), {}
        for queue, loop in streams:
            post(loop, queue.put_nowait, error)
        for future, loop in calls:
            post(loop, settle, future, False, EngineDeadError(f"the engine stopped: {error}"))


def post(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """Run `fn(*args)` on `loop`, unless it has closed (a server that stopped while the engine ends)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def put_all(items: list[tuple[asyncio.Queue, RequestDelta]]) -> None:
    for queue, delta in items:
        queue.put_nowait(delta)


def settle(future: asyncio.Future, ok: bool, value: Any) -> None:
    if not future.done():  # its caller may have gone (a client that disconnected)
        future.set_result(value) if ok else future.set_exception(value)
