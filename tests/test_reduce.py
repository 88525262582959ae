"""The reduction table (docs/DESIGN.md §3), checked on a scalar model of every rank's partial sums.

Each TP rank holds a partial routed value r_t (or the complete R = Σ r_t when the method already
reduced it) and a shared value (partial s_t in TP layout, complete S in DP layout). Walking the
three points with the plan and the runtime rule must leave every rank with f(R) + S: each partial
sum reduced exactly once, the transform applied to complete values only.
"""

import itertools
import math
import random

import pytest

from moeshard.moe.config import SharedLayout
from moeshard.moe.dispatch import DISPATCHERS, CommMethod
from moeshard.moe.reduce import Point, ReductionPlan, already_reduced, reduces_now
from moeshard.parallel import Layout


def transform(v):
    return math.tanh(v) + 0.5 * v * v


def simulate(layout: Layout, method: CommMethod, shared: SharedLayout | None, has_transform: bool, rule=reduces_now):
    rng = random.Random(hash((layout, method, shared, has_transform)))
    tp = layout.tp
    r = [rng.uniform(-1, 1) for _ in range(tp)]
    s = [rng.uniform(-1, 1) for _ in range(tp)]
    expected = (transform(sum(r)) if has_transform else sum(r)) + (sum(s) if shared else 0.0)
    plan = ReductionPlan.for_layer(shared, has_transform, layout)
    reduced = already_reduced(method, layout.sp)
    routed = [sum(r)] * tp if reduced else list(r)
    reduce = lambda values: [sum(values)] * tp  # noqa: E731

    def at(point, values):
        return reduce(values) if rule(point, method, layout.sp, plan.routed_early) else values

    if plan.routed_early:
        routed = at(Point.ROUTED_EARLY, routed)
    if has_transform:
        routed = [transform(v) for v in routed]
    out = routed
    if shared is not None:
        shared_values = list(s) if shared is SharedLayout.TENSOR_PARALLEL else [sum(s)] * tp
        if plan.shared:
            shared_values = at(Point.SHARED, shared_values)
        out = [a + b for a, b in zip(routed, shared_values)]
    if plan.final:
        out = at(Point.FINAL, out)
    return all(math.isclose(v, expected, rel_tol=1e-12, abs_tol=1e-12) for v in out)


LAYOUTS = [Layout(tp=tp, dp=dp, ep=ep, sp=sp) for tp, dp, ep, sp in itertools.product((1, 2, 4), (1, 2), (False, True), (False, True)) if not (sp and tp == 1)]
SHARED = [None, SharedLayout.TENSOR_PARALLEL, SharedLayout.DATA_PARALLEL]


def combos():
    for layout, method, shared, has_transform in itertools.product(LAYOUTS, CommMethod, SHARED, (False, True)):
        if DISPATCHERS[method].needs_ep and not layout.ep:
            continue
        # The scalar model says the ALLGATHER routed output is a partial over TP without SP, which
        # is what the layer produces; under SP every method's output is complete.
        yield layout, method, shared, has_transform


def test_already_reduced_table():
    assert not already_reduced(CommMethod.ALLGATHER, sp=False)
    assert already_reduced(CommMethod.ALLGATHER, sp=True)
    for method in (CommMethod.ALLTOALL, CommMethod.MC2, CommMethod.FUSED_MC2):
        assert already_reduced(method, sp=False) and already_reduced(method, sp=True)


@pytest.mark.parametrize("combo", list(combos()), ids=lambda c: f"{c[0].label()}-{c[1].value}-{c[2] and c[2].value}-{c[3]}")
def test_every_partial_sum_reduced_exactly_once(combo):
    assert simulate(*combo)


def test_the_model_catches_a_rule_that_ignores_the_method():
    """Negative control: the shared point reducing by static config alone (the first seed's bug)."""

    def static_rule(point, method, sp, routed_early):
        return reduces_now(point, CommMethod.ALLGATHER, sp, routed_early)

    failures = [c for c in combos() if not simulate(*c, rule=static_rule)]
    assert failures, "the scalar model must be able to fail"
    assert all(c[1] is not CommMethod.ALLGATHER for c in failures)


def test_points_exist_as_the_design_says():
    tp2 = Layout(tp=2)
    assert ReductionPlan.for_layer(SharedLayout.TENSOR_PARALLEL, False, tp2) == ReductionPlan(False, True, True)
    assert ReductionPlan.for_layer(SharedLayout.DATA_PARALLEL, False, tp2) == ReductionPlan(True, False, False)
    assert ReductionPlan.for_layer(None, True, tp2) == ReductionPlan(True, False, False)
    assert ReductionPlan.for_layer(None, True, Layout()) == ReductionPlan(False, False, True)
    assert ReductionPlan.for_layer(None, True, Layout(dp=2, ep=True)) == ReductionPlan(True, False, False)
    assert ReductionPlan.for_layer(SharedLayout.TENSOR_PARALLEL, True, Layout(tp=2, sp=True)) == ReductionPlan(False, True, False)
