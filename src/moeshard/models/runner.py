"""Run a model one step at a time over sequences whose K/V live in a paged cache.

This is the model's contract with the engine. A step is a list of chunks, one per sequence: its
new tokens, the position of the first, and its block table (blocks are placed by the caller's
block manager). The runner lays the chunks out as one flat batch, pads it (to a multiple of TP
under SP; to a graph bucket when compiled), builds the attention metadata, fixes the MoE method for
the step (every rank agrees) and returns logits. A rank with nothing to do still steps, on one
dummy token, so that every collective stays matched. On request it also returns where each token
was routed in every MoE layer (for routing replay).
"""

from __future__ import annotations

import bisect
import collections
import os
from dataclasses import dataclass

import torch

from moeshard.runtime.graph import compile_for_serving
from moeshard.models.kv_cache import AttentionMetadata, allocate, attention_context, null_slot
from moeshard.models.model import CausalLM
from moeshard.moe import CommMethod, SelectionPolicy
from moeshard.moe.context import moe_forward_context
from moeshard.parallel.state import all_gather

Logits = torch.Tensor | list[torch.Tensor]
BUCKETS = (2, 4, 8, 16, 32, 64, 128, 256, 512)  # compiled batch sizes; eager above the largest


@dataclass(frozen=True)
class Chunk:
    token_ids: list[int]
    start: int  # position of token_ids[0]; the sequence's earlier tokens are already cached
    blocks: list[int]  # block table, covering start + len(token_ids) tokens

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        policy: SelectionPolicy = SelectionPolicy(),
        force: CommMethod | None = None,
        compile_backend: str | None = None,
        buckets: tuple[int, ...] = BUCKETS,
    ):
        self.model, self.block_size, self.policy, self.force = model, block_size, policy, force
        self.num_blocks = num_blocks
        # Negative control only: padded key positions read slot 0, an ordinary slot, not the null block.
        unsafe = os.environ.get("MOESHARD_UNSAFE_NO_NULL_BLOCK") == "1"
        self.padding_slot = 0 if unsafe else null_slot(num_blocks, block_size)
        self.allocate_kv_cache()
        self.compiled = compile_for_serving(model, compile_backend) if compile_backend else None
        self.buckets = buckets
        self.tp, self.sp = model.parallel.layout.tp, model.parallel.layout.sp
        self.method_steps: collections.Counter[str] = collections.Counter()  # steps run by each MoE method

    def padded_rows(self, rows: int) -> tuple[int, bool]:
        """Rows to run and whether the compiled graph runs them."""
        compiled = self.compiled is not None and rows <= self.buckets[-1]
        if compiled:
            rows = self.buckets[bisect.bisect_left(self.buckets, rows)]
        if self.sp:
            rows = -(-rows // self.tp) * self.tp
        return rows, compiled

    @torch.no_grad()
    def run_chunks(
        self, chunks: list[Chunk], all_logits: bool = False, record_routing: bool = False
    ) -> Logits | tuple[Logits, list[torch.Tensor]]:
        """Each chunk's logits (fp32): its last row, as one [chunks, vocab] tensor, or with `all_logits`
        a list of every row [n, vocab] per chunk. With `record_routing`, also each chunk's routed
        experts, [n, MoE layers, top_k] int64 per chunk: row i holds the global expert ids token i went
        to in each MoE layer, in layer order.

        Every rank calls this in lock-step; a rank with no chunks passes [] (and gets []). Every TP rank
        of a DP group passes the same `record_routing` (under SP they gather the routing together).
        """
        device = self.model.parallel.device
        ids = [t for c in chunks for t in c.token_ids]
        positions = [p for c in chunks for p in range(c.start, c.end)]
        rows, compiled = self.padded_rows(max(len(ids), 1))  # a dummy row when idle
        meta = AttentionMetadata.build(
            [len(c.token_ids) for c in chunks],
            [c.end for c in chunks],
            [c.blocks for c in chunks],
            self.block_size,
            self.padding_slot,
            device,
        )
        ids_T = torch.tensor(ids + [0] * (rows - len(ids)), dtype=torch.int64, device=device)
        positions_T = torch.tensor(positions + [0] * (rows - len(ids)), dtype=torch.int64, device=device)
        forward = self.compiled if compiled else self.model
        moe_rows, real_rows = rows, len(ids)
        if self.sp:  # this rank's slice of the rows
            moe_rows = rows // self.tp
            real_rows = min(max(len(ids) - self.model.parallel.tp_rank * moe_rows, 0), moe_rows)
        with (
            moe_forward_context(moe_rows, self.policy, self.force, real_rows, record_routing) as moe,
            attention_context(meta),
        ):
            hidden_TD = forward(ids_T, positions_T)
        self.method_steps[moe.method.name] += 1
        ends = meta.query_starts[1:]
        if not chunks:
            logits = []
        elif not all_logits:
            logits = self.model.logits(hidden_TD[[end - 1 for end in ends]])
        else:
            logits_TV = self.model.logits(hidden_TD[: len(ids)])
            logits = [logits_TV[start:end] for start, end in zip(meta.query_starts, ends)]
        if not record_routing:
            return logits
        routed_TYK = torch.stack(moe.routing, dim=1)
        if self.sp:  # each TP rank routed its slice of the rows
            routed_TYK = all_gather(routed_TYK, self.model.parallel.tp_group)
        return logits, [routed_TYK[start:end] for start, end in zip(meta.query_starts, ends)]

    def allocate_kv_cache(self, poison: bool | str = False) -> None:
        """A new cache, its contents undefined (`poison`: garbage) except the null block's zeros."""
        device, dtype = self.model.parallel.device, self.model.dtype
        self.model.set_kv_caches(
            [allocate(spec, self.num_blocks, self.block_size, dtype, device, poison) for spec in self.model.cache_specs()]
        )

    def kv_cache_bytes(self) -> int:
        slots, itemsize = (self.num_blocks + 1) * self.block_size, self.model.dtype.itemsize
        return sum(slots * spec.kv_heads * (spec.k_dim + spec.v_dim) * itemsize for spec in self.model.cache_specs())

    def release_kv_cache(self) -> None:
        self.model.set_kv_caches(None)

    def set_method(self, force: CommMethod | None, policy: SelectionPolicy) -> None:
        """Change the method for later steps (a compiled graph serves every method)."""
        self.force, self.policy = force, policy
