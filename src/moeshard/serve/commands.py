"""The "serve" command: `moeshard serve` (docs/serving.md)."""

from __future__ import annotations

import argparse

from moeshard.commandline import METHODS, Registry, add_batch_invariant, add_compile, add_dtype, add_layout, add_quantization, lazy


def add_commands(registry: Registry) -> None:
    srv = registry.command("serve", "serve", "an OpenAI-compatible HTTP server (streaming, metrics, RL routes)",
                           "moeshard serve --dp 2 --ep --enable-sleep-mode --port 8000")
    srv.add_argument("--model", default=None, metavar="DIR", help="default: the bundled arithmetic model")
    srv.add_argument("--served-model-name", default=None, help="the name clients ask for (default: --model)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    add_layout(srv)
    srv.add_argument("--moe-comm", default="auto", choices=METHODS)
    add_compile(srv)
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
    srv.add_argument(
        "--kv-after-update", default="keep", choices=("keep", "recompute"),
        help="a weight update while pause_generation(mode=keep) parks requests: keep their K/V (their token spans "
             "say which weights sampled what), or recompute it under the new weights first (a request's "
             "kv_after_update overrides it)",
    )
    srv.add_argument("--shutdown-timeout", type=float, default=10.0, help="seconds in-flight requests get on SIGTERM")
    srv.add_argument(
        "--max-request-bytes", type=int, default=None,
        help="bodies over this get 413 before parsing (default: 64 bytes per token of the context, at least 1 MiB); "
             "the weight routes have their own limit",
    )
    srv.add_argument(
        "--max-weight-update-bytes", type=int, default=None,
        help="the same for the weight routes' bodies (/update_weights_from_tensor, /update_weights_from_distributed, "
             "/update_weights) (default: every weight in one body: base64 of the model's safetensors files, plus 1/16 "
             "and 1 MiB)",
    )
    srv.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    add_dtype(srv)
    add_quantization(srv)
    add_batch_invariant(srv)
    srv.set_defaults(run=lazy("moeshard.serve.server", "serve_command"), layouts_of=serve_layouts)


def serve_layouts(args: argparse.Namespace) -> list:
    from moeshard.parallel import Layout

    return [Layout(args.tp, args.dp, args.ep, args.sp)]
