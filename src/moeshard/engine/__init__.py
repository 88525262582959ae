"""The serving engine: LLM (the driver), scheduler, block manager, sampling, the per-rank worker."""

from moeshard.engine.llm import LLM, RequestOutput
from moeshard.engine.sampling import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
