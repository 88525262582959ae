"""Weight updates as bytes: safetensors payloads (never pickle: the bytes cannot run code), read in
place, and SGLang's flattened buckets in that safe form.

A payload's tensors are views of its bytes, never copies. Over HTTP the bytes are decoded once,
into a `SharedPayload` (a memory file), which reaches the engine process by its path: one decoded
copy of a bucket on the machine, whichever process reads it.

Flattened bucket (`load_format="flattened_bucket"`): SGLang's `FlattenedTensorBucket` is a flat
tensor and the list of the tensors in it (`FlattenedTensorMetadata`: name, shape, dtype,
start_idx, end_idx, numel), pickled. Here it is a safetensors file whose tensors are flat (1-D)
buffers, any number of them (one per dtype, say), each with its list as JSON in the header's
metadata under the buffer's own name:

    {"flattened_tensor": <1-D bf16>}, __metadata__ {"flattened_tensor": '[{"name": "model.norm.weight",
        "shape": [128], "dtype": "bfloat16", "start_idx": 0, "end_idx": 128, "numel": 128}, …]'}

start_idx and end_idx count elements of the buffer; an entry whose dtype is not the buffer's is
converted (as SGLang's `reconstruct_tensors` does); numel, if given, must agree. `flattened_bucket`
writes one.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save

FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# and the dtypes a published quantized checkpoint stores its weights in (models/quantized_checkpoint.py)
STORED = (torch.float8_e4m3fn, torch.int8, torch.uint8, torch.int32, torch.int64)
DTYPES = {str(t).removeprefix("torch."): t for t in FLOATS + STORED}
FLATTENED = "flattened_bucket"
# vLLM's packed broadcast (vllm/distributed/weight_transfer/packed_tensor.py): each tensor's bytes, in
# the announced order, appended to a uint8 buffer until it holds more than the buffer size (1 GiB by
# default; the tensor that crosses the limit stays in it), one broadcast per buffer.
PACKED = "packed"
PACKED_BUFFER_BYTES = 1 << 30


def dtype_named(name: str) -> torch.dtype:
    """"bfloat16" or "torch.bfloat16" → torch.bfloat16, or a ValueError."""
    if not isinstance(name, str) or name.removeprefix("torch.") not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPES)}.")
    return DTYPES[name.removeprefix("torch.")]


@dataclass(frozen=True)
class TensorMeta:
    """A tensor announced by name, dtype and shape (a broadcast still to come, or a bucket's entry)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @classmethod
    def parse(cls, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list["TensorMeta"]:
        """The announced tensors, or a ValueError: three lists of one length, known dtypes."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"names, dtypes and shapes must have one length, got {len(names)}, {len(dtypes)} and {len(shapes)}.")
        if any(any(n < 0 for n in s) for s in shapes):
            raise ValueError("shapes must not have negative sizes.")
        return [cls(n, dtype_named(d), tuple(s)) for n, d, s in zip(names, dtypes, shapes)]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def packed_buffers(metas: list[TensorMeta], limit: int = PACKED_BUFFER_BYTES) -> list[list[TensorMeta]]:
    """The tensors of each of vLLM's packed buffers, in broadcast order (see PACKED)."""
    buffers, pending, size = [], [], 0
    for meta in metas:
        pending.append(meta)
        size += meta.nbytes
        if size > limit:
            buffers.append(pending)
            pending, size = [], 0
    return buffers + ([pending] if pending else [])


def unpack(buffer_B: torch.Tensor, metas: list[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of one packed uint8 buffer, as views of it."""
    parts = buffer_B.split([m.nbytes for m in metas])
    return [(m.name, part.view(m.dtype).view(m.shape)) for m, part in zip(metas, parts)]


def flat_dtype(metas: list[TensorMeta]) -> torch.dtype:
    """The dtype of SGLang's flat buffer for these tensors: torch.cat's, which promotes (floats only:
    a quantized checkpoint's stored tensors may share a buffer only with their own dtype)."""
    dtype = metas[0].dtype
    for meta in metas[1:]:
        check_conversion(meta, dtype)
        dtype = torch.promote_types(dtype, meta.dtype)
    return dtype


def check_conversion(meta: TensorMeta, dtype: torch.dtype) -> None:
    if meta.dtype != dtype and not (meta.dtype in FLOATS and dtype in FLOATS):
        raise ValueError(
            f"{meta.name!r} is {meta.dtype} and its flat buffer {dtype}: a flat buffer converts its tensors, which "
            "only floats survive; send stored quantized tensors in a buffer of their own dtype or one by one."
        )


def unflatten(flat: torch.Tensor, metas: list[TensorMeta], starts: list[int]) -> list[tuple[str, torch.Tensor]]:
    """Each tensor as a view of `flat` from its start (converted where its dtype is not flat's)."""
    out = []
    for meta, start in zip(metas, starts):
        if not 0 <= start <= start + meta.numel <= flat.numel():
            raise ValueError(f"{meta.name!r} lies outside its flat buffer of {flat.numel()} elements.")
        check_conversion(meta, flat.dtype)
        out.append((meta.name, flat[start:start + meta.numel].view(meta.shape).to(meta.dtype)))
    return out


class SharedPayload:
    """Bytes in a memory file (a Linux memfd) that any process of this machine can open by `path`
    while this object is open: pickled (for the engine process), it is that path, not its bytes."""

    def __init__(self, size: int):
        self.fd = os.memfd_create("moeshard-payload", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self.path = f"/proc/{os.getpid()}/fd/{self.fd}"
        self.memory = mmap.mmap(self.fd, size)

    @classmethod
    def of(cls, data: bytes) -> "SharedPayload":
        payload = cls(len(data))
        payload.memory[:] = data
        return payload

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def close(self) -> None:
        self.memory.close()
        os.close(self.fd)


def read_payload(payload: SharedPayload | bytes, load_format: str | None = None) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a safetensors payload, or of the flattened bucket it holds; each
    tensor a view of the payload's memory. A ValueError says what is wrong with the bytes."""
    own = not isinstance(payload, SharedPayload)
    try:
        shared = SharedPayload.of(payload) if own else payload
        try:
            handle = safe_open(shared.path, framework="pt")
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        finally:
            if own:
                shared.close()  # the tensors keep their own mapping of the memory
    except Exception as exc:  # safetensors says what is wrong with the bytes
        raise ValueError(f"it is not a safetensors file ({exc})") from None
    if load_format is None:
        return list(tensors.items())
    entries = handle.metadata() or {}
    return [pair for name, flat in tensors.items() for pair in bucket_entries(name, flat, entries.get(name))]


def bucket_entries(name: str, flat: torch.Tensor, listing: str | None) -> list[tuple[str, torch.Tensor]]:
    """The tensors a flattened bucket's buffer `name` holds, by its JSON listing."""
    if flat.dim() != 1:
        raise ValueError(f"the flattened bucket's buffer {name!r} has {flat.dim()} dimensions; it must be flat (1-D)")
    if listing is None:
        raise ValueError(f"the flattened bucket's buffer {name!r} has no listing in the header's metadata")
    try:
        entries = json.loads(listing)
        metas, starts = [], []
        for e in entries:
            meta = TensorMeta(e["name"], dtype_named(e.get("dtype", str(flat.dtype))), tuple(e["shape"]))
            if not isinstance(meta.name, str) or not all(isinstance(n, int) and n >= 0 for n in meta.shape):
                raise ValueError("a name must be a string and a shape non-negative integers")
            if e["end_idx"] - e["start_idx"] != meta.numel or e.get("numel", meta.numel) != meta.numel:
                raise ValueError(f"{meta.name!r} spans {e['end_idx'] - e['start_idx']} elements, but its shape holds {meta.numel}")
            metas.append(meta)
            starts.append(e["start_idx"])
        return unflatten(flat, metas, starts)
    except (TypeError, KeyError, json.JSONDecodeError, ValueError) as exc:
        raise ValueError(f"the listing of the flattened bucket's buffer {name!r} in the metadata is not valid ({exc})") from None


def flattened_bucket(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> bytes:
    """The trainer's side: `named_tensors` as a flattened-bucket payload, one flat buffer per dtype
    (named by it), each with its SGLang-style listing."""
    buffers: dict[str, list[torch.Tensor]] = {}
    listings: dict[str, list[dict]] = {}
    for name, tensor in named_tensors:
        key = str(tensor.dtype).removeprefix("torch.")
        parts, listing = buffers.setdefault(key, []), listings.setdefault(key, [])
        start = listing[-1]["end_idx"] if listing else 0
        listing.append({"name": name, "shape": list(tensor.shape), "dtype": key, "start_idx": start,
                        "end_idx": start + tensor.numel(), "numel": tensor.numel()})
        parts.append(tensor.reshape(-1))
    return save({k: torch.cat(v) for k, v in buffers.items()}, metadata={k: json.dumps(v) for k, v in listings.items()})
