"""Object-storage sources: a bucket is a source like a directory.

``source`` may be a URL (docs/design.md, "Object storage"):

- ``s3://bucket/prefix/`` (or any URL not naming a ``.safetensors`` or
  ``.json`` object): a "directory": its ``model.safetensors.index.json``,
  else its ``*.safetensors`` objects at that level, sorted;
- ``s3://bucket/key.safetensors``, ``s3://bucket/x.safetensors.index.json``;
- a list of object URLs (read in the order given);
- the same with ``gs://`` (GCS), ``az://``/``abfs://`` (Azure Blob) and
  ``http://``/``https://`` (plain ranged GETs).

The client is ``obstore`` (Rust's ``object_store``: one API for S3, GCS,
Azure and HTTP; requests run without the GIL), installed by the
``remote`` extra.  Credentials and endpoints come from the client's
standard chain (``AWS_*`` variables and profiles, ``AWS_ENDPOINT_URL`` for
S3-compatible servers, instance metadata; ``GOOGLE_APPLICATION_CREDENTIALS``;
``AZURE_*``); ``storage_options=`` is passed through to the store's
``config`` (its keys ``client_options`` and ``retry_config``, where given,
to those arguments).  No value of it is ever logged or put in a message.

Each object is asked for its first ``HEADER_PREFETCH`` bytes (one ranged
GET, every object of the checkpoint at once: a checkpoint's start is round
trips, not bytes), whose answer also carries the object's size, ETag and
version; a second GET only for a longer header (or a HEAD, where that GET
failed for a reason the HEAD names again, such as an empty object's 416).
The header is validated exactly as a local file's; under a bandwidth cap
the rest of that GET's bytes (the first tensors') are kept for the
checkpoint's first load, which fetches only what follows them.  The data ranges are
then fetched for the loader's reader threads (``Pipeline(fetch=)``): one
ranged GET per chunk, copied into a staging slot, as many in flight as
there are readers, started ahead of them (``RemoteShards.prefetch``).
Every GET carries
``If-Match`` with the ETag the first GET saw (and the version, where the store
versions objects), and each answer's ETag (its Last-Modified where the
server gives no ETag; its size always) is compared with the pinned one (a
server may ignore ``If-Match``), so an object replaced during a load is an
error naming it, never a model built from two versions.

Failures: the client retries 5xx answers, throttling and connection errors
with backoff (``retry_config``), and resumes a body cut short from where it
stopped (checking the ETag); a range that still fails is fetched again
here, that range only, with backoff, within ``RETRY_SECONDS`` in all; each
try ends by then however the server answers (a body that stalls too).
Requests run on an asyncio loop of the checkpoint's (``_Requests``), so a
cancel (``close()``, Ctrl-C) ends every wait at once and drops the
requests in flight.  A missing object, a refused request and
missing credentials are errors naming the URL, raised when the checkpoint
is opened: before anything is allocated.
"""

from __future__ import annotations

import logging
import os
import posixpath
import random
import threading
import time
import traceback

from ..defaults import REMOTE_REQUEST_LOOPS
from ._errors import CheckpointChangedError, LoadError
from ._header import SafetensorsError, header_length, parse_header
from ._schemes import (
    ClientPanic,
    Stores,
    describe,
    is_url,
    load_obstore,
    no_credentials,
    no_panic,
    redact_text,
    redact_url,
    schemes_text,
)
from ._shards import Shards
from ._source import INDEX_NAME, INDEX_SUFFIX, SHARD_SUFFIX, Source, parse_index

log = logging.getLogger("instant_staging")

# One GET covers the 8-byte length and the header of nearly every file
# (a header is a few hundred KiB for 90,000 tensors); a longer one costs a
# second GET.
HEADER_PREFETCH = 1 << 20
# A range whose body failed part-way is fetched again at most this many
# times, within RETRY_SECONDS from its first try.
RETRIES = 5
RETRY_SECONDS = 60.0
_BACKOFF = 0.1


# A URL as it may be shown (its secrets ``***``): every message here says it so.
_safe = redact_url


class RemoteChangedError(CheckpointChangedError):
    """An object changed (another ETag or version) since it was opened: its
    checkpoint reads it no more (every answer is compared with the version
    pinned at the open); ``Checkpoint.reopen()`` pins the new one."""


class _Object:
    """One object of a remote checkpoint: where it is and which version."""

    __slots__ = ("etag", "key", "modified", "size", "store", "url", "version")

    def __init__(self, url, store, key):
        self.url, self.store, self.key = url, store, key
        self.size = self.etag = self.version = self.modified = None

    def pin(self, meta):
        """Takes the version the first answer names: size, ETag, version,
        Last-Modified."""
        self.size, self.etag, self.version = meta["size"], meta.get("e_tag"), meta.get("version")
        self.modified = meta.get("last_modified")

    def changed(self, meta):
        """What of ``meta`` (a range answer's) differs from the pinned
        version, or None: a server that ignores ``If-Match`` still names the
        version it answered with.  The ETag where the first answer had one;
        else Last-Modified; the size always."""
        if meta.get("size") != self.size:
            return f"its size is {meta.get('size')}, not {self.size}"
        if self.etag is not None:
            if meta.get("e_tag") != self.etag:
                return f"its ETag is {meta.get('e_tag')}, not {self.etag}"
        elif self.modified is not None and meta.get("last_modified") != self.modified:
            return f"it was modified at {meta.get('last_modified')}, not {self.modified}"
        if self.version is not None and meta.get("version") not in (None, self.version):
            return f"its version is {meta.get('version')}, not {self.version}"
        return None


def _classify(obstore, exc, url, what):
    """The error a user sees for ``exc`` raised while ``what`` of ``url``."""
    errors = obstore.exceptions
    if isinstance(exc, (FileNotFoundError, errors.NotFoundError)):    # obstore raises the former
        return FileNotFoundError(f"{url}: no such object ({what})")
    missing = no_credentials(exc, url, what)
    if missing is not None:
        return missing
    if isinstance(exc, (errors.PermissionDeniedError, errors.UnauthenticatedError)):
        return PermissionError(f"{url}: access denied while {what}: check the credentials "
                               f"({describe(exc)})")
    if isinstance(exc, errors.PreconditionError) or (
            isinstance(exc, errors.GenericError) and "precondition" in str(exc).lower()):
        # (a 412 met by the client's own resume of a cut body is a GenericError)
        return RemoteChangedError(f"{url}: the object changed while it was loaded (its ETag or "
                                  "version is not the one its header was read from): reopen the "
                                  "checkpoint (Checkpoint.reopen()) and load again",
                                  url)
    return OSError(f"{url}: {what} failed: {describe(exc)}")


def _permanent(obstore, exc):
    errors = obstore.exceptions
    return isinstance(exc, (FileNotFoundError, errors.NotFoundError, errors.PermissionDeniedError,
                            errors.UnauthenticatedError, errors.PreconditionError,
                            errors.NotSupportedError, errors.InvalidPathError))


# -- what a URL source names ---------------------------------------------------

def resolve(source, stores: Stores) -> tuple[Source, list[_Object]]:
    """The objects ``source`` names, as ``_source.resolve`` for paths."""
    obstore = load_obstore()
    if isinstance(source, str):
        kind, url = named_by(source)
        if kind == "directory":
            return _directory(obstore, url, stores)
        if kind == "index":
            return _index(obstore, url, stores)
        return _objects([url], stores)
    return _objects(object_urls(source), stores)


def object_urls(source):
    """The object URLs of ``source``, a list of them (checked: each an
    object's URL, not a directory's or an index's)."""
    items = list(source)
    for u in items:
        if not is_url(u):
            raise TypeError(f"a list of URLs must hold only URLs of {schemes_text()}, "
                            f"got {redact_text(repr(u))}")
        if u.endswith("/") or u.endswith(".json"):
            raise ValueError(f"{_safe(u)} is a directory or an index: pass it alone, not in a "
                             "list of shards")
    return items


def named_by(url):
    """What the source ``url`` (a str) names: ``("directory", prefix)``,
    ``("index", url)`` or ``("object", url)``."""
    name = url.rstrip("/").rsplit("/", 1)[-1]
    if url.endswith("/") or not (name.endswith(SHARD_SUFFIX) or name.endswith(".json")):
        return "directory", url.rstrip("/") + "/"
    return ("index" if name.endswith(".json") else "object"), url


def _objects(urls, stores, index=None, weight_map=None):
    # The Source (the checkpoint's paths, its files and messages) names
    # each object as it may be shown: redact_url.
    objects = [_Object(u, *stores.split(u)) for u in urls]
    if weight_map is not None:
        weight_map = {name: _safe(u) for name, u in weight_map.items()}
    return Source([_safe(o.url) for o in objects], index and _safe(index), weight_map), objects


def _listing(obstore, url, stores):
    """``(store, objects)``: the objects directly under the prefix ``url``
    (obstore's metadata: path, size, ...), one level deep."""
    store, prefix = stores.split(url)
    try:
        with no_panic(url):
            listing = _once(lambda: _list_async(obstore, store, prefix or None), url, "listing")
            return store, listing["objects"]
    except (ClientPanic, _NoAnswer):
        raise
    except Exception as e:
        raise _classify(obstore, e, _safe(url), "listing") from None


def _directory(obstore, url, stores):
    _, objects = _listing(obstore, url, stores)
    names = sorted(posixpath.basename(o["path"]) for o in objects)
    if INDEX_NAME in names:
        return _index(obstore, url + INDEX_NAME, stores)
    shards = [n for n in names if n.endswith(SHARD_SUFFIX)]
    if not shards:
        raise FileNotFoundError(f"no {INDEX_NAME} and no *{SHARD_SUFFIX} object under {_safe(url)}")
    src, objects = _objects([url + n for n in shards], stores)
    src.named = {"shards": shards}
    return src, objects


def _index(obstore, url, stores):
    store, key = stores.split(url)
    try:
        with no_panic(url):
            raw = bytes(_once(lambda: _read_async(obstore, store, key), url, "reading the index"))
    except (ClientPanic, _NoAnswer):
        raise
    except Exception as e:
        raise _classify(obstore, e, _safe(url), "reading the index") from None
    if not url.endswith(INDEX_SUFFIX):
        raise SafetensorsError(f"an index must be named *{INDEX_SUFFIX}", _safe(url))
    weight_map = parse_index(raw, _safe(url))
    base = url.rsplit("/", 1)[0] + "/"
    shards = sorted(set(weight_map.values()))
    src, objects = _objects([base + s for s in shards], stores, url,
                            {name: base + s for name, s in weight_map.items()})
    src.named = {"index": url[len(base):], "weight_map": weight_map}
    return src, objects


# -- requests that a cancel or a stall can end ----------------------------------------

# How often a thread waiting for a request looks at its load's stop flag.
_POLL = 0.05


class _Requests:
    """The client's requests of one checkpoint, run on asyncio loops of
    their own (at most ``loops``, each a thread, started as requests come,
    the requests dealt to them in turn; joined by ``close()``), so that a
    thread waiting for one can stop waiting: a load's cancel (``close()``,
    Ctrl-C) and a stalled body end the wait at once, and cancelling the
    request drops it in the client (its connection closed), so nothing of
    it outlives the load.  The client's blocking calls could not be left: a
    reader thread in one waited for the server, however long it stalled."""

    def __init__(self, loops=1):
        self._lock = threading.Lock()
        self._most = loops
        # [(loop, thread, pid)], in the order started; pid: the process
        # whose thread runs the loop
        self._loops = []
        self._turn = 0
        # asyncio, kept from the start for close(): a close at interpreter
        # exit (a finalizer) can no longer import it.
        self._asyncio = None

    def run(self, make, stop, timeout):
        """``await make()`` on the loop: its result, or its exception;
        ``TimeoutError`` after ``timeout`` s; ``_Cancelled`` once ``stop``
        is set.  The request is cancelled whenever this returns early
        (a KeyboardInterrupt here too)."""
        return self.wait(self.submit(make, timeout), stop)

    def submit(self, make, timeout):
        """Starts ``await make()`` on the loop, ending by ``timeout`` s; its
        future (``wait`` for it, or cancel it)."""
        import asyncio
        loop = self._start()
        return asyncio.run_coroutine_threadsafe(asyncio.wait_for(make(), timeout), loop)

    @staticmethod
    def wait(future, stop):
        """``future``'s result (``submit``'s), as ``run``: ``_Cancelled``
        once ``stop`` is set; the request cancelled whenever this returns
        early."""
        from concurrent.futures import wait
        try:
            while not future.done():
                if stop.is_set():
                    raise _Cancelled()
                wait([future], timeout=_POLL)
            try:
                return future.result()
            except BaseException as e:
                # The request's frames (its store: the client's connections)
                # would live as long as the caller keeps the error.
                traceback.clear_frames(e.__traceback__)
                raise
        finally:
            future.cancel()         # (done: nothing; else the request is dropped)

    def _start(self):
        """The loop whose turn it is: a new one while fewer than the most run.
        A loop is recorded before its thread starts, so that a Ctrl-C
        landing in between leaves it to ``close()``, never running
        unrecorded."""
        with self._lock:
            if len(self._loops) < self._most:
                import asyncio
                self._asyncio = asyncio
                loop = asyncio.new_event_loop()
                try:
                    thread = threading.Thread(target=_run_loop, args=(loop,), daemon=True,
                                              name="instant_staging-requests")
                    self._loops.append((loop, thread, os.getpid()))
                except BaseException:
                    loop.close()
                    raise
                try:
                    thread.start()
                except RuntimeError:        # (no thread left to this process: none to hand requests to)
                    self._loops.remove((loop, thread, os.getpid()))
                    loop.close()
                    raise
                # (a Ctrl-C in start()'s wait for the thread leaves it recorded: close()'s)
                return loop
            self._turn = (self._turn + 1) % len(self._loops)
            return self._loops[self._turn][0]

    def close(self):
        """Cancels what is left and joins the loops' threads (idempotent; the
        next request starts another)."""
        with self._lock:
            loops, self._loops = self._loops, []
        for loop, thread, pid in loops:
            self._close(loop, thread, pid)

    def _close(self, loop, thread, pid):
        if pid != os.getpid():
            # A fork child's copy: the loop's thread is the parent's, not
            # here, so nothing runs it to stop.  Nor is it closed: its epoll
            # instance is the parent's too (a forked descriptor of it), and
            # closing the loop would unregister the self-pipe from it, which
            # the parent's loop then never wakes on.  The child's copies of
            # its descriptors (self-pipe, epoll) are closed as files, which
            # unregisters nothing the parent has (the selector loop's
            # attributes: where they are absent, they stay to its exit).
            for part in (getattr(loop, "_ssock", None), getattr(loop, "_csock", None),
                         getattr(loop, "_selector", None)):
                if part is not None:
                    part.close()
            return
        asyncio = self._asyncio

        async def stop():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            loop.stop()
        if thread.ident is None:
            # Recorded, and its start interrupted by a Ctrl-C: before the
            # thread was made (it never runs) or in start()'s wait for it.
            deadline = time.monotonic() + _POLL
            while thread.ident is None and time.monotonic() < deadline:
                time.sleep(0.001)
            if thread.ident is None:
                loop.close()        # (a thread begun after this finds it closed: _run_loop)
                return
        asyncio.run_coroutine_threadsafe(stop(), loop)
        if thread is not threading.current_thread():
            thread.join()
            loop.close()


def _run_loop(loop):
    """A request loop's thread."""
    try:
        loop.run_forever()
    except RuntimeError:
        if not loop.is_closed():
            raise           # (closed before it ran: its start was interrupted, _Requests._close)


class _NoAnswer(OSError):
    """No answer within ``RETRY_SECONDS`` (an OSError as any failed request)."""


def _once(make, url, what):
    """``await make()`` on a loop of its own (``_Requests``): resolving a
    source, before the checkpoint exists.  A Ctrl-C ends it at once; no
    answer within ``RETRY_SECONDS`` is an OSError."""
    requests = _Requests()
    try:
        return requests.run(make, threading.Event(), RETRY_SECONDS)
    except TimeoutError:
        raise _NoAnswer(f"{_safe(url)}: no answer within {RETRY_SECONDS:g} s while {what}") from None
    finally:
        requests.close()


async def _list_async(obstore, store, prefix):
    return await obstore.list_with_delimiter_async(store, prefix)


async def _read_async(obstore, store, key):
    got = await obstore.get_async(store, key)
    return await got.bytes_async()


class _Cancelled(Exception):
    """The load's stop flag was set while a request was waited for."""


# (They take the _Object, never its store: an error's frames, kept by the
# caller's exception, would keep the store's connections alive; the
# object's store is dropped when the checkpoint closes.)

async def _get_async(obstore, obj, options):
    """``(meta, bytes)`` of one GET of ``obj``."""
    got = await obstore.get_async(obj.store, obj.key, options=options)
    return got.meta, await got.bytes_async()


async def _head_async(obstore, obj):
    return await obstore.head_async(obj.store, obj.key)


def _range_options(obj, offset, length):
    """A ranged GET's options: the range, pinned to the version opened."""
    options = {"range": (offset, offset + length)}
    if obj.etag:
        options["if_match"] = obj.etag
    if obj.version:
        options["version"] = obj.version
    return options


def _check_unchanged(obj, meta, url):
    """Raises ``RemoteChangedError`` where a range's answer (``meta``) is not
    of the version the object was opened at (a server that ignored
    ``If-Match``)."""
    changed = obj.changed(meta)
    if changed is not None:
        raise RemoteChangedError(f"{url}: the object changed while it was loaded ({changed}; "
                                 "the server did not refuse the request): reopen the checkpoint "
                                 "(Checkpoint.reopen()) and load again", url)


# -- the checkpoint ---------------------------------------------------------------

class RemoteShards(Shards):
    """The objects of a URL source, with validated headers: what
    ``Shards`` is for files.  Its "descriptors" are the objects'
    indexes, which ``fetch`` (the reader threads' read, ``Pipeline(fetch=)``)
    takes.  It owns no descriptor and no socket (the client's connection
    pool is the store's, dropped with it)."""

    from_url = True
    # A bandwidth cap (``_throttle.Throttle``): the open's, then each load's
    # own, set on its share (``_prepare.throttled``).
    throttle = None

    def changed(self, wait=True):
        # (each range answer's ETag or Last-Modified is compared as it comes:
        # RemoteChangedError)
        return []

    def __init__(self, objects, cache=None, throttle=None):
        """``objects``: the source's (``resolve``); ``cache``: their local
        cache (``_cache.Cache``), None without one; ``throttle``: the open's
        bandwidth cap (``_throttle.Throttle``), None without one."""
        self._objects = list(objects)
        self.cache = cache
        self.throttle = throttle
        # {index: (offset, bytes)}: what a capped open's first GET of each
        # object brought past its header, the first tensors' bytes: the
        # first load reads them from here instead of fetching them again
        # (``_kept_part``).
        self._kept = {}
        # The load's read-ahead (``prefetch``), on its share.
        self._ahead = None
        self._error = None
        self._error_lock = threading.Lock()
        self._stop = threading.Event()
        self._requests = _Requests(REMOTE_REQUEST_LOOPS)
        self._obstore = load_obstore()
        self._unpinned = False      # an object without an ETag was said (once)
        super().__init__()          # open(): the objects' URLs, in order

    def share(self, release):
        # A load's own error and stop: one load's cancel stops only its fetches.
        kept = self._kept

        def release_and_forget():
            # (the kept bytes serve the first load: a later one fetches them,
            # and a server's checkpoint does not hold a MiB per object)
            kept.clear()
            release()
        view = super().share(release_and_forget)
        view._error, view._error_lock, view._stop = None, threading.Lock(), threading.Event()
        view._ahead, view.throttle = None, None
        return view

    def prefetch(self, plan, window):
        """Fetches the load's chunks ahead of its readers: ``window`` ranged
        GETs in flight from now on (``_ReadAhead``), in the order the readers
        claim ``plan``'s chunks.  The first are asked for while the load
        makes its staging buffer and device memory (tens of ms on a GPU host:
        more than a round trip), which the readers wait for; then each range
        a reader takes puts the next one in flight, so the requests in flight
        stay ``window`` while the readers copy what arrived into their slots
        (a reader's own GET, the next one after its copy, would leave a gap
        per chunk).  Not under a bandwidth cap (its pace is the readers')."""
        if self.throttle is None and window > 0:
            self._ahead = _ReadAhead(self, plan, window)

    def _kept_part(self, index, offset, length):
        """``(kept, offset, length)`` of a range of object ``index``: the part
        of its bytes that the open's first GET brought (a memoryview, or
        None: ``_kept``), and the range left to fetch (its length 0 where
        none is)."""
        got = self._kept.get(index)
        if got is None:
            return None, offset, length
        begin, data = got
        end = begin + len(data)
        if not begin <= offset < end:
            return None, offset, length
        stop = min(offset + length, end)
        return data[offset - begin:stop - begin], stop, offset + length - stop

    def _pay(self, length):
        """Waits until ``length`` more bytes fit the bandwidth cap, where
        there is one (a cancel ends the wait)."""
        if self.throttle is not None:
            self._stop.wait(self.throttle.take(length))

    @property
    def fills_cache(self):
        """Whether this load writes objects into its cache (``_cache.Cache.filling``)."""
        return self.cache is not None and self.cache.filling()

    def _wanted(self, index, length):
        """Whether a range of object ``index`` is fetched (not one read from
        the cache's entry, not an empty one)."""
        return length > 0 and (self.cache is None or not self.cache.holds(index))

    def _submit(self, index, offset, length):
        """Starts one ranged GET (``_Requests.submit``); its future."""
        obstore, obj = self._obstore, self._objects[index]
        options = _range_options(obj, offset, length)
        return self._requests.submit(lambda: _get_async(obstore, obj, options), RETRY_SECONDS)

    def _take_prefetched(self, got, index, offset, length, what):
        """The bytes of a range the read-ahead started (``got``: when, and its
        future), once they arrived; a failed GET counts as ``_get``'s first try."""
        started, future = got
        obj = self._objects[index]
        url = _safe(obj.url)
        try:
            with no_panic(url):
                try:
                    meta, data = self._requests.wait(future, self._stop)
                finally:
                    self._ahead.answered()
        except _Cancelled:
            raise LoadError(f"{url}: the load was cancelled", url) from None
        except ClientPanic:
            raise
        except Exception:       # (its failure is met again, and classified, by the tries below)
            return self._get(index, offset, length, what, started)
        _check_unchanged(obj, meta, url)
        if len(data) != length:
            return self._get(index, offset, length, what, started)
        return data

    def _drop_prefetched(self):
        """Cancels the read-ahead's requests no reader took (a cancel, a close)."""
        ahead = self._ahead
        if ahead is not None:
            ahead.drop()

    @property
    def fetch(self):
        """The reader threads' read (``Pipeline(fetch=)``): ``_Fetch``."""
        return _Fetch(self)

    def _open_all(self, urls):
        firsts = _each(self._first, range(len(urls)), self._stop)
        for url, first in zip(urls, firsts):
            self._open(url, first)

    def _first(self, index):
        """``(meta, bytes)`` of one ranged GET of object ``index``'s first
        ``HEADER_PREFETCH`` bytes (``meta``: the object's, its whole size
        among them); None where it failed for a reason ``_open``'s HEAD
        names again (a permanent one is raised here)."""
        obj, obstore = self._objects[index], self._obstore
        try:
            self._pay(HEADER_PREFETCH)
            with no_panic(obj.url):
                meta, data = self._request(
                    lambda: _get_async(obstore, obj, {"range": (0, HEADER_PREFETCH)}),
                    RETRY_SECONDS)
            if self.throttle is not None:
                self.throttle.give_back(HEADER_PREFETCH - len(data))
            return meta, bytes(data)
        except (ClientPanic, LoadError):
            raise
        except TimeoutError:
            raise LoadError(f"{_safe(obj.url)}: no answer within {RETRY_SECONDS:g} s while "
                            "reading its header", _safe(obj.url)) from None
        except Exception as e:
            if _permanent(obstore, e):
                raise _classify(obstore, e, _safe(obj.url), "reading its header") from None
            return None

    def _open(self, url, got=None):
        """Opens object ``url`` with ``got``, ``_first``'s answer for it."""
        url = _safe(url)        # as it is shown (the object is ``_objects[index]``)
        index = len(self.paths)
        obj = self._objects[index]
        obstore = self._obstore
        if got is None:
            try:
                with no_panic(url):
                    meta = self._request(lambda: _head_async(obstore, obj),
                                         RETRY_SECONDS)
                    first = None
            except (ClientPanic, LoadError):
                raise
            except TimeoutError:
                raise LoadError(f"{url}: no answer within {RETRY_SECONDS:g} s while asking for "
                                "its size", url) from None
            except Exception as e:
                raise _classify(obstore, e, _safe(url), "asking for its size") from None
        else:
            meta, first = got
        obj.pin(meta)
        if obj.etag is None and not self._unpinned:
            self._unpinned = True
            if self.cache is not None:
                # (not cached by Last-Modified and size: a second's mark
                # cannot tell two versions of one size written in the same
                # second apart, and an entry is served without asking)
                log.warning("%s: the server gives no ETag: the cache in %s is not used for it "
                            "(an entry is kept only under the ETag its server vouches for), "
                            "and a change during the load is seen only by the object's size "
                            "and Last-Modified (one a second)", url, self.cache.directory)
            else:
                log.warning("%s: the server gives no ETag: a change during the load is seen only "
                            "by the object's size and Last-Modified (one a second)", url)
        self.fds.append(index)
        self.paths.append(url)
        want = min(obj.size, HEADER_PREFETCH)
        if first is None or len(first) != want:    # (a body cut short: fetched again, If-Match)
            first = self.read_bytes(index, 0, want, what="reading its header")
        length = header_length(first[:8], obj.size, url)
        if 8 + length <= len(first):
            raw = first[8:8 + length]
        else:
            raw = first[8:] + self.read_bytes(index, len(first), 8 + length - len(first),
                                              what="reading its header")
        self.headers.append(parse_header(raw, url, obj.size))
        if self.throttle is not None and len(first) > 8 + length:
            # (under a cap, where each byte fetched costs time; without one
            # the loads fetch them again, as every range they read)
            self._kept[index] = (8 + length, memoryview(first)[8 + length:])
        if self.cache is not None:
            self.cache.opened(index, obj, first[:8] + raw)

    def origin(self, index):
        """``(url, ETag, version)`` of object ``index`` as it was opened
        (the URL without credentials; ETag and version None where the
        server gives none): its identity for a group's check."""
        obj = self._objects[index]
        return _safe(obj.url), obj.etag, obj.version

    def resident(self, samples=None):
        return None         # no page cache to ask

    def default_knobs(self):
        from ..defaults import REMOTE_CHUNK_SIZE, REMOTE_THREADS, default_threads
        return {"chunk_size": REMOTE_CHUNK_SIZE, "io_depth": None,
                "threads": default_threads(REMOTE_THREADS)}

    def _fetch(self, index, offset, length):
        try:
            cache = self.cache
            data = None if cache is None else cache.read(index, offset, length)
            if data is not None:
                return data
            kept, at, rest = self._kept_part(index, offset, length)
            if rest:
                ahead = self._ahead
                got = None if ahead is None else ahead.take(index, at, rest)
                if got is not None:
                    data = self._take_prefetched(got, index, at, rest, "loading")
                else:
                    data = self._get(index, at, rest, "loading")
                if kept is not None:
                    data = b"".join((kept, data))
            else:
                data = kept
            if cache is not None:
                cache.write(index, offset, data)
            return data
        except BaseException as e:
            with self._error_lock:
                if self._error is None:
                    self._error = e
            raise

    def fetch_error(self):
        return self._error

    def read_bytes(self, index, offset, length, what="verifying"):
        if length == 0:
            return bytearray()
        return bytearray(self._get(index, offset, length, what))

    def current_size(self, index):
        return self._objects[index].size

    def byte_sources(self):
        if self.cache is None:
            return 0, self.total_bytes
        return self.cache.sources(self.entries)

    def _get(self, index, offset, length, what, started=None):
        """The bytes, with retries within RETRY_SECONDS of ``started`` (now,
        or when a prefetch of the range, which failed, began: its first try)."""
        obstore = self._obstore
        obj = self._objects[index]
        options = _range_options(obj, offset, length)
        url = _safe(obj.url)
        deadline = (time.monotonic() if started is None else started) + RETRY_SECONDS
        for attempt in range(0 if started is None else 1, RETRIES + 1):
            self._pay(length)       # (each try fetches the bytes again)
            if self._stop.is_set():
                raise LoadError(f"{url}: the load was cancelled", url)
            # Each try ends by the deadline, however the server answers
            # (a body that stalls included).
            left = deadline - time.monotonic()
            try:
                with no_panic(url):
                    meta, data = self._request(
                        lambda: _get_async(obstore, obj, options), max(left, 0.001))
                    _check_unchanged(obj, meta, url)
                if len(data) == length:
                    return data
                problem = OSError(f"{url}: {what}: got {len(data)} of the {length} bytes at "
                                  f"byte {offset}")
            except (RemoteChangedError, ClientPanic, LoadError):
                raise
            except TimeoutError:
                problem = OSError(f"{url}: {what}: no answer within {RETRY_SECONDS:g} s for "
                                  f"bytes [{offset}, {offset + length})")
            except Exception as e:
                problem = _classify(obstore, e, url, what)
                if _permanent(obstore, e) or isinstance(problem, RemoteChangedError):
                    raise problem from None
            delay = min(_BACKOFF * (2 ** attempt), 5.0) * (0.5 + random.random() / 2)
            if attempt == RETRIES or time.monotonic() + delay > deadline:
                raise LoadError(f"{problem} (gave up after {attempt + 1} tries of bytes "
                                f"[{offset}, {offset + length}))", url)
            self._stop.wait(delay)          # a cancel ends the wait
        raise AssertionError("unreachable")

    def _request(self, make, timeout):
        """``_Requests.run`` for this load: a cancel of it is a LoadError."""
        try:
            return self._requests.run(make, self._stop, timeout)
        except _Cancelled:
            raise LoadError("the load was cancelled") from None

    def rest(self):
        """Ends the request loop's thread while no request is in flight (a
        ``safe_open`` whose handle closed, its slices alive): the next
        request starts it again."""
        self._requests.close()

    def close(self):
        # The stores (their connection pools) go with the last reference:
        # a closed checkpoint keeps no socket.
        self._kept.clear()
        self._drop_prefetched()
        self._requests.close()
        self.fds = []
        for obj in self._objects:
            obj.store = None
        if self.cache is not None:
            self.cache.close()      # (its partial files, after the readers were joined)


# Objects asked for their first bytes at once when a checkpoint opens.
OPEN_CONCURRENCY = 16


def _each(call, items, stop):
    """``[call(item) for item in items]``, the calls run at once (at most
    OPEN_CONCURRENCY threads; one item runs here); the first item's error
    in order is raised, after every call ended: the threads live only
    inside this function.  An error or a Ctrl-C sets ``stop``, which ends
    the other calls' retries, and cancels the calls not yet begun."""
    items = list(items)
    if len(items) <= 1:
        return [call(item) for item in items]
    from concurrent.futures import ThreadPoolExecutor
    pool = ThreadPoolExecutor(min(len(items), OPEN_CONCURRENCY), thread_name_prefix="instant_staging-open")
    try:
        futures = [pool.submit(call, item) for item in items]
        return [f.result() for f in futures]
    except BaseException:
        stop.set()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# A range the read-ahead chose and is starting the request of (``_ReadAhead``).
_STARTING = object()


class _ReadAhead:
    """A load's ranged GETs started ahead of its readers (``RemoteShards.prefetch``):
    ``window`` of ``plan``'s chunks, in the order the readers claim them,
    are in flight until the last is.  ``take`` hands a reader its range's
    request; once it is answered, the next starts (``answered``), while
    the reader copies.  A range a reader asks for before its turn came (the
    readers race a little) is left to that reader.  Host memory: the
    client's buffers of ``window`` requests and of the chunks the readers
    copy (at most one each).

    A request is started outside the lock (handing it to the request loop
    wakes the loop's thread, a system call, after which the GIL is waited
    for): the range is marked ``_STARTING`` under it first, and a reader
    that takes such a range waits for its request.  Held across the
    start, the lock made every reader that took or answered a range wait
    for each other's start: against a server that answers fast, most of
    the readers' time (docs/develop/remote-timeline.md)."""

    def __init__(self, shards, plan, window):
        self._shards, self._plan = shards, plan
        self._next = 0              # the plan's next chunk to request
        # (file, offset, length) -> (when started, future), or _STARTING
        self._pending = {}
        self._skipped = set()       # ranges a reader asked for first: never requested here
        self._dropped = False
        self._lock = threading.Condition(threading.Lock())
        for _ in range(window):
            self._start_next()

    def _choose(self):
        """The next chunk to fetch, marked ``_STARTING`` (under the lock); None
        where none is left."""
        while self._next < self._plan.n_chunks:
            index, offset, length = self._plan.chunk(self._next)
            self._next += 1
            _, offset, length = self._shards._kept_part(index, offset, length)   # (the rest of it)
            key = (index, offset, length)
            if key not in self._skipped and self._shards._wanted(index, length):
                self._pending[key] = _STARTING
                return key
        return None

    def _start_next(self):
        """Requests the next chunk to fetch (the caller holds no lock)."""
        with self._lock:
            key = None if self._dropped else self._choose()
        if key is None:
            return
        got = None
        try:
            got = (time.monotonic(), self._shards._submit(*key))
        finally:
            # (a start that failed leaves the range to its reader, as one skipped)
            with self._lock:
                if self._dropped and got is not None:
                    got[1].cancel()
                if self._pending.get(key) is _STARTING:
                    if got is None or self._dropped:
                        del self._pending[key]
                    else:
                        self._pending[key] = got
                self._lock.notify_all()

    def take(self, index, offset, length):
        """``(when started, future)`` of the range; None where it was not
        requested (nor will it be).  Its taker calls ``answered`` once the
        future is done."""
        key = (index, offset, length)
        with self._lock:
            while self._pending.get(key) is _STARTING:
                self._lock.wait()
            got = self._pending.pop(key, None)
            if got is None:
                self._skipped.add(key)
        return got

    def answered(self):
        """A taken request was answered: the next one in its place, while
        its taker copies what arrived."""
        self._start_next()

    def drop(self):
        """Requests no more; cancels those no reader took (one being started
        is cancelled by its starter)."""
        with self._lock:
            self._dropped = True
            self._next = self._plan.n_chunks
            pending = {k: v for k, v in self._pending.items() if v is not _STARTING}
            for k in pending:
                del self._pending[k]
        for _, future in pending.values():
            future.cancel()


class _Fetch:
    """``fetch(file, offset, length)``: ``length`` bytes at ``offset`` of
    object ``file``, as the client's buffer (the reader threads copy it into
    their slot).  The first error is kept for ``fetch_error`` (the pipeline
    only sees that this raised).  ``cancel()`` (the pipeline's cancel and
    close, any thread) ends the range retries, backoffs and requests in
    flight of this load within ``_POLL`` s (``_Requests``)."""

    __slots__ = ("_checkpoint",)

    def __init__(self, checkpoint):
        self._checkpoint = checkpoint

    def __call__(self, index, offset, length):
        return self._checkpoint._fetch(index, offset, length)

    def cancel(self):
        self._checkpoint._stop.set()
        self._checkpoint._drop_prefetched()


# -- the files beside the weights (config, tokenizer) --------------------------------

# What a model's "directory" holds beside its weights and is fetched to a
# local one (transformers' and vLLM's config and tokenizer readers take a
# path): anything at that level but weights, up to this size each.
_SIDE_FILE_LIMIT = 64 << 20
_WEIGHT_SUFFIXES = (SHARD_SUFFIX, ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")


def fetch_side_files(url, dest, storage_options=None):
    """Copies the objects under a prefix that are not weights into a local directory.

    These are the objects directly under the prefix ``url`` (config.json,
    tokenizer files, generation_config.json, the index).  An object already
    there with the same size is kept.  Each is written to a temporary name
    and renamed, so a reader never sees half a file.

    Args:
        url: the prefix (s3://bucket/model/, ...).
        dest: the local directory (made where missing).
        storage_options: as ``load_file``'s; default None.

    Returns:
        The names of every object under the prefix (the weights too, which
        stay there).
    """
    obstore = load_obstore()
    stores = Stores(storage_options)
    url = url.rstrip("/") + "/"
    store, objects = _listing(obstore, url, stores)
    os.makedirs(dest, exist_ok=True)
    names = []
    for meta in objects:
        name = posixpath.basename(meta["path"])
        names.append(name)
        if (not name or name.endswith(_WEIGHT_SUFFIXES) or name.startswith(".")
                or meta["size"] > _SIDE_FILE_LIMIT):
            continue
        path = os.path.join(dest, name)
        if os.path.isfile(path) and os.path.getsize(path) == meta["size"]:
            continue
        try:
            with no_panic(url):
                data = obstore.get(store, meta["path"]).bytes()
        except ClientPanic:
            raise
        except Exception as e:
            raise _classify(obstore, e, _safe(url + name), "fetching it") from None
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    return sorted(names)
