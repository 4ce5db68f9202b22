"""What bench_alloc.py and bench_h2d.py share: runtime choice, raw memory,
memory accounting, the environment record, tables, targets and JSON.

Benchmarks reach the GPU only through instant_staging's runtime table (the
same seam the state machine uses), so one script measures the real driver
on a GPU host and the SimulatedRuntime elsewhere, and says which.
"""

import ctypes
import json
import logging
import mmap
import os
import platform
import resource
import statistics
import sys
import threading
import time

try:
    import instant_staging as ist
except ImportError:  # run from a checkout built with build_ext --inplace
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import instant_staging as ist

PAGE = mmap.PAGESIZE
GiB = 1 << 30
MiB = 1 << 20

# -- the runtime -------------------------------------------------------------


class Setup:
    """The runtime a benchmark measures, and whether it is a real GPU.

    ``gpu`` is False on the simulated runtime; ``why_simulated`` then says
    why (``--simulate``, or what the real runtime answered).
    """

    def __init__(self, runtime, gpu, why_simulated=None):
        self.runtime = runtime
        self.gpu = gpu
        self.why_simulated = why_simulated

    @property
    def label(self):
        if self.gpu:
            code, name = self.runtime.device_name(0)
            return f"{self.runtime.name} runtime, device 0: {name if code == 0 else '?'}"
        return f"SIMULATED runtime ({self.why_simulated}): no GPU, no driver"


def pick_runtime(simulate=False):
    """The real runtime when it sees a device (device 0 made current),
    else the SimulatedRuntime with the reason."""
    from instant_staging.testing import SimulatedRuntime
    if simulate:
        return Setup(SimulatedRuntime(log_limit=0), False, "--simulate")
    try:
        rt = ist.real_runtime()
        code, count = rt.device_count()
    except Exception as e:  # a build without a loadable runtime library
        return Setup(SimulatedRuntime(log_limit=0), False, f"real runtime unavailable: {e}")
    if code != 0 or count == 0:
        why = (f"device_count returned {rt.error_name(code)}" if code
               else "the real runtime sees no device")
        return Setup(SimulatedRuntime(log_limit=0), False, why)
    try:
        rt.check(rt.set_device(0), call="set_device(0)")
    except ist.RuntimeCallError as e:
        raise SystemExit(str(e)) from None
    return Setup(rt, True)


def warm_up(setup):
    """Creates the CUDA context and touches each path once, untimed, so that
    the first measured run does not pay for driver initialisation."""
    rt = setup.runtime
    rt.device_synchronize()
    code, ptr = rt.host_alloc(4 * MiB)
    if code == 0:
        rt.free_host(ptr)
    else:
        rt.get_last_error()
    ist.StagingBuffer(4 * MiB, runtime=rt, prefault_threads=2).close()


def torch_cuda():
    """torch if it is importable and sees a GPU, else None (and why)."""
    try:
        import torch
    except ImportError:
        return None, "torch not installed"
    if not torch.cuda.is_available():
        return None, f"torch {torch.__version__} sees no GPU"
    torch.cuda.init()
    return torch, None


def torch_empty_host_cache(torch):
    """Hands torch's cached pinned blocks back to the driver (cudaFreeHost);
    True if this torch has a way to.  Without it a second pin_memory of the
    same size is a cache hit, not an allocation."""
    # Public since torch.accelerator grew it; private names before that.
    for fn in (getattr(getattr(torch, "accelerator", None), "empty_host_cache", None),
               getattr(torch._C, "_accelerator_emptyHostCache", None),
               getattr(torch._C, "_host_emptyCache", None)):
        if fn is not None:
            fn()
            return True
    return False


def segment_size_for(size):
    """Segment size for the forced SEGMENTED kind: the default 256 MiB, or
    an eighth of a buffer no larger than that (the state machine skips
    segmenting a buffer that fits one segment)."""
    default = 256 * MiB
    if size > default:
        return default
    return max(PAGE, size // 8 // PAGE * PAGE)


# -- raw memory through libc (the references) --------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
MADV_WILLNEED = 3
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux 5.14


def map_anonymous(size):
    """Page-aligned private anonymous memory, pages untouched; returns the address."""
    ptr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if ptr is None or ptr == ctypes.c_void_p(-1).value:
        raise MemoryError(f"mmap of {size} bytes: {os.strerror(ctypes.get_errno())}")
    return ptr


def map_file(fd, size):
    """The first ``size`` bytes of ``fd``, mapped shared and read-only, its
    cached pages mapped now (MADV_WILLNEED); returns the address."""
    ptr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if ptr is None or ptr == ctypes.c_void_p(-1).value:
        raise OSError(ctypes.get_errno(), "mmap")
    advise(ptr, size, MADV_WILLNEED)
    return ptr


def unmap(ptr, size):
    if _libc.munmap(ptr, size) != 0:
        raise OSError(ctypes.get_errno(), "munmap")


def advise(ptr, size, advice):
    """madvise(2); 0 or -1 (advice only: a refusal is not an error here)."""
    return _libc.madvise(ptr, size, advice)


def same_bytes(a, b, size):
    """Whether ``size`` bytes at addresses ``a`` and ``b`` are equal."""
    return _libc.memcmp(a, b, size) == 0


def populate_write(ptr, size, threads):
    """MADV_POPULATE_WRITE over [ptr, ptr+size) in `threads` slices at once
    (ctypes drops the GIL during each call).  Raises OSError if refused."""
    per = -(-size // threads // PAGE) * PAGE
    errors = []

    def work(lo):
        n = min(per, size - lo)
        if n > 0 and _libc.madvise(ptr + lo, n, MADV_POPULATE_WRITE) != 0:
            errors.append(ctypes.get_errno())
    workers = [threading.Thread(target=work, args=(i * per,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise OSError(errors[0], f"MADV_POPULATE_WRITE: {os.strerror(errors[0])}")


def fill(ptr, size, chunk=8 * MiB, seed=0):
    """Writes a byte pattern that differs per chunk (and per seed), so a
    misplaced or missing chunk shows when read back."""
    off = 0
    while off < size:
        n = min(chunk, size - off)
        ctypes.memset(ptr + off, expected_byte(off, chunk, seed), n)
        off += n


def expected_byte(offset, chunk=8 * MiB, seed=0):
    """The byte fill() wrote at `offset`: never 0, so untouched memory fails."""
    return (offset // chunk + 7 * seed) % 251 + 1


# -- memory accounting -------------------------------------------------------


def _status_kib(field, path="/proc/self/status"):
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def huge_bytes(ptr, path="/proc/self/smaps"):
    """AnonHugePages of the mapping holding address ``ptr`` (bytes), or None."""
    try:
        with open(path) as f:
            inside = False
            for line in f:
                head = line.split()[0]
                if "-" in head and ":" not in head:      # a mapping's first line
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= ptr < hi
                elif inside and head == "AnonHugePages:":
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def mem_free():
    """System-wide free memory in bytes (driver allocations show here, not in RSS)."""
    return _status_kib("MemFree", "/proc/meminfo")


def anon_huge():
    """Bytes of this process's memory in transparent huge pages."""
    return _status_kib("AnonHugePages", "/proc/self/smaps_rollup")


def reset_peak_rss():
    """Resets VmHWM to the current RSS (Linux >= 4.0); False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class MemoryProbe:
    """Resident memory around one allocation: process RSS, its peak, and the
    lowest system MemFree seen while it was made (sampled every 2 ms by a
    thread; the allocation paths release the GIL)."""

    def __enter__(self):
        self.rss0 = _status_kib("VmRSS")
        self.huge0 = anon_huge()
        self.free0 = mem_free()
        self.peak_ok = reset_peak_rss()
        self._min_free = self.free0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            free = mem_free()
            if free is not None and (self._min_free is None or free < self._min_free):
                self._min_free = free

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        free = mem_free()
        if free is not None and self._min_free is not None:
            self._min_free = min(self._min_free, free)
        self.rss1 = _status_kib("VmRSS")
        self.hwm = _status_kib("VmHWM") if self.peak_ok else None
        self.huge1 = anon_huge()
        self.free1 = free
        return False

    def after_release(self):
        self.rss2 = _status_kib("VmRSS")

    def report(self, size, own_mapping, resident=True):
        """The record for JSON, with a verdict.

        own_mapping: the memory is instant_staging's (or our) mmap, so RSS
        must never peak above the page-rounded size (no double allocation,
        no power-of-two rounding) and, once `resident` (pinned by a driver
        or prefaulted), rise by exactly that.  Driver-allocated pinned
        memory may not appear in RSS at all; there the system MemFree drop
        is reported and only a doubled peak is flagged.
        """
        def d(a, b):
            return None if a is None or b is None else a - b
        rec = dict(
            size=size,
            rss_delta=d(self.rss1, self.rss0),
            rss_peak_delta=d(self.hwm, self.rss0),
            rss_after_release_delta=d(getattr(self, "rss2", None), self.rss0),
            sys_delta=d(self.free0, self.free1),
            sys_peak_delta=d(self.free0, self._min_free),
            thp_delta=d(self.huge1, self.huge0),
        )
        expected = -(-size // PAGE) * PAGE
        # Python's own allocations and kernel accounting granularity (RSS is
        # updated in per-CPU batches) make a small fixed slack necessary.
        tol = 2 * MiB + size // 1000
        problems = []
        if own_mapping:
            if (resident and rec["rss_delta"] is not None
                    and abs(rec["rss_delta"] - expected) > tol):
                problems.append(f"RSS grew {fmt_size(rec['rss_delta'])}, expected {fmt_size(expected)}")
            if rec["rss_peak_delta"] is not None and rec["rss_peak_delta"] > expected + tol:
                problems.append(f"RSS peaked {fmt_size(rec['rss_peak_delta'])} above the start")
        if rec["sys_peak_delta"] is not None and rec["sys_peak_delta"] > 1.5 * size + 64 * MiB:
            problems.append(f"system memory dropped {fmt_size(rec['sys_peak_delta'])} at peak "
                            "(double allocation?)")
        if rec["rss_after_release_delta"] is not None and rec["rss_after_release_delta"] > tol:
            problems.append(f"{fmt_size(rec['rss_after_release_delta'])} still resident after release")
        rec["expected"] = expected
        rec["own_mapping"] = own_mapping
        rec["resident_expected"] = bool(resident)
        rec["checked"] = ("rss" if resident else "rss peak only") if own_mapping else "system"
        rec["ok"] = not problems
        rec["problems"] = problems
        return rec


# -- environment record ------------------------------------------------------


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def environment(setup):
    """What the numbers depend on: host, kernel, THP, driver, torch."""
    rt = setup.runtime
    env = dict(
        python=platform.python_version(),
        kernel=platform.release(),
        cpus=os.cpu_count(),
        cpus_usable=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        mem_total=_status_kib("MemTotal", "/proc/meminfo"),
        thp=_read("/sys/kernel/mm/transparent_hugepage/enabled"),
        thp_defrag=_read("/sys/kernel/mm/transparent_hugepage/defrag"),
        memlock=resource.getrlimit(resource.RLIMIT_MEMLOCK)[0],
        backend=ist.BACKEND,
        runtime=rt.name,
        gpu=setup.gpu,
        simulated_because=setup.why_simulated,
        prefault_threads_env=os.environ.get("INSTANT_STAGING_PREFAULT_THREADS"),
        hugepages_env=os.environ.get("INSTANT_STAGING_HUGEPAGES"),
    )
    if setup.gpu:
        env["device"] = rt.device_name(0)[1]
        env["runtime_version"] = rt.runtime_version()[1]
        env["driver_version"] = rt.driver_version()[1]
    try:
        import torch
        env["torch"] = torch.__version__
    except ImportError:
        env["torch"] = None
    return env


# -- statistics, tables, targets, output --------------------------------------


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt_size(n):
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    return sign + ist.format_size(abs(int(n))).replace(" ", "")


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def table(headers, rows):
    """Plain-text table, columns as wide as their widest cell."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    def line(r):
        return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


class Targets:
    """PASS/FAIL/SKIP verdicts, printed and written to JSON."""

    def __init__(self, setup):
        self.setup = setup
        self.items = []

    def check(self, name, ok, value, detail):
        """ok None means the inputs are missing (SKIP)."""
        if not self.setup.gpu:
            status, detail = "SKIP", f"simulated runtime, no GPU: {detail}"
        elif ok is None:
            status = "SKIP"
        else:
            status = "PASS" if ok else "FAIL"
        self.items.append(dict(name=name, status=status, value=value, detail=detail))

    def print(self, out=sys.stdout):
        print("\nTargets (H200, DESIGN issue 6):", file=out)
        for t in self.items:
            print(f"  {t['status']:4}  {t['name']}: {t['detail']}", file=out)

    @property
    def failed(self):
        return any(t["status"] == "FAIL" for t in self.items)


def banner(setup, what):
    line = "=" * 78
    print(line)
    print(f"{what} -- {setup.label}")
    if not setup.gpu:
        print("NO GPU: measuring only what exists here (host memory, the prefault and the")
        print("simulated runtime's bookkeeping). Driver pinning and PCIe copies are NOT")
        print("measured; the figures below say nothing about a GPU host. Targets: SKIP.")
    print(line, flush=True)


def write_json(path, doc):
    if path:
        with open(path, "w") as f:
            json.dump(doc, f, indent=2, default=str)
            f.write("\n")
        print(f"\nJSON written to {path}")


def quiet_logging(verbose):
    """Forced fallbacks warn on every run; keep the table readable."""
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("instant_staging").setLevel(logging.INFO if verbose else logging.ERROR)


def progress(msg):
    print(msg, file=sys.stderr, flush=True)


def changed(torch, tensors, fraction, seed=1):
    """A copy of ``tensors`` with ``fraction`` of each one's elements changed
    (the low bit of each flipped, at random positions drawn on the tensor's
    device: a 16 GB model in seconds, every dtype, never equal)."""
    out = {}
    for i, (name, t) in enumerate(tensors.items()):
        new = t.clone()
        n = new.numel()
        k = int(n * fraction)
        if k:
            g = torch.Generator(device=new.device).manual_seed(seed + i)
            flat = new.reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                                         8: torch.int64}[new.element_size()])
            flat[torch.randint(0, n, (k,), generator=g, device=new.device)] ^= 1
        out[name] = new
    return out


def parse_sizes(text):
    sizes = [ist.parse_size(s) for s in text.split(",") if s.strip()]
    if not sizes or any(s <= 0 for s in sizes):
        raise SystemExit(f"--sizes needs positive sizes, got {text!r}")
    return sizes


def now():
    return time.perf_counter()


def parse_kinds(parser, text, known):
    """'a,b' -> ['a', 'b'], a usage error naming the unknown ones."""
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    unknown = set(kinds) - set(known)
    if unknown or not kinds:
        parser.error(f"unknown kinds {sorted(unknown)}; known: {', '.join(known)}")
    return kinds


def add_common_options(parser):
    """The options every benchmark script shares."""
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--simulate", action="store_true",
                        help="use the simulated runtime even if a GPU is present")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a target FAILs")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show the fallback warnings")


QUICK_SCALE = 64     # --quick: each matrix dimension of a layout this many times smaller


def add_layout_options(parser, *, layouts, layouts_help, dir_default=None, dir_help):
    """The options of the benchmarks that time torch over bench_load.py's
    layouts (load, reload, update, save, save_dcp): --layouts, --dir,
    --repeat, --device, --quick and --json."""
    parser.add_argument("--layouts", default=layouts, help=layouts_help)
    parser.add_argument("--dir", default=dir_default, help=dir_help)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default=None, help="default: cuda if torch sees one, else cpu")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke test: layouts {QUICK_SCALE}x smaller per dimension, "
                             "one repeat")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")


def scale_and_repeat(args):
    """(how many times smaller each layout's dimensions, how many runs),
    as --quick and --repeat ask."""
    return (QUICK_SCALE, 1) if args.quick else (1, args.repeat)


def run_timed(parser, args, title, run):
    """Checks --runs, picks the runtime, prints the banner and times
    ``run(args, setup)``; returns (setup, results, skipped, seconds)."""
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    quiet_logging(args.verbose)
    setup = pick_runtime(args.simulate)
    banner(setup, title)
    start = time.perf_counter()
    results, skipped = run(args, setup)
    return setup, results, skipped, time.perf_counter() - start


def torch_for(setup, kinds):
    """(torch or None, the kinds left, {kind: why skipped}): torch_pinned
    needs torch on a real GPU, so it is dropped, with the reason, without."""
    torch, why = (None, "skipped on the simulated runtime")
    if setup.gpu:
        torch, why = torch_cuda()
    kinds = list(kinds)
    skipped = {}
    if "torch_pinned" in kinds and torch is None:
        kinds.remove("torch_pinned")
        skipped["torch_pinned"] = why
    return torch, kinds, skipped
