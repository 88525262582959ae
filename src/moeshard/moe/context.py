"""The per-forward context: which communication method is live for this step, and why; and, when
asked, where each MoE layer routed this rank's rows (routing replay: docs/DESIGN.md §7).

The live method is never module state: it is set here once per forward (outside any compiled code)
and read only by the real implementations of moeshard's custom ops, at run time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from moeshard.moe.config import SelectionPolicy
from moeshard.moe.dispatch import DISPATCHERS, CommMethod
from moeshard.parallel import state
from moeshard.parallel.layout import Layout


@dataclass(frozen=True)
class ForwardContext:
    method: CommMethod
    num_tokens: int  # max MoE-input rows over all ranks: every rank pads to this
    real_rows: int  # this rank's MoE-input rows that carry tokens (the rest is padding)
    routing: list[torch.Tensor] | None = None  # each MoE layer's topk_ids_TK, in layer order; None: not recorded


def method_policy(text: str) -> tuple[CommMethod | None, SelectionPolicy]:
    """A method name ("auto" or one method) as (forced method, policy). A forced method runs at every
    batch size: MC2's capacity is not its limit."""
    force = CommMethod.parse(text)
    return force, SelectionPolicy() if force is None else SelectionPolicy(mc2_capacity=1 << 20)


def check_method(force: CommMethod | None, layout: Layout) -> None:
    """Refuse forcing a method the layout cannot run (before any rank starts, where possible)."""
    if force is not None and DISPATCHERS[force].needs_ep and not layout.ep and layout.world_size > 1:
        raise ValueError(f"{force.name} needs expert parallelism, but layout {layout.label()} runs with EP off.")


def select_method(num_tokens: int, ep_size: int, policy: SelectionPolicy, force: CommMethod | None) -> CommMethod:
    """docs/DESIGN.md §2, from the methods' own facts: of the methods that can run this step (EP if
    they need it, within their token capacity, enabled by the policy), the highest `auto_priority`.
    For today's four: no EP → ALLGATHER; fits MC2's capacity → MC2 (or FUSED_MC2); else ALLTOALL."""
    if force is not None:
        check_method(force, state.get_parallel_state().layout)
        capacity = DISPATCHERS[force].token_capacity(policy)
        if capacity is not None and num_tokens > capacity:
            raise ValueError(
                f"{force.name} was forced for {num_tokens} tokens per rank, over its capacity of "
                f"{capacity}; raise mc2_capacity or use ALLTOALL."
            )
        return force
    runnable = [
        (cls.auto_priority, method)
        for method, cls in DISPATCHERS.items()
        if (ep_size > 1 or not cls.needs_ep)
        and cls.auto_enabled(policy)
        and (cls.token_capacity(policy) is None or num_tokens <= cls.token_capacity(policy))
    ]
    return max(runnable, key=lambda pair: pair[0])[1]


_current: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("an MoE layer ran outside moe_forward_context(); the engine sets it once per step.")
    return _current


@contextlib.contextmanager
def moe_forward_context(
    num_local_tokens: int,
    policy: SelectionPolicy = SelectionPolicy(),
    force: CommMethod | None = None,
    real_rows: int | None = None,
    record_routing: bool = False,
) -> Iterator[ForwardContext]:
    """Agree with every rank on the step's token counts (one host sync) and fix the method.

    `num_local_tokens` is the rows this rank feeds its MoE layers (its SP slice under SP), of which
    the first `real_rows` (default: all) carry tokens. With `record_routing` the context's `routing`
    collects every MoE layer's expert ids of all `num_local_tokens` rows.
    """
    global _current
    parallel = state.get_parallel_state()
    num_tokens = max(state.gather_ints(num_local_tokens, parallel.ep_group))
    method = select_method(num_tokens, parallel.layout.ep_size, policy, force)
    real = num_local_tokens if real_rows is None else real_rows
    previous, _current = _current, ForwardContext(method, num_tokens, real, [] if record_routing else None)
    try:
        yield _current
    finally:
        _current = previous
