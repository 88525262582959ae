"""Compile as a serving engine does: once, with dynamic shapes, and with no guards on runtime state.

Guards are dropped (as vLLM's compiled runner bypasses them), so the compiled code runs for every
batch size and whatever the live communication method is: anything a graph decided while it was
traced stays decided. That is what makes the runtime-aware custom ops necessary, and what the
replay tests exercise.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from moeshard.runtime import invariance


def serving_op(name: str) -> Callable:
    """Define `fn` as the custom op `name` (no mutated arguments), which compiled graphs keep as one
    opaque call that decides at run time. Outside compiled code the returned function calls `fn`
    directly: the same computation, without the dispatcher's cost (~0.25 ms a call on CPU)."""

    def define(fn: Callable) -> Callable:
        op = torch.library.custom_op(name, fn, mutates_args=())

        @functools.wraps(fn)
        def call(*args):
            return op(*args) if torch.compiler.is_compiling() else fn(*args)

        call.register_fake = op.register_fake
        return call

    return define


def compile_for_serving(module: torch.nn.Module, backend: str = "inductor") -> torch.nn.Module:
    """`torch.compile(module)` with dynamic shapes and every guard skipped.

    With guards skipped, a cached graph would also be reused by another module running the same
    code, so the Dynamo cache is cleared first: one compiled module per process at a time.
    """
    torch._dynamo.reset()
    options = {"guard_filter_fn": torch.compiler.skip_all_guards_unsafe}
    if backend == "inductor" and invariance.batch_invariant():
        # Keep eager's rounding between fused low-precision ops, and reductions whose split does not
        # follow the batch: compiled then equals eager bit for bit.
        options |= {"emulate_precision_casts": True, "batch_invariant": True}
    return torch.compile(module, dynamic=True, backend=backend, options=options)
