"""The MoE layer: router, experts, dispatch (one module per method), runtime-aware reductions."""

from moeshard.moe.config import MoEConfig, RouterConfig, SelectionPolicy, SharedLayout
from moeshard.moe.dispatch import CommMethod
from moeshard.moe.context import ForwardContext, get_forward_context, moe_forward_context
from moeshard.moe.layer import MoELayer
from moeshard.moe.reference import reference_moe
from moeshard.moe.weights import MoEWeights

__all__ = [
    "CommMethod",
    "ForwardContext",
    "MoEConfig",
    "MoELayer",
    "MoEWeights",
    "RouterConfig",
    "SelectionPolicy",
    "SharedLayout",
    "get_forward_context",
    "moe_forward_context",
    "reference_moe",
]
