"""The trainer's side of a rollout engine that runs elsewhere: `moeshard serve`, driven over HTTP.

What an RL framework's rollout client does (SGLang's routes, which moeshard serves): rollouts on
/v1/completions, and after each optimizer step the new weights over a process group of their own
(moeshard.engine.weight_sync). The trainer is rank 0 of that group and hosts its store; it calls
the engine's route and joins (or broadcasts) at the same time, since each side waits for the other.
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Callable

import httpx
import torch
from safetensors.torch import save

from moeshard.engine.weight_sync import GroupSpec, WeightsGroup

CONTROL_TIMEOUT_S = 600.0


class EngineRefused(RuntimeError):
    """The engine answered a control call with an error object."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


class RemoteEngine:
    def __init__(self, url: str, api_key: str | None = None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=url, headers=headers, timeout=CONTROL_TIMEOUT_S)
        self.group: WeightsGroup | None = None
        self.group_name = "weight_update_group"

    def call(self, route: str, body: dict | None = None, method: str = "POST") -> dict:
        response = self.http.request(method, route, json=body)
        if response.status_code != 200:
            raise EngineRefused(response.status_code, response.json()["error"]["message"])
        return response.json()

    def model_info(self) -> dict:
        return self.call("/get_model_info", method="GET")

    def while_calling(self, route: str, body: dict, work: Callable[[], object]):
        """Call `route` and run `work` at the same time (each side of a collective waits for the
        other); the route's answer, once both are done. A refusal raises after `work` finished."""
        answer: dict = {}

        def post() -> None:
            try:
                answer["ok"] = self.call(route, body)
            except Exception as exc:  # re-raised in the caller's thread
                answer["error"] = exc

        thread = threading.Thread(target=post, daemon=True)
        thread.start()
        try:
            work()
        finally:
            thread.join()
        if "error" in answer:
            raise answer["error"]
        return answer["ok"]

    def join_weights_group(self, port: int, address: str = "127.0.0.1", timeout_s: float = 120.0) -> None:
        """Form the weights group with every engine rank (the trainer: rank 0, hosting the store)."""
        ranks = self.model_info()["num_ranks"]
        spec = GroupSpec(address, port, 1, 1 + ranks, self.group_name, "gloo", timeout_s)
        body = {"master_address": address, "master_port": port, "rank_offset": 1, "world_size": 1 + ranks,
                "group_name": self.group_name, "timeout_s": timeout_s}
        joined: dict = {}
        self.while_calling("/init_weights_update_group", body, lambda: joined.setdefault("group", WeightsGroup.join(spec, 0)))
        self.group = joined["group"]

    def send_weights(self, weights: dict[str, torch.Tensor], weight_version: str | None = None,
                     abort_all_requests: bool = False) -> tuple[dict, float]:
        """Announce and broadcast `weights` (checkpoint names → full tensors); the engine's answer and
        the seconds the update took, announcement to answer."""
        if self.group is None:
            raise RuntimeError("join_weights_group first.")
        names = list(weights)
        body = {"names": names, "dtypes": [str(weights[n].dtype).removeprefix("torch.") for n in names],
                "shapes": [list(weights[n].shape) for n in names], "group_name": self.group_name,
                "weight_version": weight_version, "abort_all_requests": abort_all_requests}
        start = time.perf_counter()

        def broadcast() -> None:
            for name in names:
                self.group.broadcast(weights[name].contiguous())

        answer = self.while_calling("/update_weights_from_distributed", body, broadcast)
        return answer, time.perf_counter() - start

    def send_tensors(self, weights: dict[str, torch.Tensor], weight_version: str | None = None) -> dict:
        """A small update in the request body: safetensors bytes, base64."""
        payload = base64.b64encode(save({n: t.contiguous() for n, t in weights.items()})).decode()
        return self.call("/update_weights_from_tensor", {"serialized_named_tensors": [payload], "weight_version": weight_version})

    def leave_weights_group(self) -> None:
        self.call("/destroy_weights_update_group", {"group_name": self.group_name})
        self.group = None

    def close(self) -> None:
        self.http.close()
