"""Weights the kernels serve are held once, as their packed panels (moeshard.kernels.packed): a block
written through a layout equals the kernels' own packing of the whole weight, reads back as the
weight, and a loaded model holds its packed bytes and nothing beside them — on one rank and on TP/EP
shards of odd sizes, after whole and partial updates."""

import math

import pytest
import torch
from safetensors.torch import load_file

from moeshard import LLM, kernels
from moeshard.kernels import packed
from moeshard.models.checkpoint import Checkpoint, TensorDict
from moeshard.models.model import load_model, part_of
from moeshard.parallel import Layout, set_layout
from moeshard.runtime import derived
from moeshard.runtime.memory import fill_poison
from moeshard.verify.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.skipif(not kernels.built(), reason="no moeshard CPU kernels here")

# Sizes that fit no panel: 130 outputs (two panels and 2 rows), SwiGLU intermediates of 7 and 40
# (padded to 32 and 64), 5 inputs of a down projection (padded to a whole bf16 step).
CASES = [
    ("linear", (3, 130, 32), [(0, 7), (7, 70), (70, 130)]),
    ("gate_up", (2, 80, 16), [(0, 3), (3, 35), (35, 40), (40, 80)]),  # I = 40: blocks across the gate/up edge
    ("gate_up", (1, 14, 8), [(0, 14)]),  # I = 7
    ("down", (2, 16, 5), [(0, 16)]),
    ("down", (2, 130, 40), [(0, 64), (64, 100), (100, 130)]),
]


def layout_of(kind: str, shape: tuple[int, ...], dtype: torch.dtype):
    if kind == "linear":
        return packed.for_linear(shape, dtype, "cpu", "w")
    L, N, K = shape
    gate_up, down = packed.for_swiglu((L, 2 * K, N), (L, N, K), dtype, "cpu", "w") if kind == "down" else \
        packed.for_swiglu(shape, (L, K, N // 2), dtype, "cpu", "w")
    return down if kind == "down" else gate_up


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind, shape, blocks", CASES)
def test_blocks_written_through_a_layout_equal_packing_the_whole_weight(kind, shape, blocks, dtype):
    """Into poisoned storage (every element must be written, padding as zeros), block by block,
    each expert's rows in odd ranges; read back, the weight itself."""
    if dtype not in kernels.dtypes():
        pytest.skip(f"the kernels do not serve {dtype} here")
    g = torch.Generator().manual_seed(len(blocks))
    w = torch.randn(shape, generator=g).to(dtype)
    layout = layout_of(kind, shape, dtype)
    assert layout.packed
    storage = torch.empty(layout.storage_shape(), dtype=dtype)
    fill_poison(storage)
    layout.zero_padding(storage)
    for expert in range(shape[0]):
        for first, last in blocks:
            layout.write(storage, (expert, slice(first, last)), w[expert, first:last])
    packer = {"linear": kernels.pack, "gate_up": kernels.pack_gate_up, "down": kernels.pack_down}[kind]
    assert torch.equal(storage, packer(w))
    assert torch.equal(layout.read(storage), w)


def test_a_transposed_layout_packs_the_transpose():
    """MLA's absorbed key projection in batch-invariant mode: [H, nope, C] stored as panels of [H, C, nope]."""
    w = torch.randn(2, 12, 16).bfloat16()
    layout = packed.TransposedPanels((2, 12, 16), packed.for_linear((2, 16, 12), torch.bfloat16, "cpu", "w"))
    storage = torch.full(layout.storage_shape(), float("nan"), dtype=torch.bfloat16)
    layout.zero_padding(storage)
    with pytest.raises(ValueError, match="starts on a whole step of 2 inputs, not at input 5"):
        layout.write(storage, (slice(None), slice(5, 12)), w[:, 5:])
    layout.write(storage, (slice(None), slice(0, 6)), w[:, :6])
    layout.write(storage, (slice(None), slice(6, 12)), w[:, 6:])
    assert torch.equal(storage, kernels.pack(w.transpose(1, 2)))
    assert torch.equal(layout.read(storage), w)


# Odd sizes for TP = 2: 15 expert rows, 23 shared-expert rows and 45 dense rows per rank (no multiple
# of 16, 32 or 64), 51 vocabulary rows per rank (one of them padding on the second rank).
ODD = dict(moe_intermediate_size=30, shared_expert_intermediate_size=46, intermediate_size=90)


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    return str(make_tiny_checkpoint("qwen2_moe", tmp_path_factory.mktemp("odd") / "qwen2_moe", seed=3, **ODD))


def stored_as_checkpoint(directory: str, layout: Layout, dtype: torch.dtype) -> bool:
    """On one rank: each parameter, read back from its layout, equals its blocks of the checkpoint
    (checked by writing them into a plain copy of the logical weight); after garbage everywhere and a
    partial update part by part (one tensor per call, as a trainer's buckets come), still."""
    set_layout(layout)
    model = load_model(directory, dtype)
    assert any(p.weight_layout.packed for p in model.parameters())
    tensors = load_file(f"{directory}/model.safetensors")

    def as_checkpoint() -> bool:
        for param in model.parameters():
            expected = torch.zeros(param.weight_layout.shape, dtype=param.dtype)
            for b in param.shard_load.blocks:
                block = tensors[b.name][b.index]
                expected[b.dest] = (block.reshape(b.view) if b.view is not None else block)[b.pick]
            if not torch.equal(packed.logical(param), expected):
                return False
        return True

    good = as_checkpoint()
    for p in model.parameters():
        fill_poison(p)
    for name, tensor in tensors.items():
        model.load_part(TensorDict({name: tensor}, partial=True), part_of(name))
    return good and as_checkpoint()


@pytest.mark.parametrize("layout", ["2x1", "1x2-ep"])
def test_tp_and_ep_shards_of_odd_sizes_are_their_checkpoint_blocks(odd, ranks2, layout):
    assert ranks2.run(stored_as_checkpoint, odd, Layout.parse(layout), torch.bfloat16) == [True, True]


def test_one_rank_fp32_from_a_bf16_checkpoint(odd):
    """Converted on the way in (the strided copy's path, not pack_rows')."""
    assert stored_as_checkpoint(odd, Layout(), torch.float32)


def test_a_partial_update_writes_its_blocks_and_keeps_the_rest(odd):
    set_layout(Layout())
    model = load_model(odd, torch.bfloat16)
    experts = model.layers[0].mlp.experts
    before = packed.logical(experts.w13_LFD)
    up = Checkpoint(odd).block("model.layers.0.mlp.experts.2.up_proj.weight", ()) * 2
    model.load_part(TensorDict({"model.layers.0.mlp.experts.2.up_proj.weight": up}, partial=True), 0)
    after = packed.logical(experts.w13_LFD)
    I = up.shape[0]
    assert torch.equal(after[2, I:], up.bfloat16()) and torch.equal(after[2, :I], before[2, :I])
    assert torch.equal(after[[0, 1, *range(3, 8)]], before[[0, 1, *range(3, 8)]])


def test_the_engine_holds_its_packed_bytes_and_no_second_copy(odd):
    """What `memory_held_mb` counts is the parameters' storage (the packed panels, as large as the
    layouts say) plus derived tensors that are no weight (RoPE tables, expert maps): no derived
    tensor depends on the weights any more."""
    with LLM(odd, dtype="bfloat16") as llm:
        model = llm.ranks.host.worker.model
        params = list(model.parameters())
        storage = sum(math.prod(p.weight_layout.storage_shape()) * p.element_size() for p in params)
        assert sum(p.numel() * p.element_size() for p in params) == storage
        owners = model.derived_owners()
        attrs = {attr for _, attr, *_ in derived.entries_of(owners)}
        assert attrs == {"cos_Xr", "sin_Xr", "maps"}
        other = sum(t.numel() * t.element_size() for t in derived.registered_tensors(owners))
        assert llm.memory_held_mb()[0]["weights"] * 2**20 == storage + other
        products = ("weight_OI", "gate_up_FD", "down_DI", "w13_LFD", "w2_LDI")
        served = [p for m in model.modules() for name, p in m.named_parameters(recurse=False) if name in products]
        assert len(served) > 20 and all(p.weight_layout.packed for p in served + [model.lm_head.weight_VD])
