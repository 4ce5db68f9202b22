#!/usr/bin/env python3
"""A ready transformers model: instant_staging's from_pretrained against
transformers' own, on a dense and a fine-grained MoE model, and
tensor-parallel slices through safe_open.

    python benchmarks/bench_transformers.py [--dir DIR] [--device cuda:0]
        [--models dense,finemoe] [--repeat 2] [--json PATH] [--quick] [--layers N]
        [--skip-phases] [--skip-slices] [--handovers] [--vllm-batches]

1. Each model of --models is written to DIR/<its folder> once (reused when
   .complete exists there) and read once so the page cache is hot:
   ``dense``, a Llama-3-8B-shaped checkpoint (hidden 4096, intermediate
   14336, 32 layers, 32 heads, 8 kv heads, vocab 128256, untied, bf16: 291
   tensors, 16.06 GB) in 4 shards with model.safetensors.index.json and
   config.json, random weights generated on the device (DIR/llama3-8b);
   ``finemoe``, a fine-grained MoE (Qwen3-MoE: hidden 1024, 24 layers of 64
   experts of moe_intermediate 512, 8 active, 16 heads of 64, 4 kv heads,
   vocab 32000, untied, bf16), built by transformers from its config on the
   device with its own random initialization and written by
   ``save_pretrained`` in shards of 2 GB: one tensor per expert matrix as
   such checkpoints cut them, 4,827 tensors of which 4,608 are 1 MiB, 5.09
   GB (DIR/qwen3-moe-fine).
2. transformers' ``from_pretrained(DIR, dtype=bfloat16, device_map=DEVICE)``
   (its fastest setting for one device: the model placed there as it is
   read, its own safetensors loading with its default thread pool) and
   ``instant_staging.integrations.transformers.from_pretrained(DIR,
   device=DEVICE, dtype=bfloat16)`` each build a ready model --repeat
   times (synchronized; best reported; on a GPU also the peak of memory
   reserved over what was reserved before the call); then every parameter and buffer of the two models is
   compared bit for bit.  The speedup must be >= 5x on the dense model
   (issue 20), >= 3x on the fine-grained MoE (issue 45).  ``route`` says
   which route ours took (its log line): "in place" (the checkpoint written
   into the parameters transformers makes, integrations/transformers/
   _inplace.py) or "state dict" (transformers handed the tensors);
   ``instant_staging_state_dict_s``, ours again with the in-place route off
   (``_inplace.IN_PLACE``), and its state compared too.  ``handover`` says
   how ours hands the tensors to transformers on the state-dict route
   (whole or streamed, integrations/_whole.py's rule).
2b. The two phases of ours, each timed alone (best of --repeat): ``read``,
   ``load_file(DIR, DEVICE)``; ``assemble``, transformers'
   ``from_pretrained(None, config=..., state_dict=<those tensors>,
   dtype=bfloat16, device_map=DEVICE)`` as ours calls it (allocator warm-up
   skipped), and ``assemble_with_warmup``, the same with transformers'
   warm-up left on (what the skip saves, in seconds and peak memory).
   Ours runs the two at once (the model is built while the tensors
   arrive), so its total is below their sum by about the meta build;
   ``sequential``, the two one after the other in one timing, is the
   route without that overlap.
3. TP=2, on the dense model: for every 2-D tensor, each rank's half along
   dimension 0 and along dimension 1 through ``instant_staging.loader.safe_open(...,
   device=DEVICE).get_slice(name)[...]``, compared with
   ``safetensors.safe_open``'s on the same device (values, shape, dtype,
   strides of the dimensions longer than 1); total time of each.

3b. With --handovers: ours again on the state-dict route, with every load handed to transformers
   whole, then streamed, whatever the rule says (its threshold set past
   every tensor's size, then to 0): what the rule chose against the other.

4. With --vllm-batches: the (name, tensor) pairs the vLLM load format
   feeds ``model.load_weights`` (``integrations.vllm._weights.iter_weights``,
   no vLLM needed), each dropped as it comes as vLLM does, over each
   checkpoint with batch_bytes of 1 TiB (one load), 4 GiB and
   1 GiB (the default): seconds, GB/s, batches, staging kinds, and the peak of memory
   allocated on the GPU (what a batch holds beside the model).

Prints one JSON object (also written to --json), then one table of both
models with the versions (on stderr).  ``--quick`` (or ``--small``) uses
tiny configs of both models (a smoke test that runs on the CPU in
seconds).  Takes under 5 minutes on an H200 host with 16 cores when DIR
must be generated.
"""

import argparse
import contextlib
import gc
import json
import logging
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: F401  (finds an in-place build of the package)
import torch
import transformers
from safetensors import safe_open as st_safe_open
from safetensors.torch import save_file

from instant_staging.integrations.transformers import _background, _inplace, from_pretrained
from instant_staging.loader import load_file, safe_open

DEFAULT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".bench")
SHARDS = 4
# The speedup over transformers' own each model must reach.
GOALS = {"dense": 5.0, "finemoe": 3.0}
FOLDERS = {"dense": "llama3-8b", "finemoe": "qwen3-moe-fine"}


def llama_config(small, layers=None):
    if small:
        sizes = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}
    else:
        sizes = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}
    if layers is not None:
        sizes["num_hidden_layers"] = layers
    return transformers.LlamaConfig(max_position_embeddings=8192, rope_theta=500000.0,
                                    rms_norm_eps=1e-5, tie_word_embeddings=False,
                                    architectures=["LlamaForCausalLM"], dtype="bfloat16", **sizes)


def finemoe_config(small, layers=None):
    """A fine-grained MoE: every expert matrix 1 MiB in bf16 (1024 x 512)."""
    if small:
        sizes = {"hidden_size": 64, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                 "vocab_size": 512}
    else:
        sizes = {"hidden_size": 1024, "moe_intermediate_size": 512, "num_experts": 64,
                 "num_experts_per_tok": 8, "num_hidden_layers": 24, "num_attention_heads": 16,
                 "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 32000}
    if layers is not None:
        sizes["num_hidden_layers"] = layers
    return transformers.Qwen3MoeConfig(intermediate_size=4 * sizes["hidden_size"], decoder_sparse_step=1,
                                       mlp_only_layers=[], max_position_embeddings=8192, rms_norm_eps=1e-6,
                                       tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"],
                                       dtype="bfloat16", **sizes)


def generate_with_transformers(path, config, cls, device, small):
    """The checkpoint as transformers writes it: the model built from its
    config on the device (transformers' own random initialization) and
    saved by save_pretrained (one tensor per expert matrix)."""
    done = os.path.join(path, ".complete")
    if os.path.exists(done):
        return False
    torch.manual_seed(0)
    with torch.device(device):
        model = cls._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, max_shard_size="24KB" if small else "2GB")
    del model
    open(done, "w").close()
    return True


def generate(path, config, device):
    """The checkpoint: names and shapes from the model built on meta, values
    random on the device (norms 1), 4 shards of about equal size + index."""
    done = os.path.join(path, ".complete")
    if os.path.exists(done):
        return False
    os.makedirs(path, exist_ok=True)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    shapes = [(n, tuple(t.shape)) for n, t in model.state_dict().items()]
    total = sum(torch.Size(s).numel() * 2 for _, s in shapes)
    names = [f"model-{k + 1:05d}-of-{SHARDS:05d}.safetensors" for k in range(SHARDS)]
    weight_map, part, size, k = {}, {}, 0, 0
    g = torch.Generator(device=device).manual_seed(0)

    def flush(part, k):
        save_file({n: t.cpu() for n, t in part.items()}, os.path.join(path, names[k]),
                  metadata={"format": "pt"})
    for name, shape in shapes:
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16, device=device)
        else:
            t = (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * 0.02).bfloat16()
        if size >= (k + 1) * total / SHARDS and k < SHARDS - 1:
            flush(part, k)
            part, k = {}, k + 1
        part[name] = t
        size += t.numel() * 2
        weight_map[name] = names[k]
    flush(part, k)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config.save_pretrained(path)
    open(done, "w").close()
    return True


def warm(path):
    """Reads every shard once: the page cache is hot for every method."""
    buf = bytearray(64 << 20)
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with open(os.path.join(path, name), "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed(make, device, repeat, peaks=None):
    times, model = [], None
    for _ in range(repeat):
        model = None
        release(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            # Over what is reserved already: ours runs while the reference
            # model is kept for the comparison (its 16 GB were counted in
            # ours, 32.13 GB, on the H200 2026-12-01).
            before = torch.cuda.memory_reserved(device)
        t0 = time.perf_counter()
        model = make()
        sync(device)
        times.append(time.perf_counter() - t0)
        if peaks is not None and device.type == "cuda":
            peaks.append(torch.cuda.max_memory_reserved(device) - before)
    return times, model


def phases(path, cls, device, repeat):
    """Ours in its two phases, each timed alone (see the docstring, 2b)."""
    config = transformers.AutoConfig.from_pretrained(path)
    dmap = {"": device} if device.type == "cuda" else None
    result = {}

    def assemble(state, warmup):
        context = contextlib.nullcontext() if warmup else _background.no_allocator_warmup(transformers)
        with context:
            return cls.from_pretrained(
                None, config=config, state_dict=state, dtype=torch.bfloat16, device_map=dmap)
    read_times, state = timed(lambda: load_file(path, device), device, repeat)
    result["read_s"] = [round(t, 4) for t in read_times]
    for key, warmup in (("assemble", False), ("assemble_with_warmup", True)):
        times, peaks = [], []
        for _ in range(repeat):
            state = load_file(path, device)
            sync(device)
            t, model = timed(lambda: assemble(state, warmup), device, 1, peaks)  # noqa: B023
            times += t
            del model
            state = None
        result[key + "_s"] = [round(t, 4) for t in times]
        if peaks:
            result[key + "_peak_reserved_gb"] = round(max(peaks) / 1e9, 2)
    # The route without the overlap: read everything, then assemble.
    times, _ = timed(lambda: assemble(load_file(path, device), False), device, repeat)
    result["sequential_s"] = [round(t, 4) for t in times]
    release(device)
    return result


def same(a, b):
    """Bit-equal, same dtype and shape (and device)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    return bool(torch.equal(a.reshape(-1).view(torch.uint8) if a.dim() else a.reshape(1),
                            b.reshape(-1).view(torch.uint8) if b.dim() else b.reshape(1)))


def compare_models(ours, ref):
    bad = []
    ours_p, ref_p = dict(ours.named_parameters()), dict(ref.named_parameters())
    if list(ours_p) != list(ref_p):
        bad.append("parameter names differ")
    bad += [f"parameter {n}" for n in ref_p if n in ours_p and not same(ours_p[n].data, ref_p[n].data)]
    ours_b, ref_b = dict(ours.named_buffers()), dict(ref.named_buffers())
    if list(ours_b) != list(ref_b):
        bad.append("buffer names differ")
    bad += [f"buffer {n}" for n in ref_b if n in ours_b and not same(ours_b[n], ref_b[n])]
    return bad


def vllm_batches(path, device, repeat):
    from instant_staging.integrations.vllm._options import Options
    from instant_staging.integrations.vllm._weights import Stats, iter_weights
    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    result = {}
    for batch_bytes in (1 << 40, 4 << 30, 1 << 30):
        best = None
        for _ in range(repeat):
            release(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            stats = Stats()
            t0 = time.perf_counter()
            for _name, tensor in iter_weights(files, device, Options(batch_bytes=batch_bytes), stats=stats):
                del tensor
            sync(device)
            seconds = time.perf_counter() - t0
            if best is None or seconds < best["seconds"]:
                best = {"seconds": round(seconds, 4), "gbps": round(stats.bytes / seconds / 1e9, 2),
                        "batches": stats.batches, "kinds": stats.kinds,
                        "peak_allocated_gb": round(torch.cuda.max_memory_allocated(device) / 1e9, 2)
                        if device.type == "cuda" else None}
        result[f"{batch_bytes >> 20}MiB"] = best
    return result


def tp2_slices(path, device):
    """Each TP=2 rank's half of every 2-D tensor, dims 0 and 1, both readers."""
    shards = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    bad, count, nbytes = [], 0, 0
    ours_s = ref_s = 0.0

    def nontrivial(t):
        return [s for s, n in zip(t.stride(), t.shape) if n > 1]
    dev = str(device)
    for shard in shards:
        with safe_open(shard, framework="pt", device=dev) as f, \
                st_safe_open(shard, framework="pt", device=dev) as g:
            names = f.keys()   # safe_open is not iterable (as safetensors')
            for name in names:
                shape = f.get_slice(name).get_shape()
                if len(shape) != 2:
                    continue
                for rank in (0, 1):
                    for dim in (0, 1):
                        half = shape[dim] // 2
                        part = slice(rank * half, (rank + 1) * half)
                        index = (part,) if dim == 0 else (slice(None), part)
                        t0 = time.perf_counter()
                        ours = f.get_slice(name)[index]
                        sync(device)
                        t1 = time.perf_counter()
                        ref = g.get_slice(name)[index]
                        sync(device)
                        t2 = time.perf_counter()
                        ours_s += t1 - t0
                        ref_s += t2 - t1
                        count += 1
                        nbytes += ref.numel() * ref.element_size()
                        if not (same(ours.contiguous(), ref.contiguous())
                                and nontrivial(ours) == nontrivial(ref)):
                            bad.append(f"{name}{list(index)}")
                        del ours, ref
    return {"slices": count, "bytes": nbytes, "ours_s": ours_s, "safetensors_s": ref_s,
            "speedup": ref_s / ours_s if ours_s else None, "mismatches": bad[:20],
            "equal": not bad}


def model_of(name, small, layers):
    """(class, generate(path, device)) of a model of --models."""
    if name == "dense":
        config = llama_config(small, layers)
        return transformers.LlamaForCausalLM, lambda path, device: generate(path, config, device)
    config = finemoe_config(small, layers)
    cls = transformers.Qwen3MoeForCausalLM
    return cls, lambda path, device: generate_with_transformers(path, config, cls, device, small)


def layout(path):
    """Tensors, bytes and how ours hands them to transformers."""
    from instant_staging.loader import Checkpoint
    with Checkpoint.open(path) as checkpoint:
        names = checkpoint.names()
        nbytes = sum(checkpoint.info(n).nbytes for n in names)
        whole = _background.loads_whole(checkpoint)
    return {"tensors": len(names), "bytes": nbytes,
            "mean_tensor_mib": round(nbytes / len(names) / 2**20, 2),
            "handover": "whole" if whole else "streamed"}


def bench_model(name, path, cls, device, args):
    """One model: transformers' own against ours, state compared."""
    warm(path)
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    dmap = str(device) if device.type == "cuda" else None

    def theirs():
        return cls.from_pretrained(path, **{dtype_kw: torch.bfloat16}, device_map=dmap)

    def ours():
        return from_pretrained(path, device=device, dtype=torch.bfloat16)

    ref_peaks, ours_peaks = [], []
    ref_times, ref = timed(theirs, device, args.repeat, ref_peaks)
    with routes() as taken:
        ours_times, mine = timed(ours, device, args.repeat, ours_peaks)
    bad = compare_models(mine, ref)
    mine = None
    release(device)
    before_peaks = []
    with state_dict_route(), routes() as taken_before:
        before_times, mine = timed(ours, device, args.repeat, before_peaks)
    bad += [f"(state-dict route) {m}" for m in compare_models(mine, ref)]
    del mine, ref
    release(device)
    speedup = min(ref_times) / min(ours_times)
    result = {
        "checkpoint": path, **layout(path), "route": "/".join(sorted(set(taken))),
        "instant_staging_state_dict_s": [round(t, 4) for t in before_times],
        "state_dict_route": "/".join(sorted(set(taken_before))),
        "transformers_s": [round(t, 4) for t in ref_times],
        "instant_staging_s": [round(t, 4) for t in ours_times],
        "speedup_best": round(speedup, 2), "goal": GOALS[name], "goal_met": speedup >= GOALS[name],
        "peak_reserved_gb": {"transformers": round(max(ref_peaks) / 1e9, 2) if ref_peaks else None,
                             "instant_staging": round(max(ours_peaks) / 1e9, 2) if ours_peaks else None,
                             "instant_staging_state_dict": (round(max(before_peaks) / 1e9, 2)
                                                            if before_peaks else None)},
        "parameters_and_buffers_equal": not bad, "mismatches": bad[:20],
    }
    result["instant_staging_gbps"] = round(result["bytes"] / min(ours_times) / 1e9, 2)
    if args.handovers:
        result["handovers"] = handovers(ours, device, args.repeat)
    if not args.skip_phases:
        result["phases"] = phases(path, cls, device, args.repeat)
    if args.vllm_batches:
        result["vllm_batches"] = vllm_batches(path, device, args.repeat)
    if name == "dense" and not args.skip_slices:
        result["tp2_slices"] = tp2_slices(path, device)
    return result


@contextlib.contextmanager
def routes():
    """The route of each of ours in the block, from its log line ("in place"
    or "state dict")."""
    taken = []

    class Route(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if message.startswith("from_pretrained "):
                taken.append("in place" if message.endswith("written in place") else "state dict")
    logger = logging.getLogger("instant_staging")
    handler, level = Route(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield taken
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@contextlib.contextmanager
def state_dict_route():
    """Ours with the in-place route off: transformers handed the tensors."""
    try:
        _inplace.IN_PLACE = False
        yield
    finally:
        _inplace.IN_PLACE = True


def handovers(ours, device, repeat):
    """Ours with every load handed over whole, then streamed, whatever the
    rule says (integrations/_whole.py's threshold set past every tensor's
    size, then to 0): seconds, best of ``repeat``."""
    from instant_staging.integrations import _whole
    rule = _whole.WHOLE_BATCH_MEAN_BYTES
    out = {}
    try:
        for mode, threshold in (("whole", 1 << 62), ("streamed", 0)):
            _whole.WHOLE_BATCH_MEAN_BYTES = threshold
            with state_dict_route():             # (the handover is that route's)
                times, _ = timed(ours, device, repeat)
            out[mode + "_s"] = [round(t, 4) for t in times]
    finally:
        _whole.WHOLE_BATCH_MEAN_BYTES = rule
    release(device)
    return out


def versions(device):
    import instant_staging
    out = {"device": str(device), "torch": torch.__version__, "transformers": transformers.__version__,
           "instant_staging": getattr(instant_staging, "__version__", "?")}
    try:
        import safetensors
        out["safetensors"] = safetensors.__version__
    except (ImportError, AttributeError):
        pass
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        out["cuda"] = torch.version.cuda
        try:
            smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            out["driver"] = subprocess.run(smi, capture_output=True, text=True, timeout=30).stdout.split()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            pass
    return out


def table(result):
    """The models side by side, as markdown, with the versions."""
    lines = [", ".join(f"{k} {v}" for k, v in result["versions"].items()), "",
             "| model | tensors | GB | route | transformers s | ours s | ours, state-dict route s "
             "| ours GB/s | speedup (goal) | equal |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in result["models"].items():
        lines.append(f"| {name} | {r['tensors']} | {r['bytes'] / 1e9:.2f} | {r['route']} | "
                     f"{min(r['transformers_s']):.3f} | {min(r['instant_staging_s']):.3f} | "
                     f"{min(r['instant_staging_state_dict_s']):.3f} ({r['handover']}) | "
                     f"{r['instant_staging_gbps']} | {r['speedup_best']}x ({r['goal']}x: "
                     f"{'met' if r['goal_met'] else 'NOT met'}) | "
                     f"{'yes' if r['parameters_and_buffers_equal'] else 'NO'} |")
    both = {n: r["handovers"] for n, r in result["models"].items() if "handovers" in r}
    if both:
        lines += ["", "| model | ours, handed over whole s | ours, streamed s |", "| --- | --- | --- |"]
        lines += [f"| {n} | {min(h['whole_s']):.3f} | {min(h['streamed_s']):.3f} |" for n, h in both.items()]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=None, help="where each model's folder is (default .bench/)")
    parser.add_argument("--device", default=None, help="default cuda:0, else cpu")
    parser.add_argument("--models", default="dense,finemoe", help="dense, finemoe (comma-separated)")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", "--small", dest="small", action="store_true",
                        help="tiny configs: a smoke test that runs on the CPU")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers of each model (default: dense 32, finemoe 24)")
    parser.add_argument("--skip-slices", action="store_true")
    parser.add_argument("--skip-phases", action="store_true", help="do not time read and assembly alone")
    parser.add_argument("--handovers", action="store_true",
                        help="time ours handing every load over whole, then streamed, whatever the rule")
    parser.add_argument("--vllm-batches", action="store_true",
                        help="time the vLLM load format's pairs at three batch sizes (no vLLM needed)")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(GOALS))
    if unknown or not models:
        parser.error(f"--models: unknown {', '.join(unknown) or '(none given)'} (dense, finemoe)")
    device = torch.device(args.device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.zeros(1, device=device)      # the CUDA context, outside every timing

    result = {"versions": versions(device), "models": {}}
    for name in models:
        cls, make = model_of(name, args.small, args.layers)
        path = os.path.join(args.dir or DEFAULT_DIR, FOLDERS[name] + ("-small" if args.small else "")
                            + (f"-{args.layers}layers" if args.layers else ""))
        t0 = time.perf_counter()
        generated = make(path, device)
        generate_s = time.perf_counter() - t0
        release(device)
        result["models"][name] = {"generated": generated, "generate_s": round(generate_s, 2),
                                  **bench_model(name, path, cls, device, args)}
    text = json.dumps(result, indent=2)
    print(text)
    print(table(result), file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    ok = all(r["parameters_and_buffers_equal"] and r.get("tp2_slices", {"equal": True})["equal"]
             for r in result["models"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
