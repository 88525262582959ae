"""KV-cache blocks: a free list, each sequence's block table, and reuse of full blocks by content.

A full block is cached under its key: (its parent block's serial, its token ids, the weights'
version, the request's cache salt). The key is a dict key, compared by equality and never by a
hash alone, so two different prefixes can never share a block; the version is part of it, so a
block computed under older weights can never match again, with no reset needed for correctness
(docs/DESIGN.md §5). A cached block is shared by reference count. When its last user lets go it
keeps its key and waits, least recently used first, until a new block is needed.
"""

from __future__ import annotations

import itertools
import os
from collections import OrderedDict
from dataclasses import dataclass

ROOT = 0  # the serial a sequence's first block chains to


@dataclass(frozen=True)
class Prefix:
    """Where a sequence stands in the cache: its first `blocks` blocks are keyed, the last of them
    under `serial` (ROOT when none)."""

    blocks: int = 0
    serial: int = ROOT


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, order: list[int] | None = None, caching: bool = True):
        """`order`: the order blocks are handed out (a permutation shows that placement is free).
        `caching`: reuse full blocks by content (prefix caching)."""
        self.num_blocks, self.block_size, self.caching = num_blocks, block_size, caching
        self.free = list(reversed(order if order is not None else range(num_blocks)))  # no key
        self.refs = [0] * num_blocks
        self.key_of: dict[int, tuple] = {}
        self.block_of: dict[tuple, int] = {}
        self.serial_of: dict[int, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # keyed, unreferenced; oldest first
        self.serials = itertools.count(ROOT + 1)
        self.version = 0  # the weights' version: the engine advances it on every weight change
        # Negative control only: keys without the version, so a block outlives a weight update.
        self.unversioned = os.environ.get("MOESHARD_UNSAFE_PREFIX_KEY_NO_VERSION") == "1"
        self.queried_tokens = self.hit_tokens = 0  # since start, as vLLM counts them

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def num_free(self) -> int:
        """Blocks a sequence can still get: never used, or cached and unreferenced."""
        return len(self.free) + len(self.evictable)

    def key(self, parent: int, tokens: list[int], salt: str | None) -> tuple:
        return (parent, tuple(tokens), None if self.unversioned else self.version, salt)

    def lookup(self, tokens: list[int], salt: str | None) -> tuple[list[int], Prefix]:
        """The cached blocks `tokens` starts with (at least one token is left to compute, so that the
        last one's logits exist) and where the sequence then stands. Takes nothing."""
        hits, serial = [], ROOT
        if self.caching:
            size = self.block_size
            for i in range((len(tokens) - 1) // size):
                block = self.block_of.get(self.key(serial, tokens[i * size : (i + 1) * size], salt))
                if block is None:
                    break
                hits.append(block)
                serial = self.serial_of[block]
        return hits, Prefix(len(hits), serial)

    def count_query(self, queried: int, hit: int) -> None:
        self.queried_tokens += queried
        self.hit_tokens += hit

    def can_take(self, hits: list[int], tokens: int) -> bool:
        """Can a sequence holding nothing take `hits` and grow to `tokens` tokens?"""
        idle_hits = sum(1 for b in hits if self.refs[b] == 0)
        return self.blocks_for(tokens) - len(hits) <= self.num_free - idle_hits

    def take(self, table: list[int], hits: list[int]) -> None:
        """Start the empty `table` with the cached blocks `hits`."""
        for block in hits:
            if self.refs[block] == 0:
                del self.evictable[block]
            self.refs[block] += 1
        table += hits

    def can_grow(self, table: list[int], tokens: int) -> bool:
        return self.blocks_for(tokens) - len(table) <= self.num_free

    def grow(self, table: list[int], tokens: int) -> None:
        """Extend `table` in place to hold `tokens` tokens (the caller checked `can_grow`)."""
        while len(table) < self.blocks_for(tokens):
            table.append(self.allocate())

    def allocate(self) -> int:
        if self.free:
            block = self.free.pop()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            self.forget(block)
        else:
            raise RuntimeError("the KV cache has no free block left; allocate more blocks or run fewer sequences.")
        self.refs[block] = 1
        return block

    def cache(self, table: list[int], tokens: list[int], upto: int, prefix: Prefix, salt: str | None) -> Prefix:
        """Key the blocks of `table` that `tokens[:upto]` (whose K/V are, or this step will be, in the
        cache) fill, after the `prefix.blocks` already keyed; returns the new prefix.
        A block whose key another block already holds stays private, and the chain goes on from that
        one's serial (same content, same key)."""
        if not self.caching:
            return prefix
        size, serial = self.block_size, prefix.serial
        full = upto // size
        for i in range(prefix.blocks, full):
            key = self.key(serial, tokens[i * size : (i + 1) * size], salt)
            holder = self.block_of.get(key)
            if holder is None:
                holder = table[i]
                self.key_of[holder], self.block_of[key] = key, holder
                self.serial_of[holder] = next(self.serials)
            serial = self.serial_of[holder]
        return Prefix(max(full, prefix.blocks), serial)

    def release(self, table: list[int]) -> None:
        """Let go of `table`'s blocks (the last first, so a prefix's head is evicted last)."""
        for block in reversed(table):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.key_of:
                    self.evictable[block] = None
                else:
                    self.free.append(block)
        table.clear()

    def forget(self, block: int) -> None:
        key = self.key_of.pop(block, None)
        if key is not None:
            del self.block_of[key], self.serial_of[block]

    def reset(self) -> None:
        """Drop every key: unreferenced cached blocks are free at once, blocks in use stay with their
        sequences, private from now on (after a sleep their memory is gone; a reset frees memory)."""
        for block in list(self.key_of):
            self.forget(block)
        self.free += list(self.evictable)
        self.evictable.clear()
