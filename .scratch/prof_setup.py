import os, sys, time, cProfile, pstats
sys.path.insert(0, "benchmarks")
import bench_load as B
import torch
from instant_staging.loader import _load as LL, _run as R, _target as T
from instant_staging.loader._checkpoint import _Checkpoint
d = "/tmp/bench_small"; os.makedirs(d, exist_ok=True)
which = sys.argv[1] if len(sys.argv) > 1 else "moe"
paths = B.generate(d, dict(B.layouts([which], 16, 1 << 26))[which])
tgt = object.__new__(T._TorchTarget)
tgt.torch, tgt.device, tgt.dtype, tgt.mode, tgt.index, tgt._checked = torch, torch.device("cuda", 0), None, 1, 0, {}
def setup():
    ck = _Checkpoint(paths)
    r = ck.resident()
    dtypes = [tgt.check(t, ck.paths[i]) for i, t in ck.entries]
    start = R._plan(ck, tgt, dtypes, 4 << 20, None, True)
    ck.close()
    return start
for _ in range(20): setup()
def timed(label, fn, n=50):
    best = 1e9
    for _ in range(n):
        t = time.perf_counter(); fn(); best = min(best, time.perf_counter() - t)
    print(f"{label:12s} {best*1e3:.3f} ms")
timed("setup", setup)
ck = _Checkpoint(paths)
timed("checkpoint", lambda: _Checkpoint(paths).close())
timed("resident", ck.resident)
timed("dtypes", lambda: [tgt.check(t, ck.paths[i]) for i, t in ck.entries])
dtypes = [tgt.check(t, ck.paths[i]) for i, t in ck.entries]
timed("plan", lambda: R._plan(ck, tgt, dtypes, 4 << 20, None, True))
from instant_staging.loader import _header as H
fd = ck.fds[0]
timed("read_header", lambda: H.read_header(fd, paths[0]))
size = os.fstat(fd).st_size; n = H.header_length(os.pread(fd, 8, 0), size, paths[0]); raw = os.pread(fd, n, 8)
timed("parse_header", lambda: H.parse_header(raw, paths[0], size))
timed("canonical", lambda: H._canonical(raw))
print("entries", len(ck.entries), "header bytes", n)
pr = cProfile.Profile(); pr.enable()
for _ in range(50): setup()
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(18)
import gc
gc.disable()
timed("parse nogc", lambda: H.parse_header(raw, paths[0], size))
timed("canon nogc", lambda: H._canonical(raw))
timed("setup nogc", setup)
gc.enable()
