"""Which S3 client to build the object-storage source on: the raw ceiling of each.

For each candidate client this fetches one whole object from an S3-compatible
endpoint as parallel ranged GETs (``Range: bytes=a-b``) of ``--chunk`` bytes,
``--inflight`` of them outstanding at a time, into memory, and throws the
bytes away.  Nothing more is done with them (no copy, hash or GPU), so the
figure is the most that client can deliver through its own Python API: the
ceiling any loader built on it would be held under.  Each setting is timed
``--repeat`` times and the best run is reported (MB/s, MB = 10**6 bytes), with
the others beside it, and with the CPU time the client's process spent per GB
over all the runs (user + system, every thread).

The clients:

``obstore``
    The Rust ``object_store`` crate through its Python binding: the blocking
    ``obstore.get_range`` (it releases the GIL while it waits) in a pool of
    ``--inflight`` threads, the way a threaded loader would call it.  Not
    ``get_ranges``: that one coalesces adjacent ranges into one request and
    fixes its own concurrency, so it would not measure the setting asked for.
``obstore-async``
    The same through ``obstore.get_range_async`` under an ``asyncio``
    semaphore of ``--inflight``.
``awscrt``
    The AWS Common Runtime's S3 client (C; what runai-model-streamer's S3
    backend builds on).  One ``GET_OBJECT`` meta-request per range with the
    part size set to the chunk, so each is one HTTP GET; a semaphore released
    by ``on_done`` keeps ``--inflight`` of them outstanding.
``awscrt-auto``
    The same client left to split the object itself: one ``GET_OBJECT``
    meta-request for the whole object, ``part_size=chunk`` and
    ``max_active_connections_override=inflight`` (how the CRT is meant to be
    used).
``boto3``
    ``get_object(Range=...)`` and ``Body.read()`` in a thread pool of
    ``--inflight`` threads sharing one client whose pool holds as many
    connections.

``--put`` first creates the bucket (if missing) and uploads ``--size`` random
bytes as the object; without it the object must exist and its size is read
with a HEAD.  Credentials come from ``--access-key``/``--secret-key`` or the
usual ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``.

The client and the server share the machine, so on a small machine the
figures are CPU bound: they rank the clients by the CPU each spends per byte
as much as by their I/O, a larger host will give larger numbers, and the
client's CPU per GB is the figure that carries over best.  For the same
reason the server should cost little CPU per byte.  Of the S3 servers that
install from PyPI, LocalBucket (``localbucket``, standard library only; it
serves ``DATA_ROOT/<bucket>/<key>`` files and does not check credentials)
cost the least on a 2-core host: ``python3 -m localbucket DATA_ROOT --port
9000``.  It computes an object's ETag (MD5 of the whole file) at its first
HEAD or GET and caches it; this script's HEAD comes before any timing.

Example::

    python benchmarks/bench_clients.py --endpoint http://127.0.0.1:9000 \\
        --bucket bench --key blob --size 1GiB --put \\
        --chunk 8MiB,16MiB --inflight 8,16,32 --repeat 3
"""

import argparse
import asyncio
import concurrent.futures
import importlib.metadata
import os
import platform
import re
import resource
import statistics
import sys
import threading
import time
import urllib.parse

CLIENTS = ("obstore", "obstore-async", "awscrt", "awscrt-auto", "boto3")
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30,
          "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_size(text):
    """``'16MiB'``, ``'1GiB'``, ``'8m'``, ``'1000000'`` -> bytes (KiB/MiB/GiB and bare k/m/g are binary)."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def fmt_size(n):
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def ranges(size, chunk):
    """``(start, length)`` of each chunk covering ``[0, size)``."""
    return [(s, min(chunk, size - s)) for s in range(0, size, chunk)]


def version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


class Target:
    """Where the object is and how to sign for it."""

    def __init__(self, args):
        self.endpoint = args.endpoint.rstrip("/")
        url = urllib.parse.urlsplit(self.endpoint)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise SystemExit(f"--endpoint must be http(s)://host[:port][/path]: {args.endpoint}")
        self.https = url.scheme == "https"
        self.hostport = url.netloc
        self.prefix = url.path.rstrip("/")  # a server mounted under a path, e.g. http://host:port/s3
        self.bucket = args.bucket
        self.key = args.key
        self.region = args.region
        self.access_key = args.access_key
        self.secret_key = args.secret_key


# -- boto3 (also does --put and the HEAD) ----------------------------------------------------------------


def boto3_client(t, pool):
    import boto3
    import botocore.config

    cfg = botocore.config.Config(
        max_pool_connections=pool,
        s3={"addressing_style": "path"},
        retries={"max_attempts": 3, "mode": "standard"},
        # Third-party servers need not know the flexible-checksum headers; ranged GETs are not checked anyway.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return boto3.session.Session().client(
        "s3", endpoint_url=t.endpoint, region_name=t.region, aws_access_key_id=t.access_key,
        aws_secret_access_key=t.secret_key, config=cfg)


def put_object(t, size):
    """Create the bucket if missing and upload ``size`` random bytes as the object."""
    from botocore.exceptions import ClientError

    s3 = boto3_client(t, 4)
    try:
        s3.create_bucket(Bucket=t.bucket)
    except ClientError as e:
        if e.response["Error"]["Code"] not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise
    data = os.urandom(size)
    t0 = time.perf_counter()
    s3.put_object(Bucket=t.bucket, Key=t.key, Body=data)
    return time.perf_counter() - t0


def head_object(t):
    """(size, the Server header) of the object."""
    r = boto3_client(t, 1).head_object(Bucket=t.bucket, Key=t.key)
    headers = r["ResponseMetadata"]["HTTPHeaders"]
    return r["ContentLength"], headers.get("server", "?")


class Boto3Fetch:
    name = "boto3"

    def __init__(self, t, chunk, inflight):
        self.t = t
        self.s3 = boto3_client(t, inflight)
        self.pool = concurrent.futures.ThreadPoolExecutor(inflight)
        self.settings = (f"get_object(Range) + Body.read() in {inflight} threads; "
                         f"max_pool_connections={inflight}")

    def _one(self, start, length):
        rng = f"bytes={start}-{start + length - 1}"
        return len(self.s3.get_object(Bucket=self.t.bucket, Key=self.t.key, Range=rng)["Body"].read())

    def fetch(self, size, chunk):
        return sum(self.pool.map(lambda r: self._one(*r), ranges(size, chunk)))

    def close(self):
        self.pool.shutdown()


# -- obstore -----------------------------------------------------------------------------------------------


def obstore_store(t):
    import obstore.store

    return obstore.store.S3Store(
        t.bucket, endpoint=t.endpoint, region=t.region, access_key_id=t.access_key,
        secret_access_key=t.secret_key, virtual_hosted_style_request=False,
        client_options={"allow_http": not t.https, "timeout": "120s"})


class ObstoreFetch:
    name = "obstore"

    def __init__(self, t, chunk, inflight):
        self.t = t
        self.store = obstore_store(t)
        self.pool = concurrent.futures.ThreadPoolExecutor(inflight)
        self.settings = f"get_range (blocking, releases the GIL) in {inflight} threads; path-style"

    def _one(self, start, length):
        import obstore

        return len(memoryview(obstore.get_range(self.store, self.t.key, start=start, length=length)))

    def fetch(self, size, chunk):
        return sum(self.pool.map(lambda r: self._one(*r), ranges(size, chunk)))

    def close(self):
        self.pool.shutdown()


class ObstoreAsyncFetch:
    name = "obstore-async"

    def __init__(self, t, chunk, inflight):
        self.t = t
        self.inflight = inflight
        self.store = obstore_store(t)
        self.loop = asyncio.new_event_loop()
        self.settings = f"get_range_async under asyncio.Semaphore({inflight}); path-style"

    async def _all(self, size, chunk):
        import obstore

        sem = asyncio.Semaphore(self.inflight)

        async def one(start, length):
            async with sem:
                buf = await obstore.get_range_async(self.store, self.t.key, start=start, length=length)
                return len(memoryview(buf))

        tasks = [asyncio.ensure_future(one(s, n)) for s, n in ranges(size, chunk)]
        try:
            return sum(await asyncio.gather(*tasks))
        except BaseException:  # let no range outlive a failed fetch (nor the loop)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    def fetch(self, size, chunk):
        return self.loop.run_until_complete(self._all(size, chunk))

    def close(self):
        self.loop.close()


# -- awscrt ------------------------------------------------------------------------------------------------


class AwscrtFetch:
    name = "awscrt"

    def __init__(self, t, chunk, inflight):
        from awscrt import auth, io, s3

        self.t = t
        self.inflight = inflight
        self.s3 = s3
        self.elg = io.EventLoopGroup(os.cpu_count())
        bootstrap = io.ClientBootstrap(self.elg, io.DefaultHostResolver(self.elg))
        self.client = s3.S3Client(
            bootstrap=bootstrap, region=t.region,
            credential_provider=auth.AwsCredentialsProvider.new_static(t.access_key, t.secret_key),
            tls_mode=s3.S3RequestTlsMode.ENABLED if t.https else s3.S3RequestTlsMode.DISABLED,
            part_size=chunk, max_active_connections_override=inflight,
            throughput_target_gbps=100.0, memory_limit=max(2 << 30, 4 * chunk * inflight))
        self.settings = (f"GET_OBJECT meta-request per range, part_size=chunk, {inflight} outstanding; "
                         f"event loop threads={os.cpu_count()}")

    def _request(self, start=None, length=None):
        from awscrt import http

        headers = [("Host", self.t.hostport)]
        if start is not None:
            headers.append(("Range", f"bytes={start}-{start + length - 1}"))
        path = self.t.prefix + "/" + urllib.parse.quote(f"{self.t.bucket}/{self.t.key}")
        return http.HttpRequest("GET", path, http.HttpHeaders(headers))

    def _go(self, request, on_done):
        got = [0]

        def on_body(chunk, offset, **_):
            got[0] += len(chunk)

        def done(error=None, status_code=None, **_):
            on_done(error, status_code, got[0])

        self.client.make_request(type=self.s3.S3RequestType.GET_OBJECT, request=request,
                                 on_body=on_body, on_done=done)

    def fetch(self, size, chunk):
        sem = threading.Semaphore(self.inflight)
        lock = threading.Lock()
        total, errors, finished = [0], [], threading.Event()
        parts = ranges(size, chunk)
        left = [len(parts)]

        def on_done(error, status, got):
            with lock:
                total[0] += got
                if error is not None or status not in (200, 206):
                    errors.append(f"{error} (HTTP {status})")
                left[0] -= 1
                if left[0] == 0:
                    finished.set()
            sem.release()

        for start, length in parts:
            sem.acquire()
            self._go(self._request(start, length), on_done)
        finished.wait()
        if errors:
            raise RuntimeError(f"awscrt: {len(errors)} failed ranges, first: {errors[0]}")
        return total[0]

    def close(self):
        del self.client


class AwscrtAutoFetch(AwscrtFetch):
    name = "awscrt-auto"

    def __init__(self, t, chunk, inflight):
        super().__init__(t, chunk, inflight)
        self.settings = (f"one GET_OBJECT meta-request for the object, part_size=chunk, "
                         f"max_active_connections_override={inflight}")

    def fetch(self, size, chunk):
        out, finished = {}, threading.Event()

        def on_done(error, status, got):
            out.update(error=error, status=status, got=got)
            finished.set()

        self._go(self._request(), on_done)
        finished.wait()
        if out["error"] is not None or out["status"] not in (200, 206):
            raise RuntimeError(f"awscrt-auto: {out['error']} (HTTP {out['status']})")
        return out["got"]


FETCHERS = {c.name: c for c in (ObstoreFetch, ObstoreAsyncFetch, AwscrtFetch, AwscrtAutoFetch, Boto3Fetch)}
DISTS = {"obstore": ["obstore"], "obstore-async": ["obstore"], "awscrt": ["awscrt"],
         "awscrt-auto": ["awscrt"], "boto3": ["boto3", "botocore"]}


# -- driver ------------------------------------------------------------------------------------------------


def cpu_seconds():
    """User + system CPU time of this process, all its threads (the client's side only)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(cls, t, size, chunk, inflight, repeat):
    """(MB/s of each of ``repeat`` whole-object fetches, the client's CPU seconds per GB over all of
    them, the settings line); one client, reused, so runs after the first find its connections open."""
    f = cls(t, chunk, inflight)
    try:
        rates, cpu = [], 0.0
        for _ in range(repeat):
            c0, t0 = cpu_seconds(), time.perf_counter()
            got = f.fetch(size, chunk)
            dt, cpu = time.perf_counter() - t0, cpu + cpu_seconds() - c0
            if got != size:
                raise RuntimeError(f"{cls.name}: got {got} bytes of {size}")
            rates.append(size / dt / 1e6)
        return rates, cpu / (repeat * size / 1e9), f.settings
    finally:
        f.close()


def csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", default="http://127.0.0.1:9000",
                   help="http(s)://host[:port][/path] of the server (default http://127.0.0.1:9000)")
    p.add_argument("--bucket", default="bench")
    p.add_argument("--key", default="blob-1g")
    p.add_argument("--size", type=parse_size, default=None,
                   help="object size for --put (default 1GiB); without --put it is read with a HEAD")
    p.add_argument("--put", action="store_true",
                   help="create the bucket and upload --size random bytes first")
    p.add_argument("--chunk", type=csv(parse_size), default=[8 << 20, 16 << 20],
                   help="range sizes, comma-separated (default 8MiB,16MiB)")
    p.add_argument("--inflight", type=csv(int), default=[8, 16, 32],
                   help="requests outstanding, comma-separated (default 8,16,32)")
    p.add_argument("--clients", type=csv(str), default=list(CLIENTS),
                   help=f"comma-separated, of {','.join(CLIENTS)} (default all)")
    p.add_argument("--repeat", type=int, default=3,
                   help="whole-object fetches per setting; the best is reported (default 3)")
    p.add_argument("--region", default=os.environ.get("AWS_REGION", "us-east-1"))
    p.add_argument("--access-key", default=os.environ.get("AWS_ACCESS_KEY_ID", "bench"))
    p.add_argument("--secret-key", default=os.environ.get("AWS_SECRET_ACCESS_KEY", "benchbench"))
    p.add_argument("--server-name", default=None,
                   help="what the server is, for the table (default: its Server header)")
    args = p.parse_args(argv)
    bad = [c for c in args.clients if c not in FETCHERS]
    if bad:
        p.error(f"unknown client(s) {bad}; known: {', '.join(CLIENTS)}")

    t = Target(args)
    if args.put:
        size = args.size or (1 << 30)
        dt = put_object(t, size)
        print(f"uploaded s3://{t.bucket}/{t.key}: {fmt_size(size)} in {dt:.1f} s "
              f"({size / dt / 1e6:.0f} MB/s)\n")
    size, server = head_object(t)
    if args.size is not None and args.size != size:
        raise SystemExit(f"the object is {size} bytes, not --size {args.size}")

    print("# Raw ceiling: whole-object ranged GETs into memory, discarded\n")
    print(f"- endpoint `{t.endpoint}`, object `{t.bucket}/{t.key}` {fmt_size(size)}, "
          f"server: {args.server_name or server}")
    print(f"- host: {platform.machine()}, {os.cpu_count()} CPUs (client and server share them), "
          f"Python {platform.python_version()}")
    print(f"- best of {args.repeat}; MB/s with MB = 10^6 bytes; the other runs in brackets")
    print("- versions: " + ", ".join(f"{d} {version(d)}" for d in ("obstore", "awscrt", "boto3", "botocore")))
    print()
    print("| client | version | chunk | in flight | best MB/s | runs MB/s | client CPU s/GB | settings |")
    print("| --- | --- | ---: | ---: | ---: | --- | ---: | --- |")
    for name in args.clients:
        ver = " / ".join(version(d) for d in DISTS[name])
        for chunk in args.chunk:
            for inflight in args.inflight:
                try:
                    rates, cpu_per_gb, settings = measure(
                        FETCHERS[name], t, size, chunk, inflight, args.repeat)
                except Exception as e:  # one client failing must not hide the others' figures
                    why = " ".join(str(e).split())[:160]
                    print(f"| {name} | {ver} | {fmt_size(chunk)} | {inflight} | failed | | | "
                          f"{type(e).__name__}: {why} |", flush=True)
                    continue
                runs = ", ".join(f"{r:.0f}" for r in rates)
                print(f"| {name} | {ver} | {fmt_size(chunk)} | {inflight} | **{max(rates):.0f}** | "
                      f"[{runs}] (median {statistics.median(rates):.0f}) | {cpu_per_gb:.2f} | {settings} |",
                      flush=True)


if __name__ == "__main__":
    main()
    # After obstore 0.12.1's async API, one exit in three to eight died in interpreter finalisation
    # (SIGABRT or SIGBUS, after all the output; its blocking API never did, in 24 runs).  The figures
    # are out by now: leave without the finalisation.
    sys.stdout.flush()
    os._exit(0)
