"""What every command group shares: its registration (one line of help, grouped; an example), the
arguments several groups take, and the log format (which the engine process keeps too). Each group's
parser lives next to the code it drives (`serve/commands.py`, `demos/commands.py`,
`verify/commands.py`, `bench/commands.py`); `cli.py` puts them together. Nothing here imports the
rest of moeshard, so `moeshard --help` stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
from dataclasses import dataclass, field

GROUPS = ("serve", "run", "prove", "benchmark")
LOG_FORMAT = "%(asctime)s %(levelname)s %(message)s"  # the CLI's and the engine process's
METHODS = ("auto", "allgather", "alltoall", "mc2", "fused_mc2")


@dataclass
class Registry:
    """Adds commands to a subparsers action and remembers each one's group and line of help."""

    commands: argparse._SubParsersAction
    lines: list[tuple[str, str, str]] = field(default_factory=list)  # (group, name, help)

    def command(self, group: str, name: str, summary: str, example: str, under=None) -> argparse.ArgumentParser:
        """A command (or, `under` a command's subparsers, a subcommand) with its summary and an example."""
        if group not in GROUPS:
            raise ValueError(f"unknown command group {group!r}; known: {', '.join(GROUPS)}.")
        # A subcommand is listed in its parent's help; a command only in the grouped list.
        listed = {} if under is None else {"help": summary}
        parser = (under or self.commands).add_parser(
            name.split()[-1], description=summary, epilog=f"example:\n  {example}",
            formatter_class=argparse.RawDescriptionHelpFormatter, **listed,
        )
        self.lines.append((group, name, summary))
        return parser

    def parent(self, name: str, summary: str, dest: str) -> argparse._SubParsersAction:
        """A command whose subcommands carry the work (`verify layer`, `bench e2e`): their subparsers."""
        parser = self.commands.add_parser(name, description=summary)
        return parser.add_subparsers(dest=dest, required=True, metavar="WHAT")

    def grouped_help(self) -> str:
        width = max(len(name) for _, name, _ in self.lines) + 2
        out = []
        for group in GROUPS:
            out.append(f"{group}:")
            out += [f"  {name:<{width}}{summary}" for g, name, summary in self.lines if g == group]
        return "\n".join(out) + "\n\n`moeshard COMMAND --help` for a command's options and an example."


def int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} must list positive integers")
    return values


def choice_list(choices: tuple[str, ...]):
    """An argparse type: a comma-separated list of `choices`."""

    def parse(text: str) -> list[str]:
        values = [part.strip() for part in text.split(",") if part.strip()]
        wrong = [v for v in values if v not in choices]
        if wrong or not values:
            raise argparse.ArgumentTypeError(f"{text!r}: comma-separated {', '.join(choices)}")
        return values

    return parse


def add_layout(parser: argparse.ArgumentParser, sp: bool = True) -> None:
    """--tp, --dp, --ep (and --sp): one layout, as `LLM` takes it."""
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per DP group")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel groups")
    parser.add_argument("--ep", action=argparse.BooleanOptionalAction, default=False, help="expert parallelism over all ranks")
    if sp:
        parser.add_argument("--sp", action="store_true", help="sequence parallelism (rows split over TP between blocks)")


def add_compile(parser: argparse.ArgumentParser, help: str = "compile the model once (dynamic shapes, no guards)") -> None:
    parser.add_argument("--compile", action="store_true", help=help)
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (aot_eager traces fastest)")


def add_dtype(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
        help="auto: bf16 for a bf16 (or fp16) checkpoint, as the bundled model is; else fp32",
    )


def add_quantization(parser: argparse.ArgumentParser, several: bool = False) -> None:
    """`several`: --quantization lists formats, bf16 among them meaning unquantized (bench e2e: an engine each)."""
    if several:
        parser.add_argument("--quantization", type=choice_list(("bf16", "fp8", "int8", "int4")), default=[],
                            help="comma-separated: bf16 (unquantized), fp8, int8, int4 — an engine each, quantized at "
                                 "load with the options below")
    else:
        parser.add_argument("--quantization", choices=("fp8", "int8", "int4"), default=None,
                            help="quantize every linear weight a decode step reads at load, the LM head too, and hold it "
                                 "quantized (computes in bf16; docs/quantization.md)")
    parser.add_argument("--quantization-skip", action="append", default=[], metavar="NAME",
                        help="a module name, dotted suffix or pattern kept unquantized (e.g. lm_head); repeatable")
    parser.add_argument("--quantization-group", type=int, default=128, help="inputs per quantization scale")
    parser.add_argument("--quantize-activations", action="store_true",
                        help="with --quantization int8 or int4: quantize activations to int8 too and multiply integers "
                             "(VNNI; faster, within a stated error of bf16 activations)")


def quantization_options(args: argparse.Namespace) -> dict:
    """LLM's quantization options from `add_quantization`'s flags."""
    return dict(quantization=args.quantization, quantization_skip=tuple(args.quantization_skip),
                quantization_group=args.quantization_group, quantize_activations=args.quantize_activations)


def add_batch_invariant(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-invariant", action="store_true",
                        help="a request's tokens and logprobs bitwise the same whatever runs beside it (docs/DESIGN.md §11)")


def progress_bar(label: str, console):
    """A bar with a count, the current item and the time so far (rich)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn(f"[bold]{label}[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                    TimeElapsedColumn(), console=console)


@contextlib.contextmanager
def row_progress(label: str, console, total: int, line):
    """A progress bar that each finished row (with `.layout` and `.method`) advances; `line(row)`
    is printed above it. Yields the callback for the rows."""
    with progress_bar(label, console) as progress:
        task = progress.add_task("", total=total)

        def on_row(row) -> None:
            progress.console.print(line(row))
            progress.update(task, advance=1, description=f"{row.layout} {row.method}")

        yield on_row


def lazy(module: str, function: str):
    """The command's runner `module.function`, imported only when the command runs (so that
    `moeshard --help` does not import what each command drives)."""

    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module), function)(args)

    return run
