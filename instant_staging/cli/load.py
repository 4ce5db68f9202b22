"""load: load safetensors checkpoints through a StagingBuffer and report how fast.

``sources()`` turns the command's SOURCE arguments (files, a directory, an
index.json) into a ``load_file`` source.  ``load()`` makes the staging
buffer itself (sized by what the files can use; the loader's slots are
whole chunks inside each registration, so any chunk size works), hands it
to ``instant_staging.loader.iter_load`` and returns a plain dict with the
tensor count, the bytes read, seconds (torch imported before the clock
starts), GB/s and the staging kind reached.
``Progress`` is the progress callback: a bar on a terminal, a line per
tenth otherwise.  Nothing here prints to stdout.
"""

import os
import time

from .. import defaults
from .._types import StagingError, format_size
from ..loader._progress import (
    Progress,  # noqa: F401  (the CLI's progress, one implementation)
    format_si,
)
from .report import attempt_dict, describe_attempt, error_result


class NoDevice(RuntimeError):
    """torch sees no GPU for a load to one."""


def staging_size(chunk_size, io_depth, data_bytes=None):
    """The staging bytes a load can use: ``io_depth`` slots of ``chunk_size``,
    but no more chunks, and no larger ones, than ``data_bytes`` of files
    hold (so ``--chunk-size 99999GiB`` or ``--io-depth 99999999999`` size
    the buffer by the files, as the loader sizes its own)."""
    if data_bytes is not None:
        chunk_size = max(1, min(chunk_size, data_bytes))
        io_depth = max(1, min(io_depth, -(-data_bytes // chunk_size)))
    return chunk_size * io_depth


def device_error(device):
    """The usage error of ``--device`` (one line), or None: a name the
    loader refuses whatever the host (``loader._target.parse_device``)."""
    from ..loader._target import _import_torch, parse_device
    try:
        parse_device(_import_torch(), device)
    except ValueError as e:
        return f"--device: {e}"
    return None


def _check_device(device):
    # Before the staging buffer is made (without a GPU its pinning would be
    # the first failure): the loader's own rule, as the loader words it.
    import torch

    from ..loader._target import _resolve_device
    try:
        _resolve_device(torch, device)
    except ValueError as e:
        raise NoDevice(f"cannot load to {device}: {e} (--device cpu loads to memory)") from None


def _synchronize(device):
    # The loader returns when its copies are issued and done; synchronizing
    # again costs nothing and keeps the timing honest whatever it does.
    import torch
    if str(device).startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize(device)


def staging_dict(buf, seconds):
    return {"kind": buf.kind.name, "pinned": buf.pinned, "size": buf.size,
            "segment_size": buf.segment_size, "seconds": seconds,
            "hugepages": {"on": buf.hugepages, "why": buf.hugepages_reason},
            "attempts": [attempt_dict(a) for a in buf.attempts]}


def _host_staging(size):
    # A load to CPU memory gains nothing from pinning: the loader stages
    # through ordinary memory of its own.
    return {"kind": "HOST", "pinned": False, "size": size, "segment_size": None,
            "seconds": 0.0, "hugepages": None, "attempts": []}


def _make_staging(size, chunk_size, allow_pageable, runtime):
    from .._staging import StagingBuffer
    # As the loader's own buffer: every registration holds a whole chunk.
    segment = defaults.staging_segment_size(min(chunk_size, size))
    t0 = time.perf_counter()
    buf = StagingBuffer(size, segment_size=segment, allow_pageable=allow_pageable,
                        runtime=runtime)
    return buf, staging_dict(buf, time.perf_counter() - t0)


def _is_cpu(device):
    return str(device).split(":")[0] == "cpu"


def sources(args):
    """What ``load SOURCE...`` loads: one SOURCE as given (a file, a
    directory or an index.json: resolved here so that a missing file or a bad
    index is a usage error), several as the list of the shards each names.
    Raises OSError, ValueError or TypeError with the message to show."""
    from ..loader._source import resolve
    shards = []
    for arg in args:
        paths = resolve(arg).paths
        for path in paths:
            if not os.path.isfile(path):
                if os.path.exists(path):        # a FIFO, a device: reads that need not end
                    raise ValueError(f"not a regular file: {path}")
                raise FileNotFoundError(f"no such file: {path}")
            if any(os.path.samefile(path, p) for p in shards):
                raise ValueError(f"{path} is given twice (SOURCE {arg} names it again)")
            shards.append(path)
    return args[0] if len(args) == 1 else shards


def cold_knobs(source):
    """The loader's knobs for ``source`` where the page cache lacks it
    (``loader._load._for_cache``), else {}; {} too where its headers cannot
    be read (the load reports that)."""
    from ..loader._checkpoint import _Checkpoint
    from ..loader._load import _for_cache
    from ..loader._source import resolve
    try:
        checkpoint = _Checkpoint(resolve(source).paths)
    except (OSError, ValueError):
        return {}
    try:
        return _for_cache(checkpoint)
    finally:
        checkpoint.close()


def load(source, *, device="cuda:0", dtype=None, chunk_size=defaults.CHUNK_SIZE,
         io_depth=defaults.IO_DEPTH, threads=None, verify=False, staging_bytes=None,
         allow_pageable=False, runtime=None, progress=None):
    """Loads ``source`` (as ``load_file``'s); returns the result dict (each
    tensor is dropped as it arrives).  ``bytes`` are the bytes read from the
    files; the time excludes importing torch and making the staging buffer.

    Raises ImportError (no torch), NoDevice, StagingError, and whatever the loader raises
    (SafetensorsError, a ValueError, for a bad file; LoadError, a
    RuntimeError, for a failed read or copy).
    """
    from .. import loader
    from ..loader._source import resolve
    from ..loader._target import _import_torch
    if not isinstance(source, (str, bytes, os.PathLike)):
        source = list(source)
    files = [str(p) for p in resolve(source).paths]
    data_bytes = sum(os.path.getsize(p) for p in files)
    io_depth = defaults.io_depth_for(io_depth, threads)     # as the loader
    size = staging_bytes or staging_size(chunk_size, io_depth, data_bytes)
    if size < min(chunk_size, data_bytes):
        raise ValueError(f"the staging buffer ({format_size(size)}) must hold at least one "
                         f"chunk ({format_size(chunk_size)})")
    _import_torch()              # not part of the load's time
    if _is_cpu(device):
        buf, staging = None, _host_staging(size)
    else:
        _check_device(device)
        buf, staging = _make_staging(size, chunk_size, allow_pageable, runtime)
    failed = None
    try:
        t0 = time.perf_counter()
        count = 0
        with loader.iter_load(source, device, dtype=dtype, chunk_size=chunk_size,
                              io_depth=io_depth, threads=threads, staging=buf,
                              verify=verify, progress=progress) as it:
            for _ in it:
                count += 1
            nbytes = it.total_bytes
        _synchronize(device)
        seconds = time.perf_counter() - t0
    except (OSError, ValueError, RuntimeError) as e:
        # A bad file (SafetensorsError), a failed read or copy (LoadError),
        # torch's own: the run failed; its report keeps the staging attempts.
        failed = e
    finally:
        if buf is not None:
            try:
                buf.close()
            except StagingError as e:          # ReleaseError: memory retained
                failed = failed or e
    if failed is not None:
        return {"command": "load", "ok": False, "files": files, "device": str(device),
                "dtype": None if dtype is None else str(dtype), "chunk_size": chunk_size,
                "io_depth": io_depth, "threads": threads, "staging": staging,
                "error": error_result("load", failed)["error"]}
    return {"command": "load", "ok": True, "files": files,
            "device": str(device), "dtype": None if dtype is None else str(dtype),
            "tensors": count, "bytes": nbytes,
            "seconds": seconds, "gbps": nbytes / max(seconds, 1e-9) / 1e9,
            "chunk_size": chunk_size, "io_depth": io_depth, "threads": threads,
            "verified": bool(verify), "staging": staging}


def format_text(result):
    if not result["ok"]:
        s = result["staging"]
        lines = [f"load failed: {result['error']['type']}: {result['error']['message']}"]
        if s["kind"] != "HOST":
            lines.append(f"staging: {s['kind']}, {format_size(s['size'])}, made in "
                         f"{s['seconds']:.3f} s")
            lines += ["  " + describe_attempt(a) for a in s["attempts"]]
        return lines
    s = result["staging"]
    if s["kind"] == "HOST":
        pinned = " (ordinary memory: a load to the CPU needs no pinning)"
    else:
        pinned = "" if s["pinned"] else " (NOT pinned: several times slower)"
    segments = f" (segments of {format_size(s['segment_size'])})" if s["segment_size"] else ""
    if s["hugepages"] is not None:
        segments += ", 2 MiB huge pages" if s["hugepages"]["on"] else ", 4 KiB pages"
    as_dtype = f" as {result['dtype']}" if result.get("dtype") else ""
    # Bytes and rate in one unit system (decimal, as GB/s is).
    return [f"{result['tensors']} tensors, {format_si(result['bytes'])} to "
            f"{result['device']}{as_dtype} in {result['seconds']:.3f} s: {result['gbps']:.2f} GB/s"
            + (", verified" if result["verified"] else ""),
            f"staging: {s['kind']}{pinned}, {format_size(s['size'])}{segments}, "
            f"made in {s['seconds']:.3f} s"]
