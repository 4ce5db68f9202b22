import os, sys, time, resource
sys.path.insert(0, "benchmarks")
import bench_load as B
import torch
from instant_staging.loader import _run as R, _target as T
from instant_staging.loader._checkpoint import _Checkpoint
d = "/tmp/bench_small"
paths = B.generate(d, dict(B.layouts(["moe"], 16, 1 << 26))["moe"])
tgt = object.__new__(T._TorchTarget)
tgt.torch, tgt.device, tgt.dtype, tgt.mode, tgt.index, tgt._checked = torch, torch.device("cuda", 0), None, 1, 0, {}
for i in range(5):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt; t = time.perf_counter()
    ck = _Checkpoint(paths)
    f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt; t1 = time.perf_counter()
    dtypes = [tgt.check(t_, ck.paths[j]) for j, t_ in ck.entries]
    start = R._plan(ck, tgt, dtypes, 4 << 20, None, True)
    f2 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt; t2 = time.perf_counter()
    print(f"ck {f1-f0} faults {1e3*(t1-t):.2f} ms, plan {f2-f1} faults {1e3*(t2-t1):.2f} ms")
    ck.close(); del ck, start, dtypes
