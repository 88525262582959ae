"""The four architectures from tiny random checkpoints, on 1, 2 and 4 ranks, against transformers."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeshard.parallel import Layout, RankPool, set_layout
from moeshard.verify import hf
from moeshard.verify.tiny import VARIANTS, make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {v: str(make_tiny_checkpoint(v, root / v, seed=i)) for i, v in enumerate(VARIANTS)}


@pytest.fixture(scope="session")
def ranks1():
    with RankPool(1) as pool:
        yield pool


def check(request: hf.Request, pool) -> hf.Comparison:
    comparison = hf.verify_hf(request, pool)
    assert comparison.passed, comparison
    assert len(comparison.steps) == request.steps + 1
    return comparison


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_one_rank_matches_transformers(tiny, ranks1, variant):
    check(hf.Request(tiny[variant], Layout()), ranks1)


# Every architecture on TP=2, DP=2 with EP, and 2x2 with EP; every method forced at least once,
# every architecture compiled at least once (compiled graphs are traced on the prefill and replayed
# on every decode step, under whichever method is live).
LAYOUT_CASES = [
    ("qwen3_moe", "2x1", "allgather", None),
    ("qwen3_moe_tied", "2x1", "auto", "aot_eager"),  # one KV head: replicated over TP
    ("qwen3_moe", "1x2-ep", "alltoall", None),
    ("qwen3_moe", "2x2-ep", "mc2", "aot_eager"),
    ("qwen2_moe", "2x1", "auto", "aot_eager"),
    ("qwen2_moe", "1x2-ep", "mc2", None),
    ("qwen2_moe_step2", "2x2-ep", "fused_mc2", None),
    ("qwen2_moe", "2x1-ep-sp", "auto", None),
    ("mixtral_top2", "2x1", "allgather", None),
    ("mixtral_top1", "1x2-ep", "fused_mc2", "aot_eager"),
    ("mixtral_top2", "2x2-ep", "alltoall", None),
    ("deepseek_v3", "2x1", "auto", None),
    ("deepseek_v3", "1x2-ep", "auto", None),
    ("deepseek_v3", "2x2-ep", "alltoall", "aot_eager"),
    ("deepseek_v3_plain", "2x2-ep", "mc2", None),
    ("deepseek_v3", "2x2-sp", "allgather", None),
]


@pytest.mark.parametrize("variant, layout, method, backend", LAYOUT_CASES)
def test_layouts_match_transformers(tiny, ranks2, ranks4, variant, layout, method, backend):
    layout = Layout.parse(layout)
    pool = ranks2 if layout.world_size == 2 else ranks4
    check(hf.Request(tiny[variant], layout, method, backend), pool)


@pytest.mark.long_pole
def test_inductor_compiled_model(tiny, ranks2):
    check(hf.Request(tiny["qwen2_moe"], Layout.parse("1x2-ep"), "auto", "inductor", steps=3), ranks2)


def test_comparison_can_fail(tiny, ranks1):
    """Negative control: moeshard on one checkpoint against transformers on another must fail."""
    ours = hf.Request(tiny["qwen3_moe"], Layout(), steps=2)
    other = hf.Request(tiny["qwen3_moe_tied"], Layout(), steps=2)
    mine = {i: r for rank in ranks1.run(hf.rank_run, ours) for i, r in rank.items()}
    comparison = hf.compare_with_transformers(ours, mine, other.model)
    assert not comparison.passed and comparison.steps[0].max_abs_diff > 1.0


def restack(src, dst):
    """Rewrite a checkpoint with stacked 3-D expert tensors, split over two indexed shards."""
    tensors = load_file(f"{src}/model.safetensors")
    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    cfg = json.loads(open(f"{src}/config.json").read())
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts"
        E = cfg["num_local_experts"]
        out[f"{p}.gate_up_proj"] = torch.stack(
            [torch.cat([tensors[f"{p}.{e}.gate_proj.weight"], tensors[f"{p}.{e}.up_proj.weight"]]) for e in range(E)]
        )
        out[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in range(E)])
    names = sorted(out)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    dst.mkdir()
    for file, keys in halves.items():
        save_file({k: out[k].contiguous() for k in keys}, str(dst / file), metadata={"format": "pt"})
    weight_map = {k: file for file, keys in halves.items() for k in keys}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_stacked_experts_in_sharded_files(tiny, ranks2, tmp_path):
    model = restack(tiny["qwen3_moe"], tmp_path / "stacked")
    check(hf.Request(model, Layout.parse("1x2-ep"), "alltoall"), ranks2)
    check(hf.Request(model, Layout.parse("2x1"), "allgather", steps=2), ranks2)


def test_bf16_checkpoint_loads_as_fp32(tiny, ranks1, tmp_path):
    tensors = load_file(f"{tiny['mixtral_top2']}/model.safetensors")
    (tmp_path / "bf16").mkdir()
    save_file(
        {k: v.bfloat16() for k, v in tensors.items()},
        str(tmp_path / "bf16/model.safetensors"),
        metadata={"format": "pt"},
    )
    (tmp_path / "bf16/config.json").write_text(open(f"{tiny['mixtral_top2']}/config.json").read())
    check(hf.Request(str(tmp_path / "bf16"), Layout(), steps=3), ranks1)


def test_loads_into_the_dtype_asked_for(tiny):
    from moeshard.models.model import load_model

    set_layout(Layout())
    model = load_model(tiny["deepseek_v3"], dtype=torch.bfloat16)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert {d for n, d in dtypes.items() if ".router." not in n} == {torch.bfloat16}
    assert {d for n, d in dtypes.items() if ".router." in n} == {torch.float32}  # routing decisions stay fp32


@pytest.mark.parametrize("variant", [v for v in VARIANTS if not v.startswith("deepseek")])
def test_tiny_routers_are_decisive(tiny, variant):
    """The spread init makes a token's top expert take most of the softmax (uniform would be 1/8)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny[variant])
    top1 = []
    for name, module in model.named_modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.register_forward_hook(lambda m, i, out: top1.append(out[0].softmax(-1).max(-1).values.mean()))
    with torch.no_grad():
        model(torch.randint(0, 101, (1, 64), generator=torch.Generator().manual_seed(0)))
    assert top1 and min(top1) > 0.5, top1


BF16_VARIANTS = ["qwen3_moe", "qwen2_moe", "mixtral_top2", "deepseek_v3"]


@pytest.mark.parametrize("layout", ["1x1", "1x2-ep", "2x1-ep"])
@pytest.mark.parametrize("variant", BF16_VARIANTS)
def test_bf16_within_tolerance_of_transformers(tiny, ranks1, ranks2, variant, layout):
    layout = Layout.parse(layout)
    pool = ranks1 if layout.world_size == 1 else ranks2
    comparison = check(hf.Request(tiny[variant], layout, steps=3, dtype="bfloat16"), pool)
    assert comparison.tolerance == hf.BF16_TOLERANCE  # transformers' own bf16 rounding did not widen it


def swapped_experts(src: str, dst, layer: int = 2) -> str:
    """`src` with experts 0 and 1 of one layer exchanged: serving a neighbour's expert, as a wrong
    expert map or packing would."""
    tensors = load_file(f"{src}/model.safetensors")
    for name in [n for n in tensors if n.startswith(f"model.layers.{layer}.") and ".experts.0." in n]:
        twin = name.replace(".experts.0.", ".experts.1.")
        tensors[name], tensors[twin] = tensors[twin], tensors[name]
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(open(f"{src}/config.json").read())
    return str(dst)


@pytest.mark.parametrize("variant", BF16_VARIANTS)
def test_bf16_tolerance_catches_a_swapped_expert(tiny, ranks1, tmp_path, variant):
    """Negative control: moeshard serving one layer's experts 0 and 1 swapped fails against
    transformers on the intact checkpoint, though a quarter of the positions may be off."""
    request = hf.Request(swapped_experts(tiny[variant], tmp_path / "swapped"), Layout(), steps=3, dtype="bfloat16")
    ours = {i: r for rank in ranks1.run(hf.rank_run, request) for i, r in rank.items()}
    comparison = hf.compare_with_transformers(request, ours, tiny[variant])
    assert not comparison.passed, comparison
