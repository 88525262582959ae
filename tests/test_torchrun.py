"""One engine over two torchrun "nodes" on this machine (c10d rendezvous on 127.0.0.1, 2 ranks each):
rank 0 drives and writes the JSON, the others serve it headless; the result equals the spawned-rank
run and the one-rank engine. Killing one node's launcher stops the other, non-zero, within the bound."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from processes import free_port, kill_tree, listening

pytestmark = pytest.mark.xdist_group("torchrun")  # four ranks: alone on the machine's two cores

EVAL = ["eval", "--layouts", "2x2-ep", "--concurrency", "1,16", "-n", "32"]  # c = 16: two full batches
TIMEOUT_S = 25  # MOESHARD_COLLECTIVE_TIMEOUT_S below: the failure bound
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "MOESHARD_COLLECTIVE_TIMEOUT_S": str(TIMEOUT_S)}


def launch(node_rank: int, port: int, args: list[str], cwd: Path) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
        "--node-rank", str(node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", f"moeshard-test-{port}", "--local-addr", "127.0.0.1", "--max-restarts", "0",
        "-m", "moeshard", *args,
    ]  # fmt: skip
    log = open(cwd / f"node{node_rank}.log", "w")
    return subprocess.Popen(command, cwd=cwd, env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def launch_both(procs: list, port: int, args: list[str], cwd: Path, ready, what: str) -> None:
    """Node 0 (it hosts the rendezvous), then node 1, into `procs` (the caller stops them), then
    wait until `ready()` says the job runs."""
    procs.append(launch(0, port, args, cwd))
    deadline = time.monotonic() + 600
    while not listening(port):
        assert time.monotonic() < deadline and procs[0].poll() is None, "the rendezvous never started"
        time.sleep(0.2)
    procs.append(launch(1, port, args, cwd))
    while not ready():
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), f"{what} never started"
        time.sleep(0.5)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        kill_tree(p)
        p.wait(timeout=30)


def run_moeshard(args: list[str], cwd: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "moeshard", *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_two_nodes_equal_spawned_ranks_and_one_rank(tmp_path):
    port = free_port()
    procs = [launch(n, port, [*EVAL, "--json", "torchrun.json"], tmp_path) for n in (0, 1)]
    try:
        codes = [p.wait(timeout=900) for p in procs]
    finally:
        stop(procs)
    logs = "".join((tmp_path / f"node{n}.log").read_text()[-2000:] for n in (0, 1))
    assert codes == [0, 0], logs
    run_moeshard([*EVAL, "--json", "spawned.json"], tmp_path)
    run_moeshard(["eval", "--layouts", "1x1", "--concurrency", "1", "-n", "32", "--json", "one.json"], tmp_path)
    torchrun, spawned, one = (json.loads((tmp_path / f).read_text()) for f in ("torchrun.json", "spawned.json", "one.json"))
    assert torchrun == spawned
    assert {r["outputs_sha256"] for r in torchrun} == {one[0]["outputs_sha256"]}
    assert sum(line.startswith("2x2-ep") for line in logs.splitlines()) == 2  # rank 0 alone printed its rows


@pytest.mark.parametrize("lost", ["rendezvous host", "other node"])
def test_killing_one_launcher_stops_the_other(tmp_path, lost):
    """The first launcher hosts the c10d rendezvous. Losing it fails torchrun's own agents (they poll
    its store), so only the bound is moeshard's; losing the other node, moeshard names the rank."""
    port = free_port()
    long_eval = ["eval", "--layouts", "2x2-ep", "--concurrency", "16,1", "-n", "300"]
    logs = [tmp_path / f"node{n}.log" for n in (0, 1)]
    procs = []
    try:
        launch_both(procs, port, long_eval, tmp_path, lambda: any("accuracy" in log.read_text() for log in logs), "the eval")
        time.sleep(2)  # mid-run: concurrency 1 is decoding
        killed = 0 if lost == "rendezvous host" else 1
        kill_tree(procs[killed])  # the launcher and its ranks, as a lost machine
        t0 = time.monotonic()
        code = procs[1 - killed].wait(timeout=TIMEOUT_S + 60)
        elapsed = time.monotonic() - t0
    finally:
        stop(procs)
    survivor = logs[1 - killed].read_text()
    assert code != 0, survivor[-3000:]
    assert elapsed < TIMEOUT_S + 30, elapsed  # the collective timeout, plus torchrun's own teardown
    if lost == "other node":  # ranks 2, 3 are one node's: the driver names them, or they name the lost driver
        # mid-step the step's failure or the heartbeat watch names them first: either says RankLost
        named = "RankLost: " if "accuracy" in survivor else "DriverLost"
        assert f"moeshard: error: rank 2: {named}" in survivor, survivor[-3000:]


def test_a_node_lost_while_the_server_is_idle_stops_the_other(tmp_path):
    """`moeshard serve --tp 2 --dp 2 --ep` over two nodes, idle: node 1 killed, node 0's launcher
    exits non-zero once rank 0 has seen the heartbeats stop, naming the rank and its node."""
    port, serve_port = free_port(), free_port()
    serve = ["serve", "--tp", "2", "--dp", "2", "--ep", "--port", str(serve_port)]
    procs = []
    try:
        launch_both(procs, port, serve, tmp_path, lambda: listening(serve_port), "the server")
        kill_tree(procs[1])  # node 1's launcher and ranks, as a lost machine, while nothing runs
        t0 = time.monotonic()
        code = procs[0].wait(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        stop(procs)
    log = (tmp_path / "node0.log").read_text()
    assert code != 0 and elapsed < 60, (code, elapsed, log[-3000:])
    assert "ERROR moeshard: the engine lost a rank: rank 2: RankLost: its heartbeat stopped" in log, log[-3000:]
    assert "(node 1, host" in log, log[-3000:]
    print(f"node 0's launcher exited with code {code}, {elapsed:.1f} s after node 1 was killed")
