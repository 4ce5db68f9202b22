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
the size and ETag of the GET that read its header, and the entry's first
bytes are compared with that header.  Where every object has its entry,
the checkpoint is read from the entries as local files (``CachedShards``:
the local pipeline, pread straight into the staging slots, the page
cache's knobs); where some have one, their ranges are read from the
entries and the rest fetched (and filled).

Layout.  A flat directory of the cache's own files (nothing else in it is
looked at or removed), as ``ls -l`` shows one holding two objects, the
second of them also at a newer version being filled::

    $ ls -l $INSTANT_STAGING_CACHE_DIR
    -rw-r--r-- 1 me me 4965799096 Jun  2 09:14 0b3e...c41f.5d2a9e0c71b4f6a3.safetensors
    -rw-r--r-- 1 me me 1073741824 Jun  2 11:40 7a91...e2d0.8e17c2d04a9b3f55.partial
    -rw-r--r-- 1 me me 4983148400 Jun  1 17:02 7a91...e2d0.c1f0a9b8e7d6c523.safetensors
       (64 hex digits: the URL's hash)  ^^^^  (16: the version's)

An entry (``.safetensors``) is an object's bytes as the server holds
them, its modification time its last use (the bound's order); a partial
file (``.partial``) is an object being filled, locked by its filler; the
old version's entry goes once the new one is named.

Filling.  An object without an entry is filled by the reader threads that
fetch it: each fetched range is written at its offset into the object's
partial file (``<name>.partial``) from the client's own buffer
(``os.pwrite``: no second fetch, no copy of ours); its header came with
the open.  When the checkpoint closes (its loads' readers joined, their
tensors out), each object of which every byte was written (by one load, or
by the batches of several loads of one ``Checkpoint``) is handed to the
finisher, which makes its entry after the load returned (the flush waits
for the disk: it is in no load's way): the partial file flushed (fsync),
renamed to the entry's name while its lock is still held, the directory
flushed, the lock let go.  An entry appears whole or not at all, and a
crash, a SIGKILL or a Ctrl-C before the rename leaves at most a partial
file, which no load trusts (its next filler truncates it, and any filler's
eviction removes one whose filler is gone).  A failed flush (a full disk)
is no entry and one warning, logged by the finisher: the load stands.

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
file: the cache holds only whole objects.

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
used entries (by modification time, set again at each hit) are removed
until the object fits, and ``CACHE_KEEP_FREE`` of the file system is left
free.  An object larger than the bound is not cached.

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
import threading
from typing import NamedTuple

from .. import envs
from ..defaults import CACHE_FINISH_AT_EXIT, CACHE_KEEP_FREE, CACHE_MAX_BYTES
from ._fds import close_recorded, open_recorded
from ._header import read_header
from ._remote import RemoteShards
from ._shards import _OPEN_FLAGS, Shards

log = logging.getLogger("instant_staging")

ENV_CACHE_DIR = "INSTANT_STAGING_CACHE_DIR"
ENV_CACHE_MAX_BYTES = "INSTANT_STAGING_CACHE_MAX_BYTES"

ENTRY_SUFFIX = ".safetensors"
PARTIAL_SUFFIX = ".partial"
# The cache's own files: nothing else in the directory is ever looked at or removed.
_OURS = re.compile(r"^[0-9a-f]{64}\.[0-9a-f]{16}\.(?:safetensors|partial)$")

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

    __slots__ = ("base", "covered", "fd", "fds", "handed", "head", "lock", "size", "state", "whole")

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


class Cache:
    """One open checkpoint's use of a cache directory: the hooks that
    ``RemoteShards`` calls (``opened``, ``read``, ``write``, ``close``).

    Its descriptors (entries read, partial files filled) are recorded as
    they open (``_fds.pyx``) and closed by ``close()``, which the
    checkpoint's owner calls once the reader threads are joined: a reader
    never writes a descriptor that was closed under it."""

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
        self.local = None       # the CachedShards made from it (closed with it until handed on)

    # -- the checkpoint's hooks ---------------------------------------------------

    def opened(self, index, obj, head):
        """Object ``index`` (a ``_remote._Object`` with its size and ETag) was
        opened and ``head`` are its bytes up to its data: finds its entry,
        else prepares its fill."""
        if self._off or not obj.etag:
            return
        base = os.path.join(self.directory, entry_base(obj.url, obj.etag, obj.version, obj.size))
        entry = base + ENTRY_SUFFIX
        # An earlier checkpoint of this process still finishing this entry:
        # waited for (a flush of bytes already written, where the other way,
        # its locked partial file, would fetch the whole object again).
        _finisher.wait_for(base)
        fd = None
        try:
            fd = open_recorded(self._fds, entry, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
            st = os.fstat(fd)
            whole = (stat.S_ISREG(st.st_mode) and st.st_size == obj.size
                     and os.pread(fd, len(head), 0) == head)
        except FileNotFoundError:
            whole = False
        except OSError as e:
            self._degrade(e, "reading")
            return
        if whole:
            _touch(entry)
            self._hits[index] = (entry, fd)
            return
        if fd is not None:
            _unlink(entry)      # damaged (cut short, changed by hand): filled again
        self._fills[index] = _Fill(base, obj.size, bytes(head))

    def whole(self, count):
        """The entry paths of objects ``0..count-1`` where the cache holds each, else None."""
        if len(self._hits) != count:
            return None
        return [self._hits[i][0] for i in range(count)]

    def holds(self, index):
        """Whether object ``index`` is read from its entry."""
        return index in self._hits

    def read(self, index, offset, length):
        """Object ``index``'s bytes from its entry; None where it has none (fetched)."""
        hit = self._hits.get(index)
        if hit is None:
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
        """``data``, fetched at ``offset`` of object ``index``, into its fill."""
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
        try:
            _write(fill.fd, data, offset)
        except OSError as e:
            self._degrade(e, "writing")
            with fill.lock:
                self._abandon(fill)
            return
        with fill.lock:
            if fill.state == _FILLING and fill.add(offset, offset + len(data)):
                fill.whole = True

    def sources(self, entries):
        """``(bytes from the cache, bytes fetched)`` of ``entries`` (index, tensor)."""
        cached = sum(t.nbytes for i, t in entries if i in self._hits)
        fetched = sum(t.nbytes for i, t in entries if i not in self._hits)
        return cached, fetched

    def close(self):
        """Hands the objects written whole to the finisher (which makes
        their entries, ``_finish``, after this returns), removes the partial
        files of the others, closes every other descriptor (and the
        CachedShards made from it, until handed on); idempotent.  Called
        once the reader threads are joined and the tensors are out: the
        flush (fsync), which waits for the disk, is in no load's way."""
        handed = []
        try:
            for fill in list(self._fills.values()):
                if fill.handed:
                    continue    # (a second close; its lock may be the finisher's, for a while)
                with fill.lock:
                    if fill.state == _FILLING and fill.whole and not self._off:
                        fill.state, fill.handed = _FINISHING, True
                        handed.append(fill)
                    else:
                        self._abandon(fill)
            if handed and not _finisher.submit(self.directory, handed):
                _finish(self.directory, handed)     # (no thread to be had: here, now)
        except BaseException:
            for fill in handed:         # (an interrupt: the finisher skips what is _OFF)
                with fill.lock:
                    self._abandon(fill)
                    close_recorded(fill.fds)
            raise
        finally:
            for fill in list(self._fills.values()):
                if not fill.handed:     # (a handed one's: the finisher's, under its lock)
                    close_recorded(fill.fds)
            close_recorded(self._fds)
            local, self.local = self.local, None
            if local is not None:
                local.close()

    # -- filling ------------------------------------------------------------------

    def _start(self, fill):
        """Takes object ``fill``'s partial file (under ``fill.lock``): makes
        it, locks it, makes room, writes its header; only then is the fill
        _FILLING (a reader that sees it so writes into a file that nothing
        truncates any more).  Leaves it _OFF where another process fills
        it, its entry is there already, or the cache fails."""
        fill.state = _OFF
        if self._off:
            return
        partial = fill.base + PARTIAL_SUFFIX
        locked, taken = None, False
        try:
            os.makedirs(self.directory, exist_ok=True)
            for _ in range(2):
                fd = open_recorded(fill.fds, partial, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return      # another process fills it: this load goes without
                if os.path.exists(fill.base + ENTRY_SUFFIX):
                    if _names(fd, partial):
                        _unlink(partial)    # (made by our open, after the filler's rename)
                    _unlock(fd)
                    return      # filled meanwhile
                if _names(fd, partial):
                    break
                _unlock(fd)     # renamed or removed (as stale, by another process's
                fd = None       # eviction) between our open and our lock: once more
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
            os.ftruncate(fd, 0)         # (a crashed filler's bytes)
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
        entries, total = [], 0
        reading = {path for path, _ in self._hits.values()}
        for name in _listing(self.directory):
            path = os.path.join(self.directory, name)
            if path == own:
                continue
            try:
                st = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if name.endswith(PARTIAL_SUFFIX):
                if not _remove_if_stale(path):
                    total += st.st_size
            else:
                if path not in reading:         # (this checkpoint's other objects: kept)
                    entries.append(Listed(path, st.st_size, st.st_mtime_ns))
                total += st.st_size
        fs = os.statvfs(self.directory)
        gone, fits = evictions(entries, size, used=total, bound=self.bound,
                               free=fs.f_bavail * fs.f_frsize, keep_free=CACHE_KEEP_FREE)
        for path in gone:
            _unlink(path)
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
    """The entry's path."""
    size: int
    """Its bytes (``st_size``)."""
    used_ns: int
    """When it was last used: its modification time (``st_mtime_ns``),
    set again at each hit."""


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
        self.jobs = collections.deque()     # (directory, [_Fill]): the first one in work
        self.pending = collections.Counter()    # fill.base -> fills queued or in work
        self.thread = None
        self.stopped = False    # Ctrl-C at exit: no entry is named from here on

    def submit(self, directory, fills) -> bool:
        """Queues ``fills`` (each _FINISHING); False where no thread starts."""
        with self.cond:
            if self.thread is None:
                thread = threading.Thread(target=self._run, name="instant_staging-cache",
                                          daemon=True)
                try:
                    thread.start()
                except RuntimeError:        # (no thread left to this process)
                    return False
                self.thread = thread
            self.jobs.append((directory, fills))
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
                directory, fills = self.jobs[0]
            try:
                _finish(directory, fills, self)
            except BaseException:       # (a bug: each fill still ends, no job is left pending)
                log.exception("the cache in %s: finishing its entries failed", directory)
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
    partial file locked): each flushed (fsync), checked, renamed to its
    entry's name while still locked, the directory flushed, then unlocked;
    the object's older entries removed.  A fill that fails is removed, with
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
                    _flush(fill.fd)
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
            close_recorded(fill.fds)
        if not named:
            continue
        try:
            _fsync_directory(directory)     # (the entry is whole already: its name's durability)
        except OSError as e:
            failed = failed or e
        key, mine = os.path.basename(fill.base).split(".")[0], os.path.basename(entry)
        for name in _listing(directory):
            if name.startswith(key + ".") and name.endswith(ENTRY_SUFFIX) and name != mine:
                _unlink(os.path.join(directory, name))      # an older version
    if failed is not None:
        reason = failed.strerror or str(failed)
        log.warning("the cache in %s failed while finishing its entries (%s): not cached",
                    directory, reason)


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
    for _, fills in old.jobs:
        for fill in fills:
            close_recorded(fill.fds)


_finisher = _Finisher()
os.register_at_fork(after_in_child=_forget_in_child)
atexit.register(_finish_at_exit)


class CachedShards(Shards):
    """A URL source whose every object the cache holds: its entries, read
    as local files.  ``paths`` are the objects' URLs (what ``files``, the
    tensors' infos and errors name), the descriptors the entries'."""

    # (its identity in a group load is its objects', as a rank that fetches them sees it)
    from_url = True

    def __init__(self, files, origins):
        super().__init__()
        self._files, self._origins = files, origins

    def _open_all(self, urls):
        for url, path in zip(urls, self._files):
            fd = open_recorded(self.fds, path, _OPEN_FLAGS)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, f"{path} is not a regular file")
            os.set_blocking(fd, True)
            self.paths.append(url)
            self.headers.append(read_header(fd, url))

    def byte_sources(self):
        return self.total_bytes, 0

    def changed(self):
        # Entries are never written once named (a new one replaces an old
        # by a rename); their times move when a load marks them used.
        return []

    def origin(self, index):
        """As ``RemoteShards.origin``: the object's, as the open found it."""
        return self._origins[index]


def cached(shards):
    """``shards`` (an open ``RemoteShards``), or, where its cache holds
    every object, a ``CachedShards`` of the entries (``shards`` closed);
    until the caller holds that one, closing ``shards`` closes it too."""
    cache = shards.cache if isinstance(shards, RemoteShards) else None
    files = None if cache is None else cache.whole(len(shards.paths))
    if files is None:
        return shards
    local = CachedShards(files, [shards.origin(i) for i in range(len(files))])
    try:
        local.open(shards.paths)
    except Exception:           # an entry removed meanwhile: read the objects
        local.close()
        return shards
    except BaseException:
        local.close()
        raise
    shards.close()
    cache.local = local         # (a second close of shards, by the caller's cleanup, closes it)
    return local


# -- files -------------------------------------------------------------------------

def _listing(directory):
    try:
        return [name for name in os.listdir(directory) if _OURS.match(name)]
    except OSError:
        return []


def _names(fd, path):
    """Whether ``path`` names the file open as ``fd``."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _remove_if_stale(path):
    """Removes partial file ``path`` where no filler holds its lock; whether it did."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
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


def _touch(path):
    """Marks entry ``path`` used now (the eviction's order)."""
    try:
        os.utime(path)
    except OSError:
        pass            # a read-only cache is still read


def _fsync_directory(path):
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
