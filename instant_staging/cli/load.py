"""load: load safetensors files through a StagingBuffer and report how fast.

``load()`` makes the staging buffer itself (sized by what the files can
use; the loader's slots are whole chunks inside each registration), hands it to
``instant_staging.loader.load_file`` and returns a plain dict with the
tensor count, bytes, seconds, GB/s and the staging kind reached.
``Progress`` is the progress callback: a bar on a terminal, a line per
tenth otherwise.  Nothing here prints to stdout.
"""

import mmap
import threading
import time

from .. import defaults
from .._types import format_size
from .report import attempt_dict


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


class Progress:
    """``progress(done_bytes, total_bytes)`` for the loader; thread-safe.

    ``bar=True`` redraws one line in place (a terminal); otherwise a plain
    line is written at each tenth, and nothing when ``quiet``.
    """

    WIDTH = 30

    def __init__(self, stream, *, bar, quiet=False, interval=0.1):
        self._stream = stream
        self._bar = bar
        self._quiet = quiet and not bar
        self._interval = interval
        self._lock = threading.Lock()
        self._start = time.perf_counter()
        self._last_draw = 0.0
        self._last_tenth = 0
        self._drawn = False

    def __call__(self, done, total):
        if self._quiet:
            return
        with self._lock:
            if self._bar:
                self._draw_bar(done, total)
            else:
                self._plain(done, total)

    def _rate(self, done):
        return done / max(time.perf_counter() - self._start, 1e-9) / 1e9

    def _draw_bar(self, done, total):
        now = time.perf_counter()
        if done < total and now - self._last_draw < self._interval:
            return  # redraw at most every `interval` seconds
        self._last_draw = now
        frac = done / total if total else 1.0
        filled = int(frac * self.WIDTH)
        self._stream.write(f"\r[{'#' * filled}{' ' * (self.WIDTH - filled)}] {frac:4.0%} "
                           f"{format_size(done)} / {format_size(total)} "
                           f"{self._rate(done):.1f} GB/s ")
        self._stream.flush()
        self._drawn = True

    def _plain(self, done, total):
        tenth = int(10 * done / total) if total else 10
        if tenth <= self._last_tenth:
            return
        self._last_tenth = tenth
        self._stream.write(f"loaded {tenth * 10}%: {format_size(done)} of "
                           f"{format_size(total)}, {self._rate(done):.1f} GB/s\n")
        self._stream.flush()

    def close(self):
        """Ends the bar's line."""
        with self._lock:
            if self._drawn:
                self._stream.write("\n")
                self._stream.flush()
                self._drawn = False


def _check_device(device):
    # Before any allocation, and in plain words (torch's own is an
    # AssertionError deep inside the first allocation).
    import torch
    if not torch.cuda.is_available():
        raise NoDevice(f"cannot load to {device}: torch {torch.__version__} sees no GPU "
                       "(torch.cuda.is_available() is False); --device cpu loads to memory")


def _synchronize(device):
    # The loader returns when its copies are issued and done; synchronizing
    # again costs nothing and keeps the timing honest whatever it does.
    import torch
    if str(device).startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize(device)


def staging_dict(buf, seconds):
    return {"kind": buf.kind.name, "pinned": buf.pinned, "size": buf.size,
            "segment_size": buf.segment_size, "seconds": seconds,
            "attempts": [attempt_dict(a) for a in buf.attempts]}


def _host_staging(size):
    # A load to CPU memory gains nothing from pinning: the loader stages
    # through ordinary memory of its own.
    return {"kind": "HOST", "pinned": False, "size": size, "segment_size": None,
            "seconds": 0.0, "attempts": []}


def _make_staging(size, chunk_size, allow_pageable, runtime):
    from .._staging import StagingBuffer
    page = mmap.PAGESIZE
    # As the loader does: segments hold at least one chunk, so chunks
    # larger than the default segment still fit in one registration; the
    # loader cuts whole chunks inside each registration (no copy_unit).
    segment = max(defaults.SEGMENT_SIZE, -(-min(chunk_size, size) // page) * page)
    t0 = time.perf_counter()
    buf = StagingBuffer(size, segment_size=segment, allow_pageable=allow_pageable,
                        runtime=runtime)
    return buf, staging_dict(buf, time.perf_counter() - t0)


def _is_cpu(device):
    return str(device).split(":")[0] == "cpu"


def load(paths, *, device="cuda:0", chunk_size=defaults.CHUNK_SIZE, io_depth=defaults.IO_DEPTH, threads=None,
         verify=False, staging_bytes=None, allow_pageable=False, runtime=None,
         progress=None):
    """Loads ``paths``; returns the result dict (the tensors are dropped).

    Raises ImportError (no torch), NoDevice, StagingError, and whatever the loader raises
    (SafetensorsError, a ValueError, for a bad file; LoadError, a
    RuntimeError, for a failed read or copy).
    """
    import os

    from .. import loader
    data_bytes = sum(os.path.getsize(p) for p in paths)
    size = staging_bytes or staging_size(chunk_size, io_depth, data_bytes)
    if size < min(chunk_size, data_bytes):
        raise ValueError(f"the staging buffer ({format_size(size)}) must hold at least one "
                         f"chunk ({format_size(chunk_size)})")
    if _is_cpu(device):
        buf, staging = None, _host_staging(size)
    else:
        _check_device(device)
        buf, staging = _make_staging(size, chunk_size, allow_pageable, runtime)
    try:
        t0 = time.perf_counter()
        tensors = loader.load_file(list(paths), device, chunk_size=chunk_size,
                                   io_depth=io_depth, threads=threads, staging=buf,
                                   verify=verify, progress=progress)
        _synchronize(device)
        seconds = time.perf_counter() - t0
    finally:
        if buf is not None:
            buf.close()
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return {"command": "load", "ok": True, "files": [str(p) for p in paths],
            "device": str(device), "tensors": len(tensors), "bytes": nbytes,
            "seconds": seconds, "gbps": nbytes / max(seconds, 1e-9) / 1e9,
            "chunk_size": chunk_size, "io_depth": io_depth, "threads": threads,
            "verified": bool(verify), "staging": staging}


def format_text(result):
    s = result["staging"]
    if s["kind"] == "HOST":
        pinned = " (ordinary memory: a load to the CPU needs no pinning)"
    else:
        pinned = "" if s["pinned"] else " (NOT pinned: several times slower)"
    segments = f" (segments of {format_size(s['segment_size'])})" if s["segment_size"] else ""
    return [f"{result['tensors']} tensors, {format_size(result['bytes'])} to "
            f"{result['device']} in {result['seconds']:.3f} s: {result['gbps']:.2f} GB/s"
            + (", verified" if result["verified"] else ""),
            f"staging: {s['kind']}{pinned}, {format_size(s['size'])}{segments}, "
            f"made in {s['seconds']:.3f} s"]
