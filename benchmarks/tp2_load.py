#!/usr/bin/env python3
"""Two ranks (tensor parallel 2) each loading their own shard at the same time.

    torchrun --nproc-per-node 2 benchmarks/tp2_load.py [--size-per-rank 4GiB]
        [--dir DIR] [--runs plain,register=invalid_value] [--repeat 3] [--json PATH]

Each rank takes GPU local_rank (ranks share one when there are fewer
GPUs, and say so), generates its shard once (reused when present) and
reads it so the page cache is hot.  Then, for each run, it sets
INSTANT_STAGING_FAULTS to the run's spec ("plain": unset), makes the
2 GiB staging buffer of InstantTensor's convention (256 x 8 MiB,
copy_unit 8 MiB) through the default runtime, and --repeat times: waits
at a barrier, loads its shard with load_file(staging=buf), verifies it
bit-exact against the shard's checksums and prints rank, kind, seconds
and GB/s.  Rank 0 prints the aggregate: both shards' bytes over the
slower rank's time.  By default the two runs are the plain host and the
failing host of the change request ('register=invalid_value': every
registration refused, RUNTIME_PINNED).

Barriers only, over gloo (NCCL_NVLS_ENABLE=0 stays set for any NCCL use).
Without a GPU the ranks load to the CPU through the simulated runtime.
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C
import bench_load as B

import instant_staging as ist
from instant_staging import loader


def setup_rank(torch, dist):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        device = torch.device("cuda", local % count)
        torch.cuda.set_device(device)
        shared = count < world
    else:
        device, shared = torch.device("cpu"), False
    return rank, world, device, shared


def shard(args, rank, world, checker, dist):
    path = os.path.join(args.dir, f"tp{world}-rank{rank}-{args.size // C.MiB}MiB.safetensors")
    if not os.path.exists(path) or os.path.getsize(path) < args.size:
        C.progress(f"rank {rank}: generating {path}")
        B.generate(path, args.size, seed=1000 + rank)
    B.warm(path)
    reference = checker.reference(path)
    dist.barrier()
    return path, reference


def make_staging(spec, device):
    if spec == "plain":
        os.environ.pop("INSTANT_STAGING_FAULTS", None)
    else:
        os.environ["INSTANT_STAGING_FAULTS"] = spec
    runtime = None
    if device.type == "cpu":   # no driver here: the simulated runtime plays the host
        from instant_staging.testing import SimulatedRuntime
        runtime = SimulatedRuntime(faults=None if spec == "plain" else spec)
    t0 = time.perf_counter()
    buf = ist.StagingBuffer(B.STAGING_BYTES, copy_unit=loader.DEFAULT_CHUNK_SIZE, runtime=runtime)
    return buf, time.perf_counter() - t0


def one_run(spec, path, reference, device, checker, torch, dist, repeat):
    buf, staging_s = make_staging(spec, device)
    times, checks = [], []
    try:
        for _ in range(repeat):
            B._free(torch, device)
            dist.barrier()
            t0 = time.perf_counter()
            result = loader.load_file(path, str(device), staging=buf)
            B.sync(torch, device)
            times.append(time.perf_counter() - t0)
            checks.append(checker.verify(result, reference))
            del result
    finally:
        kind = buf.kind.name
        buf.close()
        os.environ.pop("INSTANT_STAGING_FAULTS", None)
    return dict(run=spec, kind=kind, staging_s=staging_s, times=times,
                bit_exact=all(c == "ok" for c in checks),
                problems=sorted(set(c for c in checks if c != "ok")))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-per-rank", dest="size", type=ist.parse_size, default=4 << 30)
    ap.add_argument("--dir", default=B.DEFAULT_DIR)
    ap.add_argument("--runs", default="plain,register=invalid_value",
                    help="comma-separated: 'plain' or an INSTANT_STAGING_FAULTS spec each")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    C.quiet_logging(args.verbose)
    import torch
    import torch.distributed as dist
    rank, world, device, shared = setup_rank(torch, dist)
    os.makedirs(args.dir, exist_ok=True)
    checker = B.Checker(torch, device)
    path, reference = shard(args, rank, world, checker, dist)
    nbytes = os.path.getsize(path)
    if rank == 0:
        print(f"tp{world}_load: {world} ranks, {C.fmt_size(nbytes)} shard each, device "
              f"{device.type}" + (" (ranks SHARE a GPU)" if shared else "")
              + ("" if device.type == "cuda" else " (NO GPU: CPU copies, simulated runtime)"),
              flush=True)
    records = []
    for spec in [s.strip() for s in args.runs.split(",") if s.strip()]:
        rec = one_run(spec, path, reference, device, checker, torch, dist, args.repeat)
        rec.update(rank=rank, device=str(device), bytes=nbytes)
        best = min(rec["times"])
        print(f"rank {rank} [{spec}] kind {rec['kind']}, staging {rec['staging_s']:.2f} s, "
              f"load best {best:.3f} s median {statistics.median(rec['times']):.3f} s = "
              f"{nbytes / best / 1e9:.1f} GB/s, bit-exact {'yes' if rec['bit_exact'] else 'NO'}",
              flush=True)
        records.append(rec)
        everyone = [None] * world
        dist.all_gather_object(everyone, rec)
        if rank == 0:
            report(spec, everyone)
    if rank == 0 and args.json:
        gathered = [None] * world
        dist.all_gather_object(gathered, records)
        C.write_json(args.json, dict(world=world, shared_gpu=shared, ranks=gathered))
    elif args.json:
        dist.all_gather_object([None] * world, records)
    ok = all(r["bit_exact"] for r in records)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


def report(spec, everyone):
    """Aggregate of one run: all shards' bytes over the slower rank's time."""
    total = sum(r["bytes"] for r in everyone)
    per_repeat = [max(ts) for ts in zip(*(r["times"] for r in everyone))]
    kinds = ", ".join(sorted({r["kind"] for r in everyone}))
    print(f"[{spec}] all {len(everyone)} ranks ({kinds}): best {min(per_repeat):.3f} s = "
          f"{total / min(per_repeat) / 1e9:.1f} GB/s aggregate, median "
          f"{total / statistics.median(per_repeat) / 1e9:.1f} GB/s; bit-exact "
          f"{'yes' if all(r['bit_exact'] for r in everyone) else 'NO'}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
