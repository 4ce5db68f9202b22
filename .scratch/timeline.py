"""Scratch: where a hot in-process load's time goes (steps wrapped, times
relative to the load_file call).  python .scratch/timeline.py [layouts] [repeat]"""
import os, sys, time, threading
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_load as B
import torch
from instant_staging import loader
from instant_staging.loader import _load as LL, _run as R, _target as T, _staging_pool as SP, _checkpoint as CK, _header as H

ev = []
t0 = [0.0]
def mark(name):
    ev.append((name, time.perf_counter() - t0[0], threading.current_thread().name[:12]))
def wrap(mod, attr, label=None):
    f = getattr(mod, attr); label = label or attr
    def w(*a, **k):
        mark(label + ">")
        try:
            return f(*a, **k)
        finally:
            mark(label + "<")
    setattr(mod, attr, w)
for a in ("_Checkpoint", "_for_cache", "_plan", "_begin_staging", "_TorchTarget", "resolve", "fault_plan", "_import_torch"):
    wrap(LL, a)
for a in ("_allocate_blocks", "_start", "_abandon"):
    wrap(R, a)
wrap(SP, "own", "pool.own"); wrap(SP, "give", "pool.give")
wrap(R._StagingStart, "take", "staging.take"); wrap(R._StagingStart, "_run", "staging.thread")
wrap(R, "_use_device")
for a in ("before_copies", "allocate_blocks", "reserve"):
    wrap(T._TorchTarget, a, "t." + a)
wrap(CK._Checkpoint, "resident", "ck.resident")
wrap(CK._Checkpoint, "_open", "ck.open")
orig_drive = R._drive
def drive(*a, **k):
    mark("drive>"); n = 0
    for x in orig_drive(*a, **k):
        if n == 0: mark("first")
        n += 1
        yield x
    mark("drive<")
R._drive = drive
orig_provide = None

layouts = (sys.argv[1] if len(sys.argv) > 1 else "moe,awq,dense").split(",")
repeat = int(sys.argv[2]) if len(sys.argv) > 2 else 5
d = B.DEFAULT_DIR; os.makedirs(d, exist_ok=True)
torch.cuda.init(); torch.empty(1, device="cuda:0")
ramps = [int(x) for x in os.environ.get("RAMPS", "0").split(",")]
for (name, files), ramp in [(l, r) for l in B.layouts(layouts, 1, 4 << 30) for r in ramps]:
    R._RAMP = ramp
    paths = B.generate(d, files)
    nbytes = sum(os.path.getsize(p) for p in paths)
    B.warm(paths)
    for i in range(repeat):
        torch.cuda.synchronize(); torch.cuda.empty_cache()
        ev.clear(); t0[0] = time.perf_counter()
        out = loader.load_file(paths if len(paths) > 1 else paths[0], "cuda:0")
        mark("returned"); torch.cuda.synchronize(); mark("sync")
        total = ev[-1][1]
        print(f"== {name} ramp {ramp} run {i}: {total*1e3:.1f} ms, {nbytes/total/1e9:.1f} GB/s")
        if i >= repeat - 1 and ramp == 0:
            for n_, t, th in ev:
                print(f"   {t*1e3:8.2f}  {th:12s} {n_}")
        del out
