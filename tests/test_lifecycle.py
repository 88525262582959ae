"""Sleep, wake and reload with poisoned memory: outputs equal a fresh engine's; with the derived-tensor
rebuild off they do not (the second seed's bug class); released memory is really released."""

import pytest
import torch

from moeshard import LLM, SamplingParams
from moeshard.bundled.arithmetic import held_out

PROMPTS = [p.prompt for p in held_out(48)]
GREEDY = SamplingParams(temperature=0)
CYCLES = 5


@pytest.fixture(scope="module")
def reference():
    with LLM() as llm:
        return [o.text for o in llm.generate(PROMPTS, GREEDY)]


def texts(llm):
    # 48 prompts, 16 in flight: new prefills join running decodes in the same steps.
    return [o.text for o in llm.generate(PROMPTS, GREEDY, max_concurrency=16)]


@pytest.mark.parametrize("compile", [False, "aot_eager"])
@pytest.mark.parametrize("method", ["allgather", "alltoall", "mc2", "fused_mc2"])
@pytest.mark.parametrize("tp", [1, 2])
def test_sleep_wake_reload_equal_a_fresh_engine(reference, tp, method, compile):
    with LLM(tensor_parallel_size=tp, data_parallel_size=2, enable_expert_parallel=True, moe_comm=method,
             compile=compile) as llm:
        assert texts(llm) == reference
        for _ in range(CYCLES):
            llm.sleep(level=1)
            llm.wake_up(poison=True)
            assert texts(llm) == reference
        for _ in range(2):
            llm.sleep(level=2)
            llm.wake_up(["weights"], poison=True)
            llm.reload_weights()
            llm.wake_up(["kv_cache"], poison=True)
            assert texts(llm) == reference


def test_negative_control_without_the_derived_rebuild(reference, monkeypatch):
    """Poisoned expert maps and RoPE tables left as the wake made them: the engine must not
    produce the reference (it fails loudly on garbage indices, or answers differently)."""
    monkeypatch.setenv("MOESHARD_UNSAFE_SKIP_DERIVED_REBUILD", "1")
    with LLM(data_parallel_size=2, enable_expert_parallel=True, moe_comm="alltoall") as llm:
        assert texts(llm) == reference
        llm.sleep(level=1)
        llm.wake_up(poison=True)
        try:
            outputs = texts(llm)
        except RuntimeError:
            return
        assert outputs != reference


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
    from moeshard.engine import worker

    with LLM(larger_model(str(tmp_path / "larger")), max_num_seqs=2) as llm:
        weight_mb = sum(t.numel() * t.element_size() for t in worker.weights()) / 2**20  # one rank: in-process
        awake = llm.resident_mb()[0]
        asleep = llm.sleep(level=2)[0]
        assert awake - asleep >= 0.9 * weight_mb, (awake, asleep, weight_mb)
        assert llm.wake_up(poison=True)[0] - asleep >= 0.9 * weight_mb
        llm.reload_weights()
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
        assert len(out.token_ids) == 4
