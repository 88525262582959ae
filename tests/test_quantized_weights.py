"""Weights quantized at load, held once as the kernels' quantized panels (kernels.packed.QuantizedPanels):
blocks written piece by piece equal the kernels' own packing and read back as `quant.dequantize`'s
weight; products equal the bf16 product on that weight (bitwise on the kernels, through torch's ops
without them); on a decisive model, greedy continuations agree with bf16; int4 holds under half the
bf16 weights' bytes; an EP=2 engine's greedy tokens equal the one-rank one's. (Batch-invariant mode
would make them bitwise equal, at ~3× these tests' time: ~200 s for four engines here.)"""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from moeshard import LLM, SamplingParams, kernels
from moeshard.kernels import packed
from moeshard.kernels.quant import QuantFormat, dequantize, quantize
from moeshard.parallel import Layout
from moeshard.verify import hf
from moeshard.verify.eval import run_eval
from moeshard.verify.quantized import write_quantized
from moeshard.verify.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.skipif(not kernels.built(), reason="no moeshard CPU kernels here")

FORMATS = [QuantFormat("fp8", 16), QuantFormat("int8", 32, zero_point=True), QuantFormat("int4", 16),
           QuantFormat("int4", 32, zero_point=True), QuantFormat("int8", 16, activations="int8"),
           QuantFormat("int4", 32, zero_point=True, activations="int8")]  # the last two: the a8 layout
# (kind, logical shape, row blocks): panels cut mid-way, SwiGLU intermediates padded (I = 40 → 64).
CASES = [
    ("linear", (130, 64), [(0, 7), (7, 70), (70, 130)]),
    ("gate_up", (2, 80, 32), [(0, 3), (3, 35), (35, 80)]),
    ("down", (2, 70, 96), [(0, 64), (64, 70)]),
]
PACK = {"linear": kernels.pack_quantized, "gate_up": kernels.pack_gate_up_quantized, "down": kernels.pack_down_quantized}


def written(layout: packed.QuantizedPanels, w: torch.Tensor, blocks) -> torch.Tensor:
    """`w` written block by block (each a mix of quantized-here and canonical rows) into poisoned storage."""
    storage = torch.randint(0, 256, layout.storage_shape(), dtype=torch.uint8)
    layout.zero_padding(storage)
    lead = (slice(None),) * (len(layout.shape) - 2)
    for k, (a, b) in enumerate(blocks):
        values = w[..., a:b, :]
        layout.write(storage, (*lead, slice(a, b)), quantize(values, layout.fmt) if k % 2 else values)
    return storage


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_blocks_equal_the_kernels_packing_and_read_back_dequantized(fmt):
    g = torch.Generator().manual_seed(0)
    for kind, shape, blocks in CASES:
        w = torch.randn(shape, generator=g).bfloat16()
        layout = packed.QuantizedPanels(shape, fmt, kind)
        storage = written(layout, w, blocks)
        mine, theirs = layout.panels(storage), PACK[kind](quantize(w, fmt))
        for got, want in ((mine.values, theirs.values), (mine.scale, theirs.scale), (mine.zero, theirs.zero)):
            assert (got is None and want is None) or torch.equal(got, want), (kind, shape)
        assert torch.equal(layout.read(storage), dequantize(quantize(w, fmt)))
        assert layout.storage_shape()[0] == sum(t.numel() * t.element_size() for t in (theirs.values, theirs.scale, theirs.zero)
                                                if t is not None) + (-theirs.values.numel() % 4 if fmt.kind != "int4" else 0)


@pytest.mark.parametrize("served", [True, False], ids=["kernels", "torch"])
def test_a_product_is_the_bf16_product_on_the_dequantized_weight(served, monkeypatch):
    if not served:  # MOESHARD_CPU_KERNELS=0: the weight stays quantized, a product dequantizes it
        monkeypatch.setattr(packed.kernels, "built", lambda: False)
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(70, 64, generator=g), torch.randn(5, 64, generator=g).bfloat16()
    for fmt in (f for f in FORMATS if f.activations == "bf16"):  # int8 activations: tests/test_kernels_int8_activations.py
        layout = packed.for_linear((70, 64), torch.bfloat16, "cpu", "w", fmt)
        storage = written(layout, w, [(0, 70)])
        reference = kernels.linear(x, kernels.pack(dequantize(quantize(w, fmt))), 70, True) if served else \
            F.linear(x, dequantize(quantize(w, fmt))).float()
        assert torch.equal(layout.linear(x, storage, fp32_out=True), reference), fmt


def test_refusals(monkeypatch):
    layout = packed.QuantizedPanels((64, 64), QuantFormat("int8", 32), "linear")
    with pytest.raises(ValueError, match="whole groups"):
        layout.write(torch.zeros(layout.storage_shape(), dtype=torch.uint8), (slice(None), slice(0, 48)), torch.zeros(64, 48))
    with pytest.raises(ValueError, match="cannot be written"):
        layout.write(torch.zeros(layout.storage_shape(), dtype=torch.uint8), (), quantize(torch.ones(64, 64), QuantFormat("fp8", 32)))
    with pytest.raises(ValueError, match="q_proj has 64 inputs, not whole quantization groups of 128"):
        packed.for_linear((32, 64), torch.bfloat16, "cpu", "model.layers.0.self_attn.q_proj", QuantFormat("int8"))
    with pytest.raises(ValueError, match="compute in bfloat16"):
        packed.for_linear((32, 64), torch.float32, "cpu", "w", QuantFormat("int8", 32))
    monkeypatch.setattr(packed.kernels, "built", lambda: False)
    with pytest.raises(ValueError, match="int8 activations run on moeshard's CPU kernels only"):
        packed.for_linear((32, 64), torch.bfloat16, "cpu", "w", QuantFormat("int8", 32, activations="int8"))
    skip = packed.Quantization(QuantFormat("int4", 32), ("lm_head", "mlp.experts", "model.layers.1.*"))
    assert [skip.format_for(n) for n in ("lm_head", "model.layers.0.mlp.experts", "model.layers.1.self_attn.o_proj")] == [None] * 3
    assert skip.format_for("model.layers.0.mlp.shared_experts") == QuantFormat("int4", 32)


PROMPTS = [torch.randint(0, 101, (6,), generator=torch.Generator().manual_seed(k)).tolist() for k in range(16)]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def decisive(tmp_path_factory):
    """A tiny Qwen3-MoE whose LM head leans on a permutation of the embedding (half its scale):
    greedy choices with wide margins, so formats are compared, not the model's near-ties."""
    directory = make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("decisive"))
    weights = load_file(directory / "model.safetensors")
    perm = torch.randperm(101, generator=torch.Generator().manual_seed(2))
    weights["lm_head.weight"] = weights["lm_head.weight"] + 0.5 * weights["model.embed_tokens.weight"][perm]
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return str(directory)


def run(directory, **options):
    with LLM(directory, dtype="bfloat16", **options) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)], llm.memory_held_mb()[0]["weights"]


@pytest.fixture(scope="module")
def runs(decisive):
    return {q: run(decisive, quantization=q, quantization_group=16) for q in ("fp8", "int8", "int4")} | {"bf16": run(decisive)}


def test_quantized_at_load_agrees_with_bf16_and_int4_holds_under_half(runs):
    bf16, held_bf16 = runs["bf16"]
    agree = {q: sum(a == b for a, b in zip(runs[q][0], bf16)) for q in ("fp8", "int8", "int4")}
    print(f"greedy 24-token continuations equal to bf16's, of 16: {agree}")
    assert agree["fp8"] >= 12 and agree["int8"] >= 14
    print(f"weights held: bf16 {held_bf16:.3f} MiB, int4 {runs['int4'][1]:.3f} MiB")
    assert runs["int4"][1] <= 0.5 * held_bf16


def test_int8_activations_agree_with_bf16(decisive, runs):
    """quantize_activations: each linear and expert product on int8 activations (the a8 kernels)."""
    bf16, _ = runs["bf16"]
    agree = {q: sum(a == b for a, b in zip(run(decisive, quantization=q, quantization_group=16, quantize_activations=True)[0], bf16))
             for q in ("int8", "int4")}
    print(f"greedy 24-token continuations with int8 activations equal to bf16's, of 16: {agree}")
    assert agree["int8"] >= 14 and agree["int4"] >= agree_of(runs, "int4") - 2


def agree_of(runs, q: str) -> int:
    return sum(a == b for a, b in zip(runs[q][0], runs["bf16"][0]))


def test_an_ep2_engine_gives_the_one_rank_engines_greedy_tokens(decisive, runs):
    ep2, _ = run(decisive, quantization="int8", quantization_group=16, data_parallel_size=2, enable_expert_parallel=True)
    assert ep2 == runs["int8"][0]


def test_quantization_options_are_checked_before_the_ranks_start(decisive):
    with pytest.raises(ValueError, match="cannot run with dtype='float32'"):
        LLM(decisive, quantization="int8", dtype="float32")
    with pytest.raises(ValueError, match="no quantization is set"):
        LLM(decisive, quantization_skip=["lm_head"])
    with pytest.raises(ValueError, match="fp8, int8 or int4"):
        LLM(decisive, quantization="int2")
    for kind in ("fp8", None):
        with pytest.raises(ValueError, match=f"needs quantization='int8' or 'int4', got quantization={kind!r}"):
            LLM(decisive, quantization=kind, quantize_activations=True)


def test_the_bundled_model_quantized_int4_answers_as_in_bf16_on_two_layouts():
    """`moeshard eval --quantization int4`: held-out accuracy with int4 weights (hidden 128: one
    group a row), the same texts on one rank and on two with expert parallelism."""
    layouts = [Layout(), Layout(dp=2, ep=True)]
    rows = run_eval(layouts, [4], ["auto"], [None], 40, quantization=dict(quantization="int4"))
    assert all(r.identical_to_reference for r in rows) and rows[0].accuracy >= 0.95


SHIPPED = [("fp8", arch) for arch in ("qwen3_moe", "qwen2_moe", "mixtral_top2", "deepseek_v3")] + [
    (layout, "qwen3_moe") for layout in ("ct-int4-asym", "ct-int8", "gptq-int4", "awq-int4")]


@pytest.mark.skipif(not kernels.built(), reason="no moeshard CPU kernels here")
@pytest.mark.parametrize("layout, arch", SHIPPED, ids=[f"{layout}-{arch}" for layout, arch in SHIPPED])
def test_a_published_quantized_checkpoint_is_held_quantized_and_runs_as_its_dequantized_weights(tmp_path, layout, arch):
    """A checkpoint as published (its quantization_config, its stored layout) is held in its own
    format, and its greedy tokens and logprobs equal, bit for bit, the engine's on the dequantized
    reference checkpoint in bf16 (the quantized kernels are the bf16 kernel on dequantized weights)."""
    source = make_tiny_checkpoint(arch, tmp_path / "source")
    write_quantized(source, tmp_path / "shipped", layout, tmp_path / "reference")
    runs = {}
    for name in ("shipped", "reference"):
        with LLM(str(tmp_path / name), dtype="bfloat16") as llm:
            outputs = llm.generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0))
            runs[name] = [(o.token_ids, o.logprobs) for o in outputs], llm.memory_held_mb()[0]["weights"]
    assert runs["shipped"][0] == runs["reference"][0]
    assert runs["shipped"][1] < 0.8 * runs["reference"][1]


@pytest.mark.skipif(not kernels.built(), reason="no moeshard CPU kernels here")
@pytest.mark.parametrize("arch, layout", [("deepseek_v3", "fp8"), ("mixtral_top2", "ct-int4-asym")])
def test_verify_hf_passes_a_published_checkpoint_on_dp2_ep_against_transformers_on_its_dequantized_weights(
        tmp_path, arch, layout):
    """`moeshard verify hf --model Q --reference R --dtype bfloat16 --dp 2 --ep`: transformers runs the
    dequantized weights (bf16 teacher-forced, and fp32); without a reference it is refused."""
    source = make_tiny_checkpoint(arch, tmp_path / "source")
    write_quantized(source, tmp_path / "shipped", layout, tmp_path / "reference")
    request = hf.Request(str(tmp_path / "shipped"), Layout(dp=2, ep=True), dtype="bfloat16",
                         reference=str(tmp_path / "reference"))
    assert hf.verify_hf(request).passed
    with pytest.raises(ValueError, match="give the checkpoint of its dequantized weights"):
        hf.verify_hf(replace(request, reference=None))


def in_bf16(directory):
    """The checkpoint rewritten in bf16 (what a trainer sends), in place; its tensors."""
    weights = {n: t.bfloat16() for n, t in load_file(directory / "model.safetensors").items()}
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return weights


def answers(llm):
    outputs = llm.generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0))
    return [(o.token_ids, o.logprobs) for o in outputs]


UPDATED = ["fp8", "ct-int4-asym", "gptq-int4", "awq-int4"]


@pytest.mark.parametrize("layout", UPDATED)
def test_updates_to_a_published_quantized_checkpoint_in_its_own_tensors_or_in_bf16(tmp_path, layout):
    """An engine serving a published quantized checkpoint takes updates in bf16 under the plain
    names, quantized as the checkpoint stores them (in two buckets, as a trainer sends them), and in
    the checkpoint's own tensors (from disk): each gives, bit for bit, a fresh engine's answers on
    the checkpoint written from those weights. A quantized weight's stored tensors split over two
    calls, or a scale of the wrong shape, are refused with nothing written (the digest unchanged)."""
    dirs, bf16 = {}, {}
    for seed in (0, 1):
        source = make_tiny_checkpoint("qwen3_moe", tmp_path / f"source{seed}", seed=seed)
        bf16[seed] = in_bf16(source)
        write_quantized(source, tmp_path / f"shipped{seed}", layout, tmp_path / f"reference{seed}")
        dirs[seed] = str(tmp_path / f"shipped{seed}")
    with LLM(dirs[1], dtype="bfloat16") as fresh:
        expected = answers(fresh)
    with LLM(dirs[0], dtype="bfloat16") as llm:
        start, digest, stored = answers(llm), llm.state_digest(), llm.schema.stored
        assert start != expected
        tensors = load_file(tmp_path / "shipped1" / "model.safetensors")
        module = "model.layers.0.self_attn.q_proj"
        values, scale = module + stored.layout.marker, module + stored.layout.scale
        with pytest.raises(ValueError, match="comes without .*in one call"):
            llm.update_weights([(values, tensors[values])], complete=False)
        wrong = torch.zeros(tensors[scale].shape[0] + 1, *tensors[scale].shape[1:], dtype=tensors[scale].dtype)
        with pytest.raises(ValueError, match=f"{scale}.*has shape"):
            llm.update_weights([(n, wrong if n == scale else tensors[n]) for n in stored.names[module]], complete=False)
        assert llm.state_digest() == digest
        names = list(bf16[1])
        llm.update_weights([(n, bf16[1][n]) for n in names[: len(names) // 2]], complete=False)
        llm.update_weights([(n, bf16[1][n]) for n in names[len(names) // 2 :]], complete=False)
        assert answers(llm) == expected
        llm.update_weights_from_disk(dirs[0])
        assert answers(llm) == start and llm.state_digest() == digest


def test_a_tied_lm_head_is_quantized_as_a_copy_of_the_embedding_unless_skipped(tmp_path):
    """With quantization set, a tied model's LM head is the embedding's table quantized (a derived
    copy; the table stays bf16 for lookups, kernels.packed.QuantizedPanels read back as `dequantize`
    reads it); `quantization_skip=["lm_head"]` leaves the head the table itself."""
    from moeshard.models.model import load_model
    from moeshard.parallel import set_layout

    set_layout(Layout())
    directory = make_tiny_checkpoint("qwen3_moe_tied", tmp_path)
    fmt = QuantFormat("int4", 16)
    model = load_model(directory, torch.bfloat16, packed.Quantization(fmt))
    head, table = model.lm_head, packed.logical(model.embed.weight_VD)
    assert head is model.embed and table.dtype == torch.bfloat16
    assert torch.equal(head.head_layout.read(head.head_VD), dequantize(quantize(table, fmt)))
    skipped = load_model(directory, torch.bfloat16, packed.Quantization(fmt, ("lm_head",))).lm_head
    assert skipped.head_layout is skipped.layout and not hasattr(skipped, "head_VD")
