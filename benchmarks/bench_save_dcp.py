#!/usr/bin/env python3
"""Sharded trainers' saves (issue 57, item 5): torch.distributed.checkpoint
with instant_staging.loader.SafetensorsStorageWriter against DCP's own
HuggingFaceStorageWriter, one process, the same GPU tensors.

bench_save.py's layouts and tensors (--layouts; default dense, 16 GB
Llama-3-8B in 291 bf16 tensors, and finemoe, 4,680 tensors of about 1 MiB),
random bytes made on the device (--device; default the current GPU, else
the CPU), split into files of --shard-size (default 4 GiB) by
``fqn_to_index_mapping``.  ``dcp.save`` without a process group (one
rank).  Each row --repeat times, the checkpoint's directory removed
before each run (best and median GB/s of the layout's
bytes; host peak as bench_save.py measures it):

  ceiling disk           bench_save.py's: SAVE_THREADS threads pwrite pinned
                         memory into one file of the layout's size, fsync
  dcp hf writer          dcp.save(..., storage_writer=HuggingFaceStorageWriter(dir,
                         mapping)): every tensor copied to the host, each file
                         serialised by safetensors.torch.save and written by one
                         thread, fsync
  dcp hf writer, N thr   the same with thread_count=N (its files written N at
                         a time; N = the number of files, at most SAVE_THREADS)
  instant_staging        dcp.save(..., storage_writer=SafetensorsStorageWriter(dir,
                         mapping)): each file published atomically, device
                         tensors staged in chunks, fsync (the default)

"same" says the two writers' files hold the same headers (as JSON: safetensors
orders DCP's three metadata keys by its hash map) and the same data bytes,
and the same index byte for byte (against "dcp hf writer", once per layout).

    python benchmarks/bench_save_dcp.py --dir /nvme/bench [--layouts dense,finemoe]
        [--repeat 3] [--device cuda:0] [--shard-size 4GiB] [--json PATH]
    python benchmarks/bench_save_dcp.py --quick      # CPU smoke test, layouts 64x smaller
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C
import bench_load as BL
import bench_save as BS

import instant_staging as ist
from instant_staging import defaults
from instant_staging.loader import SafetensorsStorageWriter


def shard_mapping(tensors, limit):
    """{name: file index from 1}: files filled in order, a new one where the
    next tensor would take the file past ``limit`` bytes."""
    out, index, size = {}, 1, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if size and size + n > limit:
            index, size = index + 1, 0
        out[name] = index
        size += n
    return out


def same_checkpoint(a, b):
    names = sorted(os.listdir(a))
    if names != sorted(os.listdir(b)):
        return False
    for name in names:
        pa, pb = os.path.join(a, name), os.path.join(b, name)
        if name.endswith(".json"):
            with open(pa, "rb") as fa, open(pb, "rb") as fb:
                if fa.read() != fb.read():
                    return False
            continue
        with open(pa, "rb") as fa, open(pb, "rb") as fb:
            na, nb = (int.from_bytes(f.read(8), "little") for f in (fa, fb))
            if na != nb or json.loads(fa.read(na)) != json.loads(fb.read(nb)):
                return False
            while True:
                x, y = fa.read(64 << 20), fb.read(64 << 20)
                if x != y:
                    return False
                if not x:
                    break
    return True


def fresh(path):
    shutil.rmtree(path, ignore_errors=True)


def bench_layout(torch, device, name, directory, scale, repeat, limit):
    import torch.distributed.checkpoint as dcp
    tensors = BS.make_tensors(torch, device, BS.LAYOUTS[name], scale)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    mapping = shard_mapping(tensors, limit)
    files = max(mapping.values())
    theirs, ours = os.path.join(directory, f"{name}.dcp"), os.path.join(directory, f"{name}.ours")
    ceil_path = os.path.join(directory, f"{name}.ceiling.bin")
    BS.sync(torch, device)
    C.progress(f"{name}: {len(tensors)} tensors in {files} files, {C.fmt_size(nbytes)} on {device}")

    def save(writer):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")     # "assuming ... a single process"
            dcp.save(tensors, storage_writer=writer)

    rows = []
    times, peak = BS.timed(BS.ceiling(torch, device, ceil_path, nbytes, True), repeat,
                           before=lambda: BS.remove(ceil_path))
    rows.append(BS.record(name, "ceiling disk", nbytes, times, peak))
    BS.remove(ceil_path)
    threads = min(files, defaults.default_threads(defaults.SAVE_THREADS))
    runs = []
    if threads > 1:     # first: its index lists the files in the order its threads ended
        runs.append((f"dcp hf writer, {threads} thr", theirs,
                     lambda: dcp.HuggingFaceStorageWriter(theirs, fqn_to_index_mapping=mapping,
                                                          thread_count=threads)))
    runs.append(("instant_staging", ours,
                 lambda: SafetensorsStorageWriter(ours, fqn_to_index_mapping=mapping)))
    runs.append(("dcp hf writer", theirs,        # (last: its default, one thread, the slowest)
                 lambda: dcp.HuggingFaceStorageWriter(theirs, fqn_to_index_mapping=mapping)))
    for label, path, writer in runs:
        times, peak = BS.timed(lambda w=writer: save(w()), repeat, before=lambda p=path: fresh(p))
        rows.append(BS.record(name, label, nbytes, times, peak, files=files))
    same = same_checkpoint(theirs, ours)
    for r in rows:
        r["same"] = same if r["method"] == "instant_staging" else None
    fresh(theirs)
    fresh(ours)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    BS.add_options(parser)
    parser.add_argument("--shard-size", default="4GiB", help="bytes per file (4GiB, 512MiB, ...)")
    args = parser.parse_args(argv)
    layouts = BS.checked_layouts(parser, args)
    try:
        limit = ist.parse_size(args.shard_size)
    except (TypeError, ValueError) as e:
        parser.error(f"--shard-size: {e}")
    if limit <= 0:
        parser.error("--shard-size must be positive")
    import torch
    device, note = BL.pick_device(torch, args.device)
    scale, repeat = C.scale_and_repeat(args)
    limit = max(1, limit // scale ** 2)
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        rows = []
        for name in layouts:
            rows += bench_layout(torch, device, name, directory, scale, repeat, limit)
    what = torch.cuda.get_device_name(device) if device.type == "cuda" else note or "CPU"
    print(f"\ndcp.save on {device} ({what}), files in {args.dir or tempfile.gettempdir()}")
    print(C.table(["layout", "method", "size", "files", "best GB/s", "median GB/s", "host peak",
                   "same"],
                  [[r["layout"], r["method"], C.fmt_size(r["bytes"]), r.get("files", "-"),
                    C.fmt(r["best"], ".2f"), C.fmt(r["median"], ".2f"), C.fmt_size(r["host_peak"]),
                    "-" if r.get("same") is None else r["same"]] for r in rows]))
    by = {(r["layout"], r["method"]): r for r in rows}
    for layout in dict.fromkeys(r["layout"] for r in rows):
        ours, theirs = by[(layout, "instant_staging")], by[(layout, "dcp hf writer")]
        print(f"  {layout}: instant_staging {ours['best'] / theirs['best']:.2f}x DCP's writer, "
              f"{ours['best'] / by[(layout, 'ceiling disk')]['best']:.2f}x the disk ceiling")
    C.write_json(args.json, dict(device=str(device), note=note, dir=args.dir, scale=scale,
                                 repeat=repeat, shard_size=limit, results=rows,
                                 defaults=dict(chunk=defaults.SAVE_CHUNK_SIZE,
                                               slots=defaults.SAVE_SLOTS,
                                               threads=defaults.SAVE_THREADS)))


if __name__ == "__main__":
    main()
