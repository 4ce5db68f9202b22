"""The load itself: the plan, the reader pipeline, the consumer.

Each tensor gets its own allocation of the file's dtype and shape, and
reader threads (``_pipeline.pyx``, C, no GIL) read chunks of ``chunk_size``
into the staging buffer's slots and copy them out: to a GPU through the
buffer's runtime table on their own streams, with an event per slot so that
a slot is refilled only after its copy finished; to the CPU with memcpy.

Who owns what, at each moment:

- the checkpoint's file descriptors belong to the load from ``iter_load``
  until the generator's ``finally`` (or ``LoadIterator.close()`` for a load
  that never started) closes them, always after ``Pipeline.close()`` joined
  the readers, so no reader can ever read a reused descriptor number;
- the staging buffer is held by the Pipeline from its construction until
  its threads are joined (``StagingBuffer.close()`` raises meanwhile); a
  buffer the load made itself (or took from an earlier load) then goes
  back to ``_staging_pool``, which keeps it for the next load or closes it;
- tensors not yet yielded are freed after the join; yielded ones are the
  caller's;
- ``LoadIterator.close()`` may come from any thread: it cancels and joins
  the pipeline first (no lock needed), then takes the iterator's lock,
  which a ``next()`` in another thread releases as soon as it sees the
  cancel, and closes the generator.
"""

import logging
import os
import sys
import threading
import traceback
from typing import TYPE_CHECKING, Optional

from .._types import format_size
from ..defaults import (
    CHUNK_SIZE,
    COLD_CHUNK_SIZE,
    COLD_THREADS,
    io_depth_for,
    reader_threads,
    staging_segment_size,
)
from . import _gc, _progress, _staging_pool
from ._checkpoint import _Checkpoint
from ._errors import LoadError, VerifyError
from ._options import check_backend, knobs, left_unset, torch_dtype
from ._source import resolve
from ._target import _import_torch, _TorchTarget
from ._typing import Device, DType, Names, ProgressArg, Source

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

    from .._staging import StagingBuffer

log = logging.getLogger("instant_staging")

# How often the consumer wakes to report progress while no tensor finishes.
_POLL_SECONDS = 0.05
# verify=True compares in pieces of this many bytes.
_VERIFY_STEP = 64 << 20
# Tensors in the first hand-over, and in each one after it (each takes the
# pipeline's lock once).
_FIRST_BATCH = 4
_BATCH = 32

# -- arguments and the staging buffer -----------------------------------------

def _own_staging(device, size, slot_bytes):
    """A pinned staging buffer of at least ``size`` bytes for one load to
    ``device``: the one an earlier load kept (``_staging_pool.py``), else a
    new one.  Hand it back with ``_staging_pool.give(device, buf)``.

    No ``copy_unit``: the pipeline cuts whole slots inside each
    registration, so any chunk size works; segments are at least one slot.
    """
    segment = staging_segment_size(slot_bytes)
    return _staging_pool.take(device, size, segment, lambda: _make_staging(size, segment))


def _make_staging(size, segment):
    from .._staging import StagingBuffer
    from .._types import StagingError
    try:
        # Prefault with the load's thread count rather than one thread per
        # 32 MiB (4 for 128 MiB): making the buffer is on the critical path
        # of a load that keeps none, 26-33 ms of a 140 ms MoE load on the
        # H200 host.
        return StagingBuffer(size, segment_size=segment, prefault_threads=_prefault_threads(size),
                             hugepages=_hugepages(size))
    except StagingError as e:
        # Its message suggests StagingBuffer's own knobs; load_file's are these.
        raise StagingError(
            f"no pinned staging buffer of {format_size(size)} for the load ("
            + "; ".join(f"{a.step} failed with {a.name or 'an error'}" for a in e.attempts if not a.ok)
            + "): pass staging=StagingBuffer(size, allow_pageable=True) to load through "
            "unpinned memory, or a smaller chunk_size / io_depth", e.attempts) from None


def _hugepages(size):
    """INSTANT_STAGING_HUGEPAGES where set; else huge pages when the host
    holds them free (``_hugepages.py``)."""
    from .._hugepages import env_setting, huge_pages_free
    setting = env_setting()
    return huge_pages_free(size) if setting is None else setting


def _for_cache(checkpoint):
    """The knobs for a checkpoint the page cache mostly lacks (read from
    disk: larger reads, fewer threads; ``defaults.COLD_CHUNK_SIZE``); none
    for one it holds, or where that cannot be told."""
    resident = checkpoint.resident()
    if resident is None or resident >= 0.5:
        return {}
    log.info("%.0f%% of the sampled pages of the checkpoint are in the page cache: reading it "
             "from disk in %s pieces with %d threads (chunk_size=, io_depth=, threads= or "
             "INSTANT_STAGING_* choose otherwise)", 100 * resident, format_size(COLD_CHUNK_SIZE),
             COLD_THREADS)
    return {"chunk_size": COLD_CHUNK_SIZE, "io_depth": None, "threads": COLD_THREADS}


def _check_staging(staging):
    from .._staging import StagingBuffer
    if not isinstance(staging, StagingBuffer):
        raise TypeError(f"staging must be an instant_staging.StagingBuffer, not {type(staging).__name__}")
    if staging.closed:
        raise ValueError("staging buffer is closed")


def _prefault_threads(size):
    from .._staging import auto_prefault_threads
    # One thread per 4 MiB (a slot), up to the load's reader threads;
    # INSTANT_STAGING_PREFAULT_THREADS still decides where it is set.
    return auto_prefault_threads(size, bytes_per_thread=4 << 20, max_threads=reader_threads())


def _check_args(chunk_size, io_depth, threads):
    # io_depth and threads may stay None (defaults.io_depth_for, reader_threads).
    for name, value, optional in (("chunk_size", chunk_size, False), ("io_depth", io_depth, True),
                                  ("threads", threads, True)):
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int{' or None' if optional else ''}, "
                            f"not {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def _fault_plan(staging):
    """The plan whose ``read`` and ``copy`` rules this load obeys: that of the
    staging buffer's runtime if it has one, else INSTANT_STAGING_FAULTS."""
    from .._faults import FaultyRuntime
    from .._simulated import SimulatedRuntime
    from ..faults import FaultPlan
    if staging is not None:
        runtime = staging.runtime
        if isinstance(runtime, (FaultyRuntime, SimulatedRuntime)) and runtime.plan is not None:
            return runtime.plan
    return FaultPlan.from_env()


# -- the public functions ------------------------------------------------------

class _LoadState:
    """What a load shares with its LoadIterator.  The generator and the
    iterator both point here (never at each other), so dropping the
    iterator frees the load at once."""

    __slots__ = ("cancelled", "finished", "pipe", "staging_kind", "threads")

    def __init__(self):
        self.pipe = None
        self.staging_kind = None
        self.threads = None
        self.finished = False
        self.cancelled = False


class LoadIterator:
    """Yields ``(name, tensor)`` as tensors finish.

    ``close()`` (or leaving a ``with`` block, or dropping it) stops the load,
    waits for in-flight copies, joins the reader threads, frees every tensor
    not yet yielded, and only then closes the files.  It may be called from
    any thread (a watchdog's cancel): a ``next()`` running in another thread
    then raises ``LoadError`` ("cancelled"), and so does every ``next()``
    after closing an unfinished load.  In a forked child ``next()`` raises
    ``LoadError`` (the reader threads are the parent's).
    """

    def __init__(self, checkpoint, target, dtypes, *, staging=None, chunk_size=CHUNK_SIZE,
                 io_depth=None, threads=None, verify=False, progress=None, faults=None):
        self._state = _LoadState()
        self._lock = threading.RLock()     # one next() or close() at a time
        self._pid = os.getpid()
        self._checkpoint = checkpoint
        self._generator = self._generate(self._state, checkpoint, target, dtypes, staging=staging,
                                         chunk_size=chunk_size, io_depth=io_depth, threads=threads,
                                         verify=verify, progress=progress, faults=faults)
        self.names = [t.name for _, t in checkpoint.entries]
        self.total_bytes = checkpoint.total_bytes

    def _generate(self, state, checkpoint, target, dtypes, **options):
        """The generator of the load (a process group's iterator has its own)."""
        return _load(state, checkpoint, target, dtypes, **options)

    @property
    def staging_kind(self):
        """The Kind of the staging buffer in use once loading started (None
        before, and for ordinary memory when loading to the CPU)."""
        return self._state.staging_kind

    @property
    def threads(self):
        """Reader threads of this load, once it started."""
        return self._state.threads

    def __iter__(self) -> "LoadIterator":
        return self

    def __next__(self) -> tuple[str, "torch.Tensor"]:
        if os.getpid() != self._pid:
            raise LoadError(f"this load was started by process {self._pid}; a forked child "
                            "cannot continue it (its reader threads exist only in the parent)")
        with self._lock:
            if self._state.cancelled:
                raise LoadError("the load was cancelled: its iterator was closed before it finished")
            return next(self._generator)

    def close(self):
        state = self._state
        if os.getpid() != self._pid:
            self._close_in_fork_child()
            return
        if not state.finished:
            state.cancelled = True
        pipe = state.pipe
        if pipe is not None:
            pipe.cancel()
            pipe.close()     # stop, join: from here on no reader touches anything
        with self._lock:
            if self._generator.gi_running:
                # close() from inside this load (a progress callback): the
                # generator sees the cancel and cleans up as it unwinds.
                return
            self._generator.close()      # frees the tensors and the load's buffer
            self._checkpoint.close()     # (the generator's finally did, if it ran)

    def _close_in_fork_child(self):
        # The parent's threads do not exist here and its locks may have been
        # copied held: take none; drop the hold and our copies of the fds.
        self._state.cancelled = True
        if self._state.pipe is not None:
            self._state.pipe.close()
        if not self._generator.gi_running:
            self._generator.close()
        self._checkpoint.close()

    def __enter__(self) -> "LoadIterator":
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def iter_load(source: Source, device: Device = "cpu", *, dtype: DType = None, names: Names = None,
              process_group: Optional["ProcessGroup"] = None, chunk_size: Optional[int] = None,
              io_depth: Optional[int] = None, threads: Optional[int] = None,
              staging: Optional["StagingBuffer"] = None, verify: bool = False,
              progress: ProgressArg = None, backend: str = "mmap") -> "LoadIterator":
    """Loads safetensors file(s), yielding ``(name, tensor)`` as each finishes.

    Headers are parsed and validated when this is called; the load runs
    while the iterator is consumed.  Arguments are those of ``load_file``.
    """
    def prepare():
        check_backend(backend)
        knobs_ = knobs(chunk_size, io_depth, threads)
        _check_args(*knobs_)
        if staging is not None:
            _check_staging(staging)
        options = dict(zip(("chunk_size", "io_depth", "threads"), knobs_), staging=staging,
                       verify=verify, progress=_progress.resolve(progress))
        if sys.byteorder != "little":
            raise RuntimeError("safetensors data is little-endian; this loader needs a little-endian host")
        torch = _import_torch()
        # device and dtype first: a bad one is named before any file is opened
        target = _TorchTarget(torch, device, torch_dtype(torch, dtype))
        src = resolve(source)
        checkpoint = _Checkpoint(src.paths)
        try:
            src.check(checkpoint)
            checkpoint.select(names)
            if process_group is None and left_unset(chunk_size, io_depth, threads):
                options.update(_for_cache(checkpoint))
            dtypes = [target.check(t, checkpoint.paths[i]) for i, t in checkpoint.entries]
            options["faults"] = _fault_plan(staging)
        except BaseException:
            checkpoint.close()
            raise
        return checkpoint, target, dtypes, options

    if process_group is not None:
        from ._distributed import iter_load_group
        return iter_load_group(prepare, process_group)
    checkpoint, target, dtypes, options = prepare()
    return LoadIterator(checkpoint, target, dtypes, **options)


def load_file(source: Source, device: Device = "cpu", *, dtype: DType = None, names: Names = None,
              process_group: Optional["ProcessGroup"] = None, chunk_size: Optional[int] = None,
              io_depth: Optional[int] = None, threads: Optional[int] = None,
              staging: Optional["StagingBuffer"] = None, verify: bool = False,
              progress: ProgressArg = None, backend: str = "mmap") -> dict[str, "torch.Tensor"]:
    """Loads safetensors file(s) into ``{name: tensor}`` on ``device``.

    source      a .safetensors path; a list of them (a name in two shards is an
                error); a directory (the shards its model.safetensors.index.json
                lists, else every *.safetensors in it, sorted); or an
                *.safetensors.index.json path
    device      "cpu" (as safetensors), "cuda:N", a torch.device or an int
    dtype       None keeps the file's dtypes; a floating torch dtype (or its name)
                converts floating tensors on the device after the copy, as
                transformers does; integer and bool tensors are kept
    names       None for all; an iterable of tensor names (unknown ones are a
                KeyError, raised before anything is allocated); or a callable
                name -> bool.  Only the selected tensors' bytes are read.
    process_group  a torch.distributed group whose every rank makes this call
                with the same checkpoint: each rank reads about 1/N of the bytes
                and the ranks exchange them over the group, so each byte is read
                from the host once (loader/_distributed.py); names= may differ
                per rank.  A failure on one rank raises on every rank.
    chunk_size  bytes per read and per copy (None: $INSTANT_STAGING_CHUNK_SIZE,
                e.g. 8MiB, else 4 MiB)
    io_depth    chunks in flight, i.e. slots (None: $INSTANT_STAGING_IO_DEPTH, else
                2 per reader thread: 32 with 16 threads); the load's own staging
                buffer holds io_depth * chunk_size; capped at 64 per reader thread
    threads     reader threads (None: $INSTANT_STAGING_THREADS, else one per CPU,
                at most 16; never more than slots); capped at twice the usable
                CPUs (a warning says so)
    staging     a StagingBuffer to reuse instead of making one per load; up to
                io_depth whole chunks inside its registrations are the slots (one
                load at a time per buffer)
    verify      after each tensor is copied, re-read its bytes from the file with
                plain reads (not through the staging buffer) and compare them with
                the tensor's memory on the device; a difference raises VerifyError.
                It checks the copy path (slot reuse, spans, copies), not that the
                file is the one intended: safetensors carries no checksum.
    progress    progress(done_bytes, total_bytes), called from this thread; or
                True: a tqdm bar (a plain line per 10% without tqdm or a terminal)
    backend     "mmap" or "pread", accepted as safetensors' load_file accepts them;
                either way the bytes are read with pread into the staging slots

    Tensors have the file's shape (and dtype, unless ``dtype``) and each owns
    its memory.  A read or copy that fails raises LoadError after waiting for
    the copies in flight and freeing every tensor of the load; the staging
    buffer stays reusable.
    """
    with iter_load(source, device, dtype=dtype, names=names, process_group=process_group,
                   chunk_size=chunk_size, io_depth=io_depth, threads=threads, staging=staging,
                   verify=verify, progress=progress, backend=backend) as it:
        loaded = dict(it)
        return {name: loaded[name] for name in it.names}


# -- the load itself ---------------------------------------------------------

def _load(state, checkpoint, target, dtypes, *, staging, chunk_size, io_depth, threads,
          verify, progress, faults):
    """The generator behind LoadIterator; ``state`` receives the pipeline,
    the staging kind and the thread count."""
    from ._pipeline import DEVICE, Pipeline, Plan
    entries = checkpoint.entries
    device = target.index if target.mode == DEVICE else None
    owned = staging is None and device is not None
    buf = None if owned else staging
    handles = []
    pipe = None
    try:
        plan = Plan([(checkpoint.fds[i], t.begin, t.end) for i, t in entries], chunk_size,
                    faults=faults if faults is not None else _fault_plan(staging))
        threads = reader_threads(threads)
        io_depth = io_depth_for(io_depth, threads)
        # No load uses more slots than it has chunks (io_depth=10**11 is fine).
        depth = min(io_depth, max(plan.n_chunks, 1))
        if owned:
            buf = _own_staging(device, depth * plan.max_chunk, plan.max_chunk)
        # Holds buf from here until its threads are joined (pipe.close()).
        pipe = Pipeline(plan, threads=threads, staging=buf, depth=depth, device=device)
        state.pipe = pipe
        state.staging_kind = buf.kind if buf is not None else None
        state.threads = pipe.n_threads
        target.before_copies()
        _start(pipe, handles, target, entries, dtypes)
        runtime = buf.runtime if buf is not None else None
        yield from _drive(pipe, plan, checkpoint, target, handles, verify, progress, runtime)
        state.finished = True
    except BaseException as e:
        # The traceback's finished frames would keep tensors alive for as
        # long as the caller keeps the exception.
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        if pipe is not None:
            pipe.close()           # stop, join: no copy in flight into what we free next
        handles.clear()
        if owned and buf is not None:
            _staging_pool.give(device, buf)     # kept for the next load, or closed
        checkpoint.close()         # only now: no reader can use a reused fd number


def _start(pipe, handles, target, entries, dtypes):
    """Starts the pipeline, then allocates the tensors (in reading order)
    while the threads already read, handing them over in batches: a thread
    waits only for the tensors of its own chunk.  1,188 tensors of a MoE
    shard took 26 ms to allocate on the H200 host, a third of the 76 ms
    their bytes take to load; before, every byte waited for the last
    allocation.  The threads also fill their slots while torch reserves the
    tensors' block (``reserve``: one cudaMalloc of the load's size, ~4 ms
    for 3.6 GB there).

    (``before_copies`` ran first: allocating queues no GPU work, so every
    block handed out here was freed by work that has finished.)"""
    n, i = len(entries), 0
    try:
        with _gc.paused():
            pipe.start([], more=True)
            target.reserve([e for _, e in entries])
            while i < n:
                end = min(n, i + (_FIRST_BATCH if i == 0 else _BATCH))
                if not pipe.provide([_allocate(handles, target, entries[k][1], dtypes[k])
                                     for k in range(i, end)]):
                    break       # cancelled: _drive reports it
                i = end
    finally:
        pipe.done_providing()


def _allocate(handles, target, entry, dtype):
    """Allocates one tensor into ``handles``; returns its address."""
    handle, ptr = target.allocate(entry, dtype)
    handles.append(handle)
    return ptr


def _drive(pipe, plan, checkpoint, target, handles, verify, progress, runtime):
    """Yields tensors as the pipeline finishes them; raises its first error."""
    total, reported, left = checkpoint.total_bytes, -1, len(handles)
    while True:
        finished, done, exited, failed = pipe.wait(_POLL_SECONDS)
        if failed:
            pipe.close()
            raise _error(pipe, plan, checkpoint, runtime)
        if progress is not None and done != reported:
            progress(done, total)
            reported = done
        for i in finished:
            handle, handles[i] = handles[i], None   # the consumer's from now on
            if verify:
                _verify(checkpoint, i, target, handle)
            left -= 1
            yield checkpoint.entries[i][1].name, target.result(handle)
        if exited:
            break
    if left:
        raise LoadError(f"the load ended with {left} tensor(s) unfinished and no error recorded")


def _error(pipe, plan, checkpoint, runtime):
    from ..faults import ERROR_NAMES
    from ._pipeline import CANCELLED, END_OF_FILE, READ_ERROR, RUNTIME_ERROR
    kind, code, call, chunk, offset = pipe.error()
    if kind == CANCELLED:
        return LoadError("the load was cancelled (its iterator was closed from another "
                         "thread, or the interpreter is exiting)")
    index = plan.tensor_at(chunk, offset)
    path = tensor = None
    where = ""
    if index >= 0:
        file_index, entry = checkpoint.entries[index]
        path, tensor = checkpoint.paths[file_index], entry.name
        where = f"{path}: tensor {tensor!r}: "
    if kind == END_OF_FILE:
        size = os.fstat(checkpoint.fds[file_index]).st_size if index >= 0 else "?"
        return LoadError(f"{where}the file ended at byte {offset} while loading (it is now "
                         f"{size} bytes): was it truncated?", path, tensor, 0)
    if kind == READ_ERROR:
        return LoadError(f"{where}reading at byte {offset} failed: {os.strerror(code)}",
                         path, tensor, code)
    if kind == RUNTIME_ERROR:
        if runtime is not None:
            name, text = runtime.error_name(code), f" ({runtime.error_string(code)})"
        else:
            name = ERROR_NAMES.get(code, f"error {code}")
            text = ""
        return LoadError(f"{where}{call} failed with {name}{text}", path, tensor, code)
    return LoadError(f"could not start reader threads: {os.strerror(code)}", code=code)


def _verify(checkpoint, index, target, handle):
    file_index, entry = checkpoint.entries[index]
    fd, path = checkpoint.fds[file_index], checkpoint.paths[file_index]
    for offset in range(0, entry.nbytes, _VERIFY_STEP):
        data = bytearray(min(_VERIFY_STEP, entry.nbytes - offset))
        got = os.preadv(fd, [data], entry.begin + offset)
        if got != len(data):
            raise VerifyError(f"{path}: tensor {entry.name!r}: the file ended while verifying "
                              f"(byte {entry.begin + offset + got})", path, entry.name)
        if not target.equal(handle, offset, data):
            raise VerifyError(f"{path}: tensor {entry.name!r}: bytes [{offset}, "
                              f"{offset + len(data)}) differ from the file after loading",
                              path, entry.name)
