"""A server as a child process of this one: `moeshard serve` (the engine of `moeshard rl
--disaggregated`, the server `moeshard bench serve` measures) or a peer server, on a free
127.0.0.1 port, waited for until healthy, and stopped by PID with every process it started. The
tests take their ports and process trees from here too.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

START_TIMEOUT_S = 600
STOP_GRACE_S = 20


def free_port() -> int:
    """A free port below Linux's ephemeral range (32768 and up). A port from bind(0) is an ephemeral
    one, which the kernel may hand to another process's socket (a gloo or c10d listener of the
    engine's ranks) before the server binds it: the server then cannot bind, and a client probing
    the port meets that socket (seen once in CI: the first /health reset by peer)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port between 20000 and 32767 on 127.0.0.1.")


def process_tree(root: int) -> list[int]:
    """root and its descendants (a server's engine ranks may be processes of their own)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, rest = stat.read_text().split(" ", 1)
        except OSError:
            continue  # exited while we looked
        parents[int(pid)] = int(rest.rsplit(")", 1)[1].split()[1])
    tree = [root]
    for pid in tree:
        tree += [child for child, parent in parents.items() if parent == pid]
    return tree


def serve_command(model_dir: str, port: int, max_num_seqs: int, dtype: str, extra: tuple[str, ...] = ()) -> list[str]:
    """`moeshard serve` of `model_dir` on 127.0.0.1:`port`, in this Python, with the `extra` arguments."""
    return [sys.executable, "-m", "moeshard", "serve", "--model", model_dir, "--host", "127.0.0.1",
            "--port", str(port), "--max-num-seqs", str(max_num_seqs), "--dtype", dtype, *extra]


@contextmanager
def running(kind: str, command: list[str], env: dict[str, str], port: int, log_path: Path) -> Iterator[subprocess.Popen]:
    """`command`, a server listening on 127.0.0.1:`port` (`kind` in errors), from its first healthy
    answer until the block ends; its output goes to `log_path`."""
    with open(log_path, "w") as log:
        # its own session: a Ctrl-C in the terminal reaches only us, and we stop it (and its group) below
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, log_path, kind)
        yield proc
    finally:
        stop(proc)


def wait_healthy(base: str, proc: subprocess.Popen, log_path: Path, kind: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text()[-2000:]
            raise RuntimeError(f"{kind} serve exited with code {proc.returncode} before it was healthy:\n{tail}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{kind} serve was not healthy within {START_TIMEOUT_S} s (log: {log_path})")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (each server shuts down cleanly on it), then SIGKILL to whatever of its tree and its
    process group (vLLM's engine core, multiprocessing helpers) is left — the kill even when a second
    Ctrl-C cuts the grace period short."""
    children = process_tree(proc.pid)[1:]  # now: once the server exits they are no longer its children
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    finally:
        proc.kill()  # no-op once it has exited (and been reaped)
        proc.wait()
        kill(children)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session, so its group's id is its PID
        except (ProcessLookupError, PermissionError):
            pass


def kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
