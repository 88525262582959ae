import pytest
import torch

from moeshard.moe import experts
from moeshard.moe.experts import group_by_expert, grouped_linear, grouped_swiglu


def test_group_by_expert_puts_foreign_rows_last():
    labels = torch.tensor([2, 0, 3, 1, 0, 3, 2])  # 3 = not computed here
    order, ends = group_by_expert(labels, 3)
    assert labels[order].tolist() == [0, 0, 1, 2, 2, 3, 3]
    assert ends.tolist() == [2, 3, 5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_equals_per_expert_loop(dtype, monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(20, 16, dtype=dtype)
    w13 = torch.randn(3, 32, 16, dtype=dtype)  # [L, F, D]
    w2 = torch.randn(3, 16, 16, dtype=dtype)  # [L, D, I]
    ends = torch.tensor([4, 4, 15], dtype=torch.int32)  # an empty expert, and 5 rows not computed
    fast = grouped_swiglu(x, w13, w2, ends)
    monkeypatch.setattr(experts, "_grouped_mm_fits", lambda *_: False)
    slow = grouped_swiglu(x, w13, w2, ends)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fast[:15], slow[:15], rtol=tol, atol=tol)
    computed = fast[:15].clone()
    experts.zero_rows_past_groups_(fast, ends)
    assert (fast[15:] == 0).all() and fast[:15].equal(computed)
    ref = torch.cat([x[:4] @ w13[0].T, x[4:15] @ w13[2].T])
    torch.testing.assert_close(grouped_linear(x, w13.transpose(1, 2), ends)[:15].float(), ref.float(), rtol=tol, atol=tol * 10)


def test_unaligned_shapes_fall_back_to_the_loop():
    x = torch.randn(6, 5)
    w = torch.randn(2, 5, 3)
    ends = torch.tensor([2, 6], dtype=torch.int32)
    torch.testing.assert_close(grouped_linear(x, w, ends), torch.cat([x[:2] @ w[0], x[2:] @ w[1]]))
