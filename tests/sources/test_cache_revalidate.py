"""A cache hit read while its objects are revalidated (loader/_revalidate.py),
against the tests' ranged-GET HTTP server in this process
(``support/remote_servers.RangeHTTPServer``): the open does not wait for
the server, no byte reaches a caller before its answer, and an object
that changed meanwhile is loaded again the usual way."""

import json
import os
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("obstore")
st = pytest.importorskip("safetensors.torch")

from instant_staging.loader import (
    Checkpoint,
    LoadError,
    RemoteChangedError,
    _cache,
    _remote,
    _revalidate,
    iter_load,
    load_file,
    load_into,
    safe_open,
    wait_for_cache_fills,
)

from support.remote_checkpoints import fds as _fds
from support.remote_checkpoints import settled as _settled
from support.remote_checkpoints import threads as _threads
from support.remote_servers import RangeHTTPServer


def _model(value, n=8, size=16 * 1024):
    return {f"t{i}": torch.full((size,), float(value * 100 + i)) for i in range(n)}


def _save(path, tensors):
    """Saves ``tensors`` over ``path`` with a later mtime: another ETag
    (the server's is the mtime and size) even within the clock's tick."""
    later = os.stat(path).st_mtime_ns + 5 * 10**9 if os.path.exists(path) else None
    st.save_file(tensors, str(path))
    if later is not None:
        os.utime(path, ns=(later, later))


def _same(got, want):
    assert list(got) == list(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def _entries(cache):
    assert wait_for_cache_fills(timeout=30)
    return sorted(n for n in os.listdir(cache) if n.endswith(_cache.ENTRY_SUFFIX))


@pytest.fixture
def served(tmp_path):
    """``(server, url, cache)``: one object, ``_model(1)``, loaded once into the cache."""
    root = tmp_path / "root"
    root.mkdir()
    _save(root / "model.safetensors", _model(1))
    cache = tmp_path / "cache"
    with RangeHTTPServer(root) as server:
        url = server.url_for("model.safetensors")
        load_file(url, cache_dir=cache)
        assert len(_entries(cache)) == 1
        server.reset_counts()
        yield server, url, cache


def _header_gets(requests):
    """The GETs of an object's first bytes (its header: the revalidation's,
    or the usual open's 1 MiB)."""
    return [r for r in requests if r.method == "GET" and (r.range or "").startswith("bytes=0-")]


def _data_gets(requests):
    """The GETs of an object's data: the object fetched."""
    return [r for r in requests if r.method == "GET" and r.range
            and not r.range.startswith("bytes=0-")]


def _on_ask(server, act, once=True):
    """Runs ``act()`` in the server as the first GET of an object's header
    (``once``; else each) arrives, before it is answered."""
    done = []

    def hook(request):
        if _header_gets([request]) and not (once and done):
            done.append(request)
            act()
    server.on_request = hook
    return done


def test_the_open_does_not_wait_for_the_server(served):
    """The open of a hit asks nothing; its load asks once its readers have
    their addresses (making the client holds the GIL), and hands out no
    tensor before the answer."""
    server, url, cache = served
    release, asked = threading.Event(), threading.Event()

    def act():
        asked.set()
        release.wait(10)
    _on_ask(server, act)
    box = {}
    try:
        t0 = time.monotonic()
        ck = Checkpoint.open(url, cache_dir=cache)
        assert isinstance(ck._shards, _revalidate.HitShards)
        assert ck.names() == list(_model(1))
        assert not asked.wait(0.3) and not server.requests      # asked by the load

        def load():
            box["got"] = ck.load()
        loading = threading.Thread(target=load, daemon=True)
        loading.start()
        # the load asked, and holds its tensors while the server holds the answer
        assert asked.wait(10) and not release.is_set()
        loading.join(0.3)
        assert loading.is_alive() and "got" not in box
    finally:
        release.set()
    loading.join(10)
    assert not loading.is_alive()
    with ck:
        _same(box["got"], _model(1))
        report = ck.last_report
    assert time.monotonic() - t0 < 10
    assert (report.cache_hit_bytes, report.fetched_bytes) == (report.bytes, 0)
    # its header's bytes asked for (no more: the usual open asks for a MiB), no data
    asked = _header_gets(server.requests)
    assert len(asked) == 1 and asked[0].range != f"bytes=0-{_remote.HEADER_PREFETCH - 1}"
    assert len(server.requests) == 1


def test_load_into_writes_nothing_before_the_answer(served):
    server, url, cache = served
    path = os.path.join(server.root, "model.safetensors")
    # the object replaced as its header is asked for, answered only after the readers
    # had time to read every entry's byte into their slots
    _on_ask(server, lambda: (_save(path, _model(2)), time.sleep(0.3)))
    threads, fds = _threads(), _fds()
    ck = Checkpoint.open(url, cache_dir=cache)
    dests = {name: torch.zeros(16 * 1024) for name in _model(1)}
    with pytest.raises(RemoteChangedError, match="changed since it was cached") as e:
        ck.load_into(dests, chunk_size=64 * 1024, threads=1)
    assert e.value.written == []
    for name, t in dests.items():
        assert not t.any(), name            # not a byte of the old version
    assert _entries(cache) == []            # the stale entry (and its stamp) removed
    assert not [n for n in os.listdir(cache) if n.endswith(_cache.STAMP_SUFFIX)]
    ck = ck.reopen()                        # the usual way: the new version fetched
    with ck:
        ck.load_into(dests)
    _same(dests, _model(2))
    assert len(_entries(cache)) == 1
    # the door that opens its own checkpoint opens it again by itself
    _save(path, _model(3))
    load_into(url, dests, cache_dir=cache)
    _same(dests, _model(3))
    assert _settled(threads, fds)


@pytest.mark.parametrize("door", ["load_file", "iter_load", "safe_open"])
def test_an_object_changed_meanwhile_is_loaded_as_it_is_now(served, door):
    server, url, cache = served
    path = os.path.join(server.root, "model.safetensors")
    _on_ask(server, lambda: _save(path, _model(2)))
    threads, fds = _threads(), _fds()
    if door == "load_file":
        _same(load_file(url, cache_dir=cache), _model(2))
    elif door == "iter_load":
        with iter_load(url, cache_dir=cache) as it:
            got = dict(it)
        assert it.names == list(_model(2)) and it.report.fetched_bytes == it.report.bytes
        _same(got, _model(2))
    else:
        # a handle's tensors are its object's as it was opened: the change is an error
        with (safe_open(url, framework="pt", cache_dir=cache) as f,
              pytest.raises(RemoteChangedError, match="changed since it was cached")):
            f.get_tensor("t0")
        with safe_open(url, framework="pt", cache_dir=cache) as f:
            _same(f.get_tensors(), _model(2))      # (every byte: its entry filled)
    # the second open took the usual way: the object fetched and filled
    assert _data_gets(server.requests)
    assert len(_entries(cache)) == 1
    server.reset_counts()
    _same(load_file(url, cache_dir=cache), _model(2))      # a hit again
    assert len(server.requests) == 1 and not _data_gets(server.requests)
    assert _settled(threads, fds)


def test_an_index_that_names_other_objects_now(tmp_path):
    root, cache = tmp_path / "root", tmp_path / "cache"
    root.mkdir()
    first, second = _model(1, n=2), {f"u{i}": torch.full((64,), float(i)) for i in range(2)}
    _save(root / "a.safetensors", first)
    _save(root / "b.safetensors", second)

    def index(*shards):
        weight_map = {n: s for s, ts in shards for n in ts}
        (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    index(("a.safetensors", first))
    with RangeHTTPServer(root) as server:
        url = server.url_for("model.safetensors.index.json")
        _same(load_file(url, cache_dir=cache), first)
        assert len(_entries(cache)) == 1
        assert isinstance(Checkpoint.open(url, cache_dir=cache)._shards, _revalidate.HitShards)
        index(("a.safetensors", first), ("b.safetensors", second))
        _same(load_file(url, cache_dir=cache), {**first, **second})
        assert len(_entries(cache)) == 2


def test_no_answer_in_time_is_the_opens_error(served, monkeypatch):
    server, url, cache = served
    monkeypatch.setattr(_revalidate, "RETRY_SECONDS", 0.5)
    release = threading.Event()
    _on_ask(server, lambda: release.wait(10), once=False)
    threads, fds = _threads(), _fds()
    try:
        t0 = time.monotonic()
        with pytest.raises(LoadError, match=r"no answer within 0\.5 s"):
            load_file(url, cache_dir=cache)
        assert time.monotonic() - t0 < 5
        dests = {name: torch.zeros(16 * 1024) for name in _model(1)}
        with Checkpoint.open(url, cache_dir=cache) as ck, pytest.raises(LoadError):
            ck.load_into(dests)
        assert not any(t.any() for t in dests.values())
    finally:
        release.set()
    assert len(_entries(cache)) == 1        # an entry is no less the object for a silent server
    assert _settled(threads, fds)


@pytest.mark.parametrize("asked", [True, False], ids=["asked", "never-asked"])
def test_a_checkpoint_closed_before_the_answer_leaks_nothing(served, asked):
    server, url, cache = served
    release, arrived = threading.Event(), threading.Event()
    _on_ask(server, lambda: (arrived.set(), release.wait(10)))
    threads, fds = _threads(), _fds()
    try:
        with Checkpoint.open(url, cache_dir=cache) as ck:
            assert isinstance(ck._shards, _revalidate.HitShards)
            if asked:
                ck._shards.revalidating()
                assert arrived.wait(10)
        # its request loop ended with the close, the HEAD still unanswered
        assert not [t for t in threading.enumerate() if t.name == "instant_staging-requests"]
        assert arrived.is_set() == asked
    finally:
        release.set()
    assert _settled(threads, fds)       # (no client kept: a closed checkpoint keeps no socket)
    with pytest.raises(LoadError, match="closed while its cache entries were revalidated"):
        ck._shards.revalidated()


def test_safe_open_asks_at_its_open(served):
    """A safe_open handle of a hit asks the server as it opens (its
    tensors are asked for later), and returns none before the answer."""
    server, url, cache = served
    release, asked = threading.Event(), threading.Event()
    _on_ask(server, lambda: (asked.set(), release.wait(10)))
    box = {}
    try:
        with safe_open(url, framework="pt", cache_dir=cache) as f:
            assert asked.wait(10)

            def get():
                box["t0"] = f.get_tensor("t0")
            getting = threading.Thread(target=get, daemon=True)
            getting.start()
            getting.join(0.3)
            assert getting.is_alive() and not box
            release.set()
            getting.join(10)
            assert not getting.is_alive()
    finally:
        release.set()
    _same(box, {"t0": _model(1)["t0"]})
