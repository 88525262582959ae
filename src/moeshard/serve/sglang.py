"""SGLang's drop-in profile (docs/DESIGN.md §10): the routes SGLang's rollout clients call — slime
(slime/rollout/sglang_rollout.py, slime/backends/sglang_utils/sglang_engine.py), AReaL
(areal/engine/sglang_remote.py), NeMo-RL's SGLang backend — with SGLang's fields, defaults and
answers. Each route is only a name and a shape over the `Server` method that means the same:
releasing memory is `sleep`, resuming it `wake_up`, flushing the cache is `reset_prefix_cache`, an
abort is `Server.abort`, a pause `Server.pause_generation`.

Where a default or a shape comes from, in SGLang's python/sglang/srt/: entrypoints/http_server.py
(the routes and their answers), managers/io_struct.py (GenerateReqInput, AbortReq,
PauseGenerationReqInput, UpdateWeightVersionReqInput, Release/ResumeMemoryOccupationReqInput),
sampling/sampling_params.py (SamplingParams), managers/tokenizer_manager.py `_handle_batch_output`
(meta_info), managers/scheduler.py (logprob_start_len), managers/schedule_batch.py (finish reasons).
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from datetime import datetime, timezone
from typing import Any, ClassVar, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, field_validator

import moeshard
from moeshard.engine.lifecycle import TAGS
from moeshard.parallel import Layout
from moeshard.serve.app import Choice, Refused, Rollout, Server, cancel_on_disconnect
from moeshard.serve.protocol import FieldError, NullIsDefault, TokenSampling, parse_fields, refuse_unsupported

HEALTH_CHECK_TIMEOUT_S = 20  # http_server.py: SGLANG_HEALTH_CHECK_TIMEOUT's default
ABORTED = "the request was aborted (abort_request, or pause_generation with mode abort)."


class SGLangSampling(TokenSampling):
    """`sampling_params` (sampling_params.py SamplingParams): SGLang's names and defaults. A null
    takes the default, as SamplingParams.__post_init__ does; max_new_tokens null is the rest of the
    context."""

    keep_null: ClassVar[tuple[str, ...]] = ("max_new_tokens",)
    greedy_below: ClassVar[float] = 1e-6  # sampling_params.py _SAMPLING_EPS
    max_new_tokens: int | None = Field(128, ge=0)
    top_k: int = -1  # -1: no limit (AReaL's 1e8 is as good)
    skip_special_tokens: bool = True  # how `text` is decoded
    no_stop_trim: bool = False  # True: `text` keeps the stop token or string that ended it
    sampling_seed: int | None = None  # choice i of n gets sampling_seed + i
    # Taken at any value: they shape `text` or the stream's cadence, never a token. slime sends
    # spaces_between_special_tokens=False, and custom_params with top_p < 1 (read only by a
    # custom_logit_processor, which is refused).
    spaces_between_special_tokens: bool = True
    stream_interval: int | None = None
    custom_params: dict[str, Any] | None = None
    # Taken only at the value that changes nothing (NO_OPS).
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    stop_regex: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None

    NO_OPS: ClassVar[dict[str, tuple]] = {
        "min_p": (0,), "frequency_penalty": (0,), "presence_penalty": (0,), "repetition_penalty": (1,),
        "min_new_tokens": (0,), "json_schema": (None,), "regex": (None,), "ebnf": (None,), "structural_tag": (None,),
        "stop_regex": (None,), "logit_bias": (None, {}),
    }

    @field_validator("top_k")
    @classmethod
    def check_top_k(cls, top_k: int) -> int:
        if top_k != -1 and top_k < 1:
            raise ValueError(f"top_k must be -1 (no limit) or at least 1, got {top_k}")
        return top_k


class GenerateRequest(NullIsDefault):
    """GenerateReqInput (io_struct.py): one prompt (`input_ids` a list of ids, or `text` a string)
    or a batch (a list of them); the answer is one object, or a list for a batch or n > 1."""

    model_config = ConfigDict(strict=True, extra="forbid")
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None  # a list: one per prompt
    rid: str | list[str] | None = None  # a string names a batch's prompts rid_0, rid_1, …
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: output tokens only; prompt logprobs are not computed here
    top_logprobs_num: int = Field(0, ge=0, le=20)
    return_text_in_logprobs: bool = False
    stream: bool = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = Field(0, ge=0)  # io_struct.py: rows [start, seqlen - 1); start ≤ prompt
    extra_key: str | None = Field(None, min_length=1)  # SGLang's cache namespace (a cache_salt): moeshard's cache_salt
    log_metrics: bool = True
    # Taken only at the value that changes nothing (NO_OPS).
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    lora_path: Any = None
    custom_logit_processor: Any = None
    session_params: Any = None
    token_ids_logprob: Any = None
    return_hidden_states: bool = False
    routed_dp_rank: Any = None  # moeshard places a request on a DP group itself
    data_parallel_rank: Any = None

    NO_OPS: ClassVar[dict[str, tuple]] = {
        name: (None,) for name in ("input_embeds", "image_data", "video_data", "audio_data", "lora_path",
                                   "custom_logit_processor", "session_params", "token_ids_logprob",
                                   "routed_dp_rank", "data_parallel_rank")
    } | {"return_hidden_states": (False,)}

    def prompts(self) -> tuple[list[str | list[int]], str, bool]:
        """The prompts, the field they came in, and whether they are a batch."""
        if (self.text is None) == (self.input_ids is None):
            raise FieldError("input_ids", "give exactly one of input_ids and text.")
        field, prompt = ("text", self.text) if self.input_ids is None else ("input_ids", self.input_ids)
        batch = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        return (prompt if batch else [prompt]), field, batch

    def samplings(self, count: int) -> list[SGLangSampling]:
        given = self.sampling_params if isinstance(self.sampling_params, list) else [self.sampling_params or {}] * count
        if len(given) != count:
            raise FieldError("sampling_params", f"sampling_params has {len(given)} entries for {count} prompts.")
        samplings = [parse_fields(SGLangSampling, params, "sampling_params") for params in given]
        for sampling in samplings:
            refuse_unsupported(sampling, SGLangSampling.NO_OPS, "sampling_params")
        return samplings

    def rids(self, count: int, batch: bool) -> list[str]:
        if isinstance(self.rid, list):
            if len(self.rid) != count or len(set(self.rid)) != count:
                raise FieldError("rid", f"rid must name each of the {count} prompts once.")
            return self.rid
        rid = self.rid or uuid.uuid4().hex
        return [f"{rid}_{i}" for i in range(count)] if batch else [rid]


class AbortRequest(NullIsDefault):
    """AbortReq (io_struct.py)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    rid: str = ""
    abort_all: bool = False


class MemoryRequest(NullIsDefault):
    """Release/ResumeMemoryOccupationReqInput (io_struct.py); slime sends {"tags": null}."""

    model_config = ConfigDict(strict=True, extra="ignore")
    tags: list[Literal["weights", "kv_cache"]] | None = None


class WeightVersionRequest(BaseModel):
    """UpdateWeightVersionReqInput (io_struct.py), but abort_all_requests defaults to False: SGLang's
    True aborted every parked rollout at each publish (miles PR 2589, "Do not abort in-flight requests
    when bumping the engine weight version")."""

    model_config = ConfigDict(strict=True, extra="ignore")
    new_version: str = Field(min_length=1)
    abort_all_requests: bool = False


class Generation:
    """One /generate request: its choices, and their answers in SGLang's shape."""

    def __init__(self, server: Server, body: GenerateRequest):
        self.server, self.body = server, body
        refuse_unsupported(body, GenerateRequest.NO_OPS)
        self.prompts, self.field, batch = body.prompts()
        self.samplings = body.samplings(len(self.prompts))
        logprobs = body.top_logprobs_num if body.return_logprob else None
        self.rollouts = [
            Rollout(prompt, sampling.options(logprobs, body.return_routed_experts), sampling.max_new_tokens,
                    sampling.n, sampling.sampling_seed, rid)
            for prompt, sampling, rid in zip(self.prompts, self.samplings, body.rids(len(self.prompts), batch))
        ]
        self.listed = batch or any(sampling.n > 1 for sampling in self.samplings)  # io_struct.py is_single

    def choices(self) -> list[Choice]:
        """Checked whole (in a worker thread: text is tokenized here)."""
        fields = {"prompt": self.field, "max_tokens": "sampling_params.max_new_tokens"}
        choices = self.server.rollout_choices(self.rollouts, self.body.extra_key, fields)
        body = self.body
        for choice in choices:
            prompt = len(choice.ids)
            if body.return_logprob and body.logprob_start_len not in (-1, prompt):
                raise FieldError("logprob_start_len", f"logprob_start_len must be -1 or the prompt's length ({prompt}): "
                                                      "this engine does not compute prompt logprobs.")
            if body.return_routed_experts and body.routed_experts_start_len > prompt:
                raise FieldError("routed_experts_start_len",
                                 f"routed_experts_start_len must be at most the prompt's length ({prompt}).")
        return choices

    def answer(self, choice: Choice) -> dict:
        """tokenizer_manager.py `_handle_batch_output`: text and output_ids so far, meta_info."""
        body, sampling = self.body, self.samplings[choice.prompt_index]
        rid = self.rollouts[choice.prompt_index].rid
        meta = {
            "id": rid if sampling.n == 1 else f"{rid}_{choice.index}",
            "finish_reason": self.finish_reason(choice),
            "prompt_tokens": len(choice.ids),
            "completion_tokens": len(choice.token_ids),
            "cached_tokens": choice.cached_tokens,
            "weight_version": choice.weight_version,
            "weight_versions": choice.weight_versions,
        }
        if body.return_logprob:
            meta |= self.logprobs(choice)
        if body.return_routed_experts and choice.routed_experts is not None:
            # int32 little-endian bytes of [positions, MoE layers × top_k], base64 (AReaL's
            # sglang_remote.py parse_generation_response reshapes prompt + completion − 1 rows)
            routes = self.server.routes(choice, body.routed_experts_start_len).astype("<i4")
            meta["routed_experts"] = base64.b64encode(routes.tobytes()).decode()
        answer = {"text": self.text(choice, sampling), "output_ids": list(choice.token_ids), "meta_info": meta}
        return answer | ({"index": choice.index} if self.listed and body.stream else {})

    def finish_reason(self, choice: Choice) -> dict | None:
        """schedule_batch.py FINISH_MATCHED_TOKEN / _STR ("stop", matched), FINISH_LENGTH, FINISH_ABORT."""
        if choice.finish_reason == "stop":
            return {"type": "stop", "matched": choice.matched}
        if choice.finish_reason == "length":
            return {"type": "length", "length": len(choice.token_ids)}
        if choice.finish_reason == "abort":
            return {"type": "abort", "message": ABORTED}
        return None

    def logprobs(self, choice: Choice) -> dict:
        """[logprob, token id, text or None] per output token; the top ones per position (None when
        top_logprobs_num is 0). The input's are empty: SGLang's default start is the prompt's end."""
        text = self.server.token_text if self.body.return_text_in_logprobs else lambda _: None
        top = self.body.top_logprobs_num

        def ranked(logprobs: dict[int, float]) -> list | None:
            best = sorted(logprobs.items(), key=lambda kv: -kv[1])[:top]
            return [[value, token, text(token)] for token, value in best] if top else None

        return {
            "input_token_logprobs": [], "input_top_logprobs": [],
            "output_token_logprobs": [[lp[t], t, text(t)] for t, lp in zip(choice.token_ids, choice.logprobs)],
            "output_top_logprobs": [ranked(lp) for lp in choice.logprobs],
        }

    def text(self, choice: Choice, sampling: SGLangSampling) -> str:
        """The engine's text (special tokens skipped, the stop string cut), or decoded here as
        skip_special_tokens and no_stop_trim ask (SGLang's detokenizer trims a matched stop token or
        string unless no_stop_trim)."""
        tokenizer = self.server.inputs.tokenizer
        if (sampling.skip_special_tokens and not sampling.no_stop_trim) or tokenizer is None:
            return choice.text
        trim = not sampling.no_stop_trim
        ids = choice.token_ids[:-1] if trim and isinstance(choice.matched, int) else choice.token_ids
        text = tokenizer.decode(ids, skip_special_tokens=sampling.skip_special_tokens)
        if trim and isinstance(choice.matched, str) and choice.matched in text:
            text = text[: text.index(choice.matched)]
        return text


def add_sglang_routes(app: FastAPI, server: Server) -> None:
    """The generation and status routes on every server; the control routes (memory, versions)
    only with --enable-sleep-mode, as moeshard's own are. /pause_generation, /continue_generation,
    the weight updates and /get_weight_version are moeshard's own routes, already SGLang's names."""

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(body: GenerateRequest, request: Request):
        generation = Generation(server, body)
        choices = await asyncio.to_thread(generation.choices)
        server.check_admissible()
        for rid in {choice.rid for choice in choices}:
            server.check_rid(rid, "rid")
        if body.stream:
            async def chunks():
                async for choice, _ in server.run(choices):
                    yield generation.answer(choice)

            return server.stream(chunks())
        await cancel_on_disconnect(request, server.drain(server.run(choices)))
        answers = [generation.answer(choice) for choice in choices]
        return answers if generation.listed else answers[0]

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest):
        """An unknown or finished rid changes nothing (http_server.py answers 200 either way)."""
        if body.abort_all or body.rid:
            server.abort(None if body.abort_all else body.rid)
        return Response(status_code=200)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        """reset_prefix_cache; SGLang refuses while requests run, here the cache is freed at once."""
        await server.on_engine("reset_prefix_cache")
        return Response("Cache flushed.\n", media_type="text/plain")

    @app.get("/health_generate")
    async def health_generate():
        """A one-token greedy generate, as http_server.py's: 200 once it answers, 503 if it does not
        within its time (asleep, stopped, or paused)."""
        server.check_admissible()
        choices = server.rollout_choices([Rollout([0], {"temperature": 0.0}, 1)], None, {})
        try:
            await asyncio.wait_for(server.drain(server.run(choices)), HEALTH_CHECK_TIMEOUT_S)
        except TimeoutError:
            raise Refused(503, f"no token within {HEALTH_CHECK_TIMEOUT_S} s (is generation paused?).") from None
        return Response(status_code=200)

    @app.get("/get_server_info")
    async def get_server_info():
        """SGLang's server_args and scheduler_info names for what moeshard has."""
        info = await server.on_engine("get_model_info")
        layout, inputs = Layout.parse(info["layout"]), server.inputs
        return {
            "model_path": info["model_path"], "served_model_name": server.settings.model_name, "dtype": info["dtype"],
            "tp_size": layout.tp, "dp_size": layout.dp, "ep_size": layout.ep_size,
            "context_length": inputs.max_model_len, "max_req_input_len": inputs.max_model_len - 1,
            "page_size": inputs.block_size, "max_total_num_tokens": inputs.num_blocks * inputs.block_size,
            "weight_version": info["weight_version"], "enable_memory_saver": server.settings.enable_sleep_mode,
            "version": moeshard.__version__,
        }

    @app.get("/v1/loads")
    async def loads():
        """v1_loads.py's answer, with one entry for the whole engine (its DP groups together)."""
        stats = await server.on_engine("stats")
        layout = Layout.parse((await server.on_engine("get_model_info"))["layout"])
        capacity = server.inputs.num_blocks * server.inputs.block_size * layout.dp
        return {
            "timestamp": datetime.now(timezone.utc).isoformat(), "version": moeshard.__version__,
            "accelerator": None, "num_accelerators": layout.tp,
            "loads": [{
                "dp_rank": 0, "timestamp": time.time(), "num_running_reqs": stats.running,
                "num_waiting_reqs": stats.waiting, "num_used_tokens": round(stats.kv_usage * capacity),
                "max_total_num_tokens": capacity, "token_usage": stats.kv_usage,
                "cache_hit_rate": stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1),
            }],
        }

    if not server.settings.enable_sleep_mode:
        return

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(body: MemoryRequest | None = None):
        """sleep(level=1): the weights are kept in host memory, so a resume without an update
        serves them again (SGLang keeps them only with --enable-weights-cpu-backup)."""
        tags = (body or MemoryRequest()).tags
        if tags is not None and set(tags) != set(TAGS):
            raise Refused(400, "this engine releases the weights and the KV cache together: give both tags, or none.",
                          "tags")
        return await server.sleep(1, None)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(body: MemoryRequest | None = None):
        return await server.wake_up((body or MemoryRequest()).tags)

    @app.post("/update_weight_version")
    async def update_weight_version(body: WeightVersionRequest):
        if body.abort_all_requests:
            server.abort()
        await server.on_engine("update_weight_version", body.new_version)
        return {"success": True, "message": f"Weight version updated to {body.new_version}",
                "new_version": body.new_version}
