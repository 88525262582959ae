"""`moeshard.LLM`: continuous batching over a paged KV cache, on any DP × TP × EP layout.

The LLM object is the driver: it tokenizes and checks requests, and `generate` is a loop over the
engine core (moeshard.engine.core: per-DP-group schedulers, one step on every rank in lock-step),
the same loop online serving runs. The driver is rank 0 and its worker runs in this process; the
other ranks are spawned here or started by torchrun (moeshard.engine.ranks).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


from moeshard import kernels
from moeshard.kernels.packed import Quantization
from moeshard.kernels.quant import QuantFormat
from moeshard.bundled.arithmetic import MODEL_DIR
from moeshard.engine import worker
from moeshard.engine.core import CoreLimits, EngineCore, EngineStats, RequestDelta
from moeshard.engine.inputs import Inputs
from moeshard.engine.lifecycle import EngineLifecycle, WeightSchema
from moeshard.engine.ranks import LocalRanks, Ranks
from moeshard.engine.sampling import KV_AFTER_UPDATE, SamplingParams
from moeshard.engine.scheduler import StopRules
from moeshard.engine.weight_sync import EngineWeightSync
from moeshard.models.model import check_layout
from moeshard.moe.context import check_method, method_policy
from moeshard.parallel import Layout
from moeshard.parallel.launch import under_torchrun


@dataclass
class RequestOutput:
    prompt: str | list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None  # per generated token: top-N token → logprob
    finish_reason: str | None = None  # "stop" (EOS or a stop string), "length", "abort", or None on error
    error: str | None = None  # this request was refused; the others ran
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    weight_version: str | None = None  # the weights in force for it last (see LLM.update_weights)
    weight_versions: list[dict] = field(default_factory=list)  # [{version, start, end}]: which weights sampled which tokens
    matched: int | str | None = None  # finish_reason "stop": the token id or stop string that ended it
    # With SamplingParams.return_routed_experts: [token][MoE layer][top_k] global expert ids of every
    # token the model read (prompt + output but the last), MoE layers in model order; nested lists
    # (torch.tensor() of it is [tokens, MoE layers, top_k]). An aborted request's rows so far.
    routed_experts: list[list[list[int]]] | None = None

    def append(self, delta: RequestDelta) -> None:
        self.num_cached_tokens, self.weight_version = delta.cached_tokens, delta.weight_version
        self.weight_versions, self.matched = delta.weight_versions, delta.matched
        self.text += delta.text
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        self.finish_reason = delta.finish_reason
        if delta.routed_experts is not None:
            self.routed_experts = delta.routed_experts


def check_world(layout: Layout) -> None:
    """Under torchrun the layout must use exactly the ranks it started, and keep each TP group inside
    one node (TP's many small collectives sit on every layer's critical path); checked before any
    collective. torchrun numbers ranks node by node, so that holds when TP divides the ranks per node."""
    if not under_torchrun():
        return
    world, per_node = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if world != layout.world_size:
        raise ValueError(f"torchrun started {world} ranks but layout {layout.label()} needs {layout.world_size}.")
    if per_node % layout.tp:
        raise ValueError(
            f"layout {layout.label()} would split its TP groups of {layout.tp} across nodes of {per_node} ranks; "
            "keep TP inside a node (TP must divide --nproc-per-node)."
        )


def open_ranks(layout: Layout, config: worker.WorkerConfig):
    if under_torchrun():
        if int(os.environ["RANK"]) != 0:
            raise RuntimeError("only torchrun's rank 0 builds the engine; the others run moeshard.engine.ranks.serve_torchrun().")
        return Ranks.torchrun(layout, config) if layout.world_size > 1 else LocalRanks(config)
    return Ranks.spawn(layout, config) if layout.world_size > 1 else LocalRanks(config)


DTYPES = ("auto", "bfloat16", "float32")


def checked_layout(
    cfg, tensor_parallel_size: int = 1, data_parallel_size: int = 1, enable_expert_parallel: bool = False,
    enable_sequence_parallel: bool = False, moe_comm: str = "auto", dtype: str = "auto", **_other_options,
) -> Layout:
    """The layout the LLM's options ask for, or a ValueError saying why they cannot serve the model
    `cfg` describes: before any rank (or engine process) starts."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
    layout = Layout(tensor_parallel_size, data_parallel_size, enable_expert_parallel, enable_sequence_parallel)
    check_layout(cfg, layout)
    check_world(layout)
    check_method(method_policy(moe_comm)[0], layout)
    return layout


def checked_quantization(kind: str | None, skip: Sequence[str], group: int, dtype: str,
                         quantize_activations: bool = False) -> Quantization | None:
    """`LLM`'s quantization options as one setting, or a ValueError saying which is wrong."""
    if quantize_activations and kind not in ("int8", "int4"):
        raise ValueError(f"quantize_activations multiplies int8 activations with int8 or int4 weights, so it needs "
                         f"quantization='int8' or 'int4', got quantization={kind!r}.")
    if kind is None:
        if skip:
            raise ValueError("quantization_skip names weights to keep unquantized, but no quantization is set.")
        return None
    if dtype != "bfloat16":
        raise ValueError(f"quantized weights compute in bfloat16, so quantization={kind!r} cannot run with dtype={dtype!r}.")
    if isinstance(skip, str):
        skip = [skip]
    return Quantization(QuantFormat(kind, group, activations="int8" if quantize_activations else "bf16"), tuple(skip))


def check_batch_invariant() -> None:
    """Batch-invariant mode runs every product on moeshard's CPU kernels: refuse it where they do not run."""
    if not kernels.built():
        raise ValueError(
            "batch-invariant mode needs moeshard's CPU kernels: an x86 CPU with AVX512-BF16 or AVX2 + FMA, a C++ "
            "compiler, and MOESHARD_CPU_KERNELS not set to 0."
        )


class LLM(Inputs, EngineLifecycle, EngineWeightSync):
    def __init__(
        self,
        model: str | None = None,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        enable_sequence_parallel: bool = False,
        moe_comm: str = "auto",
        compile: bool | str = False,
        dtype: str = "auto",
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 512,
        max_model_len: int | None = None,
        num_kv_blocks: int | None = None,
        block_size: int = 16,
        seed: int = 0,
        enable_prefix_caching: bool = True,
        batch_invariant: bool = False,
        kv_after_update: str = "keep",
        quantization: str | None = None,
        quantization_skip: Sequence[str] = (),
        quantization_group: int = 128,
        quantize_activations: bool = False,
    ):
        """`model`: a Hugging Face model directory; None: the bundled arithmetic model.
        `compile`: True (inductor) or a torch.compile backend name.
        `dtype`: "auto" (bf16 for a bf16 or fp16 checkpoint, else fp32), "bfloat16" or "float32".
        `enable_prefix_caching`: reuse the KV blocks of prompts seen before (keyed by the weights'
        version too, so a weight change never serves a stale block).
        `batch_invariant`: a request's tokens and logprobs bitwise the same whatever else runs with
        it (docs/DESIGN.md §11); needs moeshard's CPU kernels.
        `kv_after_update`: what a weight update made while a pause parks requests does to their K/V,
        unless a request says otherwise (SamplingParams.kv_after_update): "keep" it, or "recompute"
        it under the new weights before their next token.
        `quantization`: "fp8", "int8" or "int4": every linear weight a decode step reads (the LM
        head too; a tied one as a quantized copy of the embedding) quantized at load, in groups of `quantization_group`
        inputs, and held quantized; `quantization_skip`: module names or patterns kept as they are
        (docs/quantization.md). Computes in bfloat16. `quantize_activations` (int8 or int4 only): their
        products quantize each row of activations to int8 per group and multiply integers (VNNI):
        faster, no longer the bf16 product on the dequantized weights (docs/quantization.md)."""
        directory = Path(model) if model is not None else MODEL_DIR
        Inputs.__init__(self, directory, max_model_len, max_num_seqs, num_kv_blocks, block_size)
        cfg = self.config
        self.layout = checked_layout(
            cfg, tensor_parallel_size, data_parallel_size, enable_expert_parallel, enable_sequence_parallel, moe_comm, dtype
        )
        self.max_num_seqs, self.token_budget = max_num_seqs, max_num_batched_tokens
        if batch_invariant:
            check_batch_invariant()
        backend = "inductor" if compile is True else compile or None
        self.schema = WeightSchema.of(self.directory, cfg)
        self.dtype = "bfloat16" if quantization is not None and dtype == "auto" else dtype
        self.dtype = self.schema.serving_dtype() if self.dtype == "auto" else self.dtype
        self.quantization = checked_quantization(quantization, quantization_skip, quantization_group, self.dtype,
                                                 quantize_activations)
        config = worker.WorkerConfig(
            str(self.directory), self.layout, self.dtype, self.num_blocks, block_size, moe_comm, backend, batch_invariant,
            self.quantization,
        )
        if kv_after_update not in KV_AFTER_UPDATE:
            raise ValueError(f"kv_after_update must be {' or '.join(KV_AFTER_UPDATE)}, got {kv_after_update!r}.")
        self.init_lifecycle(kv_after_update)
        self.init_weight_sync()
        self.ranks = open_ranks(self.layout, config)
        self.device = self.ranks.host.worker.model.parallel.device
        rules = StopRules(frozenset(self.eos), self.max_model_len, self.decode)
        limits = CoreLimits(self.num_blocks, block_size, max_num_seqs, max_num_batched_tokens, enable_prefix_caching)
        self.core = EngineCore(self.ranks, self.layout, limits, rules, seed)

    def set_moe_comm(self, method: str) -> None:
        """Run later steps with `method` (compiled graphs are reused: they serve every method)."""
        check_method(method_policy(method)[0], self.layout)
        self.ranks.call("set_method", method)

    def get_model_info(self) -> dict:
        """What a client checks before it trusts an answer: which weights, served how."""
        return {
            "model_path": str(self.directory), "weight_version": self.weight_version, "is_generation": True,
            "dtype": self.dtype, "layout": self.layout.label(), "num_ranks": self.ranks.world_size,
            "max_model_len": self.max_model_len,
            "quantization": None if self.quantization is None else self.quantization.fmt.kind,
            "quantize_activations": self.quantization is not None and self.quantization.fmt.activations == "int8",
        }

    def reset_prefix_cache(self) -> None:
        """Free every cached KV block now (correctness never needs it: keys carry the weights' version)."""
        self.core.reset_prefix_cache()

    def stats(self) -> EngineStats:
        """Queues, KV usage and MoE counters, between two steps (the engine thread's call)."""
        answers = self.ranks.call("moe_stats")
        routed = [sum(counts) for counts in zip(*(per_rank for _, per_rank in answers))]
        return self.core.engine_stats(answers[0][0], routed)

    def on_rank_lost(self, callback) -> None:
        """Call `callback(error)`, from a watch thread, the moment a rank is lost, idle or stepping
        (the engine's next call raises the same RankError). A one-rank engine has none to lose."""
        self.ranks.on_lost = callback

    def close(self) -> None:
        self.ranks.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: list[str | list[int]],
        sampling_params: SamplingParams | dict | list[SamplingParams | dict] | None = None,
        max_concurrency: int | None = None,
    ) -> list[RequestOutput]:
        """Outputs in prompt order. A request refused for bad input gets `error`; the others run.

        `max_concurrency`: at most this many of these requests in the engine at once, as that many
        clients would send them (default: all at once; each DP group runs up to max_num_seqs).
        """
        self.check_ready()
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling parameters.")
        outputs = [RequestOutput(prompt) for prompt in prompts]
        pending = []
        for output, params in zip(outputs, sampling_params):
            try:
                pending.append((output, *self.check_request(output.prompt, params)))
            except ValueError as exc:
                output.error = str(exc)
        pending.reverse()
        in_flight: dict[int, RequestOutput] = {}
        while pending or in_flight:
            while pending and len(in_flight) < (max_concurrency or len(outputs)):
                output, ids, params = pending.pop()
                in_flight[self.core.add_request(ids, params)] = output
            for delta in self.core.step():
                output = in_flight[delta.request_id]
                output.append(delta)
                if delta.finished:
                    del in_flight[delta.request_id]
        return outputs
