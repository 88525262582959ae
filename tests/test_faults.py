"""Faults and bad input as a supervisor meets them (docs/serving.md, "Faults"): a rank lost while the
server is idle or streaming, the engine's process or the server itself killed, an offline engine losing a rank between two
calls, bodies far over the limit while other clients are served, and a soak. Every process is
started here and stopped by PID; the server's temp folder is its own, and must be empty at the end."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from processes import alive, free_port, kill, process_tree, stop_tree, wait_listening

from moeshard.bench.servers import resident_mb
from moeshard.bundled.arithmetic import held_out
from moeshard.engine import LLM, SamplingParams
from moeshard.parallel.launch import RankError

pytestmark = pytest.mark.xdist_group("faults")

PROBLEMS = held_out(8)
HEALTH_BOUND_S, EXIT_BOUND_S = 10, 30  # the bounds: /health turns, the process is gone
FLOOD_S = float(os.environ.get("MOESHARD_TEST_FLOOD_S", "10"))  # 30 for the figure quoted in the docs
# A blocked event loop answers nothing for minutes (a 30 MB prompt once did); a loaded 2-core CI
# machine delays a probe by seconds. The docs' figure (every probe under 1 s) is measured alone.
BLOCKED_S = 10


class Server:
    """`moeshard serve` in its own session, with a temp folder of its own."""

    def __init__(self, tmp_path: Path, *args: str):
        self.tmp = tmp_path / "server-tmp"
        self.tmp.mkdir()
        self.port, self.log = free_port(), tmp_path / "serve.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(self.tmp)}
        command = [sys.executable, "-m", "moeshard", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(command, env=env, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        wait_listening(self.port, self.proc, 300, f"moeshard serve {' '.join(args)}")
        self.url = f"http://127.0.0.1:{self.port}"
        self.tree = process_tree(self.proc.pid)

    def spawned(self) -> list[int]:
        """multiprocessing's spawned children, at any depth (not its resource trackers)."""
        return [pid for pid in self.tree[1:] if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]

    def engine_process(self) -> int:
        """The engine's own process: the server's spawned child."""
        return next(pid for pid in self.spawned() if parent_of(pid) == self.proc.pid)

    def ranks(self) -> list[int]:
        """The spawned rank processes: the children of the server's engine process."""
        spawned = self.spawned()
        return [pid for pid in spawned if parent_of(pid) in spawned]

    def text(self) -> str:
        return self.log.read_text()[-3000:]

    def left_behind(self) -> list[int]:
        deadline = time.monotonic() + 5
        while (left := [pid for pid in self.tree if alive(pid)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left

    def close(self) -> None:
        if self.proc.poll() is None:
            stop_tree(self.proc, timeout_s=5, sig=signal.SIGKILL)
        kill([pid for pid in self.tree if alive(pid)])


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def wait_unhealthy(url: str, bound_s: float) -> httpx.Response:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        try:
            response = httpx.get(url + "/health", timeout=1)
        except httpx.TransportError:  # already gone: unhealthy too
            return httpx.Response(599)
        if response.status_code != 200:
            return response
        time.sleep(0.1)
    raise AssertionError(f"/health still answered 200 {bound_s} s after the loss")


def assert_lost_and_gone(server: Server, t0: float, rank: int) -> None:
    """The loss seen by /health within its bound, the process gone non-zero within its bound, no
    descendant left, the loss logged at error level naming the rank, nothing in the temp folder."""
    response = wait_unhealthy(server.url, HEALTH_BOUND_S)
    if response.status_code == 503:
        assert f"rank {rank}" in response.json()["error"]["message"]
    code = server.proc.wait(timeout=EXIT_BOUND_S)
    assert time.monotonic() - t0 < EXIT_BOUND_S
    assert code != 0, server.text()
    assert server.left_behind() == []
    assert f"ERROR moeshard: the engine lost a rank: rank {rank}: RankDied" in server.text(), server.text()
    assert list(server.tmp.iterdir()) == []


def test_a_rank_lost_while_idle_stops_the_server(tmp_path):
    server = Server(tmp_path, "--dp", "2", "--ep")
    try:
        assert httpx.get(server.url + "/health").status_code == 200
        os.kill(server.ranks()[0], signal.SIGKILL)
        assert_lost_and_gone(server, time.monotonic(), rank=1)
    finally:
        server.close()


def test_a_rank_lost_while_8_clients_stream(tmp_path):
    from moeshard.verify.tiny import make_tiny_checkpoint

    model = make_tiny_checkpoint("qwen3_moe", tmp_path / "tiny")  # no tokenizer: token-id prompts
    server = Server(tmp_path, "--model", str(model), "--dp", "2", "--ep")
    ends: list[str] = []
    first_chunks = threading.Semaphore(0)

    def stream(i: int) -> None:
        body = {"prompt": [1 + i, 2, 3], "max_tokens": 250, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=EXIT_BOUND_S) as response:
                for n, line in enumerate(response.iter_lines()):
                    if n == 0:
                        first_chunks.release()
                    if '"error"' in line:
                        ends.append("error event")
                        return
            ends.append("closed without an error event")
        except httpx.HTTPError as exc:  # a stream cut by the server's exit also ends it, not a hang
            ends.append(f"connection ended: {type(exc).__name__}")

    clients = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    try:
        for c in clients:
            c.start()
        for _ in clients:
            assert first_chunks.acquire(timeout=120), "a stream never started"
        os.kill(server.ranks()[0], signal.SIGKILL)
        t0 = time.monotonic()
        for c in clients:
            c.join(timeout=EXIT_BOUND_S)
        assert not any(c.is_alive() for c in clients), "a stream hung"
        assert ends.count("error event") == 8, ends
        assert_lost_and_gone(server, t0, rank=1)
    finally:
        server.close()


def test_the_engine_process_killed_stops_the_server(tmp_path):
    """The engine's own process dies (OOM killer, SIGKILL) while a stream runs: the stream ends with
    an error, /health turns 503 naming the exit, the server exits 1 and its ranks go with it."""
    from moeshard.verify.tiny import make_tiny_checkpoint

    model = make_tiny_checkpoint("qwen3_moe", tmp_path / "tiny")  # a context of 256: a long stream
    server = Server(tmp_path, "--model", str(model), "--dp", "2", "--ep")
    try:
        ranks = server.ranks()
        body = {"prompt": [1, 2, 3], "max_tokens": 250, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=EXIT_BOUND_S) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # generating
            os.kill(server.engine_process(), signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]" and "the engine process exited with code -9" in rest[-2], rest[-3:]
        response = wait_unhealthy(server.url, HEALTH_BOUND_S)
        assert response.status_code == 599 or "the engine process exited" in response.json()["error"]["message"]
        assert server.proc.wait(timeout=EXIT_BOUND_S) == 1, server.text()
        assert not any(map(alive, ranks)) and server.left_behind() == []
        assert list(server.tmp.iterdir()) == []
    finally:
        server.close()


def test_the_server_killed_outright_takes_its_ranks(tmp_path):
    server = Server(tmp_path, "--dp", "2", "--ep")
    try:
        ranks = server.ranks()
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=10)
        deadline = time.monotonic() + EXIT_BOUND_S
        while any(map(alive, ranks)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(map(alive, ranks))
        assert list(server.tmp.iterdir()) == []  # the rendezvous store is a TCP store: no file to leave
    finally:
        server.close()


def test_offline_engine_names_a_rank_lost_between_calls():
    lost = []
    with LLM(data_parallel_size=2, enable_expert_parallel=True) as llm:
        llm.on_rank_lost(lost.append)
        greedy = SamplingParams(temperature=0)
        assert llm.generate([PROBLEMS[0].prompt], greedy)[0].text == PROBLEMS[0].answer
        os.kill(llm.ranks.processes[0].pid, signal.SIGKILL)
        t0 = time.monotonic()
        while not lost and time.monotonic() - t0 < 5:  # noticed while nothing runs
            time.sleep(0.05)
        assert [str(e) for e in lost] == ["rank 1: RankDied: process killed by signal 9"]
        with pytest.raises(RankError, match="rank 1: RankDied: process killed by signal 9"):
            llm.generate([PROBLEMS[1].prompt], greedy)
        assert time.monotonic() - t0 < EXIT_BOUND_S
        with pytest.raises(RuntimeError, match="stopped after an earlier failure .*rank 1"):
            llm.generate([PROBLEMS[1].prompt], greedy)


def test_huge_bodies_are_refused_at_once_while_others_are_served(tmp_path):
    """30 MB → 413 at once; then 4 clients send 1 MB and 30 MB bodies in a loop while /health is
    probed (every probe answered, none held up as a blocked event loop would) and good requests run
    beside them, all correct, in less than twice the idle memory."""
    server = Server(tmp_path)
    huge = json.dumps({"prompt": "7" * 30_000_000}).encode()
    one_mb = json.dumps({"prompt": "7" * 1_000_000}).encode()
    headers = {"content-type": "application/json"}
    try:
        idle_mb = resident_mb(server.proc.pid)
        t0 = time.monotonic()
        response = httpx.post(server.url + "/v1/completions", content=huge, headers=headers, timeout=10)
        refused_s = time.monotonic() - t0
        assert (response.status_code, refused_s < BLOCKED_S) == (413, True), refused_s
        assert "--max-request-bytes" in response.json()["error"]["message"]
        stop, statuses, probes, answers, peak_mb = threading.Event(), [], [], [], [idle_mb]

        def flood(body: bytes) -> None:
            with httpx.Client(timeout=30) as c:
                while not stop.is_set():
                    statuses.append(c.post(server.url + "/v1/completions", content=body, headers=headers).status_code)

        def probe() -> None:
            while not stop.is_set():
                start = time.monotonic()
                code = httpx.get(server.url + "/health", timeout=5).status_code
                probes.append((code, time.monotonic() - start))
                peak_mb.append(resident_mb(server.proc.pid))
                time.sleep(0.2)

        def good() -> None:
            while not stop.is_set():
                p = PROBLEMS[len(answers) % len(PROBLEMS)]
                body = {"prompt": p.prompt, "max_tokens": 6, "temperature": 0}
                text = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]
                answers.append(text == p.answer)

        threads = [threading.Thread(target=f, args=a) for f, a in
                   [(flood, (huge,)), (flood, (huge,)), (flood, (one_mb,)), (flood, (one_mb,)), (probe, ()), (good, ())]]
        for t in threads:
            t.start()
        time.sleep(FLOOD_S)
        stop.set()
        for t in threads:
            t.join(timeout=60)
        assert set(statuses) == {400, 413}, set(statuses)  # 1 MB: within the limit, over the context
        assert probes and all(code == 200 for code, _ in probes), probes
        slowest = max(seconds for _, seconds in probes)
        assert slowest < BLOCKED_S, slowest
        assert answers and all(answers)
        assert max(peak_mb) < 2 * idle_mb, (idle_mb, max(peak_mb))
        print(f"30 MB refused in {refused_s:.2f} s; flood {FLOOD_S:g} s: {len(statuses)} huge bodies refused, "
              f"{len(probes)} probes (slowest {slowest * 1000:.0f} ms), {len(answers)} good answers, PSS {idle_mb:.0f} → "
              f"peak {max(peak_mb):.0f} MiB")
    finally:
        stop_tree(server.proc, timeout_s=30)


def test_a_short_soak(tmp_path):
    """`moeshard bench soak` for 20 s (the figure in the docs is its 3-minute default)."""
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "-m", "moeshard", "bench", "soak", "--minutes", "0.33", "--json", str(out)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["failures"] == [] and result["good"] > 0 and result["disconnected"] > 0
    assert sum(result["bad_answered_as_expected"].values()) > 0
