#!/usr/bin/env python3
"""Reload in place (issue 42): a checkpoint written into tensors already on
the device (``instant_staging.loader.load_into``) against loading it afresh
(``load_file``), and transformers' ``reload_weights`` against
``model.load_state_dict(safetensors.torch.load_file(...))``.

One process, one run, the same files for everyone (bench_load.py's layouts,
generated there once, random bytes: --dir, --layouts; default dense (16 GB
Llama-3-8B) and finemoe (4,680 tensors)).  For each layout:

  load_file      instant_staging.loader.load_file(files, device): new tensors
  load_into      the same bytes written into tensors already on the device,
                 one torch allocation per tensor made in reading order
                 (torch.empty_like, as transformers' from_pretrained leaves a
                 model's parameters: the caching allocator cuts tensors of at
                 most 1 MiB two to a 2 MiB segment and those up to 10 MiB
                 from 20 MiB segments, so some lie back to back in one
                 segment and the loader copies those as one where a chunk
                 holds them; which ones depends on the allocator's state)
  load_into-flat the same into views of one flat tensor per file laid out
                 in reading order (packed parameters, a model loaded with
                 views): every destination back to back, the best case

Before each layout's rows it prints "back to back": of the tensors (in
reading order) that follow the one before in the file, how many have a
destination right after that one's (per-tensor destinations; the flat
ones all do).  Only those inside one device allocation are copied as one
(a copy spanning two allocations is no valid range for the driver), so it
is an upper bound on the merges.

and, on the dense layout, a LlamaForCausalLM of its names and shapes (built
on the device, no init):

  load_state_dict  model.load_state_dict(safetensors.torch.load_file(f, device) for each shard)
  reload_weights   instant_staging.integrations.transformers.reload_weights(model, dir)

Each is timed --repeat times with the page cache hot (best and median).
Each load_into row also gives "version_bump": the best time of the one
call load_into makes to bump its destinations' autograd versions (part of
the row's time), for fine-grained MoE's thousands of tensors.  "before
copies" (load_file and load_into rows) is the best, over --repeat more
calls, of the load's open and prepare phases (its LoadReport's): from the
call until the readers start, the host's work per tensor before the first
copy (load_into's checks of every destination and its addresses: issue
54, 4).
"device alloc" is torch's allocator peak during the call minus what was
allocated before it (``allocated_bytes.all.peak`` after
``reset_peak_memory_stats``); "staging" is the load's slots
(io_depth x chunk_size, pinned host memory), which a reload should not
exceed on the device.  "exact" compares every tensor's bytes with a
load_file of the checkpoint (the model's parameters likewise).

    python benchmarks/bench_reload.py --json reload.json
    python benchmarks/bench_reload.py --quick          # CPU smoke test, layouts 64x smaller

The goals (issue 42): load_into >= 0.95x load_file's speed, device alloc <=
staging, exact; reload_weights >= 5x load_state_dict, exact.  Issue 54's:
load_into >= 0.95x load_file on finemoe, >= 0.98x on dense.
"""

import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C
import bench_load as BL

from instant_staging import defaults
from instant_staging.loader import iter_load, load_file, load_into


def sync(torch, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_alloc(torch, device, call):
    """``(seconds, bytes allocated on the device at the peak of call())``."""
    gc.collect()
    sync(torch, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_stats(device)["allocated_bytes.all.current"]
    t0 = time.perf_counter()
    out = call()
    sync(torch, device)
    seconds = time.perf_counter() - t0
    peak = None
    if device.type == "cuda":
        peak = torch.cuda.memory_stats(device)["allocated_bytes.all.peak"] - before
    return seconds, peak, out


def timed(torch, device, call, repeat, keep=False):
    """``{seconds: [...], alloc: max bytes}`` of ``repeat`` calls."""
    times, allocs = [], []
    for _ in range(repeat):
        seconds, peak, out = device_alloc(torch, device, call)
        times.append(seconds)
        allocs.append(peak)
        if not keep:
            del out
    return {"seconds": times, "alloc": None if allocs[0] is None else max(allocs)}


def staging_bytes(chunk_size=None, threads=None):
    """The slots a load's own staging buffer holds with the defaults."""
    threads = defaults.reader_threads(threads)
    return defaults.io_depth_for(None, threads) * (chunk_size or defaults.CHUNK_SIZE)


def same(torch, got, want):
    return all(torch.equal(got[k].reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8))
               for k in want) and set(got) == set(want)


def record(layout, method, nbytes, m, exact, staging):
    best, median = min(m["seconds"]), statistics.median(m["seconds"])
    return {"layout": layout, "method": method, "bytes": nbytes, "seconds": m["seconds"],
            "best": best, "median": median, "gbps_best": nbytes / best / 1e9,
            "device_alloc": m["alloc"], "staging": staging, "bit_exact": exact}


def reading_order(paths):
    """``[(file, name), ...]`` in the order the loader reads them."""
    from instant_staging.loader import Checkpoint
    out = []
    for i, path in enumerate(paths):
        with Checkpoint.open(path) as ck:
            out += [(i, n) for n in ck.names()]
    return out


def back_to_back(order, dests):
    """``(tensors whose destination follows the one before's, candidates)``:
    candidates are the tensors of ``order`` after another of the same file."""
    follow = candidates = 0
    for (fa, a), (fb, b) in zip(order, order[1:]):
        if fa != fb or not dests[a].nbytes or not dests[b].nbytes:
            continue
        candidates += 1
        follow += dests[b].data_ptr() == dests[a].data_ptr() + dests[a].nbytes
    return follow, candidates


def flat_destinations(torch, device, order, reference):
    """Views of one flat tensor per file, in reading order."""
    dests = {}
    for i in sorted({f for f, _ in order}):
        names = [n for f, n in order if f == i]
        flat = torch.empty(sum(reference[n].nbytes for n in names), dtype=torch.uint8, device=device)
        at = 0
        for n in names:
            t = reference[n]
            dests[n] = flat[at:at + t.nbytes].view(t.dtype).view(t.shape)
            at += t.nbytes
    return dests


def bench_layout(torch, device, name, paths, repeat):
    reference = load_file(paths, device, views=False)
    nbytes = sum(t.nbytes for t in reference.values())
    order = reading_order(paths)
    rows = []
    m = timed(torch, device, lambda: load_file(paths, device), repeat)
    rows.append(record(name, "load_file", nbytes, m, True, staging_bytes()))
    rows[-1]["before_copies"] = before_copies(torch, device, lambda: file_report(paths, device),
                                              repeat)
    for method, make in (("load_into", lambda: {n: torch.empty_like(reference[n]) for _, n in order}),
                         ("load_into-flat", lambda: flat_destinations(torch, device, order, reference))):
        rows.append(bench_into(torch, device, name, method, paths, order, make(), reference,
                               repeat))
    return rows         # (the tensors go with the frame)


def bench_into(torch, device, name, method, paths, order, dests, reference, repeat):
    follow, candidates = back_to_back(order, dests)
    print(f"  {method}: {follow} of {candidates} tensors back to back in memory after the "
          f"one before in the file", flush=True)
    nbytes = sum(t.nbytes for t in reference.values())
    m = timed(torch, device, lambda: load_into(paths, dests), repeat)
    for t in dests.values():
        t.zero_()
    load_into(paths, dests)
    row = record(name, method, nbytes, m, same(torch, dests, reference), staging_bytes())
    row["back_to_back"] = [follow, candidates]
    row["before_copies"] = before_copies(torch, device, lambda: load_into(paths, dests), repeat)
    row["version_bump"] = version_bump_seconds(torch, dests, repeat)
    print(f"  {method}: autograd version bump of {len(dests)} destinations (in each load_into "
          f"above): best {row['version_bump'] * 1e3:.3f} ms", flush=True)
    return row


def file_report(paths, device):
    """The LoadReport of load_file's load (``iter_load``, every tensor kept)."""
    with iter_load(paths, device) as it:
        out = dict(it)
    del out
    return it.report


def before_copies(torch, device, call, repeat):
    """Best seconds of a load's open and prepare phases (its LoadReport's:
    from the call to the readers' start, before any byte is copied), over
    ``repeat`` more calls: the host's work per tensor that the copies wait
    for (issue 54, 4: load_into's checks and addresses)."""
    best = None
    for _ in range(max(repeat, 3)):
        gc.collect()
        sync(torch, device)
        phases = call().phases
        seconds = phases["open"] + phases["prepare"]
        best = seconds if best is None else min(best, seconds)
    return best


def version_bump_seconds(torch, dests, repeat):
    """Best seconds of the call load_into makes at its end to bump every
    destination's autograd version (issue 53): its share of the rows above."""
    from torch.autograd.graph import increment_version
    tensors = list(dests.values())
    best = None
    for _ in range(max(repeat, 5)):
        t0 = time.perf_counter()
        increment_version(tensors)
        seconds = time.perf_counter() - t0
        best = seconds if best is None else min(best, seconds)
    return best


def bench_model(torch, device, paths, scale, repeat):
    """transformers: a LlamaForCausalLM of the dense layout's shapes."""
    try:
        import safetensors.torch as st
        import transformers

        from instant_staging.integrations.transformers import reload_weights
    except ImportError as e:
        print(f"transformers rows skipped: {e}")
        return []
    V, H, I, KV = 128256 // scale, 4096 // scale, 14336 // scale, 1024 // scale
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=I,
                                      num_hidden_layers=32, num_attention_heads=32,
                                      num_key_value_heads=KV // (H // 32), tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model = model.to_empty(device=device).eval()
    nbytes = sum(p.nbytes for p in model.parameters())
    # (the model's weights and the checkpoint must be the same files: the
    # dense layout's, whose names and shapes are this model's)
    reference = load_file(paths, device, views=False)

    def baseline():
        state = {}
        for path in paths:
            state.update(st.load_file(path, device=str(device)))
        model.load_state_dict(state)
        return None
    rows = []
    m = timed(torch, device, baseline, repeat)
    exact = same(torch, dict(model.state_dict()), reference)
    rows.append(record("dense-model", "load_state_dict", nbytes, m, exact, None))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    m = timed(torch, device, lambda: reload_weights(model, paths), repeat)
    exact = (same(torch, dict(model.state_dict()), reference)
             and ptrs == {k: v.data_ptr() for k, v in model.state_dict().items()})
    rows.append(record("dense-model", "reload_weights", nbytes, m, exact, staging_bytes()))
    return rows


def print_table(rows):
    def size(n):
        return "-" if n is None else C.fmt_size(n)
    base = {r["layout"]: r["best"] for r in rows if r["method"] in ("load_file", "load_state_dict")}
    print()
    def before(r):
        return "-" if r.get("before_copies") is None else f"{r['before_copies'] * 1e3:.2f}"
    print(C.table(["layout", "method", "best s", "median s", "GB/s", "vs base", "before copies ms",
                   "device alloc", "staging", "exact"],
                  [[r["layout"], r["method"], f"{r['best']:.3f}", f"{r['median']:.3f}",
                    f"{r['gbps_best']:.2f}", f"{base[r['layout']] / r['best']:.2f}x", before(r),
                    size(r["device_alloc"]), size(r["staging"]), r["bit_exact"]] for r in rows]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_layout_options(ap, layouts="dense,finemoe",
                         layouts_help="bench_load.py's: dense, moe, finemoe, ...",
                         dir_default=BL.DEFAULT_DIR, dir_help="where checkpoints live (local disk)")
    ap.add_argument("--no-model", action="store_true", help="skip the transformers rows")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    import torch
    device, scale, repeat = BL.start(torch, args, "bench_reload")
    rows, layouts = [], {}
    for name, paths in BL.prepared(args.layouts.split(","), args.dir, scale, layouts):
        rows += bench_layout(torch, device, name, paths, repeat)
        if name == "dense" and not args.no_model:
            rows += bench_model(torch, device, paths, scale, repeat)
    print_table(rows)
    C.write_json(args.json, {"environment": BL.environment(torch, device), "layouts": layouts,
                             "results": rows})
    return 0 if all(r["bit_exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
