"""The trainer half of `moeshard rl`: GRPO on the engine's rollouts, in a process of its own.

The trainer holds the policy as a transformers model in float32 with a torch optimizer. Each step
it receives a rollout (the sampled sequences, the engine's logprob of every sampled token and each
sequence's advantage), recomputes the logprobs of the same tokens with the weights the engine
sampled from, and compares the two: that gap is the number RL users watch (verl logs it as
rollout-vs-actor probability difference), because any gap biases the policy gradient. Over the
tolerance it refuses to train. Otherwise it takes clipped policy-gradient steps and sends the new
weights back under the checkpoint's own names.

Everything crosses the pipe as bytes: reports as JSON, tensors as safetensors (no pickle, so
neither side runs code the other sends). Shapes: N sequences, S positions (prompt, then
completion, right-padded), P problems, G completions per problem.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import load, save

from moeshard.runtime import memory

END = b"END"  # closes one update


@dataclass(frozen=True)
class GRPOConfig:
    lr: float = 1e-4
    warmup: int = 20  # optimizer steps of linear warm-up: Adam's first steps move every weight by ~lr
    clip: float = 0.2  # PPO's ε: the ratio to the rollout policy is clipped to [1 − ε, 1 + ε]
    minibatches: int = 2  # optimizer steps per rollout; after the first the policy is off the rollout's
    max_grad_norm: float = 1.0
    tolerance: float = 1e-4  # largest |Δ logprob| between engine and trainer it trains on
    # Truncated importance sampling (token level, as verl's rollout correction): where the engine's
    # policy is not the trainer's on purpose (quantized rollouts), each sampled token's loss is
    # weighted by min(π_trainer / π_engine, tis_cap) instead of refusing the gap; None: refuse it.
    tis_cap: float | None = None
    batch_invariant: bool = False  # the logprobs trained on are the engine's own computation (EngineMirror)

    def __post_init__(self):
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(f"tis_cap must be a positive number (the largest importance weight), got {self.tis_cap!r}.")


TIS_CAP = 2.0  # the cap C of the truncated importance weights where rollouts are quantized: verl's


@dataclass(frozen=True)
class Rollout:
    tokens_NS: torch.Tensor  # int64, prompt then completion, right-padded
    completion_NS: torch.Tensor  # bool: the positions the engine sampled
    engine_logprobs_NS: torch.Tensor  # float32: the engine's logprob of each sampled token (0 elsewhere)
    advantages_N: torch.Tensor  # float32, one per sequence

    def to_bytes(self) -> bytes:
        return save({k: v.contiguous() for k, v in vars(self).items()})

    @classmethod
    def from_bytes(cls, data: bytes) -> "Rollout":
        return cls(**load(data))


def group_advantages(rewards_PG: torch.Tensor) -> torch.Tensor:
    """GRPO's advantage: each completion's reward against its own group's mean, in the group's
    standard deviations. A group whose completions all scored the same teaches nothing: 0."""
    mean_P1 = rewards_PG.mean(1, keepdim=True)
    std_P1 = rewards_PG.std(1, keepdim=True, unbiased=False)
    return ((rewards_PG - mean_P1) / (std_P1 + 1e-6)).flatten()


def sampled_logprobs(model, tokens_NS: torch.Tensor) -> torch.Tensor:
    """Logprob of every token given the ones before it (position 0, which has none: 0)."""
    logits_NSV = model(input_ids=tokens_NS).logits.float()
    logprobs_NS = logits_NSV[:, :-1].log_softmax(-1).gather(-1, tokens_NS[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(logprobs_NS, (1, 0))


class EngineMirror:
    """The policy as the engine computes it, for bitwise on-policy training (docs/DESIGN.md §11).

    The engine's own model code (moeshard.models) on one rank in batch-invariant mode: each row's
    logits come from the same kernels in the same order as in the engine, whatever the engine's
    layout (1x1 and DP × EP agree bit for bit, `moeshard verify invariance`), whatever the rollout's
    batching. Its kernels have no backward, so the trainer trains on
    `transformers' logprobs + (mirror's − transformers').detach()`: the mirror's values, exactly the
    engine's, and transformers' gradient of the same function (the two differ by rounding).
    """

    def __init__(self, model_dir: str, block_size: int = 16, max_rows: int = 4096):
        from moeshard.models.model import load_model
        from moeshard.models.runner import ModelRunner
        from moeshard.parallel import Layout, set_layout
        from moeshard.runtime import invariance

        set_layout(Layout())
        invariance.set_batch_invariant(True)
        self.block_size = block_size
        self.runner = ModelRunner(load_model(model_dir, torch.float32), -(-max_rows // block_size), block_size)

    @torch.no_grad()
    def sampled_logprobs(self, tokens_NS: torch.Tensor, lengths_N: torch.Tensor, segments=None,
                         load=lambda version: None) -> torch.Tensor:
        """As `sampled_logprobs`, from the engine's computation: sequences in batches of up to
        `max_rows` tokens, each its own blocks, every position's logits. `segments`: runs of
        positions [(version, start, end)] computed in turn, each under the weights `load(version)`
        puts in place, over the K/V the runs before it wrote (default: one run, the weights held)."""
        from moeshard.models.runner import Chunk

        segments = segments or [(None, 0, tokens_NS.shape[1])]
        out_NS = torch.zeros(tokens_NS.shape, dtype=torch.float32)
        blocks_total, batch, next_block = self.runner.num_blocks, [], 0

        def run() -> None:
            logits: dict[int, list[torch.Tensor]] = {i: [] for i, _, _ in batch}
            for version, start, end in segments:
                load(version)
                chunks = [(i, Chunk(tokens_NS[i, start:min(end, n)].tolist(), start, blocks)) for i, n, blocks in batch if start < n]
                for (i, _), logits_SV in zip(chunks, self.runner.run_chunks([c for _, c in chunks], all_logits=True)):
                    logits[i].append(logits_SV)
            for i, n, _ in batch:
                lp_S = torch.cat(logits[i])[:-1].log_softmax(-1).gather(-1, tokens_NS[i, 1:n, None]).squeeze(-1)
                out_NS[i, 1:n] = lp_S
            batch.clear()

        for i, n in enumerate(lengths_N.tolist()):
            blocks = -(-n // self.block_size)
            if next_block + blocks > blocks_total:
                run()
                next_block = 0
            batch.append((i, n, list(range(next_block, next_block + blocks))))
            next_block += blocks
        if batch:
            run()
        return out_NS

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        """The trainer's new weights (checkpoint names), and the tensors derived from them."""
        from moeshard.models.checkpoint import TensorDict
        from moeshard.runtime import derived

        model = self.runner.model
        for part in model.parts():
            model.load_part(TensorDict(weights), part)
        derived.rebuild(model.derived_owners())


def sampled_lengths(sampled_NS: torch.Tensor) -> torch.Tensor:
    """Each row's length through its last sampled position (`sampled_NS`: bool)."""
    return sampled_NS.cumsum(1).argmax(1) + 1


def clipped_loss(logprobs_NS, old_NS, advantages_N, mask_NS, clip: float, weights_NS=None) -> torch.Tensor:
    """PPO's clipped surrogate, averaged over the sampled tokens (every token counts the same, so a
    long completion is not worth less per token than a short one); each token's term times
    `weights_NS` where given (truncated importance weights, `tis_weights`)."""
    ratio_NS = (logprobs_NS - old_NS).exp()
    adv_N1 = advantages_N[:, None]
    surrogate_NS = torch.minimum(ratio_NS * adv_N1, ratio_NS.clamp(1 - clip, 1 + clip) * adv_N1)
    if weights_NS is not None:
        surrogate_NS = surrogate_NS * weights_NS
    return -(surrogate_NS * mask_NS).sum() / mask_NS.sum().clamp(min=1)


def tis_weights(trainer_NS: torch.Tensor, engine_NS: torch.Tensor, mask_NS: torch.Tensor, cap: float):
    """Token-level truncated importance weights min(π_trainer / π_engine, cap) on the sampled tokens
    (0 elsewhere), and what the run reports of them: their mean and the share truncated."""
    ratio_NS = (trainer_NS - engine_NS).exp().masked_fill(~mask_NS, 0)
    weights_NS = ratio_NS.clamp(max=cap)
    sampled = ratio_NS[mask_NS]
    return weights_NS, {
        "tis_mean": float(weights_NS[mask_NS].mean()) if sampled.numel() else 1.0,
        "tis_truncated_share": float((sampled > cap).float().mean()) if sampled.numel() else 0.0,
    }


def logprob_gap(trainer_NS: torch.Tensor, engine_NS: torch.Tensor, mask_NS: torch.Tensor) -> dict[str, float]:
    """How far the engine's logprobs are from the trainer's on the sampled tokens (NaN counts as ∞)."""
    gap = (trainer_NS - engine_NS).abs().nan_to_num(nan=math.inf)[mask_NS]
    ratio_deviation = ((trainer_NS - engine_NS).exp() - 1).abs().nan_to_num(nan=math.inf)[mask_NS]
    return {
        "max_abs_dlogprob": float(gap.max()) if gap.numel() else 0.0,
        "mean_abs_dlogprob": float(gap.mean()) if gap.numel() else 0.0,
        "max_ratio_deviation": float(ratio_deviation.max()) if ratio_deviation.numel() else 0.0,
    }


class Trainer:
    def __init__(self, model_dir: str, config: GRPOConfig, seed: int):
        import transformers

        transformers.utils.logging.disable_progress_bar()  # the engine's console is the one the user reads
        torch.manual_seed(seed)
        self.config, self.model_dir = config, model_dir
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()  # no dropout: the logprobs must be the engine's
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, betas=(0.9, 0.98), weight_decay=0.0)
        self.updates = 0
        with safe_open(f"{model_dir}/model.safetensors", "pt") as f:
            self.names = set(f.keys())
        self.mirror = EngineMirror(model_dir) if config.batch_invariant else None

    def logprobs(self, rollout: Rollout, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The sampled tokens' logprobs under the current weights, with autograd; with the mirror,
        their values are the engine's (see EngineMirror)."""
        rows = slice(None) if rows is None else rows
        tokens_NS = rollout.tokens_NS[rows]
        logprobs_NS = sampled_logprobs(self.model, tokens_NS)
        if self.mirror is None:
            return logprobs_NS
        exact_NS = self.mirror.sampled_logprobs(tokens_NS, sampled_lengths(rollout.completion_NS[rows]))
        return logprobs_NS + (exact_NS - logprobs_NS).detach()

    def step(self, rollout: Rollout) -> dict:
        """Check the gap on the rollout, then (if within tolerance) train on it."""
        with torch.no_grad():
            old_NS = self.logprobs(rollout)
        report = logprob_gap(old_NS, rollout.engine_logprobs_NS, rollout.completion_NS)
        weights_NS, cap = None, self.config.tis_cap
        if cap is None:
            report["trained"] = report["max_abs_dlogprob"] <= self.config.tolerance
        else:  # a known gap, corrected by the weights; a non-finite one is still refused
            report["trained"] = math.isfinite(report["max_abs_dlogprob"])
            weights_NS, tis = tis_weights(old_NS, rollout.engine_logprobs_NS, rollout.completion_NS, cap)
            report.update(tis)
        if report["trained"]:
            report.update(self.train(rollout, old_NS, weights_NS))
        return report

    def train(self, rollout: Rollout, old_NS: torch.Tensor, weights_NS: torch.Tensor | None = None) -> dict:
        """Clipped policy-gradient steps on `rollout`, the ratio taken to `old_NS`: the trainer's
        logprobs of the policy that sampled it (with `weights_NS`, its tokens' importance weights)."""
        mask_NS = rollout.completion_NS
        losses, awake = [], memory.resident_mb()
        # A group whose completions all scored the same has advantage 0 and no gradient: its rows
        # are left out (as DAPO does), so they cost no compute and do not dilute the token average.
        taught = rollout.advantages_N.nonzero().squeeze(1)
        for rows in taught.chunk(self.config.minibatches) if len(taught) else ():
            logprobs_NS = self.logprobs(rollout, rows)
            weights = None if weights_NS is None else weights_NS[rows]
            loss = clipped_loss(logprobs_NS, old_NS[rows], rollout.advantages_N[rows], mask_NS[rows], self.config.clip,
                                weights)
            self.updates += 1
            for group in self.optimizer.param_groups:
                group["lr"] = self.config.lr * min(1.0, self.updates / self.config.warmup)
            self.optimizer.zero_grad(set_to_none=False)
            loss.backward()
            awake = max(awake, memory.resident_mb())
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
            self.optimizer.step()
            if self.mirror is not None:
                self.mirror.load(self.checkpoint_weights())
            losses.append(loss.item())
        # While the engine runs, the trainer keeps only the weights and the optimizer's moments.
        self.optimizer.zero_grad(set_to_none=True)
        memory.return_memory_to_os()
        return dict(loss=sum(losses) / max(1, len(losses)), taught=len(taught), rss_trainer_awake_mb=awake,
                    rss_trainer_asleep_mb=memory.resident_mb())

    def checkpoint_weights(self) -> dict[str, torch.Tensor]:
        """The weights under the checkpoint's names (transformers' own save-time conversion: per-expert
        tensors, no tied LM head), exactly the set the engine's update schema expects."""
        from transformers.core_model_loading import revert_weight_conversion

        state = revert_weight_conversion(self.model, dict(self.model.state_dict()))
        weights = {n: t.detach().contiguous() for n, t in state.items() if n in self.names}
        if set(weights) != self.names:
            missing = sorted(self.names - set(weights))
            raise RuntimeError(f"the trainer's weights lack checkpoint tensor(s) {missing[:3]}; cannot update the engine.")
        return weights


def send_weights(conn, weights: dict[str, torch.Tensor], part_of) -> None:
    """One safetensors message per model part (a layer, the embedding, …), then END."""
    parts: dict[object, dict[str, torch.Tensor]] = {}
    for name, tensor in weights.items():
        parts.setdefault(part_of(name), {})[name] = tensor
    for part in parts.values():
        conn.send_bytes(save(part))
    conn.send_bytes(END)


def receive_weights(conn):
    """The update stream, (name, tensor) pairs, until END."""
    while (message := conn.recv_bytes()) != END:
        yield from load(message).items()


def serve_trainer(conn, model_dir: str, config: dict, seed: int) -> None:
    """The trainer process: {"cmd": "step"} + a rollout → a report (+ the new weights when it trained)."""
    from moeshard.models.model import part_of

    torch.set_num_threads(2)
    try:
        trainer = Trainer(model_dir, GRPOConfig(**config), seed)
        conn.send_bytes(json.dumps({"ready": True, "rss_mb": memory.resident_mb()}).encode())
        while json.loads(conn.recv_bytes())["cmd"] == "step":
            report = trainer.step(Rollout.from_bytes(conn.recv_bytes()))
            conn.send_bytes(json.dumps(report).encode())
            if report["trained"]:
                send_weights(conn, trainer.checkpoint_weights(), part_of)
    except (EOFError, BrokenPipeError):
        pass  # the engine side went away; nothing to report to
    except Exception as exc:
        conn.send_bytes(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
    finally:
        conn.close()
