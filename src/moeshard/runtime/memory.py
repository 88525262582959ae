"""Releasing and re-creating tensor memory in place, as a colocated trainer's sleep/wake needs it.

A released tensor keeps its Python object (modules, dispatchers and compiled graphs still hold it)
with empty storage; re-created, it gets fresh storage of its old shape with undefined contents —
or, with `poison`, every kind of garbage reused memory can hold, mixed element by element: NaN,
±Inf, huge finite values, and values within the range the tensor held before (an index in range, a
float of the right size: wrong, but no bounds check or NaN test catches those, only a comparison of
answers does); integer tensors get ids in range and out of it. A new KV cache has no earlier range:
`fill_poison` draws its plausible values from [-4, 4].
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
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


POISON_KINDS = (True, "in_range")  # every kind of garbage; only the silent kind (values in range)


def recreate(tensors: list[torch.Tensor], released: dict[int, Released], poison: bool | str) -> None:
    """Fresh storage of each tensor's old shape: undefined contents, or with `poison` garbage
    (`True`: every kind; `"in_range"`: only values within the tensor's old range)."""
    for t in tensors:
        was = released[id(t)]
        t.data = torch.empty(was.shape, dtype=t.dtype, device=t.device)
        if poison:
            fill_poison(t, float(was.low), float(was.high), in_range_only=poison == "in_range")


def fill_poison(t: torch.Tensor, low: float = -4.0, high: float = 4.0, in_range_only: bool = False) -> None:
    """Garbage of every kind, mixed element by element, in place (one byte per element of extra
    memory): floats are NaN, +Inf, -Inf, ±huge (a quarter of the dtype's largest value) or uniform
    in [low, high], a sixth each; integers are in [low, high] or outside it (either sign), half
    each; bools are random bits. `in_range_only`: only the values in [low, high]."""
    if t.dtype == torch.bool:
        t.data.copy_(torch.randint(0, 2, t.shape, device=t.device).bool())
        return
    if not t.dtype.is_floating_point:
        inside = torch.randint(int(low), int(high) + 1, t.shape, device=t.device)
        if in_range_only:
            t.data.copy_(inside.to(t.dtype))
            return
        # Out of range by up to 2^20 (not by anything the dtype holds): a count sized by a garbage
        # id then fails, rather than allocating gigabytes first.
        far = 1 << min(20, torch.iinfo(t.dtype).bits - 2)
        above = torch.randint(int(high) + 1, int(high) + 1 + far, t.shape, device=t.device)
        below = torch.randint(int(low) - far, int(low), t.shape, device=t.device)
        kind = torch.randint(0, 4, t.shape, device=t.device)
        t.data.copy_(torch.where(kind < 2, inside, torch.where(kind == 2, above, below)).to(t.dtype))
        return
    t.data.uniform_(low, high)
    if in_range_only:
        return
    kind = torch.randint(0, 6, t.shape, dtype=torch.uint8, device=t.device)
    huge = torch.finfo(t.dtype).max / 4
    for k, value in enumerate((float("nan"), float("inf"), -float("inf"), huge, -huge)):
        t.data.masked_fill_(kind == k, value)


def digest(tensors: list[torch.Tensor]) -> str:
    """SHA-256 of every byte of `tensors`, in order: equal exactly when the contents are."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


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
