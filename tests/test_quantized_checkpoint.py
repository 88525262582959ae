"""Published quantized checkpoint layouts (models/quantized_checkpoint.py) read into the canonical
form: checked against straightforward dequantizations of the packed tensors, written here after
each layout's reference (not with moeshard's unpacking), on tiny checkpoints verify/quantized.py
writes."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from moeshard.kernels.quant import dequantize
from moeshard.models.checkpoint import CheckpointError, TensorDict
from moeshard.models.quantized_checkpoint import (
    Awq,
    Fp8Block,
    Gptq,
    PackQuantized,
    QuantizedSource,
    layout_of,
    open_checkpoint,
)
from moeshard.parallel import Layout
from moeshard.parallel.launch import open_layout
from moeshard.verify import hf
from moeshard.verify.quantized import GROUP, TINY_LAYOUTS, write_quantized
from moeshard.verify.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    made = {}

    def get(variant):
        if variant not in made:
            made[variant] = make_tiny_checkpoint(variant, tmp_path_factory.mktemp(variant))
        return made[variant]

    return get


def quantized_pair(tiny, tmp_path, layout_name, variant):
    layout = write_quantized(tiny(variant), tmp_path / "q", layout_name, tmp_path / "ref")
    return layout, tmp_path / "q", load_file(str(tmp_path / "ref" / "model.safetensors"))


# Straightforward dequantizations, one per layout, of the whole packed tensors, in fp32 (each product
# is exact or one fp32 multiply, as in the references), then rounded to bf16.


def fields(words: torch.Tensor, bits: int) -> np.ndarray:
    """[..., W] int32 → [..., W, 32/bits]: field i is bits·i up from the lowest bit."""
    u = words.numpy().view(np.uint32).astype(np.int64)[..., None]
    return (u >> (bits * np.arange(32 // bits))) & ((1 << bits) - 1)


def fp8_reference(t, m, layout):  # DeepSeek-V3 inference/kernel.py weight_dequant
    (bn, bk), w, s = layout.block, t[f"{m}.weight"].float(), t[f"{m}.weight_scale_inv"]
    out = torch.empty_like(w)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            out[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] * s[i, j]
    return out


def ct_reference(t, m, layout):  # compressed-tensors unpack_from_int32 + _dequantize
    N, K = t[f"{m}.weight_shape"].tolist()
    offset = 1 << (layout.bits - 1)
    q = fields(t[f"{m}.weight_packed"], layout.bits).reshape(N, -1)[:, :K] - offset
    zp = np.zeros((N, -(-K // layout.group_size)), np.int64)
    if not layout.symmetric:
        z = fields(t[f"{m}.weight_zero_point"].T, layout.bits)  # packed along rows: [groups, N/p, p]
        zp = z.reshape(z.shape[0], -1)[:, :N].T - offset
    g = np.arange(K) // layout.group_size
    return torch.from_numpy((q - zp[:, g]).astype(np.float32)) * t[f"{m}.weight_scale"].float()[:, g]


def gptq_reference(t, m, layout):  # AutoGPTQ qlinear_cuda_old / GPTQModel dequantize_weight
    mask = (1 << layout.bits) - 1
    qweight = fields(t[f"{m}.qweight"].T, layout.bits)  # [N, K/p, p]
    weight = qweight.reshape(qweight.shape[0], -1)  # [N, K]
    zeros = fields(t[f"{m}.qzeros"], layout.bits)  # [groups, N/p, p]
    zeros = zeros.reshape(zeros.shape[0], -1)
    if layout.v1:
        zeros = (zeros + 1) & mask
    g = t[f"{m}.g_idx"].long().numpy()
    scales = t[f"{m}.scales"].float()
    return scales.T[:, g] * torch.from_numpy((weight - zeros.T[:, g]).astype(np.float32))


def awq_reference(t, m, layout):  # AutoAWQ packing_utils.dequantize_gemm
    reverse = [0, 4, 1, 5, 2, 6, 3, 7]  # AWQ_REVERSE_ORDER

    def unpack_reordered(words):
        by_field = fields(words, 4)  # [rows, N/8, 8]
        return by_field[:, :, reverse].reshape(by_field.shape[0], -1)

    iweight, izeros = unpack_reordered(t[f"{m}.qweight"]), unpack_reordered(t[f"{m}.qzeros"])
    g = np.arange(iweight.shape[0]) // layout.group_size
    return (torch.from_numpy((iweight - izeros[g]).astype(np.float32)) * t[f"{m}.scales"].float()[g]).T


REFERENCES = {Fp8Block: fp8_reference, PackQuantized: ct_reference, Gptq: gptq_reference, Awq: awq_reference}

# One architecture per layout, DeepSeek-V3 where its K = 24 and 40 leave short last groups; FP8 on all four.
CASES = [
    ("fp8", "qwen3_moe"),
    ("fp8", "deepseek_v3"),
    ("fp8", "mixtral_top2"),
    ("fp8", "qwen2_moe"),
    ("ct-int4", "deepseek_v3"),
    ("ct-int4-asym", "qwen2_moe"),
    ("ct-int8", "mixtral_top2"),
    ("ct-int8-asym", "qwen3_moe"),
    ("gptq-int4", "qwen3_moe"),
    ("gptq-int4-asym", "deepseek_v3"),
    ("gptq-int8", "qwen2_moe"),
    ("awq-int4", "deepseek_v3"),
]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    as_bits = (lambda t: t.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else (lambda t: t)
    return a.dtype == b.dtype and torch.equal(as_bits(a), as_bits(b))


def rank_blocks(N: int, K: int, group: int):
    """Blocks of rows and columns as TP / EP ranks read them: 2 and 3 row parts (uneven), and
    columns split at a group boundary, the first part short of half."""
    cut = (K // 2) // group * group or K
    for parts in (2, 3):
        edges = [N * i // parts for i in range(parts + 1)]
        for lo, hi in zip(edges, edges[1:]):
            yield (slice(lo, hi),)
            yield (slice(lo, hi), slice(cut, K))
    yield (slice(None), slice(0, cut))


class CountingSource(TensorDict):
    """Tensors in memory that count the elements each block read returns."""

    def __init__(self, tensors):
        super().__init__(tensors)
        self.elements = 0

    def block(self, name, index):
        out = super().block(name, index)
        self.elements += out.numel()
        return out


@pytest.mark.parametrize("layout_name, variant", CASES)
def test_layout_reads_what_its_reference_dequantizes(tiny, tmp_path, layout_name, variant):
    layout, directory, reference = quantized_pair(tiny, tmp_path, layout_name, variant)
    stored = load_file(str(directory / "model.safetensors"))
    source = open_checkpoint(directory)
    counting = QuantizedSource(CountingSource(stored), layout)
    quantized = [n for n in reference if source.quantized(n) is not None]
    assert len(quantized) > 10
    for name in reference:  # routers and the LM head stay as shipped; so do embeddings and norms
        module = name.removesuffix(".weight")
        assert (name in quantized) == (module != name and reference[name].dim() == 2 and module not in layout.ignore
                                       and "embed_tokens" not in name)
    shapes = {}  # rank blocks on one weight of each shape (the rest are the same code on other bytes)
    for name in quantized:
        N, K = reference[name].shape
        module = name.removesuffix(".weight")
        expected = REFERENCES[type(layout)](stored, module, layout).to(torch.bfloat16)
        assert same(expected.float(), reference[name]), name
        whole = source.read_quantized(name, (N, K))
        assert same(dequantize(whole), expected), name
        assert same(source.read(name, (N, K)), expected), name  # what a bf16 parameter takes
        if whole.fmt.kind != "fp8":
            low, high = whole.fmt.levels
            assert low <= int(whole.values.min()) and int(whole.values.max()) <= high
        if shapes.setdefault((N, K), name) != name:
            continue
        for index in rank_blocks(N, K, whole.fmt.group):
            rows, cols = (*index, slice(None))[:2]
            part = source.read_quantized(name, (N, K), index)
            groups = slice(*(None if c is None else c // whole.fmt.group for c in (cols.start, cols.stop)))
            assert same(part.values, whole.values[rows, cols]), (name, index)
            assert same(part.scale, whole.scale[rows, groups]), (name, index)
            assert (part.zero is None) == (whole.zero is None)
            assert part.zero is None or same(part.zero, whole.zero[rows, groups])
        # half the rows, at most half the columns: a little more than that share of the stored
        # elements (a word or a group more at the edges), not the whole tensors
        total = sum(stored[s].numel() for s in counting.stored_names(name))
        counting.stored.elements = 0
        cols = max(K // 2 // whole.fmt.group, 1) * whole.fmt.group
        counting.read_quantized(name, (N, K), (slice(N - N // 2, N), slice(K - cols, K)))
        assert counting.stored.elements <= 0.55 * total, name


@pytest.mark.parametrize("layout_name, variant", [("gptq-int4", "qwen3_moe"), ("fp8", "deepseek_v3")])
def test_finish_counts_every_stored_tensor_of_a_quantized_weight(tiny, tmp_path, layout_name, variant):
    _, directory, reference = quantized_pair(tiny, tmp_path, layout_name, variant)
    source = open_checkpoint(directory)
    for name, tensor in reference.items():
        source.check(name, tuple(tensor.shape))
    source.finish()
    left = next(n for n in reference if source.quantized(n) is not None)
    source = open_checkpoint(directory)
    for name, tensor in reference.items():
        if name != left:
            source.check(name, tuple(tensor.shape))
    with pytest.raises(CheckpointError, match=left.removesuffix("weight")):
        source.finish()


def test_reference_loads_in_transformers(tiny, tmp_path):
    import transformers

    _, _, reference = quantized_pair(tiny, tmp_path, "ct-int4-asym", "qwen3_moe")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32)
    expert = "model.layers.1.mlp.experts.3.up_proj.weight"
    up = model.model.layers[1].mlp.experts.gate_up_proj[3, 32:]  # transformers 5 stacks experts: [E, 2I, D]
    assert torch.equal(up, reference[expert])


@pytest.mark.parametrize("layout_name", sorted(TINY_LAYOUTS))
def test_config_round_trips(layout_name):
    layout = TINY_LAYOUTS[layout_name](("lm_head", "model.layers.0.mlp.gate"))
    assert layout_of({"quantization_config": layout.config()}) == layout


@pytest.mark.parametrize(
    "layout, entry, module, skipped",
    [
        (Fp8Block, "mlp.gate", "model.layers.3.mlp.gate", True),  # a suffix at a module boundary
        (Fp8Block, "mlp.gate", "model.layers.3.mlp.gate_proj", False),
        (Fp8Block, r"model\.layers\.\d+\.mlp\.gate", "model.layers.3.mlp.gate", True),
        (PackQuantized, r"re:.*mlp\.gate$", "model.layers.3.mlp.gate", True),
        (PackQuantized, "mlp.gate", "model.layers.3.mlp.gate", False),  # names are exact
        (Gptq, r"model\.layers\.3\.", "model.layers.3.self_attn.q_proj", True),  # dynamic "-:" regex
        (Gptq, "nothing", "lm_head", True),  # lm_head false
        (Awq, "gate", "model.layers.3.mlp.experts.0.gate_proj", True),  # AutoAWQ: a substring
    ],
)
def test_ignore_lists_match_as_their_references_do(layout, entry, module, skipped):
    assert layout((entry,)).skips(module) == skipped


def gptq_config(**settings):
    return {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True} | settings


def ct_config(fmt="pack-quantized", activations=None, **weights):
    w = dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128) | weights
    group = dict(targets=["Linear"], weights=w, input_activations=activations)
    return dict(quant_method="compressed-tensors", format=fmt, config_groups={"group_0": group})


@pytest.mark.parametrize(
    "qc, cause",
    [
        (gptq_config(desc_act=True), "act-order"),
        (gptq_config(bits=3), "3 bits"),
        (gptq_config(bits=2), "2 bits"),
        (gptq_config(group_size=-1), "group_size -1"),
        (gptq_config(checkpoint_format="marlin"), "marlin"),
        (gptq_config(dynamic={r"+:.*down_proj": {"bits": 8}}), "dynamic"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "per-tensor"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}, "ue8m0"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "static"),
        (ct_config("float-quantized"), "float-quantized"),
        (ct_config(strategy="channel"), "channel"),
        (ct_config(actorder="group"), "actorder"),
        (ct_config(num_bits=2), "2 bits"),
        (ct_config(activations={"num_bits": 8, "type": "int"}), "activations"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "gemv"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero points"),
        ({"quant_method": "bitsandbytes"}, "bitsandbytes"),
    ],
)
def test_unsupported_configs_are_refused_in_one_sentence(qc, cause):
    with pytest.raises(CheckpointError, match=cause) as refused:
        layout_of({"quantization_config": qc})
    message = str(refused.value)
    assert message.endswith(".") and ". " not in message.rstrip(".")


def test_bad_blocks_and_inconsistent_tensors_are_refused(tiny, tmp_path):
    layout, directory, reference = quantized_pair(tiny, tmp_path, "gptq-int4", "qwen3_moe")
    name = "model.layers.0.self_attn.q_proj.weight"
    module, shape = name.removesuffix(".weight"), tuple(reference[name].shape)
    source = open_checkpoint(directory)
    with pytest.raises(CheckpointError, match="not whole quantization groups of 16"):
        source.read_quantized(name, shape, (slice(None), slice(8, 40)))
    with pytest.raises(CheckpointError, match="contiguous"):
        source.read_quantized(name, shape, (slice(0, 8, 2),))
    with pytest.raises(CheckpointError, match="has shape"):
        source.read_quantized(name, (shape[0], shape[1] + GROUP))
    with pytest.raises(CheckpointError, match="does not store"):
        source.read_quantized("model.layers.0.mlp.gate.weight", (8, 64))
    stored = load_file(str(directory / "model.safetensors"))
    permuted = dict(stored, **{f"{module}.g_idx": stored[f"{module}.g_idx"].flip(0)})
    with pytest.raises(CheckpointError, match="act-order"):
        QuantizedSource(TensorDict(permuted), layout).read_quantized(name, shape)
    shifted = dict(stored, **{f"{module}.qzeros": stored[f"{module}.qzeros"] + 1})
    with pytest.raises(CheckpointError, match="symmetric"):
        QuantizedSource(TensorDict(shifted), layout).read_quantized(name, shape)
    regrouped = Gptq((), 4, 2 * GROUP, symmetric=True, v1=True)  # a config whose group size is not the tensors'
    with pytest.raises(CheckpointError, match="group size"):
        QuantizedSource(TensorDict(stored), regrouped).read_quantized(name, shape)
    listed = Gptq((module,), 4, GROUP, symmetric=True, v1=True)
    with pytest.raises(CheckpointError, match="lists it as not quantized"):
        QuantizedSource(TensorDict(stored), listed).quantized(name)


ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral_top2", "deepseek_v3")
# bf16 (the quantized kernels), teacher-forced: one layout per architecture, besides test_quantized_weights'
# DP 2 × EP runs (DeepSeek-V3 fp8, Mixtral ct-int4-asym)
BF16_CASES = {("gptq-int8", "qwen3_moe"), ("awq-int4", "qwen2_moe"), ("ct-int8-asym", "mixtral_top2"),
              ("gptq-int4-asym", "deepseek_v3")}


def test_verify_hf_passes_every_layout_on_every_architecture(tiny, tmp_path):
    """`moeshard verify hf --model Q --reference R` (1x1, fp32) on each published layout of each
    architecture: moeshard reads the quantized weights dequantized into fp32 ones and must be within
    verify hf's fp32 tolerance (max |Δlogit| ≤ 1e-3, every greedy token the same) of transformers on
    the dequantized reference; in bf16 (`--dtype bfloat16`, the quantized kernels) one layout per
    architecture passes verify hf's bf16 test (3 positions in 4 within 2^-4 of the largest logit,
    transformers teacher-forced). Negative control: one FP8 block's scale doubled fails. (One rank
    process for every run; one thread each: tiny models run faster so, on a loaded machine much faster.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ranks = open_layout(Layout())
    try:
        def verify(directory, reference, dtype="float32"):
            lengths = (7, 3) if dtype == "float32" else None
            request = hf.Request(str(directory), Layout(), prompt_lengths=lengths, steps=4, dtype=dtype,
                                 reference=str(reference))
            return hf.verify_hf(request, ranks)

        rows = []
        for arch in ARCHS:
            for layout_name in TINY_LAYOUTS:
                shipped, reference = tmp_path / f"{layout_name}-{arch}", tmp_path / f"{layout_name}-{arch}-reference"
                write_quantized(tiny(arch), shipped, layout_name, reference)
                comparison = verify(shipped, reference)
                rows.append((layout_name, arch, max(r.max_abs_diff for r in comparison.steps), comparison.passed))
                if (layout_name, arch) in BF16_CASES:
                    bf16 = verify(shipped, reference, "bfloat16")
                    within = sum(r.within for r in bf16.steps) / sum(r.positions for r in bf16.steps)
                    print(f"bf16 {layout_name} {arch}: {within:.2f} of positions within {bf16.tolerance:.3g}")
                    assert bf16.passed, (layout_name, arch)
        print(f"\n| layout | {' | '.join(ARCHS)} |\n|---|{'---|' * len(ARCHS)}")
        for layout_name in TINY_LAYOUTS:
            cells = [f"{d:.1e}" + ("" if ok else " FAIL") for name, _, d, ok in rows if name == layout_name]
            print(f"| {layout_name} | {' | '.join(cells)} |")
        assert all(ok for *_, ok in rows), [row for row in rows if not row[-1]]

        shipped = tmp_path / "fp8-qwen3_moe"
        tensors = load_file(str(shipped / "model.safetensors"))
        tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"][0, 0] *= 2
        save_file(tensors, str(shipped / "model.safetensors"), {"format": "pt"})
        broken = verify(shipped, tmp_path / "fp8-qwen3_moe-reference")
        print(f"one FP8 block's scale doubled: max |Δlogit| {max(r.max_abs_diff for r in broken.steps):.1e}")
        assert not broken.passed
    finally:
        ranks.close()
        torch.set_num_threads(threads)


def test_an_updates_tensors_go_to_their_parts_under_the_names_a_quantized_checkpoint_stores():
    from moeshard.models.model import part_of

    assert [part_of(n) for n in ("lm_head.qweight", "lm_head.weight_scale_inv", "model.norm.weight",
                                 "model.layers.3.mlp.experts.0.up_proj.qzeros", "model.embed_tokens.weight")] == \
        ["lm_head", "lm_head", "norm", 3, "embed"]
