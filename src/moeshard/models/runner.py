"""Run a model step by step over sequences that live in a paged KV cache.

This is the model's contract with the engine: one `step` takes, for each of this rank's
sequences, its new tokens; it lays them out as one flat batch (padded to a multiple of TP under
SP), builds the step's attention metadata, fixes the MoE method for the step (every rank agrees),
and returns each sequence's logits. Blocks come from a free list, one whenever a sequence crosses
a block boundary; the engine's block manager replaces this allocator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moeshard.graph import compile_for_serving
from moeshard.models.kv_cache import AttentionMetadata, allocate, attention_context
from moeshard.models.model import CausalLM
from moeshard.moe.config import CommMethod, SelectionPolicy
from moeshard.moe.context import moe_forward_context


@dataclass
class SequenceState:
    tokens: list[int] = field(default_factory=list)  # every token whose K/V is cached
    blocks: list[int] = field(default_factory=list)


class OutOfBlocks(RuntimeError):
    pass


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int = 256,
        block_size: int = 4,
        policy: SelectionPolicy = SelectionPolicy(),
        force: CommMethod | None = None,
        compile_backend: str | None = None,
        block_order: list[int] | None = None,
    ):
        """`block_order`: the order blocks are handed out (a permutation tests that placement is free)."""
        self.model, self.block_size, self.policy, self.force = model, block_size, policy, force
        device = model.parallel.device
        model.set_kv_caches(
            [allocate(spec, num_blocks, block_size, model.dtype, device) for spec in model.cache_specs()]
        )
        self.free = list(reversed(block_order if block_order is not None else range(num_blocks)))
        self.forward = compile_for_serving(model, compile_backend) if compile_backend else model
        self.tp, self.sp = model.parallel.layout.tp, model.parallel.layout.sp

    def ensure_blocks(self, seq: SequenceState, length: int) -> None:
        while len(seq.blocks) * self.block_size < length:
            if not self.free:
                raise OutOfBlocks("the KV cache has no free block left; allocate more blocks or run fewer sequences.")
            seq.blocks.append(self.free.pop())

    def release(self, seq: SequenceState) -> None:
        self.free += reversed(seq.blocks)
        seq.blocks = []

    @torch.no_grad()
    def step(
        self, seqs: list[SequenceState], new_tokens: list[list[int]], all_logits: bool = False
    ) -> list[torch.Tensor]:
        """Append `new_tokens[i]` to `seqs[i]`; return each sequence's logits (fp32).

        The last position's [vocab] row, or with `all_logits` one row per new token [n, vocab].
        Every rank calls this in lock-step; a rank with no sequences passes empty lists.
        """
        device = self.model.parallel.device
        ids, positions, query_lens, seq_lens = [], [], [], []
        for seq, new in zip(seqs, new_tokens):
            start = len(seq.tokens)
            self.ensure_blocks(seq, start + len(new))
            seq.tokens += new
            ids += new
            positions += range(start, start + len(new))
            query_lens.append(len(new))
            seq_lens.append(len(seq.tokens))
        T = len(ids)
        padded = -(-T // self.tp) * self.tp if self.sp else T
        meta = AttentionMetadata.build(query_lens, seq_lens, [s.blocks for s in seqs], self.block_size, padded, device)
        ids_T = torch.tensor(ids + [0] * (padded - T), dtype=torch.int64, device=device)
        positions_T = torch.tensor(positions + [0] * (padded - T), dtype=torch.int64, device=device)
        moe_rows = padded // self.tp if self.sp else padded
        with moe_forward_context(moe_rows, self.policy, self.force), attention_context(meta):
            hidden_TD = self.forward(ids_T, positions_T)
        ends = meta.query_starts[1:]
        rows = list(range(T)) if all_logits else [end - 1 for end in ends]
        logits = self.model.logits(hidden_TD[rows]) if rows else hidden_TD.new_zeros(0)
        if not all_logits:
            return list(logits)
        return [logits[start:end] for start, end in zip(meta.query_starts, ends)]
