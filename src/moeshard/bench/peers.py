"""vLLM as a peer in the benchmarks: its CPU build lives in its own venv (`scripts/peers.sh` puts it
in `.peers/vllm`; `MOESHARD_VLLM_PYTHON` may name another interpreter), never in moeshard's.

vLLM's CPU engine pins its OpenMP threads to the cores `VLLM_CPU_OMP_THREADS_BIND` names, fixed at
start-up: one process per thread count, kept for the whole run (it takes ~40–80 s to start).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
START_TIMEOUT_S = 900
REPLY = "moeshard-peer "  # bench/peer_vllm.py prefixes its replies with this


def vllm_python() -> str:
    python = os.environ.get("MOESHARD_VLLM_PYTHON") or str(REPO / ".peers" / "vllm" / "bin" / "python")
    if not Path(python).is_file():
        raise RuntimeError(f"vLLM's CPU build is not installed ({python} is missing): run scripts/peers.sh first.")
    return python


def vllm_env(threads: int, kv_cache_gib: int | None = 2) -> dict[str, str]:
    """vLLM's CPU settings: its OpenMP threads pinned to cores 0…threads−1, and a KV cache of
    `kv_cache_gib` GiB (None: whatever `--kv-cache-memory-bytes` says; the variable would override it)."""
    env = {key: value for key, value in os.environ.items() if key != "VLLM_CPU_KVCACHE_SPACE"}
    env |= {"VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}", "VLLM_LOGGING_LEVEL": "WARNING"}
    if kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    return env


class VllmOffline:
    """vLLM's offline engine in its own process (bench/peer_vllm.py), fed one workload at a time,
    at most `concurrency` requests in flight."""

    name = "vllm"

    def __init__(self, model_dir: str, dtype: str, threads: int, max_num_seqs: int, max_model_len: int, log_path: Path):
        script = Path(__file__).with_name("peer_vllm.py")
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            # -P: the script's folder (moeshard's bench/, with its own kernels.py) stays off sys.path
            [vllm_python(), "-P", str(script), model_dir, dtype, str(max_num_seqs), str(max_model_len)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=vllm_env(threads),
        )
        if "ready" not in self.reply():
            raise RuntimeError(f"vLLM did not start (log: {log_path}).")

    def reply(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
        raise RuntimeError(f"vLLM exited with code {self.proc.wait()} (log: {self.log.name}).")

    def run(self, prompts, outputs, concurrency) -> tuple[list[list[int]], float]:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "outputs": outputs, "concurrency": concurrency}) + "\n")
        self.proc.stdin.flush()
        answer = self.reply()
        return answer["tokens"], answer["seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
