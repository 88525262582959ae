"""Token dispatchers: one protocol (base.TokenDispatcher), one module per communication method."""

from moeshard.moe.config import CommMethod
from moeshard.moe.dispatch.allgather import AllGatherDispatcher
from moeshard.moe.dispatch.alltoall import AllToAllDispatcher
from moeshard.moe.dispatch.base import TokenDispatcher
from moeshard.moe.dispatch.fused_mc2 import FusedMC2Dispatcher
from moeshard.moe.dispatch.mc2 import MC2Dispatcher

DISPATCHERS: dict[CommMethod, type[TokenDispatcher]] = {
    cls.method: cls for cls in (AllGatherDispatcher, AllToAllDispatcher, MC2Dispatcher, FusedMC2Dispatcher)
}

__all__ = ["DISPATCHERS", "TokenDispatcher"]
