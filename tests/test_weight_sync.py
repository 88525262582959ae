"""Weights from a trainer elsewhere, offline: the engine joins a trainer's group built the way SGLang's
`init_custom_process_group` builds it (torch's own `_new_process_group_helper` under the group-name
store prefix), so a trainer-side client written for SGLang works unchanged; each rank keeps only
its shard; partial updates leave the rest; a broadcast that breaks off changes nothing."""

import datetime
import threading

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save
from torch.distributed import PrefixStore, rendezvous
from torch.distributed.distributed_c10d import _new_process_group_helper, _world

from moeshard import LLM, SamplingParams
from moeshard.serve.launcher import free_port
from moeshard.bundled.arithmetic import MODEL_DIR, held_out
from moeshard.engine.weight_sync import ShardBuffer, TensorMeta
from moeshard.parallel import Layout

PROMPTS = [p.prompt for p in held_out(8)]
GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=1)


def sglang_trainer_group(port: int, world_size: int, group_name: str = "weight_update_group"):
    """SGLang's init_custom_process_group, as its trainer-side users call it (rank 0)."""
    timeout = datetime.timedelta(seconds=60)
    store, rank, world_size = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(world_size, rank, [], "gloo", store, group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def moved(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weights = load_file(MODEL_DIR / "model.safetensors")
    return {n: (w.float() * (1 + 0.1 * torch.randn(w.shape, generator=g))).to(w.dtype) for n, w in weights.items()}


def meta(weights: dict) -> tuple[list, list, list]:
    names = list(weights)
    return names, [str(weights[n].dtype).removeprefix("torch.") for n in names], [list(weights[n].shape) for n in names]


def answers(llm) -> list[tuple[str, list]]:
    return [(o.text, o.logprobs) for o in llm.generate(PROMPTS, GREEDY)]


def joined_engine(llm: LLM, timeout_s: float = 60):
    """The engine in a group with an SGLang-style trainer (this test's thread); the group and its
    name (torch keeps a process's group names for good: each test its own)."""
    port, found = free_port(), {}
    name, world = f"weights-{port}", 1 + llm.ranks.world_size
    trainer = threading.Thread(target=lambda: found.setdefault("group", sglang_trainer_group(port, world, name)))
    trainer.start()
    llm.init_weights_update_group("127.0.0.1", port, 1, world, name, timeout_s=timeout_s)
    trainer.join()
    return found["group"], name


def sending(group, tensors: list[torch.Tensor]) -> threading.Thread:
    thread = threading.Thread(target=lambda: [dist.broadcast(t, 0, group=group) for t in tensors])
    thread.start()
    return thread


@pytest.mark.parametrize("label", ["1x1", "1x2-ep", "2x1"])  # whole tensors, experts by EP rank, TP slices
def test_an_sglang_trainer_updates_the_engine_as_update_weights_does(label):
    weights, layout = moved(3), Layout.parse(label)
    with LLM(tensor_parallel_size=layout.tp, data_parallel_size=layout.dp, enable_expert_parallel=layout.ep) as llm:
        group, name = joined_engine(llm)
        names, dtypes, shapes = meta(weights)
        thread = sending(group, [weights[n] for n in names])
        llm.update_weights_from_distributed(names, dtypes, shapes, name, weight_version="v1")
        thread.join()
        got = answers(llm)
        assert llm.get_model_info()["weight_version"] == "v1"
        assert {o.weight_version for o in llm.generate(PROMPTS[:1], GREEDY)} == {"v1"}

        # a part of the weights: the rest keep theirs
        norm = {"model.norm.weight": torch.ones_like(weights["model.norm.weight"])}
        thread = sending(group, list(norm.values()))
        llm.update_weights_from_distributed(*meta(norm), name)
        thread.join()
        partial = answers(llm)
        assert llm.get_model_info()["weight_version"] == "v1"  # no version given: unchanged
        llm.destroy_weights_update_group(name)
        with pytest.raises(ValueError, match="no weights group"):
            llm.update_weights_from_distributed(*meta(norm), name)

        llm.update_weights(weights.items(), weight_version="direct")
        assert answers(llm) == got
        llm.update_weights_from_tensor(save(norm))
        assert answers(llm) == partial


def test_a_broadcast_that_breaks_off_changes_nothing_and_closes_the_group():
    """The trainer announces every tensor and stops before the last: the engine's receive times out."""
    weights = moved(4)
    with LLM() as llm:
        before = answers(llm)
        group, name = joined_engine(llm, timeout_s=3)
        names, dtypes, shapes = meta(weights)
        sending(group, [weights[n] for n in names[:-1]])  # then the trainer stops sending
        with pytest.raises(RuntimeError, match="broke off.*nothing was written"):
            llm.update_weights_from_distributed(names, dtypes, shapes, name, weight_version="never")
        assert answers(llm) == before and llm.get_model_info()["weight_version"] == "default"
        with pytest.raises(ValueError, match="no weights group"):
            llm.destroy_weights_update_group(name)


def test_a_rank_keeps_only_its_shard():
    with LLM(data_parallel_size=2, enable_expert_parallel=True) as llm:
        model = llm.ranks.host.worker.model  # rank 0: experts 0 … E/2 − 1 of every layer
        buffer = ShardBuffer(model)
        weights = load_file(MODEL_DIR / "model.safetensors")
        for name, tensor in weights.items():
            buffer.keep(name, tensor)
        kept = sum(t.numel() for blocks in buffer.blocks.values() for _, t in blocks)
        assert kept < sum(t.numel() for t in weights.values())
        assert not any(buffer.blocks[n] for n in weights if ".mlp.experts.3." in n)  # rank 1's expert
        assert all(buffer.blocks[n] for n in weights if ".mlp.experts.0." in n)


def test_announced_updates_are_checked_before_anything_is_received():
    with pytest.raises(ValueError, match="one length"):
        TensorMeta.parse(["a"], ["float32", "float32"], [[1]])
    with pytest.raises(ValueError, match="not one of"):
        TensorMeta.parse(["a"], ["int8"], [[1]])
    with LLM() as llm:
        with pytest.raises(ValueError, match="cannot join as ranks"):
            llm.init_weights_update_group("127.0.0.1", free_port(), 1, 1)
        with pytest.raises(ValueError, match="backend nccl"):
            llm.init_weights_update_group("127.0.0.1", free_port(), 1, 2, backend="nccl")
