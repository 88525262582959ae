"""`moeshard serve` as its users meet it: the real server in a subprocess on a free 127.0.0.1 port,
the real openai client (sync and async, streamed and not), Prometheus' own parser, the RL routes.
Every text is compared with the in-process engine (one rank: layouts are proven equal elsewhere)."""

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx2  # the HTTP client the openai package is built on
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from processes import free_port, stop_tree, wait_listening
from safetensors.torch import load_file, save_file

from moeshard.bundled.arithmetic import MODEL_DIR, held_out
from moeshard.engine import LLM, SamplingParams

pytestmark = pytest.mark.xdist_group("serve")

KEY = "test-key"
NAME = "moeshard-arithmetic"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
PROMPTS = [p.prompt for p in held_out(40)]
GREEDY = dict(temperature=0, max_tokens=6)
TIMEOUT = 120  # seconds, any one client call


class Served:
    def __init__(self, tmp_path, args: list[str], name: str, wait: bool = True):
        self.port, self.log, self.args = free_port(), tmp_path / f"{name}.log", args
        command = [sys.executable, "-m", "moeshard", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(command, env=ENV, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        if wait:
            self.wait()

    def wait(self) -> None:
        """Until it listens (servers started with wait=False start side by side)."""
        wait_listening(self.port, self.proc, 300, f"moeshard serve {' '.join(self.args)}")

    def stop(self) -> None:
        """SIGTERM: exit 0 within the shutdown bound, nothing left behind."""
        code, left = stop_tree(self.proc, timeout_s=60)
        assert (code, left) == (0, []), self.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # blocks of 4 tokens: the arithmetic prompts (~9 tokens) fill two, so repeated prompts hit the prefix cache
    served = Served(tmp_path_factory.mktemp("serve"), ["--dp", "2", "--ep", "--enable-sleep-mode", "--api-key", KEY,
                                                       "--block-size", "4"], "1x2-ep")
    yield served
    served.stop()


@pytest.fixture(scope="module")
def reference():
    with LLM() as llm:
        yield llm


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT)


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT)


def http(server) -> httpx2.Client:
    return httpx2.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT)


def expected(reference, prompts, **params) -> list:
    return reference.generate(prompts, SamplingParams(**{**GREEDY, **params}))


def test_completions_sync_text_lists_and_token_ids(server, reference):
    want = expected(reference, PROMPTS[:4])
    got = client(server).completions.create(model=NAME, prompt=PROMPTS[:4], **GREEDY)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.text for c in got.choices] == [w.text for w in want]
    assert got.usage.prompt_tokens == sum(len(reference.encode(p)) for p in PROMPTS[:4])
    assert got.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    ids = [reference.encode(p) for p in PROMPTS[:2]]
    one = client(server).completions.create(model=NAME, prompt=ids[0], **GREEDY)
    two = client(server).completions.create(model=NAME, prompt=ids, **GREEDY, echo=True)
    assert one.choices[0].text == want[0].text
    assert [c.text for c in two.choices] == [p + w.text for p, w in zip(PROMPTS[:2], want)]
    assert one.choices[0].finish_reason == want[0].finish_reason == "stop"


def test_16_concurrent_streams_equal_in_process(server, reference):
    want = expected(reference, PROMPTS[:16])

    async def stream(prompt: str) -> tuple[str, int, int]:
        text, tokens, usage = "", 0, None
        async with async_client(server) as c:
            chunks = await c.completions.create(model=NAME, prompt=prompt, stream=True, logprobs=0,
                                                stream_options={"include_usage": True}, **GREEDY)
            async for chunk in chunks:
                if chunk.choices:
                    text += chunk.choices[0].text
                    tokens += len(chunk.choices[0].logprobs.tokens)
                usage = chunk.usage or usage
        return text, tokens, usage.completion_tokens

    async def all_streams():
        return await asyncio.gather(*(stream(p) for p in PROMPTS[:16]))

    results = asyncio.run(all_streams())
    assert [text for text, _, _ in results] == [w.text for w in want]
    assert [(tokens, usage) for _, tokens, usage in results] == [(len(w.token_ids),) * 2 for w in want]


def test_chat_sync_and_async_stream(server, reference):
    want = expected(reference, PROMPTS[:1])[0]
    messages = [{"role": "system", "content": "digits, reversed"}, {"role": "user", "content": PROMPTS[0]}]
    got = client(server).chat.completions.create(model=NAME, messages=messages, logprobs=True, top_logprobs=2, **GREEDY)
    assert got.choices[0].message.content == want.text
    assert len(got.choices[0].logprobs.content) == got.usage.completion_tokens == len(want.token_ids)

    async def stream() -> str:
        async with async_client(server) as c:
            chunks = await c.chat.completions.create(model=NAME, messages=messages, stream=True, **GREEDY)
            return "".join([chunk.choices[0].delta.content or "" async for chunk in chunks if chunk.choices])

    assert asyncio.run(stream()) == want.text


def test_n_choices_with_seeds_are_reproducible(server):
    sampled = dict(model=NAME, prompt=PROMPTS[5], temperature=1.5, max_tokens=6, n=3, seed=11)
    first = client(server).completions.create(**sampled)
    again = client(server).completions.create(**sampled)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    alone = client(server).completions.create(**{**sampled, "n": 1, "seed": 12})  # choice i is seeded seed + i
    assert alone.choices[0].text == first.choices[1].text


def test_stop_strings_and_logprobs_equal_in_process(server, reference):
    want = expected(reference, PROMPTS[:1])[0]
    stop = want.text[1]
    got = client(server).completions.create(model=NAME, prompt=PROMPTS[0], stop=[stop], **GREEDY)
    assert got.choices[0].text == want.text[: want.text.index(stop)] == expected(reference, PROMPTS[:1], stop=(stop,))[0].text
    assert got.choices[0].finish_reason == "stop"
    scored = expected(reference, PROMPTS[:1], logprobs=2)[0]
    lp = client(server).completions.create(model=NAME, prompt=PROMPTS[0], logprobs=2, **GREEDY).choices[0].logprobs
    assert len(lp.tokens) == len(scored.token_ids)
    for token, logprob, top, ref in zip(scored.token_ids, lp.token_logprobs, lp.top_logprobs, scored.logprobs):
        assert abs(logprob - ref[token]) < 1e-4
        assert len(top) <= 3 and max(top.values()) == pytest.approx(max(ref.values()), abs=1e-4)


def scrape(server) -> dict[tuple, float]:
    text = http(server).get("/metrics").text
    return {
        (sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def total(metrics: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in metrics.items() if n == name and want <= set(ls))


def test_metrics_count_requests_and_disconnects_free_the_cache(server):
    for p in PROMPTS[:3]:  # their blocks cached, whatever ran before on this server
        client(server).completions.create(model=NAME, prompt=p, **GREEDY)
    before = scrape(server)
    outs = [client(server).completions.create(model=NAME, prompt=p, **GREEDY) for p in PROMPTS[:3]]
    after = scrape(server)

    def grew(name: str, **labels) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert grew("moeshard:request_success_total") == 3
    assert grew("moeshard:request_success_total", finished_reason="stop") == 3
    assert grew("moeshard:prompt_tokens_total") == sum(o.usage.prompt_tokens for o in outs)
    assert grew("moeshard:generation_tokens_total") == sum(o.usage.completion_tokens for o in outs)
    # the prompts were sent above: their blocks are cached, and usage and /metrics count the same hits
    cached = sum(o.usage.prompt_tokens_details.cached_tokens for o in outs)
    assert 0 < cached == grew("moeshard:prefix_cache_hits_total")
    assert grew("moeshard:prefix_cache_queries_total") == sum(o.usage.prompt_tokens for o in outs)
    assert grew("moeshard:time_to_first_token_seconds_count") == 3
    assert grew("moeshard:e2e_request_latency_seconds_count") == 3
    assert grew("moeshard:inter_token_latency_seconds_count") == sum(o.usage.completion_tokens - 1 for o in outs)
    assert total(after, "moeshard:num_requests_running") == total(after, "moeshard:num_requests_waiting") == 0
    assert total(after, "moeshard:kv_cache_usage_perc") == 0
    assert grew("moeshard:moe_steps_total") > 0
    assert {dict(ls)["method"] for n, ls in after if n == "moeshard:moe_steps_total"} <= {"ALLGATHER", "ALLTOALL", "MC2", "FUSED_MC2"}
    routed = {dict(ls)["ep_rank"]: v for (n, ls), v in after.items() if n == "moeshard:moe_routed_tokens_total"}
    assert set(routed) == {"0", "1"} and all(v > 0 for v in routed.values())

    # A client that leaves mid-stream: its request is aborted and its blocks freed.
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 24, "ignore_eos": True, "temperature": 0, "stream": True}
    with http(server) as h, h.stream("POST", "/v1/completions", json=body) as response:
        next(response.iter_lines())
    deadline = time.monotonic() + 30
    while total(now := scrape(server), "moeshard:num_requests_running") or total(now, "moeshard:kv_cache_usage_perc"):
        assert time.monotonic() < deadline, "the disconnected request still holds the cache"
        time.sleep(0.1)
    assert total(now, "moeshard:request_success_total", finished_reason="abort") == total(
        after, "moeshard:request_success_total", finished_reason="abort") + 1


BAD = [  # (what, route, body, status, param)
    ("bad JSON", "/v1/completions", "{not json", 400, None),
    ("a wrong type", "/v1/completions", {"prompt": "1+1=", "max_tokens": "6"}, 400, "max_tokens"),
    ("max_tokens 0", "/v1/completions", {"prompt": "1+1=", "max_tokens": 0}, 400, "max_tokens"),
    ("negative temperature", "/v1/completions", {"prompt": "1+1=", "temperature": -1}, 400, "temperature"),
    ("top_p 0", "/v1/completions", {"prompt": "1+1=", "top_p": 0}, 400, "top_p"),
    ("top_p over 1", "/v1/completions", {"prompt": "1+1=", "top_p": 1.5}, 400, "top_p"),
    ("n 0", "/v1/completions", {"prompt": "1+1=", "n": 0}, 400, "n"),
    ("an empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("no prompt", "/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("a prompt past the context", "/v1/completions", {"prompt": "1" * 40}, 400, "prompt"),
    ("a token id past the vocabulary", "/v1/completions", {"prompt": [3, 99999]}, 400, "prompt"),
    ("no messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("an unknown model", "/v1/completions", {"model": "nope", "prompt": "1+1="}, 404, "model"),
    ("an unknown route", "/v1/nothing", {}, 404, None),
]


def test_bad_inputs_answer_4xx_while_40_good_requests_run(server, reference):
    want = [w.text for w in expected(reference, PROMPTS)]

    async def good(i: int, prompt: str) -> str:
        async with async_client(server) as c:
            if i % 2:
                return (await c.completions.create(model=NAME, prompt=prompt, **GREEDY)).choices[0].text
            chunks = await c.completions.create(model=NAME, prompt=prompt, stream=True, **GREEDY)
            return "".join([chunk.choices[0].text async for chunk in chunks])

    async def bad(h: httpx2.AsyncClient, route, body, headers=None):
        content = body if isinstance(body, str) else json.dumps(body)
        return await h.post(route, content=content, headers={"Content-Type": "application/json", **(headers or {})})

    async def everything():
        async with httpx2.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT) as h:
            goods = [asyncio.create_task(good(i, p)) for i, p in enumerate(PROMPTS)]
            bads = [await bad(h, route, body) for _, route, body, _, _ in BAD]
            keyless = await bad(h, "/v1/completions", {"prompt": "1+1="}, {"Authorization": ""})
            wrong_key = await bad(h, "/v1/completions", {"prompt": "1+1="}, {"Authorization": "Bearer nope"})
            return await asyncio.gather(*goods), bads, [keyless, wrong_key]

    texts, bads, unauthorized = asyncio.run(everything())
    for (what, _, _, status, param), response in zip(BAD, bads):
        error = response.json()["error"]
        assert (response.status_code, error["param"], error["code"]) == (status, param, status), (what, error)
        assert error["message"] and error["type"], what
    for response in unauthorized:
        assert response.status_code == 401 and response.json()["error"]["code"] == 401
    assert texts == want


def test_eval_against_the_server(server, tmp_path):
    out = tmp_path / "eval.json"
    command = [sys.executable, "-m", "moeshard", "eval", "--url", server.url, "--api-key", KEY,
               "--concurrency", "1,4,16", "-n", "32", "--json", str(out)]  # c = 16: two full rounds
    proc = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [r["concurrency"] for r in rows] == [1, 4, 16]
    assert all(r["accuracy"] >= 0.95 and r["identical_to_reference"] for r in rows)
    assert len({r["outputs_sha256"] for r in rows}) == 1


def perturbed_checkpoint(directory, seed: int, wrong_shape: bool = False):
    shutil.copytree(MODEL_DIR, directory)
    path = directory / "model.safetensors"
    tensors = load_file(path)
    g = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if t.is_floating_point() and "norm" not in name:
            tensors[name] = (t.float() + 0.3 * t.float().std() * torch.randn(t.shape, generator=g)).to(t.dtype)
    if wrong_shape:
        name = next(n for n in tensors if n.endswith("mlp.gate.weight"))
        tensors[name] = torch.cat([tensors[name], tensors[name][:1]])
    save_file(tensors, path, metadata={"format": "pt"})
    return directory


def test_rl_cycle_over_http(server, reference, tmp_path):
    """Runs last in this module: it changes the served weights (and puts them back)."""
    perturbed = perturbed_checkpoint(tmp_path / "perturbed", seed=1)
    wrong = perturbed_checkpoint(tmp_path / "wrong", seed=2, wrong_shape=True)
    with LLM(str(perturbed)) as fresh:
        want = [o.text for o in fresh.generate(PROMPTS[:8], SamplingParams(**GREEDY))]
    original = [w.text for w in expected(reference, PROMPTS[:8])]
    assert want != original  # the perturbation shows

    def texts() -> list[str]:
        return [c.text for c in client(server).completions.create(model=NAME, prompt=PROMPTS[:8], **GREEDY).choices]

    long = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 24, "ignore_eos": True, "temperature": 0, "stream": True, "n": 4}
    def reasons(lines) -> list[str]:
        return [json.loads(line[6:])["choices"][0]["finish_reason"] for line in lines if line.startswith("data: {")]

    with http(server) as h:
        with h.stream("POST", "/v1/completions", json=long) as response:
            lines = response.iter_lines()
            next(lines)
            assert h.post("/sleep", params={"level": 1, "mode": "wait"}).status_code == 200  # after they finish
            assert reasons(lines).count("length") == 4
        assert h.post("/wake_up").json() == {"is_sleeping": False}
        with h.stream("POST", "/v1/completions", json=long) as response:
            lines = response.iter_lines()
            next(lines)
            refused = h.post("/sleep", params={"level": 2})
            assert refused.status_code == 409 and "in flight" in refused.json()["error"]["message"]
            assert h.post("/sleep", params={"level": 2, "mode": "abort"}).status_code == 200
            assert reasons(lines).count("abort") == 4
        assert h.get("/is_sleeping").json() == {"is_sleeping": True}
        asleep = h.post("/v1/completions", json={"model": NAME, "prompt": PROMPTS[0]})
        assert asleep.status_code == 503 and asleep.json()["error"]["code"] == 503
        assert h.post("/wake_up", params={"tags": "weights"}).status_code == 200
        assert h.post("/update_weights_from_disk", json={"model_path": str(perturbed)}).status_code == 200
        assert h.post("/wake_up", params={"tags": "kv_cache"}).json() == {"is_sleeping": False}
        assert texts() == want
        refused = h.post("/update_weights_from_disk", json={"model_path": str(wrong)})
        assert refused.status_code == 400 and "mlp.gate.weight" in refused.json()["error"]["message"]
        assert texts() == want
        assert h.post("/reload_weights").status_code == 200
        assert texts() == original
        # awake, no reset: the repeated prompts' cached blocks carry the old weights' version
        assert h.post("/update_weights_from_disk", json={"model_path": str(perturbed)}).status_code == 200
        assert texts() == want
        assert h.post("/reset_prefix_cache").json() == {"success": True}
        assert h.post("/reload_weights").status_code == 200
        assert texts() == original


def test_routed_experts_equal_in_process(server, reference):
    ids = reference.encode(PROMPTS[0])
    want = expected(reference, [ids], return_routed_experts=True)[0]
    asked = dict(model=NAME, prompt=ids, extra_body={"return_routed_experts": True}, **GREEDY)
    (choice,) = client(server).completions.create(**asked).choices
    # [prompt + completion − 1 tokens][4 MoE layers][top-2]: the last token was never fed in.
    assert torch.tensor(choice.routed_experts).shape == (len(ids) + len(want.token_ids) - 1, 4, 2)
    assert choice.routed_experts == want.routed_experts
    chunks = list(client(server).completions.create(**asked, stream=True))
    assert [c.choices[0].model_extra.get("routed_experts") for c in chunks] == [None] * (len(chunks) - 1) + [
        want.routed_experts
    ]
    plain = client(server).completions.create(model=NAME, prompt=ids, **GREEDY)
    assert "routed_experts" not in plain.choices[0].model_extra
    messages = [{"role": "user", "content": PROMPTS[0]}]
    chat = client(server).chat.completions.create(model=NAME, messages=messages, extra_body=asked["extra_body"], **GREEDY)
    assert len(chat.choices[0].routed_experts) == chat.usage.prompt_tokens + chat.usage.completion_tokens - 1


def test_model_without_template_and_sigterm_mid_stream(tmp_path):
    """A tiny random checkpoint (no tokenizer, no chat template), one rank; SIGTERM while a stream runs."""
    subprocess.run([sys.executable, "-m", "moeshard", "tiny", "qwen3_moe", str(tmp_path / "tiny")], env=ENV, check=True,
                   capture_output=True, timeout=300)
    served = Served(tmp_path, ["--model", str(tmp_path / "tiny"), "--shutdown-timeout", "5"], "tiny")
    try:
        c = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
        name = c.models.list().data[0].id
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            c.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError, match="no tokenizer"):
            c.completions.create(model=name, prompt="hi")
        ids = dict(model=name, prompt=[1, 2, 3], extra_body={"ignore_eos": True})
        assert c.completions.create(**ids, max_tokens=4).usage.completion_tokens == 4
        stream = c.completions.create(**ids, max_tokens=200, stream=True)
        next(iter(stream))
        t0 = time.monotonic()
        served.stop()  # SIGTERM with a stream in flight: exit 0, nothing left
        assert time.monotonic() - t0 < 30
    finally:
        if served.proc.poll() is None:
            stop_tree(served.proc, timeout_s=5, sig=signal.SIGKILL)
