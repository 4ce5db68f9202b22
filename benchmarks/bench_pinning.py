#!/usr/bin/env python3
"""How fast bytes become copyable to the GPU: the two costs issue 28 left.

A hot load (pread into pinned slots, then a copy to the device) moves every
byte through host memory twice before the link reads it; a first load
waits for its staging buffer's one registration.  This measures the ways
around both, on the real driver, through the runtime table:

  register   anonymous memory (huge pages, prefaulted) registered in one call
             against N registrations of size/N made by N threads at once,
             and unregistered the same ways
  file       a hot file's page cache mapped read-only and registered
             (cudaHostRegisterReadOnly), by one thread and by N; then one
             copy of the whole mapping to the device, checked byte for byte
             against the file
  mapped     a loader without a read copy: T threads, each registering a
             window of the mapping, copying it on its own stream and
             unregistering it, the next window registered while the copy runs
  pageable   copies straight from the (unregistered) mapping, T threads:
             what a load could move while its staging buffer is being made
  ceiling    one copy of the same bytes from registered anonymous memory

    python benchmarks/bench_pinning.py [--sizes 128MiB,1GiB] [--file-size 2GiB]
        [--threads 1,2,4,8,16] [--windows 16MiB,64MiB] [--runs 3]
        [--sections register,file,mapped,pageable,ceiling]

Without a GPU it says so and stops (the simulated runtime has no page cache
to pin).
"""

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C

SECTIONS = ("register", "file", "mapped", "pageable", "ceiling")
REGISTER_READ_ONLY = 0x08     # cudaHostRegisterReadOnly (CUDA 11.1+)
H2D, D2H = 1, 2


def check(rt, code, call):
    if code != 0:
        rt.get_last_error()
        raise SystemExit(f"{call} failed with {rt.error_name(code)}")


def in_threads(n, work):
    """Runs ``work(i)`` for i in range(n) in n threads at once; seconds."""
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def register_parts(rt, ptr, size, parts, flags=0):
    """Registers [ptr, ptr + size) as ``parts`` ranges, one thread each;
    returns (seconds, [(ptr, size)]) or raises with the first error."""
    step = -(-size // parts // C.PAGE) * C.PAGE
    ranges = [(ptr + lo, min(step, size - lo)) for lo in range(0, size, step)]
    codes = [0] * len(ranges)

    def work(i):
        p, n = ranges[i]
        codes[i] = rt.host_register(p, n, flags)
    seconds = in_threads(len(ranges), work)
    for code in codes:
        if code != 0:
            name = rt.error_name(code)
            rt.get_last_error()
            for (q, _), ok in zip(ranges, codes):
                if ok == 0:
                    rt.host_unregister(q)
            raise RuntimeError(f"host_register of {len(ranges)} part(s) failed with {name}")
    return seconds, ranges


def unregister_parts(rt, ranges):
    codes = [0] * len(ranges)

    def work(i):
        codes[i] = rt.host_unregister(ranges[i][0])
    seconds = in_threads(len(ranges), work)
    for code in codes:
        check(rt, code, "host_unregister")
    return seconds


def anonymous(size, huge=True):
    ptr = C.map_anonymous(size)
    if huge:
        C.advise(ptr, size, C.MADV_HUGEPAGE)
    C.populate_write(ptr, size, 8)
    return ptr


def section_register(rt, sizes, threads, runs):
    rows = []
    for size in sizes:
        for huge in (True, False):
            ptr = anonymous(size, huge)
            try:
                for n in threads:
                    reg, unreg = [], []
                    for _ in range(runs):
                        s, ranges = register_parts(rt, ptr, size, n)
                        reg.append(s)
                        unreg.append(unregister_parts(rt, ranges))
                    r = C.median(reg)
                    rows.append([C.fmt_size(size), "huge" if huge else "4 KiB", n,
                                 f"{r * 1e3:.2f}", f"{size / r / 1e9:.1f}",
                                 f"{C.median(unreg) * 1e3:.2f}"])
            finally:
                C.unmap(ptr, size)
    print(C.table(["size", "pages", "registrations at once", "register ms", "GB/s",
                   "unregister ms"], rows))


def hot_file(path, size):
    """A file of ``size`` bytes whose 8 MiB chunks all differ, read once
    (hot in the page cache); returns its descriptor."""
    if not os.path.exists(path) or os.path.getsize(path) != size:
        block = os.urandom(8 * C.MiB)
        with open(path, "wb") as f:
            for i in range(0, size, 8 * C.MiB):
                n = min(8 * C.MiB, size - i)
                f.write(i.to_bytes(8, "little") + block[8:n])
    fd = os.open(path, os.O_RDONLY)
    while os.read(fd, 64 * C.MiB):
        pass
    return fd


def device_equals(rt, dev, src, size, stream):
    """Whether the device's ``size`` bytes at ``dev`` are the host's at ``src``."""
    back = C.map_anonymous(size)
    try:
        check(rt, rt.memcpy_async(back, dev, size, D2H, stream), "memcpy_async D2H")
        check(rt, rt.stream_synchronize(stream), "stream_synchronize")
        return C.same_bytes(back, src, size)
    finally:
        C.unmap(back, size)


def copy_and_check(rt, dev, src, size, stream):
    t0 = time.perf_counter()
    check(rt, rt.memcpy_async(dev, src, size, H2D, stream), "memcpy_async")
    check(rt, rt.stream_synchronize(stream), "stream_synchronize")
    seconds = time.perf_counter() - t0
    return seconds, device_equals(rt, dev, src, size, stream)


def section_file(rt, fd, size, threads, runs, dev, stream):
    ptr = C.map_file(fd, size)
    rows = []
    try:
        for flags, label in ((0, "default"), (REGISTER_READ_ONLY, "read-only")):
            try:
                s, ranges = register_parts(rt, ptr, size, 1, flags)
            except RuntimeError as e:
                rows.append([label, 1, str(e), "", "", ""])
                continue
            unregister_parts(rt, ranges)
            for n in threads:
                reg, unreg = [], []
                for _ in range(runs):
                    s, ranges = register_parts(rt, ptr, size, n, flags)
                    reg.append(s)
                    unreg.append(unregister_parts(rt, ranges))
                r = C.median(reg)
                rows.append([label, n, f"{r * 1e3:.2f}", f"{size / r / 1e9:.1f}",
                             f"{C.median(unreg) * 1e3:.2f}", ""])
            s, ranges = register_parts(rt, ptr, size, 1, flags)
            try:
                copies = [copy_and_check(rt, dev, ptr, size, stream) for _ in range(runs)]
            finally:
                unregister_parts(rt, ranges)
            best = min(c[0] for c in copies)
            rows.append([label, "copy", f"{best * 1e3:.2f}", f"{size / best / 1e9:.1f}", "",
                         "yes" if all(c[1] for c in copies) else "NO"])
    finally:
        C.unmap(ptr, size)
    print(C.table(["flags", "registrations at once", "register ms", "GB/s", "unregister ms",
                   "bit-exact"], rows))


def mapped_load(rt, ptr, size, dev, threads, window, flags):
    """T threads take windows in turn: register, copy on the thread's
    stream, register the next, wait for the copy, unregister.  Seconds."""
    lock = threading.Lock()
    nxt = [0]
    errors = []

    def claim():
        with lock:
            lo = nxt[0]
            nxt[0] += window
        return lo if lo < size else None

    def work(_):
        code, stream = rt.stream_create()
        if code:
            errors.append(rt.error_name(code))
            return
        held = None
        try:
            lo = claim()
            while lo is not None or held is not None:
                current = None
                if lo is not None:
                    n = min(window, size - lo)
                    code = rt.host_register(ptr + lo, n, flags)
                    if code:
                        errors.append(rt.error_name(code))
                        rt.get_last_error()
                        return
                    current = (lo, n)
                if held is not None:
                    rt.stream_synchronize(stream)
                    rt.host_unregister(ptr + held[0])
                    held = None
                if current is not None:
                    rt.memcpy_async(dev + current[0], ptr + current[0], current[1], H2D, stream)
                    held = current
                    lo = claim()
        finally:
            if held is not None:
                rt.stream_synchronize(stream)
                rt.host_unregister(ptr + held[0])
            rt.stream_destroy(stream)

    seconds = in_threads(threads, work)
    if errors:
        raise RuntimeError(errors[0])
    return seconds


def section_mapped(rt, fd, size, threads, windows, runs, dev, stream):
    ptr = C.map_file(fd, size)
    rows = []
    try:
        for window in windows:
            for n in threads:
                try:
                    times = [mapped_load(rt, ptr, size, dev, n, window, REGISTER_READ_ONLY)
                             for _ in range(runs)]
                except RuntimeError as e:
                    rows.append([C.fmt_size(window), n, str(e), "", ""])
                    continue
                same = device_equals(rt, dev, ptr, size, stream)
                best = min(times)
                rows.append([C.fmt_size(window), n, f"{best * 1e3:.2f}",
                             f"{size / best / 1e9:.1f} (median {size / C.median(times) / 1e9:.1f})",
                             "yes" if same else "NO"])
    finally:
        C.unmap(ptr, size)
    print(C.table(["window", "threads", "best ms", "GB/s", "bit-exact"], rows))


def section_pageable(rt, fd, size, threads, runs, dev):
    ptr = C.map_file(fd, size)
    rows = []
    try:
        for n in threads:
            part = -(-size // n // C.PAGE) * C.PAGE

            def work(i, part=part):
                lo = i * part
                if lo >= size:
                    return
                _, stream = rt.stream_create()
                rt.memcpy_async(dev + lo, ptr + lo, min(part, size - lo), H2D, stream)
                rt.stream_synchronize(stream)
                rt.stream_destroy(stream)
            times = [in_threads(n, work) for _ in range(runs)]
            best = min(times)
            rows.append([n, f"{best * 1e3:.2f}", f"{size / best / 1e9:.1f}"])
    finally:
        C.unmap(ptr, size)
    print(C.table(["threads", "best ms", "GB/s"], rows))


def section_ceiling(rt, size, runs, dev, stream):
    ptr = anonymous(size)
    try:
        _, ranges = register_parts(rt, ptr, size, 1)
        try:
            times = [copy_and_check(rt, dev, ptr, size, stream)[0] for _ in range(runs)]
        finally:
            unregister_parts(rt, ranges)
    finally:
        C.unmap(ptr, size)
    best = min(times)
    print(C.table(["bytes", "best ms", "GB/s"],
                  [[C.fmt_size(size), f"{best * 1e3:.2f}", f"{size / best / 1e9:.1f}"]]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="128MiB,1GiB")
    ap.add_argument("--file-size", default="2GiB")
    ap.add_argument("--file", default=os.path.join(".bench", "pinning.bin"))
    ap.add_argument("--threads", default="1,2,4,8,16")
    ap.add_argument("--windows", default="16MiB,64MiB")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--sections", default=",".join(SECTIONS))
    args = ap.parse_args()
    sections = C.parse_kinds(ap, args.sections, SECTIONS)
    setup = C.pick_runtime()
    if not setup.gpu:
        print(f"bench_pinning: {setup.label}: nothing to measure without a GPU")
        return 0
    rt = setup.runtime
    C.warm_up(setup)
    C.banner(setup, "bench_pinning")
    threads = [int(t) for t in args.threads.split(",")]
    size = C.parse_sizes(args.file_size)[0]
    code, dev = rt.device_malloc(size)
    check(rt, code, "device_malloc")
    code, stream = rt.stream_create()
    check(rt, code, "stream_create")
    fd = None
    try:
        if "register" in sections:
            print("\n## register: anonymous memory, one registration against N at once")
            section_register(rt, C.parse_sizes(args.sizes), threads, args.runs)
        if {"file", "mapped", "pageable"} & set(sections):
            os.makedirs(os.path.dirname(args.file) or ".", exist_ok=True)
            fd = hot_file(args.file, size)
        if "file" in sections:
            print(f"\n## file: a hot {C.fmt_size(size)} file's page cache, registered")
            section_file(rt, fd, size, threads, args.runs, dev, stream)
        if "mapped" in sections:
            print("\n## mapped: register a window, copy it, unregister (no read copy)")
            section_mapped(rt, fd, size, threads, C.parse_sizes(args.windows), args.runs, dev,
                           stream)
        if "pageable" in sections:
            print("\n## pageable: copies straight from the unregistered mapping")
            section_pageable(rt, fd, size, threads, args.runs, dev)
        if "ceiling" in sections:
            print("\n## ceiling: one copy from registered anonymous memory")
            section_ceiling(rt, size, args.runs, dev, stream)
    finally:
        if fd is not None:
            os.close(fd)
        rt.stream_destroy(stream)
        rt.device_free(dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
