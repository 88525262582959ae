"""Token dispatchers: one protocol (base.TokenDispatcher), one file per communication method.

A new method is a new file with a TokenDispatcher subclass that declares its facts (name, needs_ep,
output_is_reduced, token_capacity, auto_priority), listed in REGISTERED below: CommMethod, the
reduction rules and automatic selection all follow from the classes.
"""

from moeshard.moe.dispatch.allgather import AllGatherDispatcher
from moeshard.moe.dispatch.alltoall import AllToAllDispatcher
from moeshard.moe.dispatch.base import MethodEnum, TokenDispatcher
from moeshard.moe.dispatch.fused_mc2 import FusedMC2Dispatcher
from moeshard.moe.dispatch.mc2 import MC2Dispatcher

REGISTERED: tuple[type[TokenDispatcher], ...] = (
    AllGatherDispatcher,
    AllToAllDispatcher,
    MC2Dispatcher,
    FusedMC2Dispatcher,
)

CommMethod = MethodEnum("CommMethod", [(cls.name.upper(), cls.name) for cls in REGISTERED])
DISPATCHERS: dict[CommMethod, type[TokenDispatcher]] = {CommMethod(cls.name): cls for cls in REGISTERED}

__all__ = ["DISPATCHERS", "CommMethod", "TokenDispatcher"]
