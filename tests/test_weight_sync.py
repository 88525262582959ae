"""Weights from a trainer elsewhere, offline: the engine joins a trainer's group built the way SGLang's
`init_custom_process_group` builds it (torch's own `_new_process_group_helper` under the group-name
store prefix), so a trainer-side client written for SGLang works unchanged; each rank keeps only
its shard; partial updates leave the rest; a broadcast that breaks off changes nothing."""

import datetime
import json
import threading
import time

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save
from torch.distributed import PrefixStore, rendezvous
from torch.distributed.distributed_c10d import _new_process_group_helper, _world

from moeshard import LLM, SamplingParams
from moeshard.serve.launcher import free_port
from moeshard.bundled.arithmetic import MODEL_DIR, held_out
from moeshard.engine.payloads import flattened_bucket, packed_buffers, read_payload, unpack
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
        # SGLang's flattened bucket: one broadcast of the tensors' torch.cat (FlattenedTensorBucket)
        thread = sending(group, [torch.cat([weights[n].reshape(-1) for n in names])])
        llm.update_weights_from_distributed(names, dtypes, shapes, name, "flattened_bucket", weight_version="v1")
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

        # vLLM's packed broadcast (SkyRL sends packed=True): the tensors' bytes in one uint8 buffer
        # (under vLLM's 1 GiB), the moved weights back
        thread = sending(group, [torch.cat([weights[n].contiguous().view(torch.uint8).view(-1) for n in names])])
        llm.update_weights_from_distributed(names, dtypes, shapes, name, "packed", weight_version="v2")
        thread.join()
        assert answers(llm) == got
        thread = sending(group, list(norm.values()))
        llm.update_weights_from_distributed(*meta(norm), name)
        thread.join()
        llm.destroy_weights_update_group(name)
        with pytest.raises(ValueError, match="no weights group"):
            llm.update_weights_from_distributed(*meta(norm), name)

        llm.update_weights(weights.items(), weight_version="direct")
        assert answers(llm) == got
        llm.update_weights_from_tensor(flattened_bucket(norm.items()), "flattened_bucket")
        assert answers(llm) == partial


def test_packed_buffers_close_past_the_limit_as_vllms_do():
    """vLLM's pack_tensors: a buffer takes tensors until it holds more than the limit; the tensor
    that crosses it stays in it."""
    metas = TensorMeta.parse(["a", "b", "c", "d"], ["float32", "bfloat16", "float32", "float32"], [[3], [4], [1], [2]])
    assert [[m.name for m in part] for part in packed_buffers(metas, limit=15)] == [["a", "b"], ["c", "d"]]
    tensors = [torch.arange(m.numel).to(m.dtype) for m in metas[:2]]
    buffer = torch.cat([t.view(torch.uint8) for t in tensors])
    assert all(torch.equal(got, want) for (_, got), want in zip(unpack(buffer, metas[:2]), tensors))


def test_a_broadcast_that_breaks_off_changes_nothing_and_closes_the_group():
    """The trainer announces every tensor and stops before the last: the engine's wait for it times
    out (per tensor); the group is closed, and destroying it (a framework's teardown) succeeds."""
    weights = moved(4)
    with LLM() as llm:
        before = answers(llm)
        group, name = joined_engine(llm)
        names, dtypes, shapes = meta(weights)
        sending(group, [weights[n] for n in names[:-1]])  # then the trainer stops sending
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="broke off.*nothing was written"):
            llm.update_weights_from_distributed(names, dtypes, shapes, name, timeout_s=2, weight_version="never")
        assert time.monotonic() - start < 2 + 10  # the last tensor's 2 s, not the group's 60
        assert answers(llm) == before and llm.get_model_info()["weight_version"] == "default"
        llm.destroy_weights_update_group(name)
        with pytest.raises(ValueError, match="no weights group"):  # as SGLang: a group never joined is refused
            llm.destroy_weights_update_group(name)


def test_flattened_bucket_payloads_hold_each_dtype_and_refuse_bad_listings():
    named = [("a", torch.arange(6, dtype=torch.bfloat16).view(2, 3)), ("b", torch.ones(4)), ("c", torch.zeros(1, dtype=torch.bfloat16))]
    payload = flattened_bucket(named)
    got = dict(read_payload(payload, "flattened_bucket"))
    assert list(got) == ["a", "c", "b"] and all(torch.equal(got[n], t) and got[n].dtype == t.dtype for n, t in named)
    assert [n for n, _ in read_payload(payload)] == ["bfloat16", "float32"]  # read plain: the flat buffers

    def listing(**changes) -> bytes:
        entry = {"name": "a", "shape": [2, 3], "dtype": "bfloat16", "start_idx": 0, "end_idx": 6, **changes}
        return save({"flat": torch.zeros(6, dtype=torch.bfloat16)}, metadata={"flat": json.dumps([entry])})

    assert read_payload(listing(dtype="float32"), "flattened_bucket")[0][1].dtype == torch.float32  # converted, as SGLang
    for bad, message in [(listing(end_idx=5), "spans 5 elements"), (listing(start_idx=3, end_idx=9), "outside"),
                         (listing(dtype="int8"), "only floats survive"), (listing(dtype="int4"), "not one of"), (listing(shape="23"), "non-negative integers"),
                         (save({"flat": torch.zeros(6)}), "no listing"), (save({"flat": torch.zeros(2, 3)}), "1-D"),
                         (b"not safetensors", "not a safetensors file")]:
        with pytest.raises(ValueError, match=message):
            read_payload(bad, "flattened_bucket")


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
        TensorMeta.parse(["a"], ["int4"], [[1]])
    with LLM() as llm:
        with pytest.raises(ValueError, match="cannot join as ranks"):
            llm.init_weights_update_group("127.0.0.1", free_port(), 1, 1)
        with pytest.raises(ValueError, match="backend nccl"):
            llm.init_weights_update_group("127.0.0.1", free_port(), 1, 2, backend="nccl")


def test_a_trainer_updates_a_published_fp8_checkpoint_in_bf16_and_in_its_stored_tensors(tmp_path):
    """An engine on a published block-FP8 checkpoint, two EP ranks: the trainer broadcasts bf16
    weights under the plain names (one module in the checkpoint's own fp8 tensors instead), packed, each
    rank quantizes them as the checkpoint stores them; the answers are a fresh engine's on the FP8
    checkpoint written from those bf16 weights."""
    from moeshard.verify.quantized import write_quantized
    from moeshard.verify.tiny import make_tiny_checkpoint

    for seed in (0, 1):
        source = make_tiny_checkpoint("qwen3_moe", tmp_path / f"source{seed}", seed=seed)
        bf16 = {n: t.bfloat16() for n, t in load_file(source / "model.safetensors").items()}
        (source / "model.safetensors").write_bytes(save(bf16, {"format": "pt"}))  # the trainer's weights: bf16
        write_quantized(source, tmp_path / f"fp8_{seed}", "fp8", tmp_path / f"reference{seed}")
    prompts, greedy = [[3, 14, 15, 92, 65], [35, 89, 79]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(tmp_path / "fp8_1"), dtype="bfloat16") as fresh:
        expected = [o.token_ids for o in fresh.generate(prompts, greedy)]
    stored = load_file(tmp_path / "fp8_1" / "model.safetensors")
    module = "model.layers.1.self_attn.o_proj"
    weights = {n: t for n, t in bf16.items() if n != f"{module}.weight"} | {
        n: stored[n] for n in (f"{module}.weight", f"{module}.weight_scale_inv")}
    with LLM(str(tmp_path / "fp8_0"), dtype="bfloat16", data_parallel_size=2, enable_expert_parallel=True) as llm:
        assert [o.token_ids for o in llm.generate(prompts, greedy)] != expected
        group, name = joined_engine(llm)
        # vLLM's packed broadcast: gloo cannot broadcast float8 tensors, their bytes it can
        thread = sending(group, [torch.cat([t.contiguous().view(torch.uint8).view(-1) for t in weights.values()])])
        llm.update_weights_from_distributed(*meta(weights), name, "packed")
        thread.join()
        got = [o.token_ids for o in llm.generate(prompts, greedy)]
        llm.destroy_weights_update_group(name)
    assert got == expected
