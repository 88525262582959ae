"""The CPU kernels (moeshard.kernels, bf16 and fp32, on whichever build this CPU takes: AVX512-BF16 or
AVX2 + FMA) against torch's ops, with the awkward shapes: one row, odd output counts, inputs not a
multiple of the vector width, experts with no rows, rows no expert computes, sliding windows,
poisoned cache slots that no sequence owns."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from moeshard import kernels
from moeshard.models import kv_cache
from moeshard.runtime import invariance
from moeshard.runtime.memory import fill_poison

pytestmark = pytest.mark.skipif(
    not kernels.built(), reason="no moeshard CPU kernels here: neither AVX512-BF16 nor AVX2 + FMA (or no compiler)"
)


@pytest.fixture(autouse=True)
def batch_invariant_mode():
    """Batch-invariant mode, where the modules run both dtypes on the kernels on either build (the
    AVX2 build's default mode keeps torch's ops in fp32: test_what_each_build_serves)."""
    before = invariance.batch_invariant()
    invariance.set_batch_invariant(True)
    yield
    invariance.set_batch_invariant(before)


def test_what_each_build_serves(monkeypatch):
    both = (torch.bfloat16, torch.float32)
    assert kernels.dtypes() == both  # batch-invariant mode: every dtype, every build
    invariance.set_batch_invariant(False)
    assert kernels.dtypes() == (both if kernels.isa() == "avx512_bf16" else both[:1])
    assert not kernels.runs(torch.empty(2, 2, dtype=torch.float16))
    monkeypatch.setenv("MOESHARD_CPU_KERNELS", "avx2")  # the portable build, asked for
    assert kernels.isa() == "avx2"
    monkeypatch.setenv("MOESHARD_CPU_KERNELS", "0")
    assert kernels.isa() is None
    monkeypatch.setenv("MOESHARD_CPU_KERNELS", "yes")
    with pytest.raises(ValueError, match="MOESHARD_CPU_KERNELS must be 0, 1 or avx2"):
        kernels.isa()


def test_a_killed_processs_build_lock_is_removed_not_waited_on():
    """cpp_extension's `lock` file, as a process killed while it loaded the kernels leaves it: the next
    process removes it (holding the build's flock, so no live process can own it) rather than wait on
    it forever."""
    lock = kernels.build_directory(kernels.isa()) / "lock"
    lock.touch()
    try:
        result = subprocess.run([sys.executable, "-c", "from moeshard import kernels; assert kernels.built()"],
                                capture_output=True, text=True, timeout=600)
    finally:
        left = lock.exists()
        lock.unlink(missing_ok=True)
    assert result.returncode == 0 and not left, result.stderr[-2000:]


def test_bf16_outputs_round_to_nearest_even_as_torch_does():
    """Each output x[0]·1 + x[1]·1 is exact in fp32; its bf16 is torch's rounding of it, ties to even."""
    tiny = 2.0**-8  # half of bf16's last place at 1: 1 + tiny is a tie
    pairs = [(1.0, tiny), (1.0 + 2 * tiny, tiny), (-1.0, -tiny), (3.0, 0.75 * tiny), (1.0, 1.25 * tiny), (-0.0, 0.0)]
    x = torch.tensor(pairs).bfloat16()
    packed = kernels.pack(torch.ones(3, 2).bfloat16())
    exact = kernels.linear(x, packed, 3, fp32_out=True)
    assert torch.equal(exact[:, 0], x.float().sum(1))
    got = kernels.linear(x, packed, 3)
    assert torch.equal(got.view(torch.int16), exact.bfloat16().view(torch.int16))
    assert got[:4, 0].tolist() == [1.0, 1.015625, -1.0, 3.0]  # two ties to even (one down, one up), two below half


DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M, K, N", [(1, 512, 512), (3, 62, 37), (7, 2048, 1000), (64, 96, 130), (0, 64, 64), (5, 33, 20)])
def test_linear_matches_fp32_and_a_row_never_depends_on_the_batch(M, K, N, dtype):
    if K % 2 and dtype == torch.bfloat16:
        return  # bf16 inputs come in pairs (kernels.serves says no)
    g = torch.Generator().manual_seed(M + K + N)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)
    packed = kernels.pack(w)
    exact = x.double() @ w.double().T
    got = kernels.linear(x, packed, N, fp32_out=True)
    assert got.shape == (M, N) and got.dtype == torch.float32
    assert torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-4)  # fp32 accumulation of the products
    assert torch.equal(kernels.linear(x, packed, N), got.to(dtype))
    for m in range(M):  # alone, or anywhere in a batch: bitwise the same
        assert torch.equal(kernels.linear(x[m : m + 1].clone(), packed, N, fp32_out=True)[0], got[m])


def torch_grouped_swiglu(x, w13, w2, ends):
    gate, up = F.grouped_mm(x, w13.transpose(1, 2), offs=ends).chunk(2, dim=-1)
    return F.grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=ends)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L, D, I", [(8, 64, 40), (32, 512, 256), (3, 32, 8)])
def test_grouped_swiglu_equals_torchs_experts(L, D, I, dtype):
    g = torch.Generator().manual_seed(L)
    w13 = (torch.randn(L, 2 * I, D, generator=g) * 0.05).to(dtype)
    w2 = (torch.randn(L, D, I, generator=g) * 0.05).to(dtype)
    x = torch.randn(50, D, generator=g).to(dtype)
    labels = torch.randint(0, L + 1, (50,), generator=g).sort().values  # label L: not computed here
    labels[labels == 1] = 2  # expert 1 gets no rows
    ends = torch.bincount(labels, minlength=L + 1)[:L].cumsum(0).to(torch.int32)
    computed = int(ends[-1])
    got = kernels.grouped_swiglu(x, kernels.pack_gate_up(w13), kernels.pack_down(w2), ends)
    want = torch_grouped_swiglu(x, w13, w2, ends)
    tol = dict(rtol=1e-2, atol=1e-3) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    assert got.dtype == dtype and torch.allclose(got[:computed].float(), want[:computed].float(), **tol)
    assert torch.equal(got[computed:], torch.zeros_like(got[computed:]))
    one = kernels.grouped_swiglu(x[:1].clone(), kernels.pack_gate_up(w13), kernels.pack_down(w2), ends.clamp(max=1))
    assert torch.equal(one[0], got[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_swiglu_is_one_expert(dtype):
    g = torch.Generator().manual_seed(3)
    gate_up, down = torch.randn(2 * 48, 64, generator=g).to(dtype), torch.randn(64, 48, generator=g).to(dtype)
    x = torch.randn(5, 64, generator=g).to(dtype)
    ends = torch.tensor([5], dtype=torch.int32)
    want = torch_grouped_swiglu(x, gate_up[None], down[None], ends)
    got = kernels.swiglu(x, kernels.pack_gate_up(gate_up), kernels.pack_down(down))
    assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_bad_operands_are_refused_with_a_sentence():
    packed = kernels.pack(torch.randn(16, 8).bfloat16())
    with pytest.raises(RuntimeError, match="x has 6 inputs; the packed weight has 8"):
        kernels.linear(torch.randn(2, 6).bfloat16(), packed, 16)
    with pytest.raises(RuntimeError, match="x must have the packed weight's dtype"):
        kernels.linear(torch.randn(2, 8), packed, 16)
    with pytest.raises(RuntimeError, match="must be packed by moeshard.kernels.pack"):
        kernels.linear(torch.randn(2, 8), torch.randn(1, 8, 64, 2), 16)
    w13, w2 = kernels.pack_gate_up(torch.randn(2, 32, 16).bfloat16()), kernels.pack_down(torch.randn(2, 16, 16).bfloat16())
    with pytest.raises(RuntimeError, match="must not decrease"):
        kernels.grouped_swiglu(torch.randn(4, 16).bfloat16(), w13, w2, torch.tensor([3, 1], dtype=torch.int32))


# (KV heads, key dim, value dim, query heads): GQA with the register path, and MLA's shape (one
# latent "head", keys longer than values, dims not a multiple of 16) with the general one.
HEADS = [(2, 64, 64, 4), (1, 72, 40, 3)]


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("q_dtype, cache_dtype", [(torch.bfloat16,) * 2, (torch.float32, torch.bfloat16), (torch.float32,) * 2])
@pytest.mark.parametrize("G, d, e, H", HEADS)
def test_paged_attention_equals_the_torch_path(window, q_dtype, cache_dtype, G, d, e, H, monkeypatch):
    """Mixed steps (prefill chunks and decodes, blocks anywhere in the pool) over a poisoned cache:
    the kernel reads only each sequence's own slots, so the poison never shows."""
    block_size, num_blocks = 8, 30
    cache = kv_cache.allocate(kv_cache.CacheSpec(G, d, e), num_blocks, block_size, cache_dtype, "cpu", poison=True)

    class Layer:
        pass

    layer = Layer()
    layer.cache, layer.scale, layer.window = cache, 0.125, window
    name = f"test_kernels.{window}.{q_dtype}.{cache_dtype}.{G}.{d}.{e}"
    kv_cache.register(name, layer)
    g = torch.Generator().manual_seed(0)
    query_lens, seq_lens = [5, 1, 1, 17, 1], [5, 30, 9, 40, 70]
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for n in seq_lens:
        tables.append([order.pop() for _ in range(-(-n // block_size))])
    for table, n, q in zip(tables, seq_lens, query_lens):  # the context before this step
        for p in range(n - q):
            slot = table[p // block_size] * block_size + p % block_size
            cache.k_SGd[slot] = torch.randn(G, d, generator=g).to(cache_dtype)
            cache.v_SGe[slot] = torch.randn(G, e, generator=g).to(cache_dtype)
    meta = kv_cache.AttentionMetadata.build(query_lens, seq_lens, tables, block_size, kv_cache.null_slot(num_blocks, block_size))
    T = sum(query_lens) + 3  # three padding rows
    q, k, v = (torch.randn(T, n, dim, generator=g).to(q_dtype) for n, dim in ((H, d), (G, d), (G, e)))
    with kv_cache.attention_context(meta):
        got = kv_cache.paged_attention(q, k, v, name)
        unused_k, unused_v = cache.k_SGd.clone(), cache.v_SGe.clone()
        monkeypatch.setenv("MOESHARD_CPU_KERNELS", "0")
        kernels.built.cache_clear()
        try:
            want = kv_cache.paged_attention(q, k, v, name)
        finally:
            monkeypatch.undo()
            kernels.built.cache_clear()
    same_bits = lambda a, b: torch.equal(a.view(torch.int16), b.view(torch.int16))  # NaN poison included
    assert same_bits(cache.k_SGd, unused_k) and same_bits(cache.v_SGe, unused_v)  # both wrote the same K/V
    assert got.dtype == q_dtype and torch.isfinite(got).all()
    tol = dict(rtol=1e-5, atol=1e-5) if cache_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    assert torch.allclose(got.float(), want.float(), **tol)
    assert torch.equal(got[-3:], torch.zeros_like(got[-3:]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_packing_into_memory_equals_packing_anew(dtype):
    g = torch.Generator().manual_seed(1)
    for packer, weight in ((kernels.pack, torch.randn(3, 130, 32, generator=g)),
                           (kernels.pack_gate_up, torch.randn(3, 80, 32, generator=g)),
                           (kernels.pack_down, torch.randn(3, 32, 40, generator=g))):
        weight = weight.to(dtype)
        fresh = packer(weight)
        out = torch.full_like(fresh, float("nan"))  # poison: every element must be written
        assert packer(weight, out=out) is out and torch.equal(out, fresh)


def torch_path(module, *args):
    """`module(*args)` on torch's ops (modules decide at construction whether to use the kernels)."""
    assert module.fused
    module.fused = False
    try:
        return module(*args)
    finally:
        module.fused = True


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 512), (3, 4, 128), (1, 40), (0, 64)])
def test_rms_norm_equals_torchs_and_a_row_never_depends_on_the_batch(dtype, shape):
    from moeshard.models.layers import RMSNorm

    g = torch.Generator().manual_seed(shape[-1])
    norm = RMSNorm(lambda size, *blocks, **kw: torch.randn(size, generator=g).to(dtype), "n", shape[-1], 1e-6)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    got, want = norm(x), torch_path(norm, x)
    assert got.dtype == dtype and got.shape == x.shape
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    assert torch.allclose(got.float(), want.float(), **tol)
    rows = x.reshape(-1, shape[-1])
    for m in range(rows.shape[0]):
        assert torch.equal(norm(rows[m : m + 1].clone()), got.reshape(-1, shape[-1])[m : m + 1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("heads, dim", [(4, 64), (2, 40)])
def test_rotary_equals_torchs_on_strided_heads(dtype, interleaved, heads, dim):
    from moeshard.models.config import RopeConfig
    from moeshard.models.layers import Rotary
    from moeshard.runtime import derived

    rotary = Rotary(RopeConfig(dim=dim, theta=10000.0, interleaved=interleaved), 64, torch.device("cpu"))
    derived.rebuild([rotary])
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(6, heads, dim + 8, generator=g).to(dtype)[..., 8:]  # a slice of wider rows, as MLA's q_rope
    positions = torch.tensor([0, 5, 63, 7, 7, 1])
    got, want = rotary(x, positions), torch_path(rotary, x, positions)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    assert got.dtype == dtype and torch.allclose(got.float(), want.float(), **tol)
    with pytest.raises(RuntimeError, match="position 64 is outside the table"):
        rotary(x[:1], torch.tensor([64]))
