#!/usr/bin/env python3
"""The start of a load from object storage: ``Checkpoint.open(url)``.

Before the first byte of data, a remote load lists the prefix, reads the
index, and asks every object for its size and header: round trips, which
a server in another region or another cloud makes long.  This measures
that start, in a fresh process per run (the import not timed), against an
S3 server on this machine (LocalBucket, started here) behind a delay line
that holds every TCP segment ``--rtt``/2 in each direction (a round trip
of ``--rtt``; bytes keep flowing, only late), for each tree given by
``--trees`` (``name=path``: a checkout built in place), the trees' runs
alternating.  Each run also counts the requests the server saw.

No GPU is involved: the figures are the client's round trips on the host
that runs it (name it with the figures).  Needs the ``remote`` extra and
LocalBucket (``pip install localbucket``: an S3 server over a folder).

    python benchmarks/bench_open.py --trees new=.,old=/tmp/base \\
        [--layouts dense,awq,moe,finemoe] [--rtt 0,10,40] [--runs 5] [--json PATH]
"""

import argparse
import importlib.util
import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
BUCKET = "bench"

# The layouts' tensors at 1/64 of their size: a header's size is its
# tensors' count, not their bytes (the data is never read here).
SCALE = 64


class DelayLine:
    """A TCP proxy on 127.0.0.1 to ``upstream_port`` that delivers every
    segment ``delay`` seconds after it arrived, in each direction."""

    def __init__(self, upstream_port, delay):
        self.upstream, self.delay = upstream_port, delay
        self.requests = {}          # method -> requests seen (their request lines)
        self._lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            client, _ = self.listener.accept()
            server = socket.create_connection(("127.0.0.1", self.upstream))
            for a, b in ((client, server), (server, client)):
                q = queue.Queue()
                threading.Thread(target=self._read, args=(a, q, a is client),
                                 daemon=True).start()
                threading.Thread(target=self._write, args=(b, q), daemon=True).start()

    def _read(self, sock, q, requests):
        while True:
            try:
                data = sock.recv(1 << 16)
            except OSError:
                data = b""
            if requests:
                self._count(data)
            q.put((time.monotonic() + self.delay, data))
            if not data:
                return

    def _count(self, data):
        # (a request line split across two segments would be missed: these
        # are short requests, each sent whole)
        for method in (b"GET", b"HEAD", b"PUT", b"POST"):
            n = data.count(method + b" /")
            if n:
                with self._lock:
                    self.requests[method.decode()] = self.requests.get(method.decode(), 0) + n

    def seen(self):
        with self._lock:
            return dict(self.requests)

    def _write(self, sock, q):
        while True:
            due, data = q.get()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                if not data:
                    sock.shutdown(socket.SHUT_WR)
                    return
                sock.sendall(data)
            except OSError:
                return


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(root):
    """LocalBucket on a free port serving ``root``; (process, port)."""
    port = _free_port()
    if importlib.util.find_spec("localbucket") is None:
        raise SystemExit("bench_open.py needs LocalBucket: pip install localbucket")
    proc = subprocess.Popen([sys.executable, "-m", "localbucket", "--port", str(port), root],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("LocalBucket did not start: " + proc.stderr.read().decode())


def write_layouts(root, names):
    """Writes each layout (bench_load's, at 1/SCALE) under root/BUCKET/<name>/
    with an index where it has several shards."""
    import bench_load as BL
    bucket = os.path.join(root, BUCKET)
    for name, files in BL.layouts(names, SCALE, 0):
        where = os.path.join(bucket, name)
        os.makedirs(where, exist_ok=True)
        paths = BL.generate(where, files)
        if len(paths) > 1:
            from safetensors import safe_open
            weight_map = {}
            for p in paths:
                with safe_open(p, "np") as f:
                    weight_map.update({k: os.path.basename(p) for k in f.keys()})  # noqa: SIM118
            with open(os.path.join(where, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {}, "weight_map": weight_map}, f)


WORKER = r"""
import sys, time, json
sys.path.insert(0, {tree!r})
from instant_staging.loader import Checkpoint
opts = {{"endpoint": {endpoint!r}, "region": "us-east-1", "skip_signature": "true",
        "client_options": {{"allow_http": True}}}}
t0 = time.perf_counter()
with Checkpoint.open({url!r}, storage_options=opts) as ck:
    t1 = time.perf_counter()
    n = len(ck.names())
print(json.dumps({{"seconds": t1 - t0, "tensors": n, "files": len(ck.files)}}))
"""


def run_one(tree, endpoint, url, line):
    """(seconds, tensors, files, requests) of one fresh process's open."""
    before = line.seen()
    out = subprocess.run([sys.executable, "-c", WORKER.format(tree=tree, endpoint=endpoint, url=url)],
                         capture_output=True, text=True, timeout=300, check=False,
                         env={**os.environ, "PYTHONPATH": tree})
    if out.returncode != 0:
        raise SystemExit(f"{tree}: {url}: {out.stderr.strip().splitlines()[-1]}")
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    after = line.seen()
    return rec["seconds"], rec["tensors"], rec["files"], {m: after[m] - before.get(m, 0) for m in after}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", default=f"this={os.path.dirname(HERE)}",
                    help="name=path of checkouts built in place, comma-separated")
    ap.add_argument("--layouts", default="dense,awq,moe,finemoe")
    ap.add_argument("--rtt", default="0,10,40", help="round trips added, in ms")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dir", default=None, help="the server's folder (default: a temporary one)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    trees = [t.split("=", 1) for t in args.trees.split(",")]
    layouts = args.layouts.split(",")
    root = args.dir or tempfile.mkdtemp(prefix="bench_open_")
    write_layouts(root, layouts)
    server, port = start_server(root)
    results = []
    try:
        for rtt in (float(r) for r in args.rtt.split(",")):
            line = DelayLine(port, rtt / 2000)
            endpoint = f"http://127.0.0.1:{line.port}"
            for layout in layouts:
                url = f"s3://{BUCKET}/{layout}/"
                times = {name: [] for name, _ in trees}
                seen = {}
                for _ in range(args.runs):
                    for name, path in trees:
                        s, tensors, files, requests = run_one(os.path.abspath(path), endpoint,
                                                              url, line)
                        times[name].append(s)
                        seen[name] = (tensors, files, requests)
                for name, _ in trees:
                    results.append({"rtt_ms": rtt, "layout": layout, "tree": name,
                                    "tensors": seen[name][0], "files": seen[name][1],
                                    "requests": seen[name][2],
                                    "median_s": statistics.median(times[name]),
                                    "best_s": min(times[name]), "runs": times[name]})
                    r = results[-1]
                    print(f"rtt {rtt:g} ms  {layout:8s} ({r['files']} files, {r['tensors']} tensors)  "
                          f"{name:6s} median {1e3 * r['median_s']:7.1f} ms  "
                          f"best {1e3 * r['best_s']:7.1f} ms  requests {r['requests']}",
                          flush=True)
    finally:
        server.kill()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
