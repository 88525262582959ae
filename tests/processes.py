"""Processes a test starts, and stops by PID: free 127.0.0.1 ports, process trees, waiting for a port."""

import os
import signal
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_listening(port: int, proc: subprocess.Popen, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not listening(port):
        assert proc.poll() is None, f"{what} exited with code {proc.returncode} before listening"
        assert time.monotonic() < deadline, f"{what} did not listen on port {port} within {timeout_s} s"
        time.sleep(0.2)


def process_tree(root: int) -> list[int]:
    """root and its descendants: torchrun starts each rank in a session of its own, so killing the
    launcher's process group would leave its ranks running."""
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


def kill_tree(proc: subprocess.Popen) -> None:
    for pid in process_tree(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


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
    for pid in filter(alive, tree[1:]):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return code, left
