"""The paged KV cache and the attention op that reads it.

The cache of a layer is one pool of S = num_blocks × block_size slots. A sequence owns a list of
blocks (its row of `block_tables`); token p of sequence i lives in slot
`block_tables[i, p // block_size] * block_size + p % block_size`. Each step writes its new tokens'
K/V at `slot_mapping` and attends over the sequence's slots, so a block manager (the engine) may
place blocks anywhere.

Attention is the custom op `moeshard::paged_attention`: the per-step metadata (how many sequences,
their lengths) is read from the attention context at run time, never baked into a compiled graph.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheSpec:
    """One layer's entry per token: `kv_heads` keys of `k_dim` and values of `v_dim`."""

    kv_heads: int
    k_dim: int
    v_dim: int


@dataclass
class KVCache:
    k_SGd: torch.Tensor
    v_SGe: torch.Tensor
    block_size: int


def allocate(spec: CacheSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> KVCache:
    slots = num_blocks * block_size
    return KVCache(
        torch.zeros(slots, spec.kv_heads, spec.k_dim, dtype=dtype, device=device),
        torch.zeros(slots, spec.kv_heads, spec.v_dim, dtype=dtype, device=device),
        block_size,
    )


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's flat batch: sequence i's new tokens are rows [query_starts[i], query_starts[i+1]).

    Rows after the last sequence's are padding (slot -1: written nowhere, output zero).
    """

    query_starts: tuple[int, ...]  # len = sequences + 1
    seq_lens: tuple[int, ...]  # context length after this step, new tokens included
    slot_mapping_T: torch.Tensor  # int64, -1 for padding rows
    block_tables: torch.Tensor  # [sequences, max blocks] int64

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        padded_rows: int,
        device="cpu",
    ) -> "AttentionMetadata":
        starts = [0]
        slots: list[int] = []
        for n, length, table in zip(query_lens, seq_lens, block_tables):
            starts.append(starts[-1] + n)
            slots += [table[p // block_size] * block_size + p % block_size for p in range(length - n, length)]
        slots += [-1] * (padded_rows - len(slots))
        width = max((len(t) for t in block_tables), default=0)
        tables = torch.tensor([list(t) + [0] * (width - len(t)) for t in block_tables], dtype=torch.int64)
        return cls(
            tuple(starts),
            tuple(seq_lens),
            torch.tensor(slots, dtype=torch.int64, device=device),
            tables.reshape(len(block_tables), width).to(device),
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


def attend(q_nHd: torch.Tensor, k_LGd: torch.Tensor, v_LGe: torch.Tensor, first_pos: int, scale: float, window):
    """Causal attention of n queries at positions first_pos… over L keys at 0…L-1 (fp32 softmax)."""
    n, H, _ = q_nHd.shape
    L, G, _ = k_LGd.shape
    q_pos = torch.arange(first_pos, first_pos + n, device=q_nHd.device)[:, None]
    k_pos = torch.arange(L, device=q_nHd.device)[None, :]
    visible_nL = k_pos <= q_pos
    if window is not None:
        visible_nL &= k_pos > q_pos - window
    k_HLd = k_LGd.repeat_interleave(H // G, dim=1).transpose(0, 1).float()
    v_HLe = v_LGe.repeat_interleave(H // G, dim=1).transpose(0, 1).float()
    scores_HnL = (q_nHd.transpose(0, 1).float() @ k_HLd.transpose(1, 2)) * scale
    probs_HnL = scores_HnL.masked_fill(~visible_nL, float("-inf")).softmax(dim=-1)
    return (probs_HnL @ v_HLe).transpose(0, 1).to(q_nHd.dtype)


@torch.library.custom_op("moeshard::paged_attention", mutates_args=())
def paged_attention(q_THd: torch.Tensor, k_TGd: torch.Tensor, v_TGe: torch.Tensor, layer_name: str) -> torch.Tensor:
    """Write this step's K/V into the layer's cache, then attend per sequence: [T, H, Dv]."""
    layer, meta = _LAYERS[layer_name], get_attention_metadata()
    cache = layer.cache
    if cache is None:
        raise RuntimeError(f"attention layer {layer_name!r} has no KV cache; allocate one before running.")
    written = meta.slot_mapping_T >= 0
    slots = meta.slot_mapping_T[written]
    cache.k_SGd[slots] = k_TGd[written].to(cache.k_SGd.dtype)
    cache.v_SGe[slots] = v_TGe[written].to(cache.v_SGe.dtype)
    out_THe = q_THd.new_zeros((q_THd.shape[0], q_THd.shape[1], v_TGe.shape[-1]))
    bs = cache.block_size
    for i, length in enumerate(meta.seq_lens):
        start, end = meta.query_starts[i], meta.query_starts[i + 1]
        positions = torch.arange(length, device=q_THd.device)
        context = meta.block_tables[i, positions // bs] * bs + positions % bs
        out_THe[start:end] = attend(
            q_THd[start:end],
            cache.k_SGd[context],
            cache.v_SGe[context],
            length - (end - start),
            layer.scale,
            layer.window,
        )
    return out_THe


@paged_attention.register_fake
def _(q_THd, k_TGd, v_TGe, layer_name):
    return q_THd.new_empty((q_THd.shape[0], q_THd.shape[1], v_TGe.shape[-1]))
