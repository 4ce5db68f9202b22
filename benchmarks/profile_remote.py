#!/usr/bin/env python3
"""Where a remote load's time goes: every ranged GET and every reader thread, on a timeline.

On the servers bench_remote.py runs against (S3: ``--endpoint``, or a
LocalBucket this script starts with ``--localbucket DIR``, or else moto's
server of the tests; ``gs``: fake-gcs-server; ``az``: the tests' Azure Blob
server), bench_load.py's layouts (scaled by ``--scale``) are uploaded
once; then, in a fresh process per cloud and layout (the Azure server
runs in this one, so its GIL is not the load's), for ``--repeat`` runs:

  load       the real ``Checkpoint.open(url)`` + ``load(device)``, with the
             loader's own settings (or ``--threads``), stamped through a
             few narrow wrappers put around it by this script only (the
             shipped code carries no tracing): per GET, when it was asked
             (``RemoteShards._submit``, or a reader's own ``_get``), when the
             request loop began it, its first byte (the answer's headers:
             ``get_async`` returned), its last byte (``bytes_async``
             returned), and when a reader thread took it and handed its
             bytes to the copy (``_Fetch`` returned); per reader thread,
             the time spent waiting on the network (inside the fetch,
             waiting for its GET's future), in the fetch's own work (the
             rest of it), and outside it (the copy into the slot and out of
             it; on a GPU also the wait for a free slot), and idle at the end
  ceiling    obstore alone, the same store, the same ranges (those the load
             asked, in its order), into memory, discarded: ``threads`` (a
             thread pool of blocking GETs, bench_remote.py's raw ceiling)
             and ``async`` (one asyncio loop, a semaphore), each at the
             load's concurrency (its GETs in flight: the window of its
             read-ahead) and at ``--wider`` times it; ``copy``: ``threads``
             with each range then copied as any loader must, into a pinned
             buffer and to the device: what the host's other work (a server
             on the same cores) leaves of the ceiling once the bytes are moved

Prints one table per cloud and layout, and the bound each row points to;
``--json`` writes every record's summary (``--records`` every GET).

    python benchmarks/profile_remote.py --clouds s3,gs,az --layouts moe,finemoe \\
        --scale moe:4,finemoe:4 --device cpu [--localbucket DIR | --endpoint URL] [--json PATH]

(benchmarks/gpu_session.sh's ``rtimeline`` step starts LocalBucket and runs
this on the GPU.)  On a host without a GPU (``--device cpu``) every figure
is host-side only: the copies are memcpy into CPU tensors, and the servers
share the host's cores with the load.
"""

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402,F401  (instant_staging installed, else this checkout built in place)

TESTS = os.path.join(os.path.dirname(HERE), "tests")    # support.*: the servers


# -- the stamps (in the worker: wrappers around the loader's seams) ----------------------

class Stamps:
    """Every GET of a load and every reader's fetch, stamped with
    ``time.perf_counter()``."""

    def __init__(self):
        self.lock = threading.Lock()
        self.asked = {}         # (key, start, end) -> [when asked, ...] (FIFO)
        self.gets = []          # dicts: key, start, end, asked, begun, first, last
        self.fetches = []       # dicts: thread, index, offset, length, called, returned, waited
        self.local = threading.local()

    def ask(self, key, start, end):
        with self.lock:
            self.asked.setdefault((key, start, end), []).append(time.perf_counter())

    def asked_at(self, key, start, end):
        with self.lock:
            queue = self.asked.get((key, start, end))
            return queue.pop(0) if queue else None


def instrument(stamps):
    """Wraps the loader's seams (module attributes looked up at call time)
    so that each GET and each fetch is stamped; returns the undo."""
    from instant_staging.loader import _remote as R
    saved = {"_get_async": R._get_async, "_submit": R.RemoteShards._submit,
             "_get": R.RemoteShards._get, "call": R._Fetch.__call__, "wait": R._Requests.wait}

    async def get_async(obstore, obj, options):
        start, end = options["range"]
        begun = time.perf_counter()
        got = await obstore.get_async(obj.store, obj.key, options=options)
        first = time.perf_counter()
        data = await got.bytes_async()
        last = time.perf_counter()
        asked = stamps.asked_at(obj.key, start, end)
        with stamps.lock:
            stamps.gets.append({"key": obj.key, "start": start, "end": end, "bytes": len(data),
                                "asked": asked if asked is not None else begun, "begun": begun,
                                "first": first, "last": last})
        return got.meta, data

    def submit(self, index, offset, length):
        stamps.ask(self._objects[index].key, offset, offset + length)
        return saved["_submit"](self, index, offset, length)

    def get(self, index, offset, length, what, started=None):
        stamps.ask(self._objects[index].key, offset, offset + length)
        return saved["_get"](self, index, offset, length, what, started)

    def call(self, index, offset, length):
        local = stamps.local
        local.waited = 0.0
        called = time.perf_counter()
        data = saved["call"](self, index, offset, length)
        returned = time.perf_counter()
        with stamps.lock:
            stamps.fetches.append({"thread": threading.get_ident(), "index": index,
                                   "key": self._checkpoint._objects[index].key,
                                   "offset": offset, "length": length, "called": called,
                                   "returned": returned, "waited": local.waited})
        return data

    def wait(future, stop):
        t0 = time.perf_counter()
        try:
            return saved["wait"](future, stop)
        finally:
            local = stamps.local
            local.waited = getattr(local, "waited", 0.0) + time.perf_counter() - t0

    R._get_async = get_async
    R.RemoteShards._submit = submit
    R.RemoteShards._get = get
    R._Fetch.__call__ = call
    R._Requests.wait = staticmethod(wait)

    def undo():
        R._get_async = saved["_get_async"]
        R.RemoteShards._submit = saved["_submit"]
        R.RemoteShards._get = saved["_get"]
        R._Fetch.__call__ = saved["call"]
        R._Requests.wait = staticmethod(saved["wait"])
    return undo


def pooled_requests(stamps):
    """What if: the read-ahead's GETs are blocking calls of the client in a
    thread pool (the ``threads`` ceiling's way), not requests on the
    checkpoint's asyncio loop; stamped as ``instrument`` stamps them.
    Returns the undo.  (Not the loader's way: a blocking call cannot be
    left when a load is cancelled.)"""
    from concurrent.futures import ThreadPoolExecutor

    import obstore

    from instant_staging.loader import _remote as R
    pool = ThreadPoolExecutor(64, thread_name_prefix="what-if-get")
    saved = R.RemoteShards._submit

    def submit(self, index, offset, length):
        obj = self._objects[index]
        options = R._range_options(obj, offset, length)

        def get():
            begun = time.perf_counter()
            got = obstore.get(obj.store, obj.key, options=options)
            first = time.perf_counter()
            data = got.bytes()
            last = time.perf_counter()
            asked = stamps.asked_at(obj.key, offset, offset + length)
            with stamps.lock:
                stamps.gets.append({"key": obj.key, "start": offset, "end": offset + length,
                                    "bytes": len(data), "asked": asked if asked is not None else begun,
                                    "begun": begun, "first": first, "last": last})
            return got.meta, data
        return pool.submit(get)

    R.RemoteShards._submit = submit

    def undo():
        R.RemoteShards._submit = saved
        pool.shutdown(wait=True)
    return undo


def looped_requests(count):
    """What if: the checkpoint's requests dealt to ``count`` request loops
    (``defaults.REMOTE_REQUEST_LOOPS``, as ``_remote`` reads it when a
    checkpoint opens).  Returns the undo."""
    from instant_staging.loader import _remote as R
    saved = R.REMOTE_REQUEST_LOOPS
    R.REMOTE_REQUEST_LOOPS = count

    def undo():
        R.REMOTE_REQUEST_LOOPS = saved
    return undo


def keeping_fetched(kept):
    """What if: each range's buffer is appended to ``kept`` as a reader takes
    it (no reader frees one).  Returns the undo."""
    from instant_staging.loader import _remote as R
    fetch = R._Fetch.__call__

    def keep(self, index, offset, length):
        data = fetch(self, index, offset, length)
        kept.append(data)
        return data
    R._Fetch.__call__ = keep

    def undo():
        R._Fetch.__call__ = fetch
    return undo


def windowed(window):
    """What if: the read-ahead's window is ``window``, apart from the reader
    threads.  Returns the undo."""
    from instant_staging.loader import _remote as R
    prefetch = R.RemoteShards.prefetch
    R.RemoteShards.prefetch = lambda self, plan, _: prefetch(self, plan, window)

    def undo():
        R.RemoteShards.prefetch = prefetch
    return undo


# -- summaries ---------------------------------------------------------------------------

def in_flight(gets, t0, t1):
    """``(time-weighted mean, max)`` of the GETs in flight (begun, last byte
    not yet) over [t0, t1]."""
    events = sorted([(g["begun"], 1) for g in gets] + [(g["last"], -1) for g in gets])
    level = peak = 0
    area, prev = 0.0, t0
    for t, d in events:
        t = min(max(t, t0), t1)
        area += level * (t - prev)
        prev = t
        level += d
        peak = max(peak, level)
    area += level * max(t1 - prev, 0.0)
    return area / max(t1 - t0, 1e-9), peak


def _ms(values):
    return round(statistics.median(values) * 1e3, 2) if values else None


def summarize_gets(gets, t0, t1):
    """The GETs' figures over the window [t0, t1]."""
    mean, peak = in_flight(gets, t0, t1)
    nbytes = sum(g["bytes"] for g in gets)
    body = [g["last"] - g["first"] for g in gets]
    rates = [g["bytes"] / max(g["last"] - g["first"], 1e-9) / 1e6 for g in gets]
    return {"gets": len(gets), "bytes": nbytes, "range_mib": round(nbytes / max(len(gets), 1) / 2**20, 2),
            "mean_in_flight": round(mean, 2), "max_in_flight": peak,
            "queued_ms": _ms([g["begun"] - g["asked"] for g in gets]),
            "first_byte_ms": _ms([g["first"] - g["begun"] for g in gets]),
            "body_ms": _ms(body), "stream_mbps": round(statistics.median(rates), 1) if rates else None}


def summarize_readers(fetches, gets, t0, t1):
    """Per reader thread: seconds waiting on its GET, in the fetch's own
    work, and outside the fetch (copy; on a GPU, the slot), over [t0, t1];
    and how long answered ranges waited for a reader."""
    by_thread = {}
    for f in fetches:
        by_thread.setdefault(f["thread"], []).append(f)
    span = max(t1 - t0, 1e-9)
    threads = []
    for calls in by_thread.values():
        calls.sort(key=lambda f: f["called"])
        net = sum(f["waited"] for f in calls)
        inside = sum(f["returned"] - f["called"] for f in calls)
        outside = sum(max(b["called"] - a["returned"], 0.0) for a, b in zip(calls, calls[1:]))
        # (after its last fetch: its last copy, then the end of the load)
        threads.append({"chunks": len(calls), "net": net, "fetch_work": inside - net,
                        "between": outside, "before": calls[0]["called"] - t0,
                        "after": t1 - calls[-1]["returned"]})
    last = {(g["key"], g["start"], g["end"]): g["last"] for g in gets}
    # A range answered before its reader took it waited for the reader.
    answered = []
    for f in fetches:
        when = last.get((f["key"], f["offset"], f["offset"] + f["length"]))
        if when is not None and when < f["returned"]:
            answered.append(max(f["called"] - when, 0.0))
    n = max(len(threads), 1)

    def share(field):
        return round(sum(t[field] for t in threads) / n / span * 100, 1)
    return {"readers": len(threads), "net_pct": share("net"), "fetch_work_pct": share("fetch_work"),
            "between_pct": share("between"), "before_pct": share("before"), "after_pct": share("after"),
            "ready_before_reader_ms": _ms(answered),
            "ready_before_reader_n": sum(1 for a in answered if a > 0)}


# -- the worker: one cloud, one layout ---------------------------------------------------

def _store(args):
    import bench_remote as BR
    return BR._store(args, args.cloud)


def run_load(args, prefix, device, threads):
    """One instrumented open + load; its record."""
    import torch

    from instant_staging.defaults import REMOTE_CHUNK_SIZE
    from instant_staging.loader import Checkpoint
    stamps = Stamps()
    kept = []
    with contextlib.ExitStack() as patches:     # (undone last first)
        if args.requests == "pool":
            patches.callback(pooled_requests(stamps))
        elif args.requests.startswith("loops"):
            patches.callback(looped_requests(int(args.requests[5:])))
        patches.callback(instrument(stamps))
        if args.keep_fetched:
            patches.callback(keeping_fetched(kept))
        if args.window:
            patches.callback(windowed(args.window))
        # (a knob set leaves every knob to the caller: the remote range size kept)
        options = {"threads": threads, "chunk_size": REMOTE_CHUNK_SIZE} if threads else {}
        t0 = time.perf_counter()
        with Checkpoint.open(prefix) as ck:
            t_open = time.perf_counter()
            out = ck.load(device, **options)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t_end = time.perf_counter()
            report = ck.last_report
        del out
        kept.clear()
    # The load's GETs: those asked after the open returned (the open's are
    # the headers' ranges; a read-ahead starts in the load's prepare).
    gets = [g for g in stamps.gets if g["asked"] >= t_open]
    first = min((g["asked"] for g in gets), default=t_open)
    rec = {"method": "load", "seconds": t_end - t0, "open_s": t_open - t0, "load_s": t_end - t_open,
           "bytes": report.bytes, "threads": report.threads, "chunk_size": report.chunk_size,
           "gbps": report.bytes / (t_end - t0) / 1e9,
           "load_gbps": report.bytes / (t_end - t_open) / 1e9,
           "first_get_after_open_ms": round((first - t_open) * 1e3, 2)}
    rec.update(summarize_gets(gets, first, t_end))
    rec.update(summarize_readers(stamps.fetches, gets, t_open, t_end))
    ranges = [(g["key"], g["start"], g["end"] - g["start"]) for g in sorted(gets, key=lambda g: g["asked"])]
    if args.records:
        rec["records"] = {"gets": [{k: (v - t0 if isinstance(v, float) else v) for k, v in g.items()}
                                   for g in stamps.gets],
                          "fetches": [{k: (v - t0 if k in ("called", "returned") else v)
                                       for k, v in f.items()} for f in stamps.fetches]}
    return rec, ranges


class _Copier:
    """``copy(data)``: a range's bytes into a buffer of the calling thread's
    (pinned on a GPU host), then to a device buffer on the thread's own
    stream, waited for before the thread's next copy: the work a load adds
    to each GET (the ``copy`` ceiling), without its planning."""

    def __init__(self, device, length):
        import torch
        self.torch, self.device, self.length = torch, torch.device(device), length
        self.local = threading.local()
        self.streams = []
        self.lock = threading.Lock()

    def __call__(self, data):
        torch, local = self.torch, self.local
        if not hasattr(local, "host"):
            cuda = self.device.type == "cuda"
            local.host = torch.empty(self.length, dtype=torch.uint8, pin_memory=cuda)
            local.dev = torch.empty(self.length, dtype=torch.uint8, device=self.device) if cuda else None
            local.stream = torch.cuda.Stream(self.device) if cuda else None
            with self.lock:
                self.streams.append(local.stream)
        n = len(data)
        if local.stream is not None:
            local.stream.synchronize()      # (the thread's last copy out of its buffer)
        local.host[:n].copy_(torch.frombuffer(data, dtype=torch.uint8))
        if local.stream is not None:
            with torch.cuda.stream(local.stream):
                local.dev[:n].copy_(local.host[:n], non_blocking=True)

    def finish(self):
        for stream in self.streams:
            if stream is not None:
                stream.synchronize()


def run_ceiling(args, ranges, inflight, how):
    """obstore alone: ``ranges`` (key, offset, length) with ``inflight``
    GETs at once, ``how`` "threads", "async" or "copy" (threads, each range
    then copied as a load must: into a pinned buffer of the thread's, and
    from it to the device on a stream of the thread's); its record."""
    import obstore
    store = _store(args)
    gets = []
    lock = threading.Lock()
    copy = _Copier(args.device, max(r[2] for r in ranges)) if how == "copy" else None

    def one(r):
        key, offset, length = r
        begun = time.perf_counter()
        got = obstore.get(store, key, options={"range": (offset, offset + length)})
        first = time.perf_counter()
        data = got.bytes()
        last = time.perf_counter()
        if copy is not None:
            copy(data)
        with lock:
            gets.append({"key": key, "start": offset, "end": offset + length, "bytes": len(data),
                         "asked": begun, "begun": begun, "first": first, "last": last})

    async def one_async(sem, r):
        key, offset, length = r
        async with sem:
            begun = time.perf_counter()
            got = await obstore.get_async(store, key, options={"range": (offset, offset + length)})
            first = time.perf_counter()
            data = await got.bytes_async()
            last = time.perf_counter()
        gets.append({"key": key, "start": offset, "end": offset + length, "bytes": len(data),
                     "asked": begun, "begun": begun, "first": first, "last": last})

    async def all_async():
        sem = asyncio.Semaphore(inflight)
        await asyncio.gather(*(one_async(sem, r) for r in ranges))

    t0 = time.perf_counter()
    if how in ("threads", "copy"):
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(inflight) as pool:
            list(pool.map(one, ranges))
    else:
        asyncio.run(all_async())
    if copy is not None:
        copy.finish()
    t1 = time.perf_counter()
    nbytes = sum(g["bytes"] for g in gets)
    rec = {"method": f"ceiling {how}", "inflight": inflight, "seconds": t1 - t0, "bytes": nbytes,
           "gbps": nbytes / (t1 - t0) / 1e9}
    rec.update(summarize_gets(gets, t0, t1))
    return rec


def worker(args):
    """The runs of one cloud and layout; prints a JSON line."""
    import torch
    device = torch.device(args.device)
    if args.split_cpus:         # (what-if: the load and its ceilings on CPUs of their own)
        os.sched_setaffinity(0, set(range(args.split_cpus)))
    if args.switch_interval:    # (what-if: how long a thread wanting the GIL waits before asking for it)
        sys.setswitchinterval(args.switch_interval)
    if device.type == "cuda":       # started, as in a server
        torch.zeros(1, device=device)
        torch.cuda.synchronize(device)
    prefix = f"{args.cloud}://{args.bucket}/{args.layout}/"
    loads, ranges = [], None
    for threads in [int(t) for t in args.threads.split(",")] if args.threads else [0]:
        runs = []
        for _ in range(args.repeat):
            rec, got = run_load(args, prefix, device, threads)
            runs.append(rec)
            ranges = ranges or got
        best = min(runs, key=lambda r: r["seconds"])
        best["median_s"] = statistics.median(r["seconds"] for r in runs)
        loads.append(best)
    window = loads[0]["max_in_flight"]
    ceilings = []
    for how in args.ceilings.split(","):
        for k in [1] + [int(x) for x in args.wider.split(",") if x]:
            runs = [run_ceiling(args, ranges, window * k, how) for _ in range(args.repeat)]
            best = min(runs, key=lambda r: r["seconds"])
            best["median_s"] = statistics.median(r["seconds"] for r in runs)
            ceilings.append(best)
    print(json.dumps({"loads": loads, "ceilings": ceilings}), flush=True)
    # (no interpreter teardown: the client's runtime threads, still holding
    # tasks of the ceilings' loops, aborted it now and then)
    os._exit(0)


# -- the parent: servers, uploads, tables ------------------------------------------------

def start_s3(args, stack):
    """Sets ``args.endpoint`` (and ``args.data_root`` for LocalBucket): the
    one given, a LocalBucket started here (``--localbucket DIR``), or moto's
    server of the tests."""
    if args.endpoint:
        return "given"
    if args.localbucket:
        import socket
        root = os.path.abspath(args.localbucket)
        os.makedirs(os.path.join(root, args.bucket), exist_ok=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-m", "localbucket", "--host", "127.0.0.1",
                                 "--port", str(port), root],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stack.callback(lambda: (proc.terminate(), proc.wait()))
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), 1).close()
                break
            except OSError:
                time.sleep(0.1)
        args.endpoint, args.data_root = f"http://127.0.0.1:{port}", root
        os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench-secret"})
        return "LocalBucket"
    sys.path.insert(0, TESTS)
    from support.remote_servers import S3Server, s3_env
    server = stack.enter_context(S3Server())
    server.create_bucket(args.bucket)
    args.endpoint = server.url
    os.environ.update(s3_env(server.url))
    return "moto"


def run_worker(args, cloud, layout):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--cloud", cloud, "--layout", layout,
           "--bucket", args.bucket, "--region", args.region, "--device", args.device,
           "--repeat", str(args.repeat), "--ceilings", args.ceilings, "--wider", args.wider,
           "--threads", args.threads, "--window", str(args.window), "--endpoint", args.endpoint or "",
           "--switch-interval", str(args.switch_interval), "--requests", args.requests,
           "--split-cpus", str(args.split_cpus)] + (["--keep-fetched"] if args.keep_fetched else [])
    if args.records:
        cmd.append("--records")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if p.returncode != 0:
        return {"error": f"exit status {p.returncode}: "
                + (p.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def bound(load, ceilings):
    """What the load's figures point to, in words."""
    same = [c for c in ceilings if c["inflight"] == load["max_in_flight"]]
    wider = max(ceilings, key=lambda c: c["gbps"], default=None)
    ceil = max(same, key=lambda c: c["gbps"], default=None)
    words = []
    if ceil is not None and wider is not None and wider["inflight"] > ceil["inflight"] \
            and wider["gbps"] > 1.15 * ceil["gbps"]:
        words.append(f"GETs in flight: the server gives {wider['gbps'] / ceil['gbps']:.2f}x "
                     f"at {wider['inflight']} in flight")
    if load["mean_in_flight"] < 0.8 * load["max_in_flight"]:
        words.append(f"the window is not kept full ({load['mean_in_flight']:.1f} of "
                     f"{load['max_in_flight']} on average)")
    if load["between_pct"] > 30:
        words.append(f"readers copy {load['between_pct']:.0f}% of the time")
    if load["net_pct"] > 60:
        words.append(f"readers wait on the network {load['net_pct']:.0f}% of the time")
    if load["ready_before_reader_n"] > load["gets"] // 4:
        words.append(f"{load['ready_before_reader_n']} answered ranges waited for a reader "
                     f"(median {load['ready_before_reader_ms']} ms)")
    return "; ".join(words) or "-"


def print_table(cloud, layout, nbytes, res):
    print(f"\n### {cloud} {layout}: {nbytes / 1e9:.3f} GB\n")
    print("| method | in flight | s (best) | GB/s | vs ceiling | GETs x MiB | mean/max in flight | "
          "queued ms | first byte ms | body ms | MB/s per GET | readers: net / fetch / copy / idle % |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    if "error" in res:
        print(f"| error: {res['error']} |")
        return
    for c in res["ceilings"]:
        print(f"| {c['method']} | {c['inflight']} | {c['seconds']:.3f} | {c['gbps']:.2f} | - | "
              f"{c['gets']} x {c['range_mib']} | {c['mean_in_flight']}/{c['max_in_flight']} | "
              f"{c['queued_ms']} | {c['first_byte_ms']} | {c['body_ms']} | {c['stream_mbps']} | - |")
    for load in res["loads"]:
        same = [c for c in res["ceilings"] if c["inflight"] == load["max_in_flight"]]
        ceil = max((c["gbps"] for c in same), default=None)
        vs = f"{load['gbps'] / ceil:.2f}x (load only {load['load_gbps'] / ceil:.2f}x)" if ceil else "-"
        idle = load["before_pct"] + load["after_pct"]
        print(f"| load ({load['threads']} threads) | {load['max_in_flight']} | {load['seconds']:.3f} "
              f"(open {load['open_s']:.3f}) | {load['gbps']:.2f} | {vs} | "
              f"{load['gets']} x {load['range_mib']} | {load['mean_in_flight']}/{load['max_in_flight']} | "
              f"{load['queued_ms']} | {load['first_byte_ms']} | {load['body_ms']} | {load['stream_mbps']} | "
              f"{load['net_pct']} / {load['fetch_work_pct']} / {load['between_pct']} / {idle:.1f} |")
        load["bound"] = bound(load, res["ceilings"])
        print(f"\nbound ({load['threads']} threads): {load['bound']}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clouds", default="s3,gs,az")
    ap.add_argument("--endpoint", default=None, help="an S3 server to use (else --localbucket, else moto)")
    ap.add_argument("--localbucket", default=None, help="start LocalBucket serving this folder")
    ap.add_argument("--data-root", default=None, help="the folder a given --endpoint (LocalBucket) serves")
    ap.add_argument("--bucket", default="bench")
    ap.add_argument("--region", default=os.environ.get("AWS_REGION", "us-east-1"))
    ap.add_argument("--layouts", default="moe,finemoe")
    ap.add_argument("--scale", default="moe:1,finemoe:1",
                    help="bench_load's layouts, each dimension / scale (moe:4 is 227 MB)")
    ap.add_argument("--dir", default="/tmp/profile_remote")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", default="", help="the loads' reader threads, comma-separated "
                    "(default: the loader's own)")
    ap.add_argument("--window", type=int, default=0, help="what if: the loads' GETs in flight "
                    "(the read-ahead's window), apart from their threads (default: the loader's)")
    ap.add_argument("--switch-interval", type=float, default=0, help="what if: the interpreter's "
                    "switch interval (sys.setswitchinterval, seconds; default: its own, 0.005) in the "
                    "loads and ceilings")
    ap.add_argument("--requests", default="loop", help="what if: the read-ahead's GETs on the "
                    "checkpoint's request loops (loop: the loader's way), the checkpoint's requests "
                    "dealt to N loops (loopsN: REMOTE_REQUEST_LOOPS), or blocking calls in a thread "
                    "pool (pool)")
    ap.add_argument("--split-cpus", type=int, default=0, help="what if: the servers on CPUs N.. "
                    "and the loads and ceilings on CPUs 0..N-1 (default: all share every CPU)")
    ap.add_argument("--keep-fetched", action="store_true", help="what if: each range's buffer "
                    "is kept until the load returned (no reader frees one)")
    ap.add_argument("--ceilings", default="threads,async,copy")
    ap.add_argument("--wider", default="2,4", help="the ceilings also at these multiples of the "
                    "load's GETs in flight")
    ap.add_argument("--records", action="store_true", help="--json keeps every GET and fetch")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cloud", default="s3", help=argparse.SUPPRESS)
    ap.add_argument("--layout", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        args.endpoint = args.endpoint or None
        return worker(args)
    args.clouds = args.clouds.split(",")
    import bench_load as BL
    import bench_remote as BR
    makers = {"dense": BL.dense_layout, "moe": BL.moe_layout, "awq": BL.awq_layout,
              "finemoe": BL.finemoe_layout, "fp8": BL.fp8_layout}
    scale = dict(kv.split(":") for kv in args.scale.split(","))
    doc = {"device": args.device, "cpus": os.cpu_count(), "versions": BR.versions(),
           "what_if": {"threads": args.threads, "window": args.window, "requests": args.requests,
                       "switch_interval": args.switch_interval, "split_cpus": args.split_cpus,
                       "keep_fetched": args.keep_fetched},
           "results": []}
    if args.split_cpus:     # (the servers started from here, and the Azure server's thread, keep them)
        os.sched_setaffinity(0, set(range(args.split_cpus, os.cpu_count())))
    with contextlib.ExitStack() as stack:
        s3 = start_s3(args, stack) if "s3" in args.clouds else None
        if args.endpoint:       # (the loader's store finds the server as a user's would)
            os.environ.setdefault("AWS_ENDPOINT_URL", args.endpoint)
            os.environ.setdefault("AWS_ALLOW_HTTP", "true")
        os.environ.setdefault("AWS_REGION", args.region)
        BR.start_emulators(args, stack)
        doc["servers"] = {"s3": f"{s3} {args.endpoint}" if s3 else None,
                          **{c: s.url for c, s in args.servers.items()}}
        print(f"profile_remote: device {args.device}, {os.cpu_count()} CPUs, servers {doc['servers']}, "
              f"what-ifs {doc['what_if']}")
        for layout in args.layouts.split(","):
            d = os.path.join(args.dir, layout)
            os.makedirs(d, exist_ok=True)
            files = BL.generate(d, makers[layout](int(scale.get(layout, 1))))
            nbytes = sum(os.path.getsize(f) for f in files)
            for cloud in args.clouds:
                BR.upload(args, cloud, layout, files)
                res = run_worker(args, cloud, layout)
                print_table(cloud, layout, nbytes, res)
                doc["results"].append({"cloud": cloud, "layout": layout, "bytes": nbytes, **res})
                if cloud != "s3":       # (the emulators hold the bytes in memory)
                    for f in files:
                        args.servers[cloud].delete(args.bucket, f"{layout}/{os.path.basename(f)}")
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
