"""The `moeshard` command: an expert-parallel MoE engine that proves every parallel path equals
one device. Commands by group (serve, run, prove, benchmark):"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings

from moeshard.commandline import LOG_FORMAT, Registry


def build_parser() -> argparse.ArgumentParser:
    """Every command group adds its own commands (each next to the code it drives); `moeshard --help`
    lists them by group, one line each."""
    from moeshard.bench import commands as bench
    from moeshard.demos import commands as run
    from moeshard.serve import commands as serve
    from moeshard.verify import commands as prove

    parser = argparse.ArgumentParser(prog="moeshard", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    registry = Registry(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    for group in (serve, run, prove, bench):
        group.add_commands(registry)
    parser.epilog = registry.grouped_help()
    return parser


def run_on_torchrun(args: argparse.Namespace) -> int:
    """One engine over all of torchrun's ranks: rank 0 drives it (and alone prints and writes files),
    the others serve it headless until it is done. Every rank checks the layouts first, so a
    mismatch is one error before any collective."""
    import os

    from moeshard.engine.llm import check_world
    from moeshard.engine.ranks import release_torchrun, serve_torchrun

    for layout in args.layouts_of(args):
        check_world(layout)
    if int(os.environ["RANK"]) != 0:
        serve_torchrun()
        return 0
    try:
        return args.run(args)
    finally:
        release_torchrun()


def main(argv: list[str] | None = None) -> int:
    from moeshard.parallel.launch import under_torchrun

    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    # Errors the engine logs (a lost rank) reach stderr at once, with their time.
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    if under_torchrun() and hasattr(args, "layouts_of"):
        exit_without_finalizing(reporting_errors(run_on_torchrun, args))
    return reporting_errors(args.run, args)


def reporting_errors(run, args: argparse.Namespace) -> int:
    try:
        return run(args)
    except (ValueError, RuntimeError, OSError) as exc:  # bad input or a failed rank: one line, no traceback wall
        print(f"moeshard: error: {exc}", file=sys.stderr)
        return 2


def exit_without_finalizing(code: int) -> None:
    """End a torchrun rank once its groups are destroyed. gloo's worker threads outlive
    destroy_process_group, and one still releasing the last collective's tensor needs the GIL: if
    the interpreter is finalizing by then, the thread is unwound inside a noexcept destructor and
    the rank aborts (SIGABRT) after a run that succeeded, failing the whole torchrun job."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    raise SystemExit(main())
