"""safe_open: one file, read tensor by tensor or a slice of rows at a time,
as safetensors.safe_open(..., framework="pt"); and prefetch, safetensors
0.9's background loader.

    python examples/safe_open.py [FILE.safetensors] [--device cuda:0]

Without FILE it writes a small checkpoint first.  Runs on the CPU.
"""

import argparse
import os

from instant_staging.loader import safe_open


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", nargs="?")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    path = args.file
    if path is None:
        from _checkpoint import tiny_checkpoint
        path = os.path.join(tiny_checkpoint(), "model-00001-of-00002.safetensors")

    with safe_open(path, framework="pt", device=args.device) as f:
        names = f.keys()                               # sorted, nothing read yet
        print(len(names), "tensors; metadata", f.metadata())
        whole = f.get_tensor(names[0])                 # reads only that tensor's bytes
        part = f.get_slice(names[0])                   # reads nothing yet
        rows, _ = part.get_shape()
        top = part[: rows // 2]                        # reads only those rows
        print(names[0], tuple(whole.shape), "->", tuple(top.shape), top.dtype)

        # safetensors 0.9's prefetch: loads in the background, each tensor
        # handed out once (here: rank 0 of 2's rows of one tensor, all of another)
        plan = {names[0]: slice(0, rows // 2), names[1]: None}
        with f.prefetch(plan) as loader:
            first = loader.take(names[0])              # waits for that one only
            rest = dict(loader)                        # the others, as they arrive
        print("prefetched", tuple(first.shape), sorted(rest))


if __name__ == "__main__":
    main()
