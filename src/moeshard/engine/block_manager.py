"""KV-cache blocks: a free list, and each sequence's block table."""

from __future__ import annotations


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, order: list[int] | None = None):
        """`order`: the order blocks are handed out (a permutation shows that placement is free)."""
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free = list(reversed(order if order is not None else range(num_blocks)))

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_grow(self, table: list[int], tokens: int) -> bool:
        return self.blocks_for(tokens) - len(table) <= len(self.free)

    def grow(self, table: list[int], tokens: int) -> None:
        """Extend `table` in place to hold `tokens` tokens (the caller checked `can_grow`)."""
        while len(table) < self.blocks_for(tokens):
            if not self.free:
                raise RuntimeError("the KV cache has no free block left; allocate more blocks or run fewer sequences.")
            table.append(self.free.pop())

    def release(self, table: list[int]) -> None:
        self.free += reversed(table)
        table.clear()

    @property
    def num_free(self) -> int:
        return len(self.free)
