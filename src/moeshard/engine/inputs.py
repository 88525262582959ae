"""What a request is checked against before it reaches the engine: the model's tokenizer and the
engine's limits. The LLM holds one; so does an API server whose engine runs in another process
(moeshard.engine.engine_process), which checks and tokenizes without loading a weight."""

from __future__ import annotations

import json
from pathlib import Path

from moeshard.engine.sampling import SamplingParams
from moeshard.models.model import load_config


class RequestError(ValueError):
    """A request refused for its input; `param` names the field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def read_eos(directory: Path) -> set[int]:
    eos = json.loads((directory / "config.json").read_text()).get("eos_token_id")
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


class Inputs:
    def __init__(
        self, directory: Path, max_model_len: int | None, max_num_seqs: int, num_kv_blocks: int | None, block_size: int
    ):
        self.directory = directory
        self.config = cfg = load_config(directory)[0]
        self.max_model_len = min(max_model_len or cfg.max_positions, cfg.max_positions)
        self.vocab_size = cfg.vocab_size
        self.block_size = block_size
        self.num_blocks = num_kv_blocks or -(-max_num_seqs * self.max_model_len // block_size)
        self.eos = read_eos(directory)
        self.tokenizer = self.load_tokenizer()
        # The longest token's text in bytes (a byte-level token's stand-in characters count as the
        # longer of the two): an upper bound on the bytes one token covers.
        vocab = self.tokenizer.get_vocab(with_added_tokens=True) if self.tokenizer is not None else {}
        self.max_token_bytes = max((len(token.encode()) for token in vocab), default=1)

    def load_tokenizer(self):
        path = self.directory / "tokenizer.json"
        if not path.is_file():
            return None
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path))

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.directory} has no tokenizer.json; pass prompts as lists of token ids.")
            # No token covers more than `max_token_bytes` of the text outside whitespace (a tokenizer
            # may drop whitespace between words), so a text this long cannot fit the context:
            # refused in time linear in its size, before a tokenizer whose time grows faster sees it.
            size = len("".join(prompt.split()).encode())
            if size > self.max_token_bytes * self.max_model_len:
                raise ValueError(
                    f"the prompt has {size} bytes outside whitespace, so at least {size // self.max_token_bytes} tokens; "
                    f"the context holds {self.max_model_len}."
                )
            return self.tokenizer.encode(prompt).ids
        return list(prompt)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def check_prompt(self, prompt: str | list[int]) -> list[int]:
        """A prompt's token ids, or a RequestError: text the tokenizer refuses, an empty prompt, an id
        outside the vocabulary. Its length is `check_request`'s to judge."""
        try:
            ids = self.encode(prompt)
        except ValueError as exc:
            raise RequestError(str(exc), "prompt") from None
        if not ids:
            raise RequestError("the prompt is empty.", "prompt")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise RequestError(f"the prompt has a token id outside the vocabulary [0, {self.vocab_size}).", "prompt")
        return ids

    def check_request(self, prompt, params) -> tuple[list[int], SamplingParams]:
        """A request's token ids and parameters, or a ValueError naming what is wrong with it."""
        if isinstance(params, dict):
            params = SamplingParams.from_options(**params)
        ids = self.check_prompt(prompt)
        if any(not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise RequestError(f"stop_token_ids has a token id outside the vocabulary [0, {self.vocab_size}).", "stop_token_ids")
        if len(ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(ids)} tokens; the context holds {self.max_model_len}.", "prompt")
        capacity = self.num_blocks * self.block_size
        if min(len(ids) + params.max_tokens, self.max_model_len) > capacity:
            raise RequestError(
                f"the request may need {len(ids) + params.max_tokens} tokens; the KV cache holds {capacity}.",
                "max_tokens",
            )
        return ids, params
