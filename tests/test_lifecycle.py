"""Sleep, wake, weight updates and reload with poisoned memory: outputs equal a fresh engine's with the
same weights; with the derived-tensor rebuild off they do not (the second seed's bug class); bad
updates change nothing; released memory is really released."""

import itertools
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeshard import LLM, SamplingParams, kernels
from moeshard.bundled.arithmetic import MODEL_DIR, held_out
from moeshard.kernels import packed
from moeshard.runtime import derived

# 7 problems cut short (1–7 tokens) among 48 whole ones: steps pad their shorter sequences' keys.
PROMPTS = [p.prompt[:k] for k, p in enumerate(held_out(55)[48:], start=1)] + [p.prompt for p in held_out(48)]
GREEDY = SamplingParams(temperature=0)
CYCLES = 5

# The whole module: its module-scoped engines' outputs would be made again if its tests were split.
pytestmark = pytest.mark.long_pole


@pytest.fixture(scope="module")
def reference():
    with LLM(dtype="float32") as llm:
        return [o.text for o in llm.generate(PROMPTS, GREEDY)]


def perturbed(seed: int) -> dict[str, torch.Tensor]:
    """The bundled weights, moved far enough (25% relative noise, bf16 as stored) that some answers change."""
    g = torch.Generator().manual_seed(seed)
    weights = load_file(MODEL_DIR / "model.safetensors")
    return {n: (w.float() * (1 + 0.25 * torch.randn(w.shape, generator=g))).to(w.dtype) for n, w in weights.items()}


@pytest.fixture(scope="module")
def updates(tmp_path_factory, reference):
    """CYCLES weight sets and what a fresh one-rank engine loaded from each generates."""
    out = []
    for k in range(CYCLES):
        directory = tmp_path_factory.mktemp(f"update{k}")
        for f in ("config.json", "tokenizer.json"):
            shutil.copy(MODEL_DIR / f, directory / f)
        weights = perturbed(k)
        save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
        with LLM(str(directory), dtype="float32") as fresh:
            out.append((weights, [o.text for o in fresh.generate(PROMPTS, GREEDY)]))
    # Each cycle's weights answer differently, so an update that is not applied cannot pass.
    assert all(texts_k != previous for (_, texts_k), previous in zip(out, [reference] + [t for _, t in out]))
    return out


def texts(llm):
    # 55 prompts, 16 in flight: new prefills join running decodes in the same steps.
    return [o.text for o in llm.generate(PROMPTS, GREEDY, max_concurrency=16)]


def run_cycles(llm, reference, updates, methods, poison=True):
    """CYCLES cycles of each kind, each checked against a fresh engine. Each check runs under the
    next of `methods` in turn, set on the live engine (a compiled graph is traced once and serves
    them all): with 4 methods over the 16 checks, every method meets every kind of cycle."""
    live = itertools.cycle(methods)

    def check(expected):
        llm.set_moe_comm(next(live))
        assert texts(llm) == expected

    check(reference)
    for weights, expected in updates:  # the RL loop: the trainer had the memory, new weights arrive
        llm.sleep(level=2)
        llm.wake_up(["weights"], poison=poison)
        llm.update_weights(weights.items())
        llm.wake_up(["kv_cache"], poison=poison)
        check(expected)
    for _ in range(CYCLES):
        llm.sleep(level=1)
        llm.wake_up(poison=poison)
        check(updates[-1][1])
    for _ in range(CYCLES):
        llm.sleep(level=2)
        llm.wake_up(["weights"], poison=poison)
        llm.reload_weights()
        llm.wake_up(["kv_cache"], poison=poison)
        check(reference)


METHODS = ("allgather", "alltoall", "mc2", "fused_mc2")


@pytest.mark.parametrize("compile", [False, "aot_eager"])
@pytest.mark.parametrize("tp", [1, 2])
def test_sleep_wake_update_reload_equal_a_fresh_engine(reference, updates, tp, compile):
    with LLM(
        tensor_parallel_size=tp, data_parallel_size=2, enable_expert_parallel=True, moe_comm=METHODS[0],
        compile=compile, dtype="float32",
    ) as llm:
        run_cycles(llm, reference, updates, METHODS)


def test_negative_control_without_the_derived_rebuild(reference, updates, monkeypatch):
    """Expert maps and RoPE tables left as a poisoned wake made them: the same cycles must fail.
    The poison is the silent kind (values in range, no NaN, no index out of bounds), so nothing
    fails loudly: the answers differ. (With out-of-range owners, gloo could abort the driver's
    process inside an all-to-all before any Python error: seen once in a fresh-clone CI run.)"""
    monkeypatch.setenv("MOESHARD_UNSAFE_SKIP_DERIVED_REBUILD", "1")
    with LLM(data_parallel_size=2, enable_expert_parallel=True, moe_comm="alltoall", dtype="float32") as llm:
        with pytest.raises((AssertionError, RuntimeError)):
            run_cycles(llm, reference, updates, ["alltoall"], poison="in_range")


def cut_short(items, after):
    for i, item in enumerate(items):
        if i == after:
            raise ConnectionError("trainer went away")
        yield item


def test_bad_updates_are_refused_and_change_nothing(reference, updates):
    weights = updates[0][0]
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    bad = {
        "unknown name": (list(weights.items()) + [("model.layers.9.mlp.gate.weight", weights[name])], "not a weight"),
        "wrong shape": ({**weights, name: weights[name][:-1]}.items(), "has shape"),
        "wrong dtype": (
            {**weights, name: weights[name].float()}.items(),
            "torch.float32; the model's is torch.bfloat16",
        ),
        "stream cut short": (cut_short(list(weights.items()), 20), "stream failed after 20 tensors"),
        "stream ends early": (list(weights.items())[:-3], "the update ended without"),
    }
    with LLM(data_parallel_size=2, enable_expert_parallel=True, dtype="float32") as llm:
        generation = llm.update_weights(perturbed(0).items())
        before = texts(llm)
        assert before == updates[0][1]
        for case, (stream, message) in bad.items():
            with pytest.raises(ValueError, match=message):
                llm.update_weights(stream)
            assert texts(llm) == before, case
        assert llm.update_weights(weights.items()) == generation + 1  # refused updates did not count


def test_lifecycle_errors():
    with LLM() as llm:
        llm.sleep(level=2)
        with pytest.raises(RuntimeError, match="asleep .*call wake_up"):
            llm.generate(PROMPTS[:1], GREEDY)
        with pytest.raises(RuntimeError, match="already asleep"):
            llm.sleep(level=1)
        with pytest.raises(RuntimeError, match="weights' memory is released"):
            llm.reload_weights()
        llm.wake_up(poison=True)
        with pytest.raises(RuntimeError, match="dropped by sleep\\(level=2\\); call reload_weights"):
            llm.generate(PROMPTS[:1], GREEDY)
        with pytest.raises(ValueError, match="unknown wake_up tag"):
            llm.wake_up(["weights", "cache"])
        with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
            llm.sleep(level=3)
        llm.reload_weights()
        assert llm.generate(["123+456="], GREEDY)[0].text == "975"


def test_level_2_releases_the_weights_memory(tmp_path):
    from moeshard.bench.e2e import larger_model

    with LLM(larger_model(str(tmp_path / "larger")), max_num_seqs=2) as llm:
        weight_mb = sum(t.numel() * t.element_size() for t in llm.ranks.host.worker.weights()) / 2**20  # in-process
        awake = llm.resident_mb()[0]
        asleep = llm.sleep(level=2)[0]
        assert awake - asleep >= 0.9 * weight_mb, (awake, asleep, weight_mb)
        assert llm.wake_up(poison=True)[0] - asleep >= 0.9 * weight_mb
        llm.reload_weights()
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
        assert len(out.token_ids) == 4


# Mixed lengths: token-id prompts of 1–300 tokens on a random model with a 512-token context, a token
# budget that cuts prefills into chunks that run beside other requests' decodes, and too few KV
# blocks, so requests are preempted and recomputed. Every step pads its shorter sequences' keys, and
# the blocks come back in an order earlier requests left, so padded reads meet poisoned memory.
MIXED_ENGINE = dict(max_num_batched_tokens=64, max_num_seqs=6, num_kv_blocks=39, block_size=8)
MIXED_LENGTHS = [1, 300, 7, 64, 2, 151, 33, 17, 250, 5, 90, 12]
MIXED_GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


REPEATED_LENGTHS = [20, 35, 50, 27]  # together ~19 of the 39 blocks: they stay cached from one run to the next


def mixed_ids(llm) -> list[list[int]]:
    """The mixed lengths, between two runs of a few shorter prompts: those that open a run find in
    the prefix cache the blocks the previous run closed with."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 101, (n,), generator=g).tolist() for n in MIXED_LENGTHS]
    repeated = [torch.randint(0, 101, (n,), generator=g).tolist() for n in REPEATED_LENGTHS]
    return [o.token_ids for batch in (repeated, prompts, repeated) for o in llm.generate(batch, MIXED_GREEDY)]


def two_checkpoints(root, dtype: str, variant: str = "qwen3_moe", **options):
    """Two random Qwen3-MoE checkpoints (the start, the update), each with a fresh one-rank engine's
    output in `dtype` (with LLM `options`)."""
    from moeshard.verify.tiny import make_tiny_checkpoint

    out = []
    for seed in (0, 1):
        directory = str(make_tiny_checkpoint(variant, root / f"seed{seed}", seed=seed, max_position_embeddings=512))
        with LLM(directory, dtype=dtype, **MIXED_ENGINE, **options) as fresh:
            out.append((directory, mixed_ids(fresh)))
            assert fresh.stats().preemptions > 0
    assert out[0][1] != out[1][1]
    return out


@pytest.fixture(scope="module")
def long_context(tmp_path_factory):
    return two_checkpoints(tmp_path_factory.mktemp("long_context"), "float32")


@pytest.fixture(scope="module")
def long_context_bf16(tmp_path_factory):
    return two_checkpoints(tmp_path_factory.mktemp("long_context_bf16"), "bfloat16")


def mixed_cycles(llm, long_context) -> list[bool]:
    """Poisoned sleep / wake / update / reload cycles, then an update and a reload while awake;
    whether each run's outputs equal a fresh engine's with the same weights. Every run repeats the
    prompts of the run before, so the prefix cache holds their blocks: after an update while awake
    only the weights' version in their keys keeps them from being served. Ends on the start-up
    weights."""
    (_, start_ids), (update, update_ids) = long_context
    equal = [mixed_ids(llm) == start_ids]
    llm.sleep(level=2)
    llm.wake_up(["weights"], poison=True)
    llm.update_weights_from_disk(update)
    llm.wake_up(["kv_cache"], poison=True)
    equal.append(mixed_ids(llm) == update_ids)
    llm.sleep(level=1)
    llm.wake_up(poison=True)
    equal.append(mixed_ids(llm) == update_ids)
    llm.sleep(level=2)
    llm.wake_up(["weights"], poison=True)
    llm.reload_weights()
    llm.wake_up(["kv_cache"], poison=True)
    equal.append(mixed_ids(llm) == start_ids)
    hits = llm.stats().prefix_cache_hits
    llm.update_weights_from_disk(update)
    equal.append(mixed_ids(llm) == update_ids)
    llm.reload_weights()
    equal.append(mixed_ids(llm) == start_ids)
    assert llm.stats().prefix_cache_hits > hits  # repeated prompts found blocks of their own version
    return equal


EVERY_METHOD = ("auto", *METHODS)
# One engine per (layout, eager/compiled) runs the cycles under each method in turn.
MIXED_CASES = [("1x1", ("auto",), False), ("1x1", ("auto",), "aot_eager"), ("1x2-ep", EVERY_METHOD, False),
               ("2x2-ep", EVERY_METHOD, "aot_eager")]


@pytest.mark.parametrize("layout, methods, compile", MIXED_CASES)
def test_mixed_lengths_through_poisoned_cycles_equal_a_fresh_engine(long_context, layout, methods, compile):
    check_mixed_cycles(long_context, layout, methods, compile, "float32")


# Without moeshard.kernels (a CPU without them, MOESHARD_CPU_KERNELS=0) attention gathers each
# sequence's keys into a padded batch: the padding reads the null block (the negative control below).
@pytest.mark.parametrize("layout, method", [("1x1", "auto"), ("1x2-ep", "alltoall")])
def test_mixed_lengths_on_torchs_ops_through_poisoned_cycles(long_context, layout, method, torch_ops):
    check_mixed_cycles(long_context, layout, (method,), False, "float32")


# bf16 on a CPU with AVX512-BF16 runs moeshard.kernels: prepacked weights (derived tensors) and the
# attention that reads the paged cache in place. A layout's bf16 sums differ from one rank's, so
# each layout is compared with a fresh engine of the same layout.
@pytest.mark.parametrize(
    "layout, method, compile",
    [("1x1", "auto", False), ("1x1", "auto", "aot_eager"), ("1x2-ep", "fused_mc2", False), ("2x2-ep", "mc2", "aot_eager")],
)
def test_bf16_mixed_lengths_through_poisoned_cycles_equal_a_fresh_engine(long_context_bf16, layout, method, compile):
    tp, dp = (int(n) for n in layout.split("-")[0].split("x"))
    engine = dict(tensor_parallel_size=tp, data_parallel_size=dp, enable_expert_parallel="ep" in layout, moe_comm=method)
    expected = long_context_bf16  # the fixture's fresh engines have one rank and method auto
    if layout != "1x1":
        expected = []
        for directory, _ in long_context_bf16:
            with LLM(directory, dtype="bfloat16", **engine, **MIXED_ENGINE) as fresh:
                expected.append((directory, mixed_ids(fresh)))
    check_mixed_cycles(expected, layout, (method,), compile, "bfloat16")


@pytest.mark.skipif(not kernels.runs(torch.empty(2, 2, dtype=torch.bfloat16)), reason="no bf16 CPU kernels here")
def test_bf16_an_update_while_awake_reaches_the_packed_weights_without_a_rebuild(long_context_bf16, monkeypatch):
    """The kernels' packed weights are the weights, not tensors derived from them: an update writes
    the panels themselves, so with the derived-tensor rebuild off (every derived tensor left, expert
    maps and RoPE tables, stays valid while awake) the answers are already the new weights'. (When
    the panels were derived copies, this was the negative control: the old weights' answers.)"""
    (start, start_ids), (update, update_ids) = long_context_bf16
    monkeypatch.setenv("MOESHARD_UNSAFE_SKIP_DERIVED_REBUILD", "1")
    with LLM(start, dtype="bfloat16", **MIXED_ENGINE) as llm:
        llm.update_weights_from_disk(update)
        assert mixed_ids(llm) == update_ids


QUANTIZED = dict(quantization="int4", quantization_group=16)


@pytest.mark.skipif(not kernels.built(), reason="no moeshard CPU kernels here")
def test_quantized_weights_through_poisoned_cycles_equal_a_fresh_engine(tmp_path, monkeypatch):
    """int4 quantized at load, on a model with a tied LM head (the embedding stays bf16 for lookups,
    the head is its quantized copy: a derived tensor): bf16 updates are quantized as they are
    written, and poisoned sleep, wake, update and reload cycles give a fresh quantized engine's
    answers, every byte of the quantized panels (padding too) and of the head's copy as at start-up.
    Negative controls: with the padding of quantized panels not zeroed on a load, a poisoned wake
    leaves its garbage, and the digests differ; with the head's copy not registered, it is never
    made from the loaded weights, and the answers differ from the first."""
    long_context = two_checkpoints(tmp_path, "bfloat16", "qwen3_moe_tied", **QUANTIZED)
    probe = [[3, 14, 15, 92, 65], [35, 89, 79]]
    with LLM(long_context[0][0], dtype="bfloat16", **MIXED_ENGINE, **QUANTIZED) as llm:
        start, answers = llm.state_digest(), llm.generate(probe, MIXED_GREEDY)
        assert mixed_cycles(llm, long_context) == [True] * 6
        assert llm.state_digest() == start
    with monkeypatch.context() as unsafe:
        unsafe.setattr(packed.QuantizedPanels, "zero_padding", lambda self, storage: None)
        with LLM(long_context[0][0], dtype="bfloat16", **MIXED_ENGINE, **QUANTIZED) as llm:
            start = llm.state_digest()
            mixed_cycles(llm, long_context)
            assert llm.state_digest() != start
    register = derived.register
    unregistered = lambda owner, attr, compute, in_place=False: (  # noqa: E731
        setattr(owner, attr, compute()) if attr == "head_VD" else register(owner, attr, compute, in_place))
    monkeypatch.setattr(derived, "register", unregistered)
    with LLM(long_context[0][0], dtype="bfloat16", **MIXED_ENGINE, **QUANTIZED) as llm:
        assert [o.token_ids for o in llm.generate(probe, MIXED_GREEDY)] != [o.token_ids for o in answers]


def check_mixed_cycles(long_context, layout, methods, compile, dtype):
    """The cycles under each of `methods` in turn, on one engine (a compiled graph is traced once)."""
    tp, dp = (int(n) for n in layout.split("-")[0].split("x"))
    directory = long_context[0][0]
    with LLM(
        directory, tensor_parallel_size=tp, data_parallel_size=dp, enable_expert_parallel="ep" in layout,
        moe_comm=methods[0], compile=compile, dtype=dtype, **MIXED_ENGINE,
    ) as llm:
        start = llm.state_digest()
        for method in methods:
            llm.set_moe_comm(method)
            assert mixed_cycles(llm, long_context) == [True] * 6, method
        # The poison (NaN, ±Inf, huge, in range; ids out of range) is gone from every weight and
        # derived tensor, padding rows included: all of it was rewritten before anything read it.
        assert llm.state_digest() == start
        assert llm.stats().preemptions > 0


@pytest.mark.parametrize("layout", ["1x1", "1x2-ep"])
def test_negative_control_padded_keys_read_an_ordinary_slot(long_context, layout, monkeypatch, torch_ops):
    """With the null block off, padded key positions read slot 0 of the pool, which a poisoned wake
    filled with garbage: the shorter sequences of a step come back wrong. (The padded path is
    torch's; moeshard.kernels read only each sequence's own slots.)"""
    monkeypatch.setenv("MOESHARD_UNSAFE_NO_NULL_BLOCK", "1")
    dp = int(layout.split("-")[0].split("x")[1])
    with LLM(long_context[0][0], data_parallel_size=dp, enable_expert_parallel=dp > 1, dtype="float32",
             **MIXED_ENGINE) as llm:
        assert not all(mixed_cycles(llm, long_context)[1:])  # the runs after a poisoned wake


@pytest.mark.parametrize("layout, method", [("1x1", "auto"), ("1x2-ep", "alltoall")])
def test_negative_control_prefix_keys_without_the_weights_version(long_context, layout, method, monkeypatch):
    """With the version left out of the prefix cache's keys, an update while awake leaves the old
    weights' blocks matchable: the repeated prompts are served stale K/V, without an error."""
    monkeypatch.setenv("MOESHARD_UNSAFE_PREFIX_KEY_NO_VERSION", "1")
    dp = int(layout.split("-")[0].split("x")[1])
    with LLM(long_context[0][0], data_parallel_size=dp, enable_expert_parallel=dp > 1, moe_comm=method,
             dtype="float32", **MIXED_ENGINE) as llm:
        assert mixed_cycles(llm, long_context)[4:] != [True, True]  # the runs after an update while awake
