"""The router against transformers' own routers on the same weights."""

import pytest
import torch
from transformers import DeepseekV3Config, Qwen3MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from moeshard.moe.config import RouterConfig
from moeshard.moe.router import route


def sorted_by_id(ids, weights):
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_topk_matches_qwen3(norm):
    torch.manual_seed(0)
    hf = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm))
    hf.weight.data.normal_(0, 1.0)
    x = torch.randn(50, 32)
    _, hf_w, hf_ids = hf(x)
    ids, w = route(x @ hf.weight.T, RouterConfig(top_k=4, scoring="softmax", renormalize=norm))
    (a, aw), (b, bw) = sorted_by_id(ids, w), sorted_by_id(hf_ids, hf_w)
    assert torch.equal(a, b)
    torch.testing.assert_close(aw, bw)


def test_grouped_sigmoid_with_bias_matches_deepseek_v3():
    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5,
    )
    hf = DeepseekV3TopkRouter(cfg)
    hf.weight.data.normal_(0, 1.0)
    hf.e_score_correction_bias.data.normal_(0, 0.5)
    x = torch.randn(50, 32)
    _, hf_w, hf_ids = hf(x)
    router = RouterConfig(top_k=4, scoring="sigmoid", n_group=4, topk_group=2, score_bias=True, routed_scaling=2.5)
    ids, w = route(x @ hf.weight.T, router, hf.e_score_correction_bias)
    (a, aw), (b, bw) = sorted_by_id(ids, w), sorted_by_id(hf_ids, hf_w)
    assert torch.equal(a, b)
    torch.testing.assert_close(aw, bw)
    # The bias steers the choice but never enters the weights.
    scores = torch.sigmoid(x @ hf.weight.T)
    unbiased = scores.gather(1, a)
    torch.testing.assert_close(aw, unbiased / unbiased.sum(-1, keepdim=True) * 2.5)


def test_selected_experts_lie_in_the_chosen_groups():
    torch.manual_seed(1)
    logits = torch.randn(200, 16)
    ids, _ = route(logits, RouterConfig(top_k=3, scoring="sigmoid", n_group=4, topk_group=1))
    groups = ids // 4
    assert (groups == groups[:, :1]).all()


@pytest.mark.parametrize(
    "bad, cause",
    [
        (RouterConfig(top_k=0), "top_k=0"),
        (RouterConfig(n_group=3), "n_group=3 does not divide"),
        (RouterConfig(top_k=4, n_group=8, topk_group=1), "exceeds the 1 experts"),
        (RouterConfig(scoring="relu"), "scoring"),
    ],
)
def test_bad_router_config(bad, cause):
    with pytest.raises(ValueError, match=cause):
        bad.validate(8)
