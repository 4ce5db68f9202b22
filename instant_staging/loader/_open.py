"""Opening a source: the one way every door gets its shards.

``open_shards`` is what ``Checkpoint.open`` and ``safe_open`` both call
(and through them ``load_file``, ``iter_load``, ``load_into``, the CLI and
the integrations): it refuses what does not apply to the source (the
URL's options given for files, worded once here), resolves the source
(``_source.resolve`` for paths, ``_remote.resolve`` for URLs; a Hub source,
``org/name`` or ``hf://``, becomes the local files of huggingface_hub's
cache first: ``hub_files``), opens every
shard or object and validates its header (``Shards.open``), checks the
index against the headers (``Source.check``) and, for a URL, gives the
objects their cache (``_cache.Cache``) and reads the entries as local
files where it holds every one (``_cache.cached``; where the cache holds
an entry of every object the source names, found by URL alone, those
are opened at once and the server asked beside the load:
``_revalidate.open_hit``).  No door makes shards
or a cache itself (tests/core/test_source.py).

Ownership.  A Ctrl-C may land anywhere, so an open descriptor always has
an owner: the shards close themselves here on any exception until the
caller's owner holds them, and that owner is made here too (``own``),
not by the caller: a Ctrl-C as this function returned would otherwise
drop the open shards out of anyone's reach.  The owner (a ``Checkpoint``,
a ``safe_open``'s file) closes them when it is collected.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ._cache import Cache, cached, offline, offline_shards, offline_source
from ._cache import directory as cache_directory
from ._options import bandwidth_cap
from ._remote import RemoteShards, named_by
from ._remote import resolve as resolve_url
from ._revalidate import HitShards, open_hit, usual_way
from ._schemes import Stores, is_hub_url, is_url, redact_url, schemes_text
from ._shards import Shards
from ._source import Source, refuse_other_url, resolve
from ._throttle import Throttle

Owner = TypeVar("Owner")


def open_shards(source, *, storage_options: Mapping[str, Any] | None = None, cache_dir=None,
                max_bytes_per_second: int | None = None, one_file: bool = False,
                revision: str | None = None, own: Callable[[Shards], Owner]) -> Owner:
    """Opens ``source`` and hands its shards to their owner.

    Every header is parsed and validated (and an index checked against
    them) before anything is allocated.

    Args:
        source: as ``load_file``'s (a path, a list of paths, a directory,
            an index.json, a URL or a list of URLs); with ``one_file``, one
            .safetensors path or object URL (``safe_open``'s).
        storage_options: for a URL source, passed to the object store;
            for a Hub source, ``token`` and ``endpoint`` (huggingface_hub's,
            as ``HfFileSystem`` takes them); a ValueError for files.
        cache_dir: for a URL source, the local cache (``_cache.directory``:
            None asks the environment, False is none); for a Hub source,
            huggingface_hub's cache (None: ``HF_HUB_CACHE``); a ValueError
            for files where it is neither None nor False.
        max_bytes_per_second: for a URL source, the bandwidth cap of the
            open's own fetches (``_options.bandwidth_cap``: None asks the
            environment); each load sets its own on its share.
        one_file: ``safe_open``'s source: one file or object, never a
            directory, an index or a list.
        revision: for a Hub source, the branch, tag or commit (None: the
            one an ``hf://`` URL names, else main); a ValueError for any
            other source.
        own: called with the open shards (a ``RemoteShards``, a
            ``CachedShards`` or ``Shards``); what it returns owns them
            from then on, and is returned.  It is called here so that a
            Ctrl-C never finds the open shards without an owner.

    Returns:
        What ``own`` returned.

    Raises:
        TypeError, ValueError: a source of the wrong form, options that
            apply to a URL given for files.
        FileNotFoundError, PermissionError, SafetensorsError, ImportError:
            as ``Checkpoint.open``.
    """
    try:
        source, storage_options, cache_dir = hub_files(source, revision, storage_options, cache_dir)
        shards, src = _unopened(source, storage_options, cache_dir, max_bytes_per_second, one_file)
        try:
            try:
                shards.open(src.paths)
                src.check(shards)
            except Exception:
                if not isinstance(shards, HitShards):
                    raise
                # (an entry removed or replaced meanwhile: the usual way)
                shards.close()
                with usual_way():
                    shards, src = _unopened(source, storage_options, cache_dir,
                                            max_bytes_per_second, one_file)
                shards.open(src.paths)
                src.check(shards)
            shards = cached(shards)     # the cache's entries, where it holds every object
            return own(shards)
        except BaseException:
            shards.close()      # (idempotent: an owner made above closes nothing twice)
            raise
    except BaseException as e:
        # The error's frames would keep the object stores (their
        # connections) alive for as long as the caller keeps the error.
        traceback.clear_frames(e.__traceback__)
        raise


# The storage_options a Hub source takes (HfFileSystem's names); the rest
# are the environment's: HF_TOKEN, HF_ENDPOINT, HF_HUB_CACHE, HF_HUB_OFFLINE.
HUB_OPTIONS = ("token", "endpoint")


def hub_files(source, revision, storage_options, cache_dir):
    """``(source, storage_options, cache_dir)`` to open: a Hub source's local
    files (``_hub.files``: fetched into huggingface_hub's cache unless there
    or offline), the options it took consumed; any other source as given
    (a ValueError where ``revision`` is given with it)."""
    from .. import _hub
    items = source if isinstance(source, (list, tuple)) and is_hub_url(source) else None
    hub = None if items is not None else _hub.hub_source(source, revision)
    if hub is None and items is None:
        return source, storage_options, cache_dir
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise TypeError("storage_options must be a mapping, not "
                        f"{type(storage_options).__name__}")
    options = dict(storage_options or {})
    unknown = sorted(str(k) for k in options if k not in HUB_OPTIONS)
    if unknown:
        raise ValueError(f"storage_options for a Hub source take {' and '.join(HUB_OPTIONS)}, "
                         f"not {', '.join(unknown)}")
    if cache_dir is False:
        raise ValueError("a Hub source is read from huggingface_hub's cache: cache_dir=False "
                         "does not apply (cache_dir names that cache; None: HF_HUB_CACHE)")
    if items is None:
        return _hub.files(hub, cache_dir=cache_dir, given=source, **options), None, None
    local = []
    for item in items:
        if not is_hub_url(item):
            raise ValueError(f"a list of Hub URLs holds {redact_url(str(item))}: give one kind")
        hub = _hub.hub_source(item, revision)
        if not hub.path.endswith(".safetensors"):
            raise ValueError(f"{item}: a list names .safetensors files, not a repo, folder or index")
        local.append(_hub.files(hub, cache_dir=cache_dir, given=item, **options))
    return local, None, None


def refuse_url_options(storage_options, cache_dir) -> None:
    """The ValueError for options that apply to a URL source, given with files."""
    if storage_options is not None:
        raise ValueError(f"storage_options apply to a URL source ({schemes_text()}), "
                         "not to files")
    if cache_dir is not None and cache_dir is not False:
        raise ValueError(f"cache_dir applies to a URL source ({schemes_text()}), "
                         "not to files")


def _unopened(source, storage_options, cache_dir, max_bytes_per_second,
              one_file) -> tuple[Shards, Source]:
    """``(shards, Source)``: the files, or objects, of ``source``, resolved;
    none opened yet (``Shards.open``), so nothing to close on an error."""
    cap = bandwidth_cap(max_bytes_per_second)
    if is_url(source):
        directory = cache_directory(cache_dir)
        stores = Stores(storage_options)
        if one_file:
            name = source.rsplit("/", 1)[-1]
            if source.endswith("/") or name.endswith(".json"):
                raise ValueError(f"{redact_url(source)}: safe_open reads one .safetensors object, "
                                 "not a directory or an index")
            source = [source]
        why = offline()
        if why is not None:
            # (no client made, nothing asked: the entries as they are)
            src, urls = offline_source(source, directory, why)
            return offline_shards(urls, directory, why), src
        hit = open_hit(source, directory, stores)
        if hit is not None:
            return hit      # (its entries, read while the server is asked: _revalidate.py)
        src, objects = resolve_url(source, stores)
        cache = None if directory is None else Cache(directory)
        if cache is not None and src.named is not None:
            cache.record = (named_by(source)[1], src.named)     # (for offline mode)
        return RemoteShards(objects, cache=cache,
                            throttle=None if cap is None else Throttle(cap)), src
    refuse_url_options(storage_options, cache_dir)
    if one_file:
        if isinstance(source, str):
            refuse_other_url(source)
        return Shards(), Source([source])
    return Shards(), resolve(source)
