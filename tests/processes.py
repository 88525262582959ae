"""Processes a test starts, and stops by PID: free 127.0.0.1 ports, process trees, waiting for a port."""

import signal
import socket
import subprocess
import time
from pathlib import Path

from moeshard.serve.launcher import free_port, kill, process_tree  # noqa: F401 (tests import them from here)


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_listening(port: int, proc: subprocess.Popen, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not listening(port):
        assert proc.poll() is None, f"{what} exited with code {proc.returncode} before listening"
        assert time.monotonic() < deadline, f"{what} did not listen on port {port} within {timeout_s} s"
        time.sleep(0.2)


def kill_tree(proc: subprocess.Popen) -> None:
    kill(process_tree(proc.pid))


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "(gone)"


def stop_tree(proc: subprocess.Popen, timeout_s: float, sig: int = signal.SIGTERM) -> tuple[int | None, list[str]]:
    """Signal `proc`; wait up to `timeout_s` for it to exit. Returns its exit code (None if it did
    not exit) and the processes of its tree still alive after it, which are then killed."""
    tree = process_tree(proc.pid)
    proc.send_signal(sig)
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    deadline = time.monotonic() + 5  # children exiting with their parent (multiprocessing's resource tracker)
    while (left := [pid for pid in tree[1:] if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [f"{pid}: {command_line(pid)}" for pid in left]
    if code is None:
        kill_tree(proc)
    kill(list(filter(alive, tree[1:])))
    return code, left
