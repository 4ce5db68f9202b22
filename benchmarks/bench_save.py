#!/usr/bin/env python3
"""Saving checkpoints (issue 57): instant_staging.loader.save_file against
safetensors.torch.save_file and the host's write ceiling, and a 2% delta
against a full save.

One process, one run, the same tensors for everyone: bench_load.py's
layouts (--layouts; default dense, 16 GB Llama-3-8B in 291 bf16 tensors,
and finemoe, 4,680 tensors of about 1 MiB), random bytes made on the device
(--device; default the current GPU, else the CPU).  Files go to --dir (the
file system measured).  For each layout, each row --repeat times (best and
median GB/s of the layout's bytes):

  ceiling page cache   the host's parallel-write rate: SAVE_THREADS threads
                       pwrite SAVE_CHUNK_SIZE pieces of one pinned host buffer
                       (min(layout, 1 GiB), written again until the layout's
                       size is covered) into one file of the layout's size
                       in --dir; no device copies, no fsync
  ceiling disk         the same, fsync included
  instant_staging      save_file(tensors, path, sync=False): the file in the
                       page cache, renamed into place
  ... synced           save_file(tensors, path): fsync of the file and its
                       directory included (the default)
  safetensors          safetensors.torch.save_file(tensors, path) (copies each
                       tensor to the host, writes from one thread; no fsync)
  delta 2%             save_delta(new, base, path): --delta-fraction of each
                       tensor's elements changed at random positions, the
                       comparison with the base (on the device) included;
                       compared with "instant_staging" (a full save)

"exact" compares our file with safetensors' byte for byte (once per
layout).  "host peak" is the process's RSS high-water mark during the call
above its RSS before it (/proc/self/clear_refs resets it per run): the
goal is at most 2x the staging buffer (SAVE_SLOTS x SAVE_CHUNK_SIZE).
Each run's file is removed before the next (no page-cache pressure from
old versions).

    python benchmarks/bench_save.py --dir /nvme/bench [--layouts dense,finemoe]
        [--repeat 3] [--device cuda:0] [--json PATH]
    python benchmarks/bench_save.py --quick     # CPU smoke test, layouts 64x smaller

The goals (issue 57, GPU host): instant_staging >= 0.9x the ceiling of the
same kind (page cache, disk) and >= 3x safetensors; a 2% delta in <= 10%
of a full save's time; host peak <= 2x the staging buffer.
"""

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C
import bench_load as BL

from instant_staging import defaults
from instant_staging.loader import save_delta, save_file

LAYOUTS = {"dense": BL.dense_layout, "moe": BL.moe_layout, "finemoe": BL.finemoe_layout}


def make_tensors(torch, device, layout, scale, seed=0):
    """{name: bf16 tensor of random bytes} of every shard of the layout, on device."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for _, tensors in layout(scale):
        for name, shape in tensors:
            n = 1
            for d in shape:
                n *= d
            raw = torch.randint(0, 256, (2 * n,), dtype=torch.uint8, generator=g, device=device)
            out[name] = raw.view(torch.bfloat16).reshape(shape)
    return out


def sync(torch, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(call, repeat, before=None):
    """(seconds per run, host peak bytes above the RSS before, of the worst run)."""
    times, peaks = [], []
    for _ in range(repeat):
        if before:
            before()
        C.reset_peak_rss()
        rss = C._status_kib("VmRSS")
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
        hwm = C._status_kib("VmHWM")
        peaks.append(None if hwm is None or rss is None else hwm - rss)
    known = [p for p in peaks if p is not None]
    return times, (max(known) if known else None)


def ceiling(torch, device, path, total, fsync):
    """The host's parallel pwrite rate of pinned memory into one file."""
    size = min(total, 1 << 30)
    pinned = device.type == "cuda"
    src = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
    src.random_(0, 256)
    view = memoryview(src.numpy())
    chunk, threads = defaults.SAVE_CHUNK_SIZE, defaults.default_threads(defaults.SAVE_THREADS)
    pieces = [(off, min(chunk, total - off)) for off in range(0, total, chunk)]

    def run():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, total)
            lock = threading.Lock()
            it = iter(pieces)

            def writer():
                while True:
                    with lock:
                        piece = next(it, None)
                    if piece is None:
                        return
                    off, n = piece
                    begin = off % size
                    n = min(n, size - begin)
                    done = 0
                    while done < n:
                        done += os.pwrite(fd, view[begin + done:begin + n], off + done)
                    if n < piece[1]:        # the buffer's end: the rest from its start
                        rest = piece[1] - n
                        os.pwrite(fd, view[:rest], off + n)
            ts = [threading.Thread(target=writer) for _ in range(threads)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    return run


def same_file(a, b, chunk=64 << 20):
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(chunk), fb.read(chunk)
            if x != y:
                return False
            if not x:
                return True


def remove(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def record(layout, method, nbytes, times, peak, **extra):
    best = min(times)
    C.progress(f"  {layout} {method}: best {nbytes / best / 1e9:.2f} GB/s, runs "
               + ", ".join(f"{t:.2f}" for t in times) + " s")
    return dict(layout=layout, method=method, bytes=nbytes, seconds=times,
                best=nbytes / best / 1e9, median=nbytes / statistics.median(times) / 1e9,
                host_peak=peak, **extra)


def bench_layout(torch, device, name, directory, scale, repeat, fraction):
    import safetensors.torch as st
    tensors = make_tensors(torch, device, LAYOUTS[name], scale)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    ours, theirs = os.path.join(directory, f"{name}.ours.safetensors"), \
        os.path.join(directory, f"{name}.theirs.safetensors")
    ceil_path = os.path.join(directory, f"{name}.ceiling.bin")
    rows = []
    sync(torch, device)
    C.progress(f"{name}: {len(tensors)} tensors, {C.fmt_size(nbytes)} on {device}")
    for label, fsync in (("ceiling page cache", False), ("ceiling disk", True)):
        times, peak = timed(ceiling(torch, device, ceil_path, nbytes, fsync), repeat,
                            before=lambda: remove(ceil_path))
        rows.append(record(name, label, nbytes, times, peak))
    remove(ceil_path)
    for label, kwargs in (("instant_staging", {"sync": False}), ("instant_staging synced", {})):
        times, peak = timed(lambda kw=kwargs: save_file(tensors, ours, **kw), repeat,
                            before=lambda: remove(ours))
        rows.append(record(name, label, nbytes, times, peak))
    times, peak = timed(lambda: st.save_file(tensors, theirs), repeat, before=lambda: remove(theirs))
    rows.append(record(name, "safetensors", nbytes, times, peak))
    exact = same_file(ours, theirs)
    for r in rows:
        r["exact"] = exact if r["method"].startswith("instant_staging") else None
    remove(theirs)
    new = C.changed(torch, tensors, fraction)
    delta = os.path.join(directory, f"{name}.delta.safetensors")
    times, peak = timed(lambda: save_delta(new, tensors, delta, base_version="a", version="b",
                                           sync=False), repeat, before=lambda: remove(delta))
    rows.append(record(name, f"delta {fraction:.0%}", nbytes, times, peak,
                       delta_bytes=os.path.getsize(delta)))
    remove(delta)
    remove(ours)
    return rows


def verdicts(rows):
    """The issue's goals, per layout: (name, ok, detail)."""
    out = []
    staging = defaults.SAVE_SLOTS * defaults.SAVE_CHUNK_SIZE
    by = {(r["layout"], r["method"]): r for r in rows}
    for layout in dict.fromkeys(r["layout"] for r in rows):
        ours, synced = by[(layout, "instant_staging")], by[(layout, "instant_staging synced")]
        hot, disk = by[(layout, "ceiling page cache")], by[(layout, "ceiling disk")]
        st = by[(layout, "safetensors")]
        delta = next(r for (lay, m), r in by.items() if lay == layout and m.startswith("delta"))
        out += [
            (f"{layout}: >= 0.9x page-cache ceiling", ours["best"] >= 0.9 * hot["best"],
             f"{ours['best']:.2f} vs {hot['best']:.2f} GB/s"),
            (f"{layout}: synced >= 0.9x disk ceiling", synced["best"] >= 0.9 * disk["best"],
             f"{synced['best']:.2f} vs {disk['best']:.2f} GB/s"),
            (f"{layout}: >= 3x safetensors", ours["best"] >= 3 * st["best"],
             f"{ours['best'] / st['best']:.2f}x"),
            (f"{layout}: delta <= 10% of a full save", min(delta["seconds"]) <= 0.1 * min(ours["seconds"]),
             f"{min(delta['seconds']) / min(ours['seconds']):.1%}"),
            (f"{layout}: host peak <= 2x staging", ours["host_peak"] is not None
             and ours["host_peak"] <= 2 * staging, C.fmt_size(ours["host_peak"])),
            (f"{layout}: byte-identical to safetensors", ours["exact"], str(ours["exact"])),
        ]
    return out


def add_options(parser):
    """The options bench_save.py and bench_save_dcp.py share."""
    C.add_layout_options(parser, layouts="dense,finemoe", layouts_help=f"of {', '.join(LAYOUTS)}",
                         dir_help="where the files go (default: a temporary directory)")


def checked_layouts(parser, args):
    """--layouts as a list, after --layouts and --repeat are checked."""
    layouts = C.parse_kinds(parser, args.layouts, list(LAYOUTS))
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    return layouts


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser)
    parser.add_argument("--delta-fraction", type=float, default=0.02)
    args = parser.parse_args(argv)
    layouts = checked_layouts(parser, args)
    if not 0 < args.delta_fraction < 1:
        parser.error("--delta-fraction must be in (0, 1)")
    import torch
    device, note = BL.pick_device(torch, args.device)
    scale, repeat = C.scale_and_repeat(args)
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        rows = []
        for name in layouts:
            rows += bench_layout(torch, device, name, directory, scale, repeat, args.delta_fraction)
    what = torch.cuda.get_device_name(device) if device.type == "cuda" else note or "CPU"
    print(f"\nSaving on {device} ({what}), files in {args.dir or tempfile.gettempdir()}")
    print(C.table(["layout", "method", "size", "best GB/s", "median GB/s", "host peak", "exact", "file"],
                  [[r["layout"], r["method"], C.fmt_size(r["bytes"]), C.fmt(r["best"], ".2f"),
                    C.fmt(r["median"], ".2f"), C.fmt_size(r["host_peak"]),
                    "-" if r.get("exact") is None else r["exact"],
                    C.fmt_size(r.get("delta_bytes"))] for r in rows]))
    checks = verdicts(rows)
    print("\nGoals (issue 57):" + (" (no GPU: a smoke test, the verdicts say nothing)"
                                   if device.type != "cuda" else ""))
    for what, ok, detail in checks:
        print(f"  {'PASS' if ok else 'FAIL'}  {what}: {detail}")
    C.write_json(args.json, dict(device=str(device), note=note, dir=args.dir, scale=scale,
                                 repeat=repeat, results=rows,
                                 goals=[dict(name=n, ok=bool(ok), detail=d) for n, ok, d in checks],
                                 defaults=dict(chunk=defaults.SAVE_CHUNK_SIZE,
                                               slots=defaults.SAVE_SLOTS,
                                               threads=defaults.SAVE_THREADS)))


if __name__ == "__main__":
    main()
