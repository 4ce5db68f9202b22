"""What the cache's digest costs (issue 53, finding 1; issue 54, item 6).

Each cache entry carries the CRC-32 of every range its fill wrote, made
by the reader threads from the bytes they fetched (``zlib.crc32``), and
is checked in full once (``loader/_cache.py``, ``_damage``): by the
finisher after its flush, the check recorded in a stamp beside it; an
open whose entry fits its stamp reads only its header.  This measures
them against the same loads with the digest switched off (in this
process: ``zlib.crc32`` of the fill made a constant and the finisher's
check skipped; the open's check skipped), side by side, best of
``--repeat``, alternating so the page cache and the server are in the
same state for both:

  crc32 rate       zlib.crc32 over 64 MiB, one thread and ``--threads``
                   threads (the host's figure: what each costs a GB)
  fill             load_file(source, device, cache_dir=<empty directory>):
                   the load as its caller sees it, and until its entries
                   were made and checked (wait_for_cache_fills); digest
                   on / off
  open             Checkpoint.open of the filled cache (every object a
                   hit, its stamp fitting: no read of its bytes); check
                   on / off
  from cache       load_file(source, device, cache_dir=<filled>), the
                   open included; check on / off, and the same files
                   read as local files (load_file of the paths), all
                   page-cache hot (read once before)
  unstamped        the open, and the load, with the stamps removed first:
                   the full check an entry gets once (where the finisher
                   did not make it, or after a change) against the
                   stamped open

The source is a synthetic checkpoint (``--gib`` GiB of bf16 in
``--shards`` shards) written under ``--dir`` and served by the tests'
ranged-GET HTTP server in this process (``--url`` instead loads from any
URL source, s3:// with the AWS_* variables for instance, its local copy
then ``--dir``'s files).  A Python HTTP server bounds the fill's rate: the
fill's digest cost is better read against LocalBucket or a real bucket.

    python benchmarks/bench_cache_digest.py --device cpu --gib 1
    python benchmarks/bench_cache_digest.py --device cuda:0 --gib 8 \\
        --url s3://bench/digest/model.safetensors.index.json --dir /nvme/bench-digest

Prints a markdown table (seconds, GB/s, ratio to the digest-off row).
"""

import argparse
import contextlib
import json
import os
import shutil
import sys
import threading
import time
import types
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402,F401  (instant_staging installed, else this checkout built in place)

sys.path.insert(1, os.path.join(os.path.dirname(HERE), "tests"))    # support.remote_servers


def crc_rates(threads):
    """GB/s of zlib.crc32 over 64 MiB buffers: one thread, then ``threads``."""
    buf = os.urandom(64 << 20)

    def one():
        zlib.crc32(buf)
    t0 = time.perf_counter()
    for _ in range(4):
        one()
    single = 4 * len(buf) / (time.perf_counter() - t0) / 1e9
    workers = [threading.Thread(target=lambda: [one() for _ in range(4)]) for _ in range(threads)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    many = 4 * threads * len(buf) / (time.perf_counter() - t0) / 1e9
    return single, many


def write_checkpoint(directory, gib, shards):
    """``gib`` GiB of bf16 in ``shards`` files and their index; the index's path."""
    import torch
    from safetensors.torch import save_file
    os.makedirs(directory, exist_ok=True)
    per = int(gib * (1 << 30)) // shards
    rows = per // (4096 * 2) // 8
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {f"layers.{s}.{i}.weight": torch.randn(rows, 4096).to(torch.bfloat16)
                   for i in range(8)}
        save_file(tensors, os.path.join(directory, name), metadata={"format": "pt"})
        weight_map.update({n: name for n in tensors})
    index = os.path.join(directory, "model.safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return index


@contextlib.contextmanager
def digest(on, what):
    """The cache's digest on (as shipped) or off: for a ``"fill"``, its CRCs
    a constant and the finisher's check skipped (its entries stamped with
    a digest that does not fit: the next fill's directory is a new one);
    for a ``"hit"``, the open's check of each range skipped."""
    from instant_staging.loader import _cache
    saved = _cache.zlib, _cache._check
    if not on:
        _cache._check = lambda fd, ranges: None
    if not on and what == "fill":
        _cache.zlib = types.SimpleNamespace(crc32=lambda data, value=0: 0)
    try:
        yield
    finally:
        _cache.zlib, _cache._check = saved


def read_all(paths):
    for p in paths:
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass


def source_arguments(doc, gib, directory):
    """The arguments both cache benchmarks take: the device, the synthetic
    checkpoint (``--gib``, ``--shards``), ``--repeat``, ``--dir`` and
    ``--url``."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--gib", type=float, default=gib)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=directory)
    ap.add_argument("--url", default=None, help="a URL source instead of the in-process server")
    return ap


def local_files(args):
    """The checkpoint's local files under ``--dir`` (written the first
    time), their bytes, and the cache directory beside them."""
    local = os.path.join(args.dir, "files")
    if not os.path.exists(os.path.join(local, "model.safetensors.index.json")):
        write_checkpoint(local, args.gib, args.shards)
    files = sorted(os.path.join(local, n) for n in os.listdir(local) if n.endswith(".safetensors"))
    return files, sum(os.path.getsize(p) for p in files), os.path.join(args.dir, "cache")


def served(args, stack):
    """``--url``, or the local files' index served by the tests' ranged-GET
    HTTP server, in this process until ``stack`` closes."""
    if args.url is not None:
        return args.url
    from support.remote_servers import RangeHTTPServer
    server = stack.enter_context(RangeHTTPServer(os.path.join(args.dir, "files")))
    return server.url_for("model.safetensors.index.json")


def main(argv=None):
    ap = source_arguments(__doc__, gib=1.0, directory="/tmp/bench_cache_digest")
    ap.add_argument("--threads", type=int, default=8, help="crc32 rate's threads")
    args = ap.parse_args(argv)

    import torch

    from instant_staging.loader import Checkpoint, load_file, wait_for_cache_fills
    device = args.device
    sync = (lambda: torch.cuda.synchronize()) if device.startswith("cuda") else (lambda: None)

    files, nbytes, cache = local_files(args)

    single, many = crc_rates(args.threads)
    print(f"crc32: {single:.2f} GB/s one thread, {many:.2f} GB/s {args.threads} threads "
          f"(zlib {zlib.ZLIB_RUNTIME_VERSION})")

    with contextlib.ExitStack() as stack:
        url = served(args, stack)
        rows = {}

        def timed(key, fn, *a):
            rows.setdefault(key, []).append(fn(*a))

        def fill(on):
            shutil.rmtree(cache, ignore_errors=True)
            with digest(on, "fill"):
                t0 = time.perf_counter()
                out = load_file(url, device, cache_dir=cache)
                sync()
                loaded = time.perf_counter() - t0
                wait_for_cache_fills()
                made = time.perf_counter() - t0
            del out
            return loaded, made

        def unstamp():
            for n in os.listdir(cache):
                if n.endswith(".checked"):
                    os.unlink(os.path.join(cache, n))

        def hit(on, stamped=True):
            read_all(files + [os.path.join(cache, n) for n in os.listdir(cache)])
            if not stamped:
                unstamp()
            with digest(on, "hit"):
                t0 = time.perf_counter()
                with Checkpoint.open(url, cache_dir=cache) as ck:
                    opened = time.perf_counter() - t0
                    assert ck.files and ck.nbytes
                if not stamped:
                    unstamp()       # (the open's check wrote them again)
                t0 = time.perf_counter()
                out = load_file(url, device, cache_dir=cache)
                sync()
                loaded = time.perf_counter() - t0
            del out
            return opened, loaded

        def plain():
            read_all(files)
            t0 = time.perf_counter()
            out = load_file(files, device)
            sync()
            del out
            return time.perf_counter() - t0, None

        for _ in range(args.repeat):
            for on in (False, True):        # (the last fill's entries are the hits')
                timed(("fill", on), fill, on)
        for _ in range(args.repeat):
            for on in (True, False):
                timed(("hit", on), hit, on)
            timed(("unstamped", True), hit, True, False)
            timed(("local", None), plain)

    def best(key, i):
        return min(r[i] for r in rows[key])

    print(f"\n{len(files)} files, {nbytes / 1e9:.2f} GB, device {device}, best of {args.repeat}\n")
    print("| what | digest on (s) | digest off (s) | on GB/s | on / off time |")
    print("| --- | --- | --- | --- | --- |")
    for label, key, i in (("fill: load returned", "fill", 0), ("fill: entries made", "fill", 1),
                          ("open of the cache (stamped)", "hit", 0),
                          ("load from the cache (open included)", "hit", 1)):
        on, off = best((key, True), i), best((key, False), i)
        print(f"| {label} | {on:.3f} | {off:.3f} | {nbytes / on / 1e9:.2f} | {on / off:.3f} |")
    for label, i in (("open, no stamp (the full check)", 0),
                     ("load from the cache, no stamp (open included)", 1)):
        on, off = best(("unstamped", True), i), best(("hit", False), i)
        print(f"| {label} | {on:.3f} | {off:.3f} | {nbytes / on / 1e9:.2f} | {on / off:.3f} |")
    ref = best(("local", None), 0)
    on = best(("hit", True), 1)
    print(f"| local files (load_file of the paths) | {ref:.3f} | | {nbytes / ref / 1e9:.2f} | "
          f"from cache / local: {on / ref:.3f} |")


if __name__ == "__main__":
    main()
