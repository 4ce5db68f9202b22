#!/usr/bin/env python3
"""Loading safetensors checkpoints: instant_staging.loader against its peers.

One process, one run, the same files for everyone.  For each size (default
4 GiB and 16 GiB) a checkpoint of 64 MiB bf16 tensors is generated once
(reused when present, with per-tensor checksums beside it), read once so
the page cache is hot, then each method loads it --repeat times (best and
median reported):

  instant_staging        load_file defaults (16 x 8 MiB slots, own buffer per load)
  instant_staging iter   iter_load defaults; also time to the first tensor
  is 2GiB <KIND>         load_file with one reused 2 GiB buffer (256 x 8 MiB) forced
                         into each kind: REGISTERED, SEGMENTED, RUNTIME_PINNED, PAGEABLE
  safetensors            safetensors.torch.load_file(device=...)
  instanttensor AIO_BUFFERED / MMAP
  fastsafetensors nogds  fastsafe_open(nogds=True)
  pinned copy ceiling    one pinned 2 GiB torch tensor copied to the device
                         until the checkpoint's size is covered (no file I/O)

Every result is checked bit-exact against the checksums (two int64 sums of
each tensor's 32-bit words, one weighted by position, computed on the
device).  Peak host memory is the RSS high-water mark of the load above
the RSS before it (/proc/self/clear_refs resets it per run).  Peers that
do not import are skipped with a note.  Without a GPU everything runs on
the CPU (device cpu), says so, and skips the GPU-only peers.

    python benchmarks/bench_load.py [--sizes 4GiB,16GiB] [--dir DIR] [--repeat 3]
        [--device cuda:0] [--json PATH] [--only NAME,...] [-v]
"""

import argparse
import gc
import json
import os
import statistics
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C

import instant_staging as ist
from instant_staging import loader

TENSOR_BYTES = 64 * C.MiB
TENSOR_SHAPE = [4096, 8192]                  # bf16: 64 MiB
STAGING_BYTES = 256 * loader.DEFAULT_CHUNK_SIZE   # InstantTensor's 2 GiB per rank
DEFAULT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".bench")

# Each kind forced on the real runtime, as INSTANT_STAGING_FAULTS would.
FORCED = [
    (ist.Kind.REGISTERED, None, {}),
    (ist.Kind.SEGMENTED, "register#1=invalid_value", {}),
    (ist.Kind.RUNTIME_PINNED, "register=invalid_value", {}),
    (ist.Kind.PAGEABLE, "register=invalid_value;host_alloc=memory_allocation",
     {"allow_pageable": True}),
]


# -- the checkpoint ------------------------------------------------------------

def generate(path, size, seed=1234):
    """Writes a safetensors file of size // 64 MiB bf16 tensors of random bits
    (each tensor distinct) and returns their checksums."""
    import numpy as np
    count = size // TENSOR_BYTES
    if count < 1:
        raise SystemExit(f"sizes must be at least {C.fmt_size(TENSOR_BYTES)}")
    header = {f"layers.{i}.weight": {"dtype": "BF16", "shape": TENSOR_SHAPE,
                                     "data_offsets": [i * TENSOR_BYTES, (i + 1) * TENSOR_BYTES]}
              for i in range(count)}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    base = np.random.default_rng(seed).integers(-(1 << 63), (1 << 63) - 1, TENSOR_BYTES // 8,
                                                dtype=np.int64, endpoint=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for i in range(count):
            f.write((base ^ np.int64(((i + 1) * 0x2545F4914F6CDD1D) % (1 << 63))).data)
    os.replace(tmp, path)


class Checker:
    """Per-tensor checksums on the device, and the comparison of results."""

    def __init__(self, torch, device):
        self.torch, self.device = torch, device
        self._weights = {}

    def sums(self, t):
        torch = self.torch
        x = t.reshape(-1).view(torch.int32).to(torch.int64)
        n = x.numel()
        if n not in self._weights:
            self._weights[n] = torch.arange(n, device=t.device, dtype=torch.int64) % 65521 + 1
        return [int(x.sum()), int((x * self._weights[n]).sum())]

    def reference(self, path):
        """The checksums of ``path`` from plain file reads (not from a loader
        under test), computed once and kept beside it."""
        side = path + ".sums.json"
        st = os.stat(path)
        try:
            with open(side) as f:
                doc = json.load(f)
            if doc["size"] == st.st_size and doc["mtime_ns"] == st.st_mtime_ns:
                return doc["sums"]
        except (OSError, ValueError, KeyError):
            pass
        C.progress(f"  checksums of {os.path.basename(path)} (once)")
        sums = {}
        with open(path, "rb", buffering=0) as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            for name, entry in header.items():
                begin, end = entry["data_offsets"]
                data = bytearray(end - begin)
                f.seek(8 + n + begin)
                f.readinto(data)
                sums[name] = self.sums(self.torch.frombuffer(data, dtype=self.torch.uint8)
                                       .to(self.device))
        with open(side, "w") as f:
            json.dump({"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sums": sums}, f)
        return sums

    def verify(self, result, reference):
        """'ok' or what is wrong."""
        if set(result) != set(reference):
            return f"names differ ({len(result)} vs {len(reference)})"
        for name, t in result.items():
            if t.device.type != self.device.type or t.dtype != self.torch.bfloat16:
                return f"{name}: {t.dtype} on {t.device}"
            if self.sums(t) != reference[name]:
                return f"{name}: checksum differs"
        return "ok"


def warm(path):
    """Reads the file once so every method meets a hot page cache."""
    buf = bytearray(64 * C.MiB)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


# -- the methods -------------------------------------------------------------

class Method:
    """One way to load: ``run()`` returns {name: tensor} (or None for the
    ceiling); ``setup``/``teardown`` bracket its repeats, untimed."""

    def __init__(self, name, run, setup=None, teardown=None, kind="", note="", ttft=False):
        self.name, self.run, self.kind, self.note, self.ttft = name, run, kind, note, ttft
        self.setup = setup or (lambda: None)
        self.teardown = teardown or (lambda: None)


def our_methods(torch, files, device):
    dev = str(device)
    out = [Method("instant_staging", lambda: loader.load_file(files, dev),
                  kind="(own)", note="load_file defaults: 16 x 8 MiB, a buffer per load")]

    def iterate():
        t0 = time.perf_counter()
        with loader.iter_load(files, dev) as it:
            name, first = next(it)
            iterate.ttft = time.perf_counter() - t0
            result = {name: first}
            result.update(it)
        kind = it.staging_kind
        method.kind = kind.name if kind else "ordinary memory"
        method.note = f"iter_load defaults, {it.threads} reader threads"
        return result
    method = Method("instant_staging iter", iterate, ttft=iterate)
    out.append(method)
    if device.type == "cpu":
        return out
    for kind, faults, kw in FORCED:
        out.append(_forced(kind, faults, kw, files, dev))
    return out


def _forced(kind, faults, kw, files, dev):
    from instant_staging.testing import inject_faults
    holder = {}

    def setup():
        runtime = inject_faults(ist.real_runtime(), faults) if faults else ist.real_runtime()
        t0 = time.perf_counter()
        buf = ist.StagingBuffer(STAGING_BYTES, runtime=runtime,
                                copy_unit=loader.DEFAULT_CHUNK_SIZE, **kw)
        holder["buf"] = buf
        method.note = (f"2 GiB buffer made once in {time.perf_counter() - t0:.2f} s, "
                       f"{len(buf.segments)} registration(s)")
        if buf.kind is not kind:
            raise RuntimeError(f"forcing {kind.name} reached {buf.kind.name}")

    def teardown():
        buf = holder.pop("buf", None)
        if buf is not None:
            buf.close()

    method = Method(f"is 2GiB {kind.name}",
                    lambda: loader.load_file(files, dev, staging=holder["buf"]),
                    setup, teardown, kind=kind.name)
    return method


def peer_methods(torch, files, device):
    """(methods, notes): every peer that imports; a note for each that does not."""
    methods, notes = [], []
    dev = str(device)
    try:
        from safetensors.torch import load_file as st_load
        methods.append(Method("safetensors", lambda: _merge(st_load(f, device=dev) for f in files),
                              note=("load_file(device='cpu') maps the file: no copy"
                                    if device.type == "cpu" else "load_file(device=...)")))
    except ImportError as e:
        notes.append(f"safetensors skipped: {e}")
    if device.type == "cpu":
        notes.append("instanttensor, fastsafetensors and the pinned ceiling skipped: no GPU")
        return methods, notes
    try:
        from instanttensor import Backend, safe_open

        def it_load(backend):
            out = {}
            with safe_open(files, framework="pt", device=device.index, backend=backend) as f:
                for name, t in f.tensors():
                    out[name] = t
            return out
        for backend in ("AIO_BUFFERED", "MMAP"):
            chosen = getattr(Backend, backend)
            methods.append(Method(f"instanttensor {backend}",
                                  lambda b=chosen: it_load(b),
                                  note="safe_open, default sizes"))
    except ImportError as e:
        notes.append(f"instanttensor skipped: {e}")
    try:
        from fastsafetensors import fastsafe_open

        def fst_load():
            with fastsafe_open(files, device=dev, nogds=True) as f:
                return {k: f.get_tensor(k) for k in f}
        methods.append(Method("fastsafetensors nogds", fst_load, note="fastsafe_open(nogds=True)"))
    except ImportError as e:
        notes.append(f"fastsafetensors skipped: {e}")
    methods.append(_ceiling(torch, files, device))
    return methods, notes


def _merge(dicts):
    out = {}
    for d in dicts:
        out.update(d)
    return out


def _ceiling(torch, files, device):
    total = sum(os.path.getsize(f) for f in files)
    holder = {}

    def setup():
        holder["src"] = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
        holder["src"].fill_(7)
        holder["dst"] = torch.empty(STAGING_BYTES, dtype=torch.uint8, device=device)

    def run():
        src, dst = holder["src"], holder["dst"]
        for off in range(0, total, STAGING_BYTES):
            n = min(STAGING_BYTES, total - off)
            dst[:n].copy_(src[:n], non_blocking=True)
        return None

    def teardown():
        holder.clear()

    return Method("pinned copy ceiling", run, setup, teardown,
                  note=f"pinned 2 GiB torch tensor -> {device}, no file I/O")


# -- measuring -----------------------------------------------------------------

def sync(torch, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(method, torch, device, checker, reference, repeat, budget):
    """Runs ``method`` up to ``repeat`` times; returns its record."""
    rec = dict(method=method.name, kind=method.kind, note=method.note, times=[], ttft=[],
               peak_rss=[], verified=[], error=None)
    try:
        method.setup()
        rec["note"] = method.note
        for i in range(repeat):
            gc.collect()
            sync(torch, device)
            rss0 = C._status_kib("VmRSS")
            peak_ok = C.reset_peak_rss()
            t0 = time.perf_counter()
            result = method.run()
            sync(torch, device)
            seconds = time.perf_counter() - t0
            hwm = C._status_kib("VmHWM")
            rec["times"].append(seconds)
            rec["peak_rss"].append(hwm - rss0 if peak_ok and hwm and rss0 else None)
            if method.ttft:
                rec["ttft"].append(method.ttft.ttft)
            rec["kind"], rec["note"] = method.kind, method.note
            if result is not None:
                rec["verified"].append(checker.verify(result, reference))
            del result
            _free(torch, device)
            if seconds * (i + 2) > budget:
                rec["note"] += f"; stopped after {i + 1} run(s): over the {budget:.0f} s budget"
                break
    except Exception as e:      # a peer failing must not end the comparison
        rec["error"] = f"{type(e).__name__}: {e}"
        _free(torch, device)
    finally:
        try:
            method.teardown()
        except Exception as e:
            rec["error"] = rec["error"] or f"teardown: {e}"
        _free(torch, device)
    return rec


def _free(torch, device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def summarize(rec, nbytes):
    times = rec["times"]
    rec["best"] = min(times) if times else None
    rec["median"] = statistics.median(times) if times else None
    rec["gbps_best"] = nbytes / rec["best"] / 1e9 if times else None
    rec["gbps_median"] = nbytes / rec["median"] / 1e9 if times else None
    rec["ttft_best"] = min(rec["ttft"]) if rec["ttft"] else None
    rec["ttft_median"] = statistics.median(rec["ttft"]) if rec["ttft"] else None
    peaks = [p for p in rec["peak_rss"] if p is not None]
    rec["peak_rss_max"] = max(peaks) if peaks else None
    checks = set(rec["verified"])
    rec["bit_exact"] = (None if not checks else checks == {"ok"})
    return rec


def row(size, rec):
    if rec["error"]:
        return [C.fmt_size(size), rec["method"], rec["kind"], "-", "-", "-", "-", "-",
                "ERROR: " + rec["error"][:60]]
    exact = {None: "n/a", True: "yes", False: "NO: " + "; ".join(
        sorted(v for v in set(rec["verified"]) if v != "ok"))[:60]}[rec["bit_exact"]]
    return [C.fmt_size(size), rec["method"], rec["kind"], C.fmt(rec["best"]),
            C.fmt(rec["median"]), C.fmt(rec["gbps_best"], ".1f"),
            C.fmt(rec["ttft_best"] and rec["ttft_best"] * 1e3, ".1f"),
            C.fmt_size(rec["peak_rss_max"]), exact]


# -- main ----------------------------------------------------------------------

def pick_device(torch, wanted):
    if wanted:
        return torch.device(wanted), None
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device()), None
    return torch.device("cpu"), f"torch {torch.__version__} sees no GPU"


def environment(torch, device):
    env = dict(python=sys.version.split()[0], torch=torch.__version__, device=str(device),
               cpus=len(os.sched_getaffinity(0)), backend=ist.BACKEND,
               faults_env=os.environ.get("INSTANT_STAGING_FAULTS"))
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    for mod in ("safetensors", "instanttensor", "fastsafetensors"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:
            env[mod] = None
    return env


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4GiB,16GiB", help="checkpoint sizes (64 MiB tensors)")
    ap.add_argument("--dir", default=DEFAULT_DIR, help="where checkpoints live (local disk)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default=None, help="default: cuda if torch sees one, else cpu")
    ap.add_argument("--budget", type=float, default=60.0,
                    help="seconds one method may take over its repeats for one size")
    ap.add_argument("--only", default=None, help="comma-separated method name prefixes")
    ap.add_argument("--json", default=None)
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    C.quiet_logging(args.verbose)
    import torch
    started = time.perf_counter()
    device, why_cpu = pick_device(torch, args.device)
    print("=" * 78)
    print(f"bench_load -- device {device}" + (f" (NO GPU: {why_cpu}; CPU copies only)" if why_cpu else ""))
    print("=" * 78, flush=True)
    os.makedirs(args.dir, exist_ok=True)
    checker = Checker(torch, device)
    doc = dict(environment=environment(torch, device), sizes=[], results=[], notes=[])
    rows = []
    for size in C.parse_sizes(args.sizes):
        path = os.path.join(args.dir, f"bench-{size // C.MiB}MiB.safetensors")
        if not os.path.exists(path) or os.path.getsize(path) < size:
            C.progress(f"generating {path}")
            t0 = time.perf_counter()
            generate(path, size)
            doc["notes"].append(f"generated {path} in {time.perf_counter() - t0:.1f} s")
        files = [path]
        nbytes = os.path.getsize(path)
        warm(path)
        reference = checker.reference(path)
        _free(torch, device)
        methods = our_methods(torch, files, device)
        peers, notes = peer_methods(torch, files, device)
        doc["notes"] += [n for n in notes if n not in doc["notes"]]
        for method in methods + peers:
            if args.only and not any(method.name.startswith(p) for p in args.only.split(",")):
                continue
            C.progress(f"  {C.fmt_size(size)} {method.name}")
            rec = summarize(measure(method, torch, device, checker, reference, args.repeat,
                                    args.budget), nbytes)
            rec["size"] = nbytes
            doc["results"].append(rec)
            rows.append(row(size, rec))
        doc["sizes"].append(nbytes)
    print(C.table(["size", "method", "kind", "best s", "median s", "GB/s best", "TTFT ms",
                   "peak RSS", "bit-exact"], rows))
    for note in doc["notes"]:
        print("note:", note)
    doc["seconds"] = time.perf_counter() - started
    print(f"total {doc['seconds']:.0f} s")
    C.write_json(args.json, doc)
    bad = [r for r in doc["results"] if r["bit_exact"] is False
           or (r["error"] and r["method"].startswith(("instant_staging", "is ")))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
