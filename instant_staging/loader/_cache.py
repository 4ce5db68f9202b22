"""A local cache of a URL source's objects, filled in the pass that loads them.

Off by default: ``cache_dir=`` of ``Checkpoint.open``, ``load_file``,
``iter_load`` and ``safe_open``, else ``INSTANT_STAGING_CACHE_DIR``
(docs/design.md, "Object storage").

Entries.  One file per object in the cache directory, named
``<sha256 of the URL>.<16 hex digits of a sha256 of its ETag, version and
size>.safetensors``: the URL is hashed, so nothing of it (a password, a
bucket's name) reaches a file name, and an object that changed (another
ETag, version or size) has another name: it is fetched again, never mixed
with the old one's bytes, whose entry its new one replaces.  An object
whose server gives no ETag is never cached: nothing could tell that it
changed.  When a checkpoint opens, each object's entry is looked up with
the size and ETag of the GET that read its header, and checked.  Where
every object has its entry, the checkpoint is read from the entries as
local files (``CachedShards``: the local pipeline, pread straight into
the staging slots, the page cache's knobs); where some have one, their
ranges are read from the entries and the rest fetched (and filled).

Integrity.  An entry is the object's bytes, then its digest (``_trailer``):
the CRC-32 of each range its fill wrote, made by the cache's writer
thread that wrote it, from the buffer that was fetched.  An entry is checked in full
(``_damage``: opened without following a link, a regular file, its
digest whole and covering every byte, its header the object's, every
range read back equal to its CRC) once, and the check recorded: its stamp
(``<name>.checked``, ``_stamp``) holds the entry's device, inode, size,
mtime and ctime as the check saw them.  The finisher checks each entry it
made, read back from the page cache after its flush; an entry without a
stamp that fits (none, another file's, changed since) is checked by the
open that finds it.  Each open compares the entry's fstat with its stamp
(``_stamped``), and where they are equal reads only its header and digest
table (the header still compared with the object's): nothing wrote the
file through the file system since its check, since a write, truncate,
chmod or rename onto it moves its ctime, which no user can set.  Damage
below the file system (a disk's silent error) is the disk's checksums'
to find; ``verify=`` on a load from the entries asks the server
(``CachedShards.read_bytes``).  A damaged entry is removed with its
stamp, with one warning, and its object fetched and filled again.  A
stamp is written to a new file and renamed onto its name (no link
followed), only where the entry did not change during the check and its
last change is older than the stamp (a write in the same tick of the
kernel's clock would leave the same times), never by the exit's wait.
A hit marks its entry used by the stamp's mtime (the entry's own times
are the stamp's record).

Layout.  A flat directory of the cache's own files (nothing else in it is
looked at or removed), as ``ls -l`` shows one holding two objects, the
second of them also at a newer version being filled::

    $ ls -l $INSTANT_STAGING_CACHE_DIR
    -rw-r--r-- 1 me me         64 Jun  2 11:52 0b3e...c41f.5d2a9e0c71b4f6a3.checked
    -rw-r--r-- 1 me me 4965801504 Jun  2 09:14 0b3e...c41f.5d2a9e0c71b4f6a3.safetensors
    -rw-r--r-- 1 me me 1073741824 Jun  2 11:40 7a91...e2d0.8e17c2d04a9b3f55.partial
    -rw-r--r-- 1 me me         64 Jun  1 17:02 7a91...e2d0.c1f0a9b8e7d6c523.checked
    -rw-r--r-- 1 me me 4983150880 Jun  1 17:02 7a91...e2d0.c1f0a9b8e7d6c523.safetensors
       (64 hex digits: the URL's hash)  ^^^^  (16: the version's)

An entry (``.safetensors``) is an object's bytes as the server holds
them followed by its digest (Integrity, below); its stamp (``.checked``)
records its last full check, and the stamp's modification time its last
use (the bound's order); a partial file (``.partial``) is an object being
filled, locked by its filler; the old version's entry goes once the new
one is named.

Filling.  An object without an entry is filled beside the load that
fetches it: each range a reader fetched is handed to the cache's writer
threads (``_Writers``: a few per checkpoint, started as ranges come, gone
once none is queued), which write it at its offset into the object's
partial file (``<name>.partial``) from the client's own buffer
(``os.pwrite``: no second fetch, no copy of ours), its CRC-32 made on the
way; the reader fetches its next range meanwhile, and waits only where the
writes handed on and not done hold CACHE_WRITE_QUEUE bytes (a disk slower
than the fetch).  Its header came with the open.  When the checkpoint
closes (its loads' readers joined, their tensors out), it hands each
object of which every byte was written (by one load, or by the batches of
several loads of one ``Checkpoint``) to the finisher, which makes its
entry after the load returned (the flush waits for the disk: it is in no
load's way): its digest appended, the partial file flushed (fsync),
renamed to the entry's name while its lock is still held, the directory
flushed, the lock let go.  Where writes handed on are not done yet, the
close does not wait for them either: it hands the writers and the fills to
the finisher, which waits for the writes first (``Cache._settle``), then
makes the entries of the objects written whole and removes the others'
partial files; until then the ranges queued (the client's buffers,
CACHE_WRITE_QUEUE bytes at most) outlive the load.  An entry appears whole
or not at all, and a crash, a SIGKILL or a Ctrl-C before the rename leaves
at most a partial file, which no load trusts (its next filler removes it
and makes its own, and any filler's eviction removes one whose filler is
gone).  A partial file is always a new one (``O_CREAT | O_EXCL |
O_NOFOLLOW``): a link or file that others planted at its name is never
written through, and a cache directory made here is private (0700).  A
failed flush (a full disk) is no entry and one warning, logged by the
finisher: the load stands.

The finisher is one daemon thread per process, started when a checkpoint
hands it entries and gone once none is queued.  ``wait_for_cache_fills``
waits for it (public: tests and benchmarks time the fill apart).  A later
load of an object in this process whose entry is still being made waits
for it at open (a flush of bytes already written; the other way, the
locked partial file, would fetch the object again).  The interpreter's
exit waits for the queued entries, for at most CACHE_FINISH_AT_EXIT
seconds (a disk that stopped answering must not hold the exit forever);
a Ctrl-C during that wait ends it, and no entry is named after it.  A fork
child does not finish its parent's fills: it closes its copies of their
descriptors (the flock is the open file's: the parent keeps it).

A checkpoint closed before every byte of an object was loaded (``names=``,
a ``plan``, a rank's share of a group load) removes that object's partial
file (or the finisher does, once the writes handed on are done): the cache
holds only whole objects.  A Ctrl-C in the close drops the writes not
begun and waits for those running (one range each) before any descriptor
closes: no write lands on a descriptor closed or reused under it; no fill
is whole then.  A Ctrl-C in the exit's wait for the finisher (above: the
writes handed on, then the flushes) names no entry from then on; the
writers, daemon threads, stop with the process, and the partial files
stay, never trusted.  A fork child has none of its parent's writers: its
copies of the fills write nothing and remove nothing.  A close as the
interpreter ends (a finalizer), its writers stopped where they stood,
waits for none and closes nothing: a partial file stays, never trusted.

Concurrency.  The partial file is also its fill's lock: its filler holds
``flock(LOCK_EX)`` on it while it fills and until the finisher renamed it
(the kernel drops the lock when the process ends, however it ends).  Another process, or rank, that finds
it locked loads without filling; one that takes the lock first checks
that the name still names the file it locked (the holder may have renamed
it to the entry meanwhile).  An entry is never written once it has its
name, only renamed into place and unlinked, so a reader that opened one
reads it whole.

Bound.  Entries and partial files take at most ``CACHE_MAX_BYTES``
(``INSTANT_STAGING_CACHE_MAX_BYTES``); before a fill, the least recently
used entries (by the later of the entry's and its stamp's modification
time: a hit sets its stamp's) are removed with their stamps until the
object fits, and ``CACHE_KEEP_FREE`` of the file system is left free.
Stamps whose entry is gone, and stamps' temporary files whose writer is
gone (unlocked), are removed on the way.  An object larger than the bound is not cached.

Offline (``INSTANT_STAGING_OFFLINE=1``, or ``HF_HUB_OFFLINE=1``:
``offline``): nothing is asked and no client made.  Each object is its
newest entry found by its URL's hash alone (``offline_shards``), checked
as above but for its header (there is no server's to compare); a
directory or an index is its record (``<sha256 of its URL>.<RECORD_VERSION>.source``:
the names of the objects it named, relative to it, nothing of the URL),
written by a checkpoint's close where every object is an entry or being
made one, and evicted as entries are.  A miss is a FileNotFoundError
naming the object.

A cache never fails a load.  A directory that cannot be made or written,
a full disk (ENOSPC, EDQUOT; EFBIG past a file size limit), any error of
a cache file: the fill stops, its partial file is removed, and the load
goes on without the cache, with one warning (per checkpoint) naming the
directory and the error.
"""

from __future__ import annotations

import atexit
import collections
import errno
import fcntl
import hashlib
import logging
import os
import re
import stat
import struct
import sys
import threading
import weakref
import zlib
from typing import NamedTuple

from .. import envs
from ..defaults import (
    CACHE_CHECK_PIECE,
    CACHE_CHECK_THREADS,
    CACHE_FINISH_AT_EXIT,
    CACHE_KEEP_FREE,
    CACHE_MAX_BYTES,
    CACHE_WRITE_QUEUE,
    CACHE_WRITE_THREADS,
    default_threads,
)
from ._fds import close_recorded, open_recorded
from ._header import _pread_exact, header_length, parse_header
from ._remote import RemoteShards
from ._shards import _OPEN_FLAGS, Shards

log = logging.getLogger("instant_staging")

ENV_CACHE_DIR = "INSTANT_STAGING_CACHE_DIR"
ENV_CACHE_MAX_BYTES = "INSTANT_STAGING_CACHE_MAX_BYTES"
ENV_OFFLINE = "INSTANT_STAGING_OFFLINE"
# huggingface_hub's switch, read as it reads it (``constants._is_true``):
# its users set it to keep a program off the network.
ENV_HF_OFFLINE = "HF_HUB_OFFLINE"
_HF_TRUE = ("1", "ON", "YES", "TRUE")

ENTRY_SUFFIX = ".safetensors"
PARTIAL_SUFFIX = ".partial"
# An entry's stamp (``<name>.checked`` beside ``<name>.safetensors``): the
# entry's file as its last full check saw it.  Written as ``<name>.checked-<16
# hex digits>`` (its writer's lock held), then renamed onto its name.
STAMP_SUFFIX = ".checked"
# A directory's or an index's record (``<sha256 of its URL>.<RECORD_VERSION>.source``):
# the objects that it named when last asked, for offline mode.  Written as
# ``<name>.source-<16 hex digits>``, then renamed onto its name.
RECORD_SUFFIX = ".source"
RECORD_VERSION = "0" * 16
# The cache's own files: nothing else in the directory is ever looked at or removed.
_OURS = re.compile(r"^[0-9a-f]{64}\.[0-9a-f]{16}\."
                   r"(?:safetensors|partial|checked|source|(?:checked|source)-[0-9a-f]{16})$")

# An entry is the object's bytes, then its digest: the CRC-32 of each range
# its fill wrote (``_RANGE``: offset, length, CRC), sorted, then ``_FOOTER``
# (the object's size, the count of ranges, the CRC-32 of their table, and
# ``_MAGIC``).  The CRCs are of the bytes the reader threads fetched, made
# by the writer threads as they wrote them: nothing is read again to make them.
_RANGE = struct.Struct("<QQI")
_FOOTER = struct.Struct("<QQI8s")
_MAGIC = b"ISCRC32\x01"
# A stamp: ``_STAMP_MAGIC``, then the entry's st_dev, st_ino, st_size,
# st_mtime_ns and st_ctime_ns as the full check that wrote it saw them.
_STAMP = struct.Struct("<8sQQqqq")
_STAMP_MAGIC = b"ISCHKD\x00\x01"
# Where an entry opens with no link followed (a link at its name is none of ours).
_ENTRY_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW

# A fill's states.  _FINISHING: whole, handed to the finisher (its
# descriptor and lock are the finisher's until it is _DONE or _OFF).
_PENDING, _FILLING, _FINISHING, _DONE, _OFF = "pending", "filling", "finishing", "done", "off"


def directory(cache_dir):
    """The cache directory of an open: ``cache_dir`` (a path) where given,
    None for False (no cache, whatever the environment), else
    ``INSTANT_STAGING_CACHE_DIR`` (None where unset: no cache).

    Raises:
        TypeError: neither a path, False nor None.
        ValueError: an empty path.
    """
    if cache_dir is False:
        return None
    if cache_dir is None:
        return envs.get(ENV_CACHE_DIR)
    if isinstance(cache_dir, bool) or not isinstance(cache_dir, (str, bytes, os.PathLike)):
        raise TypeError(f"cache_dir must be a path (or None, or False: no cache), not "
                        f"{type(cache_dir).__name__}")
    path = os.fsdecode(os.fspath(cache_dir))
    if not path:
        raise ValueError("cache_dir is empty: pass a directory, or None")
    return path


def max_bytes():
    """The bound of a cache: ``INSTANT_STAGING_CACHE_MAX_BYTES``, else CACHE_MAX_BYTES."""
    value = envs.get(ENV_CACHE_MAX_BYTES)
    return CACHE_MAX_BYTES if value is None else value


def entry_base(url, etag, version, size):
    """``<sha256 of url>.<16 hex digits of the version's digest>``: an entry's
    name without its suffix."""
    key = hashlib.sha256(url.encode("utf-8", "surrogateescape")).hexdigest()
    ver = hashlib.sha256(f"{etag}\0{version}\0{size}".encode("utf-8", "surrogateescape"))
    return f"{key}.{ver.hexdigest()[:16]}"


class _Fill:
    """One object being written into its partial file."""

    __slots__ = ("base", "covered", "digests", "fd", "fds", "handed", "head", "lock", "size",
                 "state", "whole")

    def __init__(self, base, size, head):
        self.base, self.size, self.head = base, size, head
        self.state = _PENDING
        self.fd = None
        # Its partial file's descriptors, recorded: closed by the Cache's
        # close(), or, once handed on, by the finisher (its own, not the
        # Cache's list: the finisher outlives the checkpoint).
        self.fds = []
        self.handed = False     # handed to the finisher: its descriptors are not the Cache's
        self.covered = []       # disjoint [begin, end) ranges written, sorted
        self.digests = []       # (offset, length, CRC-32) of each range written: the entry's digest
        self.whole = False      # every byte written: made an entry after close()
        self.lock = threading.Lock()

    def add(self, begin, end) -> bool:
        """Records ``[begin, end)`` as written; whether every byte now is."""
        merged = []
        for b, e in sorted(self.covered + [(begin, end)]):
            if merged and b <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], e))
            else:
                merged.append((b, e))
        self.covered = merged
        return merged[0][0] == 0 and merged[0][1] >= self.size


class _Writers:
    """A cache's writers: up to CACHE_WRITE_THREADS threads that write the
    ranges its readers fetched into their fills (``Cache._put``: the
    range's CRC-32, its pwrite) beside the load, so that a reader hands its
    range on and fetches the next instead of waiting for the disk.  The
    ranges queued and being written hold at most CACHE_WRITE_QUEUE bytes
    (one larger range goes alone); ``submit`` waits for room beyond that.
    A thread ends once nothing is queued (the next ``submit`` starts
    another): a checkpoint open and not loading keeps none.

    Lifetimes.  A task holds the fetched buffer (which nothing writes: the
    client's ``Bytes``, or ``bytes``) and its fill; a fill's descriptor is
    closed only after ``close()`` here (nothing queued, nothing running):
    by ``Cache.close``, or, where that close handed on writes not yet done,
    by the finisher (``Cache._settle``: ``drain()`` and ``close()`` first).
    The threads are daemons: the interpreter's exit does not wait for a
    checkpoint never closed (its partial files are never trusted).  A fork
    child has none of them, nor their tasks (``_forget_in_child``)."""

    def __init__(self, cache):
        self.cache = cache
        self.lock = threading.Lock()
        self.room = threading.Condition(self.lock)     # bytes freed, a task done
        self.queue = collections.deque()    # (fill, offset, data, bytes)
        self.held = 0           # bytes queued or being written
        self.running = 0        # tasks being written
        self.threads = []       # alive (each removes itself, under the lock, as it ends)
        self.closed = False
        self.count = default_threads(CACHE_WRITE_THREADS)
        _all_writers.add(self)

    def submit(self, fill, offset, data) -> bool:
        """Queues ``data``'s write at ``offset`` of ``fill``, once it fits
        the bound; False where no thread runs and none can start (the
        caller writes it)."""
        size = memoryview(data).nbytes
        with self.lock:
            while self.held and self.held + size > CACHE_WRITE_QUEUE and not self.closed:
                self.room.wait()
            if self.closed:
                return True     # (a closed cache writes nothing more)
            if (len(self.threads) < self.count
                    and len(self.queue) + self.running >= len(self.threads)):
                thread = threading.Thread(target=self._run, name="instant_staging-cache-write",
                                          daemon=True)
                self.threads.append(thread)
                try:
                    thread.start()      # (it runs once this lock is let go)
                except RuntimeError:    # (no thread left to this process)
                    self.threads.remove(thread)
                    if not self.threads:
                        return False
            self.queue.append((fill, offset, data, size))
            self.held += size
        return True

    def _run(self):
        me = threading.current_thread()
        while True:
            with self.lock:
                if not self.queue:
                    self.threads.remove(me)
                    self.room.notify_all()
                    return
                fill, offset, data, size = self.queue.popleft()
                self.running += 1
            try:
                self.cache._put(fill, offset, data)
            except BaseException:       # (a bug: this fill given up, the load unharmed)
                log.exception("the cache in %s: a write failed", self.cache.directory)
                with fill.lock:
                    _abandon(fill)
            finally:
                data = None             # (the buffer goes now, not with the next task)
                with self.lock:
                    self.running -= 1
                    self.held -= size
                    self.room.notify_all()

    def busy(self) -> bool:
        """Whether a write is queued or running (read without the lock: as
        the interpreter ends, a writer may have stopped holding it)."""
        return bool(self.queue) or self.running > 0

    def drain(self):
        """Waits until every write queued is done."""
        with self.lock:
            while self.queue or self.running:
                self.room.wait()

    def close(self):
        """Drops the writes not begun, waits for those running (a Ctrl-C
        meanwhile is raised after them: a write running still has its
        descriptor), joins the threads; idempotent."""
        interrupted = None
        with self.lock:
            self.closed = True
            dropped, self.queue = self.queue, collections.deque()
            self.held -= sum(task[3] for task in dropped)
            self.room.notify_all()
            while self.running:
                try:
                    self.room.wait()
                except KeyboardInterrupt as e:
                    interrupted = e
            threads = list(self.threads)
        del dropped
        for thread in threads:
            thread.join()               # (each ends at once: nothing is queued)
        if interrupted is not None:
            raise interrupted

    def forget(self):
        """In a fork child: no thread, no task (the parent's threads write
        its fills); this copy of the cache writes nothing more."""
        self.lock = threading.Lock()
        self.room = threading.Condition(self.lock)
        self.queue, self.held, self.running, self.threads = collections.deque(), 0, 0, []
        self.closed = True


# Every cache's writers, for a fork child to forget (``_forget_in_child``).
_all_writers = weakref.WeakSet()


class Cache:
    """One open checkpoint's use of a cache directory: the hooks that
    ``RemoteShards`` calls (``opened``, ``read``, ``write``, ``close``).

    Its descriptors (entries read, partial files filled) are recorded as
    they open (``_fds.pyx``) and closed by ``close()``, which the
    checkpoint's owner calls once the reader threads are joined, and which
    closes a fill's (or has the finisher close it) only once none of its
    writes runs (``_Writers``): no write lands on a descriptor closed
    under it."""

    def __init__(self, directory, bound=None):
        self.directory = directory
        self.bound = max_bytes() if bound is None else bound
        self._fds = []
        self._hits = {}         # object index -> (entry path, descriptor)
        self._fills = {}        # object index -> _Fill
        self._lock = threading.Lock()
        # One fill starts at a time here: a fill's room-making removes the
        # partial files no filler has locked, and another object's partial
        # file is unlocked between its creation and its lock.
        self._starting = threading.Lock()
        self._off = False
        self._warned = False    # a damaged entry was said (once)
        self.local = None       # the CachedShards made from it (closed with it until handed on)
        # ``(url, Source.named)`` of a directory or index source: its record
        # (``remember``), written by ``close()`` where every object is an entry
        # or is being made one.
        self.record = None
        self._opened = 0        # objects opened (``opened``): an object without an ETag is none of them
        # The fill's writes, beside the readers (``_Writers``): drained and
        # joined, by ``close()`` or by the finisher it hands them to, before
        # any partial file's descriptor closes.
        self._writers = _Writers(self)

    # -- the checkpoint's hooks ---------------------------------------------------

    def opened(self, index, obj, head):
        """Object ``index`` (a ``_remote._Object`` with its size and ETag) was
        opened and ``head`` are its bytes up to its data: finds its entry
        and checks it (``_damage``: its header, then, unless its stamp says
        that nothing wrote it since its last full check, every byte against
        its digest, a stamp written after), else prepares its fill.  A
        damaged entry is removed (one warning) and the object fetched and
        filled again: nothing damaged is returned as the object."""
        self._opened += 1
        if self._off or not obj.etag:
            return
        base = os.path.join(self.directory, entry_base(obj.url, obj.etag, obj.version, obj.size))
        entry = base + ENTRY_SUFFIX
        # An earlier checkpoint of this process still finishing this entry:
        # waited for (a flush of bytes already written, where the other way,
        # its locked partial file, would fetch the whole object again).
        _finisher.wait_for(base)
        fd, damage = None, None
        try:
            fd = open_recorded(self._fds, entry, _ENTRY_FLAGS)
            st = os.fstat(fd)
            stamped = _stamped(base, st)
            damage = _damage(fd, st, obj.size, head, full=not stamped)
            if damage is None and not stamped:
                _stamp(base, fd, st)
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno != errno.ELOOP:
                self._degrade(e, "reading")
                return
            damage = "a symbolic link, not an entry"
        if fd is not None and damage is None:
            self._hits[index] = (entry, fd)
            return
        if damage is not None:
            if fd is None or _names(fd, entry):     # (not a good one made meanwhile)
                _unlink(entry)
                _unlink(base + STAMP_SUFFIX)
            self._damaged(entry, damage)
        self._fills[index] = _Fill(base, obj.size, bytes(head))

    def _damaged(self, entry, damage):
        """Says once per checkpoint that an entry was removed as damaged."""
        if damage == _EARLIER:
            log.info("the cache in %s: entry %s has no digest (made by an earlier version): "
                     "filled again", self.directory, os.path.basename(entry))
            return
        with self._lock:
            first, self._warned = not self._warned, True
        if first:
            log.warning("the cache in %s: entry %s is damaged (%s): removed, and its object "
                        "fetched again", self.directory, os.path.basename(entry), damage)

    def whole(self, count):
        """The entry paths of objects ``0..count-1`` where the cache holds each, else None."""
        if len(self._hits) != count:
            return None
        return [self._hits[i][0] for i in range(count)]

    def checked(self, index):
        """``(st_dev, st_ino)`` of the entry of object ``index`` that the open checked."""
        st = os.fstat(self._hits[index][1])
        return st.st_dev, st.st_ino

    def hand_over(self):
        """Closes the entries' descriptors once a ``CachedShards`` holds its
        own of the same files: this one reads none of them any more."""
        self._hits = {i: (path, None) for i, (path, _) in self._hits.items()}
        close_recorded(self._fds)

    def filling(self):
        """Whether an object is still to be filled (its load writes its entry)."""
        return not self._off and any(f.state in (_PENDING, _FILLING) for f in self._fills.values())

    def holds(self, index):
        """Whether object ``index`` is read from its entry."""
        return index in self._hits

    def read(self, index, offset, length):
        """Object ``index``'s bytes from its entry; None where it has none (fetched)."""
        hit = self._hits.get(index)
        if hit is None or hit[1] is None:
            return None
        data = bytearray(length)
        try:
            got = os.preadv(hit[1], [data], offset)
        except OSError as e:
            got = e
        if got == length:
            return data
        self._hits.pop(index, None)         # fetched from here on
        self._degrade(got if isinstance(got, OSError) else
                      OSError(errno.EIO, f"an entry ended at byte {offset + got}"), "reading")
        return None

    def write(self, index, offset, data):
        """``data``, fetched at ``offset`` of object ``index``, into its fill:
        handed to the cache's writers (``_Writers``), which write it beside
        the load; the caller waits only where they are CACHE_WRITE_QUEUE
        bytes behind.  ``data`` is the fetched buffer itself, never written
        to afterwards (the client's immutable ``Bytes``, or ``bytes``): the
        writer holds it until written, so nothing is copied."""
        fill = self._fills.get(index)
        if fill is None:
            return
        if fill.state != _FILLING:
            with fill.lock:
                if fill.state == _PENDING:
                    with self._starting:
                        self._start(fill)
            if fill.state != _FILLING:
                return
        if self._off:
            with fill.lock:
                self._abandon(fill)
            return
        if not self._writers.submit(fill, offset, data):
            self._put(fill, offset, data)       # (no thread to be had: here, now)

    def _put(self, fill, offset, data):
        """Writes ``data`` at ``offset`` of ``fill``'s partial file, and
        records its range and CRC-32; a writer's task (``_Writers``).  The
        fill's descriptor is open: ``close()`` closes it only once no write
        is running (``_Writers.close``)."""
        if fill.state != _FILLING:
            return                  # (given up meanwhile: its partial file removed)
        if self._off:
            with fill.lock:
                self._abandon(fill)
            return
        # The digest of the bytes as they were fetched (zlib releases the
        # GIL): what a later open compares the entry with.
        crc = zlib.crc32(data)
        try:
            _write(fill.fd, data, offset)
        except OSError as e:
            self._degrade(e, "writing")
            with fill.lock:
                self._abandon(fill)
            return
        with fill.lock:
            if fill.state == _FILLING:
                fill.digests.append((offset, len(data), crc))
                if fill.add(offset, offset + len(data)):
                    fill.whole = True

    def sources(self, entries):
        """``(bytes from the cache, bytes fetched)`` of ``entries`` (index, tensor)."""
        cached = sum(t.nbytes for i, t in entries if i in self._hits)
        fetched = sum(t.nbytes for i, t in entries if i not in self._hits)
        return cached, fetched

    def close(self):
        """Hands the fills on and closes the rest; idempotent.  Called once
        the reader threads are joined and the tensors are out.

        Where writes handed on are still queued or running (a disk behind
        the fetch), the close does not wait for them: the writers and every
        fill go to the finisher (``_settle``: the writes waited for, the
        fills written whole made entries, ``_finish``, the others' partial
        files removed), and the load returns while the disk catches up.
        Otherwise the fills written whole go to the finisher (which makes
        their entries after this returns: the flush, which waits for the
        disk, is in no load's way) and the others' partial files are
        removed here.  Either way the entries read are closed (and the
        CachedShards made from it, until handed on), and the directory's
        or index's record written where every object is an entry or is
        being made one.

        A Ctrl-C (any exception) meanwhile: the cache is off, the writes
        not begun are dropped, those running are waited for
        (``_Writers.close``) before any descriptor closes (no write lands
        on a descriptor closed, or reused, under it), and the fills are
        removed, none of them whole."""
        if sys.is_finalizing() and self._writers.busy():
            self._stop_at_exit()
            return
        handed, writing = [], False
        try:
            writing = self._writers.busy() and not self._off
            if not writing:
                self._writers.drain()   # (a cache gone off: its last writes skip their bytes)
            for fill in list(self._fills.values()):
                if fill.handed:
                    continue    # (a second close; its lock may be the finisher's, for a while)
                with fill.lock:
                    if writing or self._finishing(fill):
                        # (writing: its descriptors the finisher's, _settle decides)
                        fill.handed = True
                        handed.append(fill)
            record, self.record = self.record, None
            if writing:
                # (none handed: a second close, its writes the finisher's already)
                if handed and not _finisher.submit(self.directory, handed, (self, record)):
                    _finish(self.directory, self._settle(handed, record))   # (no thread: here, now)
            else:
                if handed and not _finisher.submit(self.directory, handed):
                    _finish(self.directory, handed)     # (no thread to be had: here, now)
                self._remember(record, sum(f.handed for f in self._fills.values()))
        except BaseException:
            self._off = True    # (the writers skip what is left)
            try:
                self._writers.close()   # (those running end on their descriptors first)
            finally:
                for fill in handed:     # (the finisher skips what is _OFF)
                    with fill.lock:
                        self._abandon(fill)
                        close_recorded(fill.fds)
            raise
        finally:
            try:
                if not writing:
                    self._writers.close()
            finally:
                for fill in list(self._fills.values()):
                    if not fill.handed:     # (a handed one's: the finisher's, under its lock)
                        with fill.lock:
                            self._abandon(fill)     # (an interrupted drain's: none is whole)
                        close_recorded(fill.fds)
                close_recorded(self._fds)
                local, self.local = self.local, None
                if local is not None:
                    local.close()

    def _settle(self, fills, record):
        """The finisher's part of a ``close()`` that handed on writes still
        queued or running: waits for them and joins the writers, then makes
        ``fills`` written whole _FINISHING (returned, for ``_finish``) and
        removes the others' partial files, their descriptors closed; the
        record as ``close()`` writes it."""
        try:
            self._writers.drain()
        finally:
            self._writers.close()
        finishing = []
        for fill in fills:
            with fill.lock:
                if self._finishing(fill):
                    finishing.append(fill)
                else:
                    close_recorded(fill.fds)
        self._remember(record, len(finishing))
        return finishing

    def _finishing(self, fill) -> bool:
        """(Under ``fill.lock``, its writes done.)  A fill written whole is
        made _FINISHING, for the finisher to make its entry; any other is
        removed (an interrupted close's already: _OFF).  Whether it was."""
        if fill.state == _FILLING and fill.whole and not self._off:
            fill.state = _FINISHING
            return True
        self._abandon(fill)
        return False

    def _remember(self, record, made):
        """Writes ``record`` (``(url, Source.named)`` of a directory or an
        index) where every object opened is an entry read or one of the
        ``made`` being made."""
        if (record is not None and not self._off and self._opened
                and len(self._hits) + made == self._opened):
            remember(self.directory, *record)

    def _stop_at_exit(self):
        """``close()`` as the interpreter ends (a checkpoint closed by its
        finalizer) while writes are still handed on: the writers, daemon
        threads, stopped where they stood, maybe holding a fill's lock or in
        a pwrite; nothing is waited for and no descriptor is closed (the
        process's end closes them), and no fill is whole.  Its partial
        files stay, never trusted: their locks go with the process, and the
        next filler removes them."""
        self._off = True
        self._writers.closed = True
        for fill in self._fills.values():
            if not fill.handed and fill.state != _DONE:
                fill.state = _OFF

    # -- filling ------------------------------------------------------------------

    def _start(self, fill):
        """Takes object ``fill``'s partial file (under ``fill.lock``): makes
        it, locks it, makes room, writes its header; only then is the fill
        _FILLING (a reader that sees it so writes into a file that nothing
        truncates any more).  Leaves it _OFF where another process fills
        it, its entry is there already, or the cache fails.

        The partial file is always a new file of ours: made with
        ``O_CREAT | O_EXCL | O_NOFOLLOW``, so no link planted at its name
        (which anyone who can write the directory could compute) is
        followed and no file already there is reused; one already there is
        another filler's (locked: this load goes without) or one whose
        filler is gone, or not ours at all (a link), removed first."""
        fill.state = _OFF
        if self._off:
            return
        partial = fill.base + PARTIAL_SUFFIX
        locked, taken = None, False
        try:
            # (private where we make it: its entries are what later loads return;
            # a directory the user made keeps the mode they gave it)
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            fd = None
            for _ in range(3):
                try:
                    fd = open_recorded(fill.fds, partial, os.O_RDWR | os.O_CREAT | os.O_EXCL
                                       | os.O_NOFOLLOW | os.O_CLOEXEC)
                except FileExistsError:
                    if not _remove_if_stale(partial):
                        return  # another process fills it: this load goes without
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return      # (another's eviction took it as stale in between: it removes it)
                if os.path.lexists(fill.base + ENTRY_SUFFIX):
                    if _names(fd, partial):
                        _unlink(partial)    # (made by our open, after the filler's rename)
                    _unlock(fd)
                    return      # filled meanwhile
                if _names(fd, partial):
                    break
                _unlock(fd)     # removed (as stale, by another process's eviction)
                fd = None       # between our open and our lock: once more
            if fd is None:
                return
            locked = fd
            if not self._room(fill.size, partial):
                _unlink(partial)
                if fill.size > self.bound:
                    log.info("%s: an object of %d bytes is larger than the cache's bound (%d "
                             "bytes, %s): not cached", self.directory, fill.size, self.bound,
                             ENV_CACHE_MAX_BYTES)
                else:
                    self._degrade(OSError(errno.ENOSPC, f"no room for an object of {fill.size} "
                                          "bytes"), "making room")
                return
            os.fchmod(fd, 0o644)
            _write(fd, fill.head, 0)
            taken = True
        except OSError as e:
            self._degrade(e, "writing")
            if locked is not None:
                _unlink(partial)        # (locked by us: still ours)
            return
        finally:
            if locked is not None and not taken:
                _unlock(locked)
        fill.fd = fd
        fill.state = _FILLING
        fill.digests.append((0, len(fill.head), zlib.crc32(fill.head)))
        fill.whole = fill.add(0, len(fill.head))      # (an object of no data: whole now)
        fill.head = b""

    def _abandon(self, fill):
        _abandon(fill)

    def _room(self, size, own):
        """Makes room for ``size`` more bytes: lists the directory (partial
        files whose filler is gone are removed on the way), removes the
        entries ``evictions`` names; whether they fit now."""
        if size > self.bound:
            return False
        found, stamps, records, total = {}, {}, [], 0
        reading = {path for path, _ in self._hits.values()}
        for name in _listing(self.directory):
            path = os.path.join(self.directory, name)
            if path == own:
                continue
            try:
                st = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if name.endswith(PARTIAL_SUFFIX) or not name.endswith((ENTRY_SUFFIX, STAMP_SUFFIX,
                                                                   RECORD_SUFFIX)):
                if not _remove_if_stale(path):      # (a partial file, a stamp or record being written)
                    total += st.st_size
            elif name.endswith(RECORD_SUFFIX):
                records.append(Listed(path[:-len(RECORD_SUFFIX)], st.st_size, st.st_mtime_ns))
                total += st.st_size
            elif name.endswith(STAMP_SUFFIX):
                stamps[path[:-len(STAMP_SUFFIX)]] = st
            else:
                found[path[:-len(ENTRY_SUFFIX)]] = st
                total += st.st_size
        for base, st in stamps.items():
            if base in found or os.path.lexists(base + ENTRY_SUFFIX):
                total += st.st_size
            else:
                _unlink(base + STAMP_SUFFIX)    # its entry gone
        entries = [Listed(base, st.st_size + (stamps[base].st_size if base in stamps else 0),
                          max(st.st_mtime_ns, stamps[base].st_mtime_ns if base in stamps else 0))
                   for base, st in found.items()
                   if base + ENTRY_SUFFIX not in reading]   # (this checkpoint's: kept)
        entries += records      # (a directory's record goes by the same order: its last use)
        fs = os.statvfs(self.directory)
        gone, fits = evictions(entries, size, used=total, bound=self.bound,
                               free=fs.f_bavail * fs.f_frsize, keep_free=CACHE_KEEP_FREE)
        for base in gone:
            _unlink(base + ENTRY_SUFFIX)
            _unlink(base + STAMP_SUFFIX)
            _unlink(base + RECORD_SUFFIX)
        return fits

    def _degrade(self, error, what):
        """The cache fails: no fill starts from here on; one warning."""
        with self._lock:
            first, self._off = not self._off, True
        if first:
            reason = (error.strerror if isinstance(error, OSError) else None) or str(error)
            log.warning("the cache in %s failed while %s (%s): loading without it",
                        self.directory, what, reason)


# -- the policy: which entries go ---------------------------------------------------

class Listed(NamedTuple):
    """One entry of the directory, as its listing shows it."""

    path: str
    """The entry's path without its suffix: its entry (``.safetensors``)
    and its stamp (``.checked``) go together."""
    size: int
    """Its bytes (``st_size``), its stamp's included."""
    used_ns: int
    """When it was last used: the later of its entry's modification time
    (``st_mtime_ns``: its fill) and its stamp's, which each hit sets."""


def evictions(entries, size, *, used, bound, free, keep_free):
    """Which entries to remove so that ``size`` more bytes fit: the policy
    of ``Cache``, which lists the directory and removes what this names.

    The least recently used entries go first (the oldest ``used_ns``; the
    path breaks a tie), until the cache's files take at most ``bound``
    bytes with ``size`` more and the file system keeps ``keep_free`` bytes
    free; where even every entry gone leaves no room, every entry goes
    (and the object is not cached).

    Args:
        entries: the ``Listed`` entries that may be removed (not those of
            the open checkpoint, not partial files).
        size: the bytes of the object to cache.
        used: the bytes the cache's files take now (every entry and
            partial file, those of ``entries`` among them).
        bound: the most bytes the cache's files may take.
        free: the bytes free on the file system now.
        keep_free: the bytes the file system keeps free.

    Returns:
        ``(paths to remove, in order; whether the object then fits)``.
    """
    if size > bound:
        return [], False
    gone = []
    for entry in sorted(entries, key=lambda e: (e.used_ns, e.path)):
        if used + size <= bound and free - size >= keep_free:
            break
        gone.append(entry.path)
        used, free = used - entry.size, free + entry.size
    return gone, used + size <= bound and free - size >= keep_free


# -- the finisher: entries made after the load returned ---------------------------

def wait_for_cache_fills(timeout=None) -> bool:
    """Waits until every cache entry that this process's loads filled is
    made (or given up: a failed flush is a warning and no entry); whether
    none is pending any more.  A load returns once its bytes are out; the
    entries it filled are flushed to the disk and renamed into place after
    it, by a thread of this process (a later load of one of them in this
    process waits for its entry; the interpreter's exit waits too, for at
    most CACHE_FINISH_AT_EXIT seconds).

    Args:
        timeout: seconds at most (None: until done).
    """
    return _finisher.wait(timeout)


class _Finisher:
    """At most one thread per process (a daemon, started by a checkpoint's
    close that hands it entries to make, gone once none is queued) that
    makes them in order: ``_finish`` of each batch ``Cache.close`` hands on."""

    def __init__(self):
        self.cond = threading.Condition(threading.Lock())
        # (directory, [_Fill], None or (Cache, record) whose writes it waits
        # for first): the first one in work
        self.jobs = collections.deque()
        self.pending = collections.Counter()    # fill.base -> fills queued or in work
        self.thread = None
        self.stopped = False    # Ctrl-C at exit: no entry is named from here on
        self.exiting = False    # the exit waits: entries are named, their first open checks them

    def submit(self, directory, fills, writing=None) -> bool:
        """Queues ``fills`` (each _FINISHING; or, with ``writing``, a
        ``(Cache, record)`` whose close handed on writes not yet done, each
        fill of that cache: ``Cache._settle`` first); False where no
        thread starts."""
        with self.cond:
            if self.thread is None:
                thread = threading.Thread(target=self._run, name="instant_staging-cache",
                                          daemon=True)
                try:
                    thread.start()
                except RuntimeError:        # (no thread left to this process)
                    return False
                self.thread = thread
            self.jobs.append((directory, fills, writing))
            self.pending.update(f.base for f in fills)
            self.cond.notify_all()
        return True

    def wait(self, timeout=None) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: not self.jobs, timeout)

    def wait_for(self, base):
        with self.cond:
            self.cond.wait_for(lambda: not self.pending[base])

    def _run(self):
        # Ends when nothing is queued (the next submit starts another): a
        # process that loaded keeps no thread of the cache's.
        while True:
            with self.cond:
                if not self.jobs:
                    self.thread = None
                    return
                directory, fills, writing = self.jobs[0]
            try:
                if writing is None:
                    _finish(directory, fills, self)
                else:
                    cache, record = writing
                    _finish(directory, cache._settle(fills, record), self)
            except BaseException:       # (a bug: each fill still ends, no job is left pending)
                log.exception("the cache in %s: finishing its entries failed", directory)
                if writing is not None:
                    writing[0]._writers.close()     # (no write runs on a descriptor closed here)
                for fill in fills:
                    with fill.lock:
                        _abandon(fill)
                        close_recorded(fill.fds)
            with self.cond:
                self.jobs.popleft()
                self.pending.subtract(f.base for f in fills)
                self.pending = +self.pending        # (its zeros dropped)
                self.cond.notify_all()

    def name(self, partial, entry) -> bool:
        """Renames ``partial`` to ``entry`` unless an exit's Ctrl-C stopped it; whether it did."""
        with self.cond:
            if self.stopped:
                return False
            os.rename(partial, entry)
            return True


def _finish(directory, fills, finisher=None):
    """Makes the entries of ``fills`` (each written whole, _FINISHING, its
    partial file locked): each checked (its size, no byte unwritten), its
    digest appended (``_trailer``), flushed (fsync), renamed to its entry's
    name while still locked, the directory flushed, then unlocked; then
    read back, checked in full and stamped (``_check_made``: not while the
    exit waits); the object's older entries and their stamps removed.  A fill that fails is removed, with
    one warning for them all: the load returned already."""
    failed = None
    for fill in fills:
        named = False
        with fill.lock:
            if fill.state == _FINISHING:        # (else given up meanwhile: an interrupted close)
                partial, entry = fill.base + PARTIAL_SUFFIX, fill.base + ENTRY_SUFFIX
                try:
                    if os.fstat(fill.fd).st_size != fill.size:
                        raise OSError(errno.EIO, f"the partial file is not {fill.size} bytes")
                    if not _covers(fill.digests, fill.size):
                        raise OSError(errno.EIO, "the partial file has bytes that no fill wrote")
                    _write(fill.fd, _trailer(fill.size, fill.digests), fill.size)
                    _flush(fill.fd)
                    if not _names(fill.fd, partial):
                        raise OSError(errno.ENOENT, "the partial file was moved or removed")
                    if finisher is None:
                        os.rename(partial, entry)
                        named = True
                    else:
                        named = finisher.name(partial, entry)   # (False: an exit's Ctrl-C)
                except OSError as e:
                    failed = failed or e
                if named:
                    fill.state = _DONE
                    _unlock(fill.fd)
                else:
                    _abandon(fill)
            if not named:
                close_recorded(fill.fds)
        if not named:
            continue
        try:
            try:
                _fsync_directory(directory)     # (the entry is whole already: its name's durability)
            except OSError as e:
                failed = failed or e
            if finisher is None or not finisher.exiting:
                failed = _check_made(fill, entry) or failed
        finally:
            close_recorded(fill.fds)
        key, mine = os.path.basename(fill.base).split(".")[0], os.path.basename(fill.base)
        for name in _listing(directory):
            if (name.startswith(key + ".") and name.endswith((ENTRY_SUFFIX, STAMP_SUFFIX))
                    and not name.startswith(mine + ".")):
                _unlink(os.path.join(directory, name))      # an older version, its stamp
    if failed is not None:
        reason = failed.strerror or str(failed)
        log.warning("the cache in %s failed while finishing its entries (%s): not cached",
                    directory, reason)


def _check_made(fill, entry):
    """Checks in full the entry just made of ``fill`` (its descriptor still
    open: read back from the page cache, off any load's path) and stamps it,
    so that its first hit need not read it all again; an entry that fails
    is removed, its error returned (None where it is whole)."""
    try:
        st = os.fstat(fill.fd)
        # (the header is the one the fill wrote: its first range's CRC checks it)
        damage = _damage(fill.fd, st, fill.size, None)
        if damage is None:
            _stamp(fill.base, fill.fd, st)
            return None
    except OSError as e:
        damage = e.strerror or str(e)
    if _names(fill.fd, entry):
        _unlink(entry)
    return OSError(errno.EIO, f"entry {os.path.basename(entry)} read back damaged ({damage})")


def _abandon(fill):
    """Ends ``fill`` (under ``fill.lock``): a partial file of ours is removed."""
    if fill.state in (_FILLING, _FINISHING):
        _unlink(fill.base + PARTIAL_SUFFIX)     # (locked by us: still ours)
        _unlock(fill.fd)
    if fill.state != _DONE:
        fill.state = _OFF


def _flush(fd):
    os.fsync(fd)


def _finish_at_exit():
    # Bounded: a disk that stopped answering (a hung network file system)
    # must not hold the exit forever; a fill not finished by then stays a
    # partial file, which no load trusts.  A Ctrl-C here ends the wait and
    # names no entry from then on (those already named are whole).
    finisher = _finisher
    with finisher.cond:
        if not finisher.jobs:
            return
    # (a full check of each entry made is the first hit's to do: the exit
    # waits only for what it must, the flush)
    finisher.exiting = True
    try:
        if not finisher.wait(CACHE_FINISH_AT_EXIT):
            log.warning("the cache: exit did not wait longer than %s s for its entries to be "
                        "flushed; those not made are not cached", CACHE_FINISH_AT_EXIT)
    except KeyboardInterrupt:
        with finisher.cond:
            finisher.stopped = True     # (quietly: the user asked the exit not to wait)


def _forget_in_child():
    # A fork child does not finish its parent's fills: the parent's thread
    # does, and this process's copies of their descriptors are closed (not
    # unlocked: the flock is the open file's, which the parent still holds
    # and unlocks itself).  The condition may have been copied held by the
    # parent's thread, which does not exist here.
    global _finisher
    old, _finisher = _finisher, _Finisher()
    for _, fills, _ in old.jobs:
        for fill in fills:
            close_recorded(fill.fds)
    # Its caches' writers are the parent's: their fills are given up here
    # without a file removed (the parent fills them), and their locks,
    # which a writer may have held as it forked, made anew.
    for writers in list(_all_writers):
        writers.forget()
        cache = writers.cache
        cache._off = True
        for fill in cache._fills.values():
            fill.lock = threading.Lock()
            if fill.state != _DONE:
                fill.state = _OFF


_finisher = _Finisher()
os.register_at_fork(after_in_child=_forget_in_child)
atexit.register(_finish_at_exit)


class CachedShards(Shards):
    """A URL source whose every object the cache holds: its entries, read
    as local files.  ``paths`` are the objects' URLs (what ``files``, the
    tensors' infos and errors name), the descriptors the entries' (each
    the file the open checked: ``Cache.checked``).  ``verify=`` reads the
    objects from the server (``remote``, the ``RemoteShards`` it was made
    from): an entry compared with itself would prove nothing."""

    # (its identity in a group load is its objects', as a rank that fetches them sees it)
    from_url = True

    # Offline mode's variable (``offline_shards``), None online: ``verify=``
    # then compares each entry with the digest its fill made, read in full
    # (no server to ask).
    offline = None

    def __init__(self, files, origins, sizes, checked):
        super().__init__()
        self._files, self._origins = files, origins
        self._sizes, self._checked = sizes, checked
        self.remote = None      # the RemoteShards (closed with this one)
        self._verified = set()  # offline: the entries checked in full for verify=
        self._verify_lock = threading.Lock()

    def _open_all(self, urls):
        for url, path, size, checked in zip(urls, self._files, self._sizes, self._checked):
            fd = open_recorded(self.fds, path, _OPEN_FLAGS | os.O_NOFOLLOW)
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != checked:
                raise OSError(errno.ESTALE, f"{path} is not the entry that was checked")
            os.set_blocking(fd, True)
            self.paths.append(url)
            # (the object's bytes: its digest follows them in the entry)
            length = header_length(_pread_exact(fd, 8, 0, url), size, url)
            self.headers.append(parse_header(_pread_exact(fd, length, 8, url), url, size))

    def read_bytes(self, index, offset, length):
        # verify=: the server's bytes (If-Match the ETag the open pinned);
        # offline, the entry's own once it matched its digest in full
        if self.remote is None:
            if self.offline is not None:
                self._verify_offline(index)
            return super().read_bytes(index, offset, length)
        return self.remote.read_bytes(index, offset, length)

    def _verify_offline(self, index):
        with self._verify_lock:
            if index in self._verified:
                return
            fd = self.fds[index]
            damage = _damage(fd, os.fstat(fd), self._sizes[index], None, full=True)
            if damage is not None:
                from ._errors import VerifyError
                raise VerifyError(f"{self.paths[index]}: its cache entry "
                                  f"{os.path.basename(self._files[index])} does not match the "
                                  f"digest made when it was filled ({damage}); offline mode is on "
                                  f"({self.offline}=1), so the server was not asked",
                                  self.paths[index])
            self._verified.add(index)

    def current_size(self, index):
        return self.headers[index].file_size

    def close(self):
        remote, self.remote = self.remote, None
        try:
            super().close()
        finally:
            if remote is not None:
                remote.close()      # (its cache's close closes this one again: idempotent)

    def byte_sources(self):
        return self.total_bytes, 0

    def changed(self, wait=True):
        # Entries are never written once named (a new one replaces an old
        # by a rename); their times move when a load marks them used.
        return []

    def origin(self, index):
        """As ``RemoteShards.origin``: the object's, as the open found it."""
        return self._origins[index]


def cached(shards):
    """``shards`` (an open ``RemoteShards``), or, where its cache holds
    every object, a ``CachedShards`` of the entries, which keeps ``shards``
    for ``verify=``'s reads and closes it; until the caller holds that one,
    closing ``shards`` closes it too."""
    cache = shards.cache if isinstance(shards, RemoteShards) else None
    files = None if cache is None else cache.whole(len(shards.paths))
    if files is None:
        return shards
    count = len(files)
    local = CachedShards(files, [shards.origin(i) for i in range(count)],
                         [h.file_size for h in shards.headers],
                         [cache.checked(i) for i in range(count)])
    try:
        local.open(shards.paths)
    except Exception:           # an entry removed or replaced meanwhile: read the objects
        local.close()
        return shards
    except BaseException:
        local.close()
        raise
    cache.local = local         # (a second close of shards, by the caller's cleanup, closes it)
    local.remote = shards
    cache.hand_over()
    # (its requests' thread, until verify= asks the server again)
    shards._requests.close()
    return local


# -- offline: entries found by their URL alone ---------------------------------------

def offline():
    """The variable that turns offline mode on (its name), or None: online.
    ``INSTANT_STAGING_OFFLINE`` where set (``0`` keeps the loader online
    whatever huggingface_hub's switch says), else ``HF_HUB_OFFLINE`` read
    as huggingface_hub reads it (``1``, ``ON``, ``YES``, ``TRUE``)."""
    value = envs.get(ENV_OFFLINE)
    if value is not None:
        return ENV_OFFLINE if value else None
    if os.environ.get(ENV_HF_OFFLINE, "").strip().upper() in _HF_TRUE:
        return ENV_HF_OFFLINE
    return None


def _url_key(url):
    return hashlib.sha256(url.encode("utf-8", "surrogateescape")).hexdigest()


def remember(directory, url, named):
    """Keeps what the directory or index ``url`` named (``Source.named``:
    names relative to it, nothing of the URL itself) as its record in the
    cache, for an offline open of the same source; written only where it
    changed, to a new file renamed onto its name.  A record that cannot be
    written is no error (the load goes on; offline, that source is a miss)."""
    import json
    base = os.path.join(directory, f"{_url_key(url)}.{RECORD_VERSION}")
    data = json.dumps(named, sort_keys=True, separators=(",", ":")).encode()
    try:
        if _read_small(base + RECORD_SUFFIX) == data:
            return
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError:
        return
    _replace_small(base + RECORD_SUFFIX, data)


def _read_small(path, limit=64 << 20):
    """The bytes of file ``path`` (no link followed), None where there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        return os.pread(fd, st.st_size, 0)
    finally:
        os.close(fd)


def _offline_miss(what, directory, why):
    where = (f"the cache in {directory} holds no entry of it" if directory else
             "no cache is set (cache_dir=, INSTANT_STAGING_CACHE_DIR)")
    return FileNotFoundError(f"{what}: offline mode is on ({why}=1), so the server was not asked, "
                             f"and {where}; load it once online with the cache set, or unset {why}")


def offline_source(source, directory, why):
    """``(Source, object URLs)`` of a URL source, resolved without asking
    the server: a list of objects or one object as given, a directory or an
    index by its record (``remember``); a FileNotFoundError naming the
    source where the cache holds none."""
    import json

    from ._remote import named_by, object_urls
    from ._schemes import redact_url
    from ._source import SHARD_SUFFIX, Source, parse_index
    if not isinstance(source, str):
        urls = object_urls(source)
        return Source([redact_url(u) for u in urls]), urls
    kind, url = named_by(source)
    if kind == "object":
        return Source([redact_url(url)]), [url]
    shown = redact_url(url)
    raw = None if directory is None else _read_small(
        os.path.join(directory, f"{_url_key(url)}.{RECORD_VERSION}{RECORD_SUFFIX}"))
    try:
        named = None if raw is None else json.loads(raw)
    except ValueError:
        named = None
    base = url if kind == "directory" else url.rsplit("/", 1)[0] + "/"
    if isinstance(named, dict) and kind == "directory" and "index" in named:
        kind, url = "index", base + str(named["index"])     # (the directory's index named it)
        shown = redact_url(url)
    if isinstance(named, dict) and kind == "index" and isinstance(named.get("weight_map"), dict):
        weight_map = parse_index(json.dumps({"weight_map": named["weight_map"]}).encode(), shown)
        shards = sorted(set(weight_map.values()))
        return (Source([redact_url(base + s) for s in shards], shown,
                       {n: redact_url(base + s) for n, s in weight_map.items()}),
                [base + s for s in shards])
    shards = named.get("shards") if isinstance(named, dict) and kind == "directory" else None
    if (not isinstance(shards, list) or not shards
            or not all(isinstance(s, str) and s.endswith(SHARD_SUFFIX) and "/" not in s
                       and s not in (".", "..") for s in shards)):
        raise _offline_miss(f"{shown} (a {kind}: its list of objects)", directory, why)
    return Source([redact_url(base + s) for s in shards]), [base + s for s in shards]


def _newest(directory, url, names):
    """The base (path less suffix) of the newest entry of ``url`` among
    ``names`` (the directory's listing), None where it has none.  An object
    has one entry but for a while after a new version's is named (the old
    one is removed next): the one made last is the newer."""
    key = _url_key(url) + "."
    newest, when = None, -1
    for name in names:
        if name.startswith(key) and name.endswith(ENTRY_SUFFIX):
            path = os.path.join(directory, name)
            try:
                mtime = os.stat(path, follow_symlinks=False).st_mtime_ns
            except FileNotFoundError:
                continue
            if mtime > when:
                newest, when = path[:-len(ENTRY_SUFFIX)], mtime
    return newest


def _object_size(fd, st):
    """The object's size that entry ``fd``'s digest names, None where it has none."""
    if not stat.S_ISREG(st.st_mode) or st.st_size < _FOOTER.size:
        return None
    size, _, _, magic = _FOOTER.unpack(_read(fd, _FOOTER.size, st.st_size - _FOOTER.size))
    return size if magic == _MAGIC else None


def offline_shards(urls, directory, why):
    """The ``CachedShards`` (not opened yet) of the entries of ``urls``,
    found by URL alone and trusted without asking the server: each checked
    as an open checks it (its stamp, else in full against its digest, then
    stamped); a damaged one is removed with a warning, and is a miss.  A
    miss is a FileNotFoundError naming the object (its URL as shown)."""
    from ._schemes import redact_url
    names = [] if directory is None else _listing(directory)
    files, origins, sizes, checked, fds = [], [], [], [], []
    try:
        for url in urls:
            base = None if directory is None else _newest(directory, url, names)
            got = None if base is None else _trusted(base, fds, directory)
            if got is None:
                raise _offline_miss(redact_url(url), directory, why)
            size, st = got
            files.append(base + ENTRY_SUFFIX)
            sizes.append(size)
            checked.append((st.st_dev, st.st_ino))
            # (no ETag offline: the entry's version digest stands for it)
            origins.append((redact_url(url), None, "cache:" + base.rsplit(".", 1)[1]))
    finally:
        close_recorded(fds)
    local = CachedShards(files, origins, sizes, checked)
    local.offline = why
    return local


def _trusted(base, fds, directory):
    """``(object size, fstat)`` of entry ``base`` once checked (``_damage``,
    its header compared with none: nothing of the server's to compare);
    None where it is gone or damaged (then removed, with a warning)."""
    entry, fd = base + ENTRY_SUFFIX, None
    try:
        fd = open_recorded(fds, entry, _ENTRY_FLAGS)
        st = os.fstat(fd)
        size = _object_size(fd, st)
        stamped = size is not None and _stamped(base, st)
        damage = _damage(fd, st, -1 if size is None else size, None, full=not stamped)
        if damage is None:
            if not stamped:
                _stamp(base, fd, st)
            return size, st
    except FileNotFoundError:
        return None
    except OSError as e:
        damage = "a symbolic link, not an entry" if e.errno == errno.ELOOP else (e.strerror or str(e))
    if fd is None or _names(fd, entry):
        _unlink(entry)
        _unlink(base + STAMP_SUFFIX)
    log.warning("the cache in %s: entry %s is damaged (%s): removed", directory,
                os.path.basename(entry), damage)
    return None


# -- files -------------------------------------------------------------------------

def _listing(directory):
    try:
        return [name for name in os.listdir(directory) if _OURS.match(name)]
    except OSError:
        return []


def _names(fd, path):
    """Whether ``path`` names the file open as ``fd`` (itself, not a link to it)."""
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _remove_if_stale(path):
    """Removes partial file ``path`` where no filler holds its lock, or
    where it is a link (none of ours: planted); whether it did."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            _unlink(path)       # (the link itself: unlink follows none)
            return True
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    try:
        if _names(fd, path):
            _unlink(path)
            return True
        return False
    finally:
        os.close(fd)


def _write(fd, data, offset):
    """All of ``data`` at ``offset``; a write cut short (a full disk, a file
    size limit) is asked again for the rest, which raises its error."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        if n == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view, offset = view[n:], offset + n


def _unlock(fd):
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError:
        pass


def _unlink(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _stamp_of(st):
    return _STAMP.pack(_STAMP_MAGIC, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                       st.st_ctime_ns)


def _stamped(base, st):
    """Whether the stamp of entry ``base`` records ``st`` (the entry's
    fstat now): nothing wrote the entry through the file system since its
    last full check (its ctime, which only the kernel sets, unchanged).
    Marks the entry used (the stamp's mtime: the entry's own times are
    what the stamp records)."""
    try:
        fd = os.open(base + STAMP_SUFFIX, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
                     | os.O_NONBLOCK)
    except OSError:
        return False            # none, or a link (never ours): a full check
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        if os.pread(fd, _STAMP.size + 1, 0) != _stamp_of(st):
            return False
        try:
            os.utime(fd)
        except OSError:
            pass                # a read-only cache is still read
        return True
    finally:
        os.close(fd)


def _stamp(base, fd, st):
    """Records that the entry ``base`` open as ``fd`` was checked in full
    as ``st`` (its fstat before the check): its stamp, written to a new
    file of ours and renamed onto its name (no link followed, nothing the
    entry's times would show).  None where the entry changed during the
    check, or where its last change is not older than the stamp (a write in
    the same tick of the kernel's clock would leave the same times: the
    next open checks again); a stamp that cannot be written is no error."""
    record = _stamp_of(st)
    try:
        if _stamp_of(os.fstat(fd)) != record:
            return
    except OSError:
        return
    _replace_small(base + STAMP_SUFFIX, record,
                   ready=lambda out: os.fstat(out).st_mtime_ns > st.st_ctime_ns)


def _replace_small(path, data, ready=None):
    """Writes ``data`` to a new file of ours (``O_EXCL``, no link followed,
    locked so that an eviction removes it only once we are gone), 0644 as
    the entries (others who read them read it too), and renames it onto
    ``path`` where ``ready(fd)``, if given, says so once it is written; a
    file that cannot be written is no error, and nothing of ours is left."""
    temp = f"{path}-{os.urandom(8).hex()}"
    try:
        out = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                      0o600)
    except OSError:
        return
    try:
        fcntl.flock(out, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _write(out, data, 0)
        os.fchmod(out, 0o644)
        if ready is None or ready(out):
            os.rename(temp, path)
            return
    except OSError:
        pass
    finally:
        os.close(out)
    _unlink(temp)


# -- the digest --------------------------------------------------------------------

# ``_damage``'s word for an entry with no digest at all: one an earlier
# version made (the object's bytes alone), filled again without a warning.
_EARLIER = "no digest"


def _trailer(size, ranges):
    """The digest that follows the ``size`` bytes of an entry whose fill
    wrote ``ranges`` (offset, length, CRC-32)."""
    table = b"".join(_RANGE.pack(*r) for r in sorted(set(ranges)))
    return table + _FOOTER.pack(size, len(table) // _RANGE.size, zlib.crc32(table), _MAGIC)


def _covers(ranges, size):
    """Whether ``ranges`` (offset, length, ...) cover ``[0, size)``, no byte left out."""
    end = 0
    for offset, length, *_ in sorted(ranges):
        if offset > end:
            return False
        end = max(end, offset + length)
    return end >= size


def _damage(fd, st, size, head, full=True):
    """Why entry ``fd`` (``st``: its fstat) is not the object of ``size``
    bytes whose header is ``head``; None where it is: a regular file, its
    digest whole, covering every byte, its header ``head`` (None: not
    compared), and, where ``full``, every range of it the CRC-32 its fill
    made (read back: ``_check``)."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_size == size:
        return _EARLIER
    if st.st_size < size + _FOOTER.size:
        return "cut short"
    got, count, crc, magic = _FOOTER.unpack(_read(fd, _FOOTER.size, st.st_size - _FOOTER.size))
    if magic != _MAGIC or got != size or st.st_size != size + count * _RANGE.size + _FOOTER.size:
        return "its digest is missing or does not fit its size"
    table = _read(fd, count * _RANGE.size, size)
    if zlib.crc32(table) != crc:
        return "its digest is damaged"
    ranges = list(_RANGE.iter_unpack(table))
    if any(offset + length > size for offset, length, _ in ranges) or not _covers(ranges, size):
        return "its digest leaves bytes unchecked"
    if head is not None and _read(fd, len(head), 0) != head:
        return "its header is not the object's"
    if not full:
        return None
    bad = _check(fd, ranges)
    if bad is not None:
        return f"bytes [{bad[0]}, {bad[0] + bad[1]}) differ from their digest"
    return None


def _read(fd, length, offset):
    """``length`` bytes at ``offset`` of ``fd``; an OSError where it ends first."""
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise OSError(errno.EIO, f"an entry ended at byte {offset + len(data)}")
    return data


def _check(fd, ranges):
    """The first of ``ranges`` whose bytes in ``fd`` are not its CRC-32;
    None where each is.  Read back in pieces of CACHE_CHECK_PIECE by up to
    CACHE_CHECK_THREADS threads: pread and zlib's crc32 release the GIL."""
    buffers = threading.local()
    size = min(CACHE_CHECK_PIECE, max((r[1] for r in ranges), default=0))

    def same(r):
        offset, length, crc = r
        buf = getattr(buffers, "buf", None)
        if buf is None:
            buf = buffers.buf = memoryview(bytearray(size))
        got, end = 0, offset + length
        while offset < end:
            piece = buf[:min(len(buf), end - offset)]
            if os.preadv(fd, [piece], offset) != len(piece):
                return False
            got = zlib.crc32(piece, got)
            offset += len(piece)
        return got == crc

    threads = min(len(ranges), default_threads(CACHE_CHECK_THREADS))
    if threads <= 1 or sum(r[1] for r in ranges) <= CACHE_CHECK_PIECE:
        results = map(same, ranges)
    else:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(threads, thread_name_prefix="instant_staging-cache-check") as pool:
            results = list(pool.map(same, ranges))
    for r, ok in zip(ranges, results):
        if not ok:
            return r
    return None


def _fsync_directory(path):
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
