import multiprocessing

import pytest

from moeshard.parallel import Layout, LayoutError
from moeshard.parallel.launch import open_layout


def test_rank_numbering():
    layout = Layout(tp=2, dp=3)
    assert [(layout.dp_rank(r), layout.tp_rank(r)) for r in range(6)] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)
    ]
    assert Layout(tp=2, dp=2, ep=True).ep_size == 4
    assert Layout(tp=2, dp=2).ep_size == 1


@pytest.mark.parametrize(
    "layout, sizes, cause",
    [
        (Layout(tp=2, dp=2, ep=True), dict(num_experts=6), "6 experts cannot be split evenly over an EP group of 4"),
        (Layout(tp=4), dict(intermediate=6), "TP=4 does not divide the expert intermediate size 6"),
        (Layout(tp=4), dict(shared_intermediate=10), "shared-expert intermediate size 10"),
        (Layout(tp=2, dp=2), dict(world_size=3), "world size 3 does not equal DP × TP"),
    ],
)
def test_impossible_layouts_are_refused_before_any_process_starts(layout, sizes, cause):
    before = len(multiprocessing.active_children())
    with pytest.raises(LayoutError, match=cause):
        open_layout(layout, **sizes)
    assert len(multiprocessing.active_children()) == before


def test_ep_on_ignores_intermediate_divisibility():
    Layout(tp=4, ep=True).validate(num_experts=8, intermediate=6)


def test_parse():
    assert Layout.parse("2x2-ep") == Layout(tp=2, dp=2, ep=True)
    assert Layout.parse("1x2-ep-sp") == Layout(tp=1, dp=2, ep=True, sp=True)
    with pytest.raises(LayoutError, match="TPxDP"):
        Layout.parse("two")
    with pytest.raises(LayoutError, match="unknown flag"):
        Layout.parse("2x1-xp")
