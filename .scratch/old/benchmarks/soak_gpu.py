#!/usr/bin/env python3
"""GPU soak: create and release pinned staging buffers over and over on the
real driver, and check that nothing stays behind, neither in this process
nor in the driver's view.

One phase per pinned kind, each at --size (default 2 GiB):

  registered      StagingBuffer default (mmap, parallel prefault, one register)
  segmented       forced: inject_faults(real_runtime(), 'register>SEG=invalid_value'):
                  the whole registration is refused, 256 MiB segments are not
  runtime_pinned  forced: inject_faults(real_runtime(), 'register=invalid_value');
                  prefault_threads=0 (prefaulting memory that is then freed for
                  cudaHostAlloc is wasted time)

Every cycle: the kind is the expected one; before release the driver reports
host memory (pointer_type 1) at every segment start, after release
unregistered (0) there.  After each phase: every address that ever started a
segment still reads 0 (nothing pinned remains), host RSS is back within
--rss-bound of the phase's baseline, and system MemFree has not lost a
buffer's worth (at least 1 GiB; driver allocations show there, not in RSS).  The first and
the last cycle of each phase also copy the whole buffer to the GPU span by
span and read samples back.

Time: cudaHostAlloc of 2 GiB takes ~1.1 s and cudaFreeHost ~0.3 s on the
H200 host of docs/design.md ("Measured"), a registered or segmented cycle ~0.45 s.  200
cycles of all three would take ~8 min, so the run has a time budget
(--budget, default 330 s) as well as --cycles (default 200): each phase may
use its share of what is left, and stops early (saying so) when that is
spent.  On that host registered and segmented finish their 200 cycles and
runtime_pinned reaches about 110; --budget 480 gets all 200 of each.

    python benchmarks/soak_gpu.py [--cycles 200] [--budget 330] [--size 2GiB]
        [--kinds registered,segmented,runtime_pinned] [--rss-bound 64MiB]
        [--json PATH] [--simulate]

Exit status 0 when every check passed, 1 otherwise.  --simulate runs on the
SimulatedRuntime (host side only) to try the script without a GPU.
"""

import argparse
import ctypes
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C

import instant_staging as ist
from instant_staging.testing import inject_faults

KINDS = ("registered", "segmented", "runtime_pinned")
EXPECTED = {"registered": ist.Kind.REGISTERED, "segmented": ist.Kind.SEGMENTED,
            "runtime_pinned": ist.Kind.RUNTIME_PINNED}
# Relative cost of one cycle (H200 figures above), to share the budget.
COST = {"registered": 0.45, "segmented": 0.45, "runtime_pinned": 1.45}
MEMORY_UNREGISTERED, MEMORY_HOST = 0, 1
H2D, D2H = 1, 2


def status_bytes(field):
    """A /proc/self/status field (VmRSS, VmPin, VmLck) in bytes, or None."""
    return C._status_kib(field)


def phase_runtime(kind, setup, size):
    """(runtime, StagingBuffer keyword arguments) that force `kind`."""
    rt = setup.runtime
    seg = C.segment_size_for(size)
    if kind == "registered":
        return rt, dict(segment_size=seg)
    if kind == "segmented":
        return inject_faults(rt, f"register>{seg}=invalid_value"), dict(segment_size=seg)
    return inject_faults(rt, "register=invalid_value"), dict(segment_size=seg, prefault_threads=0)


def driver_types(rt, ptrs):
    """{ptr: memory type} as the driver reports it; a failed query is -code."""
    out = {}
    for p in ptrs:
        code, kind = rt.pointer_type(p)
        if code != 0:
            rt.get_last_error()               # never leave it pending
            out[p] = -code
        else:
            out[p] = kind
    return out


def copy_check(rt, buf, device, seed):
    """Fills the buffer, copies it to the GPU span by span (no span crosses a
    registration), reads samples back; returns a list of problems."""
    problems = []
    C.fill(buf.ptr, buf.size, seed=seed)
    offset = 0
    for ptr, n in buf.spans():
        code = rt.memcpy_async(device + offset, ptr, n, H2D)
        if code != 0:
            rt.get_last_error()
            problems.append(f"H2D of span at {offset} failed: {rt.error_name(code)}")
        offset += n
    code = rt.device_synchronize()
    if code != 0:
        rt.get_last_error()
        problems.append(f"synchronize failed: {rt.error_name(code)}")
    sample = 1 << 20
    back = (ctypes.c_ubyte * sample)()
    for off in sorted({0, buf.size // 3, buf.size // 2, max(0, buf.size - sample)}):
        n = min(sample, buf.size - off)
        code = rt.memcpy_async(ctypes.addressof(back), device + off, n, D2H)
        rt.device_synchronize()
        if code != 0:
            rt.get_last_error()
            problems.append(f"D2H at {off} failed: {rt.error_name(code)}")
            continue
        for i in (0, n // 2, n - 1):
            want = C.expected_byte(off + i, seed=seed)
            if back[i] != want:
                problems.append(f"byte {off + i} read back {back[i]}, wrote {want}")
                break
    return problems


def run_phase(kind, setup, args, deadline, device):
    """Up to args.cycles cycles of one kind, until `deadline`; returns the record."""
    rt, kw = phase_runtime(kind, setup, args.size)
    problems = []
    creates, releases, rss_after = [], [], []
    former = set()                             # every address that started a segment

    # One untimed cycle: the first registration after a release of another
    # kind pays for driver bookkeeping that the soak should not count.
    ist.StagingBuffer(args.size, runtime=rt, **kw).close()
    rss0, free0 = status_bytes("VmRSS"), C.mem_free()
    cycles, stopped_early = 0, False
    for i in range(args.cycles):
        if time.monotonic() > deadline:
            stopped_early = True
            break
        t0 = time.perf_counter()
        buf = ist.StagingBuffer(args.size, runtime=rt, **kw)
        t1 = time.perf_counter()
        creates.append(t1 - t0)
        if buf.kind is not EXPECTED[kind]:
            problems.append(f"cycle {i}: kind {buf.kind.name}, expected {EXPECTED[kind].name}")
        starts = [p for p, _ in buf.spans()]
        former.update(starts)
        pinned = driver_types(rt, starts)
        bad = {hex(p): t for p, t in pinned.items() if t != MEMORY_HOST}
        if bad:
            problems.append(f"cycle {i}: not pinned before release: {bad}")
        # The copy check runs on the first cycle and on the last one, which is
        # the last asked for or the last the budget leaves room for.
        per_cycle = (statistics.mean(creates) + statistics.mean(releases)) if releases else 0
        last = i == args.cycles - 1 or time.monotonic() + 2 * per_cycle > deadline
        if i == 0 or last:
            problems += [f"cycle {i}: {p}" for p in copy_check(rt, buf, device, seed=i)]
        t2 = time.perf_counter()
        buf.close()
        releases.append(time.perf_counter() - t2)
        after = driver_types(rt, starts)
        bad = {hex(p): t for p, t in after.items() if t != MEMORY_UNREGISTERED}
        if bad:
            problems.append(f"cycle {i}: still known to the driver after release: {bad}")
        rss_after.append(status_bytes("VmRSS"))
        cycles += 1
        if last and i < args.cycles - 1:
            stopped_early = True
            break
        if (i + 1) % 10 == 0:
            C.progress(f"  {kind}: {i + 1} cycles, create {statistics.mean(creates):.3f} s, "
                       f"release {statistics.mean(releases):.3f} s")
        if len(problems) > 20:
            problems.append("stopping the phase: too many problems")
            break

    # Nothing pinned remains: every former segment start reads unregistered.
    left = {hex(p): t for p, t in driver_types(rt, sorted(former)).items()
            if t != MEMORY_UNREGISTERED}
    if left:
        problems.append(f"{len(left)} former segment start(s) still pinned: "
                        f"{dict(list(left.items())[:5])}")
    rss1, free1 = status_bytes("VmRSS"), C.mem_free()
    if rss0 is not None and rss1 is not None and rss1 - rss0 > args.rss_bound:
        problems.append(f"RSS {C.fmt_size(rss1 - rss0)} above the phase's baseline "
                        f"(bound {C.fmt_size(args.rss_bound)})")
    # MemFree moves with the page cache and other processes: only a loss of
    # a whole buffer (at least 1 GiB) counts as something left allocated.
    if free0 is not None and free1 is not None and free0 - free1 > max(args.size, 1 << 30):
        problems.append(f"system MemFree dropped {C.fmt_size(free0 - free1)}: "
                        "a buffer's worth or more is still allocated")
    return dict(
        kind=kind, cycles=cycles, cycles_asked=args.cycles, stopped_by_budget=stopped_early,
        size=args.size,
        create_mean_s=statistics.mean(creates) if creates else None,
        create_max_s=max(creates) if creates else None,
        release_mean_s=statistics.mean(releases) if releases else None,
        release_max_s=max(releases) if releases else None,
        rss_baseline=rss0, rss_end=rss1,
        rss_after_release_max=max((r for r in rss_after if r is not None), default=None),
        memfree_drop=None if free0 is None or free1 is None else free0 - free1,
        vm_pin=status_bytes("VmPin"), vm_lck=status_bytes("VmLck"),
        former_segment_starts=len(former),
        problems=problems, ok=not problems,
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=200, help="cycles per kind (default 200)")
    ap.add_argument("--budget", type=float, default=330.0,
                    help="seconds for all phases together (default 330)")
    ap.add_argument("--size", type=ist.parse_size, default=2 << 30, help="buffer size (2GiB)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="subset of " + ",".join(KINDS))
    ap.add_argument("--rss-bound", type=ist.parse_size, default=64 << 20,
                    help="allowed RSS growth per phase (64MiB)")
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    ap.add_argument("--simulate", action="store_true", help="SimulatedRuntime, no GPU")
    ap.add_argument("--verbose", action="store_true", help="show the fallback warnings")
    args = ap.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds or any(k not in KINDS for k in kinds) or args.cycles < 1 or args.size <= 0:
        ap.error(f"--kinds from {','.join(KINDS)}, --cycles >= 1, --size > 0")
    C.quiet_logging(args.verbose)

    setup = C.pick_runtime(args.simulate)
    C.banner(setup, f"soak_gpu: {args.cycles} cycles x {', '.join(kinds)} at "
                    f"{C.fmt_size(args.size)}, budget {args.budget:.0f} s")
    if not setup.gpu and not args.simulate:
        print(f"no GPU ({setup.why_simulated}); use --simulate for a host-only dry run")
        return 1
    rt = setup.runtime
    try:
        device = rt.check(*rt.device_malloc(args.size), call=f"device_malloc of {C.fmt_size(args.size)}")
    except ist.RuntimeCallError as e:
        raise SystemExit(str(e)) from None

    start = time.monotonic()
    results = []
    try:
        # Touch the device buffer and the copy path once before any baseline
        # (on the simulated runtime the "device" is host memory: it would
        # count as RSS growth of the first phase).
        with ist.StagingBuffer(args.size, runtime=rt,
                               segment_size=C.segment_size_for(args.size)) as warm:
            problems = copy_check(rt, warm, device, seed=99)
        if problems:
            raise SystemExit(f"warm-up copy failed: {problems}")
        for n, kind in enumerate(kinds):
            # This phase's share of what is left, by the cost of its cycles.
            left = args.budget - (time.monotonic() - start)
            weights = [COST[k] for k in kinds[n:]]
            deadline = time.monotonic() + max(0.0, left) * weights[0] / sum(weights)
            C.progress(f"{kind}: up to {args.cycles} cycles, "
                       f"{deadline - time.monotonic():.0f} s of budget")
            results.append(run_phase(kind, setup, args, deadline, device))
    finally:
        rt.device_free(device)

    rows = []
    for r in results:
        budget = " (budget)" if r["stopped_by_budget"] else ""
        rows.append([r["kind"], f"{r['cycles']}/{r['cycles_asked']}" + budget,
                     C.fmt(r["create_mean_s"]), C.fmt(r["create_max_s"]),
                     C.fmt(r["release_mean_s"]), C.fmt(r["release_max_s"]),
                     C.fmt_size(r["rss_baseline"]), C.fmt_size(r["rss_end"]),
                     C.fmt_size(r["memfree_drop"]), C.fmt_size(r["vm_pin"]),
                     "ok" if r["ok"] else "FAIL"])
    print()
    print(C.table(["kind", "cycles", "create s", "max", "release s", "max",
                   "RSS base", "RSS end", "MemFree drop", "VmPin", "checks"], rows))
    for r in results:
        for p in r["problems"]:
            print(f"FAIL {r['kind']}: {p}")
    total = time.monotonic() - start
    print(f"\n{sum(r['cycles'] for r in results)} cycles in {total:.0f} s")
    C.write_json(args.json, dict(benchmark="soak_gpu", environment=C.environment(setup),
                                 args=dict(cycles=args.cycles, budget=args.budget,
                                           size=args.size, kinds=kinds,
                                           rss_bound=args.rss_bound),
                                 seconds=total, phases=results,
                                 ok=all(r["ok"] for r in results)))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
