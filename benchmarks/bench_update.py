#!/usr/bin/env python3
"""RL weight updates (issue 56): a versioned update into a running model
(``instant_staging.loader.VersionedWeights.update``, every check before the
first write) against loading the checkpoint afresh (``load_file``), a 2%
sparse delta, the rollback copy, and the digests computed on the device.

One process, the same files for everyone (bench_load.py's layouts,
generated there once: --dir, --layouts; default dense (16 GB Llama-3-8B)
and finemoe (4,680 tensors)).  For each layout, the model is the
checkpoint loaded once (one allocation per tensor), then:

  load_file          load_file(files, device): new tensors (the baseline)
  update full        holder.update(files, version=...): verified, in place
  update full+rb     the same with rollback=True (a host copy of every
                     tensor before the first write: the cost of a true rollback)
  update full+dg     the same with return_digests=True (device_digest of
                     every tensor written, on the device)
  update delta 2%    a delta (save_delta) changing 2% of every tensor's
                     elements, sparse, applied over its base (its default
                     rollback on: the old values at its positions kept)
  digests            device_digests of every tensor (what a trainer's check costs)

Each is timed --repeat times with the page cache hot (best, median).
"device alloc": torch's allocator peak during the call minus what was
allocated before it; "vs load_file": load_file's best / the row's best.

    python benchmarks/bench_update.py --json update.json
    python benchmarks/bench_update.py --quick          # CPU smoke test, layouts 64x smaller

The goals (issue 56): update full >= 0.95x load_file with 0 bytes of new
device memory beyond the staging buffer (digests included: update
full+dg), update delta 2% <= 10% of update full's time.
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C
import bench_load as BL
from bench_reload import same, staging_bytes, timed

from instant_staging.loader import VersionedWeights, device_digests, load_file, save_delta

DELTA_FRACTION = 0.02


def row(layout, method, nbytes, m, exact, base=None):
    best, median = min(m["seconds"]), statistics.median(m["seconds"])
    C.progress(f"  {layout} {method}: best {best:.3f} s, median {median:.3f} s, exact {exact}")
    return {"layout": layout, "method": method, "bytes": nbytes, "seconds": m["seconds"],
            "best": best, "median": median, "gbps_best": nbytes / best / 1e9,
            "device_alloc": m["alloc"], "staging": staging_bytes(), "exact": exact,
            "vs_load_file": None if base is None else base / best}


def bench_layout(torch, device, name, paths, repeat, directory):
    model = load_file(paths, device, views=False)
    reference = {n: t.clone() for n, t in model.items()}
    nbytes = sum(t.nbytes for t in model.values())
    rows = []
    m = timed(torch, device, lambda: load_file(paths, device), repeat)
    base = min(m["seconds"])
    rows.append(row(name, "load_file", nbytes, m, True))
    held = VersionedWeights(model, version="v0")
    counter = [0]

    def update(**kw):
        counter[0] += 1
        return held.update(paths, version=f"v{counter[0]}", **kw)
    for method, kw in (("update full", {}), ("update full+rb", {"rollback": True}),
                       ("update full+dg", {"return_digests": True})):
        for t in model.values():
            t.zero_()
        m = timed(torch, device, lambda kw=kw: update(**kw), repeat)
        rows.append(row(name, method, nbytes, m, same(torch, model, reference), base))
    # a 2% delta over the checkpoint's version
    new = C.changed(torch, reference, DELTA_FRACTION)
    delta = os.path.join(directory, f"{name}.delta.safetensors")
    info = save_delta(new, reference, delta, base_version="base", version="next")
    delta_bytes = os.path.getsize(delta)
    BL.warm([delta])

    def apply_delta():
        held = VersionedWeights(model, version="base")     # (a delta writes new values: idempotent)
        return held.update(delta, version="next")
    m = timed(torch, device, apply_delta, repeat)
    r = row(name, f"update delta {DELTA_FRACTION:.0%}", nbytes, m, same(torch, model, new), base)
    r["delta_file_bytes"] = delta_bytes
    r["sparse_tensors"] = len(info.sparse)
    full = next(x for x in rows if x["method"] == "update full")["best"]
    r["vs_update_full"] = r["best"] / full
    rows.append(r)
    os.unlink(delta)
    m = timed(torch, device, lambda: device_digests(model), repeat)
    rows.append(row(name, "digests", nbytes, m, True, base))
    return rows


def print_table(rows):
    def size(n):
        return "-" if n is None else C.fmt_size(n)
    print()
    print(C.table(["layout", "method", "best s", "median s", "GB/s", "vs load_file", "device alloc",
                   "staging", "exact"],
                  [[r["layout"], r["method"], f"{r['best']:.3f}", f"{r['median']:.3f}",
                    f"{r['gbps_best']:.2f}",
                    "-" if r["vs_load_file"] is None else f"{r['vs_load_file']:.2f}x",
                    size(r["device_alloc"]), size(r["staging"]), r["exact"]] for r in rows]))
    for r in rows:
        if "vs_update_full" in r:
            print(f"{r['layout']}: the delta ({C.fmt_size(r['delta_file_bytes'])}, "
                  f"{r['sparse_tensors']} sparse tensors) took {r['vs_update_full']:.1%} of a "
                  "full update")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_layout_options(ap, layouts="dense,finemoe",
                         layouts_help="bench_load.py's: dense, moe, finemoe, ...",
                         dir_default=BL.DEFAULT_DIR, dir_help="where checkpoints live (local disk)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    import torch
    device, scale, repeat = BL.start(torch, args, "bench_update")
    rows, layouts = [], {}
    for name, paths in BL.prepared(args.layouts.split(","), args.dir, scale, layouts):
        rows += bench_layout(torch, device, name, paths, repeat, args.dir)
    print_table(rows)
    C.write_json(args.json, {"environment": BL.environment(torch, device), "layouts": layouts,
                             "results": rows})
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
