"""The engine core in a process of its own, behind an API server (`in_engine_process`).

The API server's process checks and tokenizes requests (moeshard.engine.inputs, no weights) and
streams the answers; the engine process holds the LLM (rank 0's worker, and the other ranks it
spawns) and its EngineLoop. Between them one pipe carries small messages, pickled:
  to the engine: ("add", request_id, token ids, params, cache salt), ("abort", request_id),
    ("call", call_id, LLM method name, args), ("close",);
  to the server: ("ready",) or ("error", reason) once, then ("deliver", deltas) once a step,
    ("refuse", request_id, reason), ("resolve", call_id, ok, value, readiness), ("fail", reason).
Errors cross as ValueError or RuntimeError with their message (so the routes answer 400 or 409 as
in one process), anything else as a RuntimeError naming its type.

The engine process ends with its server, even one killed outright (it watches its parent), and
its ranks end with it; a server whose engine process dies learns it from the closed pipe.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from moeshard.bundled.arithmetic import MODEL_DIR
from moeshard.commandline import LOG_FORMAT
from moeshard.engine.async_llm import AsyncLLM, EngineLoop, Readiness, Sink
from moeshard.engine.core import RequestDelta
from moeshard.engine.inputs import Inputs
from moeshard.engine.llm import LLM, checked_layout
from moeshard.parallel.launch import exit_with_parent


def in_engine_process(**llm_options) -> AsyncLLM:
    """An AsyncLLM whose loop and LLM(**llm_options) run in an engine process of their own; returns
    once the engine is up (an engine that cannot start raises here, with its reason)."""
    return AsyncLLM(inputs_of(llm_options), lambda sink: EngineProcess(llm_options, sink))


def inputs_of(llm_options: dict) -> Inputs:
    """What the API server checks requests against: the engine's, read from the same options (the
    LLM's defaults for those not given), whose layout is checked here, before the engine process starts."""
    options = inspect.signature(LLM).bind(**llm_options)
    options.apply_defaults()
    given = options.arguments
    model = given["model"]
    inputs = Inputs(
        Path(model) if model is not None else MODEL_DIR, given["max_model_len"], given["max_num_seqs"],
        given["num_kv_blocks"], given["block_size"],
    )
    checked_layout(inputs.config, **given)
    return inputs


def portable(error: BaseException) -> Exception:
    """`error` as an exception any process can unpickle, keeping what the routes map to a status."""
    for kind in (ValueError, RuntimeError):
        if isinstance(error, kind):
            return kind(str(error))
    return RuntimeError(f"{type(error).__name__}: {error}")


class PipeSink:
    """An EngineLoop's reports, sent to the API server."""

    def __init__(self, conn):
        self.conn, self.lock = conn, threading.Lock()

    def send(self, *message) -> None:
        with self.lock:
            self.conn.send(message)

    def deliver(self, deltas: list[RequestDelta]) -> None:
        self.send("deliver", deltas)

    def refuse(self, request_id: int, message: str) -> None:
        self.send("refuse", request_id, message)

    def resolve(self, call_id: int, ok: bool, value: Any, readiness: Readiness) -> None:
        self.send("resolve", call_id, ok, value if ok else portable(value), readiness)

    def fail(self, error: BaseException) -> None:
        self.send("fail", str(error))


def engine_main(conn, llm_options: dict, parent_pid: int) -> None:
    exit_with_parent(parent_pid)
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)

    try:
        llm = LLM(**llm_options)
    except Exception as exc:
        conn.send(("error", str(exc)))
        return
    loop = EngineLoop(llm, PipeSink(conn))
    conn.send(("ready",))
    while True:
        try:
            kind, *args = conn.recv()
        except EOFError:  # the server is gone
            break
        if kind == "close":
            break
        getattr(loop, kind)(*args)
    loop.close(timeout=30.0)


class EngineProcess:
    """The API server's handle on its engine process: EngineLoop's calls, sent down the pipe, and a
    thread that hands what comes back to `sink`."""

    def __init__(self, llm_options: dict, sink: Sink):
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.sink, self.send_lock, self.closing = sink, threading.Lock(), False
        self.process = ctx.Process(target=engine_main, args=(child_conn, llm_options, os.getpid()), name="moeshard-engine")
        self.process.start()
        child_conn.close()
        try:
            first = self.conn.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(f"the engine process exited with code {self.process.exitcode} before it started.") from None
        if first[0] == "error":
            self.process.join(30)
            raise RuntimeError(first[1])
        self.reader = threading.Thread(target=self.read, name="moeshard-engine-reader", daemon=True)
        self.reader.start()

    def add(self, request_id: int, ids: list[int], params, cache_salt: str | None) -> None:
        self.send("add", request_id, ids, params, cache_salt)

    def abort(self, request_id: int) -> None:
        self.send("abort", request_id)

    def call(self, call_id: int, method: str, args: tuple) -> None:
        self.send("call", call_id, method, args)

    def send(self, *message) -> None:
        with self.send_lock:
            try:
                self.conn.send(message)
            except OSError:  # the engine process is gone; the reader reports it
                pass

    def read(self) -> None:
        while True:
            try:
                kind, *args = self.conn.recv()
            except (EOFError, OSError):
                if not self.closing:
                    self.process.join(5)
                    self.sink.fail(RuntimeError(f"the engine process exited with code {self.process.exitcode}"))
                return
            if kind == "fail":
                self.sink.fail(RuntimeError(args[0]))
            else:
                getattr(self.sink, kind)(*args)

    def close(self, timeout: float) -> None:
        self.closing = True
        self.send("close")
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.conn.close()
