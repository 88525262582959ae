"""Showing verification results: a line per case as it finishes, a summary table, JSON and Markdown."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

from moeshard.verify.layer import CaseResult


def case_line(row: CaseResult) -> str:
    verdict = "[green]PASS[/]" if row.passed else "[bold red]FAIL[/]"
    text = (
        f"{verdict} {row.method:<9} tp={row.tp} dp={row.dp} ep={'on ' if row.ep else 'off'} "
        f"sp={'on ' if row.sp else 'off'} shared={row.shared:<5} transform={row.transform:<9} "
        f"router={row.router:<15} {'compiled' if row.compiled else 'eager   '} "
        f"max|Δ|={row.max_abs_err:.2e} rel={row.rel_err:.2e}"
    )
    return text + (f"  [red]{row.error}[/]" if row.error else "")


def summary_table(rows: list[CaseResult]) -> Table:
    table = Table(title="MoE layer parity vs. single-device reference (fp32, rel ≤ 1e-5)")
    for column in ("method", "eager pass", "compiled pass", "worst rel err"):
        table.add_column(column, justify="right" if column != "method" else "left")
    for method in dict.fromkeys(r.method for r in rows):
        mine = [r for r in rows if r.method == method]
        count = Counter((r.compiled, r.passed) for r in mine)
        worst = max(r.rel_err for r in mine)
        table.add_row(
            method,
            f"{count[(False, True)]}/{count[(False, True)] + count[(False, False)]}",
            f"{count[(True, True)]}/{count[(True, True)] + count[(True, False)]}",
            f"{worst:.2e}",
        )
    return table


def write_json(rows: list[CaseResult], path: str) -> None:
    Path(path).write_text(json.dumps([r.to_json() for r in rows], indent=1))


def write_markdown(rows: list[CaseResult], path: str) -> None:
    head = "| method | tp | dp | ep | sp | shared | transform | router | compiled | max abs err | rel err | passed |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r.method} | {r.tp} | {r.dp} | {r.ep} | {r.sp} | {r.shared} | {r.transform} | {r.router} | "
            f"{r.compiled} | {r.max_abs_err:.2e} | {r.rel_err:.2e} | {'yes' if r.passed else '**no**'} |"
        )
    passed = sum(r.passed for r in rows)
    Path(path).write_text(f"# moeshard verify layer\n\n{passed}/{len(rows)} cases passed.\n\n" + "\n".join(lines) + "\n")


def console(quiet: bool = False) -> Console:
    """Under torchrun only rank 0 speaks."""
    return Console(highlight=False, quiet=quiet)
