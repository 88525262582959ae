"""The `moeshard` command."""

from __future__ import annotations

import argparse
import sys
import warnings


def int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} must list positive integers")
    return values


def verify_layer(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from moeshard.verify import layer as matrix
    from moeshard.verify import report

    from moeshard.parallel.launch import is_reporting_rank

    console = report.console(quiet=not is_reporting_rank())
    world_sizes = matrix.world_sizes_to_run(args.world_sizes)
    total = sum(len(matrix.groups_for(w)) for w in world_sizes)
    with Progress(
        TextColumn("[bold]verify layer[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
        TimeElapsedColumn(), console=console,
    ) as progress:
        task = progress.add_task("", total=total)

        def on_group(group, rows):
            for row in rows:
                progress.console.print(report.case_line(row))
            progress.update(task, advance=1, description=group.layout.label())

        rows = matrix.run_matrix(world_sizes, seed=args.seed, on_group=on_group)
    console.print(report.summary_table(rows))
    failed = [r for r in rows if not r.passed]
    console.print(f"{len(rows) - len(failed)}/{len(rows)} cases passed.")
    if args.json and is_reporting_rank():
        report.write_json(rows, args.json)
    if args.markdown and is_reporting_rank():
        report.write_markdown(rows, args.markdown)
    return 1 if failed else 0


def bench_layer(args: argparse.Namespace) -> int:
    from moeshard.bench.layer import run_bench_layer

    return run_bench_layer(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moeshard", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    verify = commands.add_parser("verify", help="prove parallel paths equal the single-device answer")
    verify_what = verify.add_subparsers(dest="what", required=True)
    layer = verify_what.add_parser("layer", help="the MoE layer's parity matrix")
    layer.add_argument("--world-sizes", type=int_list, default=[1, 2, 4], help="e.g. 1,2,4")
    layer.add_argument("--json", metavar="PATH", help="write every case as JSON")
    layer.add_argument("--markdown", metavar="PATH", help="write every case as a Markdown table")
    layer.add_argument("--seed", type=int, default=0)
    layer.set_defaults(run=verify_layer)

    bench = commands.add_parser("bench", help="benchmarks against a peer measured in the same run")
    bench_what = bench.add_subparsers(dest="what", required=True)
    blayer = bench_what.add_parser("layer", help="the MoE layer vs. transformers' MoE blocks and a dense GEMM")
    blayer.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    blayer.add_argument("--repeats", type=int, default=5)
    blayer.add_argument("--json", metavar="PATH")
    blayer.set_defaults(run=bench_layer)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        return args.run(args)
    except (ValueError, RuntimeError) as exc:  # bad input or a failed rank: one line, no traceback wall
        print(f"moeshard: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
