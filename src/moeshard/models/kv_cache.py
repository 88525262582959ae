"""The paged KV cache and the attention op that reads it.

The cache of a layer is one pool of S = (num_blocks + 1) × block_size slots. A sequence owns a list
of blocks (its row of `block_tables`); token p of sequence i lives in slot
`block_tables[i, p // block_size] * block_size + p % block_size`. Each step writes its new tokens'
K/V at `slot_mapping` and attends over the sequence's slots, so a block manager (the engine) may
place blocks anywhere in 0 … num_blocks-1.

Block `num_blocks` is the null block: zeroed at every allocation, never handed to a sequence, never
written. Every padded key position (past a sequence's length, in a step whose longest context is
longer) reads it. A masked key gets probability 0, but 0 × NaN is NaN: were the padding to read a
slot of the pool, whatever that slot held (garbage in a new or re-woken cache, another request's
non-finite values) would reach every shorter sequence's output. With the null block, no read ever
touches memory that this life of the cache has not written, so a new cache need not be zero-filled.

Attention is the custom op `moeshard::paged_attention`: the per-step metadata (how many sequences,
their lengths) is read from the attention context at run time, never baked into a compiled graph.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeshard import kernels
from moeshard.runtime.graph import serving_op
from moeshard.runtime.memory import fill_poison


@dataclass(frozen=True)
class CacheSpec:
    """One layer's entry per token: `kv_heads` keys of `k_dim` and values of `v_dim`."""

    kv_heads: int
    k_dim: int
    v_dim: int


@dataclass
class KVCache:
    k_SGd: torch.Tensor  # S = (num_blocks + 1) × block_size slots; the last block is the null block
    v_SGe: torch.Tensor


def null_slot(num_blocks: int, block_size: int) -> int:
    """The first slot of the null block, which every padded key position reads."""
    return num_blocks * block_size


def allocate(
    spec: CacheSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device, poison: bool | str = False
) -> KVCache:
    """A cache of `num_blocks` blocks plus the null block. The blocks' contents are undefined (with
    `poison`: garbage, as reused memory may hold; see runtime.memory.recreate); only the null block
    is zeroed."""
    slots = (num_blocks + 1) * block_size
    cache = KVCache(
        torch.empty(slots, spec.kv_heads, spec.k_dim, dtype=dtype, device=device),
        torch.empty(slots, spec.kv_heads, spec.v_dim, dtype=dtype, device=device),
    )
    for t in (cache.k_SGd, cache.v_SGe):
        if poison:
            fill_poison(t, in_range_only=poison == "in_range")
        t[null_slot(num_blocks, block_size) :].zero_()
    return cache


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's flat batch of N sequences: sequence i's new tokens are rows
    [query_starts[i], query_starts[i+1]); rows after the last sequence's (W = query_starts[-1]
    onwards) are padding: written nowhere, output zero.

    The gather tables are built once per step and shared by every layer: sequence i's context
    slots (keys 0 … seq_lens[i]-1), its query rows padded to the step's longest chunk Q, and where
    each real query sits in that padded [N·Q] batch. They are index tensors, not masks, so every
    gather is an `index_select` (a masked index costs a host sync and a slower kernel).
    """

    query_starts: tuple[int, ...]  # len N + 1
    seq_lens: tuple[int, ...]  # context length after this step, new tokens included
    slot_mapping_W: torch.Tensor  # int64 slot of each of the step's W new tokens
    context_slots_NX: torch.Tensor  # int64 [N, X], X = max seq_len; the null slot past a sequence's length
    context_valid_NX: torch.Tensor  # bool
    query_rows_NQ: torch.Tensor  # int64 [N, Q]: row of each query; 0 past a sequence's chunk
    query_pos_NQ: torch.Tensor  # int64 position of each query
    padded_query_W: torch.Tensor  # int64 [W]: row i·Q + offset of each of the step's W new tokens
    query_starts_N1: torch.Tensor  # int64, `query_starts` as a tensor (for moeshard.kernels)
    seq_lens_N: torch.Tensor  # int64

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        padding_slot: int,
        device="cpu",
    ) -> "AttentionMetadata":
        """`padding_slot`: what key positions past a sequence's length read (the cache's null slot)."""
        N = len(query_lens)
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        width = max((len(t) for t in block_tables), default=0)
        tables_NB = torch.tensor([list(t) + [0] * (width - len(t)) for t in block_tables], dtype=torch.int64)
        tables_NB = tables_NB.reshape(N, width)
        lens_N, qlens_N = torch.tensor(seq_lens, dtype=torch.int64), torch.tensor(query_lens, dtype=torch.int64)
        k_pos_X = torch.arange(max(seq_lens, default=0))
        valid_NX = k_pos_X < lens_N[:, None]
        slots_NX = tables_NB.gather(1, (k_pos_X // block_size).expand(N, -1).clamp(max=max(width - 1, 0)))
        slots_NX = torch.where(valid_NX, slots_NX * block_size + k_pos_X % block_size, padding_slot)
        q_off_Q = torch.arange(max(query_lens, default=0))
        q_valid_NQ = q_off_Q < qlens_N[:, None]
        q_pos_NQ = (lens_N - qlens_N)[:, None] + q_off_Q
        # The new tokens' slots are the context slots at their positions.
        slot_mapping_W = slots_NX.gather(1, q_pos_NQ.clamp(max=max(slots_NX.shape[1] - 1, 0)))[q_valid_NQ]
        rows_NQ = torch.where(q_valid_NQ, torch.tensor(starts[:-1], dtype=torch.int64)[:, None] + q_off_Q, 0)
        padded_query_W = q_valid_NQ.flatten().nonzero().flatten()
        return cls(
            tuple(starts),
            tuple(seq_lens),
            *(
                t.to(device)
                for t in (slot_mapping_W, slots_NX, valid_NX, rows_NQ, q_pos_NQ, padded_query_W,
                          torch.tensor(starts, dtype=torch.int64), lens_N)
            ),
        )


_current: AttentionMetadata | None = None


@contextlib.contextmanager
def attention_context(meta: AttentionMetadata) -> Iterator[AttentionMetadata]:
    global _current
    previous, _current = _current, meta
    try:
        yield meta
    finally:
        _current = previous


def get_attention_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention ran outside attention_context(); the runner sets it once per step.")
    return _current


class AttentionLayer:
    """What the op needs of a layer: its cache, softmax scale and window (registered by name)."""

    cache: KVCache | None
    scale: float
    window: int | None


_LAYERS: "weakref.WeakValueDictionary[str, AttentionLayer]" = weakref.WeakValueDictionary()


def register(name: str, layer: AttentionLayer) -> None:
    if name in _LAYERS:
        raise ValueError(f"an attention layer named {name!r} already exists; layer names must be unique.")
    _LAYERS[name] = layer


@serving_op("moeshard::paged_attention")
def paged_attention(q_THd: torch.Tensor, k_TGd: torch.Tensor, v_TGe: torch.Tensor, layer_name: str) -> torch.Tensor:
    """Write this step's K/V into the layer's cache, then causal attention of every sequence's new
    tokens over its cached context, all sequences in one padded batch (fp32 SDPA): [T, H, Dv]."""
    layer, meta = _LAYERS[layer_name], get_attention_metadata()
    cache = layer.cache
    if cache is None:
        raise RuntimeError(f"attention layer {layer_name!r} has no KV cache; allocate one before running.")
    W = meta.query_starts[-1]  # the step's new tokens are rows 0 … W-1; the rest is padding
    cache.k_SGd.index_copy_(0, meta.slot_mapping_W, k_TGd[:W].to(cache.k_SGd.dtype))
    cache.v_SGe.index_copy_(0, meta.slot_mapping_W, v_TGe[:W].to(cache.v_SGe.dtype))
    if kernels.serves(cache.k_SGd) and kernels.serves(cache.v_SGe):
        # Reads each sequence's own slots in place: no padded key positions, no gathered copy.
        return kernels.paged_attention(q_THd, cache.k_SGd, cache.v_SGe, meta.query_starts_N1, meta.seq_lens_N,
                                       meta.context_slots_NX, layer.scale, layer.window)
    out_THe = q_THd.new_zeros((q_THd.shape[0], q_THd.shape[1], v_TGe.shape[-1]))
    if not meta.seq_lens:
        return out_THe
    (N, Q), (H, d), (G, e) = meta.query_rows_NQ.shape, q_THd.shape[1:], v_TGe.shape[1:]
    h, X = H // G, meta.context_slots_NX.shape[1]
    # The h query heads that share a KV head are h rows of one SDPA head: one small GEMM per
    # (sequence, KV head) rather than per query head, and no copy of the KV heads.
    q_NGRd = gather_rows(q_THd, meta.query_rows_NQ).view(N, Q, G, h, d).transpose(1, 2).reshape(N, G, Q * h, d)
    k_NGXd = gather_rows(cache.k_SGd, meta.context_slots_NX).transpose(1, 2)
    v_NGXe = gather_rows(cache.v_SGe, meta.context_slots_NX).transpose(1, 2)
    k_pos_X = torch.arange(X, device=q_THd.device)
    visible_NQX = (k_pos_X <= meta.query_pos_NQ[..., None]) & meta.context_valid_NX[:, None, :]
    if layer.window is not None:
        visible_NQX &= k_pos_X > meta.query_pos_NQ[..., None] - layer.window
    visible_N1RX = visible_NQX[:, :, None].expand(N, Q, h, X).reshape(N, 1, Q * h, X)
    out_NGRe = F.scaled_dot_product_attention(
        q_NGRd.float(), k_NGXd.float(), v_NGXe.float(), attn_mask=visible_N1RX, scale=layer.scale
    )  # padded queries see nothing; their rows are never read
    out_NQHe = out_NGRe.view(N, G, Q, h, e).transpose(1, 2).reshape(N * Q, H, e)
    out_THe[:W] = out_NQHe.index_select(0, meta.padded_query_W)
    return out_THe


def gather_rows(x_R__: torch.Tensor, rows_NX: torch.Tensor) -> torch.Tensor:
    """`x_R__[rows_NX]`, as one `index_select` over the flattened rows (several times faster on CPU)."""
    return x_R__.index_select(0, rows_NX.flatten()).view(*rows_NX.shape, *x_R__.shape[1:])


@paged_attention.register_fake
def _(q_THd, k_TGd, v_TGe, layer_name):
    return q_THd.new_empty((q_THd.shape[0], q_THd.shape[1], v_TGe.shape[-1]))
