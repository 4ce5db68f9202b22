"""The load itself: staging slots, the reader pipeline, the consumer.

Each tensor gets its own allocation of the file's dtype and shape, and
reader threads (``_pipeline.pyx``, C, no GIL) read chunks of ``chunk_size``
into the staging buffer's slots and copy them out: to a GPU through the
buffer's runtime table on their own streams, with an event per slot so that
a slot is refilled only after its copy finished; to the CPU with memcpy.
"""

import mmap
import os
import sys
import threading
import traceback
import weakref

from .._types import format_size
from ..defaults import CHUNK_SIZE as DEFAULT_CHUNK_SIZE, IO_DEPTH as DEFAULT_IO_DEPTH
from ..defaults import MAX_THREADS as MAX_DEFAULT_THREADS, SEGMENT_SIZE, usable_cpus
from ._checkpoint import _Checkpoint, _paths
from ._errors import LoadError, VerifyError
from ._target import _TorchTarget, _import_torch

# How often the consumer wakes to report progress while no tensor finishes.
_POLL_SECONDS = 0.05
# verify=True compares in pieces of this many bytes.
_VERIFY_STEP = 64 << 20

# Staging buffers a load is using: two loads through one buffer would
# overwrite each other's slots.
_busy = weakref.WeakSet()
_busy_lock = threading.Lock()


# -- the staging slots -------------------------------------------------------

def _slots(spans, chunk_size):
    """Slot addresses: whole chunks inside each span, none crossing one."""
    return [ptr + i * chunk_size for ptr, size in spans for i in range(size // chunk_size)]


def _own_staging(mode, chunk_size, io_depth):
    from ._pipeline import HOST, HostArea
    size = io_depth * chunk_size
    if mode == HOST:
        # A copy to CPU memory gains nothing from pinning.
        return HostArea(size)
    from .._staging import StagingBuffer
    page = mmap.PAGESIZE
    segment = max(SEGMENT_SIZE, -(-chunk_size // page) * page)
    return StagingBuffer(size, copy_unit=chunk_size, segment_size=segment)


def _check_staging(staging, chunk_size):
    from .._staging import StagingBuffer
    if not isinstance(staging, StagingBuffer):
        raise TypeError(f"staging must be an instant_staging.StagingBuffer, not {type(staging).__name__}")
    if staging.closed:
        raise ValueError("staging buffer is closed")
    if not _slots(staging.spans(), chunk_size):
        raise ValueError(
            f"staging buffer of {format_size(staging.size)} ({staging.kind.name}, "
            f"{len(staging.segments)} registration(s)) holds no chunk of {format_size(chunk_size)} "
            f"inside one registration: pass a larger buffer or a smaller chunk_size")


def _check_args(chunk_size, io_depth, threads):
    for name, value in (("chunk_size", chunk_size), ("io_depth", io_depth)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, not {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int):
            raise TypeError(f"threads must be an int or None, not {type(threads).__name__}")
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")


def _default_threads():
    return max(1, min(MAX_DEFAULT_THREADS, usable_cpus()))


# -- the public functions ------------------------------------------------------

class LoadIterator:
    """Yields ``(name, tensor)`` as tensors finish; ``close()`` (or leaving a
    ``with`` block, or dropping it) stops the load, waits for in-flight
    copies and frees every tensor not yet yielded."""

    def __init__(self, generator, checkpoint, info):
        self._generator = generator
        self._checkpoint = checkpoint
        self._info = info
        self.names = [t.name for _, t in checkpoint.entries]
        self.total_bytes = checkpoint.total_bytes

    @property
    def staging_kind(self):
        """The Kind of the staging buffer in use once loading started (None
        before, and for ordinary memory when loading to the CPU)."""
        return self._info.get("kind")

    @property
    def threads(self):
        """Reader threads of this load, once it started."""
        return self._info.get("threads")

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._generator)

    def close(self):
        try:
            self._generator.close()
        finally:
            self._checkpoint.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def iter_load(paths, device="cpu", *, names=None, process_group=None,
              chunk_size=DEFAULT_CHUNK_SIZE, io_depth=DEFAULT_IO_DEPTH, threads=None,
              staging=None, verify=False, progress=None):
    """Loads safetensors file(s), yielding ``(name, tensor)`` as each finishes.

    Headers are parsed and validated when this is called; the load runs
    while the iterator is consumed.  Arguments are those of ``load_file``.
    """
    def prepare():
        _check_args(chunk_size, io_depth, threads)
        if staging is not None:
            _check_staging(staging, chunk_size)
        if sys.byteorder != "little":
            raise RuntimeError("safetensors data is little-endian; this loader needs a little-endian host")
        torch = _import_torch()
        checkpoint = _Checkpoint(_paths(paths))
        try:
            checkpoint.select(names)
            target = _TorchTarget(torch, device)
            dtypes = [target.check(t, checkpoint.paths[i]) for i, t in checkpoint.entries]
        except BaseException:
            checkpoint.close()
            raise
        return checkpoint, target, dtypes

    if process_group is not None:
        from ._distributed import DistributedLoadIterator, iter_load_group
        return iter_load_group(prepare, process_group, DistributedLoadIterator,
                               (staging, chunk_size, io_depth, threads, verify, progress))
    checkpoint, target, dtypes = prepare()
    info = {}
    generator = _load(checkpoint, target, dtypes, staging, chunk_size, io_depth, threads,
                      verify, progress, info=info)
    return LoadIterator(generator, checkpoint, info)


def load_file(paths, device="cpu", *, names=None, process_group=None,
              chunk_size=DEFAULT_CHUNK_SIZE, io_depth=DEFAULT_IO_DEPTH, threads=None,
              staging=None, verify=False, progress=None):
    """Loads safetensors file(s) into ``{name: tensor}`` on ``device``.

    paths       one path or a list of shards (a name in two shards is an error)
    device      "cpu" (as safetensors), "cuda:N", a torch.device or an int
    names       None for all; an iterable of tensor names (unknown ones are a
                KeyError, raised before anything is allocated); or a callable
                name -> bool.  Only the selected tensors' bytes are read.
    process_group  a torch.distributed group whose every rank makes this call
                with the same checkpoint: each rank reads about 1/N of the bytes
                and the ranks exchange them over the group, so each byte is read
                from the host once (loader/_distributed.py); names= may differ
                per rank.  A failure on one rank raises on every rank.
    chunk_size  bytes per read and per copy (8 MiB)
    io_depth    chunks in flight: the staging buffer holds io_depth * chunk_size
    threads     reader threads (None: one per CPU, at most 16; never more than slots)
    staging     a StagingBuffer to reuse instead of making one per load; every
                whole chunk inside one of its registrations is a slot (one load
                at a time per buffer)
    verify      after each tensor is copied, re-read its bytes from the file with
                plain reads (not through the staging buffer) and compare them with
                the tensor's memory on the device; a difference raises VerifyError.
                It checks the copy path (slot reuse, spans, copies), not that the
                file is the one intended: safetensors carries no checksum.
    progress    progress(done_bytes, total_bytes), called from this thread

    Tensors have the file's dtype and shape and each owns its memory.  A
    read or copy that fails raises LoadError after waiting for the copies
    in flight and freeing every tensor of the load; the staging buffer
    stays reusable.
    """
    with iter_load(paths, device, names=names, process_group=process_group, chunk_size=chunk_size,
                   io_depth=io_depth, threads=threads, staging=staging, verify=verify,
                   progress=progress) as it:
        loaded = dict(it)
        return {name: loaded[name] for name in it.names}


# -- the load itself ---------------------------------------------------------

def _load(checkpoint, target, dtypes, staging, chunk_size, io_depth, threads, verify,
          progress, fail_chunk=-1, info=None):
    """The generator behind LoadIterator (``fail_chunk``: tests make that
    chunk's read fail; ``info`` receives the staging kind and thread count)."""
    info = {} if info is None else info
    from ._pipeline import Pipeline
    owned = staging is None
    if not owned:
        _claim_staging(staging)
    buf = _own_staging(target.mode, chunk_size, io_depth) if owned else staging
    handles = []
    pipe = None
    try:
        slots = _slots(buf.spans(), chunk_size)
        runtime = getattr(buf, "runtime", None)
        info["kind"] = getattr(buf, "kind", None)
        dsts = [_allocate(handles, target, entry, dtype)
                for (_, entry), dtype in zip(checkpoint.entries, dtypes)]
        target.before_copies()
        entries = checkpoint.entries
        pipe = Pipeline(runtime, target.mode, target.index, slots,
                        threads or _default_threads(),
                        [checkpoint.fds[i] for i, _ in entries], [t.begin for _, t in entries],
                        [t.end for _, t in entries], dsts, chunk_size, fail_chunk)
        info["threads"] = pipe.n_threads
        pipe.start()
        yield from _drive(pipe, checkpoint, target, handles, verify, progress, runtime)
    except BaseException as e:
        # The traceback's finished frames would keep tensors alive for as
        # long as the caller keeps the exception.
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        if pipe is not None:
            pipe.abort()
            pipe.join()            # no copy in flight into what we free next
        handles.clear()
        if owned:
            buf.close()
        else:
            with _busy_lock:
                _busy.discard(buf)
        checkpoint.close()


def _claim_staging(buf):
    with _busy_lock:
        if buf in _busy:
            raise RuntimeError("this staging buffer is in use by another load; "
                               "loads through one buffer must not overlap")
        _busy.add(buf)


def _allocate(handles, target, entry, dtype):
    """Allocates one tensor into ``handles``; returns its address."""
    handle, ptr = target.allocate(entry, dtype)
    handles.append(handle)
    return ptr


def _drive(pipe, checkpoint, target, handles, verify, progress, runtime):
    """Yields tensors as the pipeline finishes them; raises its first error."""
    total, reported, left = checkpoint.total_bytes, -1, len(handles)
    while True:
        finished, done, exited, failed = pipe.wait(_POLL_SECONDS)
        if failed:
            pipe.join()
            raise _error(pipe, checkpoint, runtime)
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


def _error(pipe, checkpoint, runtime):
    from ._pipeline import END_OF_FILE, READ_ERROR, RUNTIME_ERROR
    kind, code, call, chunk, offset = pipe.error()
    index = pipe.tensor_at(chunk, offset)
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
        name = runtime.error_name(code) if runtime is not None else str(code)
        text = runtime.error_string(code) if runtime is not None else ""
        return LoadError(f"{where}{call} failed with {name} ({text})", path, tensor, code)
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
