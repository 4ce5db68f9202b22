#!/usr/bin/env python3
"""Why a load does not reach the copy ceiling: the reads and the copies
share the host's memory.

A hot load does two things at once: reader threads ``pread`` the page
cache into pinned slots (the CPU reads each byte and writes it), and the
copy engine reads the slots over PCIe (DMA reads each byte again).  This
measures each alone and both at once, with no loader in between, so the
rate the two reach together is the ceiling a loader of this design can
approach on the host (issue 45: ">= 0.92x of the copy ceiling"):

  reads     --threads threads, each ``os.preadv`` of --chunk bytes of a hot
            file (--file, read once before) into a ring of two pinned
            slots of its own, round robin over the file
  copies    --copy-threads streams, each copying --copy-chunk bytes at a
            time from a pinned ring of two to a device buffer (torch
            ``copy_(non_blocking=True)``), waiting on a slot's event before
            reusing it (large copies, few threads: the Python loop issuing
            them stays far from the GIL's limits)
  both      the two at once, on separate slots (nothing waits for the
            other: each runs at the rate the host leaves it)

For --seconds each (median of --repeat); GB/s of bytes read or copied.

    python benchmarks/bench_contention.py --file /var/tmp/instant_staging_bench/dense/<a shard>
"""

import argparse
import json
import os
import statistics
import sys
import threading
import time

import torch


def _reads(fd, size, chunk, threads, stop, counts):
    def one(k):
        ring = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        views = [memoryview(r.numpy()) for r in ring]
        off, turn, n = (k * chunk) % size, 0, 0
        while not stop.is_set():
            if off + chunk > size:
                off = 0
            n += os.preadv(fd, [views[turn % 2]], off)
            off += chunk * threads
            turn += 1
        counts[k] = n
    return [threading.Thread(target=one, args=(k,)) for k in range(threads)]


def _copies(device, chunk, threads, stop, counts):
    dst_size = 1 << 30

    def one(k):
        torch.cuda.set_device(device)
        stream = torch.cuda.Stream(device)
        ring = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        dst = torch.empty(dst_size, dtype=torch.uint8, device=device)
        events = [None, None]
        off, turn, n = 0, 0, 0
        with torch.cuda.stream(stream):
            while not stop.is_set():
                s = turn % 2
                if events[s] is not None:
                    events[s].synchronize()
                    n += chunk
                if off + chunk > dst_size:
                    off = 0
                dst[off:off + chunk].copy_(ring[s], non_blocking=True)
                events[s] = torch.cuda.Event()
                events[s].record(stream)
                off += chunk
                turn += 1
            stream.synchronize()
        counts[k] = n + chunk * sum(e is not None for e in events)
    return [threading.Thread(target=one, args=(k,)) for k in range(threads)]


def run(what, args, fd, size):
    stop = threading.Event()
    rc, cc = [0] * args.threads, [0] * args.copy_threads
    ts = []
    if what in ("reads", "both"):
        ts += _reads(fd, size, args.chunk, args.threads, stop, rc)
    if what in ("copies", "both"):
        ts += _copies(torch.device(args.device), args.copy_chunk, args.copy_threads, stop, cc)
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    time.sleep(args.seconds)
    stop.set()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    return sum(rc) / dt / 1e9, sum(cc) / dt / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--file", required=True, help="a file of a few GB, hot in the page cache")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--chunk", type=lambda s: int(s) << 20, default=2 << 20, help="MiB (default 2)")
    ap.add_argument("--threads", type=int, default=16, help="reader threads")
    ap.add_argument("--copy-threads", type=int, default=2, help="copy streams")
    ap.add_argument("--copy-chunk", type=lambda s: int(s) << 20, default=64 << 20,
                    help="MiB per copy (default 64)")
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    fd = os.open(args.file, os.O_RDONLY)
    size = os.fstat(fd).st_size
    with open(args.file, "rb") as f:        # hot
        while f.read(64 << 20):
            pass
    torch.ones(1, device=args.device)
    rows = {}
    for what in ("reads", "copies", "both"):
        runs = [run(what, args, fd, size) for _ in range(args.repeat)]
        rows[what] = {"read_gbps": statistics.median(r[0] for r in runs),
                      "copy_gbps": statistics.median(r[1] for r in runs)}
    os.close(fd)
    print(f"device {torch.cuda.get_device_name(args.device)}, {args.threads} reader threads, "
          f"{args.copy_threads} copy streams of {args.copy_chunk >> 20} MiB copies, reads of "
          f"{args.chunk >> 20} MiB, {args.seconds} s x "
          f"{args.repeat} (median GB/s)")
    print("| running | reads GB/s | copies GB/s |\n| --- | --- | --- |")
    for what, r in rows.items():
        print(f"| {what} | {r['read_gbps']:.1f} | {r['copy_gbps']:.1f} |")
    both, alone = rows["both"]["copy_gbps"], rows["copies"]["copy_gbps"]
    print(f"copies with reads running: {both / alone:.2f}x of copies alone")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
