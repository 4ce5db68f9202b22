"""A cache hit read while its objects are revalidated: no round trip before the first read.

Online, an open of a URL source whose every object has its entry in the
cache (found by the URL alone, as offline mode finds them: ``_cache.offline_source``,
a directory or an index by its record) opens the entries at once
(``open_hit``: each checked as any open checks it, its stamp or its
digest) and asks the server beside the load: a GET of each object's
header bytes (its ETag, version and size must name the entry:
``_cache.entry_base``; its bytes must be the entry's header, as the usual
open compares them: a server whose ETag survives a rewrite of the same
size is caught by the header), and, for a directory or an index, its
listing or its index again, all on the checkpoint's request loop
(``_remote._Requests``: a close ends them at once), where the objects'
clients are made too.  It is asked once a load's readers have every
address (``Shards.revalidating``, the end of a load's step 3), by
``safe_open`` at its open (its handle is asked later), and by anything
that waits for the answer first: making a client holds the GIL for
milliseconds (obstore reads the system's CA certificates), which at the
open would hold up the load's own steps until its readers can copy.

The answer gates every byte that would reach a caller
(``Shards.revalidated``): a load of one process waits for it before its
first tensor goes out (``_run._drive``), a load into given tensors before
the first address is given to the readers (``_run._start``: its slots are
read meanwhile), ``safe_open`` before a tensor is returned, and any other
use (``changed()``, ``verify=``, a group's identity check) waits first.

An object that changed (another ETag, version or size, gone, no ETag
any more) or a directory or an index that names other objects now: the
stale entries of the object, or the source's record, are removed, and the
load raises ``RemoteChangedError`` (``before_load`` set: nothing of it
reached a caller) as a load of a changed object does; ``load_file``,
``iter_load`` and ``load_into(source, ...)`` open the source again by the
usual way (``usual_way``: each object's header asked, its entry checked
against it, the changed ones fetched and filled) and load once more; a
``Checkpoint``'s ``reopen()`` does the same.  A failed answer (no
answer within ``RETRY_SECONDS``, access refused) is the error that the
open would have raised.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import posixpath
import threading
import traceback

from ._cache import (
    _ENTRY_FLAGS,
    ENTRY_SUFFIX,
    RECORD_SUFFIX,
    RECORD_VERSION,
    STAMP_SUFFIX,
    CachedShards,
    _damage,
    _finisher,
    _listing,
    _newest,
    _object_size,
    _read,
    _stamp,
    _stamped,
    _unlink,
    _url_key,
    entry_base,
    offline_source,
)
from ._errors import LoadError
from ._fds import close_recorded, open_recorded
from ._header import SafetensorsError, header_length
from ._remote import (
    _POLL,
    RETRY_SECONDS,
    RemoteChangedError,
    RemoteShards,
    _classify,
    _Object,
    named_by,
)
from ._schemes import ClientPanic, redact_url
from ._source import INDEX_NAME, INDEX_SUFFIX, SHARD_SUFFIX, parse_index

log = logging.getLogger("instant_staging")

# Off for an open that follows a hit found changed: the usual way, once.
_ALLOWED = contextvars.ContextVar("instant_staging_revalidate", default=True)


@contextlib.contextmanager
def usual_way():
    """Opens inside take the usual way (each object's header asked first),
    never a hit read before its answer: the open again after a hit was
    found changed."""
    token = _ALLOWED.set(False)
    try:
        yield
    finally:
        _ALLOWED.reset(token)


def open_hit(source, directory, stores):
    """``(HitShards, Source)``, not opened yet, of URL ``source`` where the
    cache in ``directory`` holds an entry of every object it names (each
    checked: ``_cache._trusted``) and the server's answer has been asked
    for; None where it does not (the usual open then)."""
    if directory is None or not _ALLOWED.get():
        return None
    try:
        src, urls = offline_source(source, directory, None)
    except FileNotFoundError:       # (a directory or an index without its record)
        return None
    keys = {_url_key(u) for u in urls}
    with _finisher.cond:
        making = [os.path.basename(b).split(".")[0] for b in _finisher.pending]
    if keys.intersection(making):
        return None     # an entry of one still being made here: the usual open waits for it
    names = _listing(directory)
    files, bases, sizes, checked, heads, fds = [], [], [], [], [], []
    try:
        for url in urls:
            base = _newest(directory, url, names)
            got = None if base is None else _checked(base, fds)
            if got is None:
                return None     # (a damaged entry: the usual open words it and removes it)
            size, st, head = got
            files.append(base + ENTRY_SUFFIX)
            bases.append(base)
            sizes.append(size)
            checked.append((st.st_dev, st.st_ino))
            heads.append(head)
    finally:
        close_recorded(fds)
    kind, url = named_by(source) if isinstance(source, str) else ("object", None)
    asked = None if kind == "object" else (kind, url, src)
    # (each store made on the request loop: making a client takes longer than
    # a hit's open)
    remote = RemoteShards([_Object(u, None, None) for u in urls])
    shards = HitShards(files, [(redact_url(u), None, None) for u in urls], sizes, checked)
    shards.remote = remote
    shards.answer = Answer(remote, directory, bases, heads, asked, stores)
    return shards, src


def _checked(base, fds):
    """``(object size, fstat, its bytes up to its data)`` of entry ``base``
    where it is whole (``_cache._damage``: in full unless its stamp says
    nothing wrote it since, then stamped); None where it is gone or is not
    (left to the usual open, which says why and removes it)."""
    try:
        fd = open_recorded(fds, base + ENTRY_SUFFIX, _ENTRY_FLAGS)
        st = os.fstat(fd)
        size = _object_size(fd, st)
        if size is None or size < 8:
            return None
        stamped = _stamped(base, st)
        if _damage(fd, st, size, None, full=not stamped) is not None:
            return None
        if not stamped:
            _stamp(base, fd, st)
        length = 8 + header_length(_read(fd, 8, 0), size, base)
        return size, st, _read(fd, length, 0)
    except (OSError, SafetensorsError):
        return None


class HitShards(CachedShards):
    """A URL source's entries read while its objects are revalidated
    (``answer``); once the answer vouched for them, a ``CachedShards``."""

    answer = None

    def revalidating(self):
        self.answer.start()

    def revalidated(self):
        self.answer.wait()

    def changed(self, wait=True):
        if wait:
            self.answer.wait()
        else:
            self.answer.raise_if_known()
        return []

    def read_bytes(self, index, offset, length):
        self.answer.wait()      # (verify=: the server's bytes, pinned to its answer)
        return super().read_bytes(index, offset, length)

    def origin(self, index):
        self.answer.wait()
        return self.remote.origin(index)

    def close(self):
        try:
            super().close()
        finally:
            self.answer.close()


class Answer:
    """The server's answer for a hit (``open_hit``): asked by ``start``
    (``Shards.revalidating``), or by the first ``wait``, on the request
    loop of ``remote`` (a ``RemoteShards`` of the objects, not opened: its
    objects pinned to the answer, for ``verify=``'s reads); ``wait`` raises
    what it says, each time it is asked."""

    def __init__(self, remote, directory, bases, heads, asked, stores):
        self._remote, self._directory, self._bases, self._heads = remote, directory, bases, heads
        self._asked = asked     # (kind, url, Source) of a directory or an index; None: objects
        self._lock = threading.Lock()
        self._error = None      # a callable making the error to raise
        self._known = False
        objects, split, obstore = remote._objects, stores.split, remote._obstore
        lengths = [len(h) for h in heads]
        self._asking = threading.Lock()
        self._future = None     # the request, once asked (``start``)
        self._submit = lambda: remote._requests.submit(
            lambda: _ask(obstore, objects, lengths, None if asked is None else asked[:2], split),
            RETRY_SECONDS)

    def start(self):
        """Asks the server, once; the request's future (a cancelled one
        where the checkpoint closed before it was asked)."""
        with self._asking:
            if self._future is None:
                # (the request holds the clients from here on, not this:
                # a closed checkpoint keeps no socket)
                submit, self._submit = self._submit, None
                if submit is None:
                    from concurrent.futures import Future
                    self._future = Future()
                    self._future.cancel()
                else:
                    self._future = submit()
            return self._future

    def close(self):
        """Never asked now: the clients it would have asked with are let go."""
        with self._asking:
            self._submit = None

    def raise_if_known(self):
        """``wait`` where the answer came already; nothing otherwise."""
        if self._known or (self._future is not None and self._future.done()):
            self.wait()

    def wait(self):
        with self._lock:
            if not self._known:
                self._judge()
                self._known = True
        if self._error is not None:
            raise self._error()

    def _judge(self):
        """Takes the answer (waits for it: a load's wait, bounded by the
        request's RETRY_SECONDS) and keeps the error it makes, if any."""
        from concurrent.futures import CancelledError, wait
        future = self.start()
        while not future.done():
            wait([future], timeout=_POLL)
        try:
            answers = future.result()
        except CancelledError:
            self._error = lambda: LoadError("the checkpoint was closed while its cache entries "
                                            "were revalidated")
            return
        except TimeoutError:
            shown = redact_url(self._remote._objects[0].url)
            self._error = lambda: LoadError(f"{shown}: no answer within {RETRY_SECONDS:g} s "
                                            "while asking for its size", shown)
            return
        finally:
            self._remote.rest()     # (its request loop: until verify= asks again)
        named, heads = answers[0], answers[1:]
        changed = self._source_changed(named)
        if changed is not None:
            self._error = changed
            return
        for base, obj, head, entry_head in zip(self._bases, self._remote._objects, heads,
                                               self._heads):
            changed = self._object_changed(base, obj, head, entry_head)
            if changed is not None:
                self._error = changed
                return

    def _source_changed(self, named):
        """The error where the directory or index names other objects now
        (its record removed: the next open asks), None where not."""
        if self._asked is None:
            return None
        kind, url, src = self._asked
        shown = redact_url(url)
        obstore = self._remote._obstore
        if isinstance(named, (ValueError, ClientPanic)):
            return _again(named)
        if isinstance(named, BaseException):
            error = _classify(obstore, named, shown, "listing" if kind == "directory"
                              else "reading the index")
            traceback.clear_frames(named.__traceback__)
            if not isinstance(error, FileNotFoundError):
                return _again(error)
            now = None
        else:
            now = _named(named, shown)
        if now is not None and now == ([redact_url(u) for u in self._urls()], src.weight_map):
            return None
        _unlink(os.path.join(self._directory, f"{_url_key(url)}.{RECORD_VERSION}{RECORD_SUFFIX}"))
        return _changed(shown, "it names other objects now than when its objects were cached")

    def _urls(self):
        return [o.url for o in self._remote._objects]

    def _object_changed(self, base, obj, head, entry_head):
        """The error where object ``obj``'s answer (``head``: the meta and
        bytes of its header's GET, or an exception) does not name entry
        ``base`` (its entries of other versions removed) or its header is
        not ``entry_head`` (the entry's: removed as damaged, as the usual
        open does), None where both are the entry's (``obj`` pinned to it)."""
        shown = redact_url(obj.url)
        obstore = self._remote._obstore
        if isinstance(head, (ValueError, ClientPanic)):
            return _again(head)     # (its client could not be made: storage_options)
        if isinstance(head, BaseException):
            error = _classify(obstore, head, shown, "asking for its size")
            traceback.clear_frames(head.__traceback__)
            if not isinstance(error, FileNotFoundError):
                return _again(error)
            why, now = "it is gone", None
        else:
            meta, data = head
            obj.pin(meta)
            if not obj.etag:
                why, now = "its server gives no ETag now", None
            else:
                now = entry_base(obj.url, obj.etag, obj.version, obj.size)
                if now == os.path.basename(base) and bytes(data) == entry_head:
                    return None
                if now == os.path.basename(base):
                    # (an ETag kept across a rewrite, or an entry damaged as a whole:
                    # its header tells, as the usual open's compare)
                    _unlink(base + ENTRY_SUFFIX)
                    _unlink(base + STAMP_SUFFIX)
                    log.warning("the cache in %s: entry %s is damaged (its header is not the "
                                "object's): removed, and its object fetched again",
                                self._directory, os.path.basename(base + ENTRY_SUFFIX))
                    return _changed(shown, "its header is not its cache entry's")
                why = "its ETag, version or size is not its cache entry's"
        key = os.path.basename(base).split(".")[0]
        for name in _listing(self._directory):
            if (name.startswith(key + ".") and name.endswith((ENTRY_SUFFIX, STAMP_SUFFIX))
                    and (now is None or not name.startswith(now + "."))):
                _unlink(os.path.join(self._directory, name))    # (a stale version, its stamp)
        return _changed(shown, why)


def _again(error):
    """A maker of ``error`` raised again (a fresh copy each time: no traceback grows)."""
    kind, args = type(error), error.args
    return lambda: kind(*args)


def _changed(shown, why):
    def make():
        error = RemoteChangedError(f"{shown}: the object changed since it was cached ({why}); "
                                   "nothing was loaded from its cache entry: reopen the "
                                   "checkpoint (Checkpoint.reopen()) and load again", shown)
        error.before_load = True
        return error
    return make


def _named(named, shown):
    """``(object URLs as shown, weight map as shown)`` that the listing or
    index ``named`` (``_ask``'s) gives, as ``_remote.resolve`` makes them;
    None where it gives none (the usual open words why)."""
    kind, url, raw = named
    if kind == "directory":
        shards = [n for n in raw if n.endswith(SHARD_SUFFIX)]
        return ([redact_url(url + s) for s in shards], None) if shards else None
    if not url.endswith(INDEX_SUFFIX):
        return None
    try:
        weight_map = parse_index(raw, redact_url(url))
    except Exception:
        return None
    base = url.rsplit("/", 1)[0] + "/"
    return ([redact_url(base + s) for s in sorted(set(weight_map.values()))],
            {name: redact_url(base + s) for name, s in weight_map.items()})


async def _ask(obstore, objects, lengths, source, split):
    """The answers: ``[what source names, (meta, bytes) of each object's
    first ``lengths`` bytes]``, an exception in place of each that failed.
    ``source``: ``(kind, url)`` of a directory or an index, None for objects."""
    import asyncio
    return await asyncio.gather(_source_now(obstore, source, split),
                                *(_header(obstore, o, n, split) for o, n in zip(objects, lengths)),
                                return_exceptions=True)


async def _header(obstore, obj, length, split):
    """``(meta, bytes)`` of the first ``length`` bytes of ``obj`` (its
    header: what its entry's are compared with), its store made here."""
    from ._remote import _get_async
    obj.store, obj.key = split(obj.url)
    return await _get_async(obstore, obj, {"range": (0, length)})


async def _source_now(obstore, source, split):
    """``(kind, url, names or raw index)`` of ``source`` now, None for objects."""
    if source is None:
        return None
    kind, url = source
    if kind == "directory":
        store, prefix = split(url)
        listing = await obstore.list_with_delimiter_async(store, prefix or None)
        names = sorted(posixpath.basename(o["path"]) for o in listing["objects"])
        if INDEX_NAME not in names:
            return "directory", url, names
        url = url + INDEX_NAME
    store, key = split(url)
    got = await obstore.get_async(store, key)
    return "index", url, bytes(await got.bytes_async())
