"""Derived tensors: everything computed at start-up from configuration or weights and kept outside
the weights (docs/DESIGN.md §5) — expert maps and the local-expert table of every dispatcher, RoPE
tables — registered in one place with the function that computes them.

After a sleep their memory is gone; after a wake it holds whatever was there (poison makes that
garbage on purpose). `rebuild()` recomputes every entry and bumps the generation; the engine calls
it after every wake and every weight update. Tensors keep their Python identity through release,
re-creation and rebuild (only their storage changes), so a compiled graph that holds them stays
valid.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterable, Iterator

import torch

_entries: list[tuple[weakref.ref, str, Callable[..., object], bool]] = []
generation = 0


def register(owner: object, attr: str, compute: Callable[..., object], in_place: bool = False) -> None:
    """Set `owner.attr = compute()` and remember how to compute it again.

    The value is a tensor or a dataclass of tensors (and plain fields). `compute` must not hold
    `owner` (the registry holds owners weakly). `in_place`: the value is one tensor and
    `compute(out=t)` writes it into `t`; a rebuild of a tensor that has its memory then needs only
    `compute`'s scratch, not a second copy (a weight update's peak memory stays small).
    """
    setattr(owner, attr, compute())
    _entries.append((weakref.ref(owner), attr, compute, in_place))


def live() -> Iterator[tuple[object, str, Callable[..., object], bool]]:
    global _entries
    _entries = [e for e in _entries if e[0]() is not None]
    for ref, attr, compute, in_place in _entries:
        yield ref(), attr, compute, in_place


def tensors_of(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if dataclasses.is_dataclass(value):
        return [v for f in dataclasses.fields(value) if isinstance(v := getattr(value, f.name), torch.Tensor)]
    return []


def entries_of(owners: Iterable[object] | None) -> Iterator[tuple[object, str, Callable[..., object], bool]]:
    """Every live entry, or those of `owners` (another engine in the process keeps its own)."""
    ids = None if owners is None else {id(owner) for owner in owners}
    return (entry for entry in live() if ids is None or id(entry[0]) in ids)


def registered_tensors(owners: Iterable[object] | None = None) -> list[torch.Tensor]:
    """The tensors of every entry (or only of the entries of `owners`)."""
    return [t for owner, attr, *_ in entries_of(owners) for t in tensors_of(getattr(owner, attr))]


def rebuild(owners: Iterable[object] | None = None) -> int:
    """Recompute registered tensors in place (same tensor objects, fresh storage): every entry, or
    those of `owners`. Returns the new generation."""
    global generation
    for owner, attr, compute, in_place in entries_of(owners):
        value = getattr(owner, attr)
        if in_place and value.numel() > 0:  # awake (a released tensor is empty until re-created)
            compute(out=value)
            continue
        for current, fresh in zip(tensors_of(value), tensors_of(compute()), strict=True):
            current.data = fresh
    generation += 1
    return generation
