#!/usr/bin/env python3
"""Host-to-device copy rate out of each kind of staging buffer.

For each size (default 2 GiB) and each kind, the buffer is made once,
filled with a pattern (different per kind), and copied to one device
allocation (runtime.device_malloc) in two modes, --runs times each after
one untimed warm-up:

  chunked   8 MiB runtime.memcpy_async calls on one stream, split by
            StagingBuffer.spans() so that none crosses a registration,
            then one stream_synchronize (how a loader streams)
  whole     one memcpy_async of the whole buffer, then stream_synchronize;
            not for SEGMENTED: one copy may not span two registrations

Kinds: registered, hugepages, segmented and runtime_pinned (forced with
faults), pageable_fallback (StagingBuffer forced to Kind.PAGEABLE), and
the references host_alloc (cudaHostAlloc), torch_pinned (torch.empty
pin_memory=True, copied through the same runtime table) and pageable
(plain mmap, touched).  Copies always go through instant_staging's runtime
table (cudaMemcpyAsync / hipMemcpyAsync), never through torch.  After the
last run of each mode a few 4 KiB samples are read back and checked.

GB/s is 1e9 bytes per second, median over the runs.  Each pinned kind is
compared with the best pinned median of the same run and mode.

Without a GPU the simulated runtime stands in (or --simulate): its "copy"
is a host memcpy, and the script says so; the targets are then SKIP.

    python benchmarks/bench_h2d.py [--sizes 2GiB] [--runs 5] [--chunk 8MiB]
        [--kinds ...] [--json PATH] [--simulate] [--strict]
"""

import argparse
import ctypes
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C

import instant_staging as ist
from instant_staging.testing import inject_faults

H2D, D2H = 1, 2
DEFAULT_KINDS = ("registered", "hugepages", "segmented", "runtime_pinned",
                 "pageable_fallback", "host_alloc", "torch_pinned", "pageable")
PINNED = {"registered", "hugepages", "segmented", "runtime_pinned", "host_alloc",
          "torch_pinned"}
DESCRIPTIONS = {
    "registered": "StagingBuffer default",
    "hugepages": "StagingBuffer hugepages=True",
    "segmented": "StagingBuffer, whole register refused",
    "runtime_pinned": "StagingBuffer, every register refused",
    "pageable_fallback": "StagingBuffer, nothing pins (allow_pageable)",
    "host_alloc": "cudaHostAlloc (runtime table)",
    "torch_pinned": "torch.empty(pin_memory=True)",
    "pageable": "mmap, touched, not pinned",
}
STAGING = {
    "registered": (dict(), None, ist.Kind.REGISTERED),
    "hugepages": (dict(hugepages=True), None, ist.Kind.REGISTERED),
    "segmented": (dict(), "register#1=invalid_value", ist.Kind.SEGMENTED),
    "runtime_pinned": (dict(), "register=invalid_value", ist.Kind.RUNTIME_PINNED),
    "pageable_fallback": (dict(allow_pageable=True),
                          "register=invalid_value;host_alloc=invalid_value", ist.Kind.PAGEABLE),
}


class Source:
    """A host buffer to copy from: its address, how to split a range, how to free it."""

    def __init__(self, ptr, size, release, spans=None, reached=None, whole_ok=True):
        self.ptr = ptr
        self.size = size
        self.release = release
        self.spans = spans or (lambda off, n: [(ptr + off, n)])
        self.reached = reached
        self.whole_ok = whole_ok


def make_source(kind, size, setup, torch):
    rt = setup.runtime
    if kind in STAGING:
        kw, faults, _ = STAGING[kind]
        kw = dict(kw)
        kw.setdefault("hugepages", False)
        if kind == "segmented":
            kw["segment_size"] = C.segment_size_for(size)
        runtime = inject_faults(rt, faults) if faults else rt
        buf = ist.StagingBuffer(size, runtime=runtime, **kw)
        return Source(buf.ptr, size, buf.close, buf.spans, buf.kind.name,
                      whole_ok=len(buf.segments) == 1)
    if kind == "host_alloc":
        ptr = rt.check(*rt.host_alloc(size), call="host_alloc")
        return Source(ptr, size, lambda: rt.free_host(ptr), reached="host_alloc")
    if kind == "torch_pinned":
        holder = [torch.empty(size, dtype=torch.uint8, pin_memory=True)]

        def release():
            holder.clear()
            C.torch_empty_host_cache(torch)
        return Source(holder[0].data_ptr(), size, release, reached="torch_pinned")
    if kind == "pageable":
        ptr = C.map_anonymous(size)
        return Source(ptr, size, lambda: C.unmap(ptr, size), reached="pageable")
    raise ValueError(kind)


# A failed copy: Runtime.check() clears the pending error and raises it.
CopyError = ist.RuntimeCallError


def copy_chunked(rt, src, dev, stream, chunk):
    for off in range(0, src.size, chunk):
        for p, n in src.spans(off, min(chunk, src.size - off)):
            rt.check(rt.memcpy_async(dev + (p - src.ptr), p, n, H2D, stream),
                     call=f"memcpy_async at offset {p - src.ptr}")
    rt.check(rt.stream_synchronize(stream), call="stream_synchronize")


def copy_whole(rt, src, dev, stream, chunk):
    rt.check(rt.memcpy_async(dev, src.ptr, src.size, H2D, stream), call="memcpy_async (whole)")
    rt.check(rt.stream_synchronize(stream), call="stream_synchronize")


MODES = {"chunked": copy_chunked, "whole": copy_whole}


def verify(rt, src, dev, stream, seed, chunk=8 * C.MiB):
    """Reads back 4 KiB at the start, around every 256 MiB and at the end;
    returns the offsets whose bytes are wrong."""
    n = min(4096, src.size)
    offsets = {0, src.size - n}
    for b in range(256 * C.MiB, src.size, 256 * C.MiB):
        offsets.update({b - n, b})
    back = bytearray(n)
    addr = ctypes.addressof((ctypes.c_char * n).from_buffer(back))
    bad = []
    for off in sorted(o for o in offsets if 0 <= o <= src.size - n):
        rt.check(rt.memcpy_async(addr, dev + off, n, D2H, stream), call="read-back")
        rt.check(rt.stream_synchronize(stream), call="stream_synchronize")
        if back != bytes(C.expected_byte(off + i, chunk, seed) for i in range(n)):
            bad.append(off)
    return bad


def measure_kind(kind, size, setup, torch, dev, stream, args, seed):
    rt = setup.runtime
    entry = dict(kind=kind, size=size, description=DESCRIPTIONS[kind],
                 pinned=kind in PINNED, modes={}, error=None)
    t0 = time.perf_counter()
    src = make_source(kind, size, setup, torch)
    entry["alloc_s"] = time.perf_counter() - t0
    entry["reached"] = src.reached
    expected = STAGING.get(kind, (None, None, None))[2]
    entry["reached_expected"] = expected is None or src.reached == expected.name
    try:
        C.fill(src.ptr, size, seed=seed)
        for mode, fn in MODES.items():
            if mode == "whole" and not src.whole_ok:
                entry["modes"][mode] = dict(skipped="spans registrations: one copy may not")
                continue
            fn(rt, src, dev, stream, args.chunk)  # warm-up, untimed
            secs = []
            for _ in range(args.runs):
                t = time.perf_counter()
                fn(rt, src, dev, stream, args.chunk)
                secs.append(time.perf_counter() - t)
            rates = [size / s / 1e9 for s in secs]
            bad = verify(rt, src, dev, stream, seed)
            entry["modes"][mode] = dict(seconds=secs, gbps=rates,
                                        gbps_median=C.median(rates), gbps_max=max(rates),
                                        verified=not bad, bad_offsets=bad)
    except CopyError as e:
        entry["error"] = str(e)
    finally:
        src.release()
    return entry


def run(args, setup):
    rt = setup.runtime
    torch, kinds, skipped = C.torch_for(setup, args.kinds)
    C.warm_up(setup)
    stream = rt.check(*rt.stream_create(), call="stream_create")
    results = []
    try:
        for size in args.sizes:
            dev = rt.check(*rt.device_malloc(size), call=f"device_malloc({size})")
            try:
                for i, k in enumerate(kinds):
                    try:
                        results.append(measure_kind(k, size, setup, torch, dev, stream,
                                                    args, seed=i))
                    except Exception as e:
                        results.append(dict(kind=k, size=size, description=DESCRIPTIONS[k],
                                            pinned=k in PINNED, modes={},
                                            reached=None, reached_expected=False,
                                            error=f"{type(e).__name__}: {e}"))
                    C.progress(f"{C.fmt_size(size)} {k} done")
            finally:
                rt.device_free(dev)
    finally:
        rt.stream_destroy(stream)
    return results, skipped


def best_pinned(results, size, mode):
    xs = [e["modes"][mode]["gbps_median"] for e in results
          if e["size"] == size and e["pinned"] and mode in e["modes"]
          and "gbps_median" in e["modes"][mode] and not e["error"]]
    return max(xs) if xs else None


def best_pageable(results, size, mode):
    xs = [e["modes"][mode]["gbps_median"] for e in results
          if e["size"] == size and not e["pinned"] and mode in e["modes"]
          and "gbps_median" in e["modes"][mode]]
    return max(xs) if xs else None


def print_table(results):
    rows = []
    for e in results:
        cells = [C.fmt_size(e["size"]), e["kind"], e.get("reached") or "ERROR",
                 C.fmt(e.get("alloc_s"))]
        for mode in MODES:
            m = e["modes"].get(mode, {})
            best = best_pinned(results, e["size"], mode)
            if "gbps_median" in m:
                cells += [f"{m['gbps_median']:.1f}", f"{m['gbps_max']:.1f}",
                          f"{m['gbps_median'] / best:.0%}" if best else "-",
                          "ok" if m["verified"] else "BAD"]
            else:
                cells += ["n/a" if m.get("skipped") else "-", "-", "-", "-"]
        rows.append(cells)
    print(C.table(["size", "kind", "reached", "alloc s",
                   "chunked GB/s", "max", "of best", "data",
                   "whole GB/s", "max", "of best", "data"], rows))
    for e in results:
        if e["error"]:
            print(f"  ERROR {C.fmt_size(e['size'])} {e['kind']}: {e['error']}")
        for mode, m in e["modes"].items():
            if m.get("skipped"):
                print(f"  {C.fmt_size(e['size'])} {e['kind']} {mode}: n/a, {m['skipped']}")
            elif m.get("bad_offsets"):
                print(f"  DATA {C.fmt_size(e['size'])} {e['kind']} {mode}: wrong bytes at "
                      f"offsets {m['bad_offsets'][:8]}")


def evaluate(results, setup, sizes):
    T = C.Targets(setup)
    for size in sizes:
        for mode in MODES:
            best = best_pinned(results, size, mode)
            slow = []
            n = 0
            for e in results:
                m = e["modes"].get(mode, {})
                if e["size"] != size or not e["pinned"] or "gbps_median" not in m:
                    continue
                n += 1
                if m["gbps_median"] < 0.95 * best:
                    slow.append(f"{e['kind']} {m['gbps_median']:.1f}")
            name = f"{C.fmt_size(size)} {mode}: every pinned kind >= 95% of the best pinned"
            if not n:
                T.check(name, None, None, "no pinned kind measured")
                continue
            page = best_pageable(results, size, mode)
            extra = f"; pinned/pageable {best / page:.1f}x" if page else ""
            T.check(name, not slow, best,
                    f"best {best:.1f} GB/s" + (f"; below 95%: {', '.join(slow)}" if slow
                                                else f"; all {n} within 95%") + extra)
    wrong = [f"{C.fmt_size(e['size'])} {e['kind']}" for e in results
             if e["error"] or not e["reached_expected"]
             or any(m.get("verified") is False for m in e["modes"].values())]
    T.check("every kind reached what it should, data verified, no errors", not wrong,
            len(wrong), "all as expected" if not wrong else "problems: " + ", ".join(wrong))
    return T


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="2GiB", help="comma-separated sizes (default 2GiB)")
    p.add_argument("--runs", type=int, default=5, help="timed copies per mode (default 5)")
    p.add_argument("--chunk", default="8MiB", help="chunk of the chunked mode (default 8MiB)")
    p.add_argument("--kinds", default=",".join(DEFAULT_KINDS), help="comma-separated kinds")
    C.add_common_options(p)
    args = p.parse_args(argv)
    args.sizes = C.parse_sizes(args.sizes)
    args.chunk = ist.parse_size(args.chunk)
    if args.chunk <= 0:
        p.error("--chunk must be positive")
    args.kinds = C.parse_kinds(p, args.kinds, DEFAULT_KINDS)
    setup, results, skipped, elapsed = C.run_timed(p, args, "bench_h2d: host-to-device copy rate", run)

    print(f"\nGB/s = 1e9 bytes/s, median of {args.runs} copies after a warm-up; copies via "
          f"the runtime table's\nmemcpy_async on one stream ({C.fmt_size(args.chunk)} chunks "
          "split at registrations, or one whole copy);\n'of best' = this median over the "
          "best pinned median of the same size and mode\n")
    print_table(results)
    for k, why in skipped.items():
        print(f"  skipped {k}: {why}")
    T = evaluate(results, setup, args.sizes)
    T.print()
    print(f"\ntotal {elapsed:.1f} s")
    C.write_json(args.json, dict(
        benchmark="h2d", schema=1, gpu=setup.gpu, runtime=setup.runtime.name,
        simulated_because=setup.why_simulated, environment=C.environment(setup),
        copy_api="instant_staging runtime table: memcpy_async + stream_synchronize",
        config=dict(sizes=args.sizes, runs=args.runs, chunk=args.chunk, kinds=args.kinds),
        skipped=skipped, results=results, targets=T.items, elapsed_s=elapsed))
    return 1 if args.strict and T.failed else 0


if __name__ == "__main__":
    sys.exit(main())
