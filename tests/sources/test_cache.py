"""The local cache of URL sources (``cache_dir=``, loader/_cache.py) and the
bandwidth cap (``max_bytes_per_second=``, loader/_throttle.py), against a
real S3 server (moto's, on 127.0.0.1; ``support/remote_servers.py``): each
rule of docs/design.md's cache with the case that would break it."""

import logging
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("obstore")
safetensors_torch = pytest.importorskip("safetensors.torch")

from instant_staging.loader import (
    Checkpoint,
    _cache,
    iter_load,
    load_file,
    safe_open,
    wait_for_cache_fills,
)

from support import TESTS, child_env
from support.remote_checkpoints import fds as _fds
from support.remote_checkpoints import put_in, same, shards, upload
from support.remote_checkpoints import settled as _settled
from support.remote_checkpoints import threads as _threads
from support.remote_servers import (  # noqa: F401
    fast_retry_config,
    fault_proxy_fixture,
    s3_bucket_fixture,
    s3_server_fixture,
)
from support.remote_servers import storage_options as options

ENTRY = re.compile(r"^[0-9a-f]{64}\.[0-9a-f]{16}\.safetensors$")


def _link(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def _names(directory):
    """The cache's files once this process's fills are finished (their
    entries are made after the load returned), less the stamps of the
    entries there (test_cache_integrity's: whether the finisher or the
    first hit wrote one depends on the clock); a stamp without its entry
    is still listed."""
    assert wait_for_cache_fills(timeout=30)
    names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    return [n for n in names if not (n.endswith(_cache.STAMP_SUFFIX)
                                     and n[:-len(_cache.STAMP_SUFFIX)] + ".safetensors" in names)
            and not n.endswith(_cache.RECORD_SUFFIX)]   # (offline mode's: test_cache_offline)


def _entries(directory):
    return [n for n in _names(directory) if ENTRY.match(n)]


def _partials(directory):
    return [n for n in _names(directory) if n.endswith(".partial")]


def _object(path):
    """The object's bytes in entry ``path``: the entry less the digest after them."""
    data = pathlib.Path(path).read_bytes()
    size = _cache._FOOTER.unpack_from(data, len(data) - _cache._FOOTER.size)[0]
    return data[:size]


def _nbytes(files):
    return sum(t.numel() * t.element_size() for _, ts in files for t in ts.values())


def _big(seed, n=4, rows=256):
    """One shard of ``n`` float32 tensors of 256 KiB each."""
    g = torch.Generator().manual_seed(seed)
    return {f"w{seed}.{i}": torch.randn((rows, 256), generator=g) for i in range(n)}


def _cache_warnings(caplog):
    return [r for r in caplog.records if r.levelno == logging.WARNING and "cache" in r.getMessage()]


# -- a fill, then a hit --------------------------------------------------------------------

def test_fill_then_hit_is_bit_exact_and_reads_no_data(s3_server, s3_bucket, tmp_path, fault_proxy):
    files = shards(0)
    local = upload(put_in(s3_server, s3_bucket), "m", files, tmp_path)
    want = load_file(local)
    url, cache = f"s3://{s3_bucket}/m/", tmp_path / "cache"
    opts = options(fault_proxy.url)
    load_file(url, storage_options=opts)    # (the client's runtime: made once per process)
    threads, fds = _threads(), _fds()

    with Checkpoint.open(url, storage_options=opts, cache_dir=cache) as ck:
        same(ck.load("cpu", chunk_size=4096), want)
        report = ck.last_report
    assert (report.cache_hit_bytes, report.fetched_bytes) == (0, _nbytes(files))
    names = _entries(cache)
    assert len(names) == 2 and _names(cache) == names          # no partial file left
    # the entries are the objects, byte for byte (then their digests); their names hold
    # nothing of the URL
    by_bytes = sorted(_object(cache / n) for n in names)
    assert by_bytes == sorted((local / f).read_bytes() for f, _ in files)
    assert not any(s3_bucket in n or "model" in n for n in names)

    fault_proxy.reset_counts()
    with Checkpoint.open(url, storage_options=opts, cache_dir=cache) as ck:
        assert ck.files == [f"{url}{f}" for f, _ in files]     # still the URLs
        assert ck.info(next(iter(files[0][1]))).file == f"{url}{files[0][0]}"
        same(ck.load("cpu", chunk_size=4096), want)
        report = ck.last_report
        seen = list(fault_proxy.requests)
    assert (report.cache_hit_bytes, report.fetched_bytes) == (_nbytes(files), 0)
    # the open's one GET per object (its size and ETag validate the entry), no data GET
    ranged = [r for r in seen if r[0] == "GET" and r[2]]
    assert len(ranged) == len(files) and all(r[2].startswith("bytes=0-") for r in ranged)
    assert _names(cache) == names
    assert _settled(threads, fds), {fd: _link(fd) for fd in _fds() - fds}


def test_iter_load_and_safe_open_take_the_cache(s3_server, s3_bucket, tmp_path, monkeypatch):
    files = [("model.safetensors", _big(1))]
    local = upload(put_in(s3_server, s3_bucket), "s", files, tmp_path)
    url, cache = f"s3://{s3_bucket}/s/model.safetensors", tmp_path / "cache"
    opts = options(s3_server.url)
    want = load_file(local)
    with safe_open(url, storage_options=opts, cache_dir=cache) as f:
        same(f.get_tensors(), want)            # every byte read through the handle: filled
    assert len(_entries(cache)) == 1 and not _partials(cache)
    with safe_open(url, storage_options=opts, cache_dir=cache) as f:
        assert isinstance(f._file.checkpoint, _cache.CachedShards)
        same({n: f.get_tensor(n) for n in f.keys()}, want)  # noqa: SIM118 (safe_open's keys())
    # the variable, and False turning it off
    monkeypatch.setenv("INSTANT_STAGING_CACHE_DIR", str(cache))
    with iter_load(url, storage_options=opts) as it:
        same(dict(it), want)
    assert it.report.cache_hit_bytes == _nbytes(files)
    with iter_load(url, storage_options=opts, cache_dir=False) as it:
        same(dict(it), want)
    assert (it.report.cache_hit_bytes, it.report.fetched_bytes) == (0, _nbytes(files))
    # a local file: the variable does not apply, the argument is an error
    same(load_file(local / "model.safetensors"), want)
    with pytest.raises(ValueError, match="cache_dir applies to a URL"):
        load_file(local / "model.safetensors", cache_dir=cache)
    with pytest.raises(TypeError, match="cache_dir must be a path"):
        load_file(url, storage_options=opts, cache_dir=3)
    with pytest.raises(ValueError, match="cache_dir is empty"):
        load_file(url, storage_options=opts, cache_dir="")


def test_a_partial_load_leaves_nothing_and_batches_of_one_checkpoint_fill_it(s3_server, s3_bucket,
                                                                               tmp_path):
    files = [("model.safetensors", _big(2))]
    local = upload(put_in(s3_server, s3_bucket), "p", files, tmp_path)
    url, cache = f"s3://{s3_bucket}/p/model.safetensors", tmp_path / "cache"
    opts = options(s3_server.url)
    names = sorted(files[0][1])
    load_file(url, storage_options=opts, cache_dir=cache, names=names[:2])
    assert _names(cache) == []                  # half an object is no entry, nor a partial file
    with Checkpoint.open(url, storage_options=opts, cache_dir=cache) as ck:
        for name in names:                      # vLLM's batches: one load per group of names
            ck.load("cpu", names=[name])
        assert not _entries(cache) and len(_partials(cache)) == 1
    assert len(_entries(cache)) == 1 and not _partials(cache)     # whole: an entry at the close
    got = load_file(url, storage_options=opts, cache_dir=cache)
    same(got, load_file(local))


# -- a crash mid-fill ----------------------------------------------------------------------

_SLOW_CHILD = """
import faulthandler, signal, sys
faulthandler.dump_traceback_later(45, exit=True)    # a hang shows where it is
# Python's Ctrl-C handler, whatever this child inherited: a shell starts
# background jobs with SIGINT ignored, and Python then installs none.
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {tests!r})
from support.remote_servers import FaultProxy, fast_retry_config
from instant_staging.loader import load_file
with FaultProxy({endpoint!r}) as proxy:
    proxy.delay({delay}, n={quick}, method="GET", ranged=True)
    proxy.delay({stall}, n=10_000, method="GET", ranged=True)   # then held: a signal lands mid-fill
    opts = {{"endpoint": proxy.url, "access_key_id": "testing", "secret_access_key": "testing",
            "region": "us-east-1", "retry_config": fast_retry_config()}}
    it = load_file({url!r}, storage_options=opts, cache_dir={cache!r}, chunk_size=64 << 10,
                   threads=2)
    print("loaded", flush=True)
"""


def _wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGINT])
def test_a_crash_mid_fill_leaves_nothing_trusted(s3_server, s3_bucket, tmp_path, how):
    files = [("model.safetensors", _big(3, n=8))]         # 2 MiB: 32 ranges of 64 KiB
    local = upload(put_in(s3_server, s3_bucket), "k", files, tmp_path)
    url, cache = f"s3://{s3_bucket}/k/model.safetensors", tmp_path / "cache"
    # The header and 7 ranges of 64 KiB at 0.1 s each, then every range held
    # 8 s: the signal lands mid-fill however slow this host is, and the
    # child's own proxy lets go of the held ranges soon after.
    code = _SLOW_CHILD.format(tests=TESTS, endpoint=s3_server.url, url=url, cache=str(cache),
                              delay=0.1, quick=8, stall=8)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=child_env(), cwd=tmp_path)
    try:
        # killed once its partial file holds data beyond the header
        assert _wait_for(lambda: any(os.path.getsize(cache / p) > 200_000 for p in _partials(cache))), \
            child.stderr.read() if child.poll() is not None else "no partial file"
        child.send_signal(how)
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert "loaded" not in out, err
    assert not _entries(cache)                  # no entry: the fill never finished
    if how == signal.SIGINT:
        assert _names(cache) == []              # Ctrl-C: its partial file removed on the way out
    report = None
    with iter_load(url, storage_options=options(s3_server.url), cache_dir=cache) as it:
        got = dict(it)
    report = it.report
    same(got, load_file(local))
    assert (report.cache_hit_bytes, report.fetched_bytes) == (0, _nbytes(files))
    assert len(_entries(cache)) == 1 and not _partials(cache)   # the killed one's partial replaced
    assert _object(cache / _entries(cache)[0]) == (local / "model.safetensors").read_bytes()


def test_two_processes_fill_one_entry_at_once(s3_server, s3_bucket, tmp_path):
    files = [("model.safetensors", _big(4, n=8))]
    local = upload(put_in(s3_server, s3_bucket), "t", files, tmp_path)
    url, cache = f"s3://{s3_bucket}/t/model.safetensors", tmp_path / "cache"
    code = _SLOW_CHILD.format(tests=TESTS, endpoint=s3_server.url, url=url, cache=str(cache),
                              delay=0.02, quick=10_000, stall=0)
    children = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=child_env(), cwd=tmp_path)
                for _ in range(2)]
    try:
        outs = [c.communicate(timeout=120) for c in children]
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
    for c, (out, err) in zip(children, outs):
        assert c.returncode == 0 and "loaded" in out, err
    assert len(_entries(cache)) == 1 and not _partials(cache)
    assert _object(cache / _entries(cache)[0]) == (local / "model.safetensors").read_bytes()
    with iter_load(url, storage_options=options(s3_server.url), cache_dir=cache) as it:
        same(dict(it), load_file(local))
    assert it.report.cache_hit_bytes == _nbytes(files)


def test_a_second_filler_finds_the_lock_and_loads_without_filling(s3_server, s3_bucket, tmp_path):
    """Two fills in one process: the second finds the partial file locked
    and streams without writing it; the first's entry is whole."""
    files = [("model.safetensors", _big(5))]
    local = upload(put_in(s3_server, s3_bucket), "l", files, tmp_path)
    url, cache = f"s3://{s3_bucket}/l/model.safetensors", tmp_path / "cache"
    opts = options(s3_server.url)
    want = load_file(local)
    names = sorted(want)
    with Checkpoint.open(url, storage_options=opts, cache_dir=cache) as first:
        first.load("cpu", names=names[:1])      # its fill has begun: the partial file is locked
        assert len(_partials(cache)) == 1
        with Checkpoint.open(url, storage_options=opts, cache_dir=cache) as second:
            same(second.load("cpu"), want)
        assert not _entries(cache) and len(_partials(cache)) == 1
        first.load("cpu", names=names[1:])
    assert len(_entries(cache)) == 1 and not _partials(cache)
    assert _object(cache / _entries(cache)[0]) == (local / "model.safetensors").read_bytes()


def test_an_entry_made_meanwhile_leaves_no_partial_file(s3_server, s3_bucket, tmp_path):
    """A checkpoint opened before another's fill finished: its first write
    finds the entry, and the partial file its own open made is removed."""
    files = [("model.safetensors", _big(12))]
    local = upload(put_in(s3_server, s3_bucket), "mw", files, tmp_path)
    url, cache = f"s3://{s3_bucket}/mw/model.safetensors", tmp_path / "cache"
    opts = options(s3_server.url)
    with Checkpoint.open(url, storage_options=opts, cache_dir=cache) as late:
        load_file(url, storage_options=opts, cache_dir=cache)
        assert len(_entries(cache)) == 1
        same(late.load("cpu"), load_file(local))
    assert len(_entries(cache)) == 1 and not _partials(cache)


# -- the entries made after the load returned ----------------------------------------------

class _HeldFlush:
    """``_cache._flush`` held until ``release()``: the finisher's fsync of a slow disk."""

    def __init__(self, monkeypatch):
        import threading
        self.release_event, self.entered = threading.Event(), threading.Event()
        flush = _cache._flush

        def held(fd):
            self.entered.set()
            assert self.release_event.wait(60)
            flush(fd)
        monkeypatch.setattr(_cache, "_flush", held)

    def release(self):
        self.release_event.set()


def _in_thread(fn):
    import threading
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:      # (shown by the test's assert)
            box["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_the_load_returns_before_its_entry_is_flushed(s3_server, s3_bucket, tmp_path, fault_proxy,
                                                     monkeypatch):
    """The flush (fsync) and the rename come after the load returned; a
    later load of the object in this process waits for the entry (no second
    fetch) rather than reading a half-made one; wait_for_cache_fills times it."""
    files = shards(3)
    local = upload(put_in(s3_server, s3_bucket), "fl", files, tmp_path)
    url, cache = f"s3://{s3_bucket}/fl/", tmp_path / "cache"
    opts = options(fault_proxy.url)
    want = load_file(local)
    load_file(url, storage_options=opts)    # (the client's runtime: made once per process)
    threads, fds = _threads(), _fds()
    held = _HeldFlush(monkeypatch)
    try:
        first, box = _in_thread(lambda: iter_load(url, storage_options=opts, cache_dir=cache))
        first.join(0)

        def load_all():
            with iter_load(url, storage_options=opts, cache_dir=cache) as it:
                got = dict(it)
            return got, it.report
        first, box = _in_thread(load_all)
        first.join(30)
        assert not first.is_alive() and "error" not in box, box     # returned, its flush held
        got, report = box["value"]
        same(got, want)
        assert (report.cache_hit_bytes, report.fetched_bytes) == (0, _nbytes(files))
        assert held.entered.wait(10)
        listing = sorted(n for n in os.listdir(cache) if not n.endswith(_cache.RECORD_SUFFIX))
        assert not _entries_now(cache) and len(listing) == 2 and all(n.endswith(".partial")
                                                                     for n in listing)
        assert not wait_for_cache_fills(timeout=0.1)
        # a later load waits for the entries, then reads them: no data GET
        fault_proxy.reset_counts()
        second, box2 = _in_thread(load_all)
        second.join(0.5)
        assert second.is_alive()
        held.release()
        second.join(30)
        assert not second.is_alive() and "error" not in box2, box2
    finally:
        held.release()
    got, report = box2["value"]
    same(got, want)
    assert (report.cache_hit_bytes, report.fetched_bytes) == (_nbytes(files), 0)
    assert not [r for r in fault_proxy.requests if r[0] == "GET" and r[2] and not r[2].startswith("bytes=0-")]
    assert wait_for_cache_fills(timeout=0)
    assert len(_entries(cache)) == 2 and not _partials(cache)
    del got, box, box2
    assert _settled(threads, fds), {fd: _link(fd) for fd in _fds() - fds}   # the finisher gone too


def _entries_now(directory):
    """The entries as they are, not waiting for the fills."""
    return [n for n in os.listdir(directory) if ENTRY.match(n)] if os.path.isdir(directory) else []


def test_a_failed_flush_is_one_warning_and_no_entry(s3_server, s3_bucket, tmp_path, monkeypatch,
                                                   caplog):
    """The disk fails the flush (ENOSPC) after the load returned: the load
    stands, no entry, no partial file, one warning for both objects; the
    next load fetches and fills them."""
    import errno
    files = shards(4)
    local = upload(put_in(s3_server, s3_bucket), "ff", files, tmp_path)
    url, cache = f"s3://{s3_bucket}/ff/", tmp_path / "cache"
    opts = options(s3_server.url)

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(_cache, "_flush", full)
    with caplog.at_level(logging.WARNING, logger="instant_staging"):
        same(load_file(url, storage_options=opts, cache_dir=cache), load_file(local))
        assert _names(cache) == []
    warnings = _cache_warnings(caplog)
    assert len(warnings) == 1 and "No space left" in warnings[0].getMessage(), warnings
    assert str(cache) in warnings[0].getMessage()
    monkeypatch.undo()
    with iter_load(url, storage_options=opts, cache_dir=cache) as it:
        same(dict(it), load_file(local))
    assert it.report.fetched_bytes == _nbytes(files)
    assert len(_entries(cache)) == 2 and not _partials(cache)


def test_a_fork_child_does_not_finish_its_parents_fills(s3_server, s3_bucket, tmp_path, monkeypatch):
    files = [("model.safetensors", _big(13))]
    local = upload(put_in(s3_server, s3_bucket), "fk", files, tmp_path)
    url, cache = f"s3://{s3_bucket}/fk/model.safetensors", tmp_path / "cache"
    held = _HeldFlush(monkeypatch)
    try:
        same(load_file(url, storage_options=options(s3_server.url), cache_dir=cache), load_file(local))
        assert held.entered.wait(10)
        (partial,) = os.listdir(cache)
        fd = _cache._finisher.jobs[0][1][0].fd
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:        # the child: nothing pending, its copy of the descriptor closed
            import fcntl
            try:
                ok = (_cache.wait_for_cache_fills(timeout=0) and not _cache._finisher.jobs
                      and not os.path.exists(f"/proc/self/fd/{fd}"))
                probe = os.open(cache / partial, os.O_RDWR)
                try:
                    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    ok = False                  # the parent's lock was let go
                except BlockingIOError:
                    pass
                os.write(write, b"1" if ok else b"0")
            finally:
                os._exit(0)
        os.close(write)
        assert os.read(read, 1) == b"1"
        os.close(read)
        assert os.waitpid(pid, 0)[1] == 0
        assert not _entries_now(cache)
    finally:
        held.release()
    assert len(_entries(cache)) == 1 and not _partials(cache)


_EXIT_CHILD = """
import atexit, os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {tests!r})
from instant_staging.loader import _cache, load_file
flush = _cache._flush
def slow(fd):
    time.sleep({flush_seconds})
    flush(fd)
_cache._flush = slow
_cache.CACHE_FINISH_AT_EXIT = {bound}
opts = {{"endpoint": {endpoint!r}, "access_key_id": "testing", "secret_access_key": "testing",
        "region": "us-east-1"}}
load_file({url!r}, storage_options=opts, cache_dir={cache!r})
print("loaded", flush=True)
atexit.register(lambda: print("exiting", flush=True))     # (runs before the cache's own)
{then}
"""


@pytest.mark.parametrize("how", ["exit", "bound", "SIGKILL", "SIGINT"])
def test_the_entries_at_exit(s3_server, s3_bucket, tmp_path, how):
    """A short script's exit waits for its entries (bounded: past the bound,
    or at a Ctrl-C while it waits, the exit goes on and leaves no entry); a
    kill before the finish leaves a partial file, which no load trusts."""
    files = [("model.safetensors", _big(14))]
    local = upload(put_in(s3_server, s3_bucket), f"x{how}", files, tmp_path)
    url, cache = f"s3://{s3_bucket}/x{how}/model.safetensors", tmp_path / "cache"
    flush_seconds, bound, then = {"exit": (1, 60, ""), "bound": (30, 1, ""),
                                  "SIGKILL": (30, 60, "time.sleep(60)"),
                                  "SIGINT": (30, 60, "")}[how]
    code = _EXIT_CHILD.format(tests=TESTS, endpoint=s3_server.url, url=url, cache=str(cache),
                              flush_seconds=flush_seconds, bound=bound, then=then)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=child_env(), cwd=tmp_path)
    try:
        assert child.stdout.readline().strip() == "loaded", child.stderr.read()
        t0 = time.monotonic()
        if how == "SIGKILL":
            child.kill()
        elif how == "SIGINT":
            assert child.stdout.readline().strip() == "exiting"
            time.sleep(0.3)         # (in the cache's wait)
            child.send_signal(signal.SIGINT)
        _out, err = child.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    names = sorted(os.listdir(cache))
    if how == "exit":
        assert child.returncode == 0, err
        assert len(names) == 1 and ENTRY.match(names[0]), names
        assert _object(cache / names[0]) == (local / "model.safetensors").read_bytes()
        return
    assert took < 20, (took, err)           # not the 30 s flush
    assert not [n for n in names if ENTRY.match(n)] and len(names) == 1, names   # a partial file
    if how == "bound":
        assert child.returncode == 0 and "exit did not wait" in err, err
    # the partial file is not trusted: the next load fetches and fills
    with iter_load(url, storage_options=options(s3_server.url), cache_dir=cache) as it:
        same(dict(it), load_file(local))
    assert it.report.fetched_bytes == _nbytes(files)
    assert len(_entries(cache)) == 1 and not _partials(cache)
    assert _object(cache / _entries(cache)[0]) == (local / "model.safetensors").read_bytes()


# -- an object that changed ----------------------------------------------------------------

def test_an_object_replaced_between_loads_is_fetched_again(s3_server, s3_bucket, tmp_path):
    files = [("model-00001-of-00002.safetensors", _big(6)), ("model-00002-of-00002.safetensors", _big(7))]
    local = upload(put_in(s3_server, s3_bucket), "r", files, tmp_path)
    url, cache = f"s3://{s3_bucket}/r/", tmp_path / "cache"
    opts = options(s3_server.url)
    load_file(url, storage_options=opts, cache_dir=cache)
    before = _entries(cache)
    assert len(before) == 2
    # the second shard replaced: same names and shapes, other values
    changed = {n: t + 1 for n, t in files[1][1].items()}
    path = local / files[1][0]
    safetensors_torch.save_file(changed, str(path), metadata={"format": "pt"})
    s3_server.put(s3_bucket, f"r/{files[1][0]}", path.read_bytes())
    with iter_load(url, storage_options=opts, cache_dir=cache) as it:
        got = dict(it)
    same(got, {**files[0][1], **changed})
    first, second = (sum(t.numel() * t.element_size() for t in ts.values()) for _, ts in files)
    assert (it.report.cache_hit_bytes, it.report.fetched_bytes) == (first, second)
    after = _entries(cache)
    assert len(after) == 2 and len(set(after) & set(before)) == 1    # the old version's entry gone
    assert sorted(_object(cache / n) for n in after) == \
        sorted((local / f).read_bytes() for f, _ in files)
    with iter_load(url, storage_options=opts, cache_dir=cache) as it:
        same(dict(it), {**files[0][1], **changed})
    assert it.report.cache_hit_bytes == first + second


def test_a_damaged_entry_is_not_trusted(s3_server, s3_bucket, tmp_path):
    files = [("model.safetensors", _big(8))]
    local = upload(put_in(s3_server, s3_bucket), "d", files, tmp_path)
    url, cache = f"s3://{s3_bucket}/d/model.safetensors", tmp_path / "cache"
    opts = options(s3_server.url)
    load_file(url, storage_options=opts, cache_dir=cache)
    entry = cache / _entries(cache)[0]
    entry.write_bytes(entry.read_bytes()[:-10])          # cut short (another tool, a bad disk)
    with iter_load(url, storage_options=opts, cache_dir=cache) as it:
        same(dict(it), load_file(local))
    assert it.report.fetched_bytes == _nbytes(files)
    assert _entries(cache) == [entry.name]
    assert _object(entry) == (local / "model.safetensors").read_bytes()     # filled again


# -- a cache that cannot be written --------------------------------------------------------

def test_an_unwritable_directory_is_one_warning(s3_server, s3_bucket, tmp_path, caplog):
    files = shards(0)                 # two objects: still one warning
    local = upload(put_in(s3_server, s3_bucket), "u", files, tmp_path)
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    load_file(f"s3://{s3_bucket}/u/", storage_options=options(s3_server.url))   # (the runtime)
    threads, fds = _threads(), _fds()
    for cache in (blocker / "cache", blocker):           # under a file (ENOTDIR), a file
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="instant_staging"), \
                iter_load(f"s3://{s3_bucket}/u/", storage_options=options(s3_server.url),
                          cache_dir=cache, chunk_size=4096) as it:
            got = dict(it)
        same(got, load_file(local))
        assert it.report.fetched_bytes == _nbytes(files)
        warnings = _cache_warnings(caplog)
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert str(cache) in warnings[0].getMessage()
    assert blocker.read_bytes() == b"x"
    del it, got
    assert _settled(threads, fds), (_fds() - fds)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes a read-only directory")
def test_a_read_only_directory_is_one_warning(s3_server, s3_bucket, tmp_path, caplog):
    files = [("model.safetensors", _big(9))]
    local = upload(put_in(s3_server, s3_bucket), "ro", files, tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o500)
    with caplog.at_level(logging.WARNING, logger="instant_staging"):
        same(load_file(f"s3://{s3_bucket}/ro/", storage_options=options(s3_server.url),
                       cache_dir=cache), load_file(local))
    assert len(_cache_warnings(caplog)) == 1 and _names(cache) == []


_LIMITED_CHILD = """
import logging, resource, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="WARN %(message)s")
sys.path.insert(0, {tests!r})
from instant_staging.loader import iter_load
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))    # files past it: EFBIG
opts = {{"endpoint": {endpoint!r}, "access_key_id": "testing", "secret_access_key": "testing",
        "region": "us-east-1"}}
with iter_load({url!r}, storage_options=opts, cache_dir={cache!r}, chunk_size=64 << 10) as it:
    got = dict(it)
import hashlib, torch
digest = hashlib.sha256()
for name in sorted(got):
    digest.update(got[name].contiguous().view(torch.uint8).numpy().tobytes())
print("loaded", it.report.cache_hit_bytes, it.report.fetched_bytes, digest.hexdigest())
"""


def test_a_full_disk_mid_fill_is_one_warning(s3_server, s3_bucket, tmp_path):
    """A file size limit (RLIMIT_FSIZE) the fill's writes cross part-way:
    EFBIG, as a full disk's ENOSPC; the load finishes from the bucket."""
    import hashlib
    files = [("model.safetensors", _big(10))]
    local = upload(put_in(s3_server, s3_bucket), "f", files, tmp_path)
    url, cache = f"s3://{s3_bucket}/f/model.safetensors", tmp_path / "cache"
    code = _LIMITED_CHILD.format(tests=TESTS, endpoint=s3_server.url, url=url, cache=str(cache),
                                 limit=300_000)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=child_env(), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    warnings = [line for line in out.stdout.splitlines() if line.startswith("WARN") and "cache" in line]
    assert len(warnings) == 1 and "File too large" in warnings[0], out.stdout
    digest = hashlib.sha256()
    want = load_file(local)
    for name in sorted(want):
        digest.update(want[name].contiguous().view(torch.uint8).numpy().tobytes())
    assert f"loaded 0 {_nbytes(files)} {digest.hexdigest()}" in out.stdout
    assert _names(cache) == []                  # its partial file removed


def _tmpfs(path, size):
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                                            str(path)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root)")


def test_a_full_tmpfs_mid_fill_is_one_warning(s3_server, s3_bucket, tmp_path, fault_proxy,
                                              monkeypatch, caplog):
    """A real ENOSPC: a 2 MiB tmpfs filled by someone else once the fill began."""
    files = [("model.safetensors", _big(11, n=6))]      # 1.5 MiB
    local = upload(put_in(s3_server, s3_bucket), "full", files, tmp_path)
    cache = tmp_path / "small"
    _tmpfs(cache, "2m")
    try:
        monkeypatch.setattr(_cache, "CACHE_KEEP_FREE", 0)
        data_gets = []

        def third_data_get(method, path, rng):     # the fill began two ranges before
            data_gets.extend([1] if rng and not rng.startswith("bytes=0-") else [])
            return len(data_gets) == 3

        fault_proxy.hook(lambda seen: (cache / "other").write_bytes(b"\0" * (1 << 20)), n=1,
                         match=third_data_get)
        fault_proxy.reset_counts()
        with caplog.at_level(logging.WARNING, logger="instant_staging"), \
                iter_load(f"s3://{s3_bucket}/full/model.safetensors",
                          storage_options=options(fault_proxy.url), cache_dir=cache,
                          chunk_size=64 << 10, threads=1) as it:
            got = dict(it)
        same(got, load_file(local))
        warnings = _cache_warnings(caplog)
        assert len(warnings) == 1 and "No space left" in warnings[0].getMessage()
        assert _names(cache) == ["other"]       # the partial file removed
    finally:
        subprocess.run(["umount", str(cache)], check=False)


# -- the bound -----------------------------------------------------------------------------

def test_the_least_recently_used_entries_go_first(s3_server, s3_bucket, tmp_path, monkeypatch):
    shards = {k: [("model.safetensors", _big(20 + i))] for i, k in enumerate("abc")}
    for k, files in shards.items():
        upload(put_in(s3_server, s3_bucket), k, files, tmp_path)
    size = len((tmp_path / "a" / "model.safetensors").read_bytes())
    monkeypatch.setenv("INSTANT_STAGING_CACHE_MAX_BYTES", str(2 * size + size // 2))    # two fit
    cache = tmp_path / "cache"
    opts = options(s3_server.url)

    def load(k):
        with iter_load(f"s3://{s3_bucket}/{k}/model.safetensors", storage_options=opts,
                       cache_dir=cache) as it:
            same(dict(it), shards[k][0][1])
        return it.report.cache_hit_bytes > 0

    def entry(k):
        return _cache.entry_base(f"s3://{s3_bucket}/{k}/model.safetensors", "", None, 0)[:64]

    assert not load("a") and not load("b")
    time.sleep(0.01)
    assert load("a")                            # a used after b: b is the least recent
    time.sleep(0.01)
    assert not load("c")
    keys = {n[:64] for n in _entries(cache)}
    assert keys == {entry("a"), entry("c")}
    assert load("a") and load("c") and not load("b")


def test_an_object_larger_than_the_bound_is_not_cached(s3_server, s3_bucket, tmp_path, monkeypatch,
                                                       caplog):
    files = [("model.safetensors", _big(30))]
    upload(put_in(s3_server, s3_bucket), "big", files, tmp_path)
    monkeypatch.setenv("INSTANT_STAGING_CACHE_MAX_BYTES", "64KiB")
    cache = tmp_path / "cache"
    with caplog.at_level(logging.WARNING, logger="instant_staging"):
        same(load_file(f"s3://{s3_bucket}/big/", storage_options=options(s3_server.url),
                       cache_dir=cache), files[0][1])
    assert _names(cache) == [] and not _cache_warnings(caplog)
    monkeypatch.setenv("INSTANT_STAGING_CACHE_MAX_BYTES", "lots")
    with pytest.raises(ValueError, match="INSTANT_STAGING_CACHE_MAX_BYTES"):
        load_file(f"s3://{s3_bucket}/big/", storage_options=options(s3_server.url), cache_dir=cache)


# -- the bandwidth cap ---------------------------------------------------------------------

def test_a_load_under_a_cap_takes_its_time(s3_server, s3_bucket, tmp_path, monkeypatch):
    files = [("model.safetensors", _big(40, n=8))]      # 2 MiB
    local = upload(put_in(s3_server, s3_bucket), "cap", files, tmp_path)
    url = f"s3://{s3_bucket}/cap/model.safetensors"
    opts = options(s3_server.url)
    size, cap = _nbytes(files), 4 << 20                   # 0.5 s at the cap
    with Checkpoint.open(url, storage_options=opts) as ck:
        t0 = time.monotonic()
        same(ck.load("cpu", chunk_size=128 << 10, threads=4), load_file(local))
        free = time.monotonic() - t0
        t0 = time.monotonic()
        same(ck.load("cpu", chunk_size=128 << 10, threads=4, max_bytes_per_second=cap),
             load_file(local))
        capped = time.monotonic() - t0
    assert capped >= size / cap * 0.9 and capped > free
    monkeypatch.setenv("INSTANT_STAGING_MAX_BYTES_PER_SECOND", "4MiB")
    t0 = time.monotonic()
    load_file(url, storage_options=opts, chunk_size=128 << 10)
    assert time.monotonic() - t0 >= size / cap * 0.9
    for bad, error in ((0, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="max_bytes_per_second"):
            load_file(url, storage_options=opts, max_bytes_per_second=bad)
    monkeypatch.setenv("INSTANT_STAGING_MAX_BYTES_PER_SECOND", "fast")
    with pytest.raises(ValueError, match="INSTANT_STAGING_MAX_BYTES_PER_SECOND"):
        load_file(url, storage_options=opts)


# -- the doors: the CLI, vLLM's extra config, from_pretrained ------------------------------

def test_the_cli_takes_a_cache_dir_and_a_cap(s3_server, s3_bucket, tmp_path):
    from support.cli import cli, cli_json
    from support.remote_servers import s3_env
    files = [("model.safetensors", _big(50))]
    local = upload(put_in(s3_server, s3_bucket), "cli", files, tmp_path)
    url, cache, env = f"s3://{s3_bucket}/cli/", str(tmp_path / "cache"), s3_env(s3_server.url)
    first = cli_json("load", url, "--device", "cpu", "--cache-dir", cache, env=env)
    assert (first["cache_hit_bytes"], first["fetched_bytes"]) == (0, _nbytes(files))
    second = cli_json("load", url, "--device", "cpu", "--max-bytes-per-second", "4MiB", env={
        **env, "INSTANT_STAGING_CACHE_DIR": cache})
    assert (second["cache_hit_bytes"], second["fetched_bytes"]) == (_nbytes(files), 0)
    third = cli_json("load", url, "--device", "cpu", "--max-bytes-per-second", "4MiB", env=env)
    assert third["fetched_bytes"] == _nbytes(files)
    assert third["phases"]["load"] >= _nbytes(files) / (4 << 20) * 0.9
    bad = cli("load", str(local / "model.safetensors"), "--device", "cpu", "--cache-dir", cache)
    assert bad.returncode == 2 and "cache_dir applies to a URL" in bad.stderr, bad.stderr
    bad = cli("load", url, "--device", "cpu", "--max-bytes-per-second", "fast", env=env)
    assert bad.returncode == 2 and "--max-bytes-per-second" in bad.stderr, bad.stderr


def test_vllm_weights_fill_the_cache_batch_by_batch(s3_server, s3_bucket, tmp_path, monkeypatch):
    from instant_staging.integrations.vllm._options import parse
    from instant_staging.integrations.vllm._weights import iter_weights

    from support.remote_servers import s3_env
    files = shards(1)
    local = upload(put_in(s3_server, s3_bucket), "vl", files, tmp_path)
    for k, v in s3_env(s3_server.url).items():
        monkeypatch.setenv(k, v)
    cache = tmp_path / "cache"
    options = parse({"cache_dir": str(cache), "batch_bytes": 20_000, "max_bytes_per_second": "1GiB"})
    assert options.cache_dir == str(cache) and options.max_bytes_per_second == 1 << 30
    urls = [f"s3://{s3_bucket}/vl/{f}" for f, _ in files]
    same(dict(iter_weights(urls, "cpu", options)), load_file(local))
    assert len(_entries(cache)) == 2 and not _partials(cache)     # every batch's ranges: whole
    same(dict(iter_weights(urls, "cpu", options)), load_file(local))
    for bad in ({"cache_dir": 3}, {"cache_dir": ""}, {"max_bytes_per_second": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            parse(bad)


def test_from_pretrained_caches_a_bucket_models_weights(s3_server, s3_bucket, tmp_path, fault_proxy):
    pytest.importorskip("transformers")
    from instant_staging.integrations.transformers import from_pretrained

    from support.models import AUTO, assert_same_model, save
    path, _ = save(tmp_path, "llama", True)
    for name in sorted(os.listdir(path)):
        s3_server.put(s3_bucket, f"llama/{name}", (path / name).read_bytes())
    cache = tmp_path / "cache"
    ref = AUTO.from_pretrained(path)
    for _ in range(2):
        fault_proxy.reset_counts()
        ours = from_pretrained(f"s3://{s3_bucket}/llama", device="cpu", cache_dir=cache,
                               storage_options=options(fault_proxy.url))
        ref.config._name_or_path = ours.config._name_or_path
        assert_same_model(ours, ref)
        data_gets = [r for r in fault_proxy.requests
                     if r[0] == "GET" and r[2] and not r[2].startswith("bytes=0-")]
        assert len(_entries(cache)) == len([n for n in os.listdir(path) if n.endswith(".safetensors")])
    assert data_gets == []          # the second read its weights from the cache


_GROUP_RANK = """
import datetime, hashlib, json, sys
import torch, torch.distributed as dist
from instant_staging.loader import load_file
rank, port, url, cache, endpoint = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
opts = {"endpoint": endpoint, "access_key_id": "testing", "secret_access_key": "testing",
        "region": "us-east-1"}
got = load_file(url, storage_options=opts, cache_dir=cache if cache != "-" else False,
                process_group=dist.group.WORLD)
digest = hashlib.sha256()
for name in sorted(got):
    digest.update(got[name].contiguous().view(torch.uint8).numpy().tobytes())
print("loaded", digest.hexdigest())
dist.destroy_process_group()
"""


def test_a_group_load_where_one_rank_has_the_cache(s3_server, s3_bucket, tmp_path):
    """Rank 0 reads the objects from its cache (local files), rank 1 from
    the bucket: the ranks agree that they load the same checkpoint."""
    import hashlib
    import socket
    files = shards(2)
    local = upload(put_in(s3_server, s3_bucket), "g", files, tmp_path)
    url, cache = f"s3://{s3_bucket}/g/", tmp_path / "cache"
    load_file(url, storage_options=options(s3_server.url), cache_dir=cache)       # rank 0's cache
    assert len(_entries(cache)) == 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [subprocess.Popen([sys.executable, "-c", _GROUP_RANK, str(r), str(port), url,
                               str(cache) if r == 0 else "-", s3_server.url],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=child_env({"OMP_NUM_THREADS": "1"}), cwd=tmp_path)
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=180)[0] for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    want = load_file(local)
    digest = hashlib.sha256()
    for name in sorted(want):
        digest.update(want[name].contiguous().view(torch.uint8).numpy().tobytes())
    for p, out in zip(ranks, outs):
        assert p.returncode == 0 and f"loaded {digest.hexdigest()}" in out, out[-3000:]
