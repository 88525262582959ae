"""Derived tensors: everything computed at start-up from configuration or weights and kept outside
the weights (DESIGN.md §5) — expert maps and the local-expert table of every dispatcher, RoPE
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
from collections.abc import Callable, Iterator

import torch

_entries: list[tuple[weakref.ref, str, Callable[[], object]]] = []
generation = 0


def register(owner: object, attr: str, compute: Callable[[], object]) -> None:
    """Set `owner.attr = compute()` and remember how to compute it again.

    The value is a tensor or a dataclass of tensors (and plain fields). `compute` must not hold
    `owner` (the registry holds owners weakly).
    """
    setattr(owner, attr, compute())
    _entries.append((weakref.ref(owner), attr, compute))


def live() -> Iterator[tuple[object, str, Callable[[], object]]]:
    global _entries
    _entries = [e for e in _entries if e[0]() is not None]
    for ref, attr, compute in _entries:
        yield ref(), attr, compute


def tensors_of(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if dataclasses.is_dataclass(value):
        return [v for f in dataclasses.fields(value) if isinstance(v := getattr(value, f.name), torch.Tensor)]
    return []


def registered_tensors(owners: set[int] | None = None) -> list[torch.Tensor]:
    """The tensors of every entry (or only of entries whose owner's id is in `owners`)."""
    return [
        t
        for owner, attr, _ in live()
        if owners is None or id(owner) in owners
        for t in tensors_of(getattr(owner, attr))
    ]


def rebuild(owners: set[int] | None = None) -> int:
    """Recompute registered tensors in place (same tensor objects, fresh storage): every entry, or
    those whose owner's id is in `owners`. Returns the new generation."""
    global generation
    for owner, attr, compute in live():
        if owners is not None and id(owner) not in owners:
            continue
        for current, fresh in zip(tensors_of(getattr(owner, attr)), tensors_of(compute()), strict=True):
            current.data = fresh
    generation += 1
    return generation
