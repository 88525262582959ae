"""Weights load into the parameters the model was built with: an update or a reload builds no module,
registers nothing, costs at most one tensor's memory, and writes every element (padding as zeros)."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeshard import LLM, SamplingParams
from moeshard.bundled.arithmetic import MODEL_DIR, held_out
from moeshard.models import kv_cache
from moeshard.models.checkpoint import Checkpoint, TensorDict
from moeshard.models.loader import load_weights
from moeshard.models.model import DecoderLayer, load_model, part_of
from moeshard.moe.layer import MoELayer
from moeshard.parallel import Layout, set_layout
from moeshard.runtime import derived, memory
from moeshard.verify.tiny import VARIANTS, make_tiny_checkpoint

PROMPTS = [p.prompt for p in held_out(16)]
GREEDY = SamplingParams(temperature=0)


def texts(llm):
    return [o.text for o in llm.generate(PROMPTS, GREEDY)]


def perturbed(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: (w.float() * (1 + 0.25 * torch.randn(w.shape, generator=g))).to(w.dtype) for n, w in weights.items()}


def saved(weights: dict[str, torch.Tensor], like, directory):
    directory.mkdir()
    for f in like.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, directory / f.name)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return str(directory)


@pytest.fixture
def constructions(monkeypatch):
    """How many MoE layers, decoder layers, derived tensors and attention layers are created."""
    counts = dict.fromkeys(["MoELayer", "DecoderLayer", "derived", "attention"], 0)

    def counting(key, fn):
        def wrapper(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(MoELayer, "__init__", counting("MoELayer", MoELayer.__init__))
    monkeypatch.setattr(DecoderLayer, "__init__", counting("DecoderLayer", DecoderLayer.__init__))
    monkeypatch.setattr(derived, "register", counting("derived", derived.register))
    monkeypatch.setattr(kv_cache, "register", counting("attention", kv_cache.register))
    return counts


def test_update_and_reload_build_nothing_and_equal_a_fresh_engine(tmp_path, constructions):
    weights = perturbed(load_file(MODEL_DIR / "model.safetensors"), seed=0)
    with LLM(saved(weights, MODEL_DIR, tmp_path / "update")) as fresh:
        expected = texts(fresh)
    with LLM() as llm:
        reference = texts(llm)
        assert expected != reference  # the update changes answers, so one not applied cannot pass
        model = llm.ranks.host.worker.model
        params = {name: (p, p.data_ptr()) for name, p in model.named_parameters()}
        for key in constructions:
            constructions[key] = 0
        llm.update_weights(weights.items())
        assert constructions == dict.fromkeys(constructions, 0)
        assert texts(llm) == expected
        llm.reload_weights()
        assert constructions == dict.fromkeys(constructions, 0)
        assert texts(llm) == reference
        # The same parameter objects, in the same storage: written in place.
        assert {name: (p, p.data_ptr()) for name, p in model.named_parameters()} == params


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def test_update_peak_memory_is_at_most_one_tensor(tmp_path):
    from moeshard.bench.e2e import larger_model

    directory = larger_model(str(tmp_path / "larger"))
    weights = perturbed(load_file(f"{directory}/model.safetensors"), seed=1)
    largest = max(t.numel() * t.element_size() for t in weights.values())
    with LLM(directory, max_num_seqs=2) as llm:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak (VmHWM) to the current resident size
        before = status_kib("VmRSS")
        llm.update_weights(weights.items())
        extra = (status_kib("VmHWM") - before) * 1024
    print(f"update peak extra memory {extra / 2**20:.2f} MiB; largest tensor {largest / 2**20:.2f} MiB")
    assert extra <= largest + 16 * 2**20, (extra, largest)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("loading")
    return {v: str(make_tiny_checkpoint(v, root / v, seed=i)) for i, v in enumerate(VARIANTS)}


def poisoned_reload(directory: str, layout: Layout, source: str) -> bool:
    """On one rank: garbage in every parameter, then a load (from the checkpoint, or from its
    tensors in memory, part by part as an update comes) must give back the start-up weights."""
    set_layout(layout)
    model = load_model(directory)
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        memory.fill_poison(p)
    if source == "checkpoint":
        load_weights(model, Checkpoint(directory))
    else:
        tensors = load_file(f"{directory}/model.safetensors")
        for part in model.parts():
            model.load_part(TensorDict({n: t for n, t in tensors.items() if part_of(n) == part}), part)
    return all(torch.equal(p, start[name]) for name, p in model.named_parameters())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_load_writes_every_element(tiny, variant):
    assert poisoned_reload(tiny[variant], Layout(), "checkpoint")
    assert poisoned_reload(tiny[variant], Layout(), "update")


@pytest.mark.parametrize("layout", ["2x1", "1x2-ep"])
@pytest.mark.parametrize("variant", ["qwen3_moe", "qwen2_moe", "deepseek_v3"])
def test_a_load_writes_every_element_of_every_shard(tiny, ranks2, variant, layout):
    """TP=2 pads the 101-row vocabulary to 2 × 51 rows: the padding row must come back as zeros."""
    assert ranks2.run(poisoned_reload, tiny[variant], Layout.parse(layout), "update") == [True, True]
