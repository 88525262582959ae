"""Sleep, wake and weight updates for a colocated trainer (docs/DESIGN.md §5), both halves in one place.

`EngineLifecycle` is the driver's half (the LLM object): it checks requests (tags, levels, an update
validated whole against `WeightSchema` before anything is written) and knows what is released.
`RankLifecycle` is each rank's half (the Worker): it releases and re-creates memory, restores or
reloads weights, and recomputes the derived tensors of its own model.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from moeshard.engine.core import INITIAL_VERSION
from moeshard.engine.payloads import FLATTENED, SharedPayload, read_payload
from moeshard.models.checkpoint import Checkpoint, TensorDict
from moeshard.models.model import part_of, unused_by_design
from moeshard.models.quantized_checkpoint import PLAIN_DTYPES, QuantizedSource, StoredFormats, open_checkpoint
from moeshard.runtime import derived, memory

TAGS = ("weights", "kv_cache")
UPDATE_IN_FLIGHT = (
    "an update would land between two of their steps: pause generation (mode keep parks them across it), "
    "or abort them (abort_all_requests)"
)


@dataclass(frozen=True)
class WeightSchema:
    """The weights a complete update must carry: checkpoint name → (full shape, dtype); for a
    published quantized checkpoint, `stored` (its quantized weights: given as stored, or plainly in
    bf16 to be quantized as stored, moeshard.models.quantized_checkpoint.StoredFormats)."""

    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]
    stored: StoredFormats | None = None

    @classmethod
    def of(cls, directory: Path, cfg) -> "WeightSchema":
        source = open_checkpoint(directory)
        quantized = isinstance(source, QuantizedSource)
        ckpt = source.stored if quantized else source
        names = [n for n in ckpt.names() if not unused_by_design(n, cfg)]
        return cls({n: (ckpt.shape(n), ckpt.stored_dtype(n)) for n in names}, StoredFormats(source) if quantized else None)

    def serving_dtype(self) -> str:
        """What `dtype="auto"` serves: bf16 for a checkpoint stored mostly in bf16 or fp16 (as real
        MoE checkpoints ship; fp16 is served as bf16, which has its range), or stored quantized (its
        weights held as stored compute in bf16), else fp32."""
        if self.stored is not None:
            return "bfloat16"
        half = sum(math.prod(shape) for shape, dtype in self.tensors.values() if dtype in (torch.bfloat16, torch.float16))
        full = sum(math.prod(shape) for shape, _ in self.tensors.values())
        return "bfloat16" if 2 * half > full else "float32"

    def check_one(self, name: str, tensor) -> None:
        plain = self.stored is not None and self.stored.plain(name) is not None
        if name not in self.tensors and not plain:
            raise ValueError(f"update tensor {name!r} is not a weight of this model; nothing was written.")
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"update entry {name!r} is a {type(tensor).__name__}, not a tensor.")
        if plain and (name not in self.tensors or tensor.dtype in PLAIN_DTYPES):
            # a weight the checkpoint stores quantized, given plainly (FP8's X.weight: in bf16, not fp8)
            shape, dtype = self.stored.shapes[self.stored.plain(name)], tensor.dtype
            if dtype not in PLAIN_DTYPES:
                raise ValueError(
                    f"update tensor {name!r} is {dtype}; the checkpoint stores it quantized, so it takes bf16, fp16 or "
                    "fp32 weights (quantized as stored) or the tensors the checkpoint stores; nothing was written."
                )
        else:
            shape, dtype = self.tensors[name]
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"update tensor {name!r} has shape {list(tensor.shape)}; the model's is {list(shape)}; "
                "nothing was written."
            )
        if tensor.dtype != dtype:
            raise ValueError(f"update tensor {name!r} is {tensor.dtype}; the model's is {dtype}; nothing was written.")

    def check_quantized(self, named: list[tuple[str, torch.dtype]]) -> set[str]:
        """Each weight stored quantized given whole (StoredFormats.check_whole); the names of the
        stored tensors that the plain weights among `named` stand for."""
        if self.stored is None:
            return set()
        return {n for module in self.stored.check_whole(named) for n in self.stored.names[module]}

    def check_announced(self, metas) -> None:
        """`check` for tensors announced by name, dtype and shape (a broadcast still to come): any
        subset of the weights, each once."""
        seen = set()
        for meta in metas:
            self.check_one(meta.name, torch.empty(meta.shape, dtype=meta.dtype, device="meta"))
            if meta.name in seen:
                raise ValueError(f"update tensor {meta.name!r} appears twice; nothing was written.")
            seen.add(meta.name)
        self.check_quantized([(meta.name, meta.dtype) for meta in metas])

    def check(self, named_tensors, complete: bool = True) -> dict[str | int, dict[str, torch.Tensor]]:
        """The update grouped by model part, or a ValueError naming the first offending tensor.
        `complete`: it must carry every weight (else the weights it does not name keep their values).
        Weights a published quantized checkpoint stores in its stored form are read once whole here,
        so that what a load would refuse is refused before anything is written."""
        buckets: dict[str | int, dict[str, torch.Tensor]] = {}
        stream, count = iter(named_tensors), 0
        while True:
            try:
                name, tensor = next(stream)  # references only: nothing is copied here
            except StopIteration:
                break
            except Exception as exc:  # the stream itself failed part-way
                raise ValueError(f"the update stream failed after {count} tensors ({exc}); nothing was written.") from None
            count += 1
            self.check_one(name, tensor)
            part = buckets.setdefault(part_of(name), {})
            if name in part:
                raise ValueError(f"update tensor {name!r} appears twice; nothing was written.")
            part[name] = tensor
        given = [(n, t.dtype) for part in buckets.values() for n, t in part.items()]
        covered = {n for n, _ in given} | self.check_quantized(given)
        missing = [n for n in self.tensors if n not in covered]
        if missing and complete:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise ValueError(
                f"the update ended without {missing[0]!r}{more}: an update carries every weight; nothing was written."
            )
        if self.stored is not None:
            for tensors in buckets.values():
                as_stored = {self.stored.module_of(n) for n, t in tensors.items() if not self.stored.is_plain(n, t.dtype)}
                self.stored.validate(TensorDict(tensors), as_stored - {None})
        return buckets

    def takes(self, name: str) -> bool:
        """`name` is a weight an update may give (a tensor the checkpoint stores, or a plain weight it stores quantized)."""
        return name in self.tensors or (self.stored is not None and self.stored.plain(name) is not None)

    def as_stored(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A checked part as the ranks write it: plain weights the checkpoint stores quantized, quantized as stored."""
        return tensors if self.stored is None else self.stored.as_stored(tensors)


class EngineLifecycle:
    """The driver's half. Expects `self.ranks` (`.call(method, *args)` on every rank's worker),
    `self.core` (its prefix cache keys blocks by the weights' version), `self.directory` and
    `self.schema`; call `init_lifecycle()` from the engine's constructor."""

    def init_lifecycle(self, kv_after_update: str = "keep") -> None:
        self.released: set[str] = set()  # memory a sleep released and no wake has re-created
        self.weights_lost = False  # sleep(level=2) dropped the weights; reload before generating
        # Negative controls only: with the rebuild off, derived tensors stay as the wake left them.
        self.rebuild_derived = os.environ.get("MOESHARD_UNSAFE_SKIP_DERIVED_REBUILD") != "1"
        self.weight_version = INITIAL_VERSION  # names the weights every request is answered with
        self.kv_after_update = kv_after_update  # what an update does to a parked request's K/V (SamplingParams)

    def quiesce(self, abort_running: bool, otherwise: str, parked_may_stay: bool = False) -> None:
        """No step may straddle a change of weights or memory: requests in flight refuse the change,
        or with `abort_running` are aborted. With `parked_may_stay` (a weight update), requests a
        pause parks stay: they go on under the new weights (`EngineCore.weights_updated`)."""
        live = self.core.live_request_ids()
        if live and not abort_running and not (parked_may_stay and self.core.paused):
            raise RuntimeError(f"{len(live)} requests are in flight; {otherwise}.")
        if abort_running:
            for request_id in live:
                self.core.abort(request_id)

    def sleep(self, level: int = 1, abort_running: bool = False) -> list[float]:
        """Release memory for a colocated trainer: level 1 backs the weights up to the host, level 2
        drops them too; the KV cache never survives. Requests in flight are refused the sleep, or
        aborted with `abort_running`. Returns each rank's resident MiB."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}.")
        if self.released:
            raise RuntimeError("the engine is already asleep; call wake_up() first.")
        self.quiesce(abort_running, "sleep with mode=abort or mode=wait, or retry when idle")
        self.core.reset_prefix_cache()  # the KV cache's memory goes
        if level == 2:
            self.core.weights_changed()
        rss = self.ranks.call("sleep", level)
        self.released, self.weights_lost = set(TAGS), level == 2
        return rss

    def wake_up(self, tags: list[str] | None = None, poison: bool | str = False) -> list[float]:
        """Re-create the memory `tags` name ("weights", "kv_cache"; default both). What is not
        restored holds undefined contents; `poison` makes it garbage, so a stale read cannot hide:
        True, every kind (NaN, ±Inf, huge, in range; ids in and out of range); "in_range", only the
        kind no NaN test or bounds check sees. Derived tensors are recomputed after the weights come
        back. Returns each rank's resident MiB."""
        tags = list(TAGS) if tags is None else list(tags)
        unknown = set(tags) - set(TAGS)
        if unknown:
            raise ValueError(f"unknown wake_up tag(s) {sorted(unknown)}; known: weights, kv_cache.")
        if poison not in (False, *memory.POISON_KINDS):
            raise ValueError(f"poison must be False, True or 'in_range', got {poison!r}.")
        rss = self.ranks.call("wake", tags, poison, self.rebuild_derived)
        self.released -= set(tags)
        return rss

    def reload_weights(self, weight_version: str | None = None, abort_running: bool = False) -> None:
        """Read the weights from the model directory again (after sleep(level=2), or to undo updates)."""
        self.check_weights_present()
        self.quiesce(abort_running, UPDATE_IN_FLIGHT, parked_may_stay=True)
        self.core.weights_changed()
        self.ranks.call("reload_weights")
        self.weights_written(weight_version or INITIAL_VERSION)

    def update_weights(
        self, named_tensors, weight_version: str | None = None, abort_running: bool = False, complete: bool = True
    ) -> int | None:
        """Take new weights: an iterable of (checkpoint name, full tensor) covering every weight
        (with `complete=False`, any of them: the others keep their values).

        Every name, shape and dtype is checked before anything is written; a refused update leaves
        the old weights (and the generation) as they were. Requests in flight refuse it (no request
        mixes two sets of weights), or with `abort_running` are aborted. Then each part of the model
        (a layer, the embedding, …) is written in turn, straight into the parameters, each rank its
        own blocks. Derived tensors are rebuilt; `weight_version` (if given) names the new weights
        from here on. Returns the new generation.
        """
        self.check_weights_present()
        parts = self.schema.check(named_tensors, complete)
        self.quiesce(abort_running, UPDATE_IN_FLIGHT, parked_may_stay=True)
        self.core.weights_changed()
        for part, tensors in parts.items():
            self.ranks.call("update_part", part, self.for_ranks(self.schema.as_stored(tensors)), complete)
        return self.weights_written(weight_version)

    def for_ranks(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A part's tensors as they cross to the other ranks (pickled): a view of a larger buffer (a
        flattened bucket's entry) would take the whole buffer along, so it goes as a copy of itself."""
        if self.ranks.world_size == 1:
            return tensors
        return {n: t if t.untyped_storage().nbytes() == t.nbytes else t.clone() for n, t in tensors.items()}

    def weights_written(self, weight_version: str | None) -> int | None:
        """After new weights are in the parameters: rebuild the derived tensors, name the version,
        move the parked requests onto them."""
        generation = self.ranks.call("rebuild_derived")[0] if self.rebuild_derived else None
        self.weights_lost = False
        if weight_version is not None:
            self.update_weight_version(weight_version)
        self.core.weights_updated(self.kv_after_update)
        return generation

    def update_weight_version(self, weight_version: str) -> None:
        """Name the weights in force `weight_version` from here on (SGLang's /update_weight_version):
        a label only — the weights, the KV cache and the prefix cache stay as they are. Requests in
        flight run on these weights, so their next tokens carry the new name (a new span)."""
        if not weight_version:
            raise ValueError("weight_version must be a non-empty string.")
        self.weight_version = weight_version
        self.core.name_weights(weight_version)

    def update_weights_from_disk(
        self, directory: str | Path, weight_version: str | None = None, abort_running: bool = False
    ) -> int | None:
        """`update_weights` from a checkpoint directory of this model's architecture (the same
        checks: a checkpoint that does not fit is refused before anything is written)."""
        if not Path(directory).is_dir():
            raise ValueError(f"{directory} is not a directory.")
        ckpt = Checkpoint(directory)
        named = ((name, ckpt.block(name, ())) for name in ckpt.names() if self.schema.takes(name))
        return self.update_weights(named, weight_version, abort_running)

    def update_weights_from_tensor(
        self, serialized_named_tensors: SharedPayload | bytes | list[SharedPayload | bytes], load_format: str | None = None,
        weight_version: str | None = None, abort_running: bool = False,
    ) -> int | None:
        """`update_weights` from safetensors payloads, one or several (moeshard.engine.payloads: never
        pickle, so the bytes cannot run code; read in place, nothing is copied on the way); with
        `load_format="flattened_bucket"`, each holds flattened buckets. Together they name any of
        the weights, each once."""
        if load_format not in (None, FLATTENED):
            raise ValueError(f"load_format must be {FLATTENED!r} or absent, got {load_format!r}.")
        payloads = serialized_named_tensors if isinstance(serialized_named_tensors, list) else [serialized_named_tensors]
        named = []
        for i, payload in enumerate(payloads):
            try:
                named += read_payload(payload, load_format)
            except ValueError as exc:
                raise ValueError(f"payload {i}: {exc}; nothing was written.") from None
        return self.update_weights(named, weight_version, abort_running, complete=False)

    @property
    def is_sleeping(self) -> bool:
        return bool(self.released)

    def resident_mb(self) -> list[float]:
        """Each rank's resident memory, in MiB."""
        return self.ranks.call("resident_mb")

    def memory_held_mb(self) -> list[dict[str, float]]:
        """Each rank's weights (with the derived tensors) and KV cache, in MiB: what a sleep releases."""
        return self.ranks.call("held_mb")

    def state_digest(self) -> list[dict[str, str]]:
        """Each rank's SHA-256 of its weights and of its derived tensors, every byte (the vocabulary's
        padding rows too): after a poisoned wake and a reload they must equal the start-up ones,
        which shows that everything poisoned was rewritten before it could be read."""
        return self.ranks.call("digest")

    def check_weights_present(self) -> None:
        if "weights" in self.released:
            raise RuntimeError("the weights' memory is released; call wake_up(['weights']) first.")

    def not_ready(self) -> str | None:
        """Why no request can run now, or None."""
        if self.released:
            return f"the engine is asleep ({' and '.join(sorted(self.released))} released); call wake_up()."
        if self.weights_lost:
            return "the weights were dropped by sleep(level=2); call reload_weights() before generating."
        return None

    def check_ready(self) -> None:
        if (reason := self.not_ready()) is not None:
            raise RuntimeError(reason)


@dataclass
class Asleep:
    level: int
    released_tensors: dict[int, memory.Released]  # every released weight and derived tensor, by id
    backup: list[torch.Tensor] | None  # level 1: the weights, on the host
    released: set[str]  # "weights", "kv_cache": what a wake has not yet re-created


class RankLifecycle:
    """A rank's half. Expects `self.runner` (its ModelRunner, whose `.model` is the CausalLM) and
    `self.model_dir`; `self.asleep` is None while awake."""

    asleep: Asleep | None = None

    def weights(self) -> list[torch.Tensor]:
        return list(self.runner.model.parameters())  # each tensor once (a tied LM head is the embedding)

    def derived_tensors(self) -> list[torch.Tensor]:
        return derived.registered_tensors(self.runner.model.derived_owners())

    def resident_mb(self) -> float:
        return memory.resident_mb()

    def held_mb(self) -> dict[str, float]:
        tensors = self.weights() + self.derived_tensors()
        weights = sum(t.numel() * t.element_size() for t in tensors)
        return {"weights": weights / 2**20, "kv_cache": self.runner.kv_cache_bytes() / 2**20}

    def digest(self) -> dict[str, str]:
        return {"weights": memory.digest(self.weights()), "derived": memory.digest(self.derived_tensors())}

    def sleep(self, level: int) -> float:
        """Release the KV cache, the derived tensors and the weights (level 1: backed up to the
        host first). Returns this rank's resident memory afterwards, in MiB."""
        tensors = self.weights()
        backup = [t.detach().clone() for t in tensors] if level == 1 else None
        released = memory.release(tensors + self.derived_tensors())
        self.runner.release_kv_cache()
        memory.return_memory_to_os()
        self.asleep = Asleep(level, released, backup, set(TAGS))
        return memory.resident_mb()

    def wake(self, tags: list[str], poison: bool | str, rebuild_derived: bool = True) -> float:
        """Re-create what `tags` name. Weights come back from the backup (level 1) or stay undefined
        until new ones arrive (level 2); derived tensors are recomputed; the KV cache is new."""
        asleep = self.asleep
        if asleep is None:
            return memory.resident_mb()
        if "weights" in tags and "weights" in asleep.released:
            tensors = self.weights()
            memory.recreate(tensors + self.derived_tensors(), asleep.released_tensors, poison)
            if asleep.backup is not None:
                for t, saved in zip(tensors, asleep.backup, strict=True):
                    t.data.copy_(saved)
                asleep.backup = None
            if rebuild_derived:
                self.rebuild_derived()
            asleep.released.discard("weights")
        if "kv_cache" in tags and "kv_cache" in asleep.released:
            self.runner.allocate_kv_cache(poison)
            asleep.released.discard("kv_cache")
        if not asleep.released:
            self.asleep = None
        return memory.resident_mb()

    def reload_weights(self) -> None:
        """Read the weights from the model directory again, a part at a time, into the parameters
        (the driver has the derived tensors rebuilt next)."""
        model = self.runner.model
        source = open_checkpoint(self.model_dir)
        for part in model.parts():
            model.load_part(source, part)

    def update_part(self, part: str | int, tensors: dict[str, torch.Tensor], complete: bool = True) -> None:
        """Write one part's new full tensors into the parameters (the driver checked them); with
        `complete=False` the part's tensors not among them keep their values."""
        model = self.runner.model
        model.load_part(model.reads(TensorDict(tensors, partial=not complete)), part)

    def rebuild_derived(self) -> int:
        return derived.rebuild(self.runner.model.derived_owners())
