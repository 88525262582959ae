"""The "benchmark" commands: `bench layer | lm-head | kernels | quant | e2e | step | load | serve | soak` (docs/benchmarks.md).
Each prints ratios against a peer measured in the same run."""

from __future__ import annotations

import argparse

from moeshard.commandline import Registry, add_quantization, int_list, lazy


def add_commands(registry: Registry) -> None:
    bench = registry.parent("bench", "benchmarks against a peer measured in the same run", "what")
    blayer = registry.command(
        "benchmark", "bench layer", "the MoE layer vs. transformers' MoE blocks and a dense GEMM",
        "moeshard bench layer --dtype bfloat16 --repeats 5", under=bench,
    )
    blayer.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    blayer.add_argument("--repeats", type=int, default=5, help="turns per contender; medians and spread reported")
    blayer.add_argument("--decode-tokens", type=int, default=8)
    blayer.add_argument("--prefill-tokens", type=int, default=2048)
    blayer.add_argument("--json", metavar="PATH")
    blayer.set_defaults(run=lazy("moeshard.bench.layer", "run_bench_layer"))
    blm = registry.command(
        "benchmark", "bench lm-head", "vocab-parallel vs. replicated LM head on 2 TP ranks",
        "moeshard bench lm-head --vocab 151936 --hidden 2048", under=bench,
    )
    blm.add_argument("--vocab", type=int, default=151936)
    blm.add_argument("--hidden", type=int, default=2048)
    blm.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    blm.add_argument("--repeats", type=int, default=5)
    blm.set_defaults(run=lazy("moeshard.bench.lm_head", "run_bench_lm_head"))
    bkern = registry.command(
        "benchmark", "bench kernels", "moeshard.kernels (CPU) vs torch's ops, decode and prefill shapes",
        "moeshard bench kernels --threads 1 --dtype bfloat16", under=bench,
    )
    bkern.add_argument("--threads", type=int, default=1)
    bkern.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    bkern.add_argument("--repeats", type=int, default=5, help="alternations per case; medians and spread reported")
    bkern.add_argument("--json", metavar="PATH")
    bkern.set_defaults(run=lazy("moeshard.bench.kernels", "run_bench_kernels"))

    bquant = registry.command(
        "benchmark", "bench quant", "quantized kernels (fp8, int8, int4; int8 activations) vs the bf16 kernel, Qwen3-30B-A3B's LM head and experts",
        "moeshard bench quant --threads 1,2 --tokens 1,16,64", under=bench,
    )
    bquant.add_argument("--threads", type=int_list, default=[1, 2], help="torch threads, one setting after another")
    bquant.add_argument("--tokens", type=int_list, default=[1, 16, 64])
    bquant.add_argument("--formats", type=lambda t: t.split(","), default=["fp8", "int8", "int4", "int8-a8", "int4-a8"],
                        help="comma-separated: fp8, int8, int4, int8-zp, int4-zp (zero points), int8-a8, int4-a8 "
                             "(int8 activations); groups of 128")
    bquant.add_argument("--cases", type=lambda t: t.split(","), default=["lm-head", "experts"], help="lm-head, experts")
    bquant.add_argument("--repeats", type=int, default=5, help="alternations; medians and spread reported")
    bquant.add_argument("--json", metavar="PATH")
    bquant.set_defaults(run=lazy("moeshard.bench.quant", "run_bench_quant"))

    be2e = registry.command(
        "benchmark", "bench e2e", "engine useful output tokens/s vs. transformers (static, continuous batching), vLLM's CPU engine and llama.cpp",
        "moeshard bench e2e --against vllm,transformers --threads 1,2 --repeats 3", under=bench,
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
    be2e.add_argument("--model", default=None, metavar="DIR",
                      help="a checkpoint instead of --model-shapes' random ones (e.g. bench checkpoint's int4 model)")
    be2e.add_argument("--against", default="transformers",
                      help="comma-separated peers: transformers (static and continuous batching), vllm (scripts/peers.sh), "
                           "llama.cpp (scripts/peers.sh llama.cpp; one contender per --llama-formats), "
                           "moeshard-batch-invariant (the cost of --batch-invariant)")
    be2e.add_argument("--llama-formats", type=lambda t: t.split(","), default=None,
                      help="with --against llama.cpp: comma-separated GGUF formats the run's weights are converted to, "
                           "each a contender: bf16, q8_0, q4_0, q4_k_m (default: all four)")
    add_quantization(be2e, several=True)
    be2e.add_argument("--plot", metavar="PNG", help="tokens/s against concurrency, one panel per model, dtype, threads")
    be2e.add_argument("--json", metavar="PATH")
    be2e.set_defaults(run=lazy("moeshard.bench.e2e", "run_bench_e2e"))
    bstep = registry.command(
        "benchmark", "bench step", "a decode step's time part by part (LM head, experts, attention, router, sampling, driver) beside each part's floor",
        "moeshard bench step --model-shape qwen3-30b-a3b --quantization bf16,int4 --concurrency 1,64 --threads 1", under=bench,
    )
    bstep.add_argument("--model", default=None, metavar="DIR", help="a checkpoint (default: bench e2e's random model, written for the run)")
    bstep.add_argument("--model-shape", default="qwen3-30b-a3b", help="small or qwen3-30b-a3b (see bench e2e)")
    bstep.add_argument("--concurrency", type=int_list, default=[1, 64], help="sequences decoding together")
    bstep.add_argument("--context", type=int, default=64, help="prompt tokens per sequence before the timed steps")
    bstep.add_argument("--steps", type=int, default=10, help="decode steps timed")
    bstep.add_argument("--threads", type=int, default=1)
    bstep.add_argument("--json", metavar="PATH")
    add_quantization(bstep, several=True)
    bstep.set_defaults(run=lazy("moeshard.bench.step", "run_bench_step"))
    bload = registry.command(
        "benchmark", "bench load", "load time, weights held and peak memory, with the kernels' packed weights and without",
        "moeshard bench load --model-shape qwen3-30b-a3b --threads 1 --repeats 3", under=bench,
    )
    bload.add_argument("--model", default=None, metavar="DIR", help="a checkpoint to load (default: bench e2e's random model, written for the run)")
    bload.add_argument("--model-shape", default="qwen3-30b-a3b", help="small or qwen3-30b-a3b (see bench e2e)")
    bload.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    bload.add_argument("--threads", type=int, default=1)
    bload.add_argument("--repeats", type=int, default=3, help="loads per setting, alternated; medians and spread reported")
    bload.add_argument("--torch-ops", action=argparse.BooleanOptionalAction, default=True,
                       help="also load with MOESHARD_CPU_KERNELS=0 (Hugging Face's layout), alternated")
    bload.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one load, in a process of its own
    bload.add_argument("--json", metavar="PATH")
    bload.set_defaults(run=lazy("moeshard.bench.load", "run_bench_load"))
    bckpt = registry.command(
        "benchmark", "bench checkpoint", "write a random int4 checkpoint (compressed-tensors W4A16) of a bench model shape at any depth",
        "moeshard bench checkpoint /tmp/q30b-int4 --model-shape qwen3-30b-a3b --layers 48", under=bench,
    )
    bckpt.add_argument("directory")
    bckpt.add_argument("--model-shape", default="qwen3-30b-a3b", help="small or qwen3-30b-a3b (see bench e2e)")
    bckpt.add_argument("--layers", type=int, default=48, help="decoder layers (qwen3-30b-a3b has 48)")
    bckpt.add_argument("--seed", type=int, default=0)
    bckpt.set_defaults(run=lazy("moeshard.bench.random_checkpoint", "run_bench_checkpoint"))
    bsrv = registry.command(
        "benchmark", "bench serve", "a serving benchmark client (vllm bench serve's shape), optionally against transformers serve",
        "moeshard bench serve --against vllm --max-concurrency 16 --repeats 5 --threads 1", under=bench,
    )
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
    bsrv.set_defaults(run=lazy("moeshard.bench.serve", "run_bench_serve"))
    bsoak = registry.command(
        "benchmark", "bench soak", "a long run of moeshard serve under disconnects and bad requests: no 5xx, no leak, idle after",
        "moeshard bench soak --minutes 3 --concurrency 16", under=bench,
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
    bsoak.set_defaults(run=lazy("moeshard.bench.soak", "run_bench_soak"))

