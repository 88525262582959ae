"""Top-k routing: softmax or sigmoid scores, optional grouped selection with a correction bias.

Everything here is computed in fp32 and is replicated on every rank (the router is cheap and its
decisions must agree bit for bit wherever a token is routed).
"""

from __future__ import annotations

import torch
from torch import nn

from moeshard import kernels
from moeshard.kernels import packed
from moeshard.moe.config import RouterConfig
from moeshard.moe.functional import sigmoid
from moeshard.moe.weights import empty_param
from moeshard.runtime import invariance


def route(logits_TE: torch.Tensor, cfg: RouterConfig, score_bias_E: torch.Tensor | None = None):
    """Return (topk_ids_TK int64, topk_weights_TK fp32) for fp32 router logits.

    With a score bias (DeepSeek-V3), the bias steers which experts (and groups) are chosen, while
    the weights come from the unbiased scores.
    """
    T, E = logits_TE.shape
    scores_TE = logits_TE.softmax(dim=-1) if cfg.scoring == "softmax" else sigmoid(logits_TE)
    choice_TE = scores_TE if score_bias_E is None else scores_TE + score_bias_E
    if cfg.n_group > 1:
        choice_TGe = choice_TE.view(T, cfg.n_group, E // cfg.n_group)
        # A group's merit: the sum of its best two choice scores (its best one if groups are singletons).
        group_score_TG = choice_TGe.topk(min(2, E // cfg.n_group), dim=-1).values.sum(dim=-1)
        best_groups_TG = group_score_TG.topk(cfg.topk_group, dim=-1).indices
        group_mask_TG = torch.zeros_like(group_score_TG, dtype=torch.bool).scatter(1, best_groups_TG, True)
        expert_mask_TE = group_mask_TG.repeat_interleave(E // cfg.n_group, dim=1)
        choice_TE = choice_TE.masked_fill(~expert_mask_TE, float("-inf"))
    topk_ids_TK = choice_TE.topk(cfg.top_k, dim=-1).indices
    topk_weights_TK = scores_TE.gather(1, topk_ids_TK)
    if cfg.renormalize:
        topk_weights_TK = topk_weights_TK / (topk_weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_ids_TK, topk_weights_TK * cfg.routed_scaling


class Router(nn.Module):
    """Allocated empty (fp32, whatever the layer's dtype); MoELayer or a model loader fills it."""

    def __init__(self, cfg: RouterConfig, num_experts: int, hidden: int, device):
        super().__init__()
        self.cfg = cfg
        # Batch-invariant mode: the logits on moeshard.kernels, whose rows do not depend on the batch
        # (torch's fp32 `mm` does), the weight stored as their panels; the MoE layer then routes
        # outside compiled code.
        shape = (num_experts, hidden)
        self.layout = packed.for_linear(shape, torch.float32, device, "the router") if invariance.batch_invariant() else None
        self.weight_ED = empty_param(shape, torch.float32, device, self.layout)
        self.score_bias_E = empty_param((num_experts,), torch.float32, device) if cfg.score_bias else None

    def forward(self, x_TD: torch.Tensor):
        if self.layout is not None:
            logits_TE = self.layout.linear(x_TD.float(), self.weight_ED)
        else:
            logits_TE = x_TD.float() @ self.weight_ED.T
        return route(logits_TE, self.cfg, self.score_bias_E)
