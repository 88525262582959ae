"""The `moeshard` command."""

from __future__ import annotations

import argparse
import logging
import sys
import warnings

import moeshard


def int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} must list positive integers")
    return values


def progress_bar(label: str, console):
    """A bar with a count, the current item and the time so far (rich)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn(f"[bold]{label}[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                    TimeElapsedColumn(), console=console)


def verify_layer(args: argparse.Namespace) -> int:
    from moeshard.parallel.launch import is_reporting_rank
    from moeshard.verify import layer as matrix
    from moeshard.verify import report

    console = report.console(quiet=not is_reporting_rank())
    world_sizes = matrix.world_sizes_to_run(args.world_sizes)
    total = sum(len(matrix.groups_for(w)) for w in world_sizes)
    with progress_bar("verify layer", console) as progress:
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


def verify_invariance(args: argparse.Namespace) -> int:
    from moeshard.verify import invariance, report

    options = invariance.InvarianceOptions(
        layouts=tuple(args.layouts), methods=tuple(args.moe_comm),
        backends=(None, args.compile_backend) if args.compile else (None,), requests=args.requests, mixes=args.mixes,
        batch_invariant=args.batch_invariant, model=args.model, dtype=args.dtype, seed=args.seed,
    )
    console = report.console()
    with progress_bar("verify invariance", console) as progress:
        task = progress.add_task("", total=invariance.rows_expected(options))

        def on_row(row):
            verdict = "[green]bitwise[/]" if row.passed else "[bold red]DIFFERS[/]"
            progress.console.print(
                f"{verdict} {row.layout:<8} {row.method:<9} {'compiled' if row.compiled else 'eager   '} vs {row.reference}: "
                f"{row.bitwise_equal}/{row.compared} equal, max |Δ logprob| {row.max_abs_dlogprob:.2e}"
            )
            progress.update(task, advance=1, description=f"{row.layout} {row.method}")

        rows = invariance.run_invariance(options, on_row)
    console.width = max(console.width, 120)
    console.print(invariance.summary_table(rows, options))
    if args.json:
        invariance.write_json(rows, args.json)
    return 0 if all(r.passed for r in rows) else 1


def verify_hf(args: argparse.Namespace) -> int:
    import json

    from rich.table import Table

    from moeshard.parallel import Layout
    from moeshard.parallel.launch import is_reporting_rank
    from moeshard.verify import hf, report

    layout = Layout(tp=args.tp, dp=args.dp, ep=args.ep, sp=args.sp)
    backend = args.compile_backend if args.compile else None
    lengths = tuple(args.prompt_lengths) if args.prompt_lengths else None
    request = hf.Request(args.model, layout, args.moe_comm, backend, lengths, args.steps, args.seed, args.dtype)
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


def add_dtype(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
        help="auto: bf16 for a bf16 (or fp16) checkpoint, as the bundled model is; else fp32",
    )


def add_batch_invariant(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-invariant", action="store_true",
                        help="a request's tokens and logprobs bitwise the same whatever runs beside it (docs/DESIGN.md §11)")


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
    with progress_bar("eval", console) as progress:
        task = progress.add_task("", total=total)

        def on_row(row):
            mark = "[green]identical[/]" if row.identical_to_reference else "[bold red]DIFFERS from the first run[/]"
            progress.console.print(
                f"{row.layout:<8} {row.method:<9} {'compiled' if row.compiled else 'eager   '} "
                f"concurrency {row.concurrency:>3}: accuracy {row.accuracy:.3f} ({row.n}), {mark}"
            )
            progress.update(task, advance=1, description=f"{row.layout} {row.method}")

        if args.url:
            rows = run_eval_url(args.url, args.concurrency, args.n, args.api_key, on_row)
        else:
            rows = evaluate(args.layouts, args.concurrency, args.moe_comm, backends, args.n, args.model, on_row, args.dtype,
                            args.batch_invariant)
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


def generate(args: argparse.Namespace) -> int:
    import re

    from moeshard.bundled.arithmetic import Problem
    from moeshard.engine import LLM, SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed,
        stop=tuple(args.stop),
    )
    with LLM(args.model, tensor_parallel_size=args.tp, data_parallel_size=args.dp, enable_expert_parallel=args.ep,
             moe_comm=args.moe_comm, compile=args.compile_backend if args.compile else False, dtype=args.dtype,
             batch_invariant=args.batch_invariant) as llm:
        for prompt, out in zip(args.prompt, llm.generate(args.prompt, params)):
            if out.error is not None:
                print(f"{prompt}  [error: {out.error}]")
            elif args.model is None and re.fullmatch(r"-?\d+", out.text):  # the bundled model writes digits reversed
                print(f"{prompt}{out.text}    (= {Problem.value_of(out.text)})")
            else:
                print(f"{prompt}{out.text}")
    return 0


def generate_layouts(args: argparse.Namespace) -> list:
    from moeshard.parallel import Layout

    return [Layout(args.tp, args.dp, args.ep)]


def make_tiny(args: argparse.Namespace) -> int:
    from moeshard.verify.tiny import make_tiny_checkpoint

    print(make_tiny_checkpoint(args.variant, args.directory, args.seed))
    return 0


def bench_layer(args: argparse.Namespace) -> int:
    from moeshard.bench.layer import run_bench_layer

    return run_bench_layer(args)


def bench_kernels(args: argparse.Namespace) -> int:
    from moeshard.bench.kernels import run_bench_kernels

    return run_bench_kernels(args)


def bench_lm_head(args: argparse.Namespace) -> int:
    from moeshard.bench.lm_head import run_bench_lm_head

    return run_bench_lm_head(args)


def bench_e2e(args: argparse.Namespace) -> int:
    from moeshard.bench.e2e import run_bench_e2e

    return run_bench_e2e(args)


def bench_serve(args: argparse.Namespace) -> int:
    from moeshard.bench.serve import run_bench_serve

    return run_bench_serve(args)


def bench_soak(args: argparse.Namespace) -> int:
    from moeshard.bench.soak import run_bench_soak

    return run_bench_soak(args)


def serve(args: argparse.Namespace) -> int:
    from moeshard.serve.server import serve_command

    return serve_command(args)


def serve_layouts(args: argparse.Namespace) -> list:
    from moeshard.parallel import Layout

    return [Layout(args.tp, args.dp, args.ep, args.sp)]


def rl(args: argparse.Namespace) -> int:
    from moeshard.demos.rl import rl_command

    return rl_command(args)


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

    vhf = verify_what.add_parser("hf", help="a Hugging Face checkpoint on a layout vs. transformers, step by step")
    vhf.add_argument("--model", required=True, metavar="DIR", help="config.json + *.safetensors")
    vhf.add_argument("--tp", type=int, default=1)
    vhf.add_argument("--dp", type=int, default=1)
    vhf.add_argument("--ep", action=argparse.BooleanOptionalAction, default=False, help="expert parallelism over all ranks")
    vhf.add_argument("--sp", action="store_true", help="sequence parallelism (rows split over TP between blocks)")
    vhf.add_argument("--moe-comm", default="auto", choices=("auto", "allgather", "alltoall", "mc2", "fused_mc2"))
    vhf.add_argument("--compile", action="store_true", help="compile the model once (dynamic shapes, no guards)")
    vhf.add_argument("--compile-backend", default="inductor", help="torch.compile backend (aot_eager traces fastest)")
    vhf.add_argument("--prompt-lengths", type=int_list, default=None, help="default: 7,13,3,10; in bf16, 16 prompts")
    vhf.add_argument("--steps", type=int, default=8, help="greedy decode steps after the prefill")
    vhf.add_argument("--seed", type=int, default=0)
    vhf.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"),
        help="float32: the exact proof (the default, whatever the checkpoint's dtype); bfloat16: within bf16's tolerance",
    )
    vhf.add_argument("--json", metavar="PATH")
    vhf.set_defaults(run=verify_hf)

    vinv = verify_what.add_parser(
        "invariance", help="every request bitwise equal to its run alone, in randomised mixes (batch-invariant mode)"
    )
    vinv.add_argument("--model", default=None, metavar="DIR", help="default: the bundled arithmetic model")
    vinv.add_argument("--layouts", type=layout_list, default="1x1,1x2-ep,2x2-ep", help="TPxDP[-ep][-sp], comma-separated")
    vinv.add_argument("--moe-comm", type=lambda t: t.split(","), default=["auto", "allgather", "alltoall", "mc2", "fused_mc2"],
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

    ev = commands.add_parser("eval", help="held-out arithmetic through the engine: accuracy and identical outputs")
    ev.add_argument("--model", default=None, metavar="DIR", help="default: the bundled arithmetic model")
    ev.add_argument("--layouts", type=layout_list, default="1x1,2x1,1x2-ep,2x2-ep", help="TPxDP[-ep][-sp], comma-separated")
    ev.add_argument("--concurrency", type=int_list, default=[1, 4, 16])
    ev.add_argument("--moe-comm", type=lambda t: t.split(","), default=["auto"], help="comma-separated methods")
    ev.add_argument("--compile", action="store_true", help="also run each layout compiled")
    ev.add_argument("--compile-backend", default="inductor")
    ev.add_argument("-n", type=int, default=500, help="held-out problems")
    ev.add_argument("--json", metavar="PATH")
    ev.add_argument("--url", metavar="URL", help="evaluate a running `moeshard serve` (openai client, streaming) instead")
    ev.add_argument("--api-key", default=None, help="with --url: the server's key")
    add_dtype(ev)
    add_batch_invariant(ev)
    ev.set_defaults(run=run_eval, layouts_of=lambda a: [] if a.url else a.layouts)

    gen = commands.add_parser("generate", help="generate text for prompts")
    gen.add_argument("prompt", nargs="*", default=["123+456=", "900-999=", "007+993="])
    gen.add_argument("--model", default=None, metavar="DIR", help="default: the bundled arithmetic model")
    gen.add_argument("--tp", type=int, default=1)
    gen.add_argument("--dp", type=int, default=1)
    gen.add_argument("--ep", action=argparse.BooleanOptionalAction, default=False)
    gen.add_argument("--moe-comm", default="auto")
    gen.add_argument("--compile", action="store_true")
    gen.add_argument("--compile-backend", default="inductor")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[])
    add_dtype(gen)
    add_batch_invariant(gen)
    gen.set_defaults(run=generate, layouts_of=generate_layouts)

    srv = commands.add_parser("serve", help="an OpenAI-compatible HTTP server (streaming, metrics, RL routes)")
    srv.add_argument("--model", default=None, metavar="DIR", help="default: the bundled arithmetic model")
    srv.add_argument("--served-model-name", default=None, help="the name clients ask for (default: --model)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--tp", type=int, default=1)
    srv.add_argument("--dp", type=int, default=1)
    srv.add_argument("--ep", action=argparse.BooleanOptionalAction, default=False)
    srv.add_argument("--sp", action="store_true")
    srv.add_argument("--moe-comm", default="auto", choices=("auto", "allgather", "alltoall", "mc2", "fused_mc2"))
    srv.add_argument("--compile", action="store_true")
    srv.add_argument("--compile-backend", default="inductor")
    srv.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY (every route but /health)")
    srv.add_argument("--enable-sleep-mode", action="store_true", help="the RL routes: sleep, wake_up, weight updates")
    srv.add_argument("--max-num-seqs", type=int, default=64, help="per DP group")
    srv.add_argument("--max-num-batched-tokens", type=int, default=2048, help="per DP group and step")
    srv.add_argument("--max-model-len", type=int, default=None)
    srv.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (the prefix cache reuses whole blocks)")
    srv.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="reuse the KV blocks of prompts seen before, keyed by the weights' version (on by default)",
    )
    srv.add_argument(
        "--engine-process", action=argparse.BooleanOptionalAction, default=None,
        help="run the engine core in a process of its own, so no forward waits behind HTTP for the GIL "
             "(default: on, except under torchrun, where rank 0 is torchrun's process)",
    )
    srv.add_argument("--shutdown-timeout", type=float, default=10.0, help="seconds in-flight requests get on SIGTERM")
    srv.add_argument(
        "--max-request-bytes", type=int, default=None,
        help="bodies over this get 413 before parsing (default: 64 bytes per token of the context, at least 1 MiB)",
    )
    srv.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    add_dtype(srv)
    add_batch_invariant(srv)
    srv.set_defaults(run=serve, layouts_of=serve_layouts)

    rlp = commands.add_parser("rl", help="GRPO on the arithmetic task: engine and trainer colocated (or disaggregated), logprobs checked")
    from moeshard.demos.grpo import GRPOConfig
    from moeshard.demos.rl import RLOptions

    rl_defaults = RLOptions()  # one source of the defaults: the options the loop itself takes
    rlp.add_argument("--model", default=None, help="the starting policy's checkpoint (default: the bundled weak one)")
    rlp.add_argument("--steps", type=int, default=rl_defaults.steps, help="GRPO steps (default: as many as --minutes allow)")
    rlp.add_argument("--minutes", type=float, default=rl_defaults.minutes, help="the loop's time budget")
    rlp.add_argument("--problems", type=int, default=rl_defaults.problems, help="training problems a step")
    rlp.add_argument("--group", type=int, default=rl_defaults.group, help="completions sampled per problem (G)")
    rlp.add_argument("--lr", type=float, default=GRPOConfig().lr)
    rlp.add_argument("--eval-every", type=int, default=rl_defaults.eval_every, help="measure held-out accuracy every K steps")
    rlp.add_argument("--eval-problems", type=int, default=rl_defaults.eval_problems)
    rlp.add_argument("--layout", default=rl_defaults.layout.label(), help="TPxDP[-ep][-sp]")
    rlp.add_argument("--moe-comm", default=rl_defaults.moe_comm, choices=("auto", "allgather", "alltoall", "mc2", "fused_mc2"))
    rlp.add_argument("--compile", action="store_true")
    rlp.add_argument("--compile-backend", default="inductor")
    rlp.add_argument("--seed", type=int, default=rl_defaults.seed)
    rlp.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=rl_defaults.prefix_caching,
                     help="the G samples of a problem share its prompt's KV blocks")
    rlp.add_argument(
        "--negative-control", action="store_true",
        help="leave the derived tensors as the poisoned wake made them: the run must stop at the first step after a wake",
    )
    add_batch_invariant(rlp)
    rlp.add_argument(
        "--disaggregated", action="store_true",
        help="the engine as `moeshard serve` in processes of its own, rollouts over HTTP, weights over a process group",
    )
    rlp.add_argument("--routing-replay", action="store_true",
                     help="with --disaggregated: the trainer's routers take the experts the engine chose (R3)")
    rlp.add_argument("--json", metavar="PATH", help="one object per step")
    rlp.add_argument("--plot", metavar="PNG", help="reward, accuracy and |Δ logprob| against step")
    rlp.set_defaults(run=rl)

    tiny = commands.add_parser("tiny", help="write a tiny random checkpoint of a supported architecture")
    from moeshard.verify.tiny import VARIANTS

    tiny.add_argument("variant", choices=list(VARIANTS))
    tiny.add_argument("directory")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(run=make_tiny)

    bench = commands.add_parser("bench", help="benchmarks against a peer measured in the same run")
    bench_what = bench.add_subparsers(dest="what", required=True)
    blayer = bench_what.add_parser("layer", help="the MoE layer vs. transformers' MoE blocks and a dense GEMM")
    blayer.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    blayer.add_argument("--repeats", type=int, default=5, help="turns per contender; medians and spread reported")
    blayer.add_argument("--decode-tokens", type=int, default=8)
    blayer.add_argument("--prefill-tokens", type=int, default=2048)
    blayer.add_argument("--json", metavar="PATH")
    blayer.set_defaults(run=bench_layer)
    blm = bench_what.add_parser("lm-head", help="vocab-parallel vs. replicated LM head on 2 TP ranks")
    blm.add_argument("--vocab", type=int, default=151936)
    blm.add_argument("--hidden", type=int, default=2048)
    blm.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    blm.add_argument("--repeats", type=int, default=5)
    blm.set_defaults(run=bench_lm_head)
    bkern = bench_what.add_parser("kernels", help="moeshard.kernels (CPU) vs torch's ops, decode and prefill shapes")
    bkern.add_argument("--threads", type=int, default=1)
    bkern.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    bkern.add_argument("--repeats", type=int, default=5, help="alternations per case; medians and spread reported")
    bkern.add_argument("--json", metavar="PATH")
    bkern.set_defaults(run=bench_kernels)

    be2e = bench_what.add_parser(
        "e2e", help="engine useful output tokens/s vs. transformers (static, continuous batching) and vLLM's CPU engine"
    )
    be2e.add_argument("--concurrency", type=int_list, default=[1, 16, 64])
    be2e.add_argument("--threads", type=int_list, default=[1, 2], help="torch threads, one setting after another")
    be2e.add_argument("--num-requests", type=int, default=64)
    be2e.add_argument("--prompt-lens", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    be2e.add_argument("--output-lens", type=int, nargs=2, default=[8, 128], metavar=("MIN", "MAX"))
    be2e.add_argument("--repeats", type=int, default=3, help="repetitions per point; medians and spread reported")
    be2e.add_argument("--seed", type=int, default=0)
    be2e.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                      help="the random weights are written, and every contender serves them, in this dtype")
    be2e.add_argument("--model-shapes", type=lambda t: t.split(","), default=["small"],
                      help="comma-separated: small, qwen3-30b-a3b (2 layers of Qwen3-30B-A3B, ~3.7 GB in bf16)")
    be2e.add_argument("--against", default="transformers",
                      help="comma-separated peers: transformers (static and continuous batching), vllm (scripts/peers.sh), "
                           "moeshard-batch-invariant (the cost of --batch-invariant)")
    be2e.add_argument("--plot", metavar="PNG", help="tokens/s against concurrency, one panel per model, dtype, threads")
    be2e.add_argument("--json", metavar="PATH")
    be2e.set_defaults(run=bench_e2e)
    bsrv = bench_what.add_parser("serve", help="a serving benchmark client (vllm bench serve's shape), optionally against transformers serve")
    bsrv.add_argument("--base-url", default=None, help="benchmark a running server instead of starting moeshard serve")
    bsrv.add_argument("--model", default=None, metavar="DIR", help="weights and tokenizer (default: bench e2e's random Qwen3-MoE, made for the run)")
    bsrv.add_argument("--against", default=None,
                      help="comma-separated servers to start beside moeshard serve: transformers (serve --continuous-batching), "
                           "vllm (its OpenAI server, scripts/peers.sh), moeshard-no-cache (without prefix caching), "
                           "moeshard-one-process (the engine in the API server's process)")
    bsrv.add_argument("--dataset", choices=("random", "prefix"), default="random",
                      help="prefix: every prompt starts with one shared --prefix-len tokens")
    bsrv.add_argument("--prefix-len", type=int, default=1024)
    bsrv.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                      help="the random model is written, and every server started here serves it, in this dtype")
    bsrv.add_argument("--num-prompts", type=int, default=64)
    bsrv.add_argument("--random-input-len", type=int, default=72)
    bsrv.add_argument("--random-output-len", type=int, default=68)
    bsrv.add_argument("--random-range-ratio", type=float, default=0.77, help="lengths uniform over [len(1-r), len(1+r)]")
    bsrv.add_argument("--max-concurrency", type=int_list, default=[16])
    bsrv.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson arrivals")
    bsrv.add_argument("--num-warmups", type=int, default=2)
    bsrv.add_argument("--repeats", type=int, default=3)
    bsrv.add_argument("--threads", type=int, default=1, help="torch threads of each server started here")
    bsrv.add_argument("--seed", type=int, default=0)
    bsrv.add_argument("--json", metavar="PATH")
    bsrv.add_argument("--plot", metavar="PNG")
    bsrv.set_defaults(run=bench_serve)
    bsoak = bench_what.add_parser(
        "soak", help="a long run of moeshard serve under disconnects and bad requests: no 5xx, no leak, idle after"
    )
    bsoak.add_argument("--minutes", type=float, default=3.0)
    bsoak.add_argument("--concurrency", type=int, default=16, help="clients, each streaming one request at a time")
    bsoak.add_argument("--disconnect", type=float, default=0.1, help="share of clients that leave after the first chunk")
    bsoak.add_argument("--bad", type=float, default=0.1, help="share of bad requests (each must get its 4xx)")
    bsoak.add_argument("--dp", type=int, default=2)
    bsoak.add_argument("--ep", action=argparse.BooleanOptionalAction, default=True)
    bsoak.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    bsoak.add_argument("--max-growth", type=float, default=0.10, help="resident memory growth allowed after the first third")
    bsoak.add_argument("--seed", type=int, default=0)
    bsoak.add_argument("--json", metavar="PATH")
    bsoak.set_defaults(run=bench_soak)
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
    logging.basicConfig(level=logging.WARNING, format=moeshard.LOG_FORMAT)
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
