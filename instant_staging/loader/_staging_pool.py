"""The loader's own staging buffers, kept between loads.

Making a pinned buffer and releasing it is a fixed cost of every load that
made its own: for a default load's 128 MiB, a fifth of the time in which
a MoE shard loads (docs/design.md, "Measured: the kept staging buffer"),
and paid again for each file a caller loads one call at a time.  So, as
torch's CachingHostAllocator keeps pinned blocks, a load that made its own
buffer gives it back here, and the next load to the same device takes it
instead of making one.

Who owns a kept buffer, at each moment:

- a load, from ``take()`` until its reader threads are joined (it holds
  the buffer like any staging buffer: ``close()`` raises meanwhile), then
  ``give()`` hands it here (or closes it, below);
- this pool while it waits: one buffer per device, the larger one where
  two concurrent loads give one each (the other is closed at once);
- ``empty_cache()`` closes the waiting ones; at interpreter exit
  ``_staging``'s atexit hook closes every buffer no load holds, these
  included; a buffer given back while the interpreter finalizes is closed.

A buffer is kept only when ``keep_staging()`` (``INSTANT_STAGING_KEEP_STAGING``
is not 0) and it is at most ``KEEP_STAGING_MAX`` bytes.  A load takes a kept
buffer only when it holds everything a buffer made for that load would:
as many bytes, and registrations of at least the segment that load asks
for, so every slot is cut as in a fresh one.  A forked child never uses
its parent's buffers (their registrations are the parent's): the child's
pool starts empty and drops the copies it inherited without a runtime call.
"""

import os
import sys
import threading

from .._types import format_size
from ..defaults import KEEP_STAGING_MAX, reader_threads, staging_segment_size
from ._options import keep_staging

# Nothing that the garbage collector tracks is allocated while _lock is
# held: such an allocation may run a collection, whose finalizers (a
# dropped load's close) give buffers back here, taking _lock on the same
# thread, and a plain lock would wait for itself forever.
_lock = threading.Lock()
_kept = {}      # device index -> StagingBuffer, none held by a load


def own(device, size, slot_bytes):
    """A pinned staging buffer of at least ``size`` bytes for one load to
    ``device``: the one an earlier load kept (``_staging_pool.py``), else a
    new one.  Hand it back with ``give(device, buf)``.

    No ``copy_unit``: the pipeline cuts whole slots inside each
    registration, so any chunk size works; segments are at least one slot.
    """
    segment = staging_segment_size(slot_bytes)
    return take(device, size, segment, lambda: _make(size, segment))



def _make(size, segment):
    from .._staging import StagingBuffer
    from .._types import StagingError
    try:
        # Prefault with the load's thread count rather than one thread per
        # 32 MiB (4 for 128 MiB): making the buffer is on the critical path
        # of a load that keeps none, a fifth of a MoE load
        # (docs/design.md, "Measured: making a load's own staging buffer").
        # (Pages: StagingBuffer's own rule, huge where their blocks are free.)
        return StagingBuffer(size, segment_size=segment, prefault_threads=_prefault_threads(size))
    except StagingError as e:
        # Its message suggests StagingBuffer's own knobs; load_file's are these.
        raise StagingError(
            f"no pinned staging buffer of {format_size(size)} for the load ("
            + "; ".join(f"{a.step} failed with {a.name or 'an error'}" for a in e.attempts if not a.ok)
            + "): pass staging=StagingBuffer(size, allow_pageable=True) to load through "
            "unpinned memory, or a smaller chunk_size / io_depth", e.attempts) from None



def _prefault_threads(size):
    from .._staging import auto_prefault_threads
    # One thread per 4 MiB (a slot), up to the load's reader threads;
    # INSTANT_STAGING_PREFAULT_THREADS still decides where it is set.
    return auto_prefault_threads(size, bytes_per_thread=4 << 20, max_threads=reader_threads())


def take(device, size, segment_size, make):
    """A kept buffer for ``device`` of at least ``size`` bytes whose
    registrations hold ``segment_size`` bytes, else ``make()``'s."""
    with _lock:
        buf = _kept.pop(device, None)
    if buf is not None:
        if _fits(buf, size, segment_size):
            return buf
        _close(buf)
    return make()


def take_kept(device, size, slot_bytes):
    """The kept buffer ``own(device, size, slot_bytes)`` would take, or None
    (then nothing changes: a kept buffer that does not fit stays for
    ``own()`` to close).  Never makes, closes or waits for anything."""
    segment = staging_segment_size(slot_bytes)
    with _lock:
        buf = _kept.get(device)
        if buf is None or not _fits(buf, size, segment):
            return None
        del _kept[device]
    return buf


def _fits(buf, size, segment_size):
    return not buf.closed and buf.size >= size and buf.segment_size >= segment_size


def give(device, buf):
    """Takes back the buffer a load made or took (its threads are joined)."""
    if buf.closed:
        return
    if not keep_staging() or buf.size > KEEP_STAGING_MAX or sys.is_finalizing():
        buf.close()
        return
    with _lock:
        other = _kept.get(device)
        if other is None or other.closed or other.size < buf.size:
            _kept[device], buf = buf, other
    if buf is not None:
        _close(buf)


def discard(buf):
    """Closes a buffer made for a load that failed before it could use it
    (one begun at the load's door, ``_prepare.early_staging``): the failed
    call leaves nothing pinned."""
    _close(buf)


def empty_cache() -> None:
    """Closes the staging buffers kept for later loads.

    ``load_file`` keeps the one it made, per device, unless
    INSTANT_STAGING_KEEP_STAGING=0.  Loads running now keep theirs.
    """
    global _kept
    fresh = {}
    with _lock:
        bufs, _kept = _kept, fresh
    for buf in bufs.values():
        _close(buf)


def kept() -> dict:
    """``{device: StagingBuffer}`` kept now (for tests and benchmarks)."""
    out = {}
    with _lock:
        out.update(_kept)
    return out


def _close(buf):
    try:
        buf.close()
    except BufferError:
        pass    # someone exported it meanwhile: released when that view goes


def _forget_in_child():
    # The lock may have been copied held by a thread that does not exist
    # here; the buffers are the parent's (their release in this process only
    # drops the child's copy of the mapping, StagingBuffer._release).
    global _lock, _kept
    _lock = threading.Lock()
    _kept = {}


os.register_at_fork(after_in_child=_forget_in_child)
