"""The "prove" commands: `eval`, `verify layer | hf | invariance`, `tiny` (docs/proofs.md)."""

from __future__ import annotations

import argparse

from moeshard.commandline import (
    METHODS, Registry, add_batch_invariant, add_compile, add_dtype, add_layout, add_quantization, int_list, progress_bar,
    quantization_options, row_progress,
)


def add_commands(registry: Registry) -> None:
    ev = registry.command("prove", "eval", "held-out arithmetic through the engine: accuracy, and identical outputs everywhere",
                          "moeshard eval --layouts 1x1,1x2-ep --concurrency 1,4,16")
    ev.add_argument("--model", default=None, metavar="DIR", help="default: the bundled arithmetic model")
    ev.add_argument("--layouts", type=layout_list, default="1x1,2x1,1x2-ep,2x2-ep", help="TPxDP[-ep][-sp], comma-separated")
    ev.add_argument("--concurrency", type=int_list, default=[1, 4, 16])
    ev.add_argument("--moe-comm", type=lambda t: t.split(","), default=["auto"], help="comma-separated methods")
    add_compile(ev, "also run each layout compiled")
    ev.add_argument("-n", type=int, default=500, help="held-out problems")
    ev.add_argument("--json", metavar="PATH")
    ev.add_argument("--url", metavar="URL", help="evaluate a running `moeshard serve` (openai client, streaming) instead")
    ev.add_argument("--api-key", default=None, help="with --url: the server's key")
    add_dtype(ev)
    add_batch_invariant(ev)
    add_quantization(ev)
    ev.set_defaults(run=run_eval, layouts_of=lambda a: [] if a.url else a.layouts)

    verify = registry.parent("verify", "prove parallel paths equal the single-device answer", "what")
    layer = registry.command("prove", "verify layer", "the MoE layer's parity matrix: every layout and method vs. one device",
                             "moeshard verify layer --world-sizes 1,2,4 --markdown matrix.md", under=verify)
    layer.add_argument("--world-sizes", type=int_list, default=[1, 2, 4], help="e.g. 1,2,4")
    layer.add_argument("--json", metavar="PATH", help="write every case as JSON")
    layer.add_argument("--markdown", metavar="PATH", help="write every case as a Markdown table")
    layer.add_argument("--seed", type=int, default=0)
    layer.add_argument("--alternate-routers", action="store_true",
                       help="one router per group, alternating (half the cases; every router still meets every "
                            "pair of layout, shared expert and transform)")
    layer.set_defaults(run=verify_layer)

    vhf = registry.command("prove", "verify hf", "a Hugging Face checkpoint on a layout vs. transformers, step by step",
                           "moeshard verify hf --model /tmp/tiny-qwen2 --tp 2 --dp 2 --ep --moe-comm alltoall", under=verify)
    vhf.add_argument("--model", required=True, metavar="DIR", help="config.json + *.safetensors")
    add_layout(vhf)
    vhf.add_argument("--moe-comm", default="auto", choices=METHODS)
    add_compile(vhf)
    vhf.add_argument("--prompt-lengths", type=int_list, default=None, help="default: 7,13,3,10; in bf16, 16 prompts")
    vhf.add_argument("--steps", type=int, default=8, help="greedy decode steps after the prefill")
    vhf.add_argument("--seed", type=int, default=0)
    vhf.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"),
        help="float32: the exact proof (the default, whatever the checkpoint's dtype); bfloat16: within bf16's tolerance",
    )
    vhf.add_argument("--reference", default=None, metavar="DIR",
                     help="the checkpoint transformers runs instead of --model: a quantized model's dequantized weights")
    vhf.add_argument("--json", metavar="PATH")
    vhf.set_defaults(run=verify_hf)

    vinv = registry.command("prove", "verify invariance",
                            "every request bitwise equal to its run alone, in randomised mixes (batch-invariant mode)",
                            "moeshard verify invariance --layouts 1x1,1x2-ep --no-compile", under=verify)
    vinv.add_argument("--model", default=None, metavar="DIR", help="default: the bundled arithmetic model")
    vinv.add_argument("--layouts", type=layout_list, default="1x1,1x2-ep,2x2-ep", help="TPxDP[-ep][-sp], comma-separated")
    vinv.add_argument("--moe-comm", type=lambda t: t.split(","), default=list(METHODS),
                      help="comma-separated methods (auto included: the policy picks per step)")
    vinv.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True, help="also run each setting compiled")
    vinv.add_argument("--compile-backend", default="inductor")
    vinv.add_argument("--requests", type=int, default=24)
    vinv.add_argument("--mixes", type=int, default=3, help="randomised mixes per engine (order, concurrency)")
    vinv.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
                      help="--no-batch-invariant: the negative control, today's default mode")
    vinv.add_argument("--dtype", default="float32", choices=("auto", "bfloat16", "float32"))
    vinv.add_argument("--seed", type=int, default=0)
    vinv.add_argument("--json", metavar="PATH")
    vinv.set_defaults(run=verify_invariance, layouts_of=lambda a: a.layouts)

    from moeshard.verify.tiny import VARIANTS

    tiny = registry.command("prove", "tiny", "write a tiny random checkpoint of a supported architecture (for verify hf)",
                            "moeshard tiny qwen2_moe /tmp/tiny-qwen2")
    tiny.add_argument("variant", choices=list(VARIANTS))
    tiny.add_argument("directory")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(run=make_tiny)


def layout_list(text: str):
    from moeshard.parallel import Layout

    return [Layout.parse(part) for part in text.split(",") if part.strip()]


def run_eval(args: argparse.Namespace) -> int:
    import json

    from rich.table import Table

    from moeshard.verify import report
    from moeshard.verify.eval import run_eval as evaluate
    from moeshard.verify.eval import run_eval_url, to_json

    backends = [None] + ([args.compile_backend] if args.compile else [])
    console = report.console()
    total = len(args.concurrency) * (1 if args.url else len(args.layouts) * len(backends) * len(args.moe_comm))
    def line(row) -> str:
        mark = "[green]identical[/]" if row.identical_to_reference else "[bold red]DIFFERS from the first run[/]"
        return (f"{row.layout:<8} {row.method:<9} {'compiled' if row.compiled else 'eager   '} "
                f"concurrency {row.concurrency:>3}: accuracy {row.accuracy:.3f} ({row.n}), {mark}")

    with row_progress("eval", console, total, line) as on_row:
        if args.url:
            rows = run_eval_url(args.url, args.concurrency, args.n, args.api_key, on_row)
        else:
            rows = evaluate(args.layouts, args.concurrency, args.moe_comm, backends, args.n, args.model, on_row, args.dtype,
                            args.batch_invariant, quantization_options(args))
    table = Table(title=f"exact match on {args.n} held-out problems (greedy)")
    for column in ("layout", "method", "compiled", "concurrency", "accuracy", "identical to first run",
                   "logprobs bitwise"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r.layout, r.method, "yes" if r.compiled else "no", str(r.concurrency), f"{r.accuracy:.3f}",
                      "yes" if r.identical_to_reference else "[bold red]no[/]",
                      "-" if r.logprobs_identical is None else "yes" if r.logprobs_identical else "no")
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(rows), f, indent=1)
    # Logprobs equal across concurrencies are the mode's promise; without it they may differ in the last bits.
    logprobs_ok = not args.batch_invariant or all(r.logprobs_identical is not False for r in rows)
    return 0 if all(r.identical_to_reference for r in rows) and logprobs_ok else 1


def verify_layer(args: argparse.Namespace) -> int:
    from moeshard.parallel.launch import is_reporting_rank
    from moeshard.verify import layer as matrix
    from moeshard.verify import report

    console = report.console(quiet=not is_reporting_rank())
    world_sizes = matrix.world_sizes_to_run(args.world_sizes)
    total = sum(len(matrix.groups_for(w, args.alternate_routers)) for w in world_sizes)
    with progress_bar("verify layer", console) as progress:
        task = progress.add_task("", total=total)

        def on_group(group, rows):
            for row in rows:
                progress.console.print(report.case_line(row))
            progress.update(task, advance=1, description=group.layout.label())

        rows = matrix.run_matrix(world_sizes, args.seed, on_group, args.alternate_routers)
    console.print(report.summary_table(rows))
    failed = [r for r in rows if not r.passed]
    console.print(f"{len(rows) - len(failed)}/{len(rows)} cases passed.")
    if args.json and is_reporting_rank():
        report.write_json(rows, args.json)
    if args.markdown and is_reporting_rank():
        report.write_markdown(rows, args.markdown)
    return 1 if failed else 0


def verify_hf(args: argparse.Namespace) -> int:
    import json

    from rich.table import Table

    from moeshard.parallel import Layout
    from moeshard.parallel.launch import is_reporting_rank
    from moeshard.verify import hf, report

    layout = Layout(tp=args.tp, dp=args.dp, ep=args.ep, sp=args.sp)
    backend = args.compile_backend if args.compile else None
    lengths = tuple(args.prompt_lengths) if args.prompt_lengths else None
    request = hf.Request(args.model, layout, args.moe_comm, backend, lengths, args.steps, args.seed, args.dtype,
                         args.reference)
    console = report.console(quiet=not is_reporting_rank())
    how = f"compiled ({backend})" if backend else "eager"
    with console.status(f"verify hf: {layout.label()} method={args.moe_comm} {how} {args.dtype}"):
        comparison = hf.verify_hf(request)
    exact = args.dtype == "float32"
    table = Table(title=f"{args.model} on {layout.label()}, method {args.moe_comm}, {how}: vs. transformers ({args.dtype})")
    for column in ("step", "max |Δlogit|", "within tolerance", "greedy tokens"):
        table.add_column(column, justify="right")
    for r in comparison.steps:
        if r.step == args.steps:
            tokens = "—"
        elif exact:
            tokens = "same" if r.tokens_match else "[bold red]differ[/]"
        else:  # teacher-forced: whether transformers would have chosen moeshard's token
            tokens = f"{r.tokens_agreeing}/{len(request.prompt_lengths)} agree"
        diff = f"{r.max_abs_diff:.2e}"
        if exact and r.max_abs_diff > hf.TOLERANCE:  # in bf16 a routing near-tie moves a few positions legitimately
            diff = f"[bold red]{diff}[/]"
        table.add_row("prefill" if r.step == 0 else f"decode {r.step}", diff, f"{r.within}/{r.positions}", tokens)
    console.print(table)
    if exact:
        rule = f"tolerance {hf.TOLERANCE:g} on every logit, greedy tokens identical"
    else:
        rule = (
            f"{hf.BF16_WITHIN:.0%} of the prefill's and of the decode steps' positions within "
            f"{comparison.tolerance:.3g}·max|logit|: 2^-4, or twice transformers' own bf16 rounding "
            f"({comparison.rounding:.3g}) if more; greedy tokens agree {comparison.token_agreement:.0%}"
        )
    console.print(("[green]PASS[/]" if comparison.passed else "[bold red]FAIL[/]") + f" ({rule})")
    if args.json and is_reporting_rank():
        with open(args.json, "w") as f:
            json.dump(hf.to_json(request, comparison), f, indent=1)
    return 0 if comparison.passed else 1


def verify_invariance(args: argparse.Namespace) -> int:
    from moeshard.verify import invariance, report

    options = invariance.InvarianceOptions(
        layouts=tuple(args.layouts), methods=tuple(args.moe_comm),
        backends=(None, args.compile_backend) if args.compile else (None,), requests=args.requests, mixes=args.mixes,
        batch_invariant=args.batch_invariant, model=args.model, dtype=args.dtype, seed=args.seed,
    )
    console = report.console()
    def line(row) -> str:
        verdict = "[green]bitwise[/]" if row.passed else "[bold red]DIFFERS[/]"
        return (f"{verdict} {row.layout:<8} {row.method:<9} {'compiled' if row.compiled else 'eager   '} vs {row.reference}: "
                f"{row.bitwise_equal}/{row.compared} equal, max |Δ logprob| {row.max_abs_dlogprob:.2e}")

    with row_progress("verify invariance", console, invariance.rows_expected(options), line) as on_row:
        rows = invariance.run_invariance(options, on_row)
    console.width = max(console.width, 120)
    console.print(invariance.summary_table(rows, options))
    if args.json:
        invariance.write_json(rows, args.json)
    return 0 if all(r.passed for r in rows) else 1


def make_tiny(args: argparse.Namespace) -> int:
    from moeshard.verify.tiny import make_tiny_checkpoint

    print(make_tiny_checkpoint(args.variant, args.directory, args.seed))
    return 0
