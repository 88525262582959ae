"""The servers `moeshard bench serve` talks to: one already running at a URL, or `moeshard serve`,
`transformers serve --continuous-batching` and vLLM's OpenAI server (its CPU build, in its own venv:
bench/peers.py) started here (CPU, one dtype, 127.0.0.1, a free port, the threads asked for) and
measured (resident memory of the whole process tree); moeshard.serve.launcher starts, waits for and
stops them.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from moeshard.bench.peers import vllm_env, vllm_python
from moeshard.serve.launcher import free_port, process_tree, running, serve_command

KV_BLOCK_SIZE = 16  # moeshard serve's block size (LLM's default)
MAX_NUM_BATCHED_TOKENS = 2048  # moeshard serve's default step budget; vLLM gets the same
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class Target:
    """A server and what its completions requests carry besides the OpenAI fields."""

    name: str
    base_url: str  # …/v1
    model: str  # the name requests ask for
    extra_body: dict = field(default_factory=dict)
    pid: int | None = None  # set when this process started it


# Neither server stops at EOS in a benchmark; each takes that in its own dialect: moeshard (as vLLM)
# has `ignore_eos`, transformers serve rejects unknown fields but takes a generation config.
# moeshard serve as benchmarked, and the variants `bench serve --against` can start beside it.
MOESHARD_FLAGS = {
    "moeshard": (),
    "moeshard-no-cache": ("--no-enable-prefix-caching",),
    "moeshard-one-process": ("--no-engine-process",),  # the engine loop in the API server's process
}
IGNORE_EOS = {
    **{kind: {"ignore_eos": True} for kind in MOESHARD_FLAGS},
    "transformers": {"generation_config": '{"eos_token_id": -1}'},
    "vllm": {"ignore_eos": True},
}


PEERS = ("transformers", "vllm", *list(MOESHARD_FLAGS)[1:])  # what `bench serve --against` starts beside moeshard


def resident_mb(root: int, key: str = "Pss", source: str = "smaps_rollup") -> float:
    """The summed `key` of a process tree, in MiB: Pss by default (pages shared between the processes
    counted once, split between them), or VmHWM from `status` (each process's peak RSS; shared pages
    counted in every process, so an upper bound)."""
    total_kb = 0
    for pid in process_tree(root):
        try:
            lines = Path(f"/proc/{pid}/{source}").read_text().splitlines()
        except OSError:
            continue
        total_kb += sum(int(line.split()[1]) for line in lines if line.startswith(f"{key}:"))
    return total_kb / 1024


def model_config(model_dir: str) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def kv_cache_blocks(model_dir: str, max_num_seqs: int) -> int:
    """The KV blocks moeshard serve reserves: `max_num_seqs` full contexts in 16-token blocks."""
    return -(-max_num_seqs * model_config(model_dir)["max_position_embeddings"] // KV_BLOCK_SIZE)


def kv_cache_bytes(model_dir: str, max_num_seqs: int, dtype: str) -> int:
    """Those blocks in bytes (K and V of every layer), for a peer that is sized in bytes."""
    config = model_config(model_dir)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if dtype == "auto":
        dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
    itemsize = DTYPE_BYTES[dtype]
    per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * itemsize
    return kv_cache_blocks(model_dir, max_num_seqs) * KV_BLOCK_SIZE * per_token


def server_command(
    kind: str, model_dir: str, port: int, max_num_seqs: int, dtype: str, extra: tuple[str, ...] = ()
) -> list[str]:
    if kind in MOESHARD_FLAGS:
        return serve_command(model_dir, port, max_num_seqs, dtype, (*MOESHARD_FLAGS[kind], *extra))
    # Left alone, each peer sizes its KV cache from free memory (transformers serve held ~13 GiB here,
    # even for the bundled model; vLLM wants 90 % of the RAM free): each gets the cache moeshard reserves.
    if kind == "vllm":  # `vllm serve` itself fails on the CPU package's name; the module runs
        return [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--dtype", dtype,
                "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(max_num_seqs),
                "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
                "--kv-cache-memory-bytes", str(kv_cache_bytes(model_dir, max_num_seqs, dtype)),
                "--seed", "0", "--uvicorn-log-level", "warning"]
    transformers_cli = Path(sys.executable).with_name("transformers")
    return [str(transformers_cli), "serve", model_dir, "--continuous-batching", "--device", "cpu",
            "--dtype", dtype, "--cb-block-size", str(KV_BLOCK_SIZE),
            "--cb-num-blocks", str(kv_cache_blocks(model_dir, max_num_seqs)),
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]


def server_env(kind: str, threads: int) -> dict[str, str]:
    # vLLM's KV cache is sized by --kv-cache-memory-bytes, which VLLM_CPU_KVCACHE_SPACE would override
    return vllm_env(threads, kv_cache_gib=None) if kind == "vllm" else {**os.environ, "OMP_NUM_THREADS": str(threads)}


@contextmanager
def started(
    kind: str, model_dir: str, threads: int, max_num_seqs: int, log_dir: Path, extra: tuple[str, ...] = (),
    dtype: str = "auto",
) -> Iterator[Target]:
    """`kind` (one of MOESHARD_FLAGS, "transformers" or "vllm") serving `model_dir` in `dtype` until the block
    ends (moeshard with the `extra` arguments)."""
    port = free_port()
    command = server_command(kind, model_dir, port, max_num_seqs, dtype, extra)
    with running(kind, command, server_env(kind, threads), port, log_dir / f"{kind}-serve.log") as proc:
        base = f"http://127.0.0.1:{port}"
        model = model_dir if not kind.startswith("moeshard") else httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        yield Target(kind, f"{base}/v1", model, IGNORE_EOS[kind], proc.pid)


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While the block runs, SIGTERM (`timeout`, a CI runner, `kill`) raises SystemExit like Ctrl-C
    raises KeyboardInterrupt, so the `finally`s that stop the servers run; Python's default would
    exit at once and leave them running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
