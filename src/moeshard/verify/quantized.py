"""Quantized copies of tiny checkpoints in each published layout, and their dequantized references.

`write_quantized` turns a bf16/fp32 checkpoint directory (verify/tiny.py makes them) into the same
model stored as a published quantized checkpoint stores it (moeshard.models.quantized_checkpoint:
packed tensors, a config.json `quantization_config`, routers and the LM head left as shipped and
listed as such), and writes beside it the dequantized reference: the same model with every
quantized weight replaced by its dequantized value (bf16-exact, stored fp32), which transformers
loads plainly — what `verify hf` compares the engine with.

The tiny models' inputs (K) are 16, 24, 32, 40, 48, 64 and 96: groups of 16 inputs (FP8 blocks of
32 outputs × 16 inputs) leave a short last group on DeepSeek-V3's K = 24 and 40 (read as canonical
groups of 8), and FP8's blocks of rows a short last one on most weights.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moeshard.kernels.quant import dequantize
from moeshard.models.checkpoint import read_config
from moeshard.models.quantized_checkpoint import Awq, Fp8Block, Gptq, Layout, PackQuantized

GROUP = 16

# name → the layout, given the modules it leaves as shipped
TINY_LAYOUTS: dict[str, Callable[[tuple[str, ...]], Layout]] = {
    "fp8": lambda ignore: Fp8Block(ignore, (2 * GROUP, GROUP)),  # not square: rows and columns told apart
    "ct-int4": lambda ignore: PackQuantized(ignore, 4, GROUP, symmetric=True),
    "ct-int4-asym": lambda ignore: PackQuantized(ignore, 4, GROUP, symmetric=False),
    "ct-int8": lambda ignore: PackQuantized(ignore, 8, GROUP, symmetric=True, scale_dtype=torch.float16),
    "ct-int8-asym": lambda ignore: PackQuantized(ignore, 8, GROUP, symmetric=False),
    "gptq-int4": lambda ignore: Gptq(ignore, 4, GROUP, symmetric=True, v1=True),
    "gptq-int4-asym": lambda ignore: Gptq(ignore, 4, GROUP, symmetric=False, v1=False),
    "gptq-int8": lambda ignore: Gptq(ignore, 8, GROUP, symmetric=True, v1=True),
    "awq-int4": lambda ignore: Awq(ignore, group_size=GROUP),
}


def is_router(module: str) -> bool:
    """MoE routers (`mlp.gate`, Mixtral's `block_sparse_moe.gate`) and Qwen2-MoE's shared-expert gate."""
    return module.endswith(".gate") or module.endswith(".shared_expert_gate")


def save_checkpoint(directory: Path, source: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """config.json, model.safetensors, and the source's other files (generation_config.json, ...)."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and path.name != "config.json" and not path.name.startswith("model.safetensors"):
            shutil.copy2(path, directory / path.name)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(directory / "model.safetensors"), {"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def write_quantized(source: str | Path, directory: str | Path, layout_name: str, reference: str | Path) -> Layout:
    """Quantize every linear layer of the checkpoint `source` but its routers and LM head into
    `directory`, in layout `layout_name` (one of TINY_LAYOUTS); the dequantized model into
    `reference`. Returns the layout."""
    source, directory, reference = Path(source), Path(directory), Path(reference)
    if layout_name not in TINY_LAYOUTS:
        raise ValueError(f"unknown quantized layout {layout_name!r}; choose one of {', '.join(TINY_LAYOUTS)}.")
    config, tensors = read_config(source), load_file(str(source / "model.safetensors"))
    linear = [n.removesuffix(".weight") for n, t in tensors.items() if n.endswith(".weight") and t.dim() == 2]
    shipped = tuple(m for m in linear if is_router(m) or m == "lm_head")
    layout = TINY_LAYOUTS[layout_name](shipped)
    stored, dequantized = {}, {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if module not in linear or "embed_tokens" in module or module in shipped:
            stored[name] = dequantized[name] = tensor
            continue
        if layout.skips(module):
            raise ValueError(f"{layout_name}'s ignore list {list(shipped)} also matches {module}, which it quantizes.")
        q = layout.quantize(tensor)
        stored.update({module + suffix: t for suffix, t in layout.encode(q).items()})
        dequantized[name] = dequantize(q).float()
    save_checkpoint(directory, source, stored, config | {"quantization_config": layout.config()})
    save_checkpoint(reference, source, dequantized, config)
    return layout
