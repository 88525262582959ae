"""Quantized weights on the CPU kernels (moeshard.kernels.PackedQuantized): every format's product
equals, bit for bit, the bf16 kernel's on the dequantized weights (quant.dequantize), in the
decode path (weights dequantized in registers) and the prefill path (a dequantized scratch panel);
packing round-trips; a wrong scale shows; bad operands are refused with a sentence.

Run it on both builds: as is (this CPU's), and with MOESHARD_CPU_KERNELS=avx2."""

import pytest
import torch

from moeshard import kernels
from moeshard.kernels import quant
from moeshard.kernels.quant import QuantFormat

pytestmark = pytest.mark.skipif(
    not kernels.built(), reason="no moeshard CPU kernels here: neither AVX512-BF16 nor AVX2 + FMA (or no compiler)"
)

FORMATS = [QuantFormat("fp8", 32), QuantFormat("int8", 16), QuantFormat("int8", 48, zero_point=True),
           QuantFormat("int4", 32), QuantFormat("int4", 16, zero_point=True)]
ROWS = [1, 2, 5, 7, 70]  # one register tile (dequantized in registers) and more (a scratch panel)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32),
                                              b.view(torch.int16 if b.dtype == torch.bfloat16 else torch.int32))


def same_quantized(a: quant.Quantized, b: quant.Quantized) -> bool:
    return (a.fmt == b.fmt and a.values.dtype == b.values.dtype and torch.equal(a.values.view(torch.uint8), b.values.view(torch.uint8))
            and torch.equal(a.scale, b.scale) and (a.zero is None) == (b.zero is None)
            and (a.zero is None or (a.zero.dtype == b.zero.dtype and torch.equal(a.zero, b.zero))))


def quantized(shape, fmt: QuantFormat, seed: int) -> quant.Quantized:
    g = torch.Generator().manual_seed(seed)
    return quant.quantize(torch.randn(shape, generator=g) * 0.1, fmt)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_linear_equals_the_bf16_kernel_on_dequantized_weights(fmt):
    N, K = 133, 6 * fmt.group  # a partial last panel, several groups
    q = quantized((N, K), fmt, seed=N)
    packed = kernels.pack_quantized(q)
    assert same_quantized(kernels.unpack_quantized(packed), q)
    bf16_packed = kernels.pack(quant.dequantize(q))
    x = torch.randn(max(ROWS), K, generator=torch.Generator().manual_seed(1)).bfloat16()
    for M in ROWS:
        for fp32_out in (False, True):
            got = kernels.linear(x[:M], packed, N, fp32_out)
            assert same_bits(got, kernels.linear(x[:M], bf16_packed, N, fp32_out)), (M, fp32_out)
    alone = kernels.linear(x[40:41].clone(), packed, N, fp32_out=True)  # decode path vs. scratch path: one row's bits
    assert same_bits(alone[0], kernels.linear(x, packed, N, fp32_out=True)[40])


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_grouped_swiglu_equals_the_bf16_kernel_on_dequantized_weights(fmt):
    # I = G of 16 or 48: padded to 32 or 64 inputs, a zero group (or half of one) after the weights'
    L, D, I = 4, 2 * fmt.group, fmt.group if fmt.group % 32 else 2 * fmt.group
    w13, w2 = quantized((L, 2 * I, D), fmt, seed=2), quantized((L, D, I), fmt, seed=3)
    p13, p2 = kernels.pack_gate_up_quantized(w13), kernels.pack_down_quantized(w2)
    assert same_quantized(kernels.unpack_quantized(p13), w13) and same_quantized(kernels.unpack_quantized(p2), w2)
    b13, b2 = kernels.pack_gate_up(quant.dequantize(w13)), kernels.pack_down(quant.dequantize(w2))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(60, D, generator=g).bfloat16()
    for M, counts in ((1, [0, 1, 0, 0]), (3, [1, 0, 1, 0]), (60, [20, 0, 25, 10])):  # expert 1 idle; rows past the last end
        ends = torch.tensor(counts).cumsum(0).to(torch.int32)
        got = kernels.grouped_swiglu(x[:M], p13, p2, ends)
        assert same_bits(got, kernels.grouped_swiglu(x[:M], b13, b2, ends)), M
        assert torch.equal(got[int(ends[-1]):], torch.zeros_like(got[int(ends[-1]):]))


def test_one_wrong_scale_changes_its_outputs_only():
    """Negative control: a group's scale doubled changes that output's result, and no other."""
    fmt = QuantFormat("int4", 32)
    q = quantized((70, 128), fmt, seed=5)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(6)).bfloat16()
    right = kernels.linear(x, kernels.pack_quantized(q), 70, fp32_out=True)
    wrong_scale = q.scale.clone()
    wrong_scale[66, 2] *= 2
    wrong = kernels.linear(x, kernels.pack_quantized(quant.Quantized(q.values, wrong_scale, None, fmt)), 70, fp32_out=True)
    differs = (wrong != right).any(0)
    assert differs[66] and differs.sum() == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_unpacking_inverts_packing(dtype):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(2, 70, 36, generator=g).to(dtype)
    assert torch.equal(kernels.unpack(kernels.pack(w), 70), w)
    gate_up, down = torch.randn(3, 2 * 40, 36, generator=g).to(dtype), torch.randn(3, 36, 40, generator=g).to(dtype)
    assert torch.equal(kernels.unpack_gate_up(kernels.pack_gate_up(gate_up), 40), gate_up)
    assert torch.equal(kernels.unpack_down(kernels.pack_down(down), 40, 36), down)


@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[2], FORMATS[4]], ids=str)
def test_packing_into_memory_from_strided_views_equals_packing_anew(fmt):
    """`out` poisoned (every byte must be written); the canonical tensors slices of wider ones."""
    g = torch.Generator().manual_seed(8)
    q = quant.quantize(torch.randn(2, 80, 3 * fmt.group, generator=g), fmt)

    def every_other_row(t):  # t's values as a strided view: every other row of a tensor twice as tall
        bytes_ = t.view(torch.uint8) if t.itemsize == 1 else t
        return torch.stack([bytes_, bytes_], dim=-2).flatten(-3, -2)[:, ::2].view(t.dtype)

    strided = quant.Quantized(*(t if t is None else every_other_row(t) for t in (q.values, q.scale, q.zero)), fmt)
    assert not strided.values.is_contiguous()
    for packer in (kernels.pack_quantized, kernels.pack_gate_up_quantized, kernels.pack_down_quantized):
        fresh = packer(q)
        out = packer(q)
        for t in (out.values, out.scale, out.zero):
            if t is not None:
                t.view(torch.uint8).fill_(0xFF)
        assert packer(strided, out=out) is out
        assert torch.equal(out.values, fresh.values) and torch.equal(out.scale, fresh.scale)
        assert out.zero is None or torch.equal(out.zero, fresh.zero)


def test_bad_operands_are_refused_with_a_sentence():
    q = quantized((16, 32), QuantFormat("int8", 16), seed=9)
    packed = kernels.pack_quantized(q)
    with pytest.raises(ValueError, match="int8 weights hold torch.int8 values, got torch.uint8"):
        kernels.pack_quantized(quant.Quantized(q.values.view(torch.uint8), q.scale, None, q.fmt))
    with pytest.raises(ValueError, match="a quantization group must be a multiple of 2, got 3"):
        kernels.pack_quantized(quantized((16, 30), QuantFormat("int8", 3), seed=9))
    with pytest.raises(ValueError, match="not whole groups of 16"):
        quant.Quantized(q.values[:, :24], q.scale[:, :1], None, q.fmt)
    big = quantized((16, 32), QuantFormat("fp8", 16), seed=9)
    with pytest.raises(ValueError, match="the fp8 kernel takes scales below 256"):
        kernels.pack_quantized(quant.Quantized(big.values, big.scale * 1e6, None, big.fmt))
    with pytest.raises(RuntimeError, match="quantized weights take bfloat16 activations"):
        kernels.linear(torch.randn(2, 32), packed, 16)
    with pytest.raises(RuntimeError, match="x has 30 inputs; the packed weight has 32"):
        kernels.linear(torch.randn(2, 30).bfloat16(), packed, 16)
    with pytest.raises(RuntimeError, match="a quantization group must be a positive multiple of 2 inputs"):
        torch.ops.moeshard_cpu.linear_quantized(torch.randn(2, 32).bfloat16(), packed.values, packed.scale, None, "int8", 5, 16, False, False)
    with pytest.raises(RuntimeError, match="scales must be float32 panels of 2 groups of 16 inputs"):
        torch.ops.moeshard_cpu.linear_quantized(torch.randn(2, 32).bfloat16(), packed.values, packed.scale[:, :1].contiguous(),
                                                None, "int8", 16, 16, False, False)
    w13 = kernels.pack_gate_up_quantized(quantized((2, 64, 32), QuantFormat("int8", 16), seed=9))
    w2 = kernels.pack_down_quantized(quantized((2, 32, 32), QuantFormat("int4", 16), seed=9))
    with pytest.raises(ValueError, match="gate-up and down weights must be quantized alike"):
        kernels.grouped_swiglu(torch.randn(2, 32).bfloat16(), w13, w2, torch.tensor([1, 2], dtype=torch.int32))
