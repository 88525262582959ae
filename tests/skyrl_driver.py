"""SkyRL's own rollout client, unmodified, driving a `moeshard serve`: run in SkyRL's venv
(.peers/skyrl, scripts/rl_clients.sh) by tests/test_rl_clients.py, answering JSON lines (client_repl).

    .peers/skyrl/bin/python tests/skyrl_driver.py URL MODEL_NAME

SkyRL 0.3.0's package `__init__` for `skyrl.backends` imports pydantic models that need Python >= 3.12
(`typing.TypedDict` in a pydantic model), while `RemoteInferenceClient`'s module needs only aiohttp
and two stdlib-only skyrl modules. So the parent packages are stood in by empty modules whose
`__path__` is the installed package's folder: the client's module and everything it imports load
from the installed files, unmodified, and no package `__init__` runs.
"""

import asyncio
import json
import socket
import sys
import types
from dataclasses import dataclass, replace
from importlib.util import find_spec
from pathlib import Path

from client_repl import serve  # first: it sends the frameworks' prints to stderr

ROOT = Path(find_spec("skyrl").origin).parent  # finds the package without executing it
for package in ("skyrl", "skyrl.backends", "skyrl.backends.skyrl_train", "skyrl.backends.skyrl_train.inference_servers"):
    stand_in = types.ModuleType(package)
    stand_in.__path__ = [str(ROOT.joinpath(*package.split(".")[1:]))]
    sys.modules[package] = stand_in

from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import (  # noqa: E402
    RemoteInferenceClient,
)


@dataclass
class BroadcastInitInfo:
    """SkyRL's init info for the broadcast weight sync (skyrl/backends/skyrl_train/weight_sync/
    broadcast_strategy.py:29-75, the two methods the client calls): that module imports ray and
    torch at its top for the trainer side, which needs vLLM's NCCL engine, so it is not loaded here."""

    master_addr: str
    master_port: int
    rank_offset: int
    world_size: int

    def for_servers(self, world_size_per_server: int, num_servers: int, dp_size: int = 1) -> list:
        infos, rank_offset = [], self.rank_offset
        for i in range(num_servers):
            infos.append(replace(self, rank_offset=rank_offset))
            if (i + 1) % dp_size == 0:
                rank_offset += world_size_per_server
        return infos

    def to_api_payload(self) -> dict:
        return {"master_address": self.master_addr, "master_port": self.master_port,
                "rank_offset": self.rank_offset, "world_size": self.world_size}


def main(url: str, model: str) -> None:
    client = RemoteInferenceClient(proxy_url=url, server_urls=[url], data_parallel_size=1, model_name=model)
    # With routes, SkyRL's client calls its own server's /skyrl/v1/generate instead (client :479-483).
    routing = RemoteInferenceClient(proxy_url=url, server_urls=[url], data_parallel_size=1, model_name=model,
                                    enable_return_routed_experts=True)

    async def generate(prompt_token_ids: list, sampling_params: dict, routed_experts: bool = False) -> dict:
        batch = {"prompt_token_ids": prompt_token_ids, "sampling_params": sampling_params}
        return dict(await (routing if routed_experts else client).generate(batch))

    async def chat(body: dict) -> dict:
        return await client.chat_completion({"json": body})

    async def tokenize(texts: list) -> dict:
        return {"tokens": await client.tokenize(texts)}

    async def call(method: str, **args) -> dict:
        """A control-plane call; its answer per server (the test checks the effect, not this)."""
        return {"answers": await getattr(client, method)(**args)}

    async def sync_weights(trainer: list) -> dict:
        """SkyRL's broadcast weight sync with `trainer` (a command) as its trainer rank 0: the group
        sized from /get_world_size + 1 (BroadcastTransferStrategy.create_init_info), the trainer
        joining while the client inits the servers (workers/worker.py:425-447), then one
        update_named_weights call while the trainer broadcasts, packed (broadcast_strategy.py:150-171)."""
        world_size, _ = await client.get_world_size()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        info = BroadcastInitInfo("127.0.0.1", port, rank_offset=1, world_size=world_size + 1)
        proc = await asyncio.create_subprocess_exec(*trainer, "127.0.0.1", str(port), str(world_size + 1),
                                                    stdout=asyncio.subprocess.PIPE)
        metadata = json.loads(await proc.stdout.readline())  # names, dtype_names, shapes
        await client.init_weight_update_communicator(info)
        await client.update_named_weights({**metadata, "packed": True})
        sent = json.loads(await proc.stdout.readline())
        return {"world_size": world_size + 1, "trainer": sent, "returncode": await proc.wait()}

    async def close() -> None:
        await client.teardown()
        await routing.teardown()

    serve({"generate": generate, "chat": chat, "tokenize": tokenize, "call": call, "sync_weights": sync_weights}, close)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
