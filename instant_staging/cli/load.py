"""load: load safetensors checkpoints through a StagingBuffer and report how fast.

``sources()`` turns the command's SOURCE arguments (files, a directory, an
index.json, URLs, hub ids) into a ``Checkpoint.open`` source, with the
checks of local paths (a missing file, a FIFO, a file named twice) as usage
errors; a hub id resolves as ``from_pretrained``'s does (``_hub``: the
weights of its snapshot in huggingface_hub's cache, fetched unless offline);
``open_checkpoint()`` opens it once (its shards resolved, every header
parsed), telling a SOURCE named wrongly (``UsageError``) from a bad file.
``knobs()`` gives the load's knobs: the user's, else the checkpoint's own
(as ``load_file`` chooses them).  ``load()`` makes the staging buffer
itself (sized by what the checkpoint can use; the loader's slots are whole
chunks inside each registration, so any chunk size works), loads with
``checkpoint.iter_load`` and returns a plain dict with the figures of the
load's ``LoadReport``: the tensor count, the bytes read, seconds (torch
imported and the staging buffer made before the load's clock starts), the
rate and the staging kind reached (shown in the package's one unit system,
``format_size``/``format_rate``; the JSON's ``gbps`` is 10^9 bytes/s, as
its name says).
``Progress`` is the progress callback: a bar on a terminal, a line per
tenth otherwise.  Nothing here prints to stdout.
"""

import os
import re
import time

from .. import _hub, defaults
from .._types import StagingError, format_rate, format_size
from ..loader import (
    Checkpoint,
    Progress,  # noqa: F401  (the CLI's progress, one implementation)
    SafetensorsError,
    import_torch,
    parse_device,
    redact_text,
    redact_url,
    resolve_device,
    resolve_source,
)
from .report import attempt_dict, describe_attempt, error_result

# A SOURCE with a scheme (s3://, gs://, az://, https://, ...) goes to
# Checkpoint.open as it is (the object store resolves it): no local checks.
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


class UsageError(ValueError):
    """A SOURCE named wrongly (one line, exit 2)."""


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
    loader refuses whatever the host (``loader.parse_device``)."""
    try:
        parse_device(import_torch(), device)
    except ValueError as e:
        return f"--device: {e}"
    return None


def _check_device(device):
    # Before the staging buffer is made (without a GPU its pinning would be
    # the first failure): the loader's own rule, as the loader words it.
    try:
        resolve_device(import_torch(), device)
    except ValueError as e:
        raise NoDevice(f"cannot load to {device}: {e} (--device cpu loads to memory)") from None


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


def is_url(arg):
    return isinstance(arg, str) and _URL.match(arg) is not None


def _check_file(path):
    if not os.path.isfile(path):
        if os.path.exists(path):        # a FIFO, a device: reads that need not end
            raise ValueError(f"not a regular file: {path}")
        raise FileNotFoundError(f"no such file: {path}")


def hub_source(arg, revision=None):
    """``arg`` as it is where it is a local path or cannot name a hub repo;
    else the weights of the hub id's (or hf:// URL's) files in
    huggingface_hub's cache, as every door of the loader reads them
    (``_hub.files``: only the weights fetched, unless offline).
    FileNotFoundError (one line) where it is neither a path nor a model there."""
    if os.path.exists(arg):
        return arg
    if _hub.is_hf_url(arg):
        return _hub.files(_hub.hub_source(arg, revision), given=arg)
    if not _hub.may_be_hub_id(arg):
        return arg
    try:
        return _hub.files(_hub.HubSource(arg, revision), given=arg)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"no such file or directory: {arg}, nor a model on the hub ({e})") from None


def sources(args, revision=None):
    """What ``load SOURCE...`` opens (``Checkpoint.open``'s source): one
    SOURCE as given (a file, a directory, an index.json, a URL; a hub id as
    the weights of its snapshot, at ``revision``); several local ones as the
    list of the shards each names (each resolved here, nothing opened);
    several URLs as their list.  Raises OSError, ValueError or TypeError
    with the message to show (a usage error), or SafetensorsError for a bad
    index among several (the load's failure)."""
    urls = [is_url(arg) and not _hub.is_hf_url(arg) for arg in args]
    if any(urls):
        if not all(urls):
            raise ValueError("a load reads local files or URLs, not both: "
                             f"{redact_url(next(a for a, u in zip(args, urls) if u))} is a URL, "
                             f"{next(a for a, u in zip(args, urls) if not u)} is not")
        if revision is not None:
            raise ValueError("--revision applies to a hub id SOURCE (or hf://), not to a URL")
        return args[0] if len(args) == 1 else list(args)
    given, args = args, [hub_source(arg, revision) for arg in args]
    if revision is not None and args == list(given):
        raise ValueError("--revision applies to a hub id SOURCE (org/name), and none is given")
    if len(args) == 1:
        if not os.path.isdir(args[0]) and not args[0].endswith(".json"):
            _check_file(args[0])
        # A directory's or an index's shards: Checkpoint.open resolves them
        # (a missing shard is its FileNotFoundError) and checks the index
        # against the headers.
        return args[0]
    shards = []
    for arg in args:
        for path in resolve_source(arg).paths:
            _check_file(path)
            if any(os.path.samefile(path, p) for p in shards):
                raise ValueError(f"{path} is given twice (SOURCE {arg} names it again)")
            shards.append(path)
    return shards


def open_checkpoint(source, cache_dir=None):
    """``Checkpoint.open(source, cache_dir=cache_dir)``: every header parsed, once.  Raises
    ``UsageError`` for a SOURCE named wrongly (a file, a shard or an object
    that is not there, a source of the wrong form, a URL without the
    client its extra installs), else what the loader raised (a bad file: a
    SafetensorsError; a read that failed: an OSError)."""
    try:
        return Checkpoint.open(source, cache_dir=cache_dir)
    except SafetensorsError:
        raise
    except ImportError as e:
        if not is_url(source if isinstance(source, str) else source[0]):
            raise
        # "reading from object storage needs the obstore client: pip install '...[remote]'"
        raise UsageError(str(e).strip().splitlines()[0]) from None
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, TypeError, ValueError) as e:
        raise UsageError(redact_text(str(e))) from None


def knobs(checkpoint, options):
    """``(chunk_size, io_depth, threads)`` of a load of ``checkpoint``: those
    of ``options`` (a ``LoadOptions`` of the flags and the variables), or,
    where the user set none of them, the checkpoint's own (the cold ones
    where the page cache lacks it, the remote ones for a URL), as
    ``Checkpoint.load`` would choose them.  The command needs them before
    the load (they size its staging buffer) and passes them to it: the page
    cache is sampled once."""
    chosen = options.for_checkpoint(checkpoint)
    return chosen.chunk_size, chosen.io_depth, chosen.threads


def load(source, *, device="cuda:0", dtype=None, chunk_size=defaults.CHUNK_SIZE,
         io_depth=defaults.IO_DEPTH, threads=None, verify=False, staging_bytes=None,
         allow_pageable=False, runtime=None, progress=None, max_bytes_per_second=None):
    """Loads ``source``: a ``Checkpoint`` (left open), or ``load_file``'s
    source (opened here, and closed); returns the result dict (each tensor
    is dropped as it arrives) with the figures of the load's
    ``LoadReport``: ``bytes`` are the bytes read, ``seconds`` exclude
    importing torch and making the staging buffer.

    Raises ImportError (no torch), NoDevice, StagingError, and whatever the loader raises
    (SafetensorsError, a ValueError, for a bad file; LoadError, a
    RuntimeError, for a failed read or copy).
    """
    args = (device, dtype, chunk_size, io_depth, threads, verify, staging_bytes, allow_pageable,
            runtime, progress, max_bytes_per_second)
    if isinstance(source, Checkpoint):
        return _load(source, *args)
    if not isinstance(source, (str, bytes, os.PathLike)):
        source = list(source)
    with Checkpoint.open(source) as checkpoint:
        return _load(checkpoint, *args)


def _load(checkpoint, device, dtype, chunk_size, io_depth, threads, verify, staging_bytes,
          allow_pageable, runtime, progress, max_bytes_per_second=None):
    files = checkpoint.files
    data_bytes = checkpoint.nbytes
    io_depth = defaults.io_depth_for(io_depth, threads)     # as the loader
    size = staging_bytes or staging_size(chunk_size, io_depth, data_bytes)
    if size < min(chunk_size, data_bytes):
        raise ValueError(f"the staging buffer ({format_size(size)}) must hold at least one "
                         f"chunk ({format_size(chunk_size)})")
    import_torch()              # not part of the load's time
    if _is_cpu(device):
        buf, staging = None, _host_staging(size)
    else:
        _check_device(device)
        buf, staging = _make_staging(size, chunk_size, allow_pageable, runtime)
    failed = report = None
    try:
        with checkpoint.iter_load(device, dtype=dtype, chunk_size=chunk_size, io_depth=io_depth,
                                  threads=threads, staging=buf, verify=verify,
                                  progress=progress,
                                  max_bytes_per_second=max_bytes_per_second) as it:
            for _ in it:
                pass
        report = it.report
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
    # The knobs as the load resolves them (None: the default, a number here).
    threads = defaults.reader_threads(threads)
    if failed is not None:
        return {"command": "load", "ok": False, "files": files, "device": str(device),
                "dtype": None if dtype is None else str(dtype), "chunk_size": chunk_size,
                "io_depth": io_depth, "threads": threads, "staging": staging,
                "error": error_result("load", failed)["error"]}
    # The kind the load staged through, as its report says (a CPU load's
    # ordinary memory: none, shown as HOST).
    staging["kind"] = report.staging_kind or staging["kind"]
    # Every figure of the LoadReport (its phases: open, prepare, load), the
    # run's own where it has one.
    result = {"command": "load", "ok": True, "files": files,
              "dtype": None if dtype is None else str(dtype), **report_fields(report)}
    result.update(device=report.device or str(device),
                  chunk_size=report.chunk_size or chunk_size, io_depth=io_depth, threads=threads,
                  reader_threads=report.threads if report.threads is not None else threads,
                  verified=bool(verify), staging=staging)
    return result


# The LoadReport's fields the JSON names otherwise: "threads" is the knob
# (the reader threads that ran, no more than the load has chunks, are
# "reader_threads"); the staging kind is said in "staging".
_REPORT_NAMES = {"threads": "reader_threads", "staging_kind": None}


def report_fields(report):
    """Every field of ``report`` (a ``LoadReport``) under its JSON name: a
    field added to the report reaches ``load --json`` as it is."""
    out = {}
    for name, value in report._asdict().items():
        key = _REPORT_NAMES.get(name, name)
        if key is not None:
            out[key] = dict(value) if isinstance(value, dict) else value
    return out


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
    rate = format_rate(result["bytes"] / max(result["seconds"], 1e-9), digits=2)
    return [f"{result['tensors']} tensors, {format_size(result['bytes'])} to "
            f"{result['device']}{as_dtype} in {result['seconds']:.3f} s: {rate}"
            + (", verified" if result["verified"] else ""),
            f"staging: {s['kind']}{pinned}, {format_size(s['size'])}{segments}, "
            f"made in {s['seconds']:.3f} s"]
