"""What a decoder model is, independent of the checkpoint format: frozen, hashable, no tensors.

Shape legend used across moeshard.models, with moeshard.moe's (docs/DESIGN.md §10); capitals
count rows, heads, sequences and slots, lower-case letters are widths inside one head:
    T  tokens in the flat batch (this rank's rows; its SP slice under SP)    D  hidden size
    V  vocabulary rows on this rank     H  attention heads on this rank     G  KV heads on this rank
    N  sequences in a step              Q  a sequence's query rows (padded to the step's longest chunk)
    X  positions: a sequence's keys (padded to the step's longest context), or the RoPE table's rows
    S  slots of the paged KV cache      B  blocks in a block table
    d  query/key width of a head        e  value width of a head
    c  MLA latent (kv_lora_rank)        n  MLA q/k dims without rope        r  rotary dims
"""

from __future__ import annotations

from dataclasses import dataclass

from moeshard.moe.config import MoEConfig


class ModelConfigError(ValueError):
    """A config.json moeshard cannot run; one sentence naming the cause."""


@dataclass(frozen=True)
class RopeConfig:
    dim: int  # rotary dims per head (r)
    theta: float = 10000.0
    kind: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_positions: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True
    interleaved: bool = False  # DeepSeek: rotary pairs are (x0, x1), (x2, x3), …


@dataclass(frozen=True)
class AttentionConfig:
    heads: int
    kv_heads: int
    head_dim: int  # query/key dims per head
    v_head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's query and key
    # Multi-head latent attention (DeepSeek-V3); kv_lora_rank == 0 means ordinary GQA.
    q_lora_rank: int = 0  # 0: queries straight from hidden
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    scale: float = 0.0  # softmax scale; 0 means head_dim ** -0.5

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def softmax_scale(self) -> float:
        return self.scale or self.head_dim**-0.5


@dataclass(frozen=True)
class LayerConfig:
    moe: MoEConfig | None  # None: a dense SwiGLU MLP of `dense_intermediate`
    dense_intermediate: int = 0
    sliding_window: int | None = None  # a query sees the last `sliding_window` positions


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden: int
    rms_eps: float
    attention: AttentionConfig
    rope: RopeConfig
    layers: tuple[LayerConfig, ...]
    max_positions: int
    tie_embeddings: bool = False
