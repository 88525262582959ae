"""The drop-in profiles (docs/serving.md "Drop-in profiles"): SGLang's /generate and vLLM's
/inference/v1/generate with their control routes, on one real `moeshard serve --dp 2 --ep
--enable-sleep-mode`, checked by their effects: the same tokens, logprobs and routes as the server's
own /v1/completions, partial rollouts that resume where they stopped, renamed and moved weights, and
bad input answered 400 without disturbing the request beside it.

Each comparison sends its prompts one at a time, so the engine runs the same batches and answers bit
for bit alike (as in tests/test_rl_routes.py).
"""

import base64
import io
import json
import threading

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from moeshard.bundled.arithmetic import MODEL_DIR, held_out
from moeshard.engine.weight_sync import GroupSpec, WeightsGroup
from moeshard.serve.launcher import free_port
from test_serve import Served

pytestmark = pytest.mark.xdist_group("rollout_routes")

ARGS = ["--dp", "2", "--ep", "--enable-sleep-mode", "--block-size", "4"]
TIMEOUT = 120
GREEDY = {"temperature": 0, "max_new_tokens": 6}
LONG = {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}  # 8-token prompts: 28 of 32 positions


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = Served(tmp_path_factory.mktemp("rollout_routes"), ARGS, "rollout")
    yield served
    served.stop()


@pytest.fixture(scope="module")
def prompts(server) -> list[list[int]]:
    with http(server) as c:
        return [c.post("/tokenize", json={"prompt": p.prompt}).json()["tokens"] for p in held_out(4)]


def http(server) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=TIMEOUT)


def sglang_routes(meta: dict, rows: int) -> list[list[int]]:
    """As AReaL's sglang_remote.py parse_generation_response decodes them."""
    return np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).reshape(rows, -1).tolist()


def flat(routes: list[list[list[int]]]) -> list[list[int]]:
    return [sum(row, []) for row in routes]


def stream(client: httpx.Client, path: str, body: dict, on_first=None) -> list[dict]:
    """The SSE chunks of a streamed request; `on_first` runs once the first chunk is in."""
    chunks = []
    with client.stream("POST", path, json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                chunks.append(json.loads(line[5:]))
                if len(chunks) == 1 and on_first is not None:
                    on_first()
    return chunks


def test_generate_equals_completions_on_both_profiles(server, prompts):
    with http(server) as c:
        for i, ids in enumerate(prompts[:3]):
            want = c.post("/v1/completions", json={
                "prompt": ids, "temperature": 0, "max_tokens": 6, "logprobs": 0, "return_token_ids": True,
                "return_routed_experts": True,
            }).json()["choices"][0]
            rows = len(ids) + len(want["token_ids"]) - 1
            start = 2 * i  # routed_experts_start_len: the rows from there on
            got = c.post("/generate", json={
                "input_ids": ids, "sampling_params": GREEDY, "return_logprob": True, "return_routed_experts": True,
                "routed_experts_start_len": start,
            }).json()
            meta = got["meta_info"]
            assert (got["output_ids"], got["text"]) == (want["token_ids"], want["text"])
            assert [lp for lp, _, _ in meta["output_token_logprobs"]] == want["logprobs"]["token_logprobs"]
            assert [t for _, t, _ in meta["output_token_logprobs"]] == want["token_ids"]
            assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == len(want["token_ids"])
            assert meta["finish_reason"]["type"] == want["finish_reason"] and meta["input_token_logprobs"] == []
            if want["finish_reason"] == "stop":  # EOS: the token that matched
                assert meta["finish_reason"]["matched"] == want["token_ids"][-1]
            assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": len(want["token_ids"])}]
            assert sglang_routes(meta, rows - start) == flat(want["routed_experts"])[start:]

            vllm = c.post("/inference/v1/generate", json={
                "token_ids": ids, "sampling_params": {"temperature": 0, "max_tokens": 6, "logprobs": 0},
                "return_routed_experts": True,
            }).json()["choices"][0]
            assert vllm["token_ids"] == want["token_ids"] and vllm["finish_reason"] == want["finish_reason"]
            assert [e["logprob"] for e in vllm["logprobs"]["content"]] == want["logprobs"]["token_logprobs"]
            assert np.load(io.BytesIO(base64.b64decode(vllm["routed_experts"]))).tolist() == want["routed_experts"]

        # stop_token_ids end it at the token, which `matched` names; processed logprobs are after
        # top-k (of 1: certain), raw ones before
        second = want["token_ids"][1]
        stopped = c.post("/generate", json={"input_ids": ids, "sampling_params": {**GREEDY, "stop_token_ids": [second]}}).json()
        assert stopped["output_ids"] == want["token_ids"][: want["token_ids"].index(second) + 1]
        assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": second}
        for mode, certain in (("processed_logprobs", True), ("raw_logprobs", False)):
            sglang = c.post("/generate", json={"input_ids": ids, "return_logprob": True, "sampling_params": {
                "max_new_tokens": 3, "top_k": 1, "sampling_seed": 0, "logprobs_mode": mode}}).json()
            vllm = c.post("/inference/v1/generate", json={"token_ids": ids, "sampling_params": {
                "max_tokens": 3, "top_k": 1, "seed": 0, "logprobs": 0, "logprobs_mode": mode}}).json()["choices"][0]
            logprobs = [lp for lp, _, _ in sglang["meta_info"]["output_token_logprobs"]]
            assert logprobs == [e["logprob"] for e in vllm["logprobs"]["content"]]
            assert all(lp == 0 for lp in logprobs) == certain

        # min_tokens (SGLang's min_new_tokens; SkyRL sends min_tokens 1 with every generate): no EOS
        # before it, on both profiles alike
        natural = c.post("/generate", json={"input_ids": ids, "sampling_params": {**GREEDY, "max_new_tokens": 12}}).json()
        longer = len(natural["output_ids"]) + 2
        at_least = [
            c.post("/generate", json={"input_ids": ids, "sampling_params": {**GREEDY, "max_new_tokens": 12,
                                                                              "min_new_tokens": longer}}).json()["output_ids"],
            c.post("/inference/v1/generate", json={"token_ids": ids, "sampling_params": {
                "temperature": 0, "max_tokens": 12, "min_tokens": longer}}).json()["choices"][0]["token_ids"],
        ]
        eos = natural["output_ids"][-1]
        assert at_least[0] == at_least[1] and len(at_least[0]) >= longer and eos not in at_least[0][:longer]

        batch = c.post("/generate", json={"input_ids": prompts[:2], "sampling_params": GREEDY}).json()
        assert [b["output_ids"] for b in batch] == [
            c.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY}).json()["output_ids"] for ids in prompts[:2]
        ]


def test_abort_returns_the_partial_rollout_and_resubmitting_finishes_it(server, prompts):
    ids = prompts[3]
    body = {"input_ids": ids, "sampling_params": LONG, "return_logprob": True, "return_routed_experts": True}
    with http(server) as c:
        whole = c.post("/generate", json=body).json()

        def park_and_abort():  # the request is parked mid-rollout, then aborted by its rid
            assert c.post("/pause_generation", json={"mode": "in_place"}).json()["paused"] == "keep"
            assert c.post("/abort_request", json={"rid": "rollout-1"}).status_code == 200

        chunks = stream(c, "/generate", {**body, "rid": "rollout-1", "stream": True}, park_and_abort)
        c.post("/continue_generation")
        part = chunks[-1]
        partial, meta = part["output_ids"], part["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["id"] == "rollout-1"
        assert 0 < len(partial) < 20 and partial == whole["output_ids"][: len(partial)]
        assert [t for _, t, _ in meta["output_token_logprobs"]] == partial
        assert len(sglang_routes(meta, len(ids) + len(partial) - 1)) == len(ids) + len(partial) - 1

        # resubmitted as slime and AReaL do: prompt + partial, the budget left, routes from where they stopped
        start = len(ids) + len(partial) - 1
        rest = c.post("/generate", json={
            **body, "input_ids": ids + partial, "routed_experts_start_len": start,
            "sampling_params": {**LONG, "max_new_tokens": 20 - len(partial)},
        }).json()
        assert partial + rest["output_ids"] == whole["output_ids"]  # greedy: the same rollout
        rows = len(ids) + 20 - 1
        routes = sglang_routes(meta, start) + sglang_routes(rest["meta_info"], rows - start)
        assert routes == sglang_routes(whole["meta_info"], rows)

        for abort in ({"rid": "no-such-request"}, {"rid": "rollout-1"}, {"abort_all": False}, {}):
            assert c.post("/abort_request", json=abort).status_code == 200  # unknown or finished: nothing happens

        # vLLM's keep pause: the request waits, then goes on token for token
        def pause_keep():
            assert c.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
            assert c.get("/is_paused").json() == {"is_paused": True}
            assert c.post("/resume").json() == {"status": "resumed"}

        kept = stream(c, "/inference/v1/generate", {"token_ids": ids, "stream": True, "sampling_params": {
            "temperature": 0, "max_tokens": 20, "ignore_eos": True}}, pause_keep)
        assert sum((k["choices"][0]["token_ids"] for k in kept), []) == whole["output_ids"]
        assert kept[-1]["choices"][0]["finish_reason"] == "length"


def test_bad_input_is_refused_and_disturbs_nothing(server, prompts):
    ids = prompts[0]
    refused = [
        ("/generate", {"input_ids": []}, "input_ids"),
        ("/generate", {"input_ids": [1, -1]}, "input_ids"),
        ("/generate", {"input_ids": [1, 10**6]}, "input_ids"),
        ("/generate", {"input_ids": [ids, []]}, "input_ids"),
        ("/generate", {"input_ids": "1 2 3"}, "input_ids"),
        ("/generate", {"token_ids": ids}, "token_ids"),  # vLLM's field, SGLang's route
        ("/generate", {"input_ids": ids, "text": "1+1="}, "input_ids"),
        ("/generate", {"input_ids": ids, "sampling_params": {"min_p": 0.5}}, "sampling_params.min_p"),
        ("/generate", {"input_ids": ids, "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
        ("/generate", {"input_ids": ids, "sampling_params": {"max_tokens": 4}}, "sampling_params.max_tokens"),
        ("/generate", {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0}, "logprob_start_len"),
        ("/generate", {"input_ids": ids, "return_routed_experts": True, "routed_experts_start_len": 99},
         "routed_experts_start_len"),
        ("/inference/v1/generate", {"input_ids": ids, "sampling_params": {}}, "input_ids"),  # SGLang's, vLLM's
        ("/inference/v1/generate", {"token_ids": ids, "sampling_params": {"max_new_tokens": 4}},
         "sampling_params.max_new_tokens"),
        ("/inference/v1/generate", {"token_ids": [], "sampling_params": {}}, "token_ids"),
        ("/update_weights", {"update_info": {"names": [], "dtype_names": [], "shapes": [], "packed": True,
                                             "packed_buffer_size_bytes": 1024}}, "update_info.packed_buffer_size_bytes"),
        ("/release_memory_occupation", {"tags": ["kv_cache"]}, "tags"),
    ]
    with http(server) as c:
        want = c.post("/generate", json={"input_ids": ids, "sampling_params": LONG}).json()["output_ids"]
        beside: list = []
        running = threading.Thread(target=lambda: beside.extend(stream(
            c, "/generate", {"input_ids": ids, "sampling_params": LONG, "stream": True})))
        running.start()
        for path, body, param in refused:
            answer = c.post(path, json=body)
            assert (answer.status_code, answer.json()["error"]["param"]) == (400, param), (path, body, answer.text)
        assert c.post("/generate", content=b"[1, 2", headers={"content-type": "application/json"}).status_code == 400
        assert c.post("/generate", json=[ids]).status_code == 400
        running.join()
        assert beside[-1]["output_ids"] == want and beside[-1]["meta_info"]["finish_reason"]["type"] == "length"

        # No room left for a token is an answer, not an error: "length" with no token.
        full = ids * 4  # 32 tokens: the whole context
        for body in ({"input_ids": full}, {"input_ids": full + ids}, {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}}):
            answer = c.post("/generate", json={**body, "return_logprob": True}).json()
            assert (answer["output_ids"], answer["meta_info"]["finish_reason"]) == ([], {"type": "length", "length": 0})
        for sampling in ({}, {"max_tokens": 0}):
            choice = c.post("/inference/v1/generate", json={"token_ids": full if not sampling else ids,
                                                             "sampling_params": sampling}).json()["choices"][0]
            assert (choice["token_ids"], choice["finish_reason"]) == ([], "length")


def test_versions_memory_and_weight_transfer(server, prompts):
    ids = prompts[1]
    body = {"input_ids": ids, "sampling_params": GREEDY, "return_logprob": True}
    with http(server) as c:
        before = c.post("/generate", json=body).json()
        assert c.post("/update_weight_version", json={"new_version": "step-7"}).json()["new_version"] == "step-7"
        assert c.get("/get_weight_version").json() == {"weight_version": "step-7"}
        renamed = c.post("/generate", json=body).json()
        assert renamed["meta_info"]["weight_version"] == "step-7" and renamed["output_ids"] == before["output_ids"]
        assert renamed["meta_info"]["weight_versions"] == [{"version": "step-7", "start": 0, "end": len(before["output_ids"])}]

        assert c.post("/release_memory_occupation", json={}).json() == {"is_sleeping": True}
        assert c.post("/generate", json=body).status_code == 503
        assert c.post("/resume_memory_occupation", json={"tags": None}).json() == {"is_sleeping": False}
        assert c.post("/generate", json=body).json()["meta_info"]["output_token_logprobs"] == \
            before["meta_info"]["output_token_logprobs"]

        # vLLM's weight transfer: this process is the trainer (rank 0) of a group with the 2 engine ranks
        assert c.get("/get_world_size").json() == {"world_size": 2}
        weights = load_file(MODEL_DIR / "model.safetensors")
        name = next(n for n in weights if n.endswith("mlp.gate.weight"))
        spec = GroupSpec("127.0.0.1", free_port(), rank_offset=1, world_size=3)
        groups: list = []
        joining = threading.Thread(target=lambda: groups.append(WeightsGroup.join(spec, rank=0)))
        joining.start()
        init_info = {"master_address": spec.master_address, "master_port": spec.master_port, "rank_offset": 1,
                     "world_size": 3}
        assert c.post("/init_weight_transfer_engine", json={"init_info": init_info}).json() == {
            "message": "Weight transfer initialized"}
        joining.join()

        def send(tensor: torch.Tensor, packed: bool = False, path: str = "/update_weights") -> dict:
            """vLLM's update (packed: the tensor's bytes as uint8, as SkyRL sends it); or SkyRL's
            own /collective_rpc update_weights_nccl with the same update_info."""
            info = {"names": [name], "dtype_names": [str(tensor.dtype).removeprefix("torch.")],
                    "shapes": [list(tensor.shape)], "packed": packed}
            request = {"update_info": info} if path == "/update_weights" else {
                "method": "update_weights_nccl", "kwargs": {"update_info": info}}
            answers: list = []
            update = threading.Thread(target=lambda: answers.append(c.post(path, json=request)))
            update.start()
            groups[0].broadcast(tensor.contiguous().view(torch.uint8).view(-1) if packed else tensor)
            update.join()
            return answers[0].json()

        assert send(-weights[name])["message"] == "Weights updated"
        moved = c.post("/generate", json=body).json()["meta_info"]["output_token_logprobs"]
        assert moved != before["meta_info"]["output_token_logprobs"]
        send(weights[name], packed=True)
        assert c.post("/generate", json=body).json()["meta_info"]["output_token_logprobs"] == \
            before["meta_info"]["output_token_logprobs"]
        assert c.post("/collective_rpc", json={"method": "skyrl_start_weight_update"}).json() == {"results": [None]}
        assert send(-weights[name], packed=True, path="/collective_rpc")["results"][0]["message"] == "Weights updated"
        assert c.post("/generate", json=body).json()["meta_info"]["output_token_logprobs"] == moved
        refused = c.post("/collective_rpc", json={"method": "reload_weights"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "method"
        send(weights[name])
        assert c.post("/generate", json=body).json()["meta_info"]["output_token_logprobs"] == \
            before["meta_info"]["output_token_logprobs"]  # the weights are the start-up ones again, bit for bit
        assert c.post("/destroy_weights_update_group", json={}).json() == {"success": True}
        c.post("/update_weight_version", json={"new_version": "default"})
