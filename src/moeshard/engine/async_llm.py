"""`AsyncLLM`: requests that join while others run, each streamed back as it is generated.

One background thread owns the engine core: it applies the requests and aborts that arrived since
the last step, steps while any request is live, and hands every delta to its request's asyncio
queue. A consumer that stops listening (cancelled, or the stream closed early) aborts its request,
which frees its KV blocks before the next step.

    engine = AsyncLLM(LLM(tensor_parallel_size=2, enable_expert_parallel=True))
    async for delta in engine.generate("123+456=", SamplingParams(temperature=0)):
        print(delta.text, end="")
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from moeshard.engine.core import RequestDelta
from moeshard.engine.llm import LLM
from moeshard.engine.sampling import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine's loop stopped on an error (a rank failed); no request can be served."""


class EngineAsleepError(RuntimeError):
    """The engine went to sleep between a request's check and its admission; it was not run."""


class AsyncLLM:
    def __init__(self, llm: LLM):
        self.llm, self.core = llm, llm.core
        self.ids = itertools.count()
        self.lock = threading.Condition()
        self.adds: list[tuple[int, list[int], SamplingParams, asyncio.Queue, asyncio.AbstractEventLoop]] = []
        self.aborts: list[int] = []
        self.calls: list[tuple[Callable[[], Any], asyncio.Future, asyncio.AbstractEventLoop]] = []
        self.streams: dict[int, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self.error: BaseException | None = None
        self.failed = threading.Event()  # set with `error`: the engine is lost for good
        self.lost: BaseException | None = None  # a rank lost while the loop may be idle
        self.closing = False
        self.thread = threading.Thread(target=self.loop, name="moeshard-engine", daemon=True)
        self.thread.start()
        llm.on_rank_lost(self.notice_loss)

    def notice_loss(self, error: BaseException) -> None:
        """A rank is gone (the ranks' watch says so): the loop ends every request now, not at its next step."""
        with self.lock:
            self.lost = error
            self.lock.notify()

    async def generate(
        self, prompt: str | list[int], params: SamplingParams | dict | None = None, request_id: int | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """The request's deltas as they are generated, the last with `finished`. A bad request raises
        ValueError before anything is queued; leaving the loop early aborts the request. `cache_salt`:
        only requests with the same salt share prefix-cache blocks."""
        ids, params = self.llm.check_request(prompt, params or SamplingParams())
        self.llm.check_ready()
        request_id = next(self.ids) if request_id is None else request_id
        queue: asyncio.Queue = asyncio.Queue()
        with self.lock:
            self.raise_if_dead()
            self.adds.append((request_id, ids, params, cache_salt, queue, asyncio.get_running_loop()))
            self.lock.notify()
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
        with self.lock:
            self.aborts.append(request_id)
            self.lock.notify()

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` on the engine's thread between two steps (sleep, wake, weight updates) and return its result."""
        future = asyncio.get_running_loop().create_future()
        with self.lock:
            self.raise_if_dead()
            self.calls.append((fn, future, asyncio.get_running_loop()))
            self.lock.notify()
        return await future

    def num_unfinished(self) -> int:
        with self.lock:
            return len(self.streams) + len(self.adds)

    def raise_if_dead(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error}")
        if self.closing:
            raise EngineDeadError("the engine is shutting down.")

    def loop(self) -> None:
        while True:
            with self.lock:
                while not (self.adds or self.aborts or self.calls or self.streams or self.closing or self.lost):
                    self.lock.wait()
                lost = self.lost
                if self.closing and not self.streams and not self.adds and lost is None:
                    return
                adds, self.adds = self.adds, []
                aborts, self.aborts = self.aborts, []
                calls, self.calls = self.calls, []
            if lost is not None:  # put back what was taken: fail() ends it all
                with self.lock:
                    self.adds, self.calls = adds + self.adds, calls + self.calls
                self.fail(lost)
                return
            try:
                self.apply(adds, aborts, calls)
                if self.core.has_unfinished:
                    self.deliver(self.core.step())
            except BaseException as exc:  # a failed rank: every live stream hears it, later calls refuse
                self.fail(exc)
                return

    def apply(self, adds, aborts, calls) -> None:
        for request_id, ids, params, cache_salt, queue, loop in adds:
            try:
                self.llm.check_ready()  # a sleep may have run since generate() checked
            except RuntimeError as exc:
                loop.call_soon_threadsafe(queue.put_nowait, EngineAsleepError(str(exc)))
                continue
            self.streams[self.core.add_request(ids, params, request_id, cache_salt)] = (queue, loop)
        for request_id in aborts:
            self.core.abort(request_id)
        for fn, future, loop in calls:
            try:
                result = fn()
            except Exception as exc:
                loop.call_soon_threadsafe(future.set_exception, exc)
            else:
                loop.call_soon_threadsafe(future.set_result, result)

    def deliver(self, deltas: list[RequestDelta]) -> None:
        """Hand a step's deltas over: one wake-up of each event loop per step, not one per request."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestDelta]]] = {}
        for delta in deltas:
            queue, loop = self.streams[delta.request_id] if not delta.finished else self.streams.pop(delta.request_id)
            by_loop.setdefault(loop, []).append((queue, delta))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(put_all, items)

    def fail(self, exc: BaseException) -> None:
        with self.lock:
            self.error = exc
            self.failed.set()
            pending = list(self.streams.values()) + [(queue, loop) for _, _, _, queue, loop in self.adds]
            calls, self.calls = self.calls, []
            self.streams.clear()
            self.adds.clear()
        for queue, loop in pending:
            loop.call_soon_threadsafe(queue.put_nowait, exc)
        for _, future, loop in calls:
            loop.call_soon_threadsafe(future.set_exception, EngineDeadError(f"the engine stopped: {exc}"))

    def close(self, timeout: float = 30.0) -> None:
        """Abort what is in flight, stop the loop thread and close the engine."""
        with self.lock:
            self.closing = True
            self.aborts += list(self.streams) + [request_id for request_id, *_ in self.adds]
            self.lock.notify()
        self.thread.join(timeout)
        self.llm.close()


def put_all(items: list[tuple[asyncio.Queue, RequestDelta]]) -> None:
    for queue, delta in items:
        queue.put_nowait(delta)
