"""Compile once under one method, replay under every other (docs/DESIGN.md §4).

The runtime-aware layer equals the reference for every (trace, run) pair. The naive layer, which
branches in Python on the method, passes eagerly and on same-method replays but fails where the
trace and run methods disagree on "already reduced" — the same test sees the first seed's bug.
"""

import pytest

from moeshard.parallel import Layout
from moeshard.verify.layer import TOLERANCE, Group, build, case_error
from moeshard.verify.naive import NaiveMoELayer
from moeshard.verify.replay import merge_pairs, run_replay

MIXED = {("allgather", "alltoall"), ("allgather", "mc2"), ("allgather", "fused_mc2"),
         ("alltoall", "allgather"), ("mc2", "allgather"), ("fused_mc2", "allgather")}


def naive_eager(group, seed):
    built = build(group, seed)
    layer = built.layer(NaiveMoELayer)
    return [case_error(layer, built, m) for m in ("allgather", "alltoall", "mc2", "fused_mc2")]


@pytest.mark.parametrize(
    "world, layout, shared, transform",
    [
        (2, Layout(tp=2, ep=True), "tp", "none"),
        (2, Layout(tp=2, ep=True), "dp", "nonlinear"),
        (4, Layout(tp=2, dp=2, ep=True), "gated", "none"),
        (4, Layout(tp=2, dp=2, ep=True), "none", "nonlinear"),
    ],
    ids=["tp2-sharedtp", "tp2-shareddp-transform", "2x2-gated", "2x2-transform"],
)
def test_replay_catches_the_naive_layer(request, world, layout, shared, transform):
    ranks = request.getfixturevalue(f"ranks{world}")
    group = Group(layout, shared, transform, "grouped_sigmoid")
    aware = merge_pairs(ranks.run(run_replay, group, 3, False))
    assert len(aware) == 16
    assert all(err <= TOLERANCE for err in aware.values()), aware
    naive = merge_pairs(ranks.run(run_replay, group, 3, True))
    failing = {pair for pair, err in naive.items() if err > TOLERANCE}
    if shared == "tp" or shared == "gated":
        assert failing == MIXED, naive
    else:  # routed reduced early: only ALLGATHER's missing reduction shows
        assert failing and failing <= MIXED, naive
    # Eagerly the naive layer is right: graph replay, not the layer's arithmetic, exposes it.
    for per_rank in zip(*ranks.run(naive_eager, group, 3)):
        assert max(e for e, _ in per_rank) <= TOLERANCE * max(s for _, s in per_rank)


def test_replay_under_sp(ranks2):
    group = Group(Layout(tp=2, ep=True, sp=True), "tp", "nonlinear", "softmax_topk")
    aware = merge_pairs(ranks2.run(run_replay, group, 4, False))
    assert all(err <= TOLERANCE for err in aware.values()), aware
