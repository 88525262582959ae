"""The "run" commands: `generate` (offline, through LLM) and `rl` (the GRPO loops, docs/rl.md)."""

from __future__ import annotations

import argparse

from moeshard.commandline import METHODS, Registry, add_batch_invariant, add_compile, add_dtype, add_layout, add_quantization, lazy


def add_commands(registry: Registry) -> None:
    gen = registry.command("run", "generate", "generate text for prompts, offline (LLM)",
                           "moeshard generate --dp 2 --ep 123+456= 900-999=")
    gen.add_argument("prompt", nargs="*", default=["123+456=", "900-999=", "007+993="])
    gen.add_argument("--model", default=None, metavar="DIR", help="default: the bundled arithmetic model")
    add_layout(gen, sp=False)
    gen.add_argument("--moe-comm", default="auto", choices=METHODS)
    add_compile(gen)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[])
    add_dtype(gen)
    add_quantization(gen)
    add_batch_invariant(gen)
    gen.set_defaults(run=generate, layouts_of=generate_layouts)

    from moeshard.demos.common import RLOptions
    from moeshard.demos.grpo import GRPOConfig

    rlp = registry.command("run", "rl", "GRPO on the arithmetic task: engine and trainer colocated (or disaggregated), logprobs checked",
                           "moeshard rl --disaggregated --routing-replay --minutes 5")
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
    rlp.add_argument("--moe-comm", default=rl_defaults.moe_comm, choices=METHODS)
    add_compile(rlp)
    rlp.add_argument("--seed", type=int, default=rl_defaults.seed)
    rlp.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=rl_defaults.prefix_caching,
                     help="the G samples of a problem share its prompt's KV blocks")
    rlp.add_argument(
        "--negative-control", action="store_true",
        help="leave the derived tensors as the poisoned wake made them: the run must stop at the first step after a wake",
    )
    add_batch_invariant(rlp)
    rlp.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                     help="the engine's (default: float32, the trainer's; bfloat16 with --quantization)")
    add_quantization(rlp)
    rlp.add_argument("--tis-cap", default="auto", metavar="C|none",
                     help="rollouts in bfloat16 or quantized: weight each sampled token by min(π_trainer / π_engine, C) "
                          "instead of refusing the gap (default 2 for them; none: refuse the gap as float32 does)")
    rlp.add_argument(
        "--disaggregated", action="store_true",
        help="the engine as `moeshard serve` in processes of its own, rollouts over HTTP, weights over a process group",
    )
    rlp.add_argument("--routing-replay", action="store_true",
                     help="with --disaggregated: the trainer's routers take the experts the engine chose (R3)")
    rlp.add_argument("--async", dest="asynchronous", action="store_true",
                     help="with --disaggregated: rollouts never wait for a training step; weights sent under pause(keep) (docs/rl.md)")
    rlp.add_argument("--kv-after-update", choices=("keep", "recompute"), default=None,
                     help="with --async: the parked requests' K/V at an update (default: keep)")
    rlp.add_argument("--max-staleness", type=int, default=None,
                     help="with --async: drop a group with a sample more than N versions behind the trainer (default: 1)")
    rlp.add_argument("--rollout-capacity", type=int, default=None, metavar="GROUPS",
                     help="with --async: groups sent and not yet taken by the trainer (default: --problems)")
    rlp.add_argument("--json", metavar="PATH", help="one object per step")
    rlp.add_argument("--plot", metavar="PNG", help="reward, accuracy and |Δ logprob| against step (--async: against time, and staleness)")
    rlp.set_defaults(run=lazy("moeshard.demos.rl", "rl_command"))


def generate(args: argparse.Namespace) -> int:
    import re

    from moeshard.bundled.arithmetic import Problem
    from moeshard.commandline import quantization_options
    from moeshard.engine import LLM, SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed,
        stop=tuple(args.stop),
    )
    with LLM(args.model, tensor_parallel_size=args.tp, data_parallel_size=args.dp, enable_expert_parallel=args.ep,
             moe_comm=args.moe_comm, compile=args.compile_backend if args.compile else False, dtype=args.dtype,
             batch_invariant=args.batch_invariant, **quantization_options(args)) as llm:
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
