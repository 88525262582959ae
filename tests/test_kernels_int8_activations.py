"""Quantized weights times int8 activations (QuantFormat(activations="int8"), cpu.cpp's A8Panels):
each product equals, bit for bit, a plain-torch reference doing the same integer arithmetic (each
row quantized per group of G inputs, exact integer sums per group, fp32 scaling group by group in
order); a row's result does not depend on the batch; a changed scale shows; the a8 layout packs
and unpacks; against the bf16 kernel on the dequantized weights it stays within 2% (relative).

Run it on both builds: as is (this CPU's, `vpdpbusd`), and with MOESHARD_CPU_KERNELS=avx2 (no VNNI:
the same integer sums by vpmaddwd / vpmaddubsw): the reference is the same, so are the bits."""

import pytest
import torch
import torch.nn.functional as F

from moeshard import kernels
from moeshard.kernels import quant
from moeshard.kernels.quant import QuantFormat

pytestmark = pytest.mark.skipif(
    not kernels.built(), reason="no moeshard CPU kernels here: neither AVX512-BF16 nor AVX2 + FMA (or no compiler)"
)

FORMATS = [QuantFormat("int8", 16, activations="int8"), QuantFormat("int8", 48, zero_point=True, activations="int8"),
           QuantFormat("int4", 32, activations="int8"), QuantFormat("int4", 16, zero_point=True, activations="int8")]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32),
                                              b.view(torch.int16 if b.dtype == torch.bfloat16 else torch.int32))


def quantized(shape, fmt: QuantFormat, seed: int, low: float | None = None) -> quant.Quantized:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.1 if low is None else low + torch.rand(shape, generator=g)
    return quant.quantize(w, fmt)


def int8_rows(x_MK: torch.Tensor, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row per group of G inputs: scale = max |x| / 127 (fp32), q = round-half-even(x / scale)
    (an all-zero group: scale 0, q 0). → q [M, X, G] (zero past K), scale [M, X]."""
    M, K = x_MK.shape
    X = -(-K // G)
    x = F.pad(x_MK.float(), (0, X * G - K)).view(M, X, G)
    largest = x.abs().amax(-1)
    scale = largest / 127
    q = (x / torch.where(scale > 0, scale, 1).unsqueeze(-1)).round().clamp(-127, 127)
    return torch.where(largest.unsqueeze(-1) > 0, q, 0), scale


def reference(x_MK: torch.Tensor, q: quant.Quantized) -> torch.Tensor:
    """fp32 [M, N]: per group g in order, acc + float(Σ level·q) · (weight scale · row scale)."""
    G, (N, K) = q.fmt.group, q.shape
    qa, sa = int8_rows(x_MK, G)
    levels = q.values.double()
    if q.zero is not None:
        levels = levels - quant.per_input(q.zero.double(), G)
    sums = torch.einsum("mxg,nxg->mnx", qa.double(), levels.view(N, -1, G))  # exact integers
    scale = q.scale.unsqueeze(0) * sa.unsqueeze(1)
    acc = torch.zeros(x_MK.shape[0], N)
    for g in range(K // G):
        acc = acc + sums[:, :, g].float() * scale[:, :, g]
    return acc


def same_weight(a: quant.Quantized, b: quant.Quantized) -> bool:
    return (a.fmt == b.fmt and torch.equal(a.values.view(torch.uint8), b.values.view(torch.uint8)) and torch.equal(a.scale, b.scale)
            and (a.zero is None) == (b.zero is None) and (a.zero is None or torch.equal(a.zero, b.zero)))


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_linear_is_the_integer_reference_bit_for_bit_and_a_row_is_its_own(fmt):
    N, K = 133, 6 * fmt.group  # a partial last panel, several groups
    q = quantized((N, K), fmt, seed=N)
    packed = kernels.pack_quantized(q)
    assert same_weight(kernels.unpack_quantized(packed), q)
    x = torch.randn(70, K, generator=torch.Generator().manual_seed(1)).bfloat16()
    x[3, : fmt.group] = 0  # an all-zero group
    want = reference(x, q)
    for M in (1, 2, 5, 7, 70):
        assert same_bits(kernels.linear(x[:M], packed, N, fp32_out=True), want[:M]), M
        assert same_bits(kernels.linear(x[:M], packed, N), want[:M].bfloat16()), M
    alone = kernels.linear(x[:1].clone(), packed, N, fp32_out=True)[0]
    for M in range(2, 71):
        assert same_bits(kernels.linear(x[:M], packed, N, fp32_out=True)[0], alone), M


def test_one_wrong_scale_fails_the_reference_at_its_output_only():
    """Negative control: the packed weight's scale of one group of one output doubled."""
    fmt = FORMATS[2]
    q = quantized((70, 4 * fmt.group), fmt, seed=5)
    x = torch.randn(3, 4 * fmt.group, generator=torch.Generator().manual_seed(6)).bfloat16()
    wrong = kernels.pack_quantized(q)
    wrong.scale[1, 2, 66 - 64] *= 2  # panel 1, group 2, output 66
    differs = (kernels.linear(x, wrong, 70, fp32_out=True) != reference(x, q)).any(0)
    assert differs[66] and differs.sum() == 1


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_grouped_swiglu_is_the_integer_reference_bit_for_bit(fmt):
    """Gate weights and inputs positive and large, so silu(gate) = gate exactly (exp(−gate) + 1 = 1 in
    fp32) and the SwiGLU is bf16(bf16(gate) · bf16(up)): every integer product of gate, up and down
    is checked against the reference (I = 48 with G = 16: the down's inputs padded to 64)."""
    L, D, I = 3, 2 * fmt.group, 48 if fmt.group == 16 else 2 * fmt.group
    gate = quantized((L, I, D), fmt, seed=2, low=0.5)
    up, down = quantized((L, I, D), fmt, seed=3), quantized((L, D, I), fmt, seed=4)
    gate = quant.Quantized(gate.values, gate.scale * 10, gate.zero, fmt)
    w13 = quant.Quantized(*(None if a is None else torch.cat([a, b], dim=1) for a, b in
                            ((gate.values, up.values), (gate.scale, up.scale), (gate.zero, up.zero))), fmt)
    p13, p2 = kernels.pack_gate_up_quantized(w13), kernels.pack_down_quantized(down)
    assert same_weight(kernels.unpack_quantized(p13), w13) and same_weight(kernels.unpack_quantized(p2), down)
    x = (1 + torch.rand(40, D, generator=torch.Generator().manual_seed(5))).bfloat16()
    counts = [15, 0, 20]  # expert 1 idle; rows past the last end
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    got = kernels.grouped_swiglu(x, p13, p2, ends)
    start = 0
    for l, n in enumerate(counts):
        rows = x[start : start + n]
        expert = [quant.Quantized(w.values[l], w.scale[l], None if w.zero is None else w.zero[l], fmt) for w in (gate, up, down)]
        g, u = reference(rows, expert[0]), reference(rows, expert[1])
        assert bool((g > 100).all())
        h = (g.bfloat16().float() * u.bfloat16().float()).bfloat16()
        assert same_bits(got[start : start + n], reference(h, expert[2]).bfloat16()), l
        start += n
    assert torch.equal(got[start:], torch.zeros_like(got[start:]))
    one = kernels.grouped_swiglu(x[15:16].clone(), p13, p2, torch.tensor([0, 0, 1], dtype=torch.int32))
    assert same_bits(one[0], got[15])


@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[2]], ids=str)
def test_within_two_percent_of_the_bf16_kernel_on_the_dequantized_weights(fmt):
    K = 2048
    fmt = QuantFormat(fmt.kind, 128, activations="int8")
    q = quantized((256, K), fmt, seed=7)
    x = torch.randn(8, K, generator=torch.Generator().manual_seed(8)).bfloat16()
    a8 = kernels.linear(x, kernels.pack_quantized(q), 256, fp32_out=True)
    bf16 = kernels.linear(x, kernels.pack(quant.dequantize(q)), 256, fp32_out=True)
    assert float((a8 - bf16).norm() / bf16.norm()) < 0.02


def test_the_a8_layout_packs_into_memory_and_refuses_what_it_cannot_hold():
    fmt = QuantFormat("int4", 16, zero_point=True, activations="int8")
    q = quantized((2, 80, 48), fmt, seed=9)
    for packer in (kernels.pack_quantized, kernels.pack_gate_up_quantized, kernels.pack_down_quantized):
        fresh, out = packer(q), packer(q)
        out.values.fill_(0xFF)
        assert packer(q, out=out) is out and torch.equal(out.values, fresh.values)
        assert same_weight(kernels.unpack_quantized(out), q)
    with pytest.raises(ValueError, match="int8 activations .* take int8 or int4 weights, not fp8"):
        QuantFormat("fp8", activations="int8")
    with pytest.raises(ValueError, match="a quantization group must be a multiple of 8, got 12"):
        kernels.pack_quantized(quantized((16, 48), QuantFormat("int4", 12, activations="int8"), seed=9))
    packed = kernels.pack_quantized(quantized((16, 32), QuantFormat("int8", 16), seed=9))
    with pytest.raises(RuntimeError, match="values must be uint8 panels"):
        torch.ops.moeshard_cpu.linear_quantized(torch.randn(2, 32).bfloat16(), packed.values, packed.scale, None, "int8", 16,
                                                16, False, True)
