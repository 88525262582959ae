"""The routes RL frameworks drive (issue 31), on a real `moeshard serve --dp 2 --ep --enable-sleep-mode`
with a separate trainer process (tests/weights_trainer.py): weights over a process group of their
own and in the request body, refused updates that change nothing, weight versions, pause/continue.

Outputs are compared request by request, each prompt sent once and alone, so two servers with the
same weights run the same batches and answer bit for bit alike (logprobs included).
"""

import base64
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save, save_file

from moeshard.serve.launcher import free_port
from moeshard.bundled.arithmetic import MODEL_DIR, held_out
from moeshard.models.model import part_of
from processes import stop_tree
from test_serve import ENV, Served

pytestmark = pytest.mark.xdist_group("rl_routes")

ARGS = ["--dp", "2", "--ep", "--enable-sleep-mode", "--block-size", "4"]
TRAINER = Path(__file__).parent / "weights_trainer.py"
TIMEOUT = 120


@pytest.fixture(scope="module")
def perturbed(tmp_path_factory) -> Path:
    """The bundled checkpoint with every weight moved (bf16, as stored)."""
    directory = tmp_path_factory.mktemp("perturbed")
    for f in MODEL_DIR.iterdir():
        if f.suffix != ".safetensors":
            (directory / f.name).write_bytes(f.read_bytes())
    generator = torch.Generator().manual_seed(1)
    weights = load_file(MODEL_DIR / "model.safetensors")
    moved = {n: (t.float() + 0.02 * t.float().std() * torch.randn(t.shape, generator=generator)).to(t.dtype) for n, t in weights.items()}
    save_file(moved, directory / "model.safetensors")
    return directory


@pytest.fixture(scope="module")
def servers(tmp_path_factory, perturbed):
    """The server under test (bundled weights) and a fresh one on the perturbed checkpoint."""
    logs = tmp_path_factory.mktemp("rl_routes")
    fresh = Served(logs, [*ARGS, "--model", str(perturbed)], "fresh", wait=False)
    served = Served(logs, ARGS, "served", wait=False)
    fresh.wait()
    served.wait()
    yield served, fresh
    served.stop()
    fresh.stop()


def http(server) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=TIMEOUT)


def answers(server, prompts: list[str], **options) -> list[tuple[str, list, str]]:
    """(text, token logprobs, weight_version) per prompt, each request alone."""
    out = []
    with http(server) as c:
        for prompt in prompts:
            body = {"prompt": prompt, "temperature": 0, "max_tokens": 6, "logprobs": 1, **options}
            choice = c.post("/v1/completions", json=body).raise_for_status().json()["choices"][0]
            out.append((choice["text"], choice["logprobs"]["token_logprobs"], choice["weight_version"]))
    return out


def run_trainer(server, checkpoint: Path, mode: str, version: str) -> dict:
    command = [sys.executable, str(TRAINER), server.url, str(checkpoint), str(free_port()), mode, version]
    done = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def model_info(server) -> dict:
    with http(server) as c:
        return c.get("/get_model_info").raise_for_status().json()


def prompts(start: int, n: int = 4) -> list[str]:
    """Prompts no earlier test sent (a repeated prompt would meet the prefix cache)."""
    return [p.prompt for p in held_out(start + n)[start:]]


def test_update_from_distributed_equals_a_fresh_server(servers, perturbed):
    served, fresh = servers
    assert model_info(served)["weight_version"] == "default"
    before = answers(served, prompts(0))
    assert {version for *_, version in before} == {"default"}

    sent = run_trainer(served, perturbed, "update", "step-1")
    assert sent["answer"] == {"success": True, "generation": sent["answer"]["generation"], "weight_version": "step-1"}
    assert model_info(served)["weight_version"] == "step-1"
    got, want = answers(served, prompts(4)), answers(fresh, prompts(4))
    assert [(t, lp) for t, lp, _ in got] == [(t, lp) for t, lp, _ in want]
    assert {version for *_, version in got} == {"step-1"}
    moved = answers(served, prompts(0), cache_salt="moved")
    assert [lp for _, lp, _ in moved] != [lp for _, lp, _ in before]


def test_refused_updates_change_nothing(servers, perturbed):
    served, _ = servers
    version = model_info(served)["weight_version"]
    before = answers(served, prompts(8), cache_salt="before")

    wrong = run_trainer(served, MODEL_DIR, "wrong-shape", "wrong")
    assert wrong["refused"] == 400 and "has shape" in wrong["message"] and "nothing was written" in wrong["message"]
    assert answers(served, prompts(8), cache_salt="after-wrong") == before

    broke = run_trainer(served, MODEL_DIR, "break-off", "broken")
    assert broke["sent"] == broke["of"] - 1
    # The engine's receive fails as the trainer's connections close; requests queue behind it.
    assert answers(served, prompts(8), cache_salt="after-break") == before
    assert model_info(served)["weight_version"] == version
    with http(served) as c:
        assert c.get("/health").json() == {"status": "ok"}


def test_update_from_tensor_in_parts_equals_a_fresh_server(servers, perturbed):
    served, fresh = servers
    weights = load_file(perturbed / "model.safetensors")
    parts: dict = {}
    for name, tensor in weights.items():
        parts.setdefault(part_of(name), {})[name] = tensor
    with http(served) as c:
        for i, part in enumerate(parts.values()):  # each under the body limit; the last names the version
            version = "tensor-1" if i == len(parts) - 1 else None
            body = {"serialized_named_tensors": [base64.b64encode(save(part)).decode()], "weight_version": version}
            c.post("/update_weights_from_tensor", json=body).raise_for_status()
        bad = {"serialized_named_tensors": [base64.b64encode(b"not safetensors").decode()]}
        refused = c.post("/update_weights_from_tensor", json=bad)
        assert refused.status_code == 400 and "not a safetensors file" in refused.json()["error"]["message"]
    got, want = answers(served, prompts(12)), answers(fresh, prompts(12))
    assert [(t, lp) for t, lp, _ in got] == [(t, lp) for t, lp, _ in want]
    assert {version for *_, version in got} == {"tensor-1"}


def stream(server, prompt: str, out: list, started: threading.Event, **options) -> None:
    """One streamed completion; `out` gets (token ids' texts, finish reason, weight version)."""
    body = {"prompt": prompt, "temperature": 0, "max_tokens": 20, "ignore_eos": True, "stream": True, "logprobs": 0, **options}
    texts, reason, version = [], None, None
    with http(server) as c, c.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            texts += choice["logprobs"]["tokens"]
            reason, version = choice["finish_reason"] or reason, choice["weight_version"]
            started.set()
    out.append((texts, reason, version))


def start_stream(server, prompt: str, **options) -> tuple[threading.Thread, list]:
    out, started = [], threading.Event()
    thread = threading.Thread(target=stream, args=(server, prompt, out, started), kwargs=options, daemon=True)
    thread.start()
    assert started.wait(TIMEOUT)
    return thread, out


def paused_metric(server) -> float:
    with http(server) as c:
        line = next(l for l in c.get("/metrics").text.splitlines() if l.startswith("moeshard:engine_paused{"))
    return float(line.rsplit(" ", 1)[1])


def test_pause_modes_with_requests_in_flight(servers):
    served, _ = servers
    prompt = prompts(16, 1)[0]
    alone: list = []
    stream(served, prompt, alone, threading.Event(), cache_salt="alone")
    with http(served) as c:
        # abort: the stream ends with reason abort; a request sent while paused waits for continue
        thread, out = start_stream(served, prompt, cache_salt="abort")
        assert c.post("/pause_generation", json={"mode": "abort"}).json()["paused"] == "abort"
        thread.join(TIMEOUT)
        assert out[0][1] == "abort" and len(out[0][0]) < 20
        assert c.get("/health").json() == {"status": "paused", "mode": "abort"} and paused_metric(served) == 1
        held, held_out_ = start_held(served, prompt)
        time.sleep(1.0)
        assert held.is_alive()  # held, not run, while paused
        c.post("/continue_generation").raise_for_status()
        held.join(TIMEOUT)
        assert held_out_[0][:2] == alone[0][:2]
        assert c.get("/health").json() == {"status": "ok"} and paused_metric(served) == 0

        # wait: the call returns once the request in flight has finished, whole
        thread, out = start_stream(served, prompt, cache_salt="wait")
        assert c.post("/pause_generation", json={"mode": "wait"}).json()["paused"] == "wait"
        thread.join(TIMEOUT)
        assert out[0][:2] == alone[0][:2]
        c.post("/continue_generation").raise_for_status()

        # keep: the request stays parked with its KV blocks and goes on after continue, token for token
        thread, out = start_stream(served, prompt, cache_salt="keep")
        assert c.post("/pause_generation", json={"mode": "keep"}).json()["paused"] == "keep"
        time.sleep(1.0)
        assert thread.is_alive()
        refused = c.post("/sleep", params={"level": 1})  # a parked request refuses what would drop its KV
        assert refused.status_code == 409
        c.post("/continue_generation").raise_for_status()
        thread.join(TIMEOUT)
        assert out[0][:2] == alone[0][:2] and out[0][1] == "length"

        assert c.post("/pause_generation", json={"mode": "later"}).status_code == 400


def start_held(server, prompt: str) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=stream, args=(server, prompt, out, threading.Event()), kwargs={"cache_salt": "held"},
                              daemon=True)
    thread.start()
    return thread, out


def test_an_update_never_mixes_weights_into_a_request(servers, perturbed):
    """Without abort_all_requests an update waits for the request in flight, which finishes on the
    weights it started with; with it, the request is aborted."""
    served, _ = servers
    weights = load_file(perturbed / "model.safetensors")
    norm = {n: t for n, t in weights.items() if n == "model.norm.weight"}
    payload = [base64.b64encode(save(norm)).decode()]
    prompt = prompts(17, 1)[0]
    with http(served) as c:
        version = c.get("/get_model_info").json()["weight_version"]
        thread, out = start_stream(served, prompt, cache_salt="mix-wait")
        answer = c.post("/update_weights_from_tensor", json={"serialized_named_tensors": payload, "weight_version": "w"})
        thread.join(TIMEOUT)
        assert answer.json()["weight_version"] == "w"
        assert out[0][1] == "length" and out[0][2] == version

        thread, out = start_stream(served, prompt, cache_salt="mix-abort")
        answer = c.post("/update_weights_from_tensor",
                        json={"serialized_named_tensors": payload, "weight_version": "a", "abort_all_requests": True})
        thread.join(TIMEOUT)
        assert answer.json()["weight_version"] == "a" and out[0][1] == "abort" and out[0][2] == "w"


def test_token_ids_model_info_and_bad_group_requests(servers):
    served, _ = servers
    prompt = prompts(18, 1)[0]
    with http(served) as c:
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 0, "return_token_ids": True}
        choice = c.post("/v1/completions", json=body).raise_for_status().json()["choices"][0]
        assert choice["prompt_token_ids"] == c.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
        assert len(choice["token_ids"]) == len(choice["logprobs"]["tokens"])
        info = c.get("/get_model_info").json()
        assert info["num_ranks"] == 2 and info["layout"] == "1x2-ep"
        assert c.get("/get_weight_version").json() == {"weight_version": info["weight_version"]}
        group = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2}
        refused = c.post("/init_weights_update_group", json=group)  # the engine's 2 ranks do not fit
        assert refused.status_code == 400 and "cannot join as ranks 1…2" in refused.json()["error"]["message"]
        refused = c.post("/update_weights_from_distributed", json={"names": [], "dtypes": [], "shapes": []})
        assert refused.status_code == 400 and "no weights group" in refused.json()["error"]["message"]
