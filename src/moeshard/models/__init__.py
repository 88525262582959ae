"""Decoder models from Hugging Face checkpoints, sharded over the current layout."""

from moeshard.models.archs import ARCHITECTURES
from moeshard.models.checkpoint import CheckpointError
from moeshard.models.config import ModelConfig, ModelConfigError
from moeshard.models.model import CausalLM, load_config, load_model
from moeshard.models.runner import Chunk, ModelRunner

__all__ = [
    "ARCHITECTURES",
    "CausalLM",
    "Chunk",
    "CheckpointError",
    "ModelConfig",
    "ModelConfigError",
    "ModelRunner",
    "load_config",
    "load_model",
]
