"""A small checkpoint for the examples to read when they are given none:
two shards and their index, written with safetensors (pip install
safetensors), in a temporary directory that lives as long as the process."""

import atexit
import json
import os
import shutil
import tempfile


def tiny_checkpoint():
    """The directory of a two-shard checkpoint (12 tensors, about 1 MB)."""
    import torch
    from safetensors.torch import save_file

    folder = tempfile.mkdtemp(prefix="instant-staging-example-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    torch.manual_seed(0)
    weight_map = {}
    for shard in (1, 2):
        name = f"model-0000{shard}-of-00002.safetensors"
        tensors = {f"model.layers.{layer}.{part}.weight": torch.randn(128, 128, dtype=torch.bfloat16)
                   for layer in range(3 * (shard - 1), 3 * shard) for part in ("q_proj", "o_proj")}
        save_file(tensors, os.path.join(folder, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return folder
