"""`moeshard rl-demo`: a trainer process and the engine colocated, as in RL rollouts.

Each step the trainer moves the weights (a stand-in for an optimizer step) while the engine sleeps
(level 2, weights and KV cache released); the engine wakes, takes the new weights over a pipe and
generates. The update travels as safetensors bytes, one model part per message: no pickle, so the
engine runs no code the trainer sends. Each step the engine's logprobs are compared with a fresh
engine loaded from the same weights.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from safetensors.torch import load, load_file, save, save_file

from moeshard.bundled.arithmetic import MODEL_DIR, held_out
from moeshard.engine import LLM, SamplingParams
from moeshard.models.model import part_of
from moeshard.parallel import Layout

END = b"END"  # closes one update
NEXT = b"NEXT"  # the engine is asleep: the trainer may use the memory and send the next update
GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=0)


@dataclass
class DemoStep:
    step: int
    max_abs_dlogprob: float
    rss_awake_mb: float
    rss_asleep_mb: float


def trainer(conn, model_dir: str, steps: int, seed: int) -> None:
    """Hold the weights; per step, perturb them and send them a part per message."""
    weights = load_file(f"{model_dir}/model.safetensors")
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        if conn.recv_bytes() != NEXT:
            return
        weights = {
            n: (w.float() * (1 + 0.1 * torch.randn(w.shape, generator=g))).to(w.dtype) for n, w in weights.items()
        }
        parts: dict[str | int | None, dict[str, torch.Tensor]] = {}
        for name, w in weights.items():
            parts.setdefault(part_of(name), {})[name] = w
        for part in parts.values():
            conn.send_bytes(save(part))
        conn.send_bytes(END)
    conn.close()


def receive(conn, keep: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The update stream: (name, tensor) from each safetensors message until END (kept in `keep`)."""
    while (message := conn.recv_bytes()) != END:
        for name, tensor in load(message).items():
            keep[name] = tensor
            yield name, tensor


def chosen_logprobs(outputs) -> list[list[float]]:
    return [[top[t] for t, top in zip(o.token_ids, o.logprobs)] for o in outputs]


def fresh_logprobs(weights: dict[str, torch.Tensor], prompts: list[str]) -> tuple[list[list[int]], list[list[float]]]:
    with tempfile.TemporaryDirectory() as tmp:
        for f in ("config.json", "tokenizer.json"):
            shutil.copy(MODEL_DIR / f, Path(tmp) / f)
        save_file(weights, f"{tmp}/model.safetensors", metadata={"format": "pt"})
        with LLM(tmp) as fresh:
            outs = fresh.generate(prompts, GREEDY)
    return [o.token_ids for o in outs], chosen_logprobs(outs)


def max_abs_dlogprob(ours, theirs) -> float:
    tokens_a, lp_a = ours
    tokens_b, lp_b = theirs
    if tokens_a != tokens_b:
        return float("inf")
    return max((abs(a - b) for la, lb in zip(lp_a, lp_b) for a, b in zip(la, lb)), default=0.0)


def run_rl_demo(steps: int, layout: Layout, n: int = 32, on_step=lambda s: None) -> list[DemoStep]:
    prompts = [p.prompt for p in held_out(n)]
    ctx = mp.get_context("spawn")
    engine_end, trainer_end = ctx.Pipe()
    proc = ctx.Process(target=trainer, args=(trainer_end, str(MODEL_DIR), steps, 0), daemon=True)
    proc.start()
    rows = []
    try:
        with LLM(tensor_parallel_size=layout.tp, data_parallel_size=layout.dp, enable_expert_parallel=layout.ep) as llm:
            for step in range(1, steps + 1):
                awake = max(llm.resident_mb())
                asleep = max(llm.sleep(level=2))
                engine_end.send_bytes(NEXT)
                llm.wake_up(["weights"], poison=True)
                received: dict[str, torch.Tensor] = {}
                llm.update_weights(receive(engine_end, received))
                llm.wake_up(["kv_cache"], poison=True)
                outs = llm.generate(prompts, GREEDY, max_concurrency=16)
                ours = ([o.token_ids for o in outs], chosen_logprobs(outs))
                rows.append(DemoStep(step, max_abs_dlogprob(ours, fresh_logprobs(received, prompts)), awake, asleep))
                on_step(rows[-1])
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    return rows


def rl_demo_command(args) -> int:
    console = Console(highlight=False)
    layout = Layout.parse(args.layout)

    def on_step(row: DemoStep) -> None:
        console.print(
            f"step {row.step}: max |Δ logprob| vs a fresh engine {row.max_abs_dlogprob:.2e}; "
            f"resident {row.rss_awake_mb:.0f} MiB awake, {row.rss_asleep_mb:.0f} MiB asleep (largest rank)"
        )

    with console.status(f"rl-demo on {layout.label()}"):
        rows = run_rl_demo(args.steps, layout, on_step=on_step)
    table = Table(title=f"rl-demo, {layout.label()}: sleep(2) → wake → update over a pipe → generate")
    for column in ("step", "max |Δ logprob|", "resident awake MiB", "resident asleep MiB"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(str(r.step), f"{r.max_abs_dlogprob:.2e}", f"{r.rss_awake_mb:.0f}", f"{r.rss_asleep_mb:.0f}")
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0 if all(r.max_abs_dlogprob <= 1e-4 for r in rows) else 1
