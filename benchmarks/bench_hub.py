"""A Hub source two ways: streamed from its resolve URLs, or through
huggingface_hub's cache (issue 55; docs/guides/hub.md holds the figures
and the decision).

A local server that answers as the Hub does (tests/support/hub_server.py:
the API, resolve URLs whose LFS files redirect to another origin, as the
Hub's CDN) serves a checkpoint of ``--shards`` shards of ``--shard-mib``
MiB, in a process of its own; ``HF_ENDPOINT`` points at it.  Each method
loads the whole checkpoint onto ``--device`` in a fresh process:

  stream          load_file of the shards' resolve URLs at the commit
                  (https path: each ranged GET follows the redirect); no
                  copy on disk, so every load fetches every byte
  hub cold        load_file("org/bench") with an empty HF_HUB_CACHE:
                  snapshot_download of the weights, then the local files
                  (the files just written: in the page cache)
  hub warm        the same again, online: huggingface_hub asks the Hub
                  which commit main is, then the local files
  hub offline     the same with HF_HUB_OFFLINE=1: nothing asked

Prints a markdown table: best and median seconds of ``--runs`` runs, GB/s.

    python benchmarks/bench_hub.py --shards 4 --shard-mib 256 --runs 3
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TESTS = os.path.join(ROOT, "tests")
sys.path.insert(0, ROOT)

SERVE = """
import sys, time
sys.path.insert(0, {tests!r})
from support.hub_server import HubServer
s = HubServer().start()
sha = s.add("org/bench", {repo!r})
print(s.url, sha, flush=True)
sys.stdin.read()
"""


def make_repo(path, shards, shard_mib):
    import torch
    from safetensors.torch import save_file
    os.makedirs(path)
    weight_map = {}
    g = torch.Generator().manual_seed(0)
    per = shard_mib * (1 << 20) // 4 // 8          # eight float32 tensors a shard
    for k in range(shards):
        name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {f"l{k}.t{j}": torch.randn(per, generator=g) for j in range(8)}
        save_file(part, os.path.join(path, name))
        weight_map.update({n: name for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write("{}")
    return sum(os.path.getsize(os.path.join(path, n)) for n in set(weight_map.values()))


WORKER = """
import os, sys, time, json
sys.path.insert(0, {root!r})
method, url, sha, shards, device = {args!r}
t0 = time.perf_counter()
from instant_staging.loader import load_file
if method == "stream":
    source = [f"{{url}}/org/bench/resolve/{{sha}}/model-{{k + 1:05d}}-of-{{shards:05d}}.safetensors"
              for k in range(shards)]
else:
    source = "org/bench"
t1 = time.perf_counter()
got = load_file(source, device)
n = sum(t.numel() * t.element_size() for t in got.values())
print(json.dumps({{"seconds": time.perf_counter() - t1, "bytes": n}}))
"""


def run(method, url, sha, shards, device, env):
    code = WORKER.format(root=ROOT, args=(method, url, sha, shards, device))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--shard-mib", type=int, default=256)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="bench-hub-")
    try:
        repo = os.path.join(work, "repo")
        total = make_repo(repo, args.shards, args.shard_mib)
        server = subprocess.Popen([sys.executable, "-c", SERVE.format(tests=TESTS, repo=repo)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        url, sha = server.stdout.readline().split()
        cache = os.path.join(work, "hf-cache")
        env = dict(os.environ, HF_ENDPOINT=url, HF_HUB_CACHE=cache, HF_HOME=os.path.join(work, "home"),
                   HF_HUB_DISABLE_PROGRESS_BARS="1")
        env.pop("HF_HUB_OFFLINE", None)
        times = {m: [] for m in ("stream", "hub cold", "hub warm", "hub offline")}
        for _ in range(args.runs):
            times["stream"].append(run("stream", url, sha, args.shards, args.device, env)["seconds"])
            shutil.rmtree(cache, ignore_errors=True)
            times["hub cold"].append(run("hub", url, sha, args.shards, args.device, env)["seconds"])
            times["hub warm"].append(run("hub", url, sha, args.shards, args.device, env)["seconds"])
            times["hub offline"].append(run("hub", url, sha, args.shards, args.device,
                                            dict(env, HF_HUB_OFFLINE="1"))["seconds"])
        server.stdin.close()
        server.wait(10)
        print(f"{args.shards} shards, {total / 1e9:.2f} GB, device {args.device}, "
              f"{args.runs} runs, {time.strftime('%Y-%m-%d')}\n")
        print("| method | best s | median s | GB/s (best) |")
        print("| --- | --- | --- | --- |")
        for m, ts in times.items():
            print(f"| {m} | {min(ts):.2f} | {statistics.median(ts):.2f} | {total / min(ts) / 1e9:.2f} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
