#!/usr/bin/env python3
"""A load under a process group, as one command: several processes on one
GPU (gloo moves CUDA tensors through the host), CPU ranks for scaling, and
NCCL where the host has a GPU per rank; bit-exact against a solo load, with
faults, and the collectives each load made.

    python benchmarks/group_load.py [--modes auto] [--ranks 2,4,8]
        [--tensor-bytes 256KiB] [--repeat 3] [--dir DIR] [--json PATH]

It writes two checkpoints of the same bytes once (reused when present):
``finemoe``, bench_load's fine-grained MoE shape (4,680 tensors in 2
shards), and ``dense``, the Llama-3-8B tensor count (291 tensors in 4
shards); ``--tensor-bytes`` is the size of one fine-grained tensor (1 MiB
in bench_load; 256 KiB here by default, so 8 processes on one GPU fit).

Modes (``--modes``, comma-separated; ``auto``: ``gpu-gloo`` and, with two
GPUs or more, ``nccl`` on a GPU host, ``cpu`` always):

  gpu-gloo   every rank on cuda:0, a gloo group: the device path of a group
             load (buckets on the device, moved through the host by gloo)
             without two GPUs
  nccl       rank r on cuda:r, an NCCL group (ranks above the GPU count are
             skipped)
  cpu        device='cpu', a gloo group

For each mode and rank count the script starts the ranks itself (no
torchrun), and each rank: loads each checkpoint once (page cache hot, CUDA
started), then ``--repeat`` times after a barrier ``load_file(path,
device, process_group=pg)``, the time the slower rank's; counts the calls
of torch.distributed's collectives during one load (wrapped); compares the
group load's tensors with its own solo load of the same file, bit for bit
on the device; and two faults, each must fail on every rank within seconds
and leave nothing (no file open, on the GPU torch's allocated memory back
where it was): ``bad device`` (rank 1 asks for a device the host does not
have) and ``read EIO`` (INSTANT_STAGING_FAULTS='read#1=EIO' on rank 1).

The table: per mode, ranks and layout, the median seconds, GB/s (the
checkpoint's bytes over the time), finemoe's time over dense's (the goal of
issue 45: <= 1.2), collectives per load, and whether every rank's load
was bit-exact; then the faults.
"""

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common as C  # noqa: E402  (puts the checkout on sys.path where needed)

import instant_staging as ist  # noqa: E402

FINE_TENSORS, FINE_SHARDS = 4680, 2
DENSE_TENSORS, DENSE_SHARDS = 291, 4
COLLECTIVES = ["broadcast", "all_gather", "all_gather_into_tensor", "all_reduce", "reduce",
               "reduce_scatter", "reduce_scatter_tensor", "scatter", "gather", "all_to_all",
               "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv",
               "broadcast_object_list", "all_gather_object"]


# -- the checkpoints -----------------------------------------------------------

def write_layouts(directory, tensor_bytes):
    """{layout: [paths]}: both checkpoints, written once per size."""
    import torch
    from safetensors.torch import save_file
    total = FINE_TENSORS * tensor_bytes
    out = {}
    for layout, count, shards in (("finemoe", FINE_TENSORS, FINE_SHARDS),
                                  ("dense", DENSE_TENSORS, DENSE_SHARDS)):
        where = os.path.join(directory, f"{layout}-{tensor_bytes}")
        paths = [os.path.join(where, f"model-{s:05d}-of-{shards:05d}.safetensors")
                 for s in range(shards)]
        out[layout] = paths
        if all(os.path.exists(p) for p in paths):
            continue
        os.makedirs(where, exist_ok=True)
        elems = total // 2                       # bf16
        sizes = [elems // count] * count
        sizes[-1] += elems - sum(sizes)
        g = torch.Generator().manual_seed(count)
        per = -(-count // shards)
        for s, path in enumerate(paths):
            tensors = {}
            for k in range(s * per, min(count, (s + 1) * per)):
                tensors[f"model.layers.{k // 16}.w{k % 16:02d}.weight"] = torch.randint(
                    0, 1 << 15, (sizes[k],), dtype=torch.int16, generator=g).view(torch.bfloat16)
            save_file(tensors, path + ".tmp")
            os.replace(path + ".tmp", path)
    return out


# -- one rank --------------------------------------------------------------------

def rank_main(spec):
    import torch
    import torch.distributed as dist

    from instant_staging.loader import _distributed, load_file
    rank, world, mode = spec["rank"], spec["world"], spec["mode"]
    if spec["bucket"]:
        _distributed.BUCKET_BYTES = _distributed.HOST_BUCKET_BYTES = spec["bucket"]
    backend = "nccl" if mode == "nccl" else "gloo"
    if mode == "cpu":
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", rank if mode == "nccl" else 0)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    pg = dist.group.WORLD
    barrier_pg = dist.new_group(backend="gloo")      # barriers, times: never counted
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    calls = []

    def counted(name, real):
        def f(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return f
    real = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}

    def gather(value):
        out = [None] * world
        dist.all_gather_object(out, value, group=barrier_pg)
        return out

    result = {"layouts": {}, "faults": {}}
    for layout, paths in spec["layouts"].items():
        nbytes = None
        got = load_file(paths, device, process_group=pg)          # warm: cache, CUDA, gloo
        del got
        times = []
        for _ in range(spec["repeat"]):
            dist.barrier(group=barrier_pg)
            t0 = time.perf_counter()
            got = load_file(paths, device, process_group=pg)
            sync()
            times.append(time.perf_counter() - t0)
            del got
        for n, f in real.items():
            setattr(dist, n, counted(n, f))
        try:
            del calls[:]
            got = load_file(paths, device, process_group=pg)
            sync()
            count = len(calls)
        finally:
            for n, f in real.items():
                setattr(dist, n, f)
        solo = load_file(paths, device)
        exact = list(got) == list(solo) and all(
            got[k].dtype == solo[k].dtype and got[k].shape == solo[k].shape
            and torch.equal(got[k].view(torch.int16), solo[k].view(torch.int16)) for k in solo)
        nbytes = sum(t.numel() * t.element_size() for t in solo.values())
        tensors = len(solo)
        del got, solo
        everyone = gather(times)
        slowest = [max(ts[i] for ts in everyone) for i in range(spec["repeat"])]
        result["layouts"][layout] = dict(seconds=slowest, collectives=gather(count),
                                         exact=gather(exact), bytes=nbytes, tensors=tensors)
    paths = spec["layouts"]["dense"]
    for fault in ("bad device", "read EIO"):
        import gc
        if device.type == "cuda":
            sync()
            before = torch.cuda.memory_allocated(device)
        dev = device
        if fault == "bad device" and rank == 1:
            dev = f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
        if fault == "read EIO" and rank == 1:
            os.environ["INSTANT_STAGING_FAULTS"] = "read#1=EIO"
        dist.barrier(group=barrier_pg)
        t0 = time.perf_counter()
        try:
            load_file(paths, dev, process_group=pg)
            rec = dict(error=None)
        except Exception as e:
            rec = dict(error=type(e).__name__, message=str(e)[:300])
        finally:
            os.environ.pop("INSTANT_STAGING_FAULTS", None)
        rec["seconds"] = time.perf_counter() - t0
        gc.collect()
        real_paths = {os.path.realpath(p) for p in paths}
        rec["open"] = sum(_link(f"/proc/self/fd/{fd}") in real_paths for fd in os.listdir("/proc/self/fd"))
        if device.type == "cuda":
            sync()
            rec["leaked"] = torch.cuda.memory_allocated(device) - before
        result["faults"][fault] = gather(rec)
        # (a rank that failed mid-exchange would leave the group's collectives
        # out of step; these faults fail before the exchange starts or, read
        # EIO, with every bucket still exchanged: the group stays usable)
    if rank == 0:
        with open(spec["out"], "w") as f:
            json.dump(result, f)
    dist.barrier(group=barrier_pg)
    dist.destroy_process_group()


def _link(path):
    try:
        return os.readlink(path)
    except OSError:
        return None


# -- the driver ----------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(mode, world, layouts, repeat, directory, timeout, bucket):
    out = os.path.join(directory, f"result-{mode}-{world}.json")
    if os.path.exists(out):
        os.remove(out)
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("INSTANT_STAGING_FAULTS", None)
    procs = []
    for r in range(world):
        spec = dict(rank=r, world=world, mode=mode, port=port, layouts=layouts, repeat=repeat, out=out,
                    bucket=bucket)
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank-spec",
                                       json.dumps(spec)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    texts = []
    try:
        for p in procs:
            texts.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = [(r, p.returncode, t) for r, (p, t) in enumerate(zip(procs, texts)) if p.returncode]
    if bad or not os.path.exists(out):
        r, code, text = bad[0] if bad else (0, 0, texts[0])
        raise SystemExit(f"{mode} x{world}: rank {r} exited {code}:\n{text[-3000:]}")
    with open(out) as f:
        return json.load(f)


def fault_ok(recs, cuda):
    """Every rank failed, rank 1 with its own error and the others with
    DistributedLoadError, within seconds, leaving nothing."""
    return (all(rec["error"] for rec in recs)
            and all(rec["error"] == "DistributedLoadError" for r, rec in enumerate(recs) if r != 1)
            and recs[1]["error"] != "DistributedLoadError"
            and all(rec["seconds"] < 30 and rec["open"] == 0 for rec in recs)
            and (not cuda or all(rec.get("leaked") == 0 for rec in recs)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="auto")
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--tensor-bytes", type=ist.parse_size, default=256 << 10)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "ist-group-load"))
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", default=None)
    ap.add_argument("--bucket", type=ist.parse_size, default=None,
                    help="the exchange's bucket size (default: the loader's)")
    ap.add_argument("--rank-spec", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank_spec is not None:
        return rank_main(json.loads(args.rank_spec))
    import torch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    modes = args.modes.split(",")
    if modes == ["auto"]:
        modes = (["gpu-gloo"] if gpus else []) + (["nccl"] if gpus >= 2 else []) + ["cpu"]
    if {"gpu-gloo", "nccl"} & set(modes) and not gpus:
        ap.error("gpu-gloo and nccl need a GPU")
    ranks = [int(x) for x in args.ranks.split(",")]
    os.makedirs(args.dir, exist_ok=True)
    layouts = write_layouts(args.dir, args.tensor_bytes)
    for paths in layouts.values():                # the page cache hot for every mode
        for p in paths:
            with open(p, "rb") as f:
                while f.read(64 << 20):
                    pass
    from instant_staging.loader import _distributed
    if args.bucket:
        _distributed.BUCKET_BYTES = _distributed.HOST_BUCKET_BYTES = args.bucket
    buckets = (f"buckets of {C.fmt_size(_distributed.BUCKET_BYTES)} on a GPU, "
               f"{C.fmt_size(_distributed.HOST_BUCKET_BYTES)} on the CPU, "
               f"{_distributed.BUCKET_SLOTS} a rank"
               if hasattr(_distributed, "BUCKET_BYTES") else "an exchange per tensor")
    print(f"group loads: {C.fmt_size(FINE_TENSORS * args.tensor_bytes)} as {FINE_TENSORS} and "
          f"{DENSE_TENSORS} tensors; {buckets}; torch {torch.__version__}, "
          f"{torch.cuda.get_device_name(0) if gpus else 'no GPU'}", flush=True)
    rows, faults, doc = [], [], []
    for mode in modes:
        for world in ranks:
            if mode == "nccl" and world > gpus:
                print(f"nccl x{world}: skipped, {gpus} GPU(s)", flush=True)
                continue
            res = run_world(mode, world, layouts, args.repeat, args.dir, args.timeout, args.bucket)
            doc.append(dict(mode=mode, ranks=world, **res))
            dense = statistics.median(res["layouts"]["dense"]["seconds"])
            for layout in ("dense", "finemoe"):
                rec = res["layouts"][layout]
                s = statistics.median(rec["seconds"])
                rows.append([mode, world, layout, rec["tensors"], C.fmt_size(rec["bytes"]),
                             C.fmt(s), C.fmt(rec["bytes"] / s / 1e9, ".2f"),
                             C.fmt(s / dense, ".2f") if layout == "finemoe" else "",
                             "/".join(map(str, sorted(set(rec["collectives"])))),
                             "yes" if all(rec["exact"]) else "NO"])
            for fault, recs in res["faults"].items():
                faults.append([mode, world, fault, "yes" if fault_ok(recs, mode != "cpu") else "NO",
                               C.fmt(max(rec["seconds"] for rec in recs)),
                               f"rank 1: {recs[1]['error']}, others: "
                               f"{','.join(sorted({str(r['error']) for i, r in enumerate(recs) if i != 1}))}",
                               max(rec["open"] for rec in recs),
                               C.fmt_size(max(rec.get("leaked", 0) for rec in recs))])
            print(f"{mode} x{world}: done", flush=True)
    print()
    print(C.table(["mode", "ranks", "layout", "tensors", "bytes", "seconds", "GB/s",
                   "vs dense", "collectives", "bit-exact"], rows))
    print()
    print(C.table(["mode", "ranks", "fault", "ok", "seconds", "errors", "open files",
                   "leaked"], faults))
    if args.json:
        C.write_json(args.json, dict(tensor_bytes=args.tensor_bytes, results=doc))
    bad = [r for r in rows if r[-1] != "yes"] + [f for f in faults if f[3] != "yes"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
