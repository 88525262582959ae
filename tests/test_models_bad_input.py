"""Bad checkpoints and layouts: one line naming the cause, a non-zero exit, no traceback."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeshard.cli import main
from moeshard.verify.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return make_tiny_checkpoint("qwen2_moe", tmp_path_factory.mktemp("good") / "qwen2_moe")


def edited(good, tmp_path, edit_tensors=None, edit_config=None):
    model = tmp_path / "model"
    shutil.copytree(good, model)
    if edit_tensors is not None:
        tensors = load_file(model / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    if edit_config is not None:
        cfg = json.loads((model / "config.json").read_text())
        edit_config(cfg)
        (model / "config.json").write_text(json.dumps(cfg))
    return model


def error_of(capsys, *argv) -> str:
    assert main(["verify", "hf", *map(str, argv)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("moeshard: error: "), err
    return err


def truncate(model):
    path = model / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return model


EXPERT = "model.layers.2.mlp.experts.5.up_proj.weight"
CASES = {
    "unsupported architecture": (
        dict(edit_config=lambda c: c.update(architectures=["LlamaForCausalLM"])),
        [],
        "architecture 'LlamaForCausalLM' is not supported",
    ),
    "missing tensor": (dict(edit_tensors=lambda t: t.pop(EXPERT)), [], f"has no tensor '{EXPERT}'"),
    "wrong shape": (
        dict(edit_tensors=lambda t: t.update({EXPERT: torch.zeros(31, 64)})),
        [],
        f"tensor '{EXPERT}' has shape [31, 64], but the config implies [32, 64]",
    ),
    "extra tensor": (
        dict(edit_tensors=lambda t: t.update({"model.layers.0.mlp.bonus.weight": torch.zeros(2)})),
        [],
        "has tensor 'model.layers.0.mlp.bonus.weight', which the config does not use",
    ),
    "heads not divisible": ({}, ["--tp", "3"], "TP=3 does not divide the 4 attention heads"),
    "experts not divisible": (
        {},
        ["--dp", "3", "--ep", "--prompt-lengths", "3,4,5"],
        "8 experts cannot be split evenly",
    ),
    "method needs EP": ({}, ["--tp", "2", "--moe-comm", "mc2"], "MC2 needs expert parallelism"),
    "bad config value": (dict(edit_config=lambda c: c.update(num_experts_per_tok=9)), [], "top_k=9 must be between 1"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line(good, tmp_path, capsys, case):
    edits, extra_args, expected = CASES[case]
    model = edited(good, tmp_path, **edits)
    assert expected in error_of(capsys, "--model", model, *extra_args)


def test_truncated_file(good, tmp_path, capsys):
    err = error_of(capsys, "--model", truncate(edited(good, tmp_path)))
    assert "model.safetensors is not a readable safetensors file (truncated?)" in err


def test_not_a_model_directory(tmp_path, capsys):
    assert "has no config.json" in error_of(capsys, "--model", tmp_path)
    assert "does not exist" in error_of(capsys, "--model", tmp_path / "nowhere")


def test_command_line_error_and_success(good, tmp_path):
    """As users run it: a missing tensor on 2 ranks is one line on stderr; a good run writes JSON."""
    bad = edited(good, tmp_path, edit_tensors=lambda t: t.pop(EXPERT))
    run = [sys.executable, "-m", "moeshard", "verify", "hf", "--tp", "2", "--ep"]
    proc = subprocess.run([*run, "--model", str(bad)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert f"has no tensor '{EXPERT}'" in proc.stderr and "Traceback" not in proc.stderr
    out = tmp_path / "ok.json"
    proc = subprocess.run([*run, "--model", str(good), "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["passed"] and report["layout"] == "2x1-ep" and len(report["steps"]) == 9
    assert "PASS" in proc.stdout and "decode 8" in proc.stdout
