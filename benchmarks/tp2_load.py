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

    torchrun --nproc-per-node 2 benchmarks/tp2_load.py --layout llama8b [--scale 1]
        [--repeat 3] [--fallback-rank 1] [--json PATH]

``--layout llama8b``: the process group comparison instead.  Rank 0 writes
the Llama-3-8B layout of docs/design.md ("Measured") once (291 bf16 tensors in 4
shards, 16.06 GB; ``--scale k`` divides hidden, intermediate and vocab
sizes by k), or with ``--layout finemoe`` bench_load's fine-grained MoE
(4,680 tensors of 1 MiB in 2 shards, 4.84 GB: a group load's exchange is
one collective per tensor), every rank reads it once (page cache hot),
then, --repeat times each, every rank at once after a barrier:

  everything   load_file(all shards): each rank reads every byte
  half         load_file(half of the shards): each rank reads half, no exchange
  group        load_file(all shards, process_group=pg): each byte read once,
               the halves exchanged over the group (NCCL between GPUs)
  tp2 plain    TP=2 split (column-parallel q/k/v/gate/up/embed/lm_head
               halved on dim 0, row-parallel o/down on dim 1, norms whole):
               load everything, keep this rank's half of every matrix
  tp2 group    the same from a group load
  tp2 rows     the TP=2 split read as such: plan= gives each rank only its
               rows of the dim-0 matrices (the rest whole, the dim-1 ones
               then halved), no group
  tp2 rows group  the same under process_group=: each rank reads its own
               rows, the whole tensors are read once and exchanged

Per-rank seconds (the slower rank per repeat), and the goal of the issue:
group <= 0.65 x everything, and within 15% of half.  Every result is
compared on the device with the plain load (itself the loader the test
suite checks against safetensors) and its first bytes with the file's.
``--fallback-rank r`` adds a group load where rank r's registration is
refused (RUNTIME_PINNED) and prints the staging kinds every rank saw.
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


def setup_rank(torch, dist, group_backend=False):
    """Rank, world, device, whether ranks share a GPU.  ``group_backend``:
    the group carries the loads' exchanges (NCCL with GPUs), else gloo
    barriers only."""
    rank = int(os.environ.get("RANK", 0))
    local = int(os.environ.get("LOCAL_RANK", rank))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        device = torch.device("cuda", local % count)
        torch.cuda.set_device(device)
        shared = count < world
    else:
        device, shared = torch.device("cpu"), False
    if group_backend and device.type == "cuda":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device, shared


def shard(args, rank, world, checker, dist):
    path = os.path.join(args.dir, f"tp{world}-rank{rank}-{args.size // C.MiB}MiB.safetensors")
    if not os.path.exists(path) or os.path.getsize(path) < args.size:
        C.progress(f"rank {rank}: generating {path}")
        B.generate(path, args.size, seed=1000 + rank)
    B.warm([path])
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


# -- the process-group comparison (--layout llama8b) --------------------------

def llama8b(scale=1):
    """(name, shape) of Llama-3-8B in file order: 291 bf16 tensors."""
    h, inter, vocab, kv = 4096 // scale, 14336 // scale, 128256 // scale, 1024 // scale
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(32):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def tp_dim(name):
    """The dimension TP=2 halves (None: kept whole on both ranks)."""
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 1
    if name.endswith("norm.weight"):
        return None
    return 0


def write_llama(directory, scale, shards=4):
    """Writes the layout into ``shards`` files of about equal size (reused when
    present); returns their paths."""
    import json as _json
    import struct as _struct

    import numpy as np
    layout = llama8b(scale)
    sizes = [2 * _prod(shape) for _, shape in layout]
    total, paths, groups, acc = sum(sizes), [], [[]], 0
    for k, n in enumerate(sizes):
        if acc >= total * len(groups) / shards and len(groups) < shards:
            groups.append([])
        groups[-1].append(k)
        acc += n
    rng = np.random.default_rng(7)
    block = rng.integers(0, 1 << 62, 8 << 20, dtype=np.int64)     # 64 MiB of random bits
    for s, group in enumerate(groups):
        path = os.path.join(directory, f"llama8b-s{scale}-{s + 1:05d}-of-{len(groups):05d}.safetensors")
        paths.append(path)
        want = sum(sizes[k] for k in group)
        if os.path.exists(path) and os.path.getsize(path) > want:
            continue
        header, off = {}, 0
        for k in group:
            name, shape = layout[k]
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + sizes[k]]}
            off += sizes[k]
        raw = _json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(path + ".tmp", "wb") as f:
            f.write(_struct.pack("<Q", len(raw)) + raw)
            for k in group:
                left, salt = sizes[k], np.int64((k + 1) * 0x2545F4914F6CDD1D % (1 << 62))
                while left:
                    n = min(left, block.nbytes)
                    f.write((block[: (n + 7) // 8] ^ salt).view(np.uint8)[:n].data)
                    left -= n
        os.replace(path + ".tmp", path)
    return paths


def _prod(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def tp_part(t, dim, rank, world):
    """This rank's share of ``t`` along ``dim`` (a copy that owns its memory)."""
    part = t.shape[dim] // world
    return t.narrow(dim, rank * part, part).clone()


def tp_half(torch, tensors, rank, world):
    """This rank's TP part of every tensor."""
    return {name: t if (dim := tp_dim(name)) is None else tp_part(t, dim, rank, world)
            for name, t in tensors.items()}


def tp_rows_plan(names_and_rows, rank, world):
    """``plan=`` of this rank's TP rows: its share of the dim-0 matrices'
    rows, every other tensor whole."""
    out = {}
    for name, rows in names_and_rows:
        part = rows // world
        out[name] = slice(rank * part, (rank + 1) * part) if tp_dim(name) == 0 else None
    return out


def tp_rows(torch, tensors, rank, world):
    """A load of ``tp_rows_plan`` made this rank's TP part: the dim-1
    matrices halved (the dim-0 ones came as rows)."""
    return {name: tp_part(t, 1, rank, world) if tp_dim(name) == 1 else t
            for name, t in tensors.items()}


def compare_group(args, torch, dist):
    rank, world, device, shared = setup_rank(torch, dist, group_backend=True)
    os.makedirs(args.dir, exist_ok=True)

    def write():
        if args.layout == "finemoe":
            return B.generate(args.dir, B.finemoe_layout(args.scale))
        return write_llama(args.dir, args.scale)
    if rank == 0:
        C.progress(f"writing the {args.layout} layout (scale {args.scale}) under {args.dir}")
        paths = write()
    dist.barrier()
    paths = write() if rank != 0 else paths
    B.warm(paths)
    nbytes = sum(os.path.getsize(p) for p in paths)
    half = paths[: len(paths) // 2] if rank % 2 == 0 else paths[len(paths) // 2:]
    pg = dist.group.WORLD
    dev = str(device)
    if rank == 0:
        print(f"tp2_load --layout {args.layout}: {world} ranks, {len(paths)} shards, {C.fmt_size(nbytes)}, "
              f"device {device.type}, group backend {dist.get_backend()}"
              + (" (ranks SHARE a GPU)" if shared else ""), flush=True)
    reference = loader.load_file(paths, dev)
    B.sync(torch, device)
    problems = spot_check(torch, reference, paths)

    def same(result, ref):
        if list(result) != list(ref):
            return "names differ"
        bad = [n for n in ref if not torch.equal(result[n].view(torch.uint8), ref[n].view(torch.uint8))]
        return f"{len(bad)} tensor(s) differ, e.g. {bad[0]}" if bad else "ok"

    tp_ref = tp_half(torch, reference, rank, world)
    with loader.Checkpoint.open(paths) as ck:
        rows_plan = tp_rows_plan([(n, ck.info(n).shape[0]) for n in ck.names()], rank, world)

    def rows_load(group):
        with loader.Checkpoint.open(paths) as ck:
            return tp_rows(torch, ck.load(dev, plan=rows_plan, process_group=group), rank, world)
    methods = [
        ("everything", lambda: loader.load_file(paths, dev), reference),
        ("half", lambda: loader.load_file(half, dev), None),
        ("group", lambda: loader.load_file(paths, dev, process_group=pg), reference),
        ("tp2 plain", lambda: tp_half(torch, loader.load_file(paths, dev), rank, world), tp_ref),
        ("tp2 group", lambda: tp_half(torch, loader.load_file(paths, dev, process_group=pg), rank, world),
         tp_ref),
        ("tp2 rows", lambda: rows_load(None), tp_ref),
        ("tp2 rows group", lambda: rows_load(pg), tp_ref),
    ]
    times = {name: [] for name, _, _ in methods}
    for _ in range(args.repeat):             # interleaved: drift hits every method alike
        for name, run, ref in methods:
            B._free(torch, device)
            dist.barrier()
            t0 = time.perf_counter()
            result = run()
            B.sync(torch, device)
            times[name].append(time.perf_counter() - t0)
            if ref is not None:
                check = same(result, ref)
                if check != "ok":
                    problems.append(f"{name}: {check}")
            del result
    kinds = None
    if args.fallback_rank is not None:
        if rank == args.fallback_rank:
            os.environ["INSTANT_STAGING_FAULTS"] = "register=invalid_value"
        # A kept staging buffer would serve this load without a registration
        # to refuse: every rank makes its buffer again, as a first load does.
        loader.empty_cache()
        B._free(torch, device)
        dist.barrier()
        t0 = time.perf_counter()
        with loader.iter_load(paths, dev, process_group=pg) as it:
            result = dict(it)
            kinds = [k.name if k is not None else None for k in it.staging_kinds]
        B.sync(torch, device)
        times["group, one rank RUNTIME_PINNED"] = [time.perf_counter() - t0]
        os.environ.pop("INSTANT_STAGING_FAULTS", None)
        check = same(result, reference)
        if check != "ok":
            problems.append(f"fallback: {check}")
        if kinds[args.fallback_rank] != "RUNTIME_PINNED":
            problems.append(f"fallback: rank {args.fallback_rank} reached {kinds[args.fallback_rank]}, "
                            "not RUNTIME_PINNED")
        del result
    rec = dict(rank=rank, device=dev, bytes=nbytes, times=times, kinds=kinds, problems=problems)
    everyone = [None] * world
    dist.all_gather_object(everyone, rec)
    if rank == 0:
        report_group(everyone, nbytes, kinds)
        if args.json:
            C.write_json(args.json, dict(world=world, shared_gpu=shared, bytes=nbytes, ranks=everyone))
    ok = all(not r["problems"] for r in everyone)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


def spot_check(torch, tensors, paths):
    """The first 256 bytes of every tensor against plain reads of the files."""
    import json as _json
    import struct as _struct
    problems = []
    for p in paths:
        with open(p, "rb") as f:
            n = _struct.unpack("<Q", f.read(8))[0]
            header = _json.loads(f.read(n))
            for name, e in header.items():
                f.seek(8 + n + e["data_offsets"][0])
                want = f.read(min(256, e["data_offsets"][1] - e["data_offsets"][0]))
                got = bytes(tensors[name].reshape(-1).view(torch.uint8)[: len(want)].cpu().numpy())
                if got != want:
                    problems.append(f"{name}: first bytes differ from the file")
    return problems


def report_group(everyone, nbytes, kinds):
    """Per method: the slower rank's time per repeat, best and median."""
    rows = {}
    for name in everyone[0]["times"]:
        per = [max(ts) for ts in zip(*(r["times"][name] for r in everyone))]
        rows[name] = (min(per), statistics.median(per))
        print(f"  {name:32s} per-rank best {min(per):.3f} s, median {statistics.median(per):.3f} s "
              f"({nbytes / min(per) / 1e9:.1f} GB/s of the checkpoint per rank)", flush=True)
    if "group" in rows and "everything" in rows and "half" in rows:
        g, e, h = rows["group"][1], rows["everything"][1], rows["half"][1]
        print(f"  group / everything = {g / e:.2f} (goal <= 0.65), group / half = {g / h:.2f} "
              f"(goal <= 1.15), medians", flush=True)
    if "tp2 group" in rows:
        print(f"  tp2 group / tp2 plain = {rows['tp2 group'][1] / rows['tp2 plain'][1]:.2f}, medians",
              flush=True)
    if kinds is not None:
        print(f"  staging kinds with --fallback-rank: {list(kinds)}", flush=True)
    problems = [f"rank {r['rank']}: {p}" for r in everyone for p in r["problems"]]
    verdict = "yes (every method, every rank)" if not problems else "NO: " + "; ".join(problems)
    print("  bit-exact: " + verdict, flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-per-rank", dest="size", type=ist.parse_size, default=4 << 30)
    ap.add_argument("--dir", default=B.DEFAULT_DIR)
    ap.add_argument("--runs", default="plain,register=invalid_value",
                    help="comma-separated: 'plain' or an INSTANT_STAGING_FAULTS spec each")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--layout", choices=["shard-per-rank", "llama8b", "finemoe"],
                    default="shard-per-rank")
    ap.add_argument("--scale", type=int, default=1,
                    help="llama8b, finemoe: divide the dimensions by this")
    ap.add_argument("--fallback-rank", type=int, default=None)
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    C.quiet_logging(args.verbose)
    import torch
    import torch.distributed as dist
    if args.layout in ("llama8b", "finemoe"):
        return compare_group(args, torch, dist)
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
