"""vLLM's drop-in profile (docs/DESIGN.md §10): the routes vLLM's rollout clients call — SkyRL
(skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py), prime-rl, TRL's async
GRPO — with vLLM's fields, defaults and answers. Each route is only a name and a shape over the
`Server` method that means the same: /pause is `Server.pause_generation`, /init_weight_transfer_engine
`Server.init_weights_group`, /update_weights `Server.update_weights` of the process-group update.

Where a default or a shape comes from, in vLLM's vllm/: entrypoints/serve/disagg/protocol.py and
serving.py (GenerateRequest, GenerateResponse, ServingTokens), sampling_params.py (SamplingParams),
entrypoints/serve/dev/rlhf/api_router.py (/pause, /resume, /is_paused, /init_weight_transfer_engine,
/update_weights, /get_world_size), distributed/weight_transfer/nccl_engine.py (NCCLInitInfo,
NCCLUpdateInfo).

The weights group: vLLM's trainer builds it with NCCLWeightTransferEngine.trainer_init, a
StatelessProcessGroup (a TCPStore the trainer hosts, vLLM's own keys) under a PyNcclCommunicator.
This engine joins the group as SGLang's init_custom_process_group does (torch's rendezvous and
store prefixes, gloo on CPU, NCCL on CUDA: engine/weight_sync.py), so the bodies and the rank
arithmetic are vLLM's (engine rank r is rank_offset + r, the trainer rank 0, tensors broadcast in
`names` order) but the trainer must build its end with torch's ProcessGroup, not vLLM's.
"""

from __future__ import annotations

import asyncio
import base64
import io
import time
import uuid
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from fastapi import FastAPI, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from moeshard.engine.weight_sync import BACKENDS
from moeshard.parallel import Layout
from moeshard.serve.app import Choice, Refused, Rollout, Server, cancel_on_disconnect
from moeshard.serve.protocol import (
    FieldError,
    InitWeightsGroupRequest,
    NullIsDefault,
    StreamOptions,
    TokenSampling,
    WeightUpdate,
    parse_fields,
    refuse_unsupported,
)

MIN_LOGPROB = -9999.0  # serving.py _create_tokens_logprobs clamps every logprob to this


class VLLMSampling(TokenSampling):
    """`sampling_params` (sampling_params.py SamplingParams): vLLM's names and defaults."""

    greedy_below: ClassVar[float] = 1e-5  # sampling_params.py _SAMPLING_EPS
    top_k: int = Field(0, ge=-1)  # 0 or -1: no limit
    seed: int | None = None  # choice i of n gets seed + i
    # serving.py: unset, the rest of the context (vLLM's server-side default, not SamplingParams'
    # 16); 0 is answered "length" with no token (vLLM refuses it).
    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)  # 20: vLLM's default --max-logprobs
    routed_experts_prompt_start: int = Field(0, ge=0)  # skip this many prompt positions' routes
    # Taken at any value: the answer is token ids (no text), or they are transport details.
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: int = 0  # SkyRL's sample() sends 2 (FINAL_ONLY); `stream` decides here
    stream_interval: int | None = None
    skip_clone: bool = False
    flat_logprobs: bool = False
    skip_reading_prefix_cache: bool | None = None  # the cache never changes an answer's meaning here
    extra_args: dict[str, Any] | None = None  # read by no in-tree sampler
    # Taken only at the value that changes nothing (NO_OPS).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    prompt_logprobs: int | None = None  # prompt logprobs are not computed by this engine
    prompt_logprob_token_ids: list[int] | None = None
    prompt_logprob_start: int | None = None
    logprob_token_ids: list[int] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_decoding: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    thinking_token_budget: int | None = None
    repetition_detection: dict[str, Any] | None = None
    trace_decode_token_ids: list[int] | None = None
    best_of: int | None = None
    truncate_prompt_tokens: int | None = None
    logits_processors: list[Any] | None = None

    NO_OPS: ClassVar[dict[str, tuple]] = {
        "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "min_p": (0,),
        "min_tokens": (0,), "thinking_token_budget": (None, -1), "best_of": (None, 1),
    } | {name: (None,) for name in (
        "prompt_logprobs", "prompt_logprob_token_ids", "prompt_logprob_start", "logprob_token_ids", "structured_outputs",
        "guided_decoding", "logit_bias", "allowed_token_ids", "bad_words", "repetition_detection",
        "trace_decode_token_ids", "truncate_prompt_tokens", "logits_processors",
    )}


class TokensRequest(NullIsDefault):
    """GenerateRequest (disagg/protocol.py): token ids in, token ids out."""

    model_config = ConfigDict(strict=True, extra="forbid")
    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex, min_length=1)
    token_ids: list[int]
    sampling_params: dict[str, Any]
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(None, min_length=1)
    # moeshard's: vLLM returns routes for every request of a server started with
    # --enable-return-routed-experts; here a request asks (SkyRL's /skyrl/v1/generate always does)
    return_routed_experts: bool = False
    # Set by vLLM's render step, read by no generation: taken at any value.
    assistant_tokens_mask: list[int] | None = None
    token_offsets: list[list[int]] | None = None
    # Taken only at the value that changes nothing (NO_OPS).
    priority: int = 0
    features: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None

    NO_OPS: ClassVar[dict[str, tuple]] = {
        "priority": (0,), "features": (None,), "kv_transfer_params": (None,), "ec_transfer_params": (None,),
    }


class TransferInitRequest(BaseModel):
    """/init_weight_transfer_engine's body: init_info is NCCLInitInfo (master_address, master_port,
    rank_offset, world_size), and moeshard's backend (default: the engine's device's)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    init_info: dict[str, Any]


class TransferUpdateInfo(BaseModel):
    """NCCLUpdateInfo (nccl_engine.py)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool = False


class TransferUpdateRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    update_info: dict[str, Any]


class Generation:
    """One /inference/v1/generate request: its choices, and their answers in vLLM's shape."""

    def __init__(self, server: Server, body: TokensRequest, routes_as_lists: bool):
        self.server, self.body, self.routes_as_lists = server, body, routes_as_lists
        server.check_model(body.model)
        refuse_unsupported(body, TokensRequest.NO_OPS)
        self.sampling = parse_fields(VLLMSampling, body.sampling_params, "sampling_params")
        refuse_unsupported(self.sampling, VLLMSampling.NO_OPS, "sampling_params")
        self.rollout = Rollout(body.token_ids, self.sampling.options(self.sampling.logprobs, body.return_routed_experts),
                               self.sampling.max_tokens, self.sampling.n, self.sampling.seed, body.request_id)

    def choices(self) -> list[Choice]:
        fields = {"prompt": "token_ids", "max_tokens": "sampling_params.max_tokens"}
        choices = self.server.rollout_choices([self.rollout], self.body.cache_salt, fields)
        if self.sampling.routed_experts_prompt_start > len(self.body.token_ids):
            raise FieldError("sampling_params.routed_experts_prompt_start",
                             "sampling_params.routed_experts_prompt_start must be at most the prompt's length.")
        return choices

    def choice(self, choice: Choice, token_ids: list[int], logprobs: list[dict[int, float]], finish_reason) -> dict:
        """GenerateResponseChoice: its token ids, logprobs as serving.py's _create_tokens_logprobs
        writes them, and (finished) routed_experts: base64 of a .npy of [positions, MoE layers,
        top_k] (disagg/protocol.py), or on /skyrl/v1/generate the nested lists SkyRL's
        vllm_server_actor.py sends."""
        out = {"index": choice.index, "token_ids": token_ids, "finish_reason": finish_reason,
               "logprobs": None if self.sampling.logprobs is None else self.logprobs(token_ids, logprobs),
               "routed_experts": None, "weight_version": choice.weight_version,
               "weight_versions": choice.weight_versions}
        if finish_reason is not None and choice.routed_experts is not None:
            routes = self.server.routes(choice, self.sampling.routed_experts_prompt_start)
            out["routed_experts"] = routes.tolist() if self.routes_as_lists else npy_base64(routes, self.server)
        return out

    def logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]]) -> dict:
        def entry(token: int, logprob: float) -> dict:
            return {"token": f"token_id:{token}", "logprob": max(logprob, MIN_LOGPROB), "bytes": None}

        top = self.sampling.logprobs
        return {"content": [
            entry(t, lp[t]) | {"top_logprobs": [entry(k, v) for k, v in
                                                (sorted(lp.items(), key=lambda kv: -kv[1])[:top] if top else [(t, lp[t])])]}
            for t, lp in zip(token_ids, logprobs)
        ]}

    def answer(self, choices: list[Choice]) -> dict:
        """GenerateResponse (disagg/protocol.py)."""
        return {
            "request_id": self.body.request_id, "model": self.server.settings.model_name, "created": int(time.time()),
            "choices": [self.choice(c, c.token_ids, c.logprobs, c.finish_reason) for c in choices],
            "usage": self.server.usage(choices), "prompt_logprobs": None, "kv_transfer_params": None,
        }


def npy_base64(routes: np.ndarray, server: Server) -> str:
    """disagg/protocol.py GenerateResponseChoice.routed_experts: np.save bytes, base64, in the
    smallest unsigned type that holds an expert id (uint8 up to 256 experts, as vLLM's)."""
    experts = max(layer.moe.num_experts for layer in server.inputs.config.layers if layer.moe is not None)
    buffer = io.BytesIO()
    np.save(buffer, routes.astype(np.min_scalar_type(experts - 1)))
    return base64.b64encode(buffer.getvalue()).decode()


def add_vllm_routes(app: FastAPI, server: Server) -> None:
    """Generation and status on every server; /pause, /resume and the weight transfer only with
    --enable-sleep-mode (vLLM keeps them behind VLLM_SERVER_DEV_MODE). /sleep, /wake_up,
    /is_sleeping and /reset_prefix_cache are moeshard's own routes, already vLLM's names."""

    async def generate(body: TokensRequest, request: Request, routes_as_lists: bool):
        generation = Generation(server, body, routes_as_lists)
        choices = await asyncio.to_thread(generation.choices)
        server.check_admissible()
        server.check_rid(body.request_id, "request_id")
        if body.stream:
            async def chunks():
                async for choice, delta in server.run(choices):
                    if delta.token_ids or delta.finished:  # serving.py sends no empty delta
                        choice_out = generation.choice(choice, delta.token_ids, delta.logprobs or [], delta.finish_reason)
                        yield {"request_id": body.request_id, "choices": [choice_out]}
                if body.stream_options is not None and body.stream_options.include_usage:
                    yield {"request_id": body.request_id, "choices": [], "usage": server.usage(choices)}

            return server.stream(chunks())
        await cancel_on_disconnect(request, server.drain(server.run(choices)))
        return generation.answer(choices)

    @app.post("/inference/v1/generate")
    async def inference_generate(body: TokensRequest, request: Request):
        return await generate(body, request, routes_as_lists=False)

    @app.post("/skyrl/v1/generate")
    async def skyrl_generate(body: TokensRequest, request: Request):
        """SkyRL's route on its vLLM server (vllm_server_actor.py `_skyrl_generate`), which its client
        calls instead when it wants routes: always with them, as nested lists."""
        return await generate(body.model_copy(update={"return_routed_experts": True}), request, routes_as_lists=True)

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": server.engine.readiness.paused is not None}

    @app.get("/get_world_size")
    async def get_world_size(include_dp: bool = Query(True)):
        """Every rank (TP × DP), or one DP group's (include_dp=false)."""
        info = await server.on_engine("get_model_info")
        return {"world_size": info["num_ranks"] if include_dp else Layout.parse(info["layout"]).tp}

    if not server.settings.enable_sleep_mode:
        return

    @app.post("/pause")
    async def pause(
        mode: Literal["abort", "wait", "keep"] = Query("abort"), clear_cache: bool = Query(True),
        wait_for_inflight_requests: bool = Query(False),
    ):
        """rlhf/api_router.py: mode abort by default; the deprecated wait_for_inflight_requests is
        mode wait; clear_cache resets the prefix cache after an abort or wait pause."""
        mode = "wait" if wait_for_inflight_requests else mode
        await server.pause_generation(mode)
        if clear_cache and mode != "keep":
            await server.on_engine("reset_prefix_cache")
        return {"status": "paused"}

    @app.post("/resume")
    async def resume():
        await server.on_engine("continue_generation")
        return {"status": "resumed"}

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(body: TransferInitRequest):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        backend = next(name for name, kind in BACKENDS.items() if kind == device)
        group = parse_fields(InitWeightsGroupRequest, {"backend": backend} | body.init_info, "init_info")
        await server.init_weights_group(group)
        return {"message": "Weight transfer initialized"}

    @app.post("/update_weights")
    async def update_weights(body: TransferUpdateRequest):
        info = parse_fields(TransferUpdateInfo, body.update_info, "update_info")
        if info.packed:
            raise Refused(400, "packed broadcasts (vLLM's packed_broadcast_producer) are not taken yet; send "
                               "packed=false, one broadcast per tensor.", "update_info.packed")
        group = InitWeightsGroupRequest.model_fields["group_name"].default
        answer = await server.update_weights(
            "update_weights_from_distributed", WeightUpdate(), info.names, info.dtype_names, info.shapes, group
        )
        return {"message": "Weights updated"} | answer
