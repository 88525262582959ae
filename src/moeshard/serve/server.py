"""`moeshard serve`: the engine behind an OpenAI-compatible HTTP server (uvicorn).

SIGTERM or SIGINT: uvicorn stops accepting, gives in-flight requests up to `--shutdown-timeout`
seconds to finish, cancels the rest (their engine requests are aborted), then the engine and its
ranks close and the process exits 0. Under torchrun only rank 0 gets here; it listens.

A lost rank (docs/serving.md, "Faults"): from the moment the engine knows, `/health` answers 503,
in-flight requests end with an error and new ones are refused; after LOSS_GRACE_S the server stops
and the process exits ENGINE_LOST_EXIT, as it does on any later signal: a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time

import uvicorn

from moeshard.commandline import quantization_options
from moeshard.engine import LLM
from moeshard.engine.async_llm import AsyncLLM
from moeshard.engine.engine_process import in_engine_process
from moeshard.parallel import Layout
from moeshard.parallel.launch import under_torchrun
from moeshard.serve.app import ServeSettings, build_app, default_max_request_bytes, default_max_weight_update_bytes
from moeshard.serve.sglang import add_sglang_routes
from moeshard.serve.vllm import add_vllm_routes

BUNDLED_NAME = "moeshard-arithmetic"
ENGINE_LOST_EXIT = 1
LOSS_GRACE_S = 1.0  # after a loss: in-flight responses get their error before uvicorn stops

log = logging.getLogger("moeshard")


def serve_command(args: argparse.Namespace) -> int:
    options = dict(
        model=args.model, tensor_parallel_size=args.tp, data_parallel_size=args.dp, enable_expert_parallel=args.ep,
        enable_sequence_parallel=args.sp, moe_comm=args.moe_comm,
        compile=args.compile_backend if args.compile else False, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching, batch_invariant=args.batch_invariant,
        kv_after_update=args.kv_after_update, **quantization_options(args),
    )
    own_process = args.engine_process if args.engine_process is not None else not under_torchrun()
    if own_process and under_torchrun():
        raise ValueError("--engine-process is not available under torchrun: rank 0's engine runs in torchrun's process.")
    engine = in_engine_process(**options) if own_process else AsyncLLM.in_process(LLM(**options))
    try:
        name = args.served_model_name or args.model or BUNDLED_NAME
        settings = ServeSettings(
            name, args.api_key, args.enable_sleep_mode,
            max_request_bytes=args.max_request_bytes or default_max_request_bytes(engine.inputs.max_model_len),
            max_weight_update_bytes=args.max_weight_update_bytes or default_max_weight_update_bytes(engine.inputs.directory),
        )
        app = build_app(engine, settings)
        for add_profile in (add_sglang_routes, add_vllm_routes):  # the drop-in profiles (docs/serving.md)
            add_profile(app, app.state.server)
        config = uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.log_level,
            access_log=False, timeout_graceful_shutdown=args.shutdown_timeout,
        )
        server = uvicorn.Server(config)
        threading.Thread(target=stop_when_lost, args=(engine, server), name="moeshard-loss-watch", daemon=True).start()
        layout = Layout(args.tp, args.dp, args.ep, args.sp).label()
        print(f"moeshard serve: {name} on {layout} at http://{args.host}:{args.port}/v1", flush=True)
        # uvicorn handles SIGTERM/SIGINT itself, then raises the signal again to the handler it found:
        # make that one a no-op, so the stop we asked for ends here, closing the engine.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        server.run()
    finally:
        engine.close()
    if engine.error is not None:
        log.error("moeshard serve: exiting with code %d: the engine was lost (%s)", ENGINE_LOST_EXIT, engine.error)
        return ENGINE_LOST_EXIT
    return 0


def stop_when_lost(engine: AsyncLLM, server: uvicorn.Server) -> None:
    """Stop the server once the engine is lost: a process that is dead inside must not look alive."""
    engine.failed.wait()
    time.sleep(LOSS_GRACE_S)
    server.should_exit = True
