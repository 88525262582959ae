"""The RL frameworks' own rollout clients, unmodified, drive a real `moeshard serve --dp 2 --ep
--enable-sleep-mode` (issue 41): SkyRL's RemoteInferenceClient (vLLM's routes) and AReaL's
RemoteSGLangEngine (SGLang's routes), each in its own venv (scripts/rl_clients.sh), each run by a
driver (tests/skyrl_driver.py, tests/areal_driver.py) that answers JSON lines. Every call is checked
by its effect: tokens equal the in-process engine's on the same weights (one rank: layouts are
proven equal elsewhere), or the server's own /v1/completions sent alone; after an update, the
engine's on the new weights; parked requests make no progress until resumed, then finish as if
never paused; a reset cache is missed; memory released with the weights leaves the server's processes.
"""

import json
import select
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from moeshard.bench.servers import resident_mb
from moeshard.bundled.arithmetic import MODEL_DIR, held_out
from moeshard.engine import LLM, SamplingParams
from test_rl_routes import ARGS, perturbed  # noqa: F401 (a fixture: the bundled checkpoint, every weight moved)
from test_serve import ENV, NAME, Served

pytestmark = pytest.mark.xdist_group("rl_clients")

HERE = Path(__file__).parent
PEERS = HERE.parent / ".peers"
TIMEOUT = 120
PROMPTS = [p.prompt for p in held_out(12)]  # 8 tokens each: room for 20 more in the 32-token context
LONG = 20


def skyrl_params(max_tokens: int, **extra) -> dict:
    """The sampling params SkyRL's generator sends (inference_servers/engine_utils.py:55-77,
    get_vllm_sampling_params, with its config's defaults: train/config/config.py:712-721, greedy);
    `extra` as its `additional_kwargs`."""
    return {"min_tokens": 1, "skip_special_tokens": True, "include_stop_str_in_output": True, "max_tokens": max_tokens,
            "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "logprobs": 1, "stop": None, **extra}


def needs(peer: str):
    return pytest.mark.skipif(not (PEERS / peer / "bin" / "python").exists(),
                              reason=f"{peer}'s client is not installed: run scripts/rl_clients.sh")


class Driver:
    """A client's driver process: `ask` sends one op and returns its answer (an error fails the test)."""

    def __init__(self, peer: str, script: str, args: list[str], log: Path):
        self.stderr = log
        self.proc = subprocess.Popen([str(PEERS / peer / "bin" / "python"), str(HERE / script), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, env=ENV)

    def ask(self, op: str, task: str | None = None, **args) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, "args": args, **({"task": task} if task else {})}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], TIMEOUT)
        line = self.proc.stdout.readline() if ready else ""
        assert line, f"{op}: no answer; the driver's log ends:\n{self.stderr.read_text()[-3000:]}"
        answer = json.loads(line)
        assert "error" not in answer, f"{op}: {answer['error']}"
        return answer

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:  # still waiting for a server that never came up
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("rl_clients")


@pytest.fixture(scope="module")
def started(logs):
    served = Served(logs, ARGS, "served", wait=False)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def server(started):
    started.wait()
    return started


@pytest.fixture(scope="module")
def skyrl(server, logs):
    driver = Driver("skyrl", "skyrl_driver.py", [server.url, NAME], logs / "skyrl.log")
    yield driver
    driver.close()


@pytest.fixture(scope="module")
def areal(started, logs):
    """Started beside the server (AReaL's imports take seconds); it waits for /health itself."""
    driver = Driver("areal", "areal_driver.py", [f"127.0.0.1:{started.port}", str(logs / "name_resolve")],
                    logs / "areal.log")
    yield driver
    driver.close()


@pytest.fixture(scope="module")
def engines(perturbed):  # noqa: F811
    """The in-process engine on each set of weights the tests serve."""
    with LLM() as bundled, LLM(str(perturbed)) as moved:
        yield {"bundled": bundled, "perturbed": moved}


def greedy(llm: LLM, prompts: list[str], max_tokens: int, ignore_eos: bool = False) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    return [out.token_ids for out in llm.generate(prompts, params)]


def completions(server, ids: list[int], max_tokens: int, **options) -> dict:
    body = {"prompt": ids, "temperature": 0, "max_tokens": max_tokens, "logprobs": 0, "return_token_ids": True,
            "return_routed_experts": True, **options}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT).raise_for_status().json()["choices"][0]


def metric(server, name: str, **labels) -> float:
    """One series of the server's /metrics (0 if it has none yet)."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    for line in httpx.get(server.url + "/metrics", timeout=TIMEOUT).text.splitlines():
        if line.startswith(f"moeshard:{name}{{") and all(w in line for w in wanted):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def until(server, name: str, changed_from: float, **labels) -> float:
    """Wait until a series of the server's /metrics moves from `changed_from`; its new value."""
    deadline = time.monotonic() + 20  # a request decodes within milliseconds; one refused never does
    while (now := metric(server, name, **labels)) == changed_from:
        assert time.monotonic() < deadline, f"{name} stayed at {changed_from}"
        time.sleep(0.01)
    return now


# AReaL: RemoteSGLangEngine (areal/engine/sglang_remote.py over areal/infra/remote_inf_engine.py)


@needs("areal")
def test_areal_generate_through_its_own_parser(areal, server, engines):
    """agenerate (remote_inf_engine.py:781-946): POST /generate with return_logprob and
    return_routed_experts, answered through SGLangBackend.parse_generation_response (:92-128):
    the tokens, logprobs and routes of the server's own /v1/completions for the same prompt, alone."""
    for prompt in PROMPTS[:2]:
        ids = engines["bundled"].encode(prompt)
        out = areal.ask("generate", input_ids=ids, max_new_tokens=6)
        want = completions(server, ids, 6)
        assert out["output_tokens"] == want["token_ids"] == greedy(engines["bundled"], [prompt], 6)[0]
        assert out["output_logprobs"] == want["logprobs"]["token_logprobs"]
        assert out["stop_reason"] == want["finish_reason"]
        assert out["routed_experts"] == [sum(row, []) for row in want["routed_experts"]]  # [prompt + output - 1, layers × k]


@needs("areal")
def test_areal_pause_continue_resubmits_the_aborted_rollout(areal, server, engines):
    """pause_generation (SGLang's default mode: abort) cuts the request in flight; agenerate sends
    prompt + partial output back (remote_inf_engine.py:849-900), held until continue_generation; the
    rollout ends as the uninterrupted one."""
    ids = engines["bundled"].encode(PROMPTS[4])
    want = completions(server, ids, LONG, ignore_eos=True)
    aborted = metric(server, "request_success_total", finished_reason="abort")
    before = metric(server, "generation_tokens_total")
    areal.ask("generate", task="long", input_ids=ids, max_new_tokens=LONG, ignore_eos=True)
    until(server, "generation_tokens_total", before)  # decoding
    areal.ask("call", method="pause_generation")  # POST /pause_generation {} (sglang_remote.py:325-327)
    assert until(server, "request_success_total", aborted, finished_reason="abort") == aborted + 1
    paused = metric(server, "generation_tokens_total")
    time.sleep(0.5)
    assert metric(server, "generation_tokens_total") == paused  # the resubmission is held
    areal.ask("call", method="continue_generation")  # POST /continue_generation {} (:329-331)
    out = areal.ask("join", task="long")
    assert out["output_tokens"] == want["token_ids"] and out["stop_reason"] == "length"
    # AReaL concatenates each round's routes (remote_inf_engine.py:903-905, :923-927): the first
    # round's rows, then the resubmission's, which cover the prompt again; both the uninterrupted's.
    routes, rows = [sum(row, []) for row in want["routed_experts"]], len(ids) + LONG - 1
    first = len(out["routed_experts"]) - rows
    assert len(ids) <= first < rows and out["routed_experts"] == routes[:first] + routes


@needs("areal")
def test_areal_weight_updates_and_memory(areal, server, engines, perturbed):  # noqa: F811
    """Update from disk, then over a weights group (init_custom_process_group, gloo), each bracketed
    by pause/continue as AReaL's FSDP engine does; release and resume memory as its colocated trainer
    does (trainer/rl_trainer.py:460-530). The answers are each time the new weights'."""
    ids = [engines["bundled"].encode(p) for p in PROMPTS[8:10]]

    def answers() -> list[list[int]]:
        return [areal.ask("generate", input_ids=i, max_new_tokens=6)["output_tokens"] for i in ids]

    areal.ask("update_from_disk", checkpoint=str(perturbed), version=1)  # /update_weights_from_disk
    assert answers() == greedy(engines["perturbed"], PROMPTS[8:10], 6)
    areal.ask("init_group")  # /init_weights_update_group
    areal.ask("update_from_distributed", checkpoint=str(MODEL_DIR))  # /update_weights_from_distributed
    assert answers() == greedy(engines["bundled"], PROMPTS[8:10], 6)

    areal.ask("call", method="offload")  # POST /release_memory_occupation {} (sglang_remote.py:337-339)
    # This is sleep(level=1): on CPU the weights' backup is host memory too, so the process tree's
    # resident memory cannot fall here (measured: within ±3 MiB); SkyRL's level-2 sleep shows the fall.
    assert httpx.get(server.url + "/is_sleeping", timeout=TIMEOUT).json() == {"is_sleeping": True}
    areal.ask("call", method="onload")  # POST /resume_memory_occupation {} (:341-350)
    assert answers() == greedy(engines["bundled"], PROMPTS[8:10], 6)  # the weights came back


# SkyRL: RemoteInferenceClient (skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py)


@needs("skyrl")
def test_skyrl_generate_tokenize_and_chat(server, skyrl, engines):
    ids = skyrl.ask("tokenize", texts=PROMPTS[:4])["tokens"]  # POST /tokenize (client :832-865)
    assert ids == [engines["bundled"].encode(p) for p in PROMPTS[:4]]
    # POST /inference/v1/generate per prompt, then /detokenize per answer (client :365-457, :460-521)
    out = skyrl.ask("generate", prompt_token_ids=ids, sampling_params=skyrl_params(6))
    want = engines["bundled"].generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=6))
    assert out["response_ids"] == [w.token_ids for w in want]
    assert out["responses"] == [w.text for w in want]
    assert out["stop_reasons"] == [w.finish_reason for w in want]
    assert [len(lps) for lps in out["response_logprobs"]] == [len(w.token_ids) for w in want]
    # routes: [prompt + output - 1 positions, layers, top_k] (base.py:49), as /v1/completions has them
    routed = skyrl.ask("generate", prompt_token_ids=ids[:1], sampling_params=skyrl_params(6), routed_experts=True)
    assert routed["rollout_expert_indices"] == [completions(server, ids[0], 6)["routed_experts"]]
    # POST /v1/chat/completions (client :735-766): the bundled template's prompt is the user's message
    answer = skyrl.ask("chat", body={"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 6,
                                     "temperature": 0})
    assert answer["choices"][0]["message"]["content"] == want[0].text


@needs("skyrl")
def test_skyrl_pause_keep_parks_requests_until_resume(server, skyrl, engines):
    """SkyRL's non-colocated weight sync brackets the broadcast with pause_generation (keep) and
    resume_generation (workers/worker_dispatch.py:643-648): requests in flight stop where they are
    and go on after /resume, token for token."""
    ids = [engines["bundled"].encode(p) for p in PROMPTS[4:8]]
    before = metric(server, "generation_tokens_total")
    skyrl.ask("generate", task="long", prompt_token_ids=ids, sampling_params=skyrl_params(LONG, ignore_eos=True))
    until(server, "generation_tokens_total", before)  # decoding
    skyrl.ask("call", method="pause", mode="keep")  # POST /pause?mode=keep&clear_cache=false (client :990-1014)
    parked = metric(server, "generation_tokens_total")
    time.sleep(0.5)
    assert metric(server, "generation_tokens_total") == parked < before + 4 * LONG  # parked mid-way, not finished
    skyrl.ask("call", method="resume")  # POST /resume (client :1016-1018)
    out = skyrl.ask("join", task="long")
    assert out["response_ids"] == greedy(engines["bundled"], PROMPTS[4:8], LONG, ignore_eos=True)
    assert out["stop_reasons"] == ["length"] * 4


# Last: a failed sync leaves the server without weights.


@needs("skyrl")
def test_skyrl_colocated_weight_sync(server, skyrl, engines, perturbed):  # noqa: F811
    """SkyRL's colocated sync (workers/worker_dispatch.py:626-630, fsdp_worker.py:284): the prefix
    cache reset, sleep (level 2: the weights are dropped), wake the weights, the broadcast (vLLM's
    packed weight transfer: /get_world_size, /init_weight_transfer_engine, /update_weights), wake the
    KV cache; then the answers are the new weights'."""
    ids = [engines["bundled"].encode(PROMPTS[8])]
    skyrl.ask("generate", prompt_token_ids=ids, sampling_params=skyrl_params(1))
    hits = metric(server, "prefix_cache_hits_total")
    skyrl.ask("generate", prompt_token_ids=ids, sampling_params=skyrl_params(1))
    assert metric(server, "prefix_cache_hits_total") > hits  # the prompt's full blocks were cached
    skyrl.ask("call", method="reset_prefix_cache", reset_running_requests=True)  # client :1065-1078
    hits = metric(server, "prefix_cache_hits_total")
    skyrl.ask("generate", prompt_token_ids=ids, sampling_params=skyrl_params(1))
    assert metric(server, "prefix_cache_hits_total") == hits  # reset: nothing left to hit

    awake = resident_mb(server.proc.pid)
    skyrl.ask("call", method="sleep")  # POST /sleep?level=2 (client :1028-1052)
    weights_mb = (MODEL_DIR / "model.safetensors").stat().st_size / 2**20
    assert resident_mb(server.proc.pid) < awake - weights_mb  # measured: about twice the weights' bytes
    skyrl.ask("call", method="wake_up", tags=["weights"])  # POST /wake_up?tags=weights (client :1054-1063)
    synced = skyrl.ask("sync_weights", trainer=[sys.executable, str(HERE / "vllm_trainer.py"), str(perturbed)])
    assert synced["world_size"] == 3 and synced["returncode"] == 0
    assert synced["trainer"]["buffers"] == 1  # SkyRL's packed=True, vLLM's 1 GiB buffers
    skyrl.ask("call", method="wake_up", tags=["kv_cache"])
    out = skyrl.ask("generate", prompt_token_ids=[engines["bundled"].encode(p) for p in PROMPTS[8:12]],
                    sampling_params=skyrl_params(6))
    assert out["response_ids"] == greedy(engines["perturbed"], PROMPTS[8:12], 6)
