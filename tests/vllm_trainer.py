"""The trainer rank 0 of vLLM's weight transfer, as SkyRL drives it (tests/skyrl_driver.py starts it):
vLLM's own trainer side (NCCLWeightTransferEngine.trainer_init / trainer_send_weights) needs CUDA
and NCCL, so this does the same over gloo: the group formed by rendezvous at the trainer's address
(rank 0, it hosts the store; vLLM: StatelessProcessGroup + PyNcclCommunicator), then the weights
packed as vLLM packs them (vllm/distributed/weight_transfer/packed_tensor.py, pack_tensors): each
tensor's bytes appended to a uint8 buffer until the buffer holds more than `packed_buffer_size_bytes`
(1 GiB by default, which SkyRL keeps), one broadcast per buffer. Prints two JSON lines: the weights'
metadata (SkyRL's `weight_metadata`: names, dtype_names, shapes), then what was sent.

    python tests/vllm_trainer.py CHECKPOINT ADDRESS PORT WORLD_SIZE
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from moeshard.engine.weight_sync import GroupSpec, WeightsGroup

PACKED_BUFFER_SIZE_BYTES = 1024**3  # vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES


def packed(tensors: list[torch.Tensor], limit: int = PACKED_BUFFER_SIZE_BYTES) -> list[torch.Tensor]:
    buffers, pending, size = [], [], 0
    for tensor in tensors:
        pending.append(tensor.contiguous().view(torch.uint8).view(-1))
        size += pending[-1].numel()
        if size > limit:
            buffers.append(torch.cat(pending))
            pending, size = [], 0
    return buffers + ([torch.cat(pending)] if pending else [])


def main(checkpoint: str, address: str, port: int, world_size: int) -> None:
    weights = load_file(Path(checkpoint) / "model.safetensors")
    names = list(weights)
    print(json.dumps({"names": names, "dtype_names": [str(weights[n].dtype).removeprefix("torch.") for n in names],
                      "shapes": [list(weights[n].shape) for n in names]}), flush=True)
    group = WeightsGroup.join(GroupSpec(address, port, 1, world_size, timeout_s=120), 0)
    buffers = packed([weights[n] for n in names])
    for buffer in buffers:
        group.broadcast(buffer)
    print(json.dumps({"buffers": len(buffers), "bytes": sum(b.numel() for b in buffers)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
