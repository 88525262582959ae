"""A trainer process for the RL-route tests: joins a running `moeshard serve`'s weights group and
sends it a checkpoint's weights over the group, or misbehaves as told. Prints one JSON line.

    python tests/weights_trainer.py URL CHECKPOINT PORT MODE VERSION
    MODE: update (every tensor), wrong-shape (one tensor announced and sent one row too long),
          break-off (the process exits before the last announced tensor)
"""

import json
import os
import sys
import threading

import torch
from safetensors.torch import load_file

from moeshard.demos.remote import EngineRefused, RemoteEngine


def main(url: str, checkpoint: str, port: int, mode: str, version: str) -> None:
    weights = load_file(os.path.join(checkpoint, "model.safetensors"))
    engine = RemoteEngine(url)
    engine.join_weights_group(port, timeout_s=60)
    if mode == "wrong-shape":
        name = next(n for n in weights if n.endswith("input_layernorm.weight"))
        weights[name] = torch.ones(weights[name].shape[0] + 1, dtype=weights[name].dtype)
    if mode == "break-off":
        names = list(weights)
        body = {"names": names, "dtypes": [str(weights[n].dtype).removeprefix("torch.") for n in names],
                "shapes": [list(weights[n].shape) for n in names], "weight_version": version}
        threading.Thread(target=engine.call, args=("/update_weights_from_distributed", body), daemon=True).start()
        for name in names[:-1]:
            engine.group.broadcast(weights[name])
        print(json.dumps({"sent": len(names) - 1, "of": len(names)}), flush=True)
        os._exit(0)  # mid-update, as a trainer that crashes: the group's connections close
    try:
        answer, seconds = engine.send_weights(weights, version)
        print(json.dumps({"answer": answer, "seconds": seconds}))
    except EngineRefused as exc:
        print(json.dumps({"refused": exc.status, "message": str(exc)}))
    engine.leave_weights_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
