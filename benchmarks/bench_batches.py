#!/usr/bin/env python3
"""Device memory beyond the model during a load, and what bounding it costs.

For each layout (bench_load.py's, generated once into --dir, page cache hot)
and each path, on one GPU, in one process:

  load_file       ``load_file(files, device)``; the model is the dict it returns
  iter_load       ``iter_load(files, device)``, every tensor kept
  vllm B          the vLLM load format's path (``integrations/vllm/_weights.py``
                  ``iter_weights`` with ``Options(batch_bytes=B)``): a model of
                  one device parameter per tensor is allocated first, and each
                  yielded tensor is copied into its parameter and dropped, as
                  vLLM's default weight loader does
  vllm B streamed the same with every batch yielded as its tensors finish, and
  vllm B whole    with every batch loaded whole before it is yielded (--modes;
                  the plain row takes ``_weights.whole``'s rule per batch)

Memory beyond the model: ``torch.cuda.max_memory_allocated()`` during the
load minus what was allocated before it, minus the model's bytes (load_file,
iter_load: the tensors returned; vllm: 0, the parameters being allocated
before).  torch's caching allocator is emptied between runs; times are with
``torch.cuda.synchronize()`` on both ends, best of --repeat.

    python benchmarks/bench_batches.py [--layouts dense,finemoe] [--batches 4GiB,1GiB,512MiB]
"""

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C
import bench_load as B

from instant_staging import loader
from instant_staging.defaults import WHOLE_BATCH_MEAN_BYTES
from instant_staging.integrations import _whole
from instant_staging.integrations.vllm._options import BATCH_BYTES, Options
from instant_staging.integrations.vllm._weights import iter_weights

# --modes: the rule's threshold (integrations/_whole.py's WHOLE_BATCH_MEAN_BYTES) each row runs with
MODES = {"rule": WHOLE_BATCH_MEAN_BYTES, "streamed": 0, "whole": 1 << 62}


def _fresh(torch):
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def run_load_file(torch, paths, device):
    base = _fresh(torch)
    t0 = time.perf_counter()
    out = loader.load_file(paths, device)
    torch.cuda.synchronize()
    t = time.perf_counter() - t0
    model = sum(v.numel() * v.element_size() for v in out.values())
    del out
    return t, torch.cuda.max_memory_allocated() - base - model


def run_iter_load(torch, paths, device):
    base = _fresh(torch)
    t0 = time.perf_counter()
    out = {}
    with loader.iter_load(paths, device) as it:
        for name, t_ in it:
            out[name] = t_
    torch.cuda.synchronize()
    t = time.perf_counter() - t0
    model = sum(v.numel() * v.element_size() for v in out.values())
    del out
    return t, torch.cuda.max_memory_allocated() - base - model


def run_vllm(torch, paths, device, batch_bytes, mode="rule"):
    _whole.WHOLE_BATCH_MEAN_BYTES = MODES[mode]
    params = {}
    for path in paths:
        with loader.Checkpoint.open(path) as ck:
            for name in ck.names():
                info = ck.info(name)
                params[name] = torch.empty(info.nbytes, dtype=torch.uint8, device=device)
    base = _fresh(torch)
    t0 = time.perf_counter()
    for name, tensor in iter_weights(paths, device, Options(batch_bytes=batch_bytes)):
        params[name].copy_(tensor.reshape(-1).view(torch.uint8))
        del tensor
    torch.cuda.synchronize()
    t = time.perf_counter() - t0
    beyond = torch.cuda.max_memory_allocated() - base
    params.clear()
    return t, beyond


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default="dense,finemoe")
    ap.add_argument("--batches", default="4GiB,1GiB,512MiB")
    ap.add_argument("--modes", default="rule", help="vllm rows: " + ", ".join(MODES))
    ap.add_argument("--dir", default=B.DEFAULT_DIR)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("bench_batches needs a GPU (torch sees none)")
    torch.ones(1, device=args.device)
    os.makedirs(args.dir, exist_ok=True)
    batches = C.parse_sizes(args.batches)
    unknown = sorted(set(args.modes.split(",")) - MODES.keys())
    if unknown:
        ap.error(f"unknown --modes {', '.join(unknown)}: choose from {', '.join(MODES)}")
    rows, doc = [], {"default_batch_bytes": BATCH_BYTES, "results": []}
    for name, files in B.layouts(args.layouts.split(","), 1, 0):
        paths = B.generate(args.dir, files)
        B.warm(paths)
        nbytes = sum(os.path.getsize(p) for p in paths)
        cases = [("load_file", run_load_file, ()), ("iter_load", run_iter_load, ())]
        cases += [(f"vllm {C.fmt_size(b)}" + ("" if mode == "rule" else f" {mode}"), run_vllm, (b, mode))
                  for b in batches for mode in args.modes.split(",")]
        for label, fn, extra in cases:
            fn(torch, paths, args.device, *extra)          # the staging buffer made, kept
            got = [fn(torch, paths, args.device, *extra) for _ in range(args.repeat)]
            best = min(t for t, _ in got)
            beyond = max(m for _, m in got)
            doc["results"].append({"layout": name, "path": label, "bytes": nbytes, "best_s": best,
                                   "gbps": nbytes / best / 1e9, "beyond_model_bytes": beyond})
            rows.append([name, label, f"{best:.3f}", f"{nbytes / best / 1e9:.1f}", C.fmt_size(beyond)])
            C.progress(" | ".join(rows[-1]))
    print(C.table(["layout", "path", "best s", "GB/s", "device memory beyond the model (max)"], rows))
    if args.json:
        C.write_json(args.json, doc)


if __name__ == "__main__":
    main()
