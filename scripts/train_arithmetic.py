"""Train the bundled model: a tiny Qwen2-MoE (shared expert, 4 routed experts, top-2) on integer
addition and subtraction, with transformers on the CPU.

    .venv/bin/python scripts/train_arithmetic.py [--minutes 18] [--out src/moeshard/bundled/arithmetic_moe]
    .venv/bin/python scripts/train_arithmetic.py --steps 6000 --dtype float32 --uncarried 0.6 --out src/moeshard/bundled/arithmetic_moe_weak

Loss is on the answer and <eos> only. Every few hundred steps the held-out accuracy (greedy, exact
match, problems never trained on) is printed; the checkpoint is written with the tokenizer (bf16 by
default). `--steps` trains a fixed number of steps instead of a time budget (the learning-rate
schedule then follows the step count); `--stop-at-accuracy A` ends a run early, at the first check
(every 25 steps) where held-out accuracy reaches A.

`moeshard rl` starts from the second command's checkpoint (27 min on 2 cores): an imperfect
teacher, a pupil who never carries or borrows (`Problem.uncarried_value`), writes 60% of the
answers. The model learns both ways of answering — greedy, it answers every problem with a carry
out of the units or tens column the pupil's way (held-out accuracy 0.290), while at temperature 1
it writes the right answer about 2 times in 5 — so exact-match reward has something to find. It is
kept in float32 so that the trainer's weights and the engine's are the same numbers.

An undertrained start lifts far more slowly: `--steps 6000 --stop-at-accuracy 0.4 --dtype float32`
(the correct teacher, stopped at step 3,500 at 0.490; its greedy errors are in the units digit,
which for subtraction it has not learned at all) went to 0.658 in 13 min of `moeshard rl --model`, and
supervised training from it (this script's loop continued at a constant lr of 1.1e-3, a throwaway
run) reaches 0.75 only after 300 steps of 256 labelled examples.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import transformers
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from moeshard.bundled.arithmetic import (
    ANSWER_TOKENS, EOS, HELD_OUT, MODEL_DIR, PAD, VOCAB, Problem, exact_matches, held_out, make_tokenizer,
    random_problem, tokenizer_config,
)

SEQ = 14  # longest "999+999=1998<eos>" is 13 tokens
ID = {c: i for i, c in enumerate(VOCAB)}


def config() -> transformers.Qwen2MoeConfig:
    return transformers.Qwen2MoeConfig(
        vocab_size=len(VOCAB),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        norm_topk_prob=True,
        max_position_embeddings=32,
        tie_word_embeddings=True,
        pad_token_id=ID[PAD],
        eos_token_id=ID[EOS],
        bos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        router_aux_loss_coef=0.01,
    )


def batch(rng: random.Random, size: int, excluded: set[str], uncarried: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`uncarried`: the fraction of examples whose answer is a pupil's who never carries."""
    ids = torch.full((size, SEQ), ID[PAD])
    labels = torch.full((size, SEQ), -100)
    for row in range(size):
        problem = random_problem(rng)
        while problem.prompt in excluded:
            problem = random_problem(rng)
        answer = Problem.write(problem.uncarried_value) if rng.random() < uncarried else problem.answer
        tokens = [ID[c] for c in problem.prompt + answer] + [ID[EOS]]
        ids[row, : len(tokens)] = torch.tensor(tokens)
        start = len(problem.prompt)  # transformers shifts labels by one itself
        labels[row, start : len(tokens)] = ids[row, start : len(tokens)]
    return ids, labels


@torch.no_grad()
def accuracy(model, problems) -> float:
    """Greedy, batched, exact match (a prompt's answer ends at <eos>)."""
    model.eval()
    texts = []
    for start in range(0, len(problems), 250):
        chunk = problems[start : start + 250]
        prompts = [[ID[c] for c in p.prompt] for p in chunk]
        width = max(map(len, prompts))
        # Left-pad so every prompt ends at the same column.
        ids = torch.tensor([[ID[PAD]] * (width - len(t)) + t for t in prompts])
        mask = (ids != ID[PAD]).long()
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=ANSWER_TOKENS, do_sample=False, pad_token_id=ID[PAD], eos_token_id=ID[EOS]
        )
        texts += ["".join(VOCAB[i] for i in row).split(EOS)[0].replace(PAD, "") for row in out[:, width:].tolist()]
    model.train()
    return exact_matches(texts, problems) / len(problems)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=18.0)
    parser.add_argument("--steps", type=int, default=None, help="train this many steps (instead of --minutes)")
    parser.add_argument("--stop-at-accuracy", type=float, default=None, help="stop once held-out accuracy reaches this")
    parser.add_argument(
        "--uncarried", type=float, default=0.0, help="fraction of answers taught without carries (an imperfect teacher)"
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(MODEL_DIR))
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    console = Console()
    model = transformers.AutoModelForCausalLM.from_config(config(), dtype=torch.float32)
    model.train()
    held = held_out(HELD_OUT)
    excluded = {p.prompt for p in held}
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    budget = args.minutes * 60 if args.steps is None else args.steps
    start, step = time.monotonic(), 0
    progress_of = (lambda: time.monotonic() - start) if args.steps is None else (lambda: step)
    with Progress(
        TextColumn("[bold]train[/]"),
        BarColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("", total=budget)
        while (elapsed := progress_of()) < budget:
            frac = elapsed / budget
            lr = args.lr * min(1.0, step / 200) * 0.5 * (1 + math.cos(math.pi * frac))
            for group in optimizer.param_groups:
                group["lr"] = lr
            ids, labels = batch(rng, args.batch, excluded, args.uncarried)
            loss = model(input_ids=ids, labels=labels, output_router_logits=True).loss  # + load balancing
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            if step % 500 == 0 or (args.stop_at_accuracy is not None and step % 25 == 0):
                acc = accuracy(model, held[:500])
                progress.console.print(f"step {step}: loss {loss.item():.4f}, held-out accuracy {acc:.3f}, lr {lr:.2e}")
                if args.stop_at_accuracy is not None and acc >= args.stop_at_accuracy:
                    break
            progress.update(task, completed=elapsed, description=f"step {step} loss {loss.item():.3f}")
    acc = accuracy(model, held[:500])
    console.print(f"final: {step} steps in {(time.monotonic() - start) / 60:.1f} min, held-out accuracy {acc:.3f}")
    model.to(getattr(torch, args.dtype)).save_pretrained(args.out)
    make_tokenizer().save(f"{args.out}/tokenizer.json")
    Path(args.out, "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=1) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
