#!/usr/bin/env python3
"""GPU proof for issue 10: a load through a user staging buffer, cancelled
mid-way and interrupted by interpreter exit, never crashes and leaves
nothing registered.

Phases (each on the real driver, device cuda:0):

  cancel   --rounds times: a consumer thread iterates iter_load(FILE,
           "cuda:0", staging=buf); after a random number of tensors a
           watchdog thread calls it.close().  Checks: every tensor yielded
           before the cancel equals the file's bytes; the consumer sees
           LoadError "cancelled" (or finished); buf.close() during the load
           raises BufferError; afterwards the buffer is reusable (a full
           load is bit-exact), torch.cuda.memory_allocated() is back to its
           baseline, no descriptor is left open, and after buf.close() the
           driver reports every segment start unregistered (pointer_type 0).
  exit     --exits times, in a child interpreter: a daemon thread loads
           through a user staging buffer (and once through the loader's own
           buffer) and the main thread returns mid-load.  An atexit hook
           registered before instant_staging is imported runs last: it
           checks that the user buffer was released and that the driver
           reports its segments unregistered.  Checks: exit status 0, no
           "Fatal"/"terminate"/"Segmentation" on stderr, "released" printed.

    python benchmarks/cancel_gpu.py [--size 1GiB] [--rounds 20] [--exits 5]
        [--staging 256MiB] [--chunk-size 8MiB] [--json PATH] [--simulate]

Exit status 0 when every check passed, 1 otherwise.  --simulate runs the
same phases on the SimulatedRuntime, loading to the CPU (the script's
logic, without a GPU).
"""

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: F401  (also finds an in-place build of the package)

import instant_staging as ist
from instant_staging._types import parse_size

MEMORY_UNREGISTERED = 0


def make_file(directory, size):
    import torch
    from safetensors.torch import save_file
    n = 64
    numel = max(1, size // n // 2)
    g = torch.Generator().manual_seed(0)
    tensors = {f"layer.{i:02d}": torch.randint(-30000, 30000, (numel,), generator=g,
                                               dtype=torch.int16).view(torch.bfloat16)
               for i in range(n)}
    path = os.path.join(directory, "cancel.safetensors")
    save_file(tensors, path)
    return path, tensors


def memory_type(rt, ptr):
    """What the driver says ``ptr`` is: 0 unregistered, 1 pinned host."""
    code, kind = rt.pointer_type(ptr)
    return kind if code == 0 else f"error {code}"


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def differing(got, expected):
    """Names of the loaded tensors whose bytes differ from the file's.

    A function, so that no loop variable of the caller keeps the last
    tensor alive (GPU memory is compared with the baseline afterwards).
    """
    import torch
    return [name for name, t in got.items()
            if not torch.equal(t.cpu().view(torch.int16), expected[name].view(torch.int16))]


def consume(it, got, errors, stop_after, seen):
    """The consumer thread of one round: collects tensors until cancelled."""
    from instant_staging.loader import LoadError
    try:
        for name, t in it:
            got[name] = t
            if len(got) > stop_after:
                seen.set()
    except LoadError as e:
        errors.append(str(e))
    finally:
        seen.set()


def phase_cancel(path, expected, args, out):
    import torch

    from instant_staging.loader import iter_load, load_file
    rt = runtime(args)
    buf = ist.StagingBuffer(args.staging, runtime=rt)
    starts = [buf.ptr + off for off, _ in buf.segments]
    all_starts = list(starts)
    gpu = not args.simulate

    def sync():
        if gpu:
            torch.cuda.synchronize()

    def allocated():
        return torch.cuda.memory_allocated() if gpu else 0

    sync()
    base_mem, base_fds = allocated(), open_fds()
    failures, cancelled, finished = [], 0, 0
    rng = random.Random(1)
    t0 = time.perf_counter()
    for r in range(args.rounds):
        it = iter_load(path, args.device, staging=buf, chunk_size=args.chunk_size)
        got, errors = {}, []
        stop_after = rng.randrange(0, len(expected))
        seen = threading.Event()

        consumer = threading.Thread(target=consume, args=(it, got, errors, stop_after, seen))
        consumer.start()
        seen.wait(60)
        try:
            buf.close()           # succeeds only once the load let go of it
        except BufferError:
            pass
        it.close()                                   # the watchdog's cancel
        consumer.join(60)
        if buf.closed:
            if errors or len(got) != len(expected):
                failures.append(f"round {r}: close() succeeded during an unfinished load")
            buf = ist.StagingBuffer(args.staging, runtime=rt)
            starts = [buf.ptr + off for off, _ in buf.segments]
            all_starts += starts
        if consumer.is_alive():
            failures.append(f"round {r}: consumer still running 60 s after the cancel")
            break
        if errors:
            cancelled += 1
            if "cancelled" not in errors[0]:
                failures.append(f"round {r}: {errors[0]}")
        else:
            finished += 1
        sync()
        failures += [f"round {r}: {name} differs from the file"
                     for name in differing(got, expected)]
        got.clear()
        del it
        gc.collect()
        if allocated() != base_mem:
            failures.append(f"round {r}: {allocated() - base_mem} bytes of "
                            "GPU memory left allocated")
    full = load_file(path, args.device, staging=buf, chunk_size=args.chunk_size)
    sync()
    bad = differing(full, expected)
    if bad:
        failures.append(f"reused buffer: {len(bad)} tensors differ after the cancels")
    del full
    gc.collect()
    registered = [memory_type(rt, p) for p in starts]
    buf.close()
    after = [memory_type(rt, p) for p in all_starts]
    if any(a != MEMORY_UNREGISTERED for a in after):
        failures.append(f"after close the driver still reports {after} at the segment starts")
    if open_fds() != base_fds:
        failures.append(f"{open_fds() - base_fds} descriptors left open")
    out["cancel"] = {"rounds": args.rounds, "cancelled": cancelled, "finished": finished,
                     "kind": buf.kind.name, "pointer_type_before_close": registered,
                     "pointer_type_after_close": after, "seconds": time.perf_counter() - t0,
                     "failures": failures}
    return not failures


EXIT_CHILD = """
import atexit, os, sys, threading
state = {}
def last():                       # registered first: runs after instant_staging's hooks
    buf = state.get("buf")
    if buf is None:
        print("no buffer", flush=True)
        return
    types = [state["rt"].pointer_type(p) for p in state["starts"]]
    ok = buf.closed and all(code == 0 and kind == 0 for code, kind in types)
    print("released" if ok else f"NOT released {types}", flush=True)
atexit.register(last)
import torch
import instant_staging as ist
from instant_staging.loader import iter_load
from instant_staging.runtime import real_runtime
from instant_staging.testing import SimulatedRuntime
path, own, chunk, staging = sys.argv[1], sys.argv[2] == "own", int(sys.argv[3]), int(sys.argv[4])
device = sys.argv[5]
rt = real_runtime() if device != "cpu" else SimulatedRuntime()
buf = None if own else ist.StagingBuffer(staging, runtime=rt)
if buf is not None:
    state.update(buf=buf, rt=rt, starts=[buf.ptr + o for o, _ in buf.segments])
started = threading.Event()
kept = []
def load():
    # The tensors stay referenced and the thread waits after the load: a
    # daemon thread caught by the finalization inside a torch call (a
    # tensor freed as the loop rebinds ``t``) makes torch abort the process
    # ("terminate called without an active exception", 1 exit in 100), which
    # is CPython's daemon-thread exit, not the loader's; the loader's own
    # calls park at exit (loader/_pipeline.pyx).
    for name, t in iter_load(path, device, staging=buf, chunk_size=chunk):
        kept.append(t)
        started.set()
    threading.Event().wait()
threading.Thread(target=load, daemon=True).start()
started.wait(60)
print("exiting mid-load", flush=True)
"""


def phase_exit(path, args, out):
    runs, failures = [], []
    for i in range(args.exits + 1):
        own = i == args.exits                       # the last run: the loader's own buffer
        t0 = time.perf_counter()
        env = dict(os.environ)           # the child imports this same instant_staging
        parent = os.path.dirname(os.path.dirname(os.path.abspath(ist.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (parent, env.get("PYTHONPATH", "")) if p)
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(EXIT_CHILD), path,
                            "own" if own else "user", str(args.chunk_size), str(args.staging),
                            args.device],
                           capture_output=True, text=True, timeout=300, env=env, check=False)
        bad = [w for w in ("Fatal", "terminate", "Segmentation", "Traceback") if w in r.stderr]
        ok = r.returncode == 0 and not bad and "exiting mid-load" in r.stdout and (
            own or r.stdout.strip().splitlines()[-1] == "released")
        runs.append({"own_buffer": own, "returncode": r.returncode, "stdout": r.stdout.strip(),
                     "stderr_tail": r.stderr[-500:], "seconds": time.perf_counter() - t0, "ok": ok})
        if not ok:
            failures.append(runs[-1])
    out["exit"] = {"runs": runs, "failures": len(failures)}
    return not failures


def runtime(args):
    """The real runtime, or the SimulatedRuntime with --simulate."""
    if args.simulate:
        from instant_staging.testing import SimulatedRuntime
        return SimulatedRuntime()
    from instant_staging.runtime import real_runtime
    return real_runtime()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=parse_size, default=1 << 30)
    p.add_argument("--staging", type=parse_size, default=256 << 20)
    p.add_argument("--chunk-size", type=parse_size, default=8 << 20)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--exits", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--simulate", action="store_true")
    args = p.parse_args()
    args.device = "cpu" if args.simulate else "cuda:0"
    import torch
    if not args.simulate and not torch.cuda.is_available():
        print("cancel_gpu: no GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    name = "SIMULATED (cpu)" if args.simulate else torch.cuda.get_device_name(0)
    out = {"device": name, "size": args.size, "staging": args.staging,
           "chunk_size": args.chunk_size}
    with tempfile.TemporaryDirectory() as d:
        path, expected = make_file(d, args.size)
        ok = phase_cancel(path, expected, args, out)
        ok = phase_exit(path, args, out) and ok
    out["ok"] = ok
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
