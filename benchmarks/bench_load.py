#!/usr/bin/env python3
"""Loading safetensors checkpoints: instant_staging.loader against its peers.

One process, one run, the same files for everyone.  Layouts (--layouts):

  dense    Llama-3-8B names and shapes: 291 bf16 tensors in 4 shards, 16.06 GB
           (1 GiB embeddings and lm_head, 112 MiB MLP, 32/8 MiB attention, 8 KiB norms)
  moe      one MoE-like shard of 1,188 bf16 tensors, 3.6 GB (12 layers x 32
           experts x 3 matrices of 3 MiB, 512 KiB routers, 4 KiB norms)
  awq      AutoAWQ Llama-3-8B (4-bit, group 128): 739 tensors in 2 shards, 5.73 GB
           (I32 qweight [in, out/8] and qzeros, F16 scales, embeddings, lm_head, norms)
  finemoe  fine-grained MoE: 4,680 bf16 tensors in 2 shards, 4.84 GB (24 layers x
           64 experts x 3 matrices of 1 MiB, 128 KiB routers, 2 KiB norms)
  fp8      FP8 block-quantized Llama-3-8B (DeepSeek-V3's scheme): F8_E4M3 weights,
           F32 weight_scale_inv per 128x128 block, an odd-length U8 tensor per
           layer, bf16 embeddings, lm_head and norms: 547 tensors in 2 shards, 9.08 GB
  uniform  the older single file of 64 MiB tensors (--uniform-size, 4 GiB)

Files are generated once (random bytes) and reused.  Each method loads a
layout --repeat times with the page cache hot (best and median), then, for
the layouts in --cold, once more per method after posix_fadvise(DONTNEED)
on every file (the files are fdatasync'ed first so the cache can drop them):

  instant_staging        iter_load defaults (also its time to the first tensor); its
                         first run makes the staging buffer, the later ones take
                         the buffer the first kept ("first" column: run 1 alone)
  ... nothing kept       load_file with INSTANT_STAGING_KEEP_STAGING=0: each run
                         makes and releases its own buffer
  read ceiling           16 threads x 8 MiB preads of the same files, no copies
                         (the loader's own C threads, SKIP_COPY): the host's
                         parallel-read rate, hot and cold
  ..., cold reads        the same with a cold load's reads (4 threads x 16 MiB);
                         a load is compared with the faster ceiling
  safetensors            safetensors.torch.load_file(device=...)
  safetensors prefetch   safetensors 0.9's pipelined loader: safe_open(..., backend=B)
                         .prefetch(threads=T) per file, every tensor taken (B, T
                         in the name; files opened together so their loads overlap)
  instanttensor          InstantTensor safe_open(...) defaults, tensors() iterated
                         (its default backend is direct I/O: a cold reader)
  instanttensor MMAP     the same with INSTANTTENSOR_BACKEND=MMAP (or BUFFERED):
                         the page-cache backends, its fastest hot
  fastsafetensors nogds  fastsafe_open(nogds=True), get_tensor per name
  runai streamer         Run:ai SafetensorsStreamer (CPU tensors) + .to(device)
  pinned copy ceiling    one pinned 2 GiB torch tensor copied to the device
                         until the layout's size is covered (no file I/O)
  is 2GiB <KIND>         (--only) load_file with one reused 2 GiB buffer forced into
                         REGISTERED, SEGMENTED, RUNTIME_PINNED or PAGEABLE

Every result is compared bit for bit (as raw bytes) with safetensors' own
load of the same files onto the same device.  Time to first tensor is when
a streaming method hands out its first tensor (load_file-style methods:
their whole time).  Peak host memory is the RSS high-water mark of the
load above the RSS before it (/proc/self/clear_refs resets it per run).
Peers that do not import are skipped with a note.  Without a GPU
everything runs on the CPU and the GPU-only peers are skipped; --quick
makes every layout 64 times smaller in each matrix dimension (a smoke test).

    python benchmarks/bench_load.py [--layouts dense,moe] [--cold dense,moe]
        [--dir DIR] [--repeat 3] [--device cuda:0] [--json PATH] [--only NAME,...]
"""

import argparse
import gc
import json
import os
import statistics
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C

import instant_staging as ist
from instant_staging import defaults, loader

STAGING_BYTES = 256 * loader.DEFAULT_CHUNK_SIZE   # InstantTensor's 2 GiB per rank
DEFAULT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".bench")
CEILING_THREADS, CEILING_CHUNK = 16, 8 * C.MiB

# Each kind forced on the real runtime, as INSTANT_STAGING_FAULTS would.
FORCED = [
    (ist.Kind.REGISTERED, None, {}),
    (ist.Kind.SEGMENTED, "register#1=invalid_value", {}),
    (ist.Kind.RUNTIME_PINNED, "register=invalid_value", {}),
    (ist.Kind.PAGEABLE, "register=invalid_value;host_alloc=memory_allocation",
     {"allow_pageable": True}),
]


# -- the layouts ---------------------------------------------------------------

def dense_layout(scale=1):
    """Llama-3-8B: [(file name, [(tensor name, shape), ...]), ...] in 4 shards."""
    V, H, I, KV, L = 128256 // scale, 4096 // scale, 14336 // scale, 1024 // scale, 32
    tensors = [("model.embed_tokens.weight", [V, H])]
    for i in range(L):
        p = f"model.layers.{i}."
        tensors += [(p + "self_attn.q_proj.weight", [H, H]), (p + "self_attn.k_proj.weight", [KV, H]),
                    (p + "self_attn.v_proj.weight", [KV, H]), (p + "self_attn.o_proj.weight", [H, H]),
                    (p + "mlp.gate_proj.weight", [I, H]), (p + "mlp.up_proj.weight", [I, H]),
                    (p + "mlp.down_proj.weight", [H, I]), (p + "input_layernorm.weight", [H]),
                    (p + "post_attention_layernorm.weight", [H])]
    tensors += [("model.norm.weight", [H]), ("lm_head.weight", [V, H])]
    total = sum(_nbytes(s) for _, s in tensors)
    shards, cur, size = [], [], 0
    for t in tensors:       # in order, about a quarter each, as transformers shards
        cur.append(t)
        size += _nbytes(t[1])
        if size >= total / 4 * (len(shards) + 1) and len(shards) < 3:
            shards.append(cur)
            cur = []
    shards.append(cur)
    return [(f"model-{i + 1:05d}-of-00004.safetensors", sorted(s)) for i, s in enumerate(shards)]


def moe_layout(scale=1):
    """One MoE-like shard: 12 layers x (32 experts x 3 matrices, router, 2 norms)."""
    H, F, E, R, L = 2048 // scale, 768 // scale, 32, 128, 12
    tensors = []
    for i in range(L):
        p = f"model.layers.{i}."
        for e in range(E):
            q = p + f"mlp.experts.{e}."
            tensors += [(q + "gate_proj.weight", [F, H]), (q + "up_proj.weight", [F, H]),
                        (q + "down_proj.weight", [H, F])]
        tensors += [(p + "mlp.gate.weight", [R, H]), (p + "input_layernorm.weight", [H]),
                    (p + "post_attention_layernorm.weight", [H])]
    return [("model-moe.safetensors", sorted(tensors))]


def finemoe_layout(scale=1):
    """Two shards of 24 layers x (64 experts x 3 matrices of 1 MiB, router,
    2 norms): 4,680 tensors, as fine-grained MoE checkpoints cut them."""
    H, F, E, L = 1024 // scale, 512 // scale, 64, 24
    shards = [[], []]
    for i in range(L):
        p = f"model.layers.{i}."
        tensors = [(p + f"mlp.experts.{e}.{m}", [F, H] if m != "down_proj.weight" else [H, F])
                   for e in range(E) for m in ("gate_proj.weight", "up_proj.weight", "down_proj.weight")]
        tensors += [(p + "mlp.gate.weight", [E, H]), (p + "input_layernorm.weight", [H]),
                    (p + "post_attention_layernorm.weight", [H])]
        shards[i * 2 // L] += tensors
    return [(f"model-{k + 1:05d}-of-00002.safetensors", sorted(s)) for k, s in enumerate(shards)]


def fp8_layout(scale=1):
    """A block-quantized FP8 Llama-3-8B as DeepSeek-V3's scheme writes it:
    each linear an F8_E4M3 ``weight`` [out, in] and an F32
    ``weight_scale_inv`` [ceil(out/128), ceil(in/128)]; a U8 tensor of odd
    length per layer (packed metadata: it breaks 2- and 4-byte alignment of
    what follows); embeddings, lm_head and norms bf16.  Two shards."""
    V, H, I, KV, L = 128256 // scale, 4096 // scale, 14336 // scale, 1024 // scale, 32
    B = max(1, 128 // scale)

    def linear(prefix, n_in, n_out):
        return [(prefix + ".weight", [n_out, n_in], "F8_E4M3"),
                (prefix + ".weight_scale_inv", [-(-n_out // B), -(-n_in // B)], "F32")]
    shards = [[("model.embed_tokens.weight", [V, H], "BF16")], []]
    for i in range(L):
        p = f"model.layers.{i}."
        t = []
        for name, n_in, n_out in (("self_attn.q_proj", H, H), ("self_attn.k_proj", H, KV),
                                  ("self_attn.v_proj", H, KV), ("self_attn.o_proj", H, H),
                                  ("mlp.gate_proj", H, I), ("mlp.up_proj", H, I),
                                  ("mlp.down_proj", I, H)):
            t += linear(p + name, n_in, n_out)
        t += [(p + "input_layernorm.weight", [H], "BF16"),
              (p + "post_attention_layernorm.weight", [H], "BF16"),
              (p + "quant_meta", [333], "U8")]
        shards[i * 2 // L] += t
    shards[1] += [("model.norm.weight", [H], "BF16"), ("lm_head.weight", [V, H], "BF16")]
    return [(f"model-{k + 1:05d}-of-00002.safetensors", sorted(s)) for k, s in enumerate(shards)]


def uniform_layout(size):
    count = max(1, size // (64 * C.MiB))
    return [(f"bench-{size // C.MiB}MiB.safetensors",
             [(f"layers.{i}.weight", [4096, 8192]) for i in range(count)])]


def awq_layout(scale=1):
    """An AutoAWQ Llama-3-8B (4-bit GEMM, group size 128): 739 tensors, 5.73 GB.

    Per linear (in -> out) WQLinear_GEMM's buffers: ``qweight`` I32
    [in, out/8] (8 packed 4-bit weights per int32), ``qzeros`` I32
    [in/128, out/8], ``scales`` F16 [in/128, out]; embeddings, lm_head and
    norms F16.  Shards as save_pretrained's 5 GB rule cuts a real one:
    everything but lm_head (4.68 GB), then lm_head alone (1.05 GB).  Inside a
    file I32 before F16, by name within each (safetensors' own order).
    Entries are (name, shape, dtype)."""
    V, H, I, KV, L = 128256 // scale, 4096 // scale, 14336 // scale, 1024 // scale, 32
    G = max(1, 128 // scale)

    def linear(prefix, n_in, n_out):
        return [(prefix + ".qweight", [n_in, max(1, n_out // 8)], "I32"),
                (prefix + ".qzeros", [max(1, n_in // G), max(1, n_out // 8)], "I32"),
                (prefix + ".scales", [max(1, n_in // G), n_out], "F16")]
    tensors = [("model.embed_tokens.weight", [V, H], "F16")]
    for i in range(L):
        p = f"model.layers.{i}."
        for name, n_in, n_out in (("self_attn.q_proj", H, H), ("self_attn.k_proj", H, KV),
                                  ("self_attn.v_proj", H, KV), ("self_attn.o_proj", H, H),
                                  ("mlp.gate_proj", H, I), ("mlp.up_proj", H, I),
                                  ("mlp.down_proj", I, H)):
            tensors += linear(p + name, n_in, n_out)
        tensors += [(p + "input_layernorm.weight", [H], "F16"),
                    (p + "post_attention_layernorm.weight", [H], "F16")]
    tensors.append(("model.norm.weight", [H], "F16"))
    head = [("lm_head.weight", [V, H], "F16")]

    def order(t):
        return (-DTYPE_BYTES[t[2]], t[0])
    return [("model-00001-of-00002.safetensors", sorted(tensors, key=order)),
            ("model-00002-of-00002.safetensors", head)]


DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8, "U8": 1, "I8": 1, "F8_E4M3": 1}


def _nbytes(shape, dtype="BF16"):
    n = DTYPE_BYTES[dtype]
    for d in shape:
        n *= d
    return n


def _entry(tensor):
    """(name, shape) -> (name, shape, "BF16"); (name, shape, dtype) as is."""
    return tensor if len(tensor) == 3 else (*tensor, "BF16")


def encode_header(tensors):
    """``(head, data_bytes)`` of a file of ``tensors`` (entries as
    ``generate`` takes them, back to back in that order): its header as
    safetensors writes it, the 8-byte length first, and the size of its data
    section."""
    header, offset = {}, 0
    for name, shape, dtype in map(_entry, tensors):
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [offset, offset + _nbytes(shape, dtype)]}
        offset += _nbytes(shape, dtype)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offset


def generate(directory, files, pool_bytes=64 * C.MiB):
    """Writes each file of ``files`` (random bytes; entries (name, shape) are
    bf16, (name, shape, dtype) that dtype) unless it is there
    with the right size; returns the paths.  Tensor k's bytes are the random
    pool read cyclically from an offset of its own, so no two are equal."""
    paths, pool = [], None
    for fname, tensors in files:
        path = os.path.join(directory, fname)
        paths.append(path)
        head, offset = encode_header(tensors)
        if os.path.exists(path) and os.path.getsize(path) == len(head) + offset:
            continue
        if pool is None:
            pool = memoryview(os.urandom(pool_bytes) * 2)   # cyclic reads without wrapping
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(head)
            for k, (_, shape, dtype) in enumerate(map(_entry, tensors)):
                left, start = _nbytes(shape, dtype), (k * 1000003 * 2) % pool_bytes
                while left:
                    n = min(left, pool_bytes)
                    f.write(pool[start:start + n])
                    left -= n
        os.replace(tmp, path)
    return paths


def flush(paths):
    """fdatasync: POSIX_FADV_DONTNEED drops clean pages only."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)


def drop_cache(paths):
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(paths):
    """Reads every file once so every method meets a hot page cache."""
    buf = bytearray(64 * C.MiB)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


class Checker:
    """Bit-exact comparison with safetensors' own load (on the same device)."""

    def __init__(self, torch, device, paths):
        from safetensors.torch import load_file as st_load
        self.torch = torch
        self.reference = {}
        for path in paths:
            self.reference.update(st_load(path, device=str(device)))

    def verify(self, result):
        """'ok' or what is wrong."""
        torch, ref = self.torch, self.reference
        if set(result) != set(ref):
            return f"names differ ({len(result)} vs {len(ref)})"
        for name, t in result.items():
            r = ref[name]
            if t.device != r.device or t.dtype != r.dtype or t.shape != r.shape:
                return f"{name}: {t.dtype} {tuple(t.shape)} on {t.device}"
            if not torch.equal(t.reshape(-1).view(torch.uint8), r.reshape(-1).view(torch.uint8)):
                return f"{name}: bytes differ"
        return "ok"


# -- the methods -------------------------------------------------------------

class Method:
    """One way to load: ``run(files, mark)`` returns {name: tensor} (None for
    a ceiling) and calls ``mark()`` when its first tensor is ready;
    ``setup``/``teardown`` bracket its repeats, untimed; ``hot=False``: only
    measured cold."""

    def __init__(self, name, run, setup=None, teardown=None, kind="", note="", peer=False, hot=True):
        self.name, self.run, self.kind, self.note, self.peer = name, run, kind, note, peer
        self.hot = hot
        self.setup = setup or (lambda files: None)
        self.teardown = teardown or (lambda: None)


def our_methods(torch, device, only):
    dev = str(device)

    def iterate(files, mark):
        with loader.iter_load(files, dev) as it:
            result = {}
            for name, t in it:
                if not result:
                    mark()
                result[name] = t
        kind = it.staging_kind
        method.kind = kind.name if kind else "ordinary memory"
        method.note = f"iter_load defaults, {it.threads} reader threads"
        return result
    def kept_note():
        # After the runs, outside the timed region: parsing /proc/self/smaps
        # of a torch process takes milliseconds.
        notes = [f"; staging {C.fmt_size(buf.size)} with {C.fmt_size(huge)} in huge pages"
                 for buf in loader._staging_pool.kept().values()
                 if (huge := C.huge_bytes(buf.ptr)) is not None]
        loader.empty_cache()
        return "".join(notes)

    # Its first run makes the staging buffer (nothing kept before it: "first"
    # in the table); the later runs take the one the first kept.
    method = Method("instant_staging", iterate, setup=lambda files: loader.empty_cache(),
                    teardown=kept_note)

    def with_env(name, value):
        def run(files, mark):
            old = os.environ.get(name)
            os.environ[name] = value
            try:
                return loader.load_file(files, dev)
            finally:
                if old is None:
                    del os.environ[name]
                else:
                    os.environ[name] = old
        return run
    # The second ceiling reads as a cold load does (defaults.COLD_*): on the
    # H200 host's disk, 16 MiB reads were 30-45% faster than 8 MiB ones.
    out = [method, _read_ceiling(),
           _read_ceiling(defaults.COLD_THREADS, defaults.COLD_CHUNK_SIZE, "read ceiling, cold reads")]
    if device.type == "cuda":
        out.append(Method("instant_staging nothing kept", with_env("INSTANT_STAGING_KEEP_STAGING", "0"),
                          kind="REGISTERED", setup=lambda files: loader.empty_cache(),
                          note="load_file defaults, INSTANT_STAGING_KEEP_STAGING=0: every "
                               "load makes and releases its buffer"))
        out.append(Method("instant_staging hugepages", with_env("INSTANT_STAGING_HUGEPAGES", "1"),
                          kind="REGISTERED", setup=lambda files: loader.empty_cache(),
                          teardown=loader.empty_cache,
                          note="load_file defaults, INSTANT_STAGING_HUGEPAGES=1"))
    if device.type == "cuda":
        out.append(Method("instant_staging readers alone", _without_head_start(dev),
                          kind="REGISTERED",
                          note="load_file defaults, a cold checkpoint read by its readers alone "
                               "(Shards.warm_if_cold off: no head start)", hot=False))
    if device.type == "cuda" and only:
        out += [_forced(kind, faults, kw, dev) for kind, faults, kw in FORCED]
    return out


def _without_head_start(dev):
    """``load_file(files, dev)`` with the disk's head start off (a cold
    load's readers alone, as a server's were before it): for the cold rows."""
    from instant_staging.loader import load_file
    from instant_staging.loader._shards import Shards

    def run(files, mark):
        real = Shards.warm_if_cold
        Shards.warm_if_cold = lambda self, piece_bytes, threads: False
        try:
            return load_file(files, dev)
        finally:
            Shards.warm_if_cold = real
    return run


def run_to_end(pipe, dsts, what="pipeline"):
    """Starts a Pipeline with ``dsts``, waits for every thread to exit,
    raises its error; closes it in any case."""
    try:
        pipe.start(dsts)
        while not pipe.wait(1.0)[2]:
            pass
        if pipe.error():
            raise RuntimeError(f"{what}: {pipe.error()}")
    finally:
        pipe.close()


def _read_ceiling(threads=CEILING_THREADS, chunk=CEILING_CHUNK, name="read ceiling"):
    """``threads`` x ``chunk`` preads of the whole files into the slots of
    one staging buffer (made once, untimed): the loader's own reader threads
    with the copies left out.  The ceiling a load is compared with is the
    faster of the rows so named (``compare``)."""
    from instant_staging.loader._pipeline import SKIP_COPY, Pipeline, Plan
    holder = {}

    def setup(files):
        holder["buf"] = ist.StagingBuffer(threads * chunk, allow_pageable=True)

    def run(files, mark):
        fds = [os.open(f, os.O_RDONLY) for f in files]
        try:
            plan = Plan([(fd, 0, os.fstat(fd).st_size) for fd in fds], chunk)
            pipe = Pipeline(plan, threads=threads, staging=holder["buf"], skip=SKIP_COPY)
            run_to_end(pipe, [0] * len(fds), name)
        finally:
            for fd in fds:
                os.close(fd)

    def teardown():
        buf = holder.pop("buf", None)
        if buf is not None:
            buf.close()
    return Method(name, run, setup, teardown, kind="(no copy)",
                  note=f"{threads} threads x {C.fmt_size(chunk)} preads, whole files")


def _forced(kind, faults, kw, dev):
    from instant_staging.testing import inject_faults
    holder = {}

    def setup(files):
        runtime = inject_faults(ist.real_runtime(), faults) if faults else ist.real_runtime()
        t0 = time.perf_counter()
        buf = ist.StagingBuffer(STAGING_BYTES, runtime=runtime,
                                copy_unit=loader.DEFAULT_CHUNK_SIZE, **kw)
        holder["buf"] = buf
        method.note = (f"2 GiB buffer made once in {time.perf_counter() - t0:.2f} s, "
                       f"{len(buf.segments)} registration(s)")
        if buf.kind is not kind:
            raise RuntimeError(f"forcing {kind.name} reached {buf.kind.name}")

    def teardown():
        buf = holder.pop("buf", None)
        if buf is not None:
            buf.close()

    method = Method(f"is 2GiB {kind.name}",
                    lambda files, mark: loader.load_file(files, dev, staging=holder["buf"]),
                    setup, teardown, kind=kind.name)
    return method


def peer_methods(torch, device):
    """(methods, notes): every peer that imports; a note for each that does not."""
    methods, notes = [], []
    dev = str(device)
    try:
        from safetensors.torch import load_file as st_load

        def st_run(files, mark):
            return _merge(st_load(f, device=dev) for f in files)
        methods.append(Method("safetensors", st_run,
                              note=("load_file(device='cpu') maps the file: no copy"
                                    if device.type == "cpu" else "load_file(device=...)"), peer=True))
    except ImportError as e:
        notes.append(f"safetensors skipped: {e}")
    if device.type == "cpu":
        notes.append("safetensors prefetch, instanttensor, fastsafetensors, runai streamer and "
                     "the pinned ceiling skipped: no GPU")
        return methods, notes
    methods += _st_prefetch_methods(dev, notes)
    try:
        from instanttensor import safe_open

        def it_method(backend):
            def it_load(files, mark):
                old = os.environ.get("INSTANTTENSOR_BACKEND")
                if backend:
                    os.environ["INSTANTTENSOR_BACKEND"] = backend
                try:
                    out = {}
                    with safe_open(files, framework="pt", device=device.index) as f:
                        for name, t in f.tensors():
                            if not out:
                                mark()
                            out[name] = t
                    return out
                finally:
                    if old is None:
                        os.environ.pop("INSTANTTENSOR_BACKEND", None)
                    else:
                        os.environ["INSTANTTENSOR_BACKEND"] = old
            return Method("instanttensor" + (f" {backend}" if backend else ""), it_load, peer=True,
                          note="safe_open, tensors(), " + (f"INSTANTTENSOR_BACKEND={backend}"
                                                           if backend else "defaults (direct I/O)"))
        methods += [it_method(None), it_method("MMAP"), it_method("BUFFERED")]
    except ImportError as e:
        notes.append(f"instanttensor skipped: {e}")
    try:
        from fastsafetensors import fastsafe_open

        def fst_load(files, mark):
            out = {}
            with fastsafe_open(files, device=dev, nogds=True) as f:
                for k in f.keys():  # noqa: SIM118 (fastsafe_open is not iterable)
                    out[k] = f.get_tensor(k)
                    if len(out) == 1:
                        mark()
            return out
        methods.append(Method("fastsafetensors nogds", fst_load, note="fastsafe_open(nogds=True)",
                              peer=True))
    except ImportError as e:
        notes.append(f"fastsafetensors skipped: {e}")
    try:
        from runai_model_streamer import SafetensorsStreamer

        def runai_load(files, mark):
            out = {}
            with SafetensorsStreamer() as streamer:
                streamer.stream_files(files)
                for name, t in streamer.get_tensors():
                    out[name] = t.to(dev)
                    if len(out) == 1:
                        mark()
            return out
        methods.append(Method("runai streamer", runai_load,
                              note="SafetensorsStreamer to CPU tensors, then .to(device)", peer=True))
    except ImportError as e:
        notes.append(f"runai streamer skipped: {e}")
    methods.append(_copy_ceiling(torch, device))
    return methods, notes


# safetensors 0.9's prefetch loader, in the settings worth comparing: its
# default (mmap backend, 8 threads), the pread backend the issue measured,
# and pread with as many threads as our loader runs.
ST_PREFETCH = [("mmap", 8), ("pread", 8), ("pread", 16)]


def _st_prefetch_methods(dev, notes):
    try:
        from safetensors import safe_open
        if not hasattr(safe_open, "prefetch"):
            raise ImportError("safetensors < 0.9 has no prefetch()")
    except ImportError as e:
        notes.append(f"safetensors prefetch skipped: {e}")
        return []

    def make(backend, threads):
        def run(files, mark):
            # Every file's loader started before any is drained: the files
            # load side by side, as a server loading shards would.
            import contextlib
            out = {}
            with contextlib.ExitStack() as stack:
                loaders = []
                for f in files:
                    h = stack.enter_context(safe_open(f, framework="pt", device=dev, backend=backend))
                    loaders.append(stack.enter_context(h.prefetch(threads=threads)))
                for ld in loaders:
                    for name, t in ld:
                        if not out:
                            mark()
                        out[name] = t
            return out
        return Method(f"safetensors prefetch {backend} x{threads}", run, peer=True,
                      note=f"safe_open(backend={backend!r}).prefetch(threads={threads}), files overlapped")
    return [make(b, t) for b, t in ST_PREFETCH]


def _merge(dicts):
    out = {}
    for d in dicts:
        out.update(d)
    return out


def _copy_ceiling(torch, device):
    holder = {}

    def setup(files):
        holder["total"] = sum(os.path.getsize(f) for f in files)
        holder["src"] = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
        holder["src"].fill_(7)
        holder["dst"] = torch.empty(STAGING_BYTES, dtype=torch.uint8, device=device)

    def run(files, mark):
        src, dst, total = holder["src"], holder["dst"], holder["total"]
        for off in range(0, total, STAGING_BYTES):
            n = min(STAGING_BYTES, total - off)
            dst[:n].copy_(src[:n], non_blocking=True)

    def teardown():
        holder.clear()

    return Method("pinned copy ceiling", run, setup, teardown, kind="(no I/O)",
                  note=f"pinned 2 GiB torch tensor -> {device}, no file I/O")


# -- measuring -----------------------------------------------------------------

def sync(torch, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(method, files, torch, device, checker, repeat, budget, cold):
    """Runs ``method`` up to ``repeat`` times; returns its record."""
    rec = {"method": method.name, "kind": method.kind, "note": method.note, "peer": method.peer,
               "cache": "cold" if cold else "hot", "times": [], "ttft": [], "peak_rss": [], "verified": [],
               "error": None}
    try:
        method.setup(files)
        rec["note"] = method.note
        for i in range(repeat):
            gc.collect()
            sync(torch, device)
            if cold:
                drop_cache(files)
            rss0 = C._status_kib("VmRSS")
            peak_ok = C.reset_peak_rss()
            first = []
            t0 = time.perf_counter()
            result = method.run(files, lambda first=first: first.append(time.perf_counter()))
            sync(torch, device)
            t1 = time.perf_counter()
            hwm = C._status_kib("VmHWM")
            rec["times"].append(t1 - t0)
            rec["ttft"].append((first[0] if first else t1) - t0)
            rec["peak_rss"].append(hwm - rss0 if peak_ok and hwm and rss0 else None)
            rec["kind"], rec["note"] = method.kind, method.note
            if result is not None:
                rec["verified"].append(checker.verify(result))
            del result
            _free(torch, device)
            if (t1 - t0) * (i + 2) > budget:
                rec["note"] += f"; {i + 1} run(s): over the {budget:.0f} s budget"
                break
    except Exception as e:      # a peer failing must not end the comparison
        rec["error"] = f"{type(e).__name__}: {e}"
        _free(torch, device)
    finally:
        try:
            rec["note"] += method.teardown() or ""      # a teardown may add to the note
        except Exception as e:
            rec["error"] = rec["error"] or f"teardown: {e}"
        _free(torch, device)
    return rec


def _free(torch, device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def summarize(rec, nbytes):
    times = rec["times"]
    rec["best"] = min(times) if times else None
    rec["median"] = statistics.median(times) if times else None
    rec["gbps_best"] = nbytes / rec["best"] / 1e9 if times else None
    rec["gbps_median"] = nbytes / rec["median"] / 1e9 if times else None
    rec["first"] = times[0] if times else None
    rec["gbps_first"] = nbytes / times[0] / 1e9 if times else None
    rec["ttft_best"] = min(rec["ttft"]) if rec["ttft"] else None
    peaks = [p for p in rec["peak_rss"] if p is not None]
    rec["peak_rss_max"] = max(peaks) if peaks else None
    checks = set(rec["verified"])
    rec["bit_exact"] = (None if not checks else checks == {"ok"})
    return rec


def compare(results):
    """Adds, per layout and cache: our speed over the best peer's, and over
    the read ceiling."""
    for layout in {r["layout"] for r in results}:
        for cache in ("hot", "cold"):
            rs = [r for r in results if r["layout"] == layout and r["cache"] == cache
                  and r["gbps_best"] and not r["error"]]
            peers = [r for r in rs if r["peer"]]
            ours = [r for r in rs if r["method"] == "instant_staging"]
            ceiling = sorted((r for r in rs if r["method"].startswith("read ceiling")),
                             key=lambda r: -r["gbps_best"])
            for r in ours:
                if peers:
                    best = max(peers, key=lambda p: p["gbps_best"])
                    r["vs_best_peer"] = r["gbps_best"] / best["gbps_best"]
                    r["best_peer"] = best["method"]
                if ceiling:
                    r["vs_read_ceiling"] = r["gbps_best"] / ceiling[0]["gbps_best"]


def row(rec):
    if rec["error"]:
        return [rec["layout"], rec["cache"], rec["method"], rec["kind"], "-", "-", "-", "-", "-", "-",
                "ERROR: " + rec["error"][:60]]
    exact = {None: "n/a", True: "yes", False: "NO: " + "; ".join(
        sorted(v for v in set(rec["verified"]) if v != "ok"))[:60]}[rec["bit_exact"]]
    extra = []
    if "vs_best_peer" in rec:
        extra.append(f"{rec['vs_best_peer']:.1f}x {rec['best_peer']}")
    if "vs_read_ceiling" in rec:
        extra.append(f"{100 * rec['vs_read_ceiling']:.0f}% of reads")
    return [rec["layout"], rec["cache"], rec["method"], rec["kind"], C.fmt(rec["best"]),
            C.fmt(rec["gbps_best"], ".2f"), C.fmt(rec["gbps_median"], ".2f"),
            C.fmt(rec["gbps_first"], ".2f"),
            C.fmt(rec["ttft_best"] and rec["ttft_best"] * 1e3, ".1f"),
            C.fmt_size(rec["peak_rss_max"]), exact + ("; " + ", ".join(extra) if extra else "")]


# -- main ----------------------------------------------------------------------

def pick_device(torch, wanted):
    if wanted:
        return torch.device(wanted), None
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device()), None
    return torch.device("cpu"), f"torch {torch.__version__} sees no GPU"


def environment(torch, device):
    env = {"python": sys.version.split()[0], "torch": torch.__version__, "device": str(device),
               "cpus": len(os.sched_getaffinity(0)), "backend": ist.BACKEND,
               "faults_env": os.environ.get("INSTANT_STAGING_FAULTS")}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    for mod, dist in (("safetensors", "safetensors"), ("instanttensor", "instanttensor"),
                      ("fastsafetensors", "fastsafetensors"),
                      ("runai_model_streamer", "runai-model-streamer")):
        try:
            from importlib.metadata import version
            env[mod] = version(dist)
        except Exception:
            env[mod] = None
    return env


def start(torch, args, title, no_gpu=""):
    """Logging as -v asks, the device, the banner and --dir made; returns
    (device, scale, repeat).  ``no_gpu``: what the banner adds without one."""
    C.quiet_logging(args.verbose)
    device, why_cpu = pick_device(torch, args.device)
    scale, repeat = C.scale_and_repeat(args)
    print("=" * 78)
    print(f"{title} -- device {device}" + (f" (NO GPU: {why_cpu}{no_gpu})" if why_cpu else ""))
    print("=" * 78, flush=True)
    os.makedirs(args.dir, exist_ok=True)
    return device, scale, repeat


def prepared(names, directory, scale, record):
    """This file's checkpoints of each of ``names`` (uniform: 4 GiB), made
    (shared with every script that asks for the same) and warmed; yields
    (name, paths), each layout's counts put in ``record`` and printed."""
    for name, files in layouts(names, scale, 4 << 30):
        paths = generate(directory, files)
        warm(paths)
        record[name] = {"files": len(paths), "tensors": sum(len(t) for _, t in files),
                        "bytes": sum(os.path.getsize(p) for p in paths)}
        print(f"{name}: {record[name]['tensors']} tensors, {C.fmt_size(record[name]['bytes'])}",
              flush=True)
        yield name, paths


def layouts(names, scale, uniform_size):
    out = []
    for name in names:
        if name == "dense":
            out.append(("dense", dense_layout(scale)))
        elif name == "moe":
            out.append(("moe", moe_layout(scale)))
        elif name == "awq":
            out.append(("awq", awq_layout(scale)))
        elif name == "finemoe":
            out.append(("finemoe", finemoe_layout(scale)))
        elif name == "fp8":
            out.append(("fp8", fp8_layout(scale)))
        elif name == "uniform":
            out.append(("uniform", uniform_layout(uniform_size // scale)))
        else:
            raise SystemExit(f"unknown layout {name!r} (dense, moe, awq, finemoe, fp8, uniform)")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_layout_options(ap, layouts="dense,moe", layouts_help="dense, moe, awq, finemoe, fp8, uniform",
                         dir_default=DEFAULT_DIR, dir_help="where checkpoints live (local disk)")
    ap.add_argument("--cold", default="dense,moe", help="layouts also measured cold ('' for none)")
    ap.add_argument("--cold-only", default=None,
                    help="comma-separated method name prefixes measured cold (default: all)")
    ap.add_argument("--skip-hot", action="store_true", help="only the cold runs")
    ap.add_argument("--uniform-size", default="4GiB")
    ap.add_argument("--budget", type=float, default=30.0,
                    help="seconds one method may take over its repeats for one layout")
    ap.add_argument("--only", default=None, help="comma-separated method name prefixes")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    import torch
    started = time.perf_counter()
    device, scale, repeat = start(torch, args, "bench_load", no_gpu="; CPU copies only")
    doc = {"environment": environment(torch, device), "layouts": {}, "results": [], "notes": []}
    cold_layouts = [c for c in args.cold.split(",") if c]

    def wanted(m, prefixes):
        return not prefixes or any(m.name.startswith(p) for p in prefixes.split(","))
    for name, files in layouts([n for n in args.layouts.split(",") if n], scale,
                               C.parse_sizes(args.uniform_size)[0]):
        t0 = time.perf_counter()
        paths = generate(args.dir, files)
        nbytes = sum(os.path.getsize(p) for p in paths)
        ntensors = sum(len(t) for _, t in files)
        doc["layouts"][name] = {"files": len(paths), "tensors": ntensors, "bytes": nbytes,
                                    "generate_s": time.perf_counter() - t0}
        C.progress(f"{name}: {len(paths)} file(s), {ntensors} tensors, {nbytes / 1e9:.2f} GB "
                   f"({time.perf_counter() - t0:.1f} s)")
        warm(paths)
        checker = Checker(torch, device, paths)
        methods = our_methods(torch, device, args.only)
        peers, notes = peer_methods(torch, device)
        doc["notes"] += [n for n in notes if n not in doc["notes"]]
        methods = [m for m in methods + peers if wanted(m, args.only)]
        for method in [] if args.skip_hot else [m for m in methods if m.hot]:
            C.progress(f"  {name} hot {method.name}")
            rec = summarize(measure(method, paths, torch, device, checker, repeat, args.budget,
                                    False), nbytes)
            rec["layout"] = name
            doc["results"].append(rec)
        if name in cold_layouts:
            t0 = time.perf_counter()
            flush(paths)
            doc["layouts"][name]["flush_s"] = time.perf_counter() - t0
            for method in methods:
                if (method.name in ("pinned copy ceiling", "instant_staging hugepages")
                        or not wanted(method, args.cold_only)):
                    continue
                C.progress(f"  {name} cold {method.name}")
                rec = summarize(measure(method, paths, torch, device, checker, 1, args.budget,
                                        True), nbytes)
                rec["layout"] = name
                doc["results"].append(rec)
        del checker
        _free(torch, device)
    compare(doc["results"])
    print(C.table(["layout", "cache", "method", "kind", "best s", "GB/s best", "GB/s median",
                   "GB/s first", "TTFT ms", "peak RSS", "bit-exact; vs best peer; vs reads"],
                  [row(r) for r in doc["results"]]))
    for name, lay in doc["layouts"].items():
        print(f"layout {name}: {lay['files']} file(s), {lay['tensors']} tensors, "
              f"{lay['bytes'] / 1e9:.2f} GB")
    for note in doc["notes"]:
        print("note:", note)
    doc["seconds"] = time.perf_counter() - started
    print(f"total {doc['seconds']:.0f} s")
    C.write_json(args.json, doc)
    bad = [r for r in doc["results"] if r["bit_exact"] is False
           or (r["error"] and r["method"].startswith(("instant_staging", "is ", "read ")))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
