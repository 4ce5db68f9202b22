#!/usr/bin/env python3
"""What this disk offers a cold read: readers x block size x buffered / O_DIRECT.

Issue 28 judges a cold load against the best read configuration the disk
offers.  This reads one of bench_load.py's layouts whole, page cache
dropped before each read (fdatasync once, then posix_fadvise(DONTNEED)),
into nothing but memory (no GPU, no copies), and prints GB/s for each
configuration, the rounds alternating so that a drift of the disk meets
every configuration alike:

  buffered   T threads, each taking the next block of B bytes (a shared
             counter, as the loader's readers do) and pread-ing it into a
             buffer of its own through the page cache
  direct     the same with O_DIRECT (page-aligned buffers, block-aligned
             offsets): the page cache is bypassed, each read goes to the
             device as it is
  willneed   posix_fadvise(WILLNEED) over every file first (the kernel's
             own readahead, asynchronous), then the buffered reads
  uring      one thread and an io_uring of T entries: T buffered reads of B
             bytes in flight, each resubmitted for the next block as it
             completes (the `liburing` binding on PyPI: pip install liburing;
             skipped with a note where it is missing or the kernel refuses
             io_uring).  Its buffers are bytearrays, which O_DIRECT's
             alignment rules out: the sweep's O_DIRECT rows are the threads'

The threads are Python threads around os.preadv, which releases the GIL for
the read: at the block sizes measured (>= 1 MiB, a few thousand reads a
second at most) the interpreter is not what limits a disk of a few GB/s.
T threads of blocking reads are T requests in flight, the queue depth an
io_uring reader would keep with one thread; the uring rows measure that
reader itself.

    python benchmarks/bench_disk.py [--layouts moe] [--threads 1,4,8,16,32]
        [--blocks 1MiB,4MiB,16MiB,64MiB] [--modes buffered,direct,willneed,uring]
        [--rounds 2] [--dir DIR] [--json PATH] [--quick]

--quick makes the layouts 64 times smaller in each matrix dimension (a
smoke test).
"""

import argparse
import itertools
import json
import mmap
import os
import platform
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C
import bench_load as B

MODES = ("buffered", "direct", "willneed", "uring")


def read_all(paths, threads, block, mode):
    """Seconds to read every byte of ``paths`` with ``threads`` readers of
    ``block`` bytes each, in ``mode``."""
    flags = os.O_RDONLY | (os.O_DIRECT if mode == "direct" else 0)
    fds = [os.open(p, flags) for p in paths]
    try:
        work = [(fd, off) for fd in fds for off in range(0, os.fstat(fd).st_size, block)]
        if mode == "uring":
            return read_uring(work, threads, block)
        nxt = itertools.count()
        errors = []

        def reader():
            buf = mmap.mmap(-1, block)      # page-aligned, as O_DIRECT needs
            try:
                while True:
                    i = next(nxt)
                    if i >= len(work):
                        return
                    fd, off = work[i]
                    os.preadv(fd, [buf], off)
            except BaseException as e:      # reported by the caller
                errors.append(e)
            finally:
                buf.close()

        t0 = time.perf_counter()
        if mode == "willneed":
            for fd in fds:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        pool = [threading.Thread(target=reader) for _ in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        seconds = time.perf_counter() - t0
        if errors:
            raise errors[0]
        return seconds
    finally:
        for fd in fds:
            os.close(fd)


def uring_missing():
    """None where an io_uring can be set up here, else why not."""
    try:
        import liburing
    except ImportError:
        return "the liburing binding is not installed (pip install liburing)"
    ring = liburing.Ring()
    try:
        liburing.io_uring_queue_init(1, ring)
    except OSError as e:            # a seccomp filter, io_uring_disabled=2
        return f"io_uring_setup failed: {e}"
    liburing.io_uring_queue_exit(ring)
    return None


def read_uring(work, depth, block):
    """Seconds to read every (fd, offset) block of ``work`` with ``depth``
    reads in flight on one io_uring (one thread: this one)."""
    import liburing as U
    ring, cqe = U.Ring(), U.Cqe()
    U.io_uring_queue_init(depth, ring)
    try:
        bufs = [bytearray(block) for _ in range(min(depth, len(work)))]
        free, nxt, inflight = list(range(len(bufs))), 0, 0
        t0 = time.perf_counter()
        while nxt < len(work) or inflight:
            queued = 0
            while free and nxt < len(work):
                slot = free.pop()
                sqe = U.io_uring_get_sqe(ring)
                fd, off = work[nxt]
                U.io_uring_prep_read(sqe, fd, bufs[slot], off)
                U.io_uring_sqe_set_data64(sqe, slot)
                nxt, inflight, queued = nxt + 1, inflight + 1, queued + 1
            if queued:
                U.io_uring_submit(ring)
            U.io_uring_wait_cqe(ring, cqe)
            done = cqe[0]
            res, slot = done.res, done.user_data
            U.io_uring_cqe_seen(ring, done)
            if res < 0:
                raise OSError(-res, os.strerror(-res))
            inflight -= 1
            free.append(slot)
        return time.perf_counter() - t0
    finally:
        U.io_uring_queue_exit(ring)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default="moe")
    ap.add_argument("--threads", default="1,4,8,16,32")
    ap.add_argument("--blocks", default="1MiB,4MiB,16MiB,64MiB")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default=B.DEFAULT_DIR)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="layouts 64x smaller per dimension")
    args = ap.parse_args(argv)
    modes = C.parse_kinds(ap, args.modes, MODES)
    if "uring" in modes and (why := uring_missing()) is not None:
        print(f"note: no uring rows: {why}")
        modes = [m for m in modes if m != "uring"]
    threads = [int(t) for t in args.threads.split(",")]
    blocks = C.parse_sizes(args.blocks)
    configs = list(itertools.product(modes, threads, blocks))
    os.makedirs(args.dir, exist_ok=True)
    st = os.statvfs(args.dir)
    env = {"kernel": platform.release(), "cpus": os.cpu_count(), "dir": args.dir,
           "fs_block": st.f_bsize}
    print(env)
    results = []
    for name, files in B.layouts(args.layouts.split(","), 64 if args.quick else 1, None):
        paths = B.generate(args.dir, files)
        nbytes = sum(os.path.getsize(p) for p in paths)
        B.flush(paths)
        times = {c: [] for c in configs}
        for r in range(args.rounds):
            order = configs if r % 2 == 0 else configs[::-1]
            for c in order:
                B.drop_cache(paths)
                times[c].append(read_all(paths, c[1], c[2], c[0]))
        print(f"\n{name}: {len(paths)} file(s), {nbytes / 1e9:.2f} GB, GB/s per round (median)")
        print(f"{'mode':9} {'threads':>7} {'block':>7}  rounds")
        for c in configs:
            rates = [nbytes / t / 1e9 for t in times[c]]
            results.append({"layout": name, "mode": c[0], "threads": c[1], "block": c[2],
                            "bytes": nbytes, "seconds": times[c]})
            print(f"{c[0]:9} {c[1]:7d} {C.fmt_size(c[2]):>7}  "
                  + " / ".join(f"{x:.2f}" for x in rates) + f"  ({statistics.median(rates):.2f})")
        best = max(configs, key=lambda c: statistics.median(nbytes / t for t in times[c]))
        print(f"best: {best[0]} {best[1]} threads x {C.fmt_size(best[2])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
