"""The peers in the benchmarks, each in its own venv (`scripts/peers.sh`), never in moeshard's.

vLLM (`.peers/vllm`; `MOESHARD_VLLM_PYTHON` may name another interpreter): its CPU engine pins its
OpenMP threads to the cores `VLLM_CPU_OMP_THREADS_BIND` names, fixed at start-up: one process per
thread count, kept for the whole run (it takes ~40–80 s to start).

llama.cpp (`.peers/llamacpp`: llama-cpp-python, which pip compiles, and the `llama-server` built
from the same llama.cpp sources): the run's checkpoint is converted to GGUF by llama.cpp's own
converter and quantized by `llama_model_quantize`, once per run, next to the checkpoint. One
sequence goes through `Llama` (the binding, as a one-user script runs it); c > 1 through
`llama-server -np c`, whose parallel slots batch the sequences continuously (the binding's own
server, `llama_cpp.server`, serves one request at a time).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx

from moeshard.serve.launcher import free_port, running

REPO = Path(__file__).resolve().parents[3]
START_TIMEOUT_S = 900
REPLY = "moeshard-peer "  # bench/peer_vllm.py and bench/peer_llamacpp.py prefix their replies with this
PEERS = REPO / ".peers"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # scripts/peers.sh installs it and unpacks its sources beside it
LLAMA_CPP_SOURCE = PEERS / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"
LLAMA_SERVER = PEERS / "llamacpp-build" / "bin" / "llama-server"  # built in the binding's build tree
LLAMA_BITS = {"bf16": 16, "q8_0": 8, "q4_0": 4, "q4_k_m": 4}  # a weight's, about (Q4_K_M mixes 4 and 6 bits)
LLAMA_FORMATS = tuple(LLAMA_BITS)


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
        read_reply(self.proc, "vLLM", self.log.name)  # {"ready": true} once its model is loaded

    def run(self, prompts, outputs, concurrency) -> tuple[list[list[int]], float]:
        answer = ask(self.proc, {"prompts": prompts, "outputs": outputs, "concurrency": concurrency}, "vLLM", self.log.name)
        return answer["tokens"], answer["seconds"]

    def close(self) -> None:
        close_peer(self.proc)
        self.log.close()


def read_reply(proc: subprocess.Popen, name: str, log_name: str) -> dict:
    for line in proc.stdout:
        if line.startswith(REPLY):
            return json.loads(line[len(REPLY):])
    raise RuntimeError(f"{name} exited with code {proc.wait()} (log: {log_name}).")


def ask(proc: subprocess.Popen, command: dict, name: str, log_name: str) -> dict:
    proc.stdin.write(json.dumps(command) + "\n")
    proc.stdin.flush()
    return read_reply(proc, name, log_name)


def close_peer(proc: subprocess.Popen) -> None:
    """Its stdin closed, a peer process ends its loop and exits; one that hangs is killed."""
    proc.stdin.close()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def llamacpp_python(need_server: bool) -> str:
    """The peer's interpreter; with `need_server`, llama-server must be built too."""
    python = PEERS / "llamacpp" / "bin" / "python"
    for path in (python, LLAMA_CPP_SOURCE / "convert_hf_to_gguf.py", *([LLAMA_SERVER] if need_server else [])):
        if not path.is_file():
            raise RuntimeError(f"llama.cpp is not installed ({path} is missing): run scripts/peers.sh llama.cpp first.")
    return str(python)


def peer_llamacpp(*args: str) -> list[str]:
    # -P: the script's folder (moeshard's bench/, with its own kernels.py) stays off sys.path
    return [llamacpp_python(False), "-P", str(Path(__file__).with_name("peer_llamacpp.py")), *args]


def gguf_path(checkpoint: str, fmt: str) -> Path:
    """Where the checkpoint's GGUF in `fmt` is kept: beside the checkpoint, for the run."""
    return Path(f"{checkpoint.rstrip('/')}-{fmt}.gguf")


def gguf_files(checkpoint: str, formats: list[str], threads: int, log_path: Path) -> dict[str, Path]:
    """The checkpoint in each of `formats` (LLAMA_FORMATS): bf16 by llama.cpp's converter, the others
    quantized from it, each made once (a file already there is taken as it is)."""
    with open(log_path, "a") as log:

        def make(out: Path, *command: str) -> None:
            if out.is_file():
                return
            partial = out.with_suffix(".partial")  # a step cut short leaves no file that looks finished
            if subprocess.run(peer_llamacpp(*command, str(partial)), stdout=log, stderr=subprocess.STDOUT).returncode:
                raise RuntimeError(f"llama.cpp's {command[0]} to {out.name} failed:\n{log_path.read_text()[-2000:]}")
            partial.rename(out)

        bf16 = gguf_path(checkpoint, "bf16")
        make(bf16, "convert", str(LLAMA_CPP_SOURCE), checkpoint)
        for fmt in formats:
            if fmt != "bf16":
                make(gguf_path(checkpoint, fmt), "quantize", str(bf16), fmt, str(threads))
    return {fmt: gguf_path(checkpoint, fmt) for fmt in formats}


class LlamaCpp:
    """One GGUF of the run's checkpoint served by llama.cpp at `threads` threads: c = 1 through
    `Llama` (bench/peer_llamacpp.py), c > 1 through llama-server with `slots` parallel slots, each
    started on its first use (a run that needs one maps its GGUF once). After a run at c = 1,
    `prefill_tok_s` is the prompts' rate to their first token."""

    def __init__(self, fmt: str, gguf: Path, threads: int, slots: int, context: int, log_dir: Path):
        self.name, self.bits = f"llama.cpp {fmt}", LLAMA_BITS[fmt]
        self.gguf, self.threads, self.slots, self.context = gguf, threads, slots, context
        self.logs = Path(log_dir) / f"llamacpp-{fmt}-{threads}"  # .log (Llama), -server.log
        self.prefill_tok_s: float | None = None
        self.proc: subprocess.Popen | None = None  # the Llama process, once started
        self.server: str | None = None  # its base URL, once started
        self.stack = ExitStack()  # what close() stops: the Llama process, the server, their logs

    def run(self, prompts, outputs, concurrency) -> tuple[list[list[int]], float]:
        if concurrency == 1:
            if self.proc is None:
                self.proc = self.start_llama()
            answer = ask(self.proc, {"prompts": prompts, "outputs": outputs}, self.name, f"{self.logs}.log")
            self.prefill_tok_s = sum(map(len, prompts)) / answer["prefill_seconds"]
            return answer["tokens"], answer["seconds"]
        self.prefill_tok_s = None
        if self.server is None:
            self.server = self.start_server()
        with httpx.Client(base_url=self.server, timeout=3600) as client, ThreadPoolExecutor(concurrency) as pool:
            start = time.perf_counter()
            tokens = list(pool.map(lambda p, n: self.complete(client, p, n), prompts, outputs))
            return tokens, time.perf_counter() - start

    def start_llama(self) -> subprocess.Popen:
        log = self.stack.enter_context(open(f"{self.logs}.log", "w"))
        proc = subprocess.Popen(peer_llamacpp("generate", str(self.gguf), str(self.threads), str(self.context)),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        self.stack.callback(close_peer, proc)
        read_reply(proc, self.name, log.name)  # {"ready": true} once its model is loaded
        return proc

    @staticmethod
    def complete(client: httpx.Client, prompt: list[int], n: int) -> list[int]:
        # token ids in, token ids out; greedy; no prompt reused from an earlier request (as moeshard's runs)
        reply = client.post("/completion", json={"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True,
                                                 "cache_prompt": False, "return_tokens": True})
        reply.raise_for_status()
        return reply.json()["tokens"]

    def start_server(self) -> str:
        port = free_port()
        command = [str(LLAMA_SERVER), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(port),
                   "-np", str(self.slots), "-c", str(self.slots * self.context), "-t", str(self.threads),
                   "-tb", str(self.threads), "--no-webui"]
        self.stack.enter_context(running(self.name, command, dict(os.environ), port, Path(f"{self.logs}-server.log")))
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=600) as client:
            self.complete(client, [1, 2, 3], 2)  # warm-up
        return base

    def close(self) -> None:
        self.stack.close()
