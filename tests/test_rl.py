"""`moeshard rl`: the GRPO loop's pieces, a few real steps, and its negative control."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeshard import LLM, SamplingParams
from moeshard.bundled.arithmetic import VOCAB
from moeshard.demos.asynchronous import AsyncOptions, Versions, run_async, token_versions, version_tensors
from moeshard.demos.common import WEAK_MODEL_DIR, LogprobGapError, RLOptions
from moeshard.demos.disaggregated import run_disaggregated, version_number
from moeshard.demos.grpo import (GRPOConfig, Rollout, Trainer, clipped_loss, group_advantages, logprob_gap, sampled_logprobs,
                                 tis_weights)
from moeshard.demos.rl import run_rl
from moeshard.parallel import Layout
from test_inflight_updates import GREEDY, PROMPTS

FEW = dict(steps=3, problems=4, group=4, eval_every=2, eval_problems=16)


def test_group_advantages_centre_each_group_and_zero_a_uniform_one():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]))
    assert adv[:4].sum().abs() < 1e-5 and adv[0] > 0 > adv[1]
    assert torch.equal(adv[4:], torch.zeros(4))


def test_clipped_loss_is_the_policy_gradient_on_policy_and_clips_off_it():
    logprobs = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    mask = torch.tensor([[False, True, True]])
    adv = torch.tensor([2.0])
    clipped_loss(logprobs, logprobs.detach(), adv, mask, clip=0.2).backward()
    assert torch.allclose(logprobs.grad, torch.tensor([[0.0, -1.0, -1.0]]))  # −A / tokens on sampled positions
    far = torch.tensor([[0.0, -0.5, -2.0]], requires_grad=True)  # token 1 already 1.65× likelier than sampled
    clipped_loss(far, logprobs.detach(), adv, mask, clip=0.2).backward()
    assert far.grad[0, 1] == 0 and far.grad[0, 2] != 0


def test_truncated_importance_weights_scale_each_token_and_cap_at_c():
    trainer_NS = torch.tensor([[0.0, -1.0, -1.0, -3.0]])
    engine_NS = torch.tensor([[0.0, -1.5, -0.5, -0.5]])  # ratios e^0.5, e^-0.5, e^-2.5 on the sampled
    mask_NS = torch.tensor([[False, True, True, True]])
    weights_NS, report = tis_weights(trainer_NS, engine_NS, mask_NS, cap=1.5)
    assert torch.allclose(weights_NS, torch.tensor([[0.0, 1.5, math.exp(-0.5), math.exp(-2.5)]]))
    assert report["tis_truncated_share"] == pytest.approx(1 / 3)
    logprobs = trainer_NS.clone().requires_grad_()
    clipped_loss(logprobs, trainer_NS, torch.tensor([3.0]), mask_NS, clip=0.2, weights_NS=weights_NS).backward()
    assert torch.allclose(logprobs.grad, -weights_NS)  # the on-policy gradient −A / tokens, token by token


def test_logprob_gap_counts_nan_as_infinite():
    mask = torch.tensor([[True, True]])
    gap = logprob_gap(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, math.nan]]), mask)
    assert gap["max_abs_dlogprob"] == math.inf
    gap = logprob_gap(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -2.0]]), mask)
    assert gap["max_abs_dlogprob"] == pytest.approx(0.5) and gap["mean_abs_dlogprob"] == pytest.approx(0.25)


def test_the_trainer_leaves_out_groups_that_teach_nothing():
    trainer = Trainer(str(WEAK_MODEL_DIR), GRPOConfig(), seed=0)
    texts = ["123+456=975<eos>", "123+456=875<eos>", "500-001=994<eos>", "500-001=994<eos>"]
    tokens_NS = torch.tensor([[VOCAB.index(c) for c in t.replace("<eos>", "")] + [VOCAB.index("<eos>")] for t in texts])
    completion_NS = torch.zeros_like(tokens_NS, dtype=torch.bool)
    completion_NS[:, 8:] = True
    with torch.no_grad():
        engine_NS = sampled_logprobs(trainer.model, tokens_NS) * completion_NS
    before = [p.clone() for p in trainer.model.parameters()]
    report = trainer.step(Rollout(tokens_NS, completion_NS, engine_NS, torch.zeros(4)))
    assert report["trained"] and report["taught"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    report = trainer.step(Rollout(tokens_NS, completion_NS, engine_NS, torch.tensor([1.0, -1.0, 0.0, 0.0])))
    assert report["trained"] and report["taught"] == 2
    assert not all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


@pytest.mark.long_pole
def test_a_few_steps_on_1x2_ep_alltoall_agree_with_the_trainer_and_repeat():
    """Engine and trainer agree to 1e-4 on every sampled token, at each step (so each update
    arrived whole and the wake rebuilt what it must); a fixed seed gives the same rewards again."""
    first = run_rl(RLOptions(**FEW))
    assert [r.step for r in first] == [0, 1, 2, 3]
    assert all(r.max_abs_dlogprob <= 1e-4 for r in first[1:])
    assert all(r.tis_mean is None and r.tis_truncated_share is None for r in first[1:])  # float32: no correction
    assert max(r.max_abs_dlogprob for r in first[1:]) > 0  # transformers' trainer is close, not bitwise
    assert [r.accuracy is not None for r in first] == [True, False, True, True]
    assert all(r.rss_engine_asleep_mb < r.rss_engine_awake_mb for r in first[1:])
    again = run_rl(RLOptions(**FEW))
    assert [r.reward_mean for r in again] == [r.reward_mean for r in first]
    assert [r.accuracy for r in again] == [r.accuracy for r in first]


def test_batch_invariant_loop_trains_on_the_engines_logprobs_bit_for_bit():
    """The trainer's logprobs come from the engine's own model code (EngineMirror, one rank) while
    the engine runs 1x2-ep: |Δ| is exactly 0 at every step, and any difference would stop the run
    (tolerance 0)."""
    records = run_rl(RLOptions(**FEW, grpo=GRPOConfig(batch_invariant=True, tolerance=0.0)))
    assert [r.step for r in records] == [0, 1, 2, 3]
    assert [r.max_abs_dlogprob for r in records[1:]] == [0.0, 0.0, 0.0]
    assert [r.max_ratio_deviation for r in records[1:]] == [0.0, 0.0, 0.0]


def test_disaggregated_loop_syncs_weights_to_a_server_every_step(tmp_path):
    """`moeshard serve --batch-invariant` 1x2-ep in processes of its own, rollouts over HTTP, weights
    over the group: every rollout answer names the version sent after the step before (the loop
    checks), the trainer's logprobs are the server's bit for bit (EngineMirror; tolerance 0), and
    routing replay compared every routed token with the trainer's own routers."""
    options = RLOptions(**FEW, grpo=GRPOConfig(batch_invariant=True, tolerance=0.0))
    records = run_disaggregated(options, replay=True, log_dir=tmp_path)
    assert [r.step for r in records] == [0, 1, 2, 3]
    assert [r.max_abs_dlogprob for r in records[1:]] == [0.0, 0.0, 0.0]
    assert all(r.update_s > 0 for r in records[1:])
    assert all(r.routing_disagreement is not None and r.routing_disagreement < 0.01 for r in records[1:])
    assert [r.accuracy is not None for r in records] == [True, False, True, True]


def test_async_loop_trains_on_stale_samples_within_the_bound_and_drops_the_rest(tmp_path):
    """Rollouts run ahead of the trainer (3 steps' worth of groups out, the trainer slower than the
    server): samples one version stale are trained on, each token's logprob checked against the
    trainer's under the version that sampled it; groups two versions stale are dropped; each
    weights sync pauses generation for that one update."""
    options = RLOptions(steps=4, problems=2, group=4, eval_every=4, eval_problems=16)
    records = run_async(options, AsyncOptions(max_staleness=1, capacity=6), tmp_path)
    steps = records[1:]
    assert [r.step for r in records] == [0, 1, 2, 3, 4] and records[-1].accuracy is not None
    assert all(sum(r.staleness) == 8 and len(r.staleness) <= 2 for r in steps)  # P × G, none over the bound
    assert sum(r.staleness[1] for r in steps if len(r.staleness) > 1) + sum(r.spanning for r in steps) > 0
    assert sum(r.dropped for r in steps) > 0
    gaps = [(r.step - 1 - version_number(v), gap) for r in steps for v, gap in r.version_gaps.items()]
    assert all(gap <= GRPOConfig.tolerance for _, gap in gaps) and max(behind for behind, _ in gaps) == 1
    assert all(0 < r.update_s <= r.pause_s for r in steps)


def test_token_versions_cover_a_choice_once_in_order():
    spans = [{"version": "default", "start": 0, "end": 2}, {"version": "step-3", "start": 2, "end": 5}]
    assert token_versions(spans, 5) == [0, 0, 3, 3, 3]
    for bad in (spans[:1], spans[::-1], [spans[0], {**spans[1], "start": 1}], [spans[1], {**spans[0], "start": 5, "end": 6}]):
        with pytest.raises(RuntimeError, match="do not cover"):
            token_versions(bad, 5 if bad[-1]["end"] == 5 else 6)


@pytest.mark.parametrize("bitwise", [False, True], ids=["fp32", "batch-invariant"])
@pytest.mark.parametrize("kv", ["keep", "recompute"])
def test_each_version_span_is_checked_under_the_weights_that_sampled_it(kv, bitwise):
    """Requests parked by pause(keep) after 3 of their 6 tokens while the weights change (a moved
    copy of the trainer's): every token's engine logprob is the trainer's under the version that
    sampled it (to 1e-4; in batch-invariant mode exactly) — with keep, over the K/V the old weights
    wrote before the switch (a plain forward under the new weights misses that: the negative
    control), with recompute, over K/V of the new weights throughout."""
    trainer = Trainer(str(WEAK_MODEL_DIR), GRPOConfig(batch_invariant=bitwise), seed=0)
    versions = Versions(trainer, kept=2)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn_like(p) * 0.005)
    versions.save(1)
    params = SamplingParams(**{**vars(GREEDY), "max_tokens": 6})
    with LLM(str(WEAK_MODEL_DIR), dtype="float32", block_size=4, kv_after_update=kv, batch_invariant=bitwise) as llm:
        prompts, core = [llm.encode(p) for p in PROMPTS], llm.core
        deltas = {core.add_request(ids, params): [] for ids in prompts}
        for step in range(params.max_tokens + 1):
            if step == 3:
                core.paused = "keep"
                llm.update_weights(list(trainer.checkpoint_weights().items()), "step-1")
                core.paused = None
            for delta in core.step():
                deltas[delta.request_id].append(delta)
    outputs = [[t for d in ds for t in d.token_ids] for ds in deltas.values()]
    assert all(len(out) == 6 for out in outputs)
    tokens_NS = torch.tensor([ids + out for ids, out in zip(prompts, outputs)])  # all one length
    samples = [(len(ids), token_versions(ds[-1].weight_versions, 6)) for ids, ds in zip(prompts, deltas.values())]
    assert all(v == [0, 0, 0, 1, 1, 1] for _, v in samples)
    sampled_NS, forward_NS = version_tensors(samples, tokens_NS.shape[1])
    engine_NS = torch.zeros(tokens_NS.shape)
    engine_NS[sampled_NS >= 0] = torch.tensor([lp[t] for ds in deltas.values() for d in ds for t, lp in zip(d.token_ids, d.logprobs)])
    as_sampled_NS = versions.as_sampled(tokens_NS, sampled_NS, forward_NS, kv)
    for version in (0, 1):
        assert logprob_gap(as_sampled_NS, engine_NS, sampled_NS == version)["max_abs_dlogprob"] <= (0.0 if bitwise else 1e-4)
    if kv == "keep":
        plain_NS = versions.as_sampled(tokens_NS, sampled_NS, forward_NS, "recompute")
        assert logprob_gap(plain_NS, engine_NS, sampled_NS == 1)["max_abs_dlogprob"] > 1e-3


QUANTIZED = dict(FEW, layout=Layout(1, 1), moe_comm="auto", quantization="int8")


def test_quantized_rollouts_learn_with_truncated_importance_weights_and_refuse_the_gap_without():
    """int8 rollouts sample from a policy other than the float32 trainer's: each step quotes the
    mismatch (far over the 1e-4 a float32 rollout may have) and trains on TIS-weighted tokens, whose
    mean weight is not 1. The negative control, the same run with no cap, stops at step 1 on the gap;
    a cap with float32 rollouts is refused (there the gap itself is the check)."""
    records = run_rl(RLOptions(**QUANTIZED, grpo=GRPOConfig(tis_cap=2.0)))
    assert [r.step for r in records] == [0, 1, 2, 3] and records[-1].accuracy is not None
    assert all(r.max_abs_dlogprob > 10 * GRPOConfig.tolerance and 0 < r.mean_abs_dlogprob < r.max_abs_dlogprob
               for r in records[1:])
    assert all(r.tis_mean is not None and r.tis_mean != 1.0 and 0 <= r.tis_truncated_share < 1 for r in records[1:])
    with pytest.raises(LogprobGapError, match="step 1: the engine's logprobs differ from the trainer's"):
        run_rl(RLOptions(**QUANTIZED))
    with pytest.raises(ValueError, match="with float32 rollouts any gap over the tolerance is refused"):
        RLOptions(**FEW, grpo=GRPOConfig(tis_cap=2.0))


def test_a_quantized_engine_quantizes_each_update_as_it_quantizes_at_load(tmp_path):
    """What the quantized loop's sync does: the trainer's float32 weights, sent to an int8 engine after
    a poisoned wake, give the logprobs (bitwise) of an int8 engine loaded from those weights."""
    g = torch.Generator().manual_seed(0)
    weights = {n: w * (1 + 0.05 * torch.randn(w.shape, generator=g)) for n, w in load_file(WEAK_MODEL_DIR / "model.safetensors").items()}
    for f in ("config.json", "tokenizer.json"):
        shutil.copy(WEAK_MODEL_DIR / f, tmp_path / f)
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})

    def logprobs(llm):
        return [o.logprobs for o in llm.generate(PROMPTS, GREEDY)]

    with LLM(str(tmp_path), quantization="int8") as fresh:
        expected = logprobs(fresh)
    with LLM(str(WEAK_MODEL_DIR), quantization="int8") as llm:
        before = logprobs(llm)
        llm.sleep(level=2)
        llm.wake_up(["weights"], poison=True)
        llm.update_weights(weights.items())
        llm.wake_up(["kv_cache"], poison=True)
        assert logprobs(llm) == expected != before


def test_negative_control_stops_at_the_first_step_after_a_wake(monkeypatch):
    """Derived tensors left as the poisoned wake made them (expert tables and RoPE with wrong but
    in-range values): the engine answers without an error, and only the logprob check catches it."""
    monkeypatch.setenv("MOESHARD_UNSAFE_SKIP_DERIVED_REBUILD", "1")
    seen = []
    with pytest.raises(LogprobGapError, match="step 2: the engine's logprobs differ from the trainer's"):
        run_rl(RLOptions(**FEW), on_step=seen.append)
    assert [r.step for r in seen] == [0, 1]


def test_rl_command_writes_json_and_plot(tmp_path):
    """Quantized (int8, so TIS with its default cap 2): the steps quote the mismatch."""
    out, png = tmp_path / "rl.json", tmp_path / "rl.png"
    proc = subprocess.run(
        [sys.executable, "-m", "moeshard", "rl", "--steps", "2", "--problems", "4", "--group", "2",
         "--eval-every", "2", "--eval-problems", "8", "--layout", "1x1", "--moe-comm", "auto", "--quantization", "int8",
         "--json", str(out), "--plot", str(png)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [r["step"] for r in rows] == [0, 1, 2]
    keys = {"step", "reward_mean", "accuracy", "max_abs_dlogprob", "mean_abs_dlogprob", "rollout_tok_s", "update_s",
            "rss_engine_awake_mb", "rss_engine_asleep_mb"}
    assert keys <= set(rows[1])
    assert all(r["tis_mean"] is not None and r["tis_truncated_share"] is not None for r in rows[1:])
    assert "mismatch corrected by truncated importance sampling (C = 2)" in proc.stdout
    assert rows[1]["accuracy"] is None and rows[2]["accuracy"] is not None
    assert png.stat().st_size > 10_000
    assert "held-out accuracy" in proc.stdout
