"""The OpenAI request bodies the server accepts, and its error objects.

Bodies are validated strictly (a string is not an integer) before anything reaches the engine;
fields this engine does not implement are accepted only at their no-op value, so a client never
gets silently different sampling from what it asked for.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

TokenIds = list[int]


def choice_seeds(seed: int | None, n: int) -> list[int | None]:
    """One per choice: a request's n choices are n requests, choice i seeded `seed + i`."""
    return [None if seed is None else seed + i for i in range(n)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


def stop_strings(stop: str | list[str] | None, param: str) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(stops):
        raise FieldError(param, f"{param} strings must not be empty.")
    return stops


class Sampling(BaseModel):
    """The fields completions and chat share."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # vLLM's -1 and 0 both mean no limit
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: Literal[0, 0.0] = 0
    frequency_penalty: Literal[0, 0.0] = 0
    user: str | None = None
    cache_salt: str | None = Field(None, min_length=1)  # vLLM's: only requests with the same salt share cached blocks
    return_routed_experts: bool = False  # each choice gets `routed_experts` (SamplingParams.return_routed_experts)
    return_token_ids: bool = False  # vLLM's: each choice gets its `token_ids` and `prompt_token_ids`
    stop_token_ids: list[int] | None = None  # vLLM's: sampling one of these ends the choice (reason stop)
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"  # vLLM's (SamplingParams)
    kv_after_update: Literal["keep", "recompute"] | None = None  # SamplingParams.kv_after_update

    def options(self, max_tokens: int, logprobs: int | None) -> dict:
        """SamplingParams fields for choice `index` 0 (the others shift the seed: see `seeds`)."""
        return dict(
            temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0), max_tokens=max_tokens,
            stop=stop_strings(self.stop, "stop"), ignore_eos=self.ignore_eos, logprobs=logprobs,
            return_routed_experts=self.return_routed_experts, stop_token_ids=tuple(self.stop_token_ids or ()),
            logprobs_mode=self.logprobs_mode, kv_after_update=self.kv_after_update,
        )

    def seeds(self) -> list[int | None]:
        return choice_seeds(self.seed, self.n)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(Sampling):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int = Field(16, gt=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False

    @model_validator(mode="after")
    def check(self) -> "CompletionRequest":
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs would need the prompt's logprobs, which this server does not compute")
        return self

    def prompts(self) -> list[str | TokenIds]:
        """The batch of prompts (a token-id list is one prompt)."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        if not self.prompt:
            raise FieldError("prompt", "the prompt is empty.")
        return list(self.prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: TokenIds


class WeightUpdate(BaseModel):
    """The fields every weight update shares (SGLang's names)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    weight_version: str | None = Field(None, min_length=1)  # names the new weights from here on
    abort_all_requests: bool = False  # else the update waits for the requests in flight to finish
    flush_cache: bool = True  # accepted: the prefix cache never serves a block of older weights anyway


class UpdateFromDiskRequest(WeightUpdate):
    model_path: str


class InitWeightsGroupRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    master_address: str
    # AReaL sends the port as a string (areal/engine/sglang_remote.py: str(meta.nccl_master_port)); SGLang's
    # pydantic body takes either.
    master_port: int = Field(gt=0, lt=65536, strict=False)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: Literal["gloo", "nccl"] = "gloo"
    timeout_s: float = Field(600.0, gt=0)  # moeshard's: how long the rendezvous and each broadcast may wait


class DestroyWeightsGroupRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    group_name: str = "weight_update_group"


class UpdateFromDistributedRequest(WeightUpdate):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    load_format: None = None  # one broadcast per tensor; SGLang's flattened buckets are not taken


class UpdateFromTensorRequest(WeightUpdate):
    serialized_named_tensors: list[str] = Field(min_length=1)  # base64 of safetensors files (never pickle)
    load_format: None = None


class PauseRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    # moeshard's modes, and SGLang's in_place and retract (io_struct.py PauseGenerationReqInput)
    mode: Literal["abort", "wait", "keep", "in_place", "retract"] = "abort"


class ResetCacheRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    reset_running_requests: bool = False


class NullIsDefault(BaseModel):
    """A body whose null fields take their defaults, as SGLang's and vLLM's own bodies do (their
    clients send null for "not set"); `keep_null` names the fields where null means something else."""

    keep_null: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def drop_nulls(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k in cls.keep_null}
        return data


class TokenSampling(NullIsDefault):
    """The `sampling_params` fields SGLang's and vLLM's token-in/token-out bodies share, by name and
    meaning (serve/sglang.py, serve/vllm.py); each adds its own names, defaults and no-ops."""

    model_config = ConfigDict(strict=True, extra="forbid")
    greedy_below: ClassVar[float]  # the peer samples greedily below this temperature
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int  # -1 (and vLLM's 0): no limit
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=128)
    # moeshard's (vLLM's --logprobs-mode, per request here): logprobs of the raw logits, or after
    # temperature, top-k and top-p
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    # moeshard's: after a weight update under a keep pause, keep this request's KV or recompute it
    # (None: the server's --kv-after-update)
    kv_after_update: Literal["keep", "recompute"] | None = None

    def options(self, logprobs: int | None, routed: bool) -> dict:
        """SamplingParams fields but max_tokens and seed."""
        return dict(
            temperature=0.0 if self.temperature < self.greedy_below else self.temperature, top_p=self.top_p,
            top_k=max(self.top_k, 0), stop=stop_strings(self.stop, "sampling_params.stop"),
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos, logprobs=logprobs,
            logprobs_mode=self.logprobs_mode, kv_after_update=self.kv_after_update, return_routed_experts=routed,
        )


class FieldError(ValueError):
    """A request field the engine refuses; answered 400 naming it."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


def parse_fields(model: type[BaseModel], data: dict, prefix: str) -> BaseModel:
    """`data` (a dict inside a body, e.g. sampling_params) as `model`, or a FieldError naming the
    field at fault as `prefix.field`."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        param, message = validation_message(exc.errors())
        raise FieldError(f"{prefix}.{param}" if param else prefix, f"{prefix}.{message}" if param else message) from None


def refuse_unsupported(values: BaseModel, no_ops: dict[str, tuple], prefix: str = "") -> None:
    """Fields this engine does not implement are taken only at a value that changes nothing."""
    for name, accepted in no_ops.items():
        if getattr(values, name) not in accepted:
            param = f"{prefix}.{name}" if prefix else name
            raise FieldError(param, f"{param} is not supported by this engine; it takes only {accepted[0]!r}.")


ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 409: "ConflictError",
               413: "RequestTooLargeError", 503: "ServiceUnavailableError", 500: "InternalServerError"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """An OpenAI error object."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "BadRequestError"), "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def validation_message(errors: list[dict]) -> tuple[str | None, str]:
    """The first validation error as (field, one sentence); a field the body should not have comes
    first (another route's field, a typo), before the fields it then lacks."""
    error = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    if error["type"] == "json_invalid":
        return None, "the request body is not valid JSON."
    loc = [str(part) for part in error["loc"] if part not in ("body", "query")]
    field = loc[0] if loc else None
    if error["type"] == "missing":
        return field, f"{'.'.join(loc)} is required."
    if error["type"] == "extra_forbidden":
        return field, f"{'.'.join(loc)} is not a field of this request."
    if len(loc) > 1 and not loc[1].isdigit():  # a union's branch: say the field, not the branch
        return field, f"{field} has the wrong type."
    message = error["msg"].removeprefix("Value error, ")
    return field, f"{'.'.join(loc)}: {message[0].lower()}{message[1:]}." if field else f"{message}."
