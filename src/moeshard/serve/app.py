"""The OpenAI-compatible HTTP app (docs/DESIGN.md §7): FastAPI routes over one `AsyncLLM`.

Each choice of a request (n per prompt, for every prompt of a batch) is one engine request; their
deltas are merged into one response, or streamed as SSE chunks ending in `data: [DONE]`. SGLang's
and vLLM's drop-in profiles (serve/sglang.py, serve/vllm.py) are names and shapes over `Server`'s
methods. A client
that goes away cancels its handler, which aborts its engine requests: their KV blocks are free
before the next step. Every refusal is an OpenAI error object, answered before anything reaches
the engine, so a bad request never touches the others.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException
from starlette.middleware.body_limit import RequestBodyLimitMiddleware
from transformers.utils.chat_template_utils import render_jinja_template

import moeshard
from moeshard.engine import SamplingParams
from moeshard.engine.async_llm import AsyncLLM, EngineAsleepError, EngineDeadError
from moeshard.engine.core import RequestDelta
from moeshard.engine.inputs import RequestError
from moeshard.serve.metrics import ServerMetrics
from moeshard.serve.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    FieldError,
    DestroyWeightsGroupRequest,
    InitWeightsGroupRequest,
    PauseRequest,
    ResetCacheRequest,
    TokenizeRequest,
    UpdateFromDiskRequest,
    UpdateFromDistributedRequest,
    UpdateFromTensorRequest,
    WeightUpdate,
    choice_seeds,
    error_body,
    error_response,
    validation_message,
)


@dataclass(frozen=True)
class ServeSettings:
    model_name: str
    api_key: str | None = None
    enable_sleep_mode: bool = False
    sleep_wait_s: float = 300.0  # sleep(mode=wait): longest wait for in-flight requests
    max_request_bytes: int = 1 << 20


SGLANG_PAUSE_MODES = {"in_place": "keep", "retract": "keep"}  # SGLang's pause modes → the engine's


def default_max_request_bytes(max_model_len: int) -> int:
    """64 bytes for every token of the context (a token-id list spends ≤ 8 on one, a text rarely
    more than 16; the rest is room for the other fields and for messages), and never under 1 MiB."""
    return max(1 << 20, 64 * max_model_len)


def too_large(max_bytes: int) -> str:
    return f"the request body is over {max_bytes} bytes (--max-request-bytes)."


class LargeBodyRefusal:
    """ASGI middleware: a Content-Length over the limit is answered 413, as an error object, before a
    byte of the body is read (Starlette's RequestBodyLimitMiddleware, inside, counts a chunked body)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        length = dict(scope.get("headers", ())).get(b"content-length", b"0")
        if scope["type"] == "http" and int(length) > self.max_bytes:  # h11 refuses a length that is no number
            return await error_response(413, too_large(self.max_bytes))(scope, receive, send)
        await self.app(scope, receive, send)


class Refused(Exception):
    """A request answered with an error object (status, message, field)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


@dataclass
class Choice:
    """One engine request of an HTTP request: choice `index` of prompt `prompt_index`."""

    index: int
    prompt_index: int
    ids: list[int]
    params: SamplingParams
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    cache_salt: str | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    weight_version: str | None = None  # the weights in force for it last
    weight_versions: list[dict] = field(default_factory=list)  # which weights sampled which tokens (RequestDelta)
    routed_experts: list[list[list[int]]] | None = None  # asked with return_routed_experts: see RequestDelta
    rid: str | None = None  # the client's name for it (SGLang's rid, vLLM's request_id): /abort_request takes it
    matched: int | str | None = None  # the stop token id or stop string that ended it


@dataclass(frozen=True)
class Rollout:
    """One prompt of a token-in/token-out request: its n choices differ only in their seeds."""

    prompt: str | list[int]
    options: dict  # SamplingParams fields but max_tokens and seed
    max_tokens: int | None  # None: the rest of the context
    n: int = 1
    seed: int | None = None  # choice i gets seed + i, as completions' n choices do
    rid: str | None = None

    def seeds(self) -> list[int | None]:
        return choice_seeds(self.seed, self.n)


def extras(body, choice: Choice, delta: RequestDelta | None = None) -> dict:
    """A choice's fields past OpenAI's, for the whole choice or one streamed `delta` of it: the
    weights that produced it (the version in force, and the spans of tokens each version sampled); with return_token_ids its token ids (the prompt's once: on the last
    chunk); with return_routed_experts, `routed_experts` ([token][MoE layer][top_k] expert ids: the
    finished delta carries them)."""
    part = choice if delta is None else delta
    out = {"weight_version": part.weight_version, "weight_versions": part.weight_versions}
    if body.return_token_ids:
        out["token_ids"] = part.token_ids
        if delta is None or delta.finished:
            out["prompt_token_ids"] = choice.ids
    if part.routed_experts is not None:
        out["routed_experts"] = part.routed_experts
    return out


class Server:
    def __init__(self, engine: AsyncLLM, settings: ServeSettings):
        self.engine, self.inputs, self.settings = engine, engine.inputs, settings
        self.metrics = ServerMetrics(settings.model_name)
        self.scrape_lock = asyncio.Lock()
        self.draining = False  # a sleep is waiting for in-flight requests: admit no new ones
        self.live: dict[int, str | None] = {}  # engine request id → the client's rid, while it runs
        self.created = int(time.time())
        self.chat_template = read_chat_template(self.inputs.directory)

    # --- requests -------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.model_name:
            raise Refused(404, f"the model {model!r} does not exist; this server serves {self.settings.model_name!r}.", "model")

    def check_admissible(self) -> None:
        if self.engine.error is not None:
            raise Refused(503, f"the engine stopped: {self.engine.error}")
        if self.draining:
            raise Refused(503, "the engine is going to sleep; no new requests are admitted.")
        try:
            self.engine.check_ready()
        except RuntimeError as exc:
            raise Refused(503, str(exc)) from None

    def choices(self, prompts: list[str | list[int]], body, max_tokens: int | None, logprobs: int | None) -> list[Choice]:
        """Every choice, checked whole (prompt, sampling, KV capacity) before any is queued."""
        choices = []
        for p, prompt in enumerate(prompts):
            try:
                ids, _ = self.inputs.check_request(prompt, SamplingParams(max_tokens=1))  # the prompt alone
                tokens = max_tokens or self.inputs.max_model_len - len(ids)  # default: the rest of the context
                for j, seed in enumerate(body.seeds()):
                    _, params = self.inputs.check_request(ids, SamplingParams(**body.options(tokens, logprobs), seed=seed))
                    choices.append(Choice(p * body.n + j, p, ids, params, cache_salt=body.cache_salt))
            except (RequestError, FieldError) as exc:
                raise Refused(400, str(exc), exc.param) from None
            except ValueError as exc:
                raise Refused(400, str(exc)) from None
        return choices

    def rollout_choices(self, rollouts: list[Rollout], cache_salt: str | None, fields: dict[str, str]) -> list[Choice]:
        """The choices of token-in/token-out requests (both drop-in profiles), prompt by prompt, checked
        whole before any is queued; `fields` renames "prompt" and "max_tokens" in refusals to the
        profile's names. A prompt that leaves no room for a token (it fills the context, or max_tokens
        is 0) is not refused: its choices arrive finished, reason "length", with no token — verl and
        slime clamp a resubmission's budget on their side and rely on that answer."""
        choices = []
        try:
            for p, rollout in enumerate(rollouts):
                ids = self.inputs.check_prompt(rollout.prompt)
                room = self.inputs.max_model_len - len(ids)
                tokens = room if rollout.max_tokens is None else rollout.max_tokens
                for seed in rollout.seeds():
                    if min(room, tokens) <= 0:
                        params, finished = SamplingParams(**rollout.options, max_tokens=1, seed=seed), "length"
                    else:
                        params = SamplingParams(**rollout.options, max_tokens=tokens, seed=seed)
                        params, finished = self.inputs.check_request(ids, params)[1], None
                    choices.append(Choice(len(choices), p, ids, params, cache_salt=cache_salt, rid=rollout.rid,
                                          finish_reason=finished))
        except RequestError as exc:
            raise Refused(400, str(exc), fields.get(exc.param, exc.param)) from None
        except ValueError as exc:
            raise Refused(400, str(exc)) from None
        return choices

    async def run(self, choices: list[Choice]) -> AsyncIterator[tuple[Choice, RequestDelta]]:
        """Every choice's deltas as they come; leaving early (or being cancelled) aborts them all. A
        choice that arrives finished (no room left in the context) never reaches the engine: it gets
        its one finished delta first."""
        queue: asyncio.Queue = asyncio.Queue()

        async def feed(choice: Choice) -> None:
            request_id, timer, unfinished = next(self.engine.ids), self.metrics.track(len(choice.ids)), "abort"
            self.live[request_id] = choice.rid  # before generate() queues it, so an abort by rid finds it
            try:
                generating = self.engine.generate(choice.ids, choice.params, request_id, cache_salt=choice.cache_salt)
                async for delta in generating:
                    timer.on_delta(len(delta.token_ids), delta.finish_reason)
                    unfinished = None if delta.finished else unfinished
                    queue.put_nowait((choice, delta))
            except Exception as exc:  # the engine died or refused: the response says so
                unfinished = "error"
                queue.put_nowait((choice, exc))
            finally:
                del self.live[request_id]
                if unfinished is not None:
                    timer.on_delta(0, unfinished)

        for choice in choices:
            if choice.finish_reason is not None:
                queue.put_nowait((choice, RequestDelta(-1, finished=True, finish_reason=choice.finish_reason)))
        tasks = [asyncio.create_task(feed(c)) for c in choices if c.finish_reason is None]
        try:
            live = len(choices)
            while live:
                choice, delta = await queue.get()
                if isinstance(delta, Exception):
                    raise delta
                choice.text += delta.text
                choice.token_ids += delta.token_ids
                choice.logprobs += delta.logprobs or []
                choice.cached_tokens, choice.weight_version = delta.cached_tokens, delta.weight_version
                choice.weight_versions = delta.weight_versions
                if delta.finished:
                    choice.finish_reason, live = delta.finish_reason, live - 1
                    choice.routed_experts, choice.matched = delta.routed_experts, delta.matched
                yield choice, delta
        finally:
            for task in tasks:
                task.cancel()

    def abort(self, rid: str | None = None) -> None:
        """End the running requests named `rid`, or every one (reason "abort"): each still answers,
        with what it produced. A rid that is unknown or already finished changes nothing."""
        for request_id, name in list(self.live.items()):
            if rid is None or name == rid:
                self.engine.abort(request_id)

    def check_rid(self, rid: str, param: str) -> None:
        if rid in self.live.values():
            raise Refused(400, f"a request named {rid!r} is still running; request ids must be unique.", param)

    def usage(self, choices: list[Choice]) -> dict:
        prompt = sum(len(ids) for ids in {c.prompt_index: c.ids for c in choices}.values())
        completion = sum(len(c.token_ids) for c in choices)
        # Each prompt once, as prompt_tokens counts it: the most any of its choices found cached.
        cached: dict[int, int] = {}
        for c in choices:
            cached[c.prompt_index] = max(cached.get(c.prompt_index, 0), c.cached_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}

    def routes(self, choice: Choice, start: int) -> np.ndarray:
        """The experts `choice`'s tokens were routed to from position `start` on, as int32
        [positions, MoE layers, top_k] (a position is a token the model read: prompt + output but
        the last)."""
        moe = [layer.moe for layer in self.inputs.config.layers if layer.moe is not None]
        rows = choice.routed_experts[start:]
        return np.asarray(rows, dtype=np.int32).reshape(len(rows), len(moe), moe[0].router.top_k)

    def token_text(self, token: int) -> str:
        tokenizer = self.inputs.tokenizer
        return tokenizer.decode([token], skip_special_tokens=False) if tokenizer is not None else f"token_id:{token}"

    # --- completions ----------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request):
        self.check_model(body.model)
        # Tokenizing runs off the event loop: one long prompt must not hold up /health or other clients.
        choices = await asyncio.to_thread(self.choices, body.prompts(), body, body.max_tokens, body.logprobs)
        self.check_admissible()
        head = {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
                "model": self.settings.model_name}
        echo = {c.index: self.prompt_text(c) if body.echo else "" for c in choices}
        if body.stream:
            async def chunks():
                offsets = {c.index: len(echo[c.index]) for c in choices}
                async for choice, delta in self.run(choices):
                    logprobs = None
                    if body.logprobs is not None:
                        logprobs = self.completion_logprobs(delta.token_ids, delta.logprobs, offsets[choice.index])
                        offsets[choice.index] += sum(len(t) for t in logprobs["tokens"])
                    text = echo.pop(choice.index, "") + delta.text
                    yield {**head, "choices": [{"index": choice.index, "text": text, "logprobs": logprobs,
                                                "finish_reason": delta.finish_reason,
                                                **extras(body, choice, delta)}],
                           **({"usage": None} if body.include_usage else {})}
                if body.include_usage:
                    yield {**head, "choices": [], "usage": self.usage(choices)}

            return self.stream(chunks())
        await cancel_on_disconnect(request, self.drain(self.run(choices)))
        return {**head, "choices": [
            {"index": c.index, "text": echo[c.index] + c.text, "finish_reason": c.finish_reason,
             "logprobs": None if body.logprobs is None else self.completion_logprobs(c.token_ids, c.logprobs, len(echo[c.index])),
             **extras(body, c)}
            for c in choices
        ], "usage": self.usage(choices)}

    def prompt_text(self, choice: Choice) -> str:
        return self.inputs.decode(choice.ids)

    def completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], offset: int) -> dict:
        tokens = [self.token_text(t) for t in token_ids]
        offsets = [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        return {
            "tokens": tokens,
            "token_logprobs": [lp[t] for t, lp in zip(token_ids, logprobs)],
            "top_logprobs": [{self.token_text(k): v for k, v in lp.items()} for lp in logprobs],
            "text_offset": offsets,
        }

    # --- chat -----------------------------------------------------------------------------------

    async def chat(self, body: ChatRequest, request: Request):
        self.check_model(body.model)
        if self.chat_template is None:
            raise Refused(400, f"the model {self.settings.model_name!r} has no chat template (tokenizer_config.json "
                               "chat_template); use /v1/completions.", "messages")
        choices = await asyncio.to_thread(self.chat_choices, body)
        self.check_admissible()
        head = {"id": f"chatcmpl-{secrets.token_hex(12)}", "created": int(time.time()), "model": self.settings.model_name}
        if body.stream:
            async def chunks():
                head_chunk = {**head, "object": "chat.completion.chunk"}
                usage = {"usage": None} if body.include_usage else {}
                for c in choices:
                    yield {**head_chunk, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                      "logprobs": None, "finish_reason": None}], **usage}
                async for choice, delta in self.run(choices):
                    logprobs = self.chat_logprobs(delta.token_ids, delta.logprobs) if body.logprobs else None
                    content = {"content": delta.text} if delta.text or not delta.finished else {}
                    yield {**head_chunk, "choices": [{"index": choice.index, "delta": content, "logprobs": logprobs,
                                                      "finish_reason": delta.finish_reason,
                                                      **extras(body, choice, delta)}], **usage}
                if body.include_usage:
                    yield {**head_chunk, "choices": [], "usage": self.usage(choices)}

            return self.stream(chunks())
        await cancel_on_disconnect(request, self.drain(self.run(choices)))
        return {**head, "object": "chat.completion", "choices": [
            {"index": c.index, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason,
             "logprobs": self.chat_logprobs(c.token_ids, c.logprobs) if body.logprobs else None,
             **extras(body, c)}
            for c in choices
        ], "usage": self.usage(choices)}

    def chat_choices(self, body: ChatRequest) -> list[Choice]:
        messages = [m.model_dump() for m in body.messages]
        try:
            prompt = render_jinja_template(conversations=[messages], chat_template=self.chat_template,
                                           add_generation_prompt=True)[0][0]
        except Exception as exc:  # the template itself refused these messages
            raise Refused(400, f"the chat template could not render these messages: {exc}", "messages") from None
        return self.choices([prompt], body, body.max_completion_tokens or body.max_tokens, body.logprob_count())

    def chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]]) -> dict:
        def entry(token: int, logprob: float) -> dict:
            text = self.token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [
            entry(t, lp[t]) | {"top_logprobs": [entry(k, v) for k, v in sorted(lp.items(), key=lambda kv: -kv[1])]}
            for t, lp in zip(token_ids, logprobs)
        ]}

    # --- shared plumbing ------------------------------------------------------------------------

    @staticmethod
    async def drain(deltas: AsyncIterator) -> None:
        async for _ in deltas:
            pass

    @staticmethod
    def stream(chunks: AsyncIterator[dict]) -> EventSourceResponse:
        async def events():
            try:
                async for chunk in chunks:
                    yield {"data": json.dumps(chunk)}
            except Refused as exc:
                yield {"data": json.dumps(error_body(exc.status, str(exc), exc.param))}
            except (EngineDeadError, EngineAsleepError) as exc:
                yield {"data": json.dumps(error_body(503, str(exc)))}
            yield {"data": "[DONE]"}

        return EventSourceResponse(events(), ping=600)

    async def on_engine(self, method: str, *args, conflict: type[Exception] = RuntimeError):
        """Run the engine's `method(*args)` between two steps; its ValueError is a 400, `conflict` a 409."""
        try:
            return await self.engine.call(method, *args)
        except ValueError as exc:
            raise Refused(400, str(exc)) from None
        except EngineDeadError as exc:
            raise Refused(503, str(exc)) from None
        except conflict as exc:
            raise Refused(409, str(exc)) from None

    # --- lifecycle ------------------------------------------------------------------------------

    async def sleep(self, level: int, mode: str | None) -> dict:
        if mode == "wait":
            self.draining = True
            try:
                deadline = time.monotonic() + self.settings.sleep_wait_s
                while self.engine.num_unfinished() and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                return await self.sleep(level, None)
            finally:
                self.draining = False

        await self.on_engine("sleep", level, mode == "abort")
        return {"is_sleeping": True}

    async def wake_up(self, tags: list[str] | None) -> dict:
        await self.on_engine("wake_up", tags)
        return {"is_sleeping": self.engine.is_sleeping}

    async def init_weights_group(self, body: InitWeightsGroupRequest) -> dict:
        await self.on_engine("init_weights_update_group", *body.model_dump().values())
        return {"success": True, "message": f"joined weights group {body.group_name!r}"}

    async def pause_generation(self, mode: str) -> None:
        """SGLang's in_place and retract keep the requests (retract frees their KV in SGLang; here
        they keep it, and a weight update treats them as it treats any parked request)."""
        await self.on_engine("pause_generation", SGLANG_PAUSE_MODES.get(mode, mode))

    async def update_weights(self, method: str, body: WeightUpdate, *args) -> dict:
        """Run the LLM's weight update `method(*args, weight_version, abort_running)`. No request
        mixes two sets of weights: with abort_all_requests those in flight are aborted; otherwise,
        unless the caller paused generation, the update pauses it (mode wait: new requests are held,
        those in flight finish, within sleep_wait_s) and continues it afterwards."""
        update = (method, *args, body.weight_version, body.abort_all_requests)
        if body.abort_all_requests or self.engine.readiness.paused:
            generation = await self.on_engine(*update)
        else:
            try:
                await asyncio.wait_for(self.on_engine("pause_generation", "wait"), self.settings.sleep_wait_s)
            except TimeoutError:
                await self.on_engine("continue_generation")
                raise Refused(409, f"requests were still in flight after {self.settings.sleep_wait_s:g} s; the weights "
                                   "were not updated: retry, pause generation, or abort them (abort_all_requests).") from None
            try:
                generation = await self.on_engine(*update)
            finally:
                await self.on_engine("continue_generation")
        info = await self.on_engine("get_model_info")
        return {"success": True, "generation": generation, "weight_version": info["weight_version"]}

    async def stats_text(self) -> bytes:
        async with self.scrape_lock:
            if self.engine.error is None:
                self.metrics.engine.stats = await self.engine.call("stats")
            self.metrics.paused.labels(self.settings.model_name).set(self.engine.readiness.paused is not None)
            return generate_latest(self.metrics.registry)


def read_chat_template(directory: Path) -> str | None:
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return None
    template = json.loads(path.read_text()).get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


async def cancel_on_disconnect(request: Request, work: Awaitable) -> None:
    """Run `work`, cancelling it if the client goes away first (its engine requests are aborted)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        raise asyncio.CancelledError
    task.result()


def add_error_handlers(app: FastAPI, key: str | None, max_request_bytes: int) -> None:
    """Every failure answers an OpenAI error object; a set API key guards every route but /health."""
    @app.exception_handler(Refused)
    async def refused(_: Request, exc: Refused):
        return error_response(exc.status, str(exc), exc.param)

    @app.exception_handler(FieldError)
    async def field_error(_: Request, exc: FieldError):
        return error_response(400, str(exc), exc.param)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError):
        param, message = validation_message(exc.errors())
        return error_response(400, message, param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        messages = {
            404: f"no route {request.method} {request.url.path}.",
            405: f"no route {request.method} {request.url.path}.",
            413: too_large(max_request_bytes),
        }
        return error_response(exc.status_code, messages.get(exc.status_code, str(exc.detail)))

    @app.exception_handler(EngineDeadError)
    @app.exception_handler(EngineAsleepError)
    async def unavailable(_: Request, exc: Exception):
        return error_response(503, str(exc))

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception):  # a bug: say so as an error object, keep serving
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if key is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return error_response(401, "a valid API key is required (Authorization: Bearer KEY).")
        return await call_next(request)


def build_app(engine: AsyncLLM, settings: ServeSettings) -> FastAPI:
    server = Server(engine, settings)
    app = FastAPI(title="moeshard", version=moeshard.__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    add_error_handlers(app, settings.api_key, settings.max_request_bytes)
    # A body over the limit gets 413 before anything parses it: by its Content-Length before a byte
    # is read; a chunked one as soon as its bytes pass the limit.
    app.add_middleware(RequestBodyLimitMiddleware, max_body_size=settings.max_request_bytes)
    app.add_middleware(LargeBodyRefusal, max_bytes=settings.max_request_bytes)

    @app.get("/health")
    async def health():
        if engine.error is not None:  # from the moment the engine knows, idle or busy
            return error_response(503, f"the engine stopped: {engine.error}")
        paused = engine.readiness.paused
        return {"status": "ok"} if paused is None else {"status": "paused", "mode": paused}

    @app.get("/version")
    async def version():
        return {"version": moeshard.__version__}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": settings.model_name, "object": "model", "created": server.created, "owned_by": "moeshard",
            "root": str(server.inputs.directory), "max_model_len": server.inputs.max_model_len,
        }]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        server.check_model(body.model)
        try:
            ids = await asyncio.to_thread(server.inputs.encode, body.prompt)
        except ValueError as exc:
            raise Refused(400, str(exc), "prompt") from None
        return {"tokens": ids, "count": len(ids), "max_model_len": server.inputs.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        server.check_model(body.model)
        if any(not 0 <= t < server.inputs.vocab_size for t in body.tokens):
            raise Refused(400, f"token ids must be in [0, {server.inputs.vocab_size}).", "tokens")
        return {"prompt": await asyncio.to_thread(server.inputs.decode, body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        return await server.chat(body, request)

    @app.get("/get_model_info")
    async def get_model_info():
        return await server.on_engine("get_model_info")

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": (await server.on_engine("get_model_info"))["weight_version"]}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = Query(False), body: ResetCacheRequest | None = None):
        """Frees the cached blocks now; correctness never needs it (keys carry the weights' version).
        vLLM's reset_running_requests (its query; SkyRL sends it in the body) is taken and changes
        nothing: running requests keep their own blocks, and no later request can find them."""
        await server.on_engine("reset_prefix_cache")
        return {"success": True}

    @app.get("/metrics")
    async def metrics():
        return Response(await server.stats_text(), media_type=CONTENT_TYPE_LATEST)

    if settings.enable_sleep_mode:
        add_lifecycle_routes(app, server)
    return app


def add_lifecycle_routes(app: FastAPI, server: Server) -> None:
    engine = server.engine

    @app.post("/sleep")
    async def sleep(level: int = Query(1), mode: str | None = Query(None)):
        if level not in (1, 2):
            raise Refused(400, f"level must be 1 or 2, got {level}.", "level")
        if mode not in (None, "abort", "wait"):
            raise Refused(400, f"mode must be abort or wait, got {mode!r}.", "mode")
        return await server.sleep(level, mode)

    @app.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(None)):
        return await server.wake_up(tags)

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": engine.is_sleeping}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateFromDiskRequest):
        return await server.update_weights("update_weights_from_disk", body, body.model_path)

    @app.post("/reload_weights")
    async def reload_weights(body: WeightUpdate | None = None):
        return await server.update_weights("reload_weights", body or WeightUpdate())

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(body: UpdateFromTensorRequest):
        try:
            payloads = [base64.b64decode(p, validate=True) for p in body.serialized_named_tensors]
        except binascii.Error:
            raise Refused(400, "serialized_named_tensors must be base64 strings.", "serialized_named_tensors") from None
        return await server.update_weights("update_weights_from_tensor", body, payloads)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitWeightsGroupRequest):
        return await server.init_weights_group(body)

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: UpdateFromDistributedRequest):
        return await server.update_weights(
            "update_weights_from_distributed", body, body.names, body.dtypes, body.shapes, body.group_name
        )

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: DestroyWeightsGroupRequest | None = None):
        group_name = (body or DestroyWeightsGroupRequest()).group_name
        await server.on_engine("destroy_weights_update_group", group_name)
        return {"success": True}

    @app.post("/pause_generation")
    async def pause_generation(body: PauseRequest | None = None):
        await server.pause_generation((body or PauseRequest()).mode)
        return {"success": True, "paused": engine.readiness.paused}

    @app.post("/continue_generation")
    async def continue_generation():
        await server.on_engine("continue_generation")
        return {"success": True}
