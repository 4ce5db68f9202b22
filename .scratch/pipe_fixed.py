"""Scratch: the pipeline's fixed cost and streaming rate on the MoE shard."""
import os, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_load as B
import torch
from instant_staging.loader import _run as R, _staging_pool
from instant_staging.loader._checkpoint import _Checkpoint
from instant_staging.loader._target import _TorchTarget
from instant_staging.loader._pipeline import Pipeline, Plan, SKIP_COPY, SKIP_READ

d = B.DEFAULT_DIR
paths = B.generate(d, dict(B.layouts(["moe"], 1, 1 << 30))["moe"])
torch.cuda.init(); torch.empty(1, device="cuda:0")
ck = _Checkpoint(paths); tgt = _TorchTarget(torch, "cuda:0")
dtypes = [tgt.check(t, ck.paths[i]) for i, t in ck.entries]
buf = _staging_pool.own(0, 64 * (8 << 20), 8 << 20)

def run(plan, dsts, threads=16, depth=32, skip=0):
    pipe = Pipeline(plan, threads=threads, staging=buf, depth=depth, device=0, skip=skip)
    t0 = time.perf_counter(); first = None
    pipe.start(dsts)
    while True:
        fin, _, exited, failed = pipe.wait(0.05)
        if fin and first is None: first = time.perf_counter() - t0
        if exited or failed: break
    t1 = time.perf_counter() - t0
    pipe.close(); t2 = time.perf_counter() - t0
    torch.cuda.synchronize()
    assert not failed, pipe.error()
    return t1, t2, first

def best(label, n, fn):
    rs = [fn() for _ in range(n)]
    t1, t2, first = min(rs)
    print(f"{label:40s} exit {t1*1e3:7.2f} ms  closed {t2*1e3:7.2f}  first {first*1e3 if first else -1:6.2f}  "
          f"median exit {sorted(r[0] for r in rs)[n//2]*1e3:7.2f}")
    return t1

# (a) fixed cost: 16 chunks of 4 KiB, one per thread
fd, t = ck.fds[0], ck.entries[0][1]
blk = torch.empty(1 << 20, dtype=torch.uint8, device="cuda:0")
for thr in (1, 4, 16):
    tiny = Plan([(fd, t.begin, t.begin + 4096 * thr)], 4096, packed=True)
    best(f"fixed: {thr} threads x one 4 KiB chunk", 15, lambda: run(tiny, [blk.data_ptr()], threads=thr, depth=thr))
# (b) MoE streaming
nbytes = ck.total_bytes
for chunk in (4 << 20, 8 << 20, 2 << 20):
    start = R._plan(ck, tgt, dtypes, chunk, None, True)
    blocks = tgt.allocate_blocks(start.runs, ck.entries, dtypes)
    dsts = [p for r, b in blocks.items() for _, p in tgt.place(start.runs[r], b, ck.entries, dtypes)]
    for depth in ((32, 64) if chunk <= 4 << 20 else (16, 32)):
        for skip, name in ((0, "full"), (SKIP_READ, "copies only"), (SKIP_COPY, "reads only")):
            if skip and depth != 32: continue
            e = best(f"moe chunk {chunk>>20}MiB depth {depth} {name}", 5,
                     lambda: run(start.plan, dsts, depth=depth, skip=skip))
            print(f"{'':40s} {nbytes / e / 1e9:.1f} GB/s")
    del blocks
x = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
for _ in range(3):
    torch.cuda.synchronize(); t0 = time.perf_counter(); x.copy_(h, non_blocking=True); torch.cuda.synchronize()
    print(f"one {nbytes/1e9:.2f} GB pinned copy: {(time.perf_counter()-t0)*1e3:.2f} ms")
R._RAMP = 0
for ramp in (0, 16, 32):
    start = R._plan(ck, tgt, dtypes, 4 << 20, None, True)
    start2 = Plan([(ck.fds[i], t.begin, t.end) for i, t in ck.entries], 4 << 20, packed=True,
                  joins=R._blocks.joined(start.runs), ramp=ramp)
    blocks = tgt.allocate_blocks(start.runs, ck.entries, dtypes)
    dsts = [p for r, b in blocks.items() for _, p in tgt.place(start.runs[r], b, ck.entries, dtypes)]
    e = best(f"moe 4MiB depth 32 ramp {ramp} ({start2.n_chunks} chunks)", 7, lambda: run(start2, dsts))
    print(f"{'':40s} {nbytes / e / 1e9:.1f} GB/s")
    del blocks
