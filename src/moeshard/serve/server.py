"""`moeshard serve`: the engine behind an OpenAI-compatible HTTP server (uvicorn).

SIGTERM or SIGINT: uvicorn stops accepting, gives in-flight requests up to `--shutdown-timeout`
seconds to finish, cancels the rest (their engine requests are aborted), then the engine and its
ranks close and the process exits 0. Under torchrun only rank 0 gets here; it listens.
"""

from __future__ import annotations

import argparse
import signal

import uvicorn

from moeshard.engine import LLM
from moeshard.engine.async_llm import AsyncLLM
from moeshard.serve.app import ServeSettings, build_app

BUNDLED_NAME = "moeshard-arithmetic"


def serve_command(args: argparse.Namespace) -> int:
    llm = LLM(
        args.model, tensor_parallel_size=args.tp, data_parallel_size=args.dp, enable_expert_parallel=args.ep,
        enable_sequence_parallel=args.sp, moe_comm=args.moe_comm,
        compile=args.compile_backend if args.compile else False, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
    )
    engine = AsyncLLM(llm)
    try:
        name = args.served_model_name or args.model or BUNDLED_NAME
        settings = ServeSettings(name, args.api_key, args.enable_sleep_mode)
        config = uvicorn.Config(
            build_app(engine, settings), host=args.host, port=args.port, log_level=args.log_level,
            access_log=False, timeout_graceful_shutdown=args.shutdown_timeout,
        )
        print(f"moeshard serve: {name} on {llm.layout.label()} at http://{args.host}:{args.port}/v1", flush=True)
        # uvicorn handles SIGTERM/SIGINT itself, then raises the signal again to the handler it found:
        # make that one a no-op, so the stop we asked for ends here, closing the engine, with exit 0.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        uvicorn.Server(config).run()
    finally:
        engine.close()
    return 0
