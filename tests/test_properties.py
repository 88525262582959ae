"""Property tests: token counts (0, 1, fewer than TP, uneven across DP), top-k, expert counts, and
routings that send every token to one expert or to one rank, on 2- and 4-rank layouts."""

import pytest
import rank_cases
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeshard.parallel import Layout
from moeshard.verify.layer import TOLERANCE

LAYOUTS = {
    2: [Layout(tp=2, ep=True), Layout(tp=2, ep=True, sp=True), Layout(dp=2, ep=True), Layout(tp=2), Layout(dp=2, sp=False)],
    4: [Layout(tp=2, dp=2, ep=True), Layout(tp=2, dp=2, ep=True, sp=True), Layout(tp=4, ep=True, sp=True), Layout(dp=4, ep=True), Layout(tp=2, dp=2)],
}
TOKEN_COUNTS = st.sampled_from([0, 1, 2, 3, 5, 9])


@st.composite
def examples(draw, world):
    layout = draw(st.sampled_from(LAYOUTS[world]))
    num_experts = world * draw(st.sampled_from([1, 2, 4]))
    top_k = draw(st.integers(1, min(4, num_experts)))
    tokens = draw(st.lists(TOKEN_COUNTS, min_size=layout.dp, max_size=layout.dp))
    routing = draw(st.sampled_from(["learned", "one_expert", "one_rank"]))
    if routing == "one_rank" and num_experts // layout.ep_size < top_k:
        routing = "one_expert"
    methods = ["auto", "allgather"] + (["alltoall", "mc2", "fused_mc2"] if layout.ep else [])
    method = draw(st.sampled_from(methods))
    return layout, num_experts, top_k, tokens, routing, method, draw(st.integers(0, 1000))


def check(ranks, example):
    per_rank = ranks.run(rank_cases.property_case, *example)
    err = max(r[0] for r in per_rank)
    scale = max(max(r[1] for r in per_rank), 1e-30)
    assert err <= TOLERANCE * scale or scale == 1e-30 and err == 0.0, (example, err, scale)
    assert len({r[2] for r in per_rank}) == 1, "ranks disagreed on the method"


PROPERTY_SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


@PROPERTY_SETTINGS
@given(example=examples(2))
def test_two_ranks(ranks2, example):
    check(ranks2, example)


@PROPERTY_SETTINGS
@given(example=examples(4))
def test_four_ranks(ranks4, example):
    check(ranks4, example)


@pytest.mark.parametrize("tokens", [[0, 0], [0, 1], [1, 0]])
def test_all_or_nearly_all_dp_groups_empty(ranks2, tokens):
    for method in ("allgather", "alltoall", "mc2", "fused_mc2"):
        check(ranks2, (Layout(dp=2, ep=True), 4, 2, tokens, "learned", method, 1))
