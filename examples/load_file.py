"""load_file: a whole checkpoint (a file, a list, a directory or an index)
into a dict of tensors, as safetensors.torch.load_file.

    python examples/load_file.py [CHECKPOINT] [--device cuda:0]

Without CHECKPOINT it writes a small one first.  Runs on the CPU.
"""

import argparse

import torch

from instant_staging.loader import Checkpoint, load_file


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    source = args.checkpoint
    if source is None:
        from _checkpoint import tiny_checkpoint
        source = tiny_checkpoint()

    tensors = load_file(source, args.device)                      # every tensor, as safetensors'
    print(f"{len(tensors)} tensors on {args.device}, e.g. {next(iter(tensors))}")

    # converted to another floating dtype on the device, only some of them
    some = load_file(source, args.device, dtype=torch.float32,
                     names=lambda name: name.startswith("model.layers.0."))
    print(sorted(some), {t.dtype for t in some.values()})

    # what a load did: bytes, seconds, GB/s, the staging buffer's kind
    with Checkpoint.open(source) as checkpoint:
        checkpoint.load(args.device)
        print(checkpoint.last_report)


if __name__ == "__main__":
    main()
