#!/usr/bin/env python3
"""The first load in a fresh process: what a server or a script waits for (issue 19).

Every run is its own Python process, started by this script (the parent),
that does what a user's process does and nothing before it:

    import torch                    timed: "torch"
    import <the loader>             timed: "import" (instant_staging.loader,
                                    safetensors.torch, instanttensor,
                                    fastsafetensors, runai_model_streamer)
    [mode cuda: torch.cuda.init(); torch.ones(1, device=...); synchronize]
                                    timed: "CUDA start", as a server does it
    first = load(files, device); synchronize            timed: "first"
    del first                       (its device memory goes back to torch's
                                    caching allocator, as a user's del does;
                                    no empty_cache; then gc.collect(), for the
                                    bit-exact check's garbage, untimed)
    second = load(files, device); synchronize           timed: "second"
    exit                            (interpreter shutdown, timed by the parent)

Modes (--modes): ``cuda`` (CUDA started first, a server), ``none``
(nothing started, a script: the first call pays CUDA's start) and
``start`` (a process that only imports torch and starts CUDA, timed: the
"CUDA start alone" of issue 19's goal: first - second <= start + 0.03 s).

Methods (--methods): instant_staging (``load_file(files, device)``,
defaults), safetensors (``load_file(f, device=...)`` per file),
instanttensor, fastsafetensors (nogds), runai (streamer + .to(device)).
The peers are called with bench_load.py's own code (``peer_methods``); in a
peer's process bench_load is imported after the timed import and before
the first call, timed as "harness", and taken out of the process wall
time ("wall").  Peers that are not installed, and the GPU-only ones on a
CPU device, are skipped with a note.

Layouts (--layouts), generated once into --dir by bench_load.py's code and
reused: ``dense`` (Llama-3-8B, 4 shards, 291 bf16 tensors, 16.06 GB),
``moe`` (1 shard, 1,188 bf16 tensors, 3.63 GB), ``awq`` (AutoAWQ
Llama-3-8B: 2 shards, 739 tensors, I32 qweight/qzeros + F16 scales,
5.73 GB).  Page cache hot for every layout; dropped (``cold``:
fdatasync once, then posix_fadvise(DONTNEED) on every file before each
such process) for the layouts in --cold.  In a cold process only the first
call meets a cold cache; the second reads what the first left cached.

Every result (both calls) is checked bit for bit after the timing: a hash
of each tensor's bytes is computed on the load's device (exact integer
sums of its 16-bit words, each weighted by its position; ``digests``) and
compared with the hashes of safetensors' own load of the same files onto
the same device, computed once by a reference process and cached beside
the files (``<layout>.first_load_ref.json``); names, dtypes, shapes and
the device are compared too.

Process times: ``wall`` = spawn to the end of the first call, minus
"harness", plus the interpreter's exit (what a process that loads once
and exits takes); ``wall_total`` in the JSON is spawn to exit of the
whole run (second call and checks included).

Order: one untimed process that imports torch and every loader and starts
CUDA (their libraries into the page cache), then CUDA's start alone, ours
hot, ours cold, the peers hot, the peers cold; --deadline S starts no
process after S seconds (the rest is listed as skipped), --budget gives a
cell whose first call was slow one run, --second-budget lets a slow first
call go without a second; --dry-run lists the processes.  Exit status 1 if a result is not bit-exact or one of
our processes failed.

    python benchmarks/bench_first_load.py [--layouts dense,moe,awq]
        [--methods instant_staging,safetensors,runai,instanttensor,fastsafetensors]
        [--modes cuda,none,start] [--peer-modes M] [--runs 2] [--peer-runs N]
        [--cold moe,awq] [--cold-methods M] [--cold-modes M] [--cold-runs N]
        [--dir DIR] [--device cuda:0] [--scale 0.01] [--deadline S] [--json PATH]

issue 19's whole set on the H200 (about 4-5 minutes, the checkpoints written
first included):

    python benchmarks/bench_first_load.py --peer-runs 1 --peer-modes none \
        --cold moe,awq --cold-modes none --cold-methods instant_staging,safetensors,runai \
        --deadline 330 --json first_load.json

A smoke test of the whole flow on a CPU host: --device cpu --scale 0.01.
"""

import time

T_MAIN = time.monotonic()   # a run's process: its first moment in Python

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MARK = "BENCH_FIRST_LOAD_RESULT "
REF_VERSION = 2   # the hash of digests()

# Ours, then the peers from the fastest (on the H200 host, in-process) down:
# --deadline cuts from the end.
METHODS = ["instant_staging", "safetensors", "runai", "instanttensor", "fastsafetensors"]
# The module each method's "import" row times, and bench_load's name for it.
MODULE = {"instant_staging": "instant_staging.loader", "safetensors": "safetensors.torch",
          "instanttensor": "instanttensor", "fastsafetensors": "fastsafetensors",
          "runai": "runai_model_streamer"}
BENCH_LOAD_NAME = {"safetensors": "safetensors", "instanttensor": "instanttensor",
                   "fastsafetensors": "fastsafetensors nogds", "runai": "runai streamer"}
GPU_ONLY = {"instanttensor", "fastsafetensors", "runai"}
LAYOUTS = ["dense", "moe", "awq", "finemoe", "fp8"]
MODES = ["cuda", "none", "start"]


# -- the tensor hash (reference and runs share it) ----------------------------

_WORDS = 1 << 22          # 16-bit words per exact partial sum (16 MiB of int32 scratch)
_PRIME = (1 << 61) - 1


def digests(torch, tensors, device):
    """One integer per tensor, from its bytes: for each run of ``_WORDS``
    16-bit words, sum(word * weight(position)), each product exact in int32
    (|word| <= 2**15, weight < 2**15) and summed in int64 (torch sums
    integers in int64; |sum| < 2**52: exact on any device, in any order),
    the partial sums then chained modulo 2**61 - 1 with the byte count.
    A changed, moved or missing word changes it."""
    weights, buf = _scratch(torch, device)
    parts, counts, sizes, tails = [], [], [], []
    for t in tensors:
        raw = t.detach().reshape(-1).view(torch.uint8)
        n = raw.numel()
        even = raw[: n - n % 2]
        try:
            words = even.view(torch.int16)
        except RuntimeError:    # an odd storage offset: hash a copy
            words = even.clone().view(torch.int16)
        k = 0
        for lo in range(0, words.numel(), _WORDS):
            m = min(_WORDS, words.numel() - lo)
            torch.mul(words[lo:lo + m], weights[:m], out=buf[:m])
            parts.append(buf[:m].sum())
            k += 1
        counts.append(k)
        sizes.append(n)
        tails.append(int(raw[-1]) if n % 2 else 0)
    sums = torch.stack(parts).tolist() if parts else []
    out, i = [], 0
    for k, n, tail in zip(counts, sizes, tails):
        h = n
        for s in sums[i:i + k]:
            h = (h * 1000003 + s) % _PRIME
        out.append((h * 1000003 + tail) % _PRIME)
        i += k
    return out


_SCRATCH = {}


def _scratch(torch, device):
    """The weights and a buffer, made once per process and device and kept
    (nothing of the check's own is freed between the two calls)."""
    if device not in _SCRATCH:
        # (pos * 40503 + 12345) % 32749 + 1, in place (no temporaries to free),
        # reduced first so that no int32 overflows.
        weights = torch.arange(_WORDS, dtype=torch.int32, device=device)
        weights.remainder_(32749).mul_(40503).add_(12345).remainder_(32749).add_(1)
        _SCRATCH[device] = (weights, torch.empty(_WORDS, dtype=torch.int32, device=device))
    return _SCRATCH[device]


def describe(torch, tensors, device):
    """{name: [dtype, shape, hash]} of a {name: tensor}."""
    names = sorted(tensors)
    hashes = digests(torch, [tensors[n] for n in names], device)
    return {n: [str(tensors[n].dtype), list(tensors[n].shape), h] for n, h in zip(names, hashes)}


def check(torch, result, ref, device):
    """'ok' or the first difference from the reference ``ref``."""
    if not isinstance(result, dict):
        return f"not a dict: {type(result).__name__}"
    if set(result) != set(ref):
        extra, missing = sorted(set(result) - set(ref)), sorted(set(ref) - set(result))
        return f"names differ: {len(result)} vs {len(ref)} (extra {extra[:2]}, missing {missing[:2]})"
    for name, t in result.items():
        if t.device != device:
            return f"{name}: on {t.device}, not {device}"
    got = describe(torch, result, device)
    for name, (dtype, shape, h) in got.items():
        rdtype, rshape, rh = ref[name]
        if dtype != rdtype or shape != rshape:
            return f"{name}: {dtype} {shape}, safetensors {rdtype} {rshape}"
        if h != rh:
            return f"{name}: bytes differ"
    return "ok"


# -- a run's process ------------------------------------------------------------

_KEEP = []      # the last result lives until the interpreter's exit, as a script's would


def child_main(spec_json=None):
    """Entry of a run's process; prints one MARK line of JSON."""
    spec = json.loads(spec_json if spec_json is not None else sys.argv[1])
    rec = {"t_main": T_MAIN, "pid": os.getpid()}
    try:
        {"load": _child_load, "start": _child_start, "reference": _child_reference,
         "warmup": _child_warmup}[spec["role"]](spec, rec)
    except BaseException as e:
        import traceback
        rec["error"] = f"{type(e).__name__}: {e}"
        rec["traceback"] = traceback.format_exc()[-2000:]
    rec["t_exit"] = time.monotonic()
    sys.stdout.write("\n" + MARK + json.dumps(rec) + "\n")
    sys.stdout.flush()


def _sync(torch, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _start_cuda(torch, device, rec):
    """torch.cuda.init() + one device tensor + synchronize, timed."""
    t0 = time.monotonic()
    if device.type == "cuda":
        torch.cuda.init()
    t1 = time.monotonic()
    one = torch.ones(1, device=device)
    _sync(torch, device)
    t2 = time.monotonic()
    rec.update(cuda_init_s=t1 - t0, cuda_tensor_s=t2 - t1, cuda_start_s=t2 - t0)
    return one


def _child_start(spec, rec):
    t0 = time.monotonic()
    import torch
    rec["torch_s"] = time.monotonic() - t0
    device = torch.device(spec["device"])
    _KEEP.append(_start_cuda(torch, device, rec))
    if device.type == "cuda":
        rec["gpu"] = torch.cuda.get_device_name(device)
        rec["torch"] = torch.__version__


def _child_warmup(spec, rec):
    """Untimed: brings torch's, CUDA's and every loader's libraries into the
    page cache, so that the first measured process does not read them from disk."""
    import torch
    for method in spec["methods"]:
        try:
            _import_method(method)
        except Exception as e:
            rec.setdefault("import_errors", {})[method] = f"{type(e).__name__}: {e}"
    _start_cuda(torch, torch.device(spec["device"]), rec)


def _import_method(method):
    t0 = time.monotonic()
    if method == "instant_staging":
        try:
            import instant_staging.loader
        except ImportError:     # a checkout built with build_ext --inplace
            sys.path.insert(1, ROOT)
            import instant_staging.loader  # noqa: F401
    else:
        __import__(MODULE[method])
    return time.monotonic() - t0


def _caller(method, torch, device, rec):
    """load(files) for ``method``; a peer's is bench_load's, imported (timed
    as "harness") with the other peers blocked so that only this one loads."""
    if method == "instant_staging":
        from instant_staging.loader import load_file
        dev = str(device)
        return lambda files: load_file(files, dev)
    t0 = time.monotonic()
    for other, module in MODULE.items():
        if other not in (method, "instant_staging", "safetensors"):
            sys.modules.setdefault(module, None)     # its import in peer_methods fails: skipped
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import bench_load
    methods, _notes = bench_load.peer_methods(torch, device)
    rec["harness_s"] = time.monotonic() - t0
    found = [m for m in methods if m.name == BENCH_LOAD_NAME[method]]
    if not found:
        raise RuntimeError(f"bench_load.peer_methods has no {BENCH_LOAD_NAME[method]!r}: {_notes}")
    run = found[0].run
    return lambda files: run(files, lambda: None)


def _child_load(spec, rec):
    t0 = time.monotonic()
    import torch
    rec["torch_s"] = time.monotonic() - t0
    device = torch.device(spec["device"])
    method, files = spec["method"], spec["files"]
    rec["import_s"] = _import_method(method)
    load = _caller(method, torch, device, rec)
    if spec["mode"] == "cuda":
        _KEEP.append(_start_cuda(torch, device, rec))
    t0 = time.monotonic()
    first = load(files)
    _sync(torch, device)
    rec["t_first_end"] = t1 = time.monotonic()
    rec["first_s"] = t1 - t0
    # -- untimed from here on, except the second call --
    t0 = time.monotonic()
    with open(spec["ref"]) as f:
        ref = json.load(f)["tensors"]
    rec["verified_first"] = check(torch, first, ref, device)
    rec["verify_s"] = time.monotonic() - t0
    del first
    # The check's own objects (the reference, the hashes) would otherwise make
    # the second call pay a full collection of the cyclic GC (CPU host: 6 ->
    # 47 ms); the first result is gone already, by its refcount at the del.
    import gc
    gc.collect()
    if spec["second"] is not None and rec["first_s"] > spec["second"]:
        rec["second_skipped"] = f"first call over {spec['second']:g} s"
    else:
        t0 = time.monotonic()
        second = load(files)
        _sync(torch, device)
        rec["second_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        rec["verified_second"] = check(torch, second, ref, device)
        rec["verify_s"] += time.monotonic() - t0
        _KEEP.append(second)
        del second
    if method == "instant_staging":
        rec["staging"] = _staging_record()
    if device.type == "cuda":
        rec["gpu"] = torch.cuda.get_device_name(device)
    rec["torch"] = torch.__version__


def _staging_record():
    """The staging buffer the loads kept (best effort: private API)."""
    try:
        sys.path.insert(0, HERE)
        import _common as C

        from instant_staging.loader import _staging_pool
        out = []
        for dev, buf in _staging_pool.kept().items():
            out.append({"device": str(dev), "kind": buf.kind.name, "size": buf.size,
                        "segments": len(buf.segments), "huge_bytes": C.huge_bytes(buf.ptr),
                        "attempts": [[a.step, a.ok, round(a.seconds, 5)] for a in buf.attempts]})
        return out or "no buffer kept (a CPU load uses none; or INSTANT_STAGING_KEEP_STAGING=0)"
    except Exception as e:
        return f"unknown: {type(e).__name__}: {e}"


def _child_reference(spec, rec):
    """safetensors' own load of each layout onto the device, hashed."""
    import torch
    from safetensors.torch import load_file
    device = torch.device(spec["device"])
    for layout, (files, out_path) in spec["layouts"].items():
        t0 = time.monotonic()
        tensors = {}
        for path in files:
            loaded = load_file(path, device=str(device))
            tensors.update(describe(torch, loaded, device))
            if not rec.get("selftest"):
                rec["selftest"] = _selftest(torch, loaded, device)
            del loaded
            if device.type == "cuda":
                torch.cuda.empty_cache()
        doc = {"version": REF_VERSION, "key": spec["keys"][layout], "tensors": tensors}
        with open(out_path + ".tmp", "w") as f:
            json.dump(doc, f)
        os.replace(out_path + ".tmp", out_path)
        rec.setdefault("seconds", {})[layout] = time.monotonic() - t0
    if device.type == "cuda":
        rec["gpu"] = torch.cuda.get_device_name(device)


def _selftest(torch, tensors, device):
    """The hash sees one flipped bit, and two swapped halves."""
    name = max(tensors, key=lambda n: tensors[n].numel())
    t = tensors[name].reshape(-1).view(torch.uint8)
    n = t.numel()
    if n < 4:
        return "skipped: tensor too small"
    base = digests(torch, [t], device)[0]
    flipped = t.clone()
    flipped[n // 2] ^= 1
    half = n // 2 // 2 * 2
    swapped = torch.cat([t[half:2 * half], t[:half], t[2 * half:]])
    a, b = digests(torch, [flipped, swapped], device)
    same = bool(torch.equal(t[:half], t[half:2 * half]))
    ok = a != base and (b != base or same)
    return "ok" if ok else f"FAILED on {name}: {base} {a} {b}"


# -- the parent ---------------------------------------------------------------------

def _parent_imports():
    global C, B
    sys.path.insert(0, HERE)
    import _common as C
    import bench_load as B


def layout_files(name, divisor):
    return {"dense": B.dense_layout, "moe": B.moe_layout, "awq": B.awq_layout,
            "finemoe": B.finemoe_layout, "fp8": B.fp8_layout}[name](divisor)


def file_key(paths):
    return [[os.path.basename(p), os.path.getsize(p), os.stat(p).st_mtime_ns] for p in paths]


def references(args, layouts, device, log):
    """{layout: ref json path}; makes those missing or stale in one process."""
    out, todo, keys = {}, {}, {}
    for name, paths in layouts.items():
        path = os.path.join(args.dir, f"{name}.first_load_ref.json")
        out[name] = path
        key = file_key(paths)
        try:
            with open(path) as f:
                doc = json.load(f)
            if doc.get("version") == REF_VERSION and doc.get("key") == key:
                continue
        except (OSError, ValueError):
            pass
        todo[name] = (paths, path)
        keys[name] = key
    if todo:
        C.progress(f"reference hashes (safetensors onto {device}): {', '.join(todo)}")
        res = spawn({"role": "reference", "device": device, "layouts": todo, "keys": keys},
                    args.timeout * 3)
        log["reference"] = res
        if res.get("error"):
            raise SystemExit(f"the reference process failed: {res['error']}\n{res.get('stderr', '')}")
        if res.get("selftest") != "ok":
            raise SystemExit(f"the tensor hash's self-test failed: {res.get('selftest')}")
    return out


def spawn(spec, timeout):
    """Runs one process; its record with the parent's timings added."""
    import subprocess
    # -c: the module's cached bytecode, not a compile of this file per process;
    # cwd benchmarks/, so sys.path is what `python benchmarks/x.py` has.
    cmd = [sys.executable, "-c",
           f"import sys; sys.path.insert(0, {HERE!r}); import bench_first_load as b; b.child_main()",
           json.dumps(spec)]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=HERE)
    except subprocess.TimeoutExpired as e:
        return {"error": f"timed out after {timeout:.0f} s", "wall_total_s": time.monotonic() - t0,
                "stderr": (e.stderr or b"")[-2000:].decode(errors="replace")
                if isinstance(e.stderr, bytes) else (e.stderr or "")[-2000:]}
    t1 = time.monotonic()
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(MARK)]
    if not lines:
        return {"error": f"exit status {p.returncode}, no result", "wall_total_s": t1 - t0,
                "stderr": p.stderr[-2000:], "stdout": p.stdout[-1000:]}
    rec = json.loads(lines[-1][len(MARK):])
    rec["returncode"] = p.returncode
    rec["wall_total_s"] = t1 - t0
    rec["startup_s"] = rec.pop("t_main") - t0
    rec["exit_s"] = t1 - rec.pop("t_exit")
    if "t_first_end" in rec:
        rec["wall_s"] = rec.pop("t_first_end") - t0 - rec.get("harness_s", 0.0) + rec["exit_s"]
    if p.returncode and not rec.get("error"):
        rec["error"] = f"exit status {p.returncode}"
    if rec.get("error"):
        rec["stderr"] = p.stderr[-2000:]
    return rec


def available(methods, device):
    """(methods to run, notes about those skipped)."""
    import importlib.util
    keep, notes = [], []
    for m in methods:
        top = MODULE[m].split(".")[0]
        if m != "instant_staging" and importlib.util.find_spec(top) is None:
            notes.append(f"{m} skipped: {top} is not installed")
        elif m in GPU_ONLY and not device.startswith("cuda"):
            notes.append(f"{m} skipped: GPU only, device {device}")
        else:
            keep.append(m)
    return keep, notes


def versions():
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for dist in ("torch", "safetensors", "instanttensor", "fastsafetensors", "runai-model-streamer"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


def tree():
    """The source tree whose instant_staging the runs import (PYTHONPATH
    picks it: an A/B of two trees runs this script once per tree)."""
    import instant_staging
    return os.path.dirname(os.path.dirname(os.path.abspath(instant_staging.__file__)))


def commit():
    """The imported tree's HEAD, short, with "+changes" where tracked files
    differ from it (a run of an uncommitted tree once recorded the commit
    below it); None where that tree is not the top of a git checkout (a copy
    inside another checkout must not take that checkout's commit)."""
    import subprocess
    root = tree()

    def git(*args):
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    try:
        if os.path.realpath(git("rev-parse", "--show-toplevel") or "/nonexistent") != os.path.realpath(root):
            return None
        head = git("rev-parse", "--short", "HEAD")
        return (head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
                if head else None)
    except Exception:
        return None


def parse_list(parser, text, known, what):
    items = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in items if x not in known]
    if unknown:
        parser.error(f"unknown {what} {unknown}; known: {', '.join(known)}")
    return items


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="dense,moe,awq", help=", ".join(LAYOUTS))
    ap.add_argument("--methods", default=",".join(METHODS), help=", ".join(METHODS))
    ap.add_argument("--modes", default="cuda,none,start",
                    help="cuda (CUDA started first), none (nothing started), start (CUDA's start alone)")
    ap.add_argument("--cold", default="moe,awq",
                    help="layouts also run with the page cache dropped ('' for none)")
    ap.add_argument("--cold-methods", default=None, help="methods run cold (default: --methods)")
    ap.add_argument("--cold-modes", default=None, help="modes run cold (default: --modes)")
    ap.add_argument("--runs", type=int, default=2, help="fresh processes per cell")
    ap.add_argument("--peer-runs", type=int, default=None, help="the same for the peers (default --runs)")
    ap.add_argument("--peer-modes", default=None, help="modes the peers run in (default: --modes)")
    ap.add_argument("--cold-runs", type=int, default=None,
                    help="processes per cold cell (default: --runs, --peer-runs)")
    ap.add_argument("--budget", type=float, default=4.0,
                    help="a cell whose first call took longer than this many seconds gets no further runs")
    ap.add_argument("--second-budget", type=float, default=6.0,
                    help="a process whose first call took longer makes no second call (0: always)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds after which no further process is started (the rest: skipped, listed)")
    ap.add_argument("--dir", default=None,
                    help="checkpoints (default bench_load's .bench; scaled: a subfolder of it)")
    ap.add_argument("--device", default=None, help="default cuda:0 where /dev/nvidiactl exists, else cpu")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="each matrix dimension times this (0.01: a smoke test of a few MB)")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds one process may take")
    ap.add_argument("--json", default=None, metavar="PATH")
    ap.add_argument("--dry-run", action="store_true", help="list the processes it would start, and stop")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each process's record")
    args = ap.parse_args(argv)
    started = time.monotonic()
    _parent_imports()
    layouts_wanted = parse_list(ap, args.layouts, LAYOUTS, "layouts")
    methods = parse_list(ap, args.methods, METHODS, "methods")
    modes = parse_list(ap, args.modes, MODES, "modes")
    cold = parse_list(ap, args.cold, LAYOUTS, "layouts")
    cold_methods = methods if args.cold_methods is None else parse_list(
        ap, args.cold_methods, METHODS, "methods")
    cold_modes = modes if args.cold_modes is None else parse_list(ap, args.cold_modes, MODES, "modes")
    peer_modes = modes if args.peer_modes is None else parse_list(ap, args.peer_modes, MODES, "modes")
    if args.runs < 1 or min(args.peer_runs or 0, args.cold_runs or 0) < 0:
        ap.error("--runs must be >= 1, --peer-runs and --cold-runs >= 0")
    if not 0 < args.scale <= 1:
        ap.error("--scale must be in (0, 1]")
    peer_runs = args.runs if args.peer_runs is None else args.peer_runs
    divisor = max(1, round(1 / args.scale))
    device = args.device or ("cuda:0" if os.path.exists("/dev/nvidiactl") else "cpu")
    if args.dir is None:
        args.dir = B.DEFAULT_DIR if divisor == 1 else os.path.join(B.DEFAULT_DIR, f"scale-1of{divisor}")
    args.dir = os.path.abspath(args.dir)
    os.makedirs(args.dir, exist_ok=True)
    second = args.second_budget or None
    methods, notes = available(methods, device)
    if not device.startswith("cuda") and ("cuda" in modes or "start" in modes):
        notes.append(f"device {device}: 'CUDA start' is only torch.ones(1) on it, no CUDA")

    imported, at = tree(), commit()
    print("=" * 78)
    print(f"bench_first_load -- device {device}, scale 1/{divisor}, tree {imported}, commit {at}")
    print("=" * 78, flush=True)
    doc = {"environment": {"python": sys.version.split()[0], "device": device, "scale": args.scale,
                           "tree": imported, "commit": at, "cpus": len(os.sched_getaffinity(0)),
                           "thp": C._read("/sys/kernel/mm/transparent_hugepage/enabled"),
                           "versions": versions(),
                           "env": {k: v for k, v in os.environ.items()
                                   if k.startswith(("INSTANT_STAGING_", "CUDA_", "PYTORCH_"))}},
           "args": vars(args), "layouts": {}, "runs": [], "notes": notes, "skipped": []}

    # The processes, the most wanted first (--deadline cuts the rest):
    # CUDA's start, ours hot, ours cold, the peers hot, the peers cold.
    plan = []
    if "start" in modes:
        plan.append(("start", None, None, None, "hot", args.runs))
    ours = [m for m in methods if m == "instant_staging"]
    peers = [m for m in methods if m != "instant_staging"]

    def cells(group, cache):
        for method in group:
            wanted = modes if method == "instant_staging" else peer_modes
            runs = args.runs if method == "instant_staging" else peer_runs
            if cache == "cold":
                runs = runs if args.cold_runs is None else args.cold_runs
            for layout in layouts_wanted:
                if cache == "cold" and (layout not in cold or method not in cold_methods):
                    continue
                for mode in wanted:
                    if mode != "start" and (cache == "hot" or mode in cold_modes):
                        plan.append(("load", method, layout, mode, cache, runs))
    cells(ours, "hot")
    cells(ours, "cold")
    cells(peers, "hot")
    cells(peers, "cold")
    if args.dry_run:
        for role, method, layout, mode, cache, runs in plan:
            print(f"{runs} x " + ("CUDA start alone" if role == "start"
                                  else f"{layout} {cache} {mode} {method}"))
        print(f"{sum(p[-1] for p in plan)} processes at most (--budget and --deadline may cut)")
        for note in notes:
            print("note:", note)
        return 0

    # 1. the checkpoints, generated once, and the reference hashes
    paths, made_since = {}, time.time() - 1
    for name in layouts_wanted:
        t0 = time.monotonic()
        files = layout_files(name, divisor)
        paths[name] = B.generate(args.dir, files)
        doc["layouts"][name] = {"files": len(paths[name]), "tensors": sum(len(t) for _, t in files),
                                "bytes": sum(os.path.getsize(p) for p in paths[name]),
                                "generate_s": time.monotonic() - t0}
        lay = doc["layouts"][name]
        C.progress(f"{name}: {lay['files']} file(s), {lay['tensors']} tensors, "
                   f"{lay['bytes'] / 1e9:.2f} GB ({lay['generate_s']:.1f} s)")
    t0 = time.monotonic()
    for name in layouts_wanted:     # what was written just now is in the page cache
        B.warm([p for p in paths[name] if os.stat(p).st_mtime < made_since])
    doc["warm_s"] = time.monotonic() - t0
    refs = references(args, paths, device, doc)

    # 2. the processes, after one untimed that imports everything once
    res = spawn({"role": "warmup", "device": device, "methods": methods}, args.timeout)
    doc["warmup"] = res
    if res.get("error") or res.get("import_errors"):
        C.progress(f"warm-up process: {res.get('error') or res.get('import_errors')}")
    flushed = set()
    for role, method, layout, mode, cache, runs in plan:
        for i in range(runs):
            label = ("CUDA start alone" if role == "start"
                     else f"{layout} {cache} {mode:4} {method}") + f" #{i + 1}"
            if args.deadline is not None and time.monotonic() - started > args.deadline:
                doc["skipped"].append(label)
                continue
            spec = {"role": role, "device": device}
            if role == "load":
                files = paths[layout]
                if cache == "cold":
                    if layout not in flushed:
                        B.flush(files)
                        flushed.add(layout)
                    B.drop_cache(files)
                spec.update(method=method, mode=mode, files=files, ref=refs[layout],
                            second=second)
            rec = spawn(spec, args.timeout)
            rec.update(role=role, method=method, layout=layout, mode=mode, cache=cache, run=i + 1)
            doc["runs"].append(rec)
            C.progress(f"  {label}: " + _one_line(rec))
            if args.verbose:
                C.progress("    " + json.dumps({k: v for k, v in rec.items() if k != "staging"}))
            if rec.get("error") or (role == "load" and rec.get("first_s", 0) > args.budget):
                if i + 1 < runs:
                    doc["skipped"].append(f"{label}: no further runs ("
                                          + ("error" if rec.get("error")
                                             else f"first call over --budget {args.budget:g} s") + ")")
                break
    # 3. the summary
    gpus = [r["gpu"] for r in doc["runs"] if r.get("gpu")]
    doc["environment"]["gpu"] = gpus[0] if gpus else None
    doc["environment"]["torch_in_runs"] = next((r["torch"] for r in doc["runs"] if r.get("torch")), None)
    doc["cells"] = summarize(doc)
    print_table(doc)
    print_side_by_side(doc)
    doc["goals"] = goals(doc, device)
    print_goals(doc["goals"])
    for name, lay in doc["layouts"].items():
        print(f"layout {name}: {lay['files']} file(s), {lay['tensors']} tensors, {lay['bytes'] / 1e9:.2f} GB")
    print("second call: after the check of the first result, `del first` (its tensors back in "
          "torch's caching allocator, no empty_cache) and gc.collect() (the check's garbage); in a "
          "cold run it meets the page cache the first call left")
    print("wall: spawn -> first call done + exit, bench_load's import for the peers taken out; "
          "import: the loader's module after torch")
    for note in doc["notes"]:
        print("note:", note)
    for s in doc["skipped"]:
        print("skipped:", s)
    doc["seconds"] = time.monotonic() - started
    print(f"total {doc['seconds']:.0f} s")
    C.write_json(args.json, doc)
    # Exit 1 on any result that is not bit-exact, or an error of ours (a
    # peer's error is in the table, not a failure of this benchmark).
    inexact = [r for r in doc["runs"] if r.get("verified_first", "ok") != "ok"
               or r.get("verified_second", "ok") != "ok"]
    ours_failed = [r for r in doc["runs"] if r.get("error") and r["method"] in (None, "instant_staging")]
    return 1 if inexact or ours_failed else 0


def _one_line(rec):
    if rec.get("error"):
        return "ERROR " + rec["error"][:200] + ("\n" + rec["stderr"][-800:] if rec.get("stderr") else "")
    if rec["role"] == "start":
        return (f"wall {rec['wall_total_s']:.2f} s, torch {rec['torch_s']:.2f}, "
                f"CUDA start {rec['cuda_start_s']:.3f} s")
    parts = [f"wall {rec['wall_s']:.2f} s", f"torch {rec['torch_s']:.2f}", f"import {rec['import_s']:.3f}"]
    if "cuda_start_s" in rec:
        parts.append(f"CUDA {rec['cuda_start_s']:.3f}")
    parts.append(f"first {rec['first_s']:.3f}")
    parts.append(f"second {rec['second_s']:.3f}" if "second_s" in rec else "no second")
    checks = {rec.get("verified_first"), rec.get("verified_second", "ok")}
    parts.append("bit-exact" if checks == {"ok"} else f"CHECK: {rec.get('verified_first')} / "
                 f"{rec.get('verified_second')}")
    return ", ".join(parts)


def _med(recs, key):
    return C.median([r.get(key) for r in recs])


def summarize(doc):
    """One record per (method, layout, mode, cache): medians over its runs."""
    start = [r for r in doc["runs"] if r["role"] == "start" and not r.get("error")]
    start_alone = _med(start, "cuda_start_s")
    cells, seen = [], {}
    for r in doc["runs"]:
        if r["role"] != "load":
            continue
        key = (r["method"], r["layout"], r["mode"], r["cache"])
        seen.setdefault(key, []).append(r)
    for (method, layout, mode, cache), recs in seen.items():
        ok = [r for r in recs if not r.get("error")]
        nbytes = doc["layouts"][layout]["bytes"]
        cell = {"method": method, "layout": layout, "mode": mode, "cache": cache, "runs": len(recs),
                "errors": [r["error"] for r in recs if r.get("error")]}
        for k in ("wall_s", "wall_total_s", "startup_s", "torch_s", "import_s", "harness_s",
                  "first_s", "second_s", "exit_s", "cuda_start_s", "verify_s"):
            cell[k] = _med(ok, k)
        cell["first_all"] = [r.get("first_s") for r in ok]
        cell["second_all"] = [r.get("second_s") for r in ok]
        diffs = [r["first_s"] - r["second_s"] for r in ok if "second_s" in r]
        cell["first_minus_second_s"] = C.median(diffs)
        cell["gbps_first"] = nbytes / cell["first_s"] / 1e9 if cell["first_s"] else None
        cell["gbps_second"] = nbytes / cell["second_s"] / 1e9 if cell["second_s"] else None
        cell["start_alone_s"] = start_alone
        checks = {r.get(k) for r in ok for k in ("verified_first", "verified_second") if r.get(k)}
        cell["bit_exact"] = None if not checks else checks == {"ok"}
        cell["check_failures"] = sorted(c for c in checks if c != "ok")
        stag = [r.get("staging") for r in ok if r.get("staging")]
        cell["staging"] = _staging_text(stag[-1]) if stag else None
        cells.append(cell)
    doc["start_alone_s"] = start_alone
    doc["start_alone_all"] = [r.get("cuda_start_s") for r in start]
    doc["start_torch_s"] = _med(start, "torch_s")
    doc["start_wall_s"] = _med(start, "wall_total_s")

    def order(c):
        return (c["cache"] != "hot", LAYOUTS.index(c["layout"]), MODES.index(c["mode"]),
                METHODS.index(c["method"]))
    return sorted(cells, key=order)


def _staging_text(staging):
    if isinstance(staging, str):
        return staging
    out = []
    for b in staging:
        huge = b.get("huge_bytes")
        out.append(f"{b['kind']} {C.fmt_size(b['size'])}"
                   + (f", huge pages {C.fmt_size(huge)}" if huge is not None else ", huge pages ?"))
    return "; ".join(out)


def print_table(doc):
    start = doc["start_alone_s"]
    if doc["start_alone_all"]:
        print(f"\nCUDA start alone (fresh process: import torch, then torch.cuda.init() + one tensor "
              f"+ sync): median {start:.3f} s, runs " + ", ".join(f"{x:.3f}" for x in doc["start_alone_all"])
              + f"; import torch {C.fmt(doc['start_torch_s'], '.2f')} s, process "
              f"{C.fmt(doc['start_wall_s'], '.2f')} s")
    rows = []
    for c in doc["cells"]:
        if not c["first_s"]:
            rows.append([c["layout"], c["cache"], c["mode"], c["method"]] + ["-"] * 9
                        + ["ERROR: " + (c["errors"][0][:70] if c["errors"] else "?")])
            continue
        exact = {None: "n/a", True: "yes",
                 False: "NO: " + "; ".join(c["check_failures"])[:60]}[c["bit_exact"]]
        cuda = c["cuda_start_s"] if c["mode"] == "cuda" else None
        rows.append([c["layout"], c["cache"], c["mode"], c["method"],
                     C.fmt(c["wall_s"], ".2f"), C.fmt(c["torch_s"], ".2f"), C.fmt(c["import_s"], ".3f"),
                     C.fmt(c["first_s"]), C.fmt(c["second_s"]),
                     C.fmt(c["gbps_first"], ".2f"), C.fmt(c["gbps_second"], ".2f"),
                     C.fmt(c["first_minus_second_s"]),
                     C.fmt(cuda) if cuda is not None else "(" + C.fmt(c["start_alone_s"]) + ")",
                     f"{exact}, n={len(c['first_all'])}"])
    print("\nseconds, median of the runs (n); CUDA start: in that process (mode cuda), "
          "(alone) for mode none")
    print(C.table(["layout", "cache", "mode", "method", "wall", "torch", "import", "first", "second",
                   "GB/s 1st", "GB/s 2nd", "1st-2nd", "CUDA start", "bit-exact"], rows))
    staging = {}
    for c in doc["cells"]:
        if c["staging"]:
            staging.setdefault(c["staging"], []).append(f"{c['layout']} {c['cache']} {c['mode']}")
    for text, where in staging.items():
        print(f"instant_staging's kept staging buffer ({', '.join(where)}): {text}")


def print_side_by_side(doc):
    """Per layout, cache and mode: each peer's first call and process over ours."""
    lines = []
    by = {}
    for c in doc["cells"]:
        if c["first_s"]:
            by.setdefault((c["layout"], c["cache"], c["mode"]), {})[c["method"]] = c
    for (layout, cache, mode), cells in by.items():
        ours = cells.get("instant_staging")
        peers = [m for m in METHODS if m in cells and m != "instant_staging"]
        if not ours or not peers:
            continue
        parts = [f"{m} {cells[m]['first_s'] / ours['first_s']:.1f}x / "
                 f"{cells[m]['wall_s'] / ours['wall_s']:.2f}x" for m in peers]
        lines.append(f"  {layout} {cache} {mode}: ours first {ours['first_s']:.3f} s, wall "
                     f"{ours['wall_s']:.2f} s; " + ", ".join(parts))
    if lines:
        print("\nPeers' time over ours (first call / process wall):")
        print("\n".join(lines))


def goals(doc, device):
    """Issue 19's fresh-process goals, on what was measured."""
    gpu = device.startswith("cuda")
    out = []

    def add(name, ok, detail):
        status = "SKIP" if ok is None or not gpu else ("PASS" if ok else "FAIL")
        out.append({"name": name, "status": status, "detail": detail + ("" if gpu else " (no GPU)")})
    ours = {(c["layout"], c["mode"]): c for c in doc["cells"]
            if c["method"] == "instant_staging" and c["cache"] == "hot" and c["first_s"]}
    c = ours.get(("dense", "cuda"))
    add("dense, CUDA started first: first call >= 40 GB/s", c and c["gbps_first"] >= 40,
        f"{C.fmt(c and c['gbps_first'], '.2f')} GB/s")
    for layout in LAYOUTS:
        c = ours.get((layout, "cuda"))
        if c:
            ratio = c["first_s"] / c["second_s"] if c["second_s"] else None
            add(f"{layout}, CUDA started first: first within 1.15x of second",
                ratio and ratio <= 1.15, f"{C.fmt(ratio, '.2f')}x ({C.fmt(c['first_s'])} vs "
                f"{C.fmt(c['second_s'])} s)")
    start = doc["start_alone_s"]
    for layout in LAYOUTS:
        c = ours.get((layout, "none"))
        if c:
            d = c["first_minus_second_s"]
            ok = None if d is None or start is None else d <= start + 0.03
            add(f"{layout}, nothing started: first - second <= CUDA start alone + 0.03 s", ok,
                f"{C.fmt(d)} s vs {C.fmt(start)} + 0.030 s")
    return out


def print_goals(items):
    if items:
        print("\nGoals (issue 19, fresh process, page cache hot):")
    for g in items:
        print(f"  {g['status']:4}  {g['name']}: {g['detail']}")


if __name__ == "__main__":
    sys.exit(main())
