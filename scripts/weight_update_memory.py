"""One `update_weights_from_tensor` bucket of a whole ≥ 500 MB model, plain and flattened, sent to a
real `moeshard serve`: accepted, applied, and the server's memory while it takes it.

    .venv/bin/python scripts/weight_update_memory.py [--dir /tmp/moeshard-big-moe] [--layers 6] [--dp 2]

The model is a random checkpoint of the bundled architecture (Qwen2-MoE, verify/tiny.py's recipe)
with bigger dimensions, in float32 (made once, kept in --dir). The server (`--dp 2 --ep`: its API
process, its engine process and a second rank) first gets the model's weights moved (one plain
safetensors payload of every weight), then its own weights back as one flattened bucket. Applied:
the greedy logprobs change after the first and return bit for bit after the second. Memory: the
process tree's PSS (pages shared between its processes counted once) sampled every 20 ms, and
each process's peak RSS (VmHWM, reset before each update), against the bucket's size.
"""

from __future__ import annotations

import argparse
import base64
import json
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file, save

from moeshard.bench.servers import process_tree, resident_mb, started
from moeshard.engine.payloads import flattened_bucket
from moeshard.verify.tiny import make_tiny_checkpoint

DIMS = dict(hidden_size=768, num_attention_heads=12, num_key_value_heads=4, num_experts=16, moe_intermediate_size=768,
            shared_expert_intermediate_size=768, intermediate_size=768, max_position_embeddings=64)
PROMPTS = [[5, 17, 33, 2, 8], [61, 4, 4, 90]]


def checkpoint(directory: Path, layers: int) -> Path:
    if not (directory / "model.safetensors").is_file():
        make_tiny_checkpoint("qwen2_moe", directory, num_hidden_layers=layers, **DIMS)
    return directory


def greedy(url: str) -> list[list[float]]:
    """Each prompt's greedy logprobs, each prompt sent alone (so every run steps the same batches)."""
    out = []
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 0, "ignore_eos": True}
        choice = httpx.post(f"{url}/v1/completions", json=body, timeout=600).raise_for_status().json()["choices"][0]
        out.append(choice["logprobs"]["token_logprobs"])
    return out


def rss_mb(root: int, key: str) -> list[int]:
    """Each process's `key` (VmRSS, VmHWM) from /proc/PID/status, in MiB, the server's first."""
    out = []
    for pid in process_tree(root):
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        out.append(round(next(int(line.split()[1]) for line in status if line.startswith(f"{key}:")) / 1024))
    return out


def chunks(body: bytes, size: int = 1 << 20):
    """The body a MiB at a time: httpx sends one bytes object by re-slicing what is left after each
    send() (quadratic: 800 MB took minutes), an iterator of views as it comes."""
    view = memoryview(body)
    return (view[i:i + size] for i in range(0, len(body), size))


def send(url: str, root: int, body: bytes) -> dict:
    """POST the body while sampling the server's memory; the figures."""
    for pid in process_tree(root):
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM from here
    idle, peak, done = resident_mb(root), [0.0], threading.Event()
    idle_rss = rss_mb(root, "VmRSS")

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], resident_mb(root))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    start = time.perf_counter()
    try:
        headers = {"content-type": "application/json", "content-length": str(len(body))}
        answer = httpx.post(f"{url}/update_weights_from_tensor", content=chunks(body), headers=headers,
                            timeout=1200).raise_for_status().json()
    finally:
        done.set()
        sampler.join()
    return {"seconds": round(time.perf_counter() - start, 1), "idle_pss_mb": round(idle), "peak_pss_mb": round(peak[0]),
            "idle_rss_mb_per_process": idle_rss, "peak_rss_mb_per_process": rss_mb(root, "VmHWM"), "answer": answer}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "moeshard-big-moe")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dp", type=int, default=2)
    args = parser.parse_args()
    model = checkpoint(args.dir, args.layers)
    weights = load_file(model / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    moved = {n: t * (1 + 0.05 * torch.randn(t.shape, generator=g)) for n, t in weights.items()}
    plain = save(moved)
    bodies = {
        "plain": json.dumps({"serialized_named_tensors": [base64.b64encode(plain).decode()], "weight_version": "moved"}),
        "flattened": json.dumps({"serialized_named_tensors": [base64.b64encode(flattened_bucket(weights.items())).decode()],
                                 "load_format": "flattened_bucket", "weight_version": "back"}),
    }
    del moved
    report = {"model_mb": round((model / "model.safetensors").stat().st_size / 2**20),
              "bucket_mb": round(len(plain) / 2**20), "body_mb": round(len(bodies["plain"]) / 2**20)}
    with started("moeshard", str(model), threads=2, max_num_seqs=4, log_dir=model,
                 extra=("--dp", str(args.dp), "--ep", "--enable-sleep-mode")) as target:
        url, root = target.base_url.removesuffix("/v1"), target.pid
        report["processes"] = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[-2].decode()[-60:]
                               for pid in process_tree(root)]
        before = greedy(url)
        report["plain"] = send(url, root, bodies.pop("plain").encode())
        after = greedy(url)
        report["flattened"] = send(url, root, bodies.pop("flattened").encode())
        back = greedy(url)
    report["applied"] = {"moved_changed_the_logprobs": after != before, "flattened_brought_them_back": back == before}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
