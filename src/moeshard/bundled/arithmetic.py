"""The bundled model's task: integer addition and subtraction, operands 0–999, one character per token.

    prompt "123+456="  →  answer "975"  (579);   prompt "012-346="  →  answer "-433"  (-334)

Operands are written with three digits (zero-padded), so digit i of each operand sits at the same
place in every prompt. The answer is the sign (if negative), then the digits least significant
first: each digit then depends only on the aligned operand digits and the carry or borrow of the
digit before it, which a small model learns in minutes (in the usual order, the first digit already
needs every carry). `Problem.value_of` reads an answer back.

Held-out problems come from their own seed and are never trained on (the training script skips
them), so the eval measures generalisation, not recall.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

PAD, EOS = "<pad>", "<eos>"
VOCAB = [PAD, EOS, *"0123456789+-="]
MAX_OPERAND = 999
ANSWER_TOKENS = 6  # room for the longest answers ("8991", "-999") and <eos>
HELD_OUT_SEED = 20261202
HELD_OUT = 2000  # problems the training script never trains on
MODEL_DIR = Path(__file__).parent / "arithmetic_moe"


@dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a:03d}{self.op}{self.b:03d}="

    @property
    def value(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b

    @property
    def answer(self) -> str:
        return self.write(self.value)

    @property
    def uncarried_value(self) -> int:
        """The answer of a pupil who never carries or borrows: each digit on its own (the last column
        in full), so 195+005 → 190 (not 200), 404-006 → 408 (not 398), 999+999 → 1888."""
        big, small = max(self.a, self.b), min(self.a, self.b)
        sign = 1 if self.op == "+" else -1
        digits = [(big // 10**i % 10 + sign * (small // 10**i % 10)) % 10 for i in (0, 1)]
        last = big // 100 + sign * (small // 100)
        magnitude = digits[0] + 10 * digits[1] + 100 * last
        return -magnitude if self.op == "-" and self.a < self.b else magnitude

    @staticmethod
    def write(value: int) -> str:
        """The answer that stands for a value: -334 → "-433"."""
        return ("-" if value < 0 else "") + str(abs(value))[::-1]

    @staticmethod
    def value_of(answer: str) -> int:
        """The integer an answer stands for: "-433" → -334."""
        sign = -1 if answer.startswith("-") else 1
        return sign * int(answer.lstrip("-")[::-1])


def random_problem(rng: random.Random) -> Problem:
    return Problem(rng.randint(0, MAX_OPERAND), rng.choice("+-"), rng.randint(0, MAX_OPERAND))


def exact_matches(texts: list[str], problems: list[Problem]) -> int:
    """How many of the texts are their problem's answer, exactly."""
    return sum(text == p.answer for text, p in zip(texts, problems, strict=True))


def held_out(n: int = 500) -> list[Problem]:
    rng = random.Random(HELD_OUT_SEED)
    seen: dict[Problem, None] = {}
    while len(seen) < n:
        seen[random_problem(rng)] = None
    return list(seen)


# The model knows no chat format: a chat's prompt is its last user message.
CHAT_TEMPLATE = "{%- for m in messages if m['role'] == 'user' %}{%- if loop.last %}{{ m['content'] }}{%- endif %}{%- endfor %}"


def tokenizer_config() -> dict:
    """tokenizer_config.json: the special tokens and the chat template."""
    return {"pad_token": PAD, "eos_token": EOS, "chat_template": CHAT_TEMPLATE}


def make_tokenizer():
    """A character-level Hugging Face tokenizer (tokenizer.json): every character is one token."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({c: i for i, c in enumerate(VOCAB)}, unk_token=PAD))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([PAD, EOS])
    return tokenizer
