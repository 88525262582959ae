"""Tensor-parallel attention: grouped-query attention, and DeepSeek's multi-head latent attention.

Heads are split over TP (q/k/v column-parallel by head, o row-parallel). With fewer KV heads than
TP ranks, each KV head is replicated on TP / kv_heads ranks.

MLA caches the compressed latent (one shared "head" of kv_lora_rank + rope dims), not per-head
keys and values: the key projection is absorbed into the query, `q_nope · (W_UK c) = (q_nope W_UK) · c`,
so attention runs over the latent as multi-query attention, and the value projection `W_UV` is
applied to the attention output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeshard import kernels
from moeshard.kernels import packed
from moeshard.models import kv_cache
from moeshard.models.config import AttentionConfig, ModelConfig
from moeshard.models.kv_cache import CacheSpec, KVCache
from moeshard.models.layers import RMSNorm, Rotary, TPComm, block, size
from moeshard.models.loader import Alloc, Block
from moeshard.parallel.layout import LayoutError
from moeshard.parallel.state import ParallelState
from moeshard.runtime import invariance


def check_heads(att: AttentionConfig, tp: int) -> None:
    if att.heads % tp:
        raise LayoutError(f"TP={tp} does not divide the {att.heads} attention heads.")
    if att.kv_heads % tp and tp % att.kv_heads:
        raise LayoutError(f"TP={tp} and the {att.kv_heads} KV heads do not divide one another.")


def kv_head_block(att: AttentionConfig, parallel: ParallelState) -> slice:
    """This rank's KV heads: a block of them, or the one it shares with TP / kv_heads ranks."""
    tp, t = parallel.layout.tp, parallel.tp_rank
    if att.kv_heads >= tp:
        return block(att.kv_heads, t, tp)
    head = t * att.kv_heads // tp
    return slice(head, head + 1)


def heads_rows(heads: slice, dim: int) -> slice:
    return slice(heads.start * dim, heads.stop * dim)


class Linear(nn.Module):
    """A block of checkpoint linear `name` (`shape` = [out, in]): `rows` and `cols` of
    `name.weight` (stored in the kernels' panels where they serve it), and the same rows of `name.bias`."""

    def __init__(
        self, alloc: Alloc, name: str, shape: tuple[int, int], rows=slice(None), cols=slice(None), bias: bool = False
    ):
        super().__init__()
        O, I = size(rows, shape[0]), size(cols, shape[1])
        self.layout = packed.for_linear((O, I), alloc.dtype, alloc.device, name, alloc.quantized(name))
        self.weight_OI = alloc((O, I), Block(f"{name}.weight", shape, (rows, cols)), layout=self.layout)
        self.bias_O = alloc((O,), Block(f"{name}.bias", shape[:1], (rows,))) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.layout.packed:
            return F.linear(x, self.weight_OI, self.bias_O)
        y = self.layout.linear(x, self.weight_OI)
        return y if self.bias_O is None else y + self.bias_O


class AttentionBase(nn.Module, kv_cache.AttentionLayer):
    """Registration with the attention op, the output projection and the TP reduction."""

    def __init__(self, name: str, cfg: ModelConfig, window: int | None, parallel: ParallelState):
        super().__init__()
        att = cfg.attention
        check_heads(att, parallel.layout.tp)
        self.name, self.scale, self.window, self.cache = name, att.softmax_scale, window, None
        self.heads = block(att.heads, parallel.tp_rank, parallel.layout.tp)
        self.num_heads = self.heads.stop - self.heads.start
        self.comm = TPComm(parallel)
        kv_cache.register(name, self)

    def add_o_proj(self, alloc: Alloc, prefix: str, cfg: ModelConfig) -> None:
        att, D = cfg.attention, cfg.hidden
        cols = heads_rows(self.heads, att.v_head_dim)
        self.o_proj = Linear(alloc, f"{prefix}.o_proj", (D, att.heads * att.v_head_dim), cols=cols)
        # A row-parallel bias is added once, after the reduction.
        self.o_bias_D = alloc((D,), Block(f"{prefix}.o_proj.bias", (D,))) if att.o_bias else None

    def project_out(self, o_THe: torch.Tensor) -> torch.Tensor:
        out_TD = self.comm.reduce(self.o_proj(o_THe.flatten(1)))
        return out_TD if self.o_bias_D is None else out_TD + self.o_bias_D

    def set_cache(self, cache: KVCache | None) -> None:
        self.cache = cache


class Attention(AttentionBase):
    """GQA with optional q/k/v bias and Qwen3's per-head QK RMSNorm."""

    def __init__(self, alloc: Alloc, prefix: str, name: str, cfg: ModelConfig, window, parallel: ParallelState):
        super().__init__(name, cfg, window, parallel)
        att, D = cfg.attention, cfg.hidden
        Dh, bias = att.head_dim, att.qkv_bias
        self.kv_heads = kv_head_block(att, parallel)
        self.q_proj = Linear(alloc, f"{prefix}.q_proj", (att.heads * Dh, D), heads_rows(self.heads, Dh), bias=bias)
        kv_rows = heads_rows(self.kv_heads, Dh)
        self.k_proj = Linear(alloc, f"{prefix}.k_proj", (att.kv_heads * Dh, D), kv_rows, bias=bias)
        self.v_proj = Linear(alloc, f"{prefix}.v_proj", (att.kv_heads * Dh, D), kv_rows, bias=bias)
        self.add_o_proj(alloc, prefix, cfg)
        self.q_norm = self.k_norm = None
        if att.qk_norm:
            self.q_norm = RMSNorm(alloc, f"{prefix}.q_norm", Dh, cfg.rms_eps)
            self.k_norm = RMSNorm(alloc, f"{prefix}.k_norm", Dh, cfg.rms_eps)
        self.head_dim = Dh

    def cache_spec(self) -> CacheSpec:
        G = self.kv_heads.stop - self.kv_heads.start
        return CacheSpec(G, self.head_dim, self.head_dim)

    def forward(self, x_TD: torch.Tensor, positions_T: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        x_TD = self.comm.gather_rows(x_TD)
        T = x_TD.shape[0]
        q_THd = self.q_proj(x_TD).view(T, -1, self.head_dim)
        k_TGd = self.k_proj(x_TD).view(T, -1, self.head_dim)
        v_TGd = self.v_proj(x_TD).view(T, -1, self.head_dim)
        if self.q_norm is not None:
            q_THd, k_TGd = self.q_norm(q_THd), self.k_norm(k_TGd)
        q_THd, k_TGd = rotary(q_THd, positions_T), rotary(k_TGd, positions_T)
        o_THd = kv_cache.paged_attention(q_THd, k_TGd, v_TGd, self.name)
        return self.project_out(o_THd)


class LatentAttention(AttentionBase):
    """DeepSeek-V3's MLA, computed over the cached latent (see the module docstring)."""

    def __init__(self, alloc: Alloc, prefix: str, name: str, cfg: ModelConfig, window, parallel: ParallelState):
        super().__init__(name, cfg, window, parallel)
        att, D = cfg.attention, cfg.hidden
        self.att = att
        nope, rope, C, Dv = att.qk_nope_head_dim, att.qk_rope_head_dim, att.kv_lora_rank, att.v_head_dim
        q_rows = heads_rows(self.heads, att.head_dim)
        bias = att.qkv_bias
        if att.q_lora_rank:
            R = att.q_lora_rank
            self.q_a_proj = Linear(alloc, f"{prefix}.q_a_proj", (R, D), bias=bias)
            self.q_a_norm = RMSNorm(alloc, f"{prefix}.q_a_layernorm", R, cfg.rms_eps)
            self.q_b_proj = Linear(alloc, f"{prefix}.q_b_proj", (att.heads * att.head_dim, R), q_rows)
        else:
            self.q_proj = Linear(alloc, f"{prefix}.q_proj", (att.heads * att.head_dim, D), q_rows)
        self.kv_a_proj = Linear(alloc, f"{prefix}.kv_a_proj_with_mqa", (C + rope, D), bias=bias)
        self.kv_a_norm = RMSNorm(alloc, f"{prefix}.kv_a_layernorm", C, cfg.rms_eps)
        # kv_b_proj holds each head's key rows then its value rows: this rank's heads, split per head.
        H = self.num_heads
        kv_b = dict(
            name=f"{prefix}.kv_b_proj.weight",
            shape=(att.heads * (nope + Dv), C),
            index=(heads_rows(self.heads, nope + Dv),),
            view=(H, nope + Dv, C),
        )
        # Batch-invariant mode: the per-head products on moeshard.kernels (einsum's bmm may choose
        # its kernel by the batch), the weights stored as panels per head (the key's transposed).
        self.per_head_kernels = invariance.batch_invariant()
        uk, uv = packed.Plain((H, nope, C)), packed.Plain((H, Dv, C))
        if self.per_head_kernels:
            what = f"{prefix}.kv_b_proj"
            uk = packed.TransposedPanels(uk.shape, packed.for_linear((H, C, nope), alloc.dtype, alloc.device, what))
            uv = packed.for_linear(uv.shape, alloc.dtype, alloc.device, what)
        self.w_uk_Hnc = alloc(uk.shape, Block(**kv_b, pick=(slice(None), slice(0, nope))), layout=uk)
        self.w_uv_Hec = alloc(uv.shape, Block(**kv_b, pick=(slice(None), slice(nope, None))), layout=uv)
        self.add_o_proj(alloc, prefix, cfg)

    def cache_spec(self) -> CacheSpec:
        return CacheSpec(1, self.att.kv_lora_rank + self.att.qk_rope_head_dim, self.att.kv_lora_rank)

    def forward(self, x_TD: torch.Tensor, positions_T: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        att = self.att
        x_TD = self.comm.gather_rows(x_TD)
        T = x_TD.shape[0]
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x_TD))) if att.q_lora_rank else self.q_proj(x_TD)
        q_nope_THn, q_rope_THr = q.view(T, -1, att.head_dim).split([att.qk_nope_head_dim, att.qk_rope_head_dim], -1)
        latent_Tc, k_rope_Tr = self.kv_a_proj(x_TD).split([att.kv_lora_rank, att.qk_rope_head_dim], -1)
        latent_T1c = self.kv_a_norm(latent_Tc).unsqueeze(1)
        k_rope_T1r = rotary(k_rope_Tr.unsqueeze(1), positions_T)
        if self.per_head_kernels:
            q_latent_THc = per_head(q_nope_THn, self.w_uk_Hnc, att.kv_lora_rank)
        else:
            q_latent_THc = torch.einsum("thn,hnc->thc", q_nope_THn, self.w_uk_Hnc)
        q_THd = torch.cat([q_latent_THc, rotary(q_rope_THr, positions_T)], dim=-1)
        k_T1d = torch.cat([latent_T1c, k_rope_T1r], dim=-1)
        o_latent_THc = kv_cache.paged_attention(q_THd, k_T1d, latent_T1c, self.name)
        if self.per_head_kernels:
            return self.project_out(per_head(o_latent_THc, self.w_uv_Hec, att.v_head_dim))
        return self.project_out(torch.einsum("thc,hec->the", o_latent_THc, self.w_uv_Hec))


def per_head(x_THi: torch.Tensor, packed_H: torch.Tensor, out_features: int) -> torch.Tensor:
    """Head h of `x_THi` times head h of a weight stored as panels per head: [T, H, out_features]."""
    return torch.stack([kernels.linear(x_THi[:, h], packed_H[h], out_features) for h in range(x_THi.shape[1])], 1)
