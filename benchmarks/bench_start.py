#!/usr/bin/env python3
"""The host's share of a load's start, per tensor, as checkpoints grow.

Modern MoE checkpoints hold 20,000-90,000 tensors; what a load does per
tensor before its first byte is read (headers parsed, names checked, the
plan) must not grow faster than the tensors do.  For each count N this
writes a checkpoint of N tensors of 1 MiB in shards of 2,340 (the header
and a sparse file: nothing is ever read, no disk is used) and times, in
this process, median of --runs:

  open      Checkpoint.open(paths): files opened, headers parsed and checked
  prepare   ckpt.iter_load(device): the selection, the dtypes, the plan (the
            iterator made, not iterated: nothing allocated, nothing read)
  batch     ckpt.iter_load(device, names=batch) for each batch of consecutive
            tensors of vLLM's load format's size (1 GiB: 1,024 tensors),
            the median per batch (a load of names must cost what its
            selection holds, not what the checkpoint does)

No GPU is needed (the default device is cuda:0 where torch sees one, else
cpu; the plan of a GPU load joins tensors into blocks, a CPU load's does not).

Then one tensor at a time: ``safe_open(path).get_tensor(name)`` for every
name of a file of 4,680 tensors of 512 bytes, to the CPU, ours and
safetensors' (its mmap), median us per tensor of --runs: what a caller
that reads a file the way transformers and vLLM read safetensors waits
per call.

    python benchmarks/bench_start.py [--tensors 4680,20000,90000] [--runs 7]
        [--device cpu] [--dir DIR] [--json PATH]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C
import bench_load as B

from instant_staging import loader
from instant_staging.integrations.vllm._options import BATCH_BYTES

PER_SHARD = 2340
TENSOR_SHAPE = (512, 1024)        # bf16: 1 MiB
ONE_BY_ONE = 4680                 # get_tensor's file: tensors of 512 bytes


def expert(j):
    """Tensor j's name: MoE experts' projections, 65 experts a layer."""
    return f"model.layers.{j // 195}.mlp.experts.{j % 195 // 3}.w{j % 3}.weight"


def sparse_checkpoint(directory, n):
    """N 1 MiB bf16 tensors with MoE expert names in shards of PER_SHARD,
    each file its header and a hole; returns the paths."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for shard, k in enumerate(range(0, n, PER_SHARD)):
        tensors = [(expert(j), list(TENSOR_SHAPE)) for j in range(k, min(k + PER_SHARD, n))]
        head, data_bytes = B.encode_header(tensors)
        path = os.path.join(directory, f"model-{shard:05d}.safetensors")
        with open(path, "wb") as f:
            f.write(head)
            f.truncate(len(head) + data_bytes)
        paths.append(path)
    return paths


def once(paths, device):
    t0 = time.perf_counter()
    ck = loader.Checkpoint.open(paths)
    t1 = time.perf_counter()
    it = ck.iter_load(device)
    t2 = time.perf_counter()
    it.close()
    ck.close()
    return t1 - t0, t2 - t1


def batches(paths, device):
    """The start of a load of each batch of names, seconds (median)."""
    with loader.Checkpoint.open(paths) as ck:
        names = ck.names()
        per_batch = BATCH_BYTES // ck.info(names[0]).nbytes
        times = []
        for k in range(0, len(names), per_batch):
            t0 = time.perf_counter()
            ck.iter_load(device, names=names[k:k + per_batch]).close()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", default="4680,20000,90000")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        counts = [int(n) for n in args.tensors.split(",")]
    except ValueError:
        ap.error(f"--tensors takes counts, got {args.tensors!r}")
    if not counts or min(counts) < 1 or args.runs < 1:
        ap.error("--tensors and --runs need positive numbers")
    torch = loader.import_torch()
    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    rows, records = [], []
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        for n in counts:
            paths = sparse_checkpoint(os.path.join(scratch, str(n)), n)
            once(paths, device)              # warm: imports, the first torch calls
            times = [once(paths, device) for _ in range(args.runs)]
            opened = statistics.median(t[0] for t in times)
            prepared = statistics.median(t[1] for t in times)
            batch = batches(paths, device)
            rows.append([n, len(paths), f"{opened * 1e3:.2f}", f"{prepared * 1e3:.2f}",
                         f"{(opened + prepared) / n * 1e6:.2f}", f"{batch * 1e3:.2f}"])
            records.append({"tensors": n, "shards": len(paths), "open_s": opened,
                            "prepare_s": prepared, "batch_s": batch})
        one_by_one = get_tensor_each(scratch, args.runs)
    print(f"bench_start: device {device}, median of {args.runs} runs")
    print(C.table(["tensors", "shards", "open ms", "prepare ms", "us per tensor",
                   "batch ms"], rows))
    print(f"get_tensor one by one, {ONE_BY_ONE} tensors of 512 bytes to the CPU, us per tensor: "
          + ", ".join(f"{name} {us:.1f}" for name, us in one_by_one.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "runs": args.runs, "results": records,
                       "get_tensor_us": one_by_one}, f, indent=2)
    return 0


def get_tensor_each(directory, runs):
    """{reader: median us per get_tensor} over a file of ONE_BY_ONE small
    tensors (written with data: every call reads)."""
    from safetensors import safe_open as upstream_open
    path, = B.generate(directory, [("small.safetensors",
                                    [(expert(j), [16, 16]) for j in range(ONE_BY_ONE)])])
    out = {}
    for name, opener in (("instant_staging", loader.safe_open), ("safetensors", upstream_open)):
        times = []
        for _ in range(runs + 1):           # (the first warms)
            with opener(path, framework="pt") as f:
                keys = list(f.keys())
                t0 = time.perf_counter()
                for k in keys:
                    f.get_tensor(k)
                times.append((time.perf_counter() - t0) / len(keys))
        out[name] = statistics.median(times[1:]) * 1e6
    return out


if __name__ == "__main__":
    sys.exit(main())
