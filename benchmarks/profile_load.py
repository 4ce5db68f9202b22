#!/usr/bin/env python3
"""Where a load's time goes, measured on bench_load.py's layouts.

The loader is taken apart on the same files (page cache hot), each number
the best of --repeat runs, GB/s over the layout's bytes:

  phases     one load_file with the defaults, step by step: headers, tensor
             allocation, staging buffer, planning, the pipeline run (threads
             start to last copy), the consumer's yields, release
  reads      pread only (the pipeline with SKIP_COPY, ordinary memory):
             T threads over one file vs the 4 dense shards vs one dense shard
  copies     copies only (SKIP_READ: the slots are copied as they are) with
             the layout's piece pattern, chunk x depth x threads: the per-copy
             and per-tensor cost
  pipeline   read + copy into pre-allocated tensors through one reused
             staging buffer (no fixed per-load costs): chunk x depth x threads
  spin       the same with events that sleep (cudaEventBlockingSync) instead
             of spinning
  load_file  the whole call with a few settings, and with a reused buffer
  host       the pipeline and load_file into CPU memory
  timeline   the real load_file (defaults, the staging buffer kept, torch's
             cache emptied before each run, as bench_judge.py's check), its
             steps stamped from the call: headers parsed, plan, staging taken,
             blocks allocated, readers started, last address given, views
             made, first and last tensor finished, readers joined, returned
  engine     the copy engine's own timeline (CUPTI, through torch.profiler):
             every host-to-device copy's start, end and bytes on the GPU,
             during the real load_file (as timeline runs it), during
             load_into of the same checkpoint into a tensor per allocation
             (a model's parameters, through one open Checkpoint), during the
             pipeline's copies alone (SKIP_READ, the defaults), and during
             2 MiB copies of one pinned torch tensor over 16 streams (no
             loader, no readers): how long the engine idles between copies,
             and at what rate it moves bytes while it copies
  first      (alone: --sections first, one layout) in this fresh process, CUDA
             started first, the first and the second load_file stamped as
             timeline stamps them: what a server's first load adds;
             --first-cold: nothing started and the page cache dropped (a
             script's cold start), the bytes copied sampled per tenth

    python benchmarks/profile_load.py [--layouts dense,moe] [--dir DIR] [--json PATH]
        [--sections phases,reads,copies,pipeline,spin,load_file,host,timeline] [--quick]
    python benchmarks/profile_load.py --layouts moe --sections first [--first-cold]
"""

import argparse
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C
import bench_load as B

from instant_staging import loader
from instant_staging.defaults import reader_threads
from instant_staging.loader import _prepare as P
from instant_staging.loader import _run as L
from instant_staging.loader import _staging_pool
from instant_staging.loader._pipeline import SKIP_COPY, SKIP_READ, Pipeline, Plan
from instant_staging.loader._shards import Shards
from instant_staging.loader._target import _TorchTarget

MiB = C.MiB
SECTIONS = ("phases", "reads", "copies", "pipeline", "spin", "load_file", "host", "timeline", "engine",
            "first")


def best(fn, repeat, *args, reset=None, **kwargs):
    """The fastest of ``repeat`` calls; ``reset()`` runs untimed before each
    (load_file rows: torch's cache emptied, as bench_load does, so that each
    load pays its own cudaMalloc)."""
    times = []
    for _ in range(repeat):
        if reset is not None:
            reset()
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        times.append(time.perf_counter() - t0)
    return min(times)


class Files:
    """A layout's files, opened and parsed once; tensors allocated once."""

    def __init__(self, torch, paths, device):
        self.torch, self.paths, self.device = torch, paths, device
        self.ck = Shards().open(paths)
        self.nbytes = self.ck.total_bytes
        self.target = _TorchTarget(torch, device)
        dtypes = [self.target.check(t, paths[i]) for i, t in self.ck.entries]
        self.handles = []
        self.dsts = [L._allocate(self.handles, self.target, e, d)
                     for (_, e), d in zip(self.ck.entries, dtypes)]
        self.ranges = [(self.ck.fds[i], t.begin, t.end) for i, t in self.ck.entries]
        self.plans = {}

    def plan(self, chunk):
        if chunk not in self.plans:
            self.plans[chunk] = Plan(self.ranges, chunk)
        return self.plans[chunk]

    def close(self):
        self.handles.clear()
        self.ck.close()


def run_pipe(plan, dsts, threads, staging=None, depth=None, device=None, skip=0):
    pipe = Pipeline(plan, threads=threads, staging=staging, depth=depth, device=device, skip=skip)
    B.run_to_end(pipe, dsts)
    return pipe


def section_phases(torch, name, paths, device, repeat, out):
    """One default load, step by step (what _load does, timed; the staging
    buffer here in this thread, where a load makes it beside the blocks)."""
    rows = []
    for _ in range(repeat):
        t = {}
        t0 = time.perf_counter()
        ck = Shards().open(paths)
        target = _TorchTarget(torch, device)
        dtypes = [target.check(e, paths[i]) for i, e in ck.entries]
        t["headers"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        start = P.plan_chunks(ck, target, dtypes, loader.DEFAULT_CHUNK_SIZE, None, True)
        plan = start.plan
        t["plan"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        target.before_copies()
        blocks = target.allocate_blocks(start.runs, ck.entries, dtypes)
        t["blocks"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        depth = P.slot_count(plan, None, None)
        gpu = device.type == "cuda"
        kept = bool(loader._staging_pool.kept())
        buf = _staging_pool.own(target.index, *P.staging_size(plan, depth)) if gpu else None
        t["staging_kept" if kept else "staging_made"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        pipe = Pipeline(plan, threads=reader_threads(), staging=buf, depth=depth,
                        device=target.index if gpu else None)
        t["pipeline"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        handles = []
        L._start(pipe, handles, target, ck, dtypes, start.runs, blocks)
        del blocks
        t["allocate_while_running"] = time.perf_counter() - t1
        first = None
        while True:
            finished, _, exited, failed = pipe.wait(0.05)
            if finished and first is None:
                first = time.perf_counter() - t1
            if exited or failed:
                break
        t["run"] = time.perf_counter() - t1
        t["first_tensor_in_run"] = first
        t1 = time.perf_counter()
        pipe.close()
        t["join"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        if buf is not None:
            loader._staging_pool.give(target.index, buf)
        t["give_back_staging"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        handles.clear()
        ck.close()
        t["free"] = time.perf_counter() - t1
        t["total"] = time.perf_counter() - t0
        t["run_gbps"] = ck.total_bytes / t["run"] / 1e9
        t["total_gbps"] = ck.total_bytes / t["total"] / 1e9
        t["threads"] = pipe.n_threads
        t["slots"] = pipe.slots
        t["chunks"] = pipe.n_chunks
        rows.append(t)
        B._free(torch, device)
    for r in rows[:1]:      # the first run made the buffer: its cost, apart
        out.append(dict(section="phases", layout=name, what="first run", **r))
        C.progress(f"  {name} phases, first run: staging made {r.get('staging_made', 0) * 1e3:.1f} ms, "
                   f"total {r['total'] * 1e3:.1f} ms")
    bestrow = min(rows, key=lambda r: r["total"])
    out.append(dict(section="phases", layout=name, **bestrow))
    C.progress(f"  {name} phases: " + ", ".join(
        f"{k} {v * 1e3:.1f} ms" if isinstance(v, float) and not k.endswith("gbps") else f"{k} {v:.4g}"
        for k, v in bestrow.items() if v is not None))
    # Allocating the tensors alone (no threads running), torch's cache empty:
    # per tensor, and after reserve() (one block, then cut).
    for label, reserve in (("allocate_alone", False), ("allocate_alone_reserved", True)):
        ck = Shards().open(paths)
        target = _TorchTarget(torch, device)
        dtypes = [target.check(e, paths[i]) for i, e in ck.entries]
        times = []
        for _ in range(repeat):
            B._free(torch, device)
            handles = []
            t1 = time.perf_counter()
            if reserve:
                target.reserve([e for _, e in ck.entries])
            for (_, e), d in zip(ck.entries, dtypes):
                L._allocate(handles, target, e, d)
            B.sync(torch, device)
            times.append(time.perf_counter() - t1)
            handles.clear()
        ck.close()
        out.append({"section": "phases", "layout": name, "what": label, "seconds": min(times)})
        C.progress(f"  {name} {label}: {min(times) * 1e3:.1f} ms")
    B._free(torch, device)
    loader.empty_cache()
    # The same through load_file, for the consumer's share.
    tl = best(lambda: loader.load_file(paths, str(device)), repeat,
              reset=lambda: B._free(torch, device))
    B._free(torch, device)
    out.append({"section": "phases", "layout": name, "what": "load_file", "seconds": tl,
                    "gbps": ck.total_bytes / tl / 1e9})
    C.progress(f"  {name} load_file defaults {tl * 1e3:.1f} ms = {ck.total_bytes / tl / 1e9:.1f} GB/s")


class _Stamps:
    """Times since the load's call, by step (``timeline``)."""

    def __init__(self):
        self.t0, self.marks = None, {}

    def mark(self, what, first=False):
        if self.t0 is not None and not (first and what in self.marks):
            self.marks[what] = time.perf_counter() - self.t0


class _StampedPipeline:
    """The reader pipeline, its calls stamped (everything else passes through)."""

    def __init__(self, real, stamps, *args, **kwargs):
        self._stamps = stamps
        stamps.mark("pipeline made")
        self._pipe = real(*args, **kwargs)

    def start(self, *args, **kwargs):
        self._stamps.mark("readers started")
        return self._pipe.start(*args, **kwargs)

    def provide(self, ptrs):
        ok = self._pipe.provide(ptrs)
        self._stamps.mark("first addresses given", first=True)
        self._stamps.mark("last address given")     # (each batch's: the last one stays)
        return ok

    def wait(self, timeout):
        finished, _, exited, _ = result = self._pipe.wait(timeout)
        if finished:
            self._stamps.mark("first tensor finished", first=True)
        if exited:
            self._stamps.mark("readers exited", first=True)
        return result

    def close(self):
        self._pipe.close()
        self._stamps.mark("readers joined", first=True)

    def __getattr__(self, name):
        return getattr(self._pipe, name)


def _stamped(stamps, module, name, label, called=None):
    """Wraps ``module.name`` so that its return is stamped as ``label``
    (an ``early_staging`` only where it began one), and its call as
    ``called`` where given."""
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        if called is not None:
            stamps.mark(called, first=True)
        out = real(*args, **kwargs)
        if out is not None or name != "early_staging":
            stamps.mark(label, first=True)
        return out
    setattr(module, name, wrapper)
    return real


class _Stamping:
    """load_file's steps stamped (``_Stamps``) while inside: the loader's
    functions wrapped, the Pipeline class replaced, all put back on exit."""

    def __init__(self, stamps):
        self.stamps = stamps

    def _collected(self, phase, info):
        # The collector's runs inside a stamped call: "gc genN" at its start,
        # with its milliseconds.
        stamps = self.stamps
        if stamps.t0 is None:
            return
        now = time.perf_counter()
        if phase == "start":
            self._gc_start = now
        elif self._gc_start is not None:
            label = f"gc gen{info['generation']} {1e3 * (now - self._gc_start):.1f} ms"
            while label in stamps.marks:
                label += "'"
            stamps.marks[label] = self._gc_start - stamps.t0
            self._gc_start = None

    def __enter__(self):
        import gc

        from instant_staging.loader import _checkpoint, _load, _pipeline, _prepare, _shards, _target
        stamps = self.stamps
        self._gc_start = None
        gc.callbacks.append(self._collected)
        self.real_pipe = real_pipe = _pipeline.Pipeline
        # (where, function): the label its return is stamped with
        steps = [(_shards.Shards, "open", "headers parsed"),
                 (_shards.Shards, "warm_if_cold", "warming asked"),
                 (_shards.Shards, "stop_warming", "warming joined"),
                 (_load, "early_staging", "staging begun at the door"),
                 (_checkpoint, "early_staging", "staging begun at the door"),
                 (_checkpoint, "usable_target", "device usable"),
                 (_prepare, "plan_chunks", "planned"),
                 (_prepare, "begin_staging", "staging begun"),
                 (L, "_allocate_blocks", "blocks allocated"),
                 (_prepare, "_use_device", "device set (its thread)", "staging thread running"),
                 (_prepare.PendingStaging, "_make", "staging made (its thread)"),
                 (_prepare.PendingStaging, "take", "staging taken"),
                 (_target._TorchTarget, "views", "views made")]
        self.patched = [(where, step[0], _stamped(stamps, where, *step))
                        for where, *step in steps]
        _pipeline.Pipeline = lambda *a, **k: _StampedPipeline(real_pipe, stamps, *a, **k)
        return self

    def __exit__(self, *exc):
        import gc

        from instant_staging.loader import _pipeline
        gc.callbacks.remove(self._collected)
        _pipeline.Pipeline = self.real_pipe
        for module, attr, real in self.patched:
            setattr(module, attr, real)

    def run(self, fn):
        """``fn()``'s result, its steps stamped from the call to its return
        (the device synchronized); the stamps are ``self.stamps.marks``."""
        self.stamps.marks = {}
        self.stamps.t0 = time.perf_counter()
        result = fn()
        self.stamps.mark("returned")
        return result


def _timeline_line(marks, nbytes):
    return (f"{nbytes / marks['returned'] / 1e9:.1f} GB/s: "
            + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in sorted(marks.items(), key=lambda kv: kv[1])))


def section_first(torch, name, paths, device, out, cold=False):
    """In this fresh process (the only section, run first): CUDA started
    as a server starts it, then load_file twice, each stamped as
    ``timeline`` stamps it (the first makes the staging buffer and meets
    torch's empty cache; ``del`` between them, no empty_cache, as
    bench_first_load.py's second call).  ``cold``: nothing started and
    the page cache dropped before the first call (a script's cold start),
    whose bytes copied are sampled besides (the progress callback: GB/s
    per tenth of the call)."""
    if cold:
        B.flush(paths)
        B.drop_cache(paths)
    else:
        torch.ones(1, device=device)
        B.sync(torch, device)
    nbytes = sum(os.path.getsize(p) for p in paths)
    with _Stamping(_Stamps()) as stamping:
        for call in ("first", "second"):
            samples = []
            cold_call = cold and call == "first"    # (the second reads what the first cached)

            def progress(done, total, samples=samples):
                samples.append((time.perf_counter() - stamping.stamps.t0, done))
            sampled = progress if cold_call else None
            result = stamping.run(lambda sampled=sampled: _synced(torch, device, loader.load_file(
                paths, str(device), progress=sampled)))
            del result
            marks = dict(stamping.stamps.marks)
            steps = _staging_steps(device) if call == "first" else []
            out.append(dict(section="first", layout=name, call=call, cold=cold_call,
                            gbps=nbytes / marks["returned"] / 1e9, samples=samples,
                            staging_steps=steps, **marks))
            C.progress(f"  {name} {call} call{' (cold)' if cold_call else ''} "
                       f"(ms from the call), {_timeline_line(marks, nbytes)}")
            if samples:
                C.progress(f"  {name} bytes copied: " + _rates(samples, marks["returned"]))


def _staging_steps(device):
    """The steps that made the staging buffer the first call kept
    (``StagingBuffer.attempts``: step, bytes, seconds), printed: where its
    wait before the first read went."""
    from instant_staging.loader import _staging_pool
    buf = _staging_pool.kept().get(device.index or 0)
    if buf is None:
        return []
    steps = [(a.step, a.size, a.seconds) for a in buf.attempts]
    C.progress("  staging buffer made: " + ", ".join(
        f"{step} {size >> 20} MiB {seconds * 1e3:.2f} ms" for step, size, seconds in steps))
    return steps


def _rates(samples, seconds, parts=10):
    """GB/s copied in each tenth of ``seconds`` (``samples``: (t, done bytes))."""
    out, k, last_t, last_done = [], 0, 0.0, 0
    for p in range(1, parts + 1):
        end = seconds * p / parts
        while k < len(samples) and samples[k][0] <= end:
            k += 1
        done = samples[k - 1][1] if k else 0
        out.append(f"{(done - last_done) / max(end - last_t, 1e-9) / 1e9:.2f}")
        last_t, last_done = end, done
    return " ".join(out) + f" (tenths of {seconds:.3f} s)"


def _synced(torch, device, result):
    B.sync(torch, device)
    return result


def section_timeline(torch, name, paths, device, repeat, out):
    """The steps of load_file's real run, stamped, for the run with the
    shortest total of ``repeat`` (after one that makes the staging buffer)."""
    runs = []
    try:
        with _Stamping(_Stamps()) as stamping:
            loader.load_file(paths, str(device))     # the staging buffer, made and kept
            for _ in range(repeat):
                B._free(torch, device)
                B.sync(torch, device)
                result = stamping.run(lambda: _synced(torch, device,
                                                      loader.load_file(paths, str(device))))
                runs.append(dict(stamping.stamps.marks))
                del result
    finally:
        B._free(torch, device)
    bestrun = min(runs, key=lambda r: r["returned"])
    nbytes = sum(os.path.getsize(p) for p in paths)
    out.append(dict(section="timeline", layout=name, gbps=nbytes / bestrun["returned"] / 1e9,
                    **bestrun))
    C.progress(f"  {name} timeline (ms from the call), {_timeline_line(bestrun, nbytes)}")


def _traced(torch, fn):
    """``fn()`` under torch.profiler with CUDA activities only; returns its
    wall seconds and its host-to-device copies as (start, end, bytes,
    stream), microseconds on the GPU's clock (CUPTI records every copy of
    the process, the loader's own cudaMemcpyAsync calls included)."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            events = json.load(trace).get("traceEvents", [])
    copies = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), int(e["args"].get("bytes", 0)),
                     e["args"].get("stream"))
                    for e in events
                    if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", ""))
    return wall, copies


def engine_stats(copies, gap_us=5.0):
    """What the copies (``_traced``'s) say of the engine: the span from the
    first copy's start to the last one's end, the time some copy ran
    (``busy``, the union) and the idle rest, the idle gaps longer than
    ``gap_us``, the bytes per busy second (the link's rate while it
    copies), the copies running at once on average, and the rate per tenth
    of the span (a slow start or tail shows there)."""
    if not copies:
        return {"copies": 0}
    span0, span1 = copies[0][0], max(c[1] for c in copies)
    busy, gaps, end = 0.0, [], span0
    for start, stop, _, _ in copies:
        if start > end:
            gaps.append(start - end)
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    span = span1 - span0
    nbytes = sum(c[2] for c in copies)
    durs = sorted(c[1] - c[0] for c in copies)
    tenths = []
    for k in range(10):
        lo, hi = span0 + span * k / 10, span0 + span * (k + 1) / 10
        moved = sum(c[2] * max(0.0, min(hi, c[1]) - max(lo, c[0])) / max(c[1] - c[0], 1e-9)
                    for c in copies)
        tenths.append(moved / max(hi - lo, 1e-9) / 1e3)
    return {"copies": len(copies), "bytes": nbytes, "span_ms": span / 1e3, "busy_ms": busy / 1e3,
            "idle_ms": (span - busy) / 1e3, "gaps": sum(g > gap_us for g in gaps),
            "gap_ms": sum(g for g in gaps if g > gap_us) / 1e3,
            "gbps_span": nbytes / span / 1e3 if span else None,
            "gbps_busy": nbytes / busy / 1e3 if busy else None,
            "at_once": sum(durs) / busy if busy else None,
            "copy_us_median": durs[len(durs) // 2], "streams": len({c[3] for c in copies}),
            "gbps_tenths": tenths}


def _engine_line(label, wall, st):
    if not st["copies"]:
        return f"  {label}: no copies traced (CUPTI missing?)"
    return (f"  {label}: {st['bytes'] / wall / 1e9:.1f} GB/s of the call; engine "
            f"{st['gbps_span']:.1f} GB/s over its span {st['span_ms']:.2f} ms, "
            f"{st['gbps_busy']:.1f} GB/s while busy {st['busy_ms']:.2f} ms, idle {st['idle_ms']:.2f} ms "
            f"({st['gaps']} gaps > 5 us: {st['gap_ms']:.2f} ms); {st['copies']} copies on "
            f"{st['streams']} streams, {st['at_once']:.2f} at once, median {st['copy_us_median']:.0f} us; "
            "tenths " + " ".join(f"{g:.0f}" for g in st["gbps_tenths"]))


def _torch_copies(torch, device, nbytes, piece=2 * MiB, streams=16):
    """A run that copies ``nbytes`` to the device in ``piece``s of a 64 MiB
    pinned torch tensor, round-robin over ``streams`` streams: the engine
    at the loader's copy unit with no reader beside it."""
    src = torch.empty(64 * MiB, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    ring = [torch.cuda.Stream(device) for _ in range(streams)]

    def run():
        for k, off in enumerate(range(0, nbytes, piece)):
            n, at = min(piece, nbytes - off), off % src.numel()
            with torch.cuda.stream(ring[k % streams]):
                dst[off:off + n].copy_(src[at:at + n], non_blocking=True)
        torch.cuda.synchronize(device)
    return run


def section_engine(torch, name, paths, device, repeat, out):
    """The copy engine's timeline (``_traced``) of runs of this layout's
    bytes: load_file as ``timeline`` runs it (its staging buffer kept,
    torch's cache emptied before), the same with torch's cache kept from
    the run before and with the cache emptied a second before, the
    pipeline's copies alone with the defaults (SKIP_READ), and 2 MiB copies
    of a pinned torch tensor round-robin over 16 streams; each the fastest
    call of ``repeat``."""
    nbytes = sum(os.path.getsize(p) for p in paths)

    def fastest(run, reset=None):
        got = []
        for _ in range(repeat):
            if reset is not None:
                reset()
            got.append(_traced(torch, run))
        return min(got, key=lambda r: r[0])

    def free():
        B._free(torch, device)

    def one_load():
        _synced(torch, device, loader.load_file(paths, str(device)))
    loader.load_file(paths, str(device))     # the staging buffer, made and kept
    runs = [("load_file", fastest(one_load, free)),
            # (the device memory of the run before it kept in torch's cache: a
            # start that differs from load_file's is its allocation's)
            ("load_file, torch's cache kept", fastest(one_load)),
            # (the device memory freed a second before, not at once: a start
            # that differs is the driver's work on the memory just freed)
            ("load_file, cache emptied 1 s before", fastest(one_load, lambda: (free(), time.sleep(1))))]
    free()
    # load_into: the same bytes into one allocation a tensor (a model's
    # parameters), through one open Checkpoint: its copies join only inside
    # one allocation of the driver's
    dests = loader.load_file(paths, str(device), views=False)
    try:
        with loader.Checkpoint.open(paths) as ck:
            runs.append(("load_into, a tensor an allocation",
                         fastest(lambda: (ck.load_into(dests), torch.cuda.synchronize(device)))))
    finally:
        dests.clear()
        free()
    f = Files(torch, paths, device)
    try:
        chunk, depth = loader.DEFAULT_CHUNK_SIZE, loader.DEFAULT_IO_DEPTH
        buf = staging_for(chunk, depth)
        try:
            runs.append(("pipeline copies alone", fastest(lambda: run_pipe(
                f.plan(chunk), f.dsts, reader_threads(), staging=buf, device=f.target.index,
                skip=SKIP_READ))))
        finally:
            buf.close()
    finally:
        f.close()
        free()
    try:
        runs.append(("torch 2 MiB copies, 16 streams", fastest(_torch_copies(torch, device, nbytes))))
    finally:
        free()
    for label, (wall, copies) in runs:
        st = engine_stats(copies)
        out.append(dict(section="engine", layout=name, run=label, wall=wall, **st))
        C.progress(_engine_line(f"{name} {label}", wall, st))


def section_reads(name, paths, repeat, out, threads_list, chunks):
    from instant_staging import StagingBuffer
    sets = [(name, paths)]
    if len(paths) > 1:
        sets.append((name + "[shard 1]", paths[:1]))
    for label, files in sets:
        fds = [os.open(p, os.O_RDONLY) for p in files]
        total = sum(os.fstat(fd).st_size for fd in fds)
        try:
            for chunk, threads in itertools.product(chunks, threads_list):
                plan = Plan([(fd, 0, os.fstat(fd).st_size) for fd in fds], chunk)
                buf = StagingBuffer(threads * chunk, allow_pageable=True)
                try:
                    s = best(run_pipe, repeat, plan, [0] * len(fds), threads, staging=buf,
                             skip=SKIP_COPY)
                finally:
                    buf.close()
                out.append({"section": "reads", "layout": label, "chunk": chunk, "threads": threads,
                                "seconds": s, "gbps": total / s / 1e9})
                C.progress(f"  {label} reads {threads} threads x {chunk // MiB} MiB: "
                           f"{total / s / 1e9:.1f} GB/s")
        finally:
            for fd in fds:
                os.close(fd)


def staging_for(chunk, depth):
    from instant_staging import StagingBuffer
    return StagingBuffer(depth * chunk, copy_unit=chunk)


def section_pipeline(torch, name, f, repeat, out, grid, skip=0, label="pipeline"):
    for chunk, depth, threads in grid:
        buf = staging_for(chunk, depth)
        plan = f.plan(chunk)
        try:
            s = best(run_pipe, repeat, plan, f.dsts, threads, staging=buf,
                     device=f.target.index, skip=skip)
        finally:
            buf.close()
        out.append({"section": label, "layout": name, "chunk": chunk, "depth": depth, "threads": threads,
                        "seconds": s, "gbps": f.nbytes / s / 1e9})
        C.progress(f"  {name} {label} {chunk // MiB} MiB / depth {depth} / {threads} threads: "
                   f"{f.nbytes / s / 1e9:.1f} GB/s")


def section_load_file(torch, name, paths, device, repeat, out, settings):
    nbytes = sum(os.path.getsize(p) for p in paths)
    for chunk, depth, threads in settings:
        s = best(loader.load_file, repeat, paths, str(device), chunk_size=chunk, io_depth=depth,
                 threads=threads, reset=lambda: B._free(torch, device))
        B._free(torch, device)
        out.append({"section": "load_file", "layout": name, "chunk": chunk, "depth": depth,
                        "threads": threads, "seconds": s, "gbps": nbytes / s / 1e9})
        C.progress(f"  {name} load_file {chunk // MiB} MiB / {depth} / {threads}: "
                   f"{nbytes / s / 1e9:.1f} GB/s")
    buf = staging_for(loader.DEFAULT_CHUNK_SIZE, loader.DEFAULT_IO_DEPTH)
    try:
        s = best(lambda: loader.load_file(paths, str(device), staging=buf), repeat,
                 reset=lambda: B._free(torch, device))
    finally:
        buf.close()
    B._free(torch, device)
    out.append({"section": "load_file", "layout": name, "what": "reused staging", "seconds": s,
                    "gbps": nbytes / s / 1e9})
    C.progress(f"  {name} load_file defaults, reused staging: {nbytes / s / 1e9:.1f} GB/s")


def section_host(torch, name, paths, repeat, out):
    if sum(os.path.getsize(p) for p in paths) > (8 << 30):
        return      # fresh CPU tensors of 16 GB measure page faults, not the loader
    f = Files(torch, paths, torch.device("cpu"))
    try:
        for chunk, threads in ((loader.DEFAULT_CHUNK_SIZE, 16), (4 * MiB, 8)):
            s = best(run_pipe, repeat, f.plan(chunk), f.dsts, threads, depth=2 * threads)
            out.append({"section": "host", "layout": name, "chunk": chunk, "threads": threads,
                            "seconds": s, "gbps": f.nbytes / s / 1e9, "what": "pipeline, tensors resident"})
            C.progress(f"  {name} host pipeline {chunk // MiB} MiB x {threads}: "
                       f"{f.nbytes / s / 1e9:.1f} GB/s")
    finally:
        f.close()
    s = best(lambda: loader.load_file(paths, "cpu"), repeat)
    out.append({"section": "host", "layout": name, "what": "load_file cpu", "seconds": s,
                    "gbps": f.nbytes / s / 1e9})
    C.progress(f"  {name} host load_file(cpu): {f.nbytes / s / 1e9:.1f} GB/s")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default="dense,moe")
    ap.add_argument("--dir", default=B.DEFAULT_DIR)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--sections", default=",".join(s for s in SECTIONS if s != "first"),
                    help="default: all but first, which runs alone")
    ap.add_argument("--chunks", default="2MiB,4MiB,8MiB")
    ap.add_argument("--depths", default="16,32,64")
    ap.add_argument("--threads", default="8,12,16")
    ap.add_argument("--settings", default="8MiB/16/16,4MiB/16/8,2MiB/16/8,4MiB/32/16,8MiB/32/16,4MiB/64/16",
                    help="load_file section: chunk/io_depth/threads, comma-separated")
    ap.add_argument("--quick", action="store_true", help="tiny layouts, CPU allowed")
    ap.add_argument("--first-cold", action="store_true",
                    help="first section: nothing started, the page cache dropped before the first call")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval(seconds) first (the GIL's hand-over: what a "
                         "thread beside the load waits for)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    C.quiet_logging(False)
    import torch
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    sections = args.sections.split(",")
    chunks = C.parse_sizes(args.chunks)
    depths = [int(x) for x in args.depths.split(",")]
    threads_list = [int(x) for x in args.threads.split(",")]
    settings = [(C.parse_sizes(c)[0], int(d), int(t))
                for c, d, t in (x.split("/") for x in args.settings.split(","))]
    if "first" in sections and (sections != ["first"] or "," in args.layouts):
        ap.error("--sections first is a fresh process's: alone, with one layout")
    os.makedirs(args.dir, exist_ok=True)
    out = []
    t_start = time.perf_counter()
    for name, files in B.layouts(args.layouts.split(","), 64 if args.quick else 1,
                                 C.parse_sizes("4GiB")[0]):
        paths = B.generate(args.dir, files)
        B.warm(paths)
        C.progress(f"{name}: {sum(os.path.getsize(p) for p in paths) / 1e9:.2f} GB")
        if "first" in sections:
            section_first(torch, name, paths, device, out, args.first_cold)
        if "phases" in sections:
            section_phases(torch, name, paths, device, args.repeat + 1, out)
        if "reads" in sections:
            section_reads(name, paths, args.repeat, out, threads_list, chunks)
        gpu = device.type == "cuda"
        if gpu and {"copies", "pipeline", "spin"} & set(sections):
            f = Files(torch, paths, device)
            try:
                d = loader.DEFAULT_CHUNK_SIZE, loader.DEFAULT_IO_DEPTH, 16
                if "copies" in sections:
                    section_pipeline(torch, name, f, args.repeat, out,
                                     list(itertools.product(chunks, depths, threads_list)),
                                     SKIP_READ, "copies")
                if "pipeline" in sections:
                    section_pipeline(torch, name, f, args.repeat, out,
                                     list(itertools.product(chunks, depths, threads_list)))
                if "spin" in sections:
                    from instant_staging.runtime import _cuda
                    _cuda._set_event_blocking_sync(True)
                    try:
                        section_pipeline(torch, name, f, args.repeat, out,
                                         [d, (4 * MiB, 16, 8), (4 * MiB, 32, 16), (8 * MiB, 32, 16)],
                                         0, "blocking-sync")
                    finally:
                        _cuda._set_event_blocking_sync(False)
            finally:
                f.close()
                B._free(torch, device)
        if "timeline" in sections:
            section_timeline(torch, name, paths, device, args.repeat + 3, out)
        if gpu and "engine" in sections:
            section_engine(torch, name, paths, device, args.repeat, out)
        if gpu and "load_file" in sections:
            section_load_file(torch, name, paths, device, args.repeat, out, settings)
        if "host" in sections:
            section_host(torch, name, paths, args.repeat, out)
    print(f"profile total {time.perf_counter() - t_start:.0f} s")
    C.write_json(args.json, {"results": out, "device": str(device)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
