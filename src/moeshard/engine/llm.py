"""`moeshard.LLM`: continuous batching over a paged KV cache, on any DP × TP × EP layout.

The LLM object is the driver: it tokenizes, schedules (one scheduler per DP group: each group
serves its own requests), samples and detokenizes. Every step it sends the ranks their chunks and
they step in lock-step (moeshard.engine.worker); with one rank the worker runs in this process.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moeshard.bundled.arithmetic import MODEL_DIR
from moeshard.engine import worker
from moeshard.engine.block_manager import BlockManager
from moeshard.engine.sampling import Sample, SamplingParams, sample_batch
from moeshard.engine.scheduler import Request, Scheduler
from moeshard.models.checkpoint import Checkpoint
from moeshard.models.model import check_layout, load_config, part_of, unused_by_design
from moeshard.models.runner import Chunk
from moeshard.moe.context import check_method, method_policy
from moeshard.parallel import Layout
from moeshard.parallel.launch import open_layout


@dataclass
class RequestOutput:
    prompt: str | list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None  # per generated token: top-N token → logprob
    finish_reason: str | None = None  # "stop" (EOS or a stop string), "length", or None on error
    error: str | None = None  # this request was refused; the others ran


@dataclass(frozen=True)
class WeightSchema:
    """The weights a complete update must carry: checkpoint name → (full shape, dtype)."""

    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]

    @classmethod
    def of(cls, directory: Path, cfg) -> "WeightSchema":
        ckpt = Checkpoint(directory)
        names = [n for n in ckpt.handles if not unused_by_design(n, cfg)]
        return cls({n: (ckpt.shape(n), ckpt.stored_dtype(n)) for n in names})

    def check(self, named_tensors) -> dict[str | int, dict[str, torch.Tensor]]:
        """The update grouped by model part, or a ValueError naming the first offending tensor."""
        buckets: dict[str | int, dict[str, torch.Tensor]] = {}
        stream, count = iter(named_tensors), 0
        while True:
            try:
                name, tensor = next(stream)  # references only: nothing is copied here
            except StopIteration:
                break
            except Exception as exc:  # the stream itself failed part-way
                raise ValueError(
                    f"the update stream failed after {count} tensors ({exc}); nothing was written."
                ) from None
            count += 1
            if name not in self.tensors:
                raise ValueError(f"update tensor {name!r} is not a weight of this model; nothing was written.")
            shape, dtype = self.tensors[name]
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"update entry {name!r} is a {type(tensor).__name__}, not a tensor.")
            if tuple(tensor.shape) != shape:
                raise ValueError(
                    f"update tensor {name!r} has shape {list(tensor.shape)}; the model's is {list(shape)}; "
                    "nothing was written."
                )
            if tensor.dtype != dtype:
                raise ValueError(
                    f"update tensor {name!r} is {tensor.dtype}; the model's is {dtype}; nothing was written."
                )
            part = buckets.setdefault(part_of(name), {})
            if name in part:
                raise ValueError(f"update tensor {name!r} appears twice; nothing was written.")
            part[name] = tensor
        missing = [n for n in self.tensors if n not in buckets.get(part_of(n), {})]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise ValueError(
                f"the update ended without {missing[0]!r}{more}: an update carries every weight; nothing was written."
            )
        return buckets


class LocalRanks:
    """One rank: its worker lives in this process (and only this engine's)."""

    world_size = 1

    def __init__(self, config: worker.WorkerConfig):
        self.worker = worker.Worker(config)

    def call(self, method: str, *args) -> list:
        return [getattr(self.worker, method)(*args)]

    def close(self) -> None:
        self.worker = None


class SpawnedRanks:
    """A rank pool (or torchrun's ranks), each holding one worker."""

    def __init__(self, layout: Layout, config: worker.WorkerConfig):
        self.pool = open_layout(layout)
        self.pool.run(worker.start, config)

    def call(self, method: str, *args) -> list:
        return self.pool.run(worker.call, method, *args)

    def close(self) -> None:
        self.pool.close()


def read_eos(directory: Path) -> set[int]:
    eos = json.loads((directory / "config.json").read_text()).get("eos_token_id")
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


class LLM:
    def __init__(
        self,
        model: str | None = None,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        enable_sequence_parallel: bool = False,
        moe_comm: str = "auto",
        compile: bool | str = False,
        dtype: str = "float32",
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 512,
        max_model_len: int | None = None,
        num_kv_blocks: int | None = None,
        block_size: int = 16,
        seed: int = 0,
    ):
        """`model`: a Hugging Face model directory; None: the bundled arithmetic model.
        `compile`: True (inductor) or a torch.compile backend name."""
        self.directory = Path(model) if model is not None else MODEL_DIR
        cfg, _ = load_config(self.directory)
        self.layout = Layout(tensor_parallel_size, data_parallel_size, enable_expert_parallel, enable_sequence_parallel)
        check_layout(cfg, self.layout)
        check_method(method_policy(moe_comm)[0], self.layout)  # fails here, before any rank starts
        self.max_model_len = min(max_model_len or cfg.max_positions, cfg.max_positions)
        self.max_num_seqs, self.token_budget, self.block_size = max_num_seqs, max_num_batched_tokens, block_size
        self.num_blocks = num_kv_blocks or -(-max_num_seqs * self.max_model_len // block_size)
        self.eos = read_eos(self.directory)
        self.tokenizer = self.load_tokenizer()
        self.seed_generator = torch.Generator().manual_seed(seed)
        self.ids = itertools.count()
        backend = "inductor" if compile is True else compile or None
        config = worker.WorkerConfig(
            str(self.directory), self.layout, dtype, self.num_blocks, block_size, moe_comm, backend
        )
        self.schema = WeightSchema.of(self.directory, cfg)
        self.released: set[str] = set()  # memory a sleep released and no wake has re-created
        self.weights_lost = False  # sleep(level=2) dropped the weights; reload before generating
        # Negative controls only: with the rebuild off, derived tensors stay as the wake left them.
        self.rebuild_derived = os.environ.get("MOESHARD_UNSAFE_SKIP_DERIVED_REBUILD") != "1"
        self.ranks = LocalRanks(config) if self.layout.world_size == 1 else SpawnedRanks(self.layout, config)

    def load_tokenizer(self):
        path = self.directory / "tokenizer.json"
        if not path.is_file():
            return None
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path))

    def set_moe_comm(self, method: str) -> None:
        """Run later steps with `method` (compiled graphs are reused: they serve every method)."""
        check_method(method_policy(method)[0], self.layout)
        self.ranks.call("set_method", method)

    def sleep(self, level: int = 1) -> list[float]:
        """Release memory for a colocated trainer (DESIGN.md §5): level 1 backs the weights up to the
        host, level 2 drops them too; the KV cache never survives. Returns each rank's resident MiB."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}.")
        if self.released:
            raise RuntimeError("the engine is already asleep; call wake_up() first.")
        rss = self.ranks.call("sleep", level)
        self.released, self.weights_lost = {"weights", "kv_cache"}, level == 2
        return rss

    def wake_up(self, tags: list[str] | None = None, poison: bool = False) -> list[float]:
        """Re-create the memory `tags` name ("weights", "kv_cache"; default both). What is not
        restored holds undefined contents; `poison` makes it garbage, so a stale read cannot hide.
        Derived tensors are recomputed after the weights come back. Returns each rank's resident MiB."""
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"unknown wake_up tag(s) {sorted(unknown)}; known: weights, kv_cache.")
        rss = self.ranks.call("wake", tags, poison, self.rebuild_derived)
        self.released -= set(tags)
        return rss

    def reload_weights(self) -> None:
        """Read the weights from the model directory again (after sleep(level=2), or to undo updates)."""
        if "weights" in self.released:
            raise RuntimeError("the weights' memory is released; call wake_up(['weights']) first.")
        self.ranks.call("reload_weights", self.rebuild_derived)
        self.weights_lost = False

    def resident_mb(self) -> list[float]:
        """Each rank's resident memory, in MiB."""
        return self.ranks.call("resident_mb")

    def update_weights(self, named_tensors) -> int:
        """Take new weights: an iterable of (checkpoint name, full tensor) covering every weight.

        Every name, shape and dtype is checked before anything is written; a refused update leaves
        the old weights (and the generation) as they were. Then each part of the model (a layer, the
        embedding, …) is written in turn, sharded as the loader shards it, so the extra memory is one
        part. Derived tensors are rebuilt; returns the new generation.
        """
        if "weights" in self.released:
            raise RuntimeError("the weights' memory is released; call wake_up(['weights']) first.")
        buckets = self.schema.check(named_tensors)
        for part, tensors in buckets.items():
            self.ranks.call("update_part", part, tensors)
        generation = self.ranks.call("rebuild_derived")[0] if self.rebuild_derived else None
        self.weights_lost = False
        return generation

    def check_ready(self) -> None:
        if self.released:
            raise RuntimeError(
                f"the engine is asleep ({' and '.join(sorted(self.released))} released); call wake_up()."
            )
        if self.weights_lost:
            raise RuntimeError("the weights were dropped by sleep(level=2); call reload_weights() before generating.")

    def close(self) -> None:
        self.ranks.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.directory} has no tokenizer.json; pass prompts as lists of token ids.")
            return self.tokenizer.encode(prompt).ids
        return list(prompt)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def make_request(self, prompt, params) -> Request:
        """A request, or a ValueError naming what is wrong with this one."""
        if isinstance(params, dict):
            params = SamplingParams.from_options(**params)
        ids = self.encode(prompt)
        if not ids:
            raise ValueError("the prompt is empty.")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context holds {self.max_model_len}.")
        capacity = self.num_blocks * self.block_size
        if min(len(ids) + params.max_tokens, self.max_model_len) > capacity:
            raise ValueError(
                f"the request may need {len(ids) + params.max_tokens} tokens; the KV cache holds {capacity}."
            )
        seed = (
            params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self.seed_generator))
        )
        return Request(next(self.ids), ids, params, torch.Generator().manual_seed(seed))

    def generate(
        self,
        prompts: list[str | list[int]],
        sampling_params: SamplingParams | dict | list[SamplingParams | dict] | None = None,
        max_concurrency: int | None = None,
    ) -> list[RequestOutput]:
        """Outputs in prompt order. A request refused for bad input gets `error`; the others run.

        `max_concurrency`: at most this many requests in flight at once (default: max_num_seqs).
        """
        self.check_ready()
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling parameters.")
        outputs = [RequestOutput(prompt) for prompt in prompts]
        groups = [
            Scheduler(
                BlockManager(self.num_blocks, self.block_size), max_concurrency or self.max_num_seqs, self.token_budget
            )
            for _ in range(self.layout.dp)
        ]
        requests: dict[int, tuple[Request, RequestOutput]] = {}
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            try:
                request = self.make_request(prompt, params)
            except ValueError as exc:
                outputs[i].error = str(exc)
                continue
            groups[len(requests) % len(groups)].add(request)
            requests[request.id] = (request, outputs[i])
        while any(group.has_work for group in groups):
            self.step(groups)
        for request, output in requests.values():
            output.text, output.token_ids, output.finish_reason = (
                request.text,
                request.output_ids,
                request.finish_reason,
            )
            if request.params.logprobs is not None:
                output.logprobs = [s.top_logprobs | {s.token: s.logprob} for s in request.samples]
        return outputs

    def step(self, groups: list[Scheduler]) -> None:
        plans = [group.schedule() for group in groups]
        chunks = [
            [Chunk(r.tokens[r.num_computed : r.num_computed + n], r.num_computed, list(r.blocks)) for r, n in plan]
            for plan in plans
        ]
        per_rank = self.ranks.call("step", chunks)
        for d, (group, plan) in enumerate(zip(groups, plans)):
            for request, n in plan:
                request.num_computed += n
            ready = [i for i, (request, _) in enumerate(plan) if request.num_computed == request.num_tokens]
            if not ready:
                continue
            logits = torch.stack([per_rank[d * self.layout.tp][i] for i in ready])
            requests = [plan[i][0] for i in ready]
            drawn = sample_batch(logits, [r.params for r in requests], [r.generator for r in requests])
            for request, sampled in zip(requests, drawn):
                self.append(group, request, sampled)

    def append(self, group: Scheduler, request: Request, drawn: Sample) -> None:
        params = request.params
        request.output_ids.append(drawn.token)
        request.samples.append(drawn)
        if drawn.token in self.eos and not params.ignore_eos:
            return self.finish(group, request, "stop")
        if params.stop:
            text = self.decode(request.output_ids)
            for stop in params.stop:
                if stop in text:
                    return self.finish(group, request, "stop", text[: text.index(stop)])
        if len(request.output_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
            self.finish(group, request, "length")

    def finish(self, group: Scheduler, request: Request, reason: str, text: str | None = None) -> None:
        request.text = self.decode(request.output_ids) if text is None else text
        group.finish(request, reason)
