"""The loader's own staging buffers, kept between loads.

Making a pinned buffer and releasing it is a fixed cost of every load that
made its own: 128 MiB took 14-17 ms to prefault and register and 7-11 ms
to unregister and unmap on the H200 host, a fifth of the 120 ms in which a
3.6 GB MoE shard loads, and paid again for each file a caller loads one
call at a time.  So, as torch's CachingHostAllocator keeps pinned blocks,
a load that made its own buffer gives it back here, and the next load to
the same device takes it instead of making one.

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

from ..defaults import KEEP_STAGING_MAX
from ._options import keep_staging

_lock = threading.Lock()
_kept = {}      # device index -> StagingBuffer, none held by a load


def take(device, size, segment_size, make):
    """A kept buffer for ``device`` of at least ``size`` bytes whose
    registrations hold ``segment_size`` bytes, else ``make()``'s."""
    with _lock:
        buf = _kept.pop(device, None)
    if buf is not None:
        if not buf.closed and buf.size >= size and buf.segment_size >= segment_size:
            return buf
        _close(buf)
    return make()


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


def empty_cache() -> None:
    """Closes the staging buffers kept for later loads (``load_file`` keeps
    the one it made, per device, unless INSTANT_STAGING_KEEP_STAGING=0).
    Loads running now keep theirs."""
    with _lock:
        bufs = list(_kept.values())
        _kept.clear()
    for buf in bufs:
        _close(buf)


def kept() -> dict:
    """``{device: StagingBuffer}`` kept now (for tests and benchmarks)."""
    with _lock:
        return dict(_kept)


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
