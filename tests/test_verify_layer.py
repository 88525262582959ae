"""`moeshard verify layer` over world sizes 1, 2 and 4, as users run it: every layout, method, shared
expert kind and transform, eager and compiled, with the routers alternating over the groups (half
the full matrix's 2,112 cases; each router still meets every pair of layout, shared kind and
transform)."""

import itertools
import json
import subprocess
import sys
from collections import Counter

import pytest

KEYS = {"method", "tp", "dp", "ep", "sp", "shared", "transform", "router", "compiled", "max_abs_err", "passed"}


@pytest.mark.long_pole
@pytest.mark.xdist_group("matrix")
def test_verify_layer_matrix(tmp_path):
    out_json, out_md = tmp_path / "layer.json", tmp_path / "layer.md"
    proc = subprocess.run(
        [sys.executable, "-m", "moeshard", "verify", "layer", "--world-sizes", "1,2,4",
         "--alternate-routers", "--json", str(out_json), "--markdown", str(out_md)],
        capture_output=True, text=True, timeout=3000,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out_json.read_text())
    assert len(rows) == 2112 // 2
    assert all(set(r) == KEYS for r in rows)
    assert all(r["passed"] for r in rows)
    assert {r["method"] for r in rows} == {"allgather", "alltoall", "mc2", "fused_mc2", "auto"}
    assert {(r["tp"], r["dp"]) for r in rows} >= {(1, 1), (2, 1), (1, 2), (4, 1), (2, 2), (1, 4)}
    assert {r["shared"] for r in rows} == {"none", "tp", "dp", "gated"}
    assert Counter(r["router"] for r in rows) == {"softmax_topk": len(rows) // 2, "grouped_sigmoid": len(rows) // 2}
    assert Counter(r["compiled"] for r in rows) == {True: len(rows) // 2, False: len(rows) // 2}
    assert {(r["ep"], r["sp"]) for r in rows} == {(True, True), (True, False), (False, True), (False, False)}
    assert max(r["max_abs_err"] for r in rows) < 1e-4
    assert "PASS" in proc.stdout and "cases passed" in proc.stdout
    assert out_md.read_text().count("\n| ") == len(rows) + 1


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_alternating_routers_is_half_the_matrix_and_meets_every_pair(world_size):
    from moeshard.verify.layer import ROUTERS, groups_for

    full, half = groups_for(world_size), groups_for(world_size, alternate_routers=True)
    assert set(half) < set(full) and 2 * len(half) == len(full)
    for a, b in itertools.combinations(("layout", "shared", "transform"), 2):
        for pair in {(getattr(g, a), getattr(g, b)) for g in full}:
            assert {g.router for g in half if (getattr(g, a), getattr(g, b)) == pair} == set(ROUTERS), (a, b, pair)
