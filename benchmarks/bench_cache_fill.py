"""What the cache costs a load, on its way in and on its way out (issue 54, items 2 and 3).

Side by side, alternating, best of ``--repeat``, one URL source:

  no cache        load_file(url, device, cache_dir=False)
  fill            load_file(url, device, cache_dir=<empty directory>): the
                  load as its caller sees it, and until its entries were
                  made (wait_for_cache_fills: "entries made")
  fill, file by   the same fill with the objects' chunks taken file by file
  file            (before the readers took them in turn)
  fill, the close the same fill with the checkpoint's close waiting for the
  waits           writes (before it handed them to the finisher)
  fill's writes   the seconds the reader threads spent in the fill's
                  hook (``Cache.write``: the range handed to the cache's
                  writer threads, and any wait past CACHE_WRITE_QUEUE;
                  before item 2, the range's CRC-32 and its pwrite into
                  the partial file), summed over the readers, and as a
                  share of (readers x the load's seconds); the seconds
                  the writers spent writing (``Cache._put``), and how
                  long the load took until ``load()`` returned, before
                  its checkpoint's close (item 2); the
                  finisher's seconds in its flushes (fsync) and its
                  read-back checks, the parts of "entries made" after
                  the load
  open (hit)      Checkpoint.open of the filled cache online: the
                  entries found by URL alone and checked, the revalidation
                  (one HEAD per object, its size and ETag compared with
                  the entry's name; a directory's listing or an index
                  again) started beside it; "+ answer": until the server
                  answered (what a load waits for before its first tensor
                  goes out, if it has not come by then)
  open (offline)  the same with INSTANT_STAGING_OFFLINE=1: the entries
                  found by URL alone, nothing asked (item 3)
  from cache      load_file(url, device, cache_dir=<filled>), online and
                  offline, beside load_file of the same files as local
                  files; all page-cache hot
  a client made   the object-store client a hit online makes for its
                  revalidation (Stores.split: obstore's store, which
                  reads the system's CA certificates, holding the GIL);
                  and with its certificates from the CA bundle alone
                  (SSL_CERT_FILE, SSL_CERT_DIR an empty directory), with
                  "from cache, online" again that way

The source is a synthetic checkpoint (``--gib`` GiB of bf16 in
``--shards`` shards) served by the tests' ranged-GET HTTP server in this
process (a Python server: it bounds the fetch rate, so the fill's share
is a lower bound of what it is against LocalBucket or a bucket); ``--url``
loads from any URL source instead (its local copy then ``--dir``'s files).

    python benchmarks/bench_cache_fill.py --device cpu --gib 0.5
    python benchmarks/bench_cache_fill.py --device cuda:0 --gib 8 \\
        --url s3://bench/fill/model.safetensors.index.json --dir /nvme/bench-fill

Prints a markdown table (seconds, GB/s, ratio to the no-cache load).
"""

import contextlib
import os
import shutil
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402,F401  (instant_staging installed, else this checkout built in place)

sys.path.insert(1, os.path.join(os.path.dirname(HERE), "tests"))    # support.remote_servers

from bench_cache_digest import local_files, read_all, served, source_arguments  # noqa: E402

ap = source_arguments(__doc__, gib=0.5, directory="/tmp/bench_cache_fill")


@contextlib.contextmanager
def timed_calls(owner, names):
    """Sums the seconds spent in each of ``names`` of ``owner`` (a class's
    methods or a module's functions), by every thread: ``spent[i]`` for
    ``names[i]`` (0.0 where ``owner`` has no such name)."""
    spent = [0.0] * len(names)
    lock = threading.Lock()
    originals = {n: getattr(owner, n) for n in names if hasattr(owner, n)}

    def timed(i, original):
        def hook(*args):
            t0 = time.perf_counter()
            try:
                return original(*args)
            finally:
                took = time.perf_counter() - t0
                with lock:
                    spent[i] += took
        return hook
    for i, n in enumerate(names):
        if n in originals:
            setattr(owner, n, timed(i, originals[n]))
    try:
        yield spent
    finally:
        for n, original in originals.items():
            setattr(owner, n, original)


@contextlib.contextmanager
def file_by_file():
    """A fill's load with its chunks in file order (``RemoteShards.fills_cache``
    False: ``Plan.interleave_files`` not asked for)."""
    from instant_staging.loader import _remote
    saved = _remote.RemoteShards.fills_cache
    _remote.RemoteShards.fills_cache = property(lambda self: False)
    try:
        yield
    finally:
        _remote.RemoteShards.fills_cache = saved


@contextlib.contextmanager
def close_drains():
    """A fill whose checkpoint's close waits for its writes (as before the
    close handed them to the finisher: ``Cache._settle``)."""
    from instant_staging.loader import _cache
    close = _cache.Cache.close

    def draining(self):
        self._writers.drain()
        return close(self)
    _cache.Cache.close = draining
    try:
        yield
    finally:
        _cache.Cache.close = close


@contextlib.contextmanager
def environment(**values):
    """``values`` in os.environ inside the block (what was there before, after)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def offline_mode():
    return environment(INSTANT_STAGING_OFFLINE="1")


@contextlib.contextmanager
def one_bundle():
    """The object-store client's certificates from the system's one CA
    bundle (SSL_CERT_FILE), not also from every file of its certificate
    directory (SSL_CERT_DIR: here an empty one), which each client made
    reads, holding the GIL; None where this host has no bundle."""
    import ssl
    import tempfile
    bundle = ssl.get_default_verify_paths().cafile
    if not bundle or not os.path.isfile(bundle):
        yield None
        return
    with tempfile.TemporaryDirectory() as empty, \
            environment(SSL_CERT_FILE=bundle, SSL_CERT_DIR=empty):
        yield bundle


def client_made(url, repeat=5):
    """The best seconds of making the object-store client of ``url``."""
    from instant_staging.loader._schemes import Stores
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        Stores(None).split(url)
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None):
    args = ap.parse_args(argv)

    import torch

    from instant_staging.loader import Checkpoint, _cache, wait_for_cache_fills
    device = args.device
    sync = (lambda: torch.cuda.synchronize()) if device.startswith("cuda") else (lambda: None)
    os.environ.pop("INSTANT_STAGING_OFFLINE", None)
    os.environ.pop("HF_HUB_OFFLINE", None)

    files, nbytes, cache = local_files(args)
    rows = {}

    def add(key, value):
        rows.setdefault(key, []).append(value)

    with contextlib.ExitStack() as stack:
        url = served(args, stack)

        def load(**kw):
            t0 = time.perf_counter()
            with Checkpoint.open(url, **kw) as ck:
                out = ck.load(device)
                sync()
                loaded = time.perf_counter() - t0
                threads = ck.last_report.threads
            took = time.perf_counter() - t0
            del out
            return took, threads, loaded

        for _ in range(args.repeat):
            add("no cache", load(cache_dir=False)[0])
            shutil.rmtree(cache, ignore_errors=True)
            # (the readers' hook and the writers' task; the finisher's flush and check)
            with timed_calls(_cache.Cache, ("write", "_put")) as spent, \
                    timed_calls(_cache, ("_flush", "_check_made")) as finish:
                t0 = time.perf_counter()
                took, threads, loaded = load(cache_dir=cache)
                wait_for_cache_fills()
                made = time.perf_counter() - t0
            add("fill", took)
            add("fill: until load() returned (before the close)", loaded)
            add("fill: entries made", made)
            add("fill: readers' seconds in Cache.write", spent[0])
            if threads:
                add("fill: share of readers' time in Cache.write", spent[0] / (threads * took))
            add("fill: writers' seconds in Cache._put", spent[1])
            add("fill: finisher's seconds in its flushes (fsync)", finish[0])
            add("fill: finisher's seconds in its read-back checks", finish[1])
            # The same fill as before each change: the objects' chunks taken
            # file by file (Plan.interleave_files), the close waiting for
            # the writes (Cache._settle).
            for before, row, made_row in (
                    (file_by_file, "fill, file by file (before)",
                     "fill, file by file: entries made"),
                    (close_drains, "fill, the close waits for the writes (before)",
                     "fill, the close waits: entries made")):
                shutil.rmtree(cache, ignore_errors=True)
                with before():
                    t0 = time.perf_counter()
                    took = load(cache_dir=cache)[0]
                    wait_for_cache_fills()
                    add(row, took)
                    add(made_row, time.perf_counter() - t0)
            read_all(files + [os.path.join(cache, n) for n in os.listdir(cache)])
            t0 = time.perf_counter()
            with Checkpoint.open(url, cache_dir=cache) as ck:
                add("open (hit, online)", time.perf_counter() - t0)
                assert type(ck._shards).__name__ == "HitShards"
                ck._shards.revalidated()
                add("open (hit, online) + answer", time.perf_counter() - t0)
            with offline_mode():
                t0 = time.perf_counter()
                with Checkpoint.open(url, cache_dir=cache) as ck:
                    add("open (hit, offline)", time.perf_counter() - t0)
            t0 = time.perf_counter()
            with Checkpoint.open(files) as ck:
                add("open (local files)", time.perf_counter() - t0)
            add("from cache, online", load(cache_dir=cache)[0])
            with offline_mode():
                add("from cache, offline", load(cache_dir=cache)[0])
            add("local files", _local(files, device, sync))
            # What a hit online pays for its client (the revalidation's):
            # made from the certificates of the CA bundle alone.
            add("a client made", client_made(url))
            with one_bundle() as bundle:
                if bundle is not None:
                    add("a client made, certificates from one file", client_made(url))
                    add("from cache, online, certificates from one file", load(cache_dir=cache)[0])

    base = min(rows["no cache"])
    print(f"{nbytes / 1e9:.2f} GB in {len(files)} shards, device {device}, best of {args.repeat}\n")
    print("| what | best | GB/s | / no cache |")
    print("| --- | --- | --- | --- |")
    for key, values in rows.items():
        best = min(values)
        if "share" in key:
            print(f"| {key} | {best:.1%} | | |")
        elif key.startswith(("open", "a client")) or "seconds in" in key:
            print(f"| {key} | {best * 1e3:.1f} ms | | |")
        else:
            print(f"| {key} | {best:.3f} s | {nbytes / best / 1e9:.2f} | {base / best:.2f}x |")


def _local(files, device, sync):
    from instant_staging.loader import load_file
    t0 = time.perf_counter()
    out = load_file(files, device)
    sync()
    took = time.perf_counter() - t0
    del out
    return took


if __name__ == "__main__":
    main()
