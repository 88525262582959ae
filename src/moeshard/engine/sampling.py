"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Each request samples from its own logits row with its own generator, so a request with a seed
draws the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch


LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
KV_AFTER_UPDATE = ("keep", "recompute")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    stop: tuple[str, ...] = ()  # generation ends before the first occurrence of any of these
    ignore_eos: bool = False
    logprobs: int | None = None  # also return the top-N logprobs of each sampled position
    # Also return, when it finishes, the experts each token was routed to in every MoE layer (for
    # routing replay in a trainer); such a request never reads the prefix cache (docs/DESIGN.md §7).
    return_routed_experts: bool = False
    stop_token_ids: tuple[int, ...] = ()  # sampling any of these ends the request (reason "stop"), EOS or not
    # vLLM's: logprobs of the model's raw logits, or of the distribution actually sampled from (after
    # temperature, top-k and top-p; a greedy request's are then those of its top-k / top-p only).
    logprobs_mode: str = "raw_logprobs"
    # What a weight update made while this request is parked (pause keep) does to its K/V: "keep" it
    # (its later tokens attend to K/V of the older weights), or "recompute" it under the new weights
    # before its next token. None: the engine's default (LLM(kv_after_update=...)).
    kv_after_update: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must not be negative, got {self.temperature}.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 (no limit) or positive, got {self.top_k}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must not be negative, got {self.logprobs}.")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be {' or '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}.")
        if self.kv_after_update not in (None, *KV_AFTER_UPDATE):
            raise ValueError(f"kv_after_update must be {' or '.join(KV_AFTER_UPDATE)}, got {self.kv_after_update!r}.")

    @classmethod
    def from_options(cls, **options) -> "SamplingParams":
        """Like the constructor, but an unknown option is a ValueError naming it."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown sampling option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}.")
        return cls(**options)


@dataclass
class Sample:
    token: int
    logprob: float | None = None  # only when the request asked for logprobs
    top_logprobs: dict[int, float] = field(default_factory=dict)


def processed(logits_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The logits sampled from: scaled by the temperature (a greedy request's are left as they are),
    those outside top-k and top-p at -inf."""
    scaled_V = logits_V / params.temperature if params.temperature else logits_V
    if params.top_k:
        kth = scaled_V.topk(min(params.top_k, scaled_V.numel())).values[-1]
        scaled_V = scaled_V.masked_fill(scaled_V < kth, float("-inf"))
    if params.top_p < 1:
        sorted_V, order_V = scaled_V.sort(descending=True)
        probs_V = sorted_V.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (always the first token).
        drop_V = probs_V.cumsum(-1) - probs_V >= params.top_p
        scaled_V = scaled_V.scatter(0, order_V, sorted_V.masked_fill(drop_V, float("-inf")))
    return scaled_V


def draw(logits_V: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from one row of fp32 logits, with temperature, top-k and top-p."""
    return int(torch.multinomial(processed(logits_V, params).softmax(-1), 1, generator=generator))


def sample_batch(
    logits_NV: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[Sample]:
    """A token for each row: greedy rows share one argmax; the others draw with their own generator."""
    greedy_N = logits_NV.argmax(-1).tolist()
    wants_logprobs = any(p.logprobs is not None for p in params)
    logprobs_NV = logits_NV.log_softmax(-1) if wants_logprobs else None
    samples = []
    for i, (p, generator) in enumerate(zip(params, generators)):
        token = greedy_N[i] if p.temperature == 0 else draw(logits_NV[i], p, generator)
        if p.logprobs is None:
            samples.append(Sample(token))
            continue
        logprobs_V = logprobs_NV[i]
        if p.logprobs_mode == "processed_logprobs":
            logprobs_V = processed(logits_NV[i], p).log_softmax(-1)
        top = {}
        if p.logprobs:
            values, ids = logprobs_V.topk(min(p.logprobs, logprobs_V.shape[-1]))
            top = dict(zip(ids.tolist(), values.tolist()))
        samples.append(Sample(token, float(logprobs_V[token]), top))
    return samples
