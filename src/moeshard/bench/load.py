"""`moeshard bench load`: how long a checkpoint takes to load, what the engine then holds, and its peak
resident memory on the way, with moeshard.kernels (weights stored as packed panels) and without them
(MOESHARD_CPU_KERNELS=0: Hugging Face's layout), each load in a fresh process of its own (the peak is
the process's VmHWM), the two alternated; and the packing alone (a checkpoint block written into
panels) against a plain copy of the same bytes (docs/perf.md).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

SETTINGS = {"kernels": "1", "torch ops": "0"}  # MOESHARD_CPU_KERNELS


def status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def load_once(directory: str, dtype: str, threads: int) -> dict:
    """In this (fresh) process: build the engine on `directory`, one rank, a minimal KV cache."""
    from moeshard import LLM, kernels

    torch.set_num_threads(threads)
    kernels.built()  # built or loaded from the cache before the clock starts
    start, cpu_start, usage = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
    with LLM(directory, dtype=dtype, max_num_seqs=1, num_kv_blocks=4, block_size=16) as llm:
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        after = resource.getrusage(resource.RUSAGE_SELF)
        params = list(llm.ranks.host.worker.model.parameters())
        return dict(
            seconds=seconds,
            cpu_seconds=cpu_seconds,  # this process's CPU time: what the load costs a core, however busy the machine
            # of which the kernel's (faulting fresh memory and the file's pages in, mostly)
            sys_seconds=after.ru_stime - usage.ru_stime,
            held_mib=llm.memory_held_mb()[0]["weights"],
            storage_mib=sum(p.numel() * p.element_size() for p in params) / 2**20,
            packed_mib=sum(p.numel() * p.element_size() for p in params if p.weight_layout.packed) / 2**20,
            peak_mib=status_mib("VmHWM"),
        )


def pack_gbs(threads: int, repeats: int) -> tuple[float, float]:
    """GB per CPU second of writing a [4096, 2048] bf16 block into panels, and of copying its bytes
    as they are (CPU time: the machine's other work does not count)."""
    from moeshard.bench.floor import median_ms
    from moeshard.kernels import packed

    torch.set_num_threads(threads)
    w = torch.randn(4096, 2048).bfloat16()
    layout = packed.for_linear(tuple(w.shape), w.dtype, "cpu", "bench")
    out, flat = torch.empty(layout.storage_shape(), dtype=w.dtype), torch.empty_like(w)

    def rate(fn) -> float:
        return w.numel() * w.element_size() / median_ms(fn, repeats, warmup=1, clock=time.process_time) * 1e3 / 1e9

    return rate(lambda: layout.write(out, (), w)), rate(lambda: flat.copy_(w))


def run_bench_load(args) -> int:
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    if args.child:
        print(json.dumps(load_once(args.model, args.dtype, args.threads)))
        return 0
    from moeshard.bench.e2e import larger_model

    with tempfile.TemporaryDirectory() as tmp:
        directory = args.model or larger_model(tmp + "/model", args.model_shape, getattr(torch, args.dtype))
        disk_mib = sum(f.stat().st_size for f in Path(directory).glob("*.safetensors")) / 2**20
        settings = {name: s for name, s in SETTINGS.items() if args.torch_ops or s == "1"}
        runs: dict[str, list[dict]] = {name: [] for name in settings}
        for _ in range(args.repeats):
            for name, setting in settings.items():
                child = subprocess.run(
                    [sys.executable, "-m", "moeshard.cli", "bench", "load", "--child", "--model", directory,
                     "--dtype", args.dtype, "--threads", str(args.threads)],
                    env={**os.environ, "MOESHARD_CPU_KERNELS": setting}, capture_output=True, text=True, check=True,
                )
                runs[name].append(json.loads(child.stdout.strip().splitlines()[-1]))
    packing, copying = pack_gbs(args.threads, 9)
    table = Table(title=f"loading {args.model or args.model_shape} ({disk_mib:,.0f} MiB on disk, {args.dtype}), one rank, "
                        f"{args.threads} thread(s), median of {args.repeats} (min–max)")
    for column in ("", "load s", "GB/s", "CPU s", "of which system", "GB per CPU s", "held MiB", "peak MiB", "held / stored", "peak / stored"):
        table.add_column(column, justify="right")
    summary = {}
    for name, results in runs.items():
        def median(key):
            values = [r[key] for r in results]
            return statistics.median(values), min(values), max(values)

        seconds, cpu, held, peak = median("seconds"), median("cpu_seconds"), median("held_mib"), median("peak_mib")
        system = median("sys_seconds")
        stored = results[0]["storage_mib"]
        table.add_row(
            name, f"{seconds[0]:.2f} ({seconds[1]:.2f}–{seconds[2]:.2f})", f"{disk_mib * 2**20 / seconds[0] / 1e9:.2f}",
            f"{cpu[0]:.2f} ({cpu[1]:.2f}–{cpu[2]:.2f})", f"{system[0]:.2f}", f"{disk_mib * 2**20 / cpu[0] / 1e9:.2f}", f"{held[0]:,.0f}", f"{peak[0]:,.0f} ({peak[1]:,.0f}–{peak[2]:,.0f})",
            f"{held[0] / stored:.3f}", f"{peak[0] / stored:.3f}",
        )
        summary[name] = dict(seconds=seconds, cpu_seconds=cpu, sys_seconds=system, held_mib=held, peak_mib=peak, storage_mib=stored,
                             packed_mib=results[0]["packed_mib"])
    console.print(table)
    console.print(f"packing a [4096, 2048] bf16 block into panels: {packing:.2f} GB per CPU s; copying it as it is: "
                  f"{copying:.2f} GB per CPU s ({args.threads} thread(s), median of 9)")
    console.print("held / stored and peak / stored: over the bytes of the weights' storage (packed panels where the "
                  "kernels serve them, else Hugging Face's layout); peak is the process's VmHWM, the interpreter included; "
                  "CPU s: the loading process's CPU time, of which system: the kernel's (faulting memory and file pages in)")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(disk_mib=disk_mib, settings=summary, pack_gbs=packing, copy_gbs=copying,
                                                   threads=args.threads), indent=1))
    return 0
