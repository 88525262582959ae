"""Releasing and re-creating tensor memory in place, as a colocated trainer's sleep/wake needs it.

A released tensor keeps its Python object (modules, dispatchers and compiled graphs still hold it)
with empty storage; re-created, it gets fresh storage of its old shape with undefined contents —
or, with `poison`, garbage: NaN for floats, random bits for integers (indices far out of range).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import torch


def release(tensors: list[torch.Tensor]) -> dict[int, torch.Size]:
    """Drop the storage of each tensor; returns each one's shape, by id, for `recreate`."""
    shapes = {}
    for t in tensors:
        shapes[id(t)] = t.shape
        t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    return shapes


def recreate(tensors: list[torch.Tensor], shapes: dict[int, torch.Size], poison: bool) -> None:
    for t in tensors:
        t.data = torch.empty(shapes[id(t)], dtype=t.dtype, device=t.device)
        if poison:
            fill_garbage(t)


def fill_garbage(t: torch.Tensor) -> None:
    if t.dtype.is_floating_point:
        t.data.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.data.copy_(torch.randint(0, 2, t.shape, device=t.device).bool())
    else:
        t.data.copy_(torch.randint(-(2**30), 2**30, t.shape, device=t.device).to(t.dtype))


def return_memory_to_os() -> None:
    """Freed CPU memory goes back to the allocator's free lists; glibc's malloc_trim hands it to the OS."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    libc = ctypes.util.find_library("c")
    if libc and hasattr(ctypes.CDLL(libc), "malloc_trim"):
        ctypes.CDLL(libc).malloc_trim(0)


def resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
