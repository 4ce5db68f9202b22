"""Loading a checkpoint from S3-compatible object storage, side by side.

On one S3 server (``--endpoint``; credentials from the AWS_* variables),
with the benchmark layouts (bench_load.py's dense, MoE and AWQ, scaled by
``--scale``) uploaded once, each method loads the whole checkpoint onto
the device, in a fresh process per run (so each pays its own start, and
its peak RSS is its own):

  instant_staging   load_file("s3://bucket/layout/", device): the reader
                    threads fetch ranged GETs straight into staging slots
  model streamer    runai-model-streamer's SafetensorsStreamer over the
                    s3:// URLs (its S3 client is awscrt's), then .to(device);
                    each --streamer-concurrency tried, the best reported
  raw ceiling       obstore fetching the same bytes as parallel ranged GETs
                    into memory and discarding them (no device, no parsing);
                    each --ceiling-inflight tried, the best reported

Every loaded tensor is compared bit for bit with the same file read from
disk (outside the timed part).  Prints one markdown table per layout,
with each method's version and settings, best and median seconds, GB/s,
the ratio to the ceiling, and the peak RSS the load added (over what the
process held once torch and, on a GPU, CUDA had started: every method starts
with CUDA up, as a server does).

    AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... \\
    python benchmarks/bench_remote.py --endpoint http://127.0.0.1:9000 --bucket bench
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
sys.path.insert(1, os.path.dirname(HERE))     # a checkout built in place


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


def _store(args):
    from obstore.store import S3Store
    return S3Store(args.bucket, config={"endpoint": args.endpoint, "region": args.region},
                   client_options={"allow_http": args.endpoint.startswith("http://")})


# -- one run, in a process of its own ----------------------------------------------------

def worker(args):
    """Runs ``args.method`` once; prints a JSON line."""
    import torch
    device = torch.device(args.device)
    prefix = f"s3://{args.bucket}/{args.layout}/"
    files = json.loads(args.files)
    urls = [prefix + os.path.basename(f) for f in files]
    out, info = None, {}
    if device.type == "cuda":       # started, as in a server: every method alike
        torch.zeros(1, device=device)
        torch.cuda.synchronize(device)
    rss_before = _rss_now()
    t0 = time.perf_counter()
    if args.method == "instant_staging":
        if args.setting != "default":           # CHUNK[:IO_DEPTH]
            chunk, _, depth = args.setting.partition(":")
            os.environ["INSTANT_STAGING_CHUNK_SIZE"] = chunk
            if depth:
                os.environ["INSTANT_STAGING_IO_DEPTH"] = depth
        from instant_staging.loader import Checkpoint
        with Checkpoint.open(prefix) as ck:
            out = ck.load(device)
            r = ck.last_report
        info = {"staging": r.staging_kind, "threads": r.threads, "chunk_size": r.chunk_size}
    elif args.method == "model streamer":
        concurrency, _, chunk = args.setting.partition(":")
        os.environ.update({"RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
                           "AWS_EC2_METADATA_DISABLED": "true",
                           "RUNAI_STREAMER_CONCURRENCY": concurrency})
        if chunk:
            os.environ["RUNAI_STREAMER_CHUNK_BYTESIZE"] = str(int(chunk) << 20)
        from runai_model_streamer import SafetensorsStreamer
        out = {}
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(urls)
            for name, t in streamer.get_tensors():
                out[name] = t.to(device)
        info = {"concurrency": concurrency, "chunk": f"{chunk} MiB" if chunk else "8 MiB (its default)"}
    else:                       # raw ceiling
        import concurrent.futures as cf

        import obstore
        store = _store(args)
        chunk = args.chunk
        ranges = [(os.path.basename(f), off, min(chunk, os.path.getsize(f) - off))
                  for f in files for off in range(0, os.path.getsize(f), chunk)]

        def get(r):
            return len(obstore.get_range(store, f"{args.layout}/{r[0]}", start=r[1], length=r[2]))
        with cf.ThreadPoolExecutor(int(args.setting)) as pool:
            got = sum(pool.map(get, ranges))
        assert got == sum(os.path.getsize(f) for f in files)
        info = {"inflight": args.setting, "range": chunk}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    rss_peak = _rss_peak()          # before the check below loads the reference
    exact = None
    if out is not None:
        from instant_staging.loader import load_file
        exact = True
        for f in files:
            for name, want in load_file(f, device).items():
                g = out.get(name)
                if g is None or g.dtype != want.dtype or g.shape != want.shape or not torch.equal(
                        g.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
                    exact = False
    print(json.dumps({"seconds": seconds, "rss": rss_peak - rss_before, "exact": exact, "info": info}))


def run_one(args, layout, files, method, setting=0):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--method", method,
           "--layout", layout, "--files", json.dumps(files), "--setting", str(setting),
           "--endpoint", args.endpoint, "--bucket", args.bucket, "--region", args.region,
           "--device", args.device, "--chunk", str(args.chunk)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(p.stdout.strip().splitlines()[-1])


# -- setup -----------------------------------------------------------------------------

def upload(args, layout, files):
    """Puts ``files`` under ``layout/`` (or, with ``--data-root``, links them
    into the folder a file-backed server serves the bucket from), then asks
    each for its size once: a server that computes ETags on first access
    does that before any method is timed."""
    import obstore
    store = _store(args)
    for f in files:
        key = f"{layout}/{os.path.basename(f)}"
        if args.data_root:
            dest = os.path.join(args.data_root, args.bucket, key)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            if not os.path.exists(dest):
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


def versions():
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for dist in ("instant_staging", "runai-model-streamer", "runai-model-streamer-s3", "obstore",
                 "torch"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--bucket", default="bench")
    ap.add_argument("--region", default=os.environ.get("AWS_REGION", "us-east-1"))
    ap.add_argument("--layouts", default="dense,moe,awq")
    ap.add_argument("--scale", default="dense:2,moe:1,awq:2",
                    help="bench_load's layouts, each dimension / scale (dense:2 is 4 GB)")
    ap.add_argument("--data-root", default=None,
                    help="the folder a file-backed server (LocalBucket) serves: files are linked there")
    ap.add_argument("--ours", default="default",
                    help="our settings: default, or CHUNK[:IO_DEPTH] (INSTANT_STAGING_CHUNK_SIZE, "
                         "INSTANT_STAGING_IO_DEPTH)")
    ap.add_argument("--dir", default="/tmp/bench_remote")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--methods", default="raw ceiling,instant_staging,model streamer")
    ap.add_argument("--streamer-concurrency", default="8,16,16:16,32",
                    help="Model Streamer's settings: concurrency[:chunk MiB] (its S3 default: 8, 8 MiB)")
    ap.add_argument("--ceiling-inflight", default="16,32")
    ap.add_argument("--chunk", type=int, default=8 << 20, help="the ceiling's range size")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--json", default=None)
    # one run (a child of main)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--layout", help=argparse.SUPPRESS)
    ap.add_argument("--files", help=argparse.SUPPRESS)
    ap.add_argument("--setting", default="0", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ.setdefault("AWS_ENDPOINT_URL", args.endpoint)
    os.environ.setdefault("AWS_REGION", args.region)
    if args.worker:
        return worker(args)
    import bench_load as BL
    makers = {"dense": BL.dense_layout, "moe": BL.moe_layout, "awq": BL.awq_layout}
    doc = {"versions": versions(), "endpoint": args.endpoint, "layouts": {}}
    print(f"bench_remote: {doc['versions']}, endpoint {args.endpoint}, device {args.device}, "
          f"{os.cpu_count()} CPUs")
    settings = {"raw ceiling": [int(x) for x in args.ceiling_inflight.split(",")],
                "model streamer": args.streamer_concurrency.split(","),
                "instant_staging": args.ours.split(",")}
    for layout in args.layouts.split(","):
        os.makedirs(os.path.join(args.dir, layout), exist_ok=True)
        scale = dict(kv.split(":") for kv in args.scale.split(","))
        files = BL.generate(os.path.join(args.dir, layout), makers[layout](int(scale.get(layout, 1))))
        nbytes = sum(os.path.getsize(f) for f in files)
        upload(args, layout, files)
        rows = []
        for method in args.methods.split(","):
            for setting in settings[method]:
                runs = [run_one(args, layout, files, method, setting) for _ in range(args.repeat)]
                ok = [r for r in runs if "error" not in r]
                rec = {"method": method, "setting": setting, "runs": runs}
                if ok:
                    secs = [r["seconds"] for r in ok]
                    rec.update(best=min(secs), median=statistics.median(secs),
                               gbps=nbytes / min(secs) / 1e9, rss=max(r["rss"] or 0 for r in ok),
                               exact=all(r["exact"] is not False for r in ok), info=ok[0]["info"])
                rows.append(rec)
        ceiling = max((r["gbps"] for r in rows if r["method"] == "raw ceiling" and "gbps" in r),
                      default=None)
        doc["layouts"][layout] = {"bytes": nbytes, "files": len(files), "rows": rows}
        print(f"\n### {layout}: {len(files)} file(s), {nbytes / 1e9:.2f} GB\n")
        print("| method | settings | best s | median s | GB/s | vs ceiling | RSS added | bit-exact |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            if "gbps" not in r:
                print(f"| {r['method']} | {r['setting']} | error: {r['runs'][0].get('error')} |", flush=True)
                continue
            vs = f"{r['gbps'] / ceiling:.2f}x" if ceiling else "-"
            exact = {True: "yes", False: "NO"}[r["exact"]] if r["method"] != "raw ceiling" else "n/a"
            print(f"| {r['method']} | {json.dumps(r['info'])} | {r['best']:.3f} | {r['median']:.3f} | "
                  f"{r['gbps']:.2f} | {vs} | {r['rss'] / 1e9:.2f} GB | {exact} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
