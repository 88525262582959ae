"""`moeshard verify layer` over world sizes 1, 2 and 4: the whole parity matrix, as users run it."""

import json
import subprocess
import sys
from collections import Counter

import pytest

KEYS = {"method", "tp", "dp", "ep", "sp", "shared", "transform", "router", "compiled", "max_abs_err", "passed"}


@pytest.mark.xdist_group("matrix")
def test_verify_layer_matrix(tmp_path):
    out_json, out_md = tmp_path / "layer.json", tmp_path / "layer.md"
    proc = subprocess.run(
        [sys.executable, "-m", "moeshard", "verify", "layer", "--world-sizes", "1,2,4",
         "--json", str(out_json), "--markdown", str(out_md)],
        capture_output=True, text=True, timeout=3000,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out_json.read_text())
    assert all(set(r) == KEYS for r in rows)
    assert all(r["passed"] for r in rows)
    assert {r["method"] for r in rows} == {"allgather", "alltoall", "mc2", "fused_mc2", "auto"}
    assert {(r["tp"], r["dp"]) for r in rows} >= {(1, 1), (2, 1), (1, 2), (4, 1), (2, 2), (1, 4)}
    assert {r["shared"] for r in rows} == {"none", "tp", "dp", "gated"}
    assert Counter(r["compiled"] for r in rows) == {True: len(rows) // 2, False: len(rows) // 2}
    assert {(r["ep"], r["sp"]) for r in rows} == {(True, True), (True, False), (False, True), (False, False)}
    assert max(r["max_abs_err"] for r in rows) < 1e-4
    assert "PASS" in proc.stdout and "cases passed" in proc.stdout
    assert out_md.read_text().count("\n| ") == len(rows) + 1
