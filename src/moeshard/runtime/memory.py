"""Releasing and re-creating tensor memory in place, as a colocated trainer's sleep/wake needs it.

A released tensor keeps its Python object (modules, dispatchers and compiled graphs still hold it)
with empty storage; re-created, it gets fresh storage of its old shape with undefined contents —
or, with `poison`, garbage that looks like data: random values within the range the tensor held
before (an index in range, a float of the right size). That is what reused memory leaves behind,
and no bounds check or NaN test catches it: only a comparison of answers does. A new KV cache has
no earlier range; `fill_garbage` makes it NaN and random bits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Released:
    shape: torch.Size
    low: torch.Tensor  # the range of the values it held (0-dim, on its device): what poison draws from
    high: torch.Tensor


def release(tensors: list[torch.Tensor]) -> dict[int, Released]:
    """Drop the storage of each tensor; returns each one's shape and range, by id, for `recreate`."""
    released = {}
    for t in tensors:
        # One pass, and kept on the device: a sleep that no poisoned wake follows never waits for it.
        low, high = torch.aminmax(t) if t.numel() else (torch.zeros(()), torch.zeros(()))
        released[id(t)] = Released(t.shape, low, high)
        t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    return released


def recreate(tensors: list[torch.Tensor], released: dict[int, Released], poison: bool) -> None:
    for t in tensors:
        was = released[id(t)]
        t.data = torch.empty(was.shape, dtype=t.dtype, device=t.device)
        if poison:
            fill_plausible(t, float(was.low), float(was.high))


def fill_plausible(t: torch.Tensor, low: float, high: float) -> None:
    """Random values in [low, high]: wrong, but of the kind the tensor holds."""
    if t.dtype.is_floating_point:
        t.data.uniform_(low, high)
    else:
        t.data.copy_(torch.randint(int(low), int(high) + 1, t.shape, device=t.device).to(t.dtype))


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
