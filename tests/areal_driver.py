"""AReaL's own SGLang rollout engine, unmodified, driving a `moeshard serve`: run in AReaL's venv
(.peers/areal, scripts/rl_clients.sh) by tests/test_rl_clients.py, answering JSON lines (client_repl).

    .peers/areal/bin/python tests/areal_driver.py HOST:PORT RECORD_ROOT

`RemoteSGLangEngine` (areal/engine/sglang_remote.py) is imported as AReaL's trainers import it, and
the trainer's half of each weight update is done as AReaL's FSDP engine does it
(areal/engine/fsdp_engine.py): pause, the update call, continue; for the distributed update its
`init_custom_process_group` (areal/engine/core/distributed.py) over gloo, one broadcast per tensor.
"""

import asyncio
import datetime
import socket
import sys
from pathlib import Path

from client_repl import serve  # first: it sends the frameworks' prints to stderr

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from areal.api import ModelAllocation, ModelRequest, ParamSpec, WeightUpdateMeta
from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig, NameResolveConfig
from areal.engine.core.distributed import init_custom_process_group
from areal.engine.sglang_remote import RemoteSGLangEngine
from areal.utils import name_resolve, names

EXPERIMENT, TRIAL = "moeshard", "clients"
GEN_ALLOCATION = "sglang:d2"  # the server's 2 engine ranks, as AReaL counts inference ranks
GROUP = "update_weight_group"  # fsdp_engine.py's name for the weights group


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(address: str, record_root: str) -> None:
    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=record_root))
    config = InferenceEngineConfig(experiment_name=EXPERIMENT, trial_name=TRIAL, max_concurrent_rollouts=16,
                                   request_timeout=120, setup_timeout=120, return_routed_experts=True)
    engine = RemoteSGLangEngine(config)
    engine.initialize(addr=[address], train_data_parallel_size=1)
    # The trainer's own process group (one process here): AReaL's trainers always run in one.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    group: list = []

    async def generate(input_ids: list, max_new_tokens: int, ignore_eos: bool = False) -> dict:
        gconfig = GenerationHyperparameters(greedy=True, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
        out = await engine.agenerate(ModelRequest(input_ids=input_ids, gconfig=gconfig))
        routes = None if out.routed_experts is None else out.routed_experts.tolist()
        return {"output_tokens": out.output_tokens, "output_logprobs": out.output_logprobs,
                "stop_reason": out.stop_reason, "routed_experts": routes}

    async def call(method: str, **args) -> dict:
        """A synchronous engine method (each runs its own event loop), off this loop's thread."""
        await asyncio.to_thread(getattr(engine, method), **args)
        return {}

    def update_from_disk(checkpoint: str, version: int) -> None:
        """fsdp_engine.py:1633-1660: pause, the update call (which waits for the trainer's "saved"
        record), the checkpoint saved (here: already on disk), the record, continue."""
        engine.set_version(version)
        meta = WeightUpdateMeta(type="disk", path=checkpoint, clear_checkpoint_after_load=False)
        engine.pause_generation()
        done = engine.update_weights_from_disk(meta)
        name_resolve.add(names.update_weights_from_disk(EXPERIMENT, TRIAL, version),
                         str(datetime.datetime.now().timestamp()), keepalive_ttl=120)
        done.result()
        engine.continue_generation()

    def init_group() -> None:
        """fsdp_engine.py:1462-1494: the servers asked to join, while the trainer forms the group."""
        meta = WeightUpdateMeta(type="xccl", gen_allocation=ModelAllocation.from_str(GEN_ALLOCATION),
                                nccl_master_address="127.0.0.1", nccl_master_port=free_port(), nccl_group_name=GROUP)
        joined = engine.init_weights_update_group(meta)
        group[:] = [meta, init_custom_process_group(
            backend="gloo", world_size=meta.gen_allocation.parallel.world_size + 1,
            init_method=f"tcp://127.0.0.1:{meta.nccl_master_port}", rank=0, group_name=GROUP,
            timeout=datetime.timedelta(seconds=120))]
        joined.result()

    def update_from_distributed(checkpoint: str) -> None:
        """fsdp_engine.py:1563-1631 and 1326-1399 with one bucket: pause, the update call, one
        broadcast per tensor in the announced order, continue."""
        meta, pg = group
        weights = load_file(Path(checkpoint) / "model.safetensors")
        specs = [ParamSpec(name=n, shape=tuple(t.shape), dtype=str(t.dtype).split("torch.")[1]) for n, t in weights.items()]
        engine.pause_generation()
        done = engine.update_weights_from_distributed(meta, specs)
        for tensor in weights.values():
            dist.broadcast(tensor, src=0, group=pg)
        done.result()
        engine.continue_generation()

    def threaded(work):
        async def op(**args) -> dict:
            await asyncio.to_thread(work, **args)
            return {}
        return op

    serve({"generate": generate, "call": call, "update_from_disk": threaded(update_from_disk),
           "init_group": threaded(init_group), "update_from_distributed": threaded(update_from_distributed)})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
