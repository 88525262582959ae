import time

import pytest
import rank_cases
import torch

from moeshard.moe import CommMethod, MoEConfig, MoELayer, MoEWeights, SelectionPolicy, moe_forward_context
from moeshard.moe.context import select_method
from moeshard.parallel import Layout, RankError, RankPool, set_layout


@pytest.fixture
def layer():
    set_layout(Layout())
    cfg = MoEConfig(hidden=16, num_experts=4, intermediate=8)
    return MoELayer(cfg, MoEWeights.random(cfg))


def test_wrong_dtype_is_one_clear_error(layer):
    with moe_forward_context(3), pytest.raises(ValueError, match=r"takes a \[tokens, 16\] tensor of torch.float32, got shape \(3, 16\) of torch.float64"):
        layer(torch.randn(3, 16, dtype=torch.float64))


@pytest.mark.parametrize("shape", [(3, 8), (3,), (2, 3, 16)])
def test_wrong_shape_is_one_clear_error(layer, shape):
    with moe_forward_context(3), pytest.raises(ValueError, match="takes a \\[tokens, 16\\] tensor"):
        layer(torch.randn(*shape))


def test_running_outside_a_forward_context_is_refused(layer):
    with pytest.raises(RuntimeError, match="outside moe_forward_context"):
        layer(torch.randn(3, 16))


def test_mc2_over_capacity_is_refused(layer):
    for method in (CommMethod.MC2, CommMethod.FUSED_MC2):
        with pytest.raises(ValueError, match="forced for 9 tokens per rank, over its capacity of 8"):
            with moe_forward_context(9, SelectionPolicy(mc2_capacity=8), method):
                pass


def test_selection_policy():
    policy = SelectionPolicy(mc2_capacity=16)
    assert select_method(100, 1, policy, None) is CommMethod.ALLGATHER
    assert select_method(16, 4, policy, None) is CommMethod.MC2
    assert select_method(17, 4, policy, None) is CommMethod.ALLTOALL
    assert select_method(3, 4, SelectionPolicy(mc2_capacity=16, fused_mc2=True), None) is CommMethod.FUSED_MC2
    assert select_method(100, 4, policy, CommMethod.ALLGATHER) is CommMethod.ALLGATHER


def test_unknown_method_name():
    with pytest.raises(ValueError, match="unknown communication method 'mc3'"):
        CommMethod.parse("mc3")


def test_duplicate_layer_name_is_refused(layer):
    with pytest.raises(ValueError, match="already exists"):
        MoELayer(layer.cfg, MoEWeights.random(layer.cfg), name=layer.name)


def test_multi_rank_errors_reach_the_caller_and_the_pool_survives(ranks2):
    with pytest.raises(RankError, match="over its capacity of 4"):
        ranks2.run(rank_cases.forced_run, Layout(tp=2, ep=True), "mc2", 5, 4)
    with pytest.raises(RankError, match="ALLTOALL needs expert parallelism"):
        ranks2.run(rank_cases.forced_run, Layout(tp=2, ep=False), "alltoall", 5, 4)
    with pytest.raises(RankError, match="bad input seen on rank"):
        ranks2.run(rank_cases.raise_everywhere)
    assert ranks2.run(rank_cases.forced_run, Layout(tp=2, ep=True), "mc2", 4, 4) == [torch.Size([4, 16])] * 2


def test_a_rank_dying_mid_collective_stops_every_rank():
    pool = RankPool(2)
    pool.run(rank_cases.rank_of_process)
    start = time.monotonic()
    with pytest.raises(RankError, match="rank 1: RankDied"):
        pool.run(rank_cases.die_in_collective, 1)
    assert time.monotonic() - start < 30
    assert not pool.alive and not any(p.is_alive() for p in pool._procs)
    with pytest.raises(RuntimeError, match="stopped after an earlier failure"):
        pool.run(rank_cases.rank_of_process)


def test_cli_refuses_an_impossible_world_size_in_one_line():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "moeshard", "verify", "layer", "--world-sizes", "3"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "moeshard: error: 8 experts cannot be split evenly over an EP group of 3 ranks."
