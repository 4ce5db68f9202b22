"""A fill's writes made beside the load by the cache's writer threads, not
by its readers (issue 54, item 2; loader/_cache.py, ``_Writers``): the
readers hand each fetched range on and fetch the next, waiting only where
the disk falls CACHE_WRITE_QUEUE bytes behind; and who holds a fill's
descriptors while a write runs, when a close, a Ctrl-C, the interpreter's
exit or a fork comes mid-fill.  Against the plain ranged-GET HTTP server
(``support/remote_servers``)."""

import json
import os
import pathlib
import select
import signal
import subprocess
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("obstore")
safetensors_torch = pytest.importorskip("safetensors.torch")

from instant_staging.loader import Checkpoint, _cache, iter_load, load_file, wait_for_cache_fills

from support import child_env
from support.remote_checkpoints import same
from support.remote_checkpoints import threads as _threads
from support.remote_servers import range_http_server_fixture  # noqa: F401

TENSORS = 16
ELEMENTS = 16 * 1024          # 64 KiB of float32 each: 1 MiB, 16 ranges and the header's
CHUNK = 64 * 1024
WRITER = "instant_staging-cache-write"


def _serve(server):
    tensors = {f"t{i}": torch.full((ELEMENTS,), float(i)) for i in range(TENSORS)}
    path = server.root_path / "model.safetensors"
    safetensors_torch.save_file(tensors, str(path))
    return server.url_for("model.safetensors"), path, tensors


def _files(cache):
    assert wait_for_cache_fills(timeout=30)
    return sorted(os.listdir(cache)) if os.path.isdir(cache) else []


def _entries(cache):
    return [n for n in _files(cache) if n.endswith(_cache.ENTRY_SUFFIX)]


def _partials(cache):
    return [n for n in _files(cache) if n.endswith(_cache.PARTIAL_SUFFIX)]


def _object(entry):
    """The object's bytes in ``entry``, less the digest after them."""
    data = pathlib.Path(entry).read_bytes()
    size = _cache._FOOTER.unpack_from(data, len(data) - _cache._FOOTER.size)[0]
    return data[:size]


def _filled_right(url, path, cache, tensors):
    """The cache holds ``path``'s object as one entry, whole and checked:
    the next load reads every byte from it."""
    (entry,) = _entries(cache)
    assert not _partials(cache)
    assert _object(cache / entry) == path.read_bytes()
    with iter_load(url, "cpu", cache_dir=cache, chunk_size=CHUNK) as it:
        same(dict(it), tensors)
    assert it.report.fetched_bytes == 0


class _HeldWrites:
    """The writers' pwrites (``_cache._write`` on a writer thread) held until
    ``release()``; each checks, once let go, that its descriptor is still
    its partial file (not closed, not another file's number)."""

    def __init__(self, monkeypatch):
        self.released = threading.Event()
        self.lock = threading.Lock()
        self.started = self.done = 0
        self.wrong = []
        write = _cache._write

        def held(fd, data, offset):
            if threading.current_thread().name != WRITER:
                return write(fd, data, offset)      # (the header, the digest: not the writers')
            before = os.fstat(fd)
            with self.lock:
                self.started += 1
            assert self.released.wait(60)
            try:
                after = os.fstat(fd)
                if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
                    self.wrong.append(fd)
            except OSError as e:
                self.wrong.append(e)
            write(fd, data, offset)
            with self.lock:
                self.done += 1
        monkeypatch.setattr(_cache, "_write", held)

    def release(self):
        self.released.set()


def test_the_readers_do_not_wait_for_the_disk(range_http_server, tmp_path, monkeypatch):
    """Every write of the fill held: the load still returns, its tensors
    whole, and so does the checkpoint's close, which hands the writes to
    the finisher (the descriptors stay open under them); once they are
    done the finisher makes the entry, the object byte for byte, and no
    writer is left."""
    url, path, tensors = _serve(range_http_server)
    cache = tmp_path / "cache"
    threads = _threads()
    held = _HeldWrites(monkeypatch)
    try:
        ck = Checkpoint.open(url, cache_dir=cache)
        same(ck.load("cpu", chunk_size=CHUNK), tensors)    # with no write done
        assert held.done == 0 and not _entries(cache) and len(_partials(cache)) == 1
        filled = ck._shards.cache
        closing = threading.Thread(target=ck.close, daemon=True)
        closing.start()
        closing.join(10)
        assert not closing.is_alive()       # the close waits for no write
        assert held.done == 0 and not wait_for_cache_fills(timeout=0.3)    # the finisher does
        assert len(os.listdir(cache)) == 1 and _cache._finisher.pending
        filled.close()                      # (idempotent: nothing more handed on)
        assert len(_cache._finisher.jobs) == 1
        held.release()
    finally:
        held.release()
    _filled_right(url, path, cache, tensors)
    assert held.done == TENSORS and not held.wrong, held.wrong
    # the writers joined by the finisher, the finisher gone once done
    deadline = time.monotonic() + 10
    while ({t for t in set(threading.enumerate()) - threads
            if t.name in (WRITER, "instant_staging-cache")} and time.monotonic() < deadline):
        time.sleep(0.01)
    assert not [t for t in set(threading.enumerate()) - threads
                if t.name in (WRITER, "instant_staging-cache")]


def _two_objects(server, prefix):
    """TENSORS tensors saved as two objects, ``<prefix>-0`` and ``-1``, every
    other tensor in each: ``(tensors, {object name: its tensors' names})``."""
    tensors = {f"t{i}": torch.full((ELEMENTS,), float(i)) for i in range(TENSORS)}
    names = {}
    for j in range(2):
        name = f"{prefix}-{j}.safetensors"
        names[name] = list(tensors)[j::2]
        safetensors_torch.save_file({k: tensors[k] for k in names[name]}, str(server.root_path / name))
    return tensors, names


def test_a_fill_of_several_objects_writes_them_side_by_side(range_http_server, tmp_path,
                                                             monkeypatch):
    """A load that fills its cache takes the objects' ranges in turn (a
    file system writes one file's ranges one at a time, several files'
    side by side): the writes alternate between the partial files from the
    start, and every entry is its object."""
    tensors, names = _two_objects(range_http_server, "m")
    (range_http_server.root_path / "m.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: name for name, part in names.items() for k in part}}))
    written = []
    write = _cache._write

    def seen(fd, data, offset):
        if threading.current_thread().name == WRITER:
            written.append(os.fstat(fd).st_ino)
        return write(fd, data, offset)
    monkeypatch.setattr(_cache, "_write", seen)
    url = range_http_server.url_for("m.safetensors.index.json")
    cache = tmp_path / "cache"
    same(load_file(url, "cpu", cache_dir=cache, chunk_size=CHUNK, threads=1), tensors)
    assert len(set(written)) == 2 and len(written) == TENSORS
    assert len(set(written[:4])) == 2          # (file by file: the first half all one file's)
    assert len(_entries(cache)) == 2 and not _partials(cache)
    with iter_load(url, "cpu", cache_dir=cache, chunk_size=CHUNK) as it:
        same(dict(it), tensors)
    assert it.report.fetched_bytes == 0


def test_a_fill_side_by_side_through_device_slots(range_http_server, tmp_path):
    """The same through a device load's slots (the simulated runtime's
    device mode: each range into a pinned slot, then to its destination,
    which a reader waits for where its chunk's tensors come later in the
    order the consumer hands out addresses): bit-exact, the entries made,
    every registration given back."""
    from support.tensors import SimTarget, assert_same, iterator, sim_staging
    tensors, names = _two_objects(range_http_server, "d")
    urls = [range_http_server.url_for(name) for name in names]
    cache = tmp_path / "cache"
    rt, buf = sim_staging()
    with Checkpoint.open(urls, cache_dir=cache) as ck:
        shards = ck._hold()
        assert shards.fills_cache
        target = SimTarget(rt)
        dtypes = [target.check(t, shards.paths[i]) for i, t in shards.entries]
        with iterator(shards, target, dtypes, chunk_size=CHUNK, io_depth=4, threads=3,
                      staging=buf) as it:
            got = dict(it)
    assert_same(got, tensors)
    buf.close()
    assert rt.live_registrations == 0
    assert len(_entries(cache)) == 2 and not _partials(cache)


def test_the_readers_wait_only_past_the_bound(range_http_server, tmp_path, monkeypatch):
    """CACHE_WRITE_QUEUE bounds the ranges handed on and not yet written
    (the buffers they keep alive): past it, a reader waits for the disk."""
    url, path, tensors = _serve(range_http_server)
    cache = tmp_path / "cache"
    monkeypatch.setattr(_cache, "CACHE_WRITE_QUEUE", 3 * CHUNK)
    held = _HeldWrites(monkeypatch)
    most = [0]
    submit = _cache._Writers.submit

    def counted(self, fill, offset, data):
        ok = submit(self, fill, offset, data)
        most[0] = max(most[0], self.held)
        return ok
    monkeypatch.setattr(_cache._Writers, "submit", counted)
    box = {}

    def load():
        box["got"] = load_file(url, "cpu", cache_dir=cache, chunk_size=CHUNK)
    try:
        loading = threading.Thread(target=load, daemon=True)
        loading.start()
        loading.join(0.5)
        assert loading.is_alive() and held.done == 0    # the readers wait: 3 ranges held
        held.release()
        loading.join(30)
        assert not loading.is_alive()
    finally:
        held.release()
    same(box["got"], tensors)
    assert 0 < most[0] <= 3 * CHUNK + 4096, most    # (a range may be a few bytes past CHUNK)
    _filled_right(url, path, cache, tensors)


_CHILD = """
import faulthandler, os, signal, sys, threading, time
faulthandler.dump_traceback_later(60, exit=True)    # a hang shows where it is
signal.signal(signal.SIGINT, signal.default_int_handler)
from instant_staging.loader import Checkpoint, _cache
write = _cache._write

def slow(fd, data, offset):
    # each of the writers' pwrites takes {seconds} s, and then checks that
    # its descriptor is still its partial file
    if threading.current_thread().name != {writer!r}:
        return write(fd, data, offset)
    print("write started", file=sys.stderr, flush=True)
    before = os.fstat(fd)
    time.sleep({seconds})
    after = os.fstat(fd)
    if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
        print("a descriptor reused under a write", file=sys.stderr, flush=True)
    write(fd, data, offset)
    print("write ended", file=sys.stderr, flush=True)
_cache._write = slow
ck = Checkpoint.open({url!r}, cache_dir={cache!r})
ck.load("cpu", chunk_size={chunk})
print("loaded", flush=True)
{then}
"""


def _child(url, cache, tmp_path, then, seconds=3.0):
    code = _CHILD.format(writer=WRITER, seconds=seconds, url=url, cache=str(cache), chunk=CHUNK,
                         then=then)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env(), cwd=tmp_path)


def _ended(child, timeout=60):
    try:
        return child.communicate(timeout=timeout)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()


def test_a_ctrl_c_in_the_exits_wait_for_the_writes(range_http_server, tmp_path):
    """A checkpoint closed with its writes still running (16 of 3 s each, 4
    at a time): the close returns at once, the finisher waits for them,
    and so does the exit, until a Ctrl-C: the exit is not held for the
    rest, no entry is named, no descriptor is closed under a write (the
    writers stop with the process), and the next load fills the object
    again."""
    url, path, tensors = _serve(range_http_server)
    cache = tmp_path / "cache"
    child = _child(url, cache, tmp_path, 'print("closing", flush=True)\nck.close()\n'
                                         'print("closed", flush=True)')
    try:
        assert child.stdout.readline().strip() == "loaded", child.stderr.read()
        assert child.stdout.readline().strip() == "closing"
        t0 = time.monotonic()
        assert child.stdout.readline().strip() == "closed"
        assert time.monotonic() - t0 < 2.5      # (not the writes' 12 s, nor one's 3)
        time.sleep(0.3)             # (in the exit's wait for the finisher)
        t0 = time.monotonic()
        child.send_signal(signal.SIGINT)
        out, err = _ended(child)
        took = time.monotonic() - t0
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0, (out, err)
    assert took < 5, took           # not the 12 s of the writes left
    for bad in ("reused", "Bad file descriptor", "Exception in thread", "Traceback"):
        assert bad not in err, err
    assert 0 < err.count("write started") < TENSORS, err
    assert not _entries(cache) and len(_files(cache)) <= 1
    load_file(url, "cpu", cache_dir=cache, chunk_size=CHUNK)
    _filled_right(url, path, cache, tensors)


def test_a_part_loaded_with_its_writes_handed_on(range_http_server, tmp_path, monkeypatch):
    """A checkpoint that loaded half its tensors, closed while their writes
    are held: the close returns, and once the writes are done the finisher
    removes the partial file (the object was not written whole), closing
    its descriptors after the last write."""
    url, _path, tensors = _serve(range_http_server)
    cache = tmp_path / "cache"
    held = _HeldWrites(monkeypatch)
    names = list(tensors)[:TENSORS // 2]
    try:
        ck = Checkpoint.open(url, cache_dir=cache)
        same(ck.load("cpu", names=names, chunk_size=CHUNK), {k: tensors[k] for k in names})
        (fill,) = ck._shards.cache._fills.values()
        closing = threading.Thread(target=ck.close, daemon=True)
        closing.start()
        closing.join(10)
        assert not closing.is_alive() and len(_partials_now(cache)) == 1
        assert fill.fds and all(os.path.exists(f"/proc/self/fd/{fd}") for fd in fill.fds)
        held.release()
    finally:
        held.release()
    assert _files(cache) == [] and not fill.fds
    assert 0 < held.done < TENSORS and not held.wrong, held.wrong


def _partials_now(cache):
    return [n for n in os.listdir(cache) if n.endswith(_cache.PARTIAL_SUFFIX)]


def test_the_exit_with_writes_handed_on(range_http_server, tmp_path):
    """A script that ends with its checkpoint open and writes still queued:
    the exit neither waits for them nor closes a descriptor under one (the
    checkpoint's finalizer runs as the interpreter ends, its writers
    stopped); no entry, at most a partial file, which the next load replaces."""
    url, path, tensors = _serve(range_http_server)
    cache = tmp_path / "cache"
    child = _child(url, cache, tmp_path, "")
    line = child.stdout.readline()
    t0 = time.monotonic()
    _out, err = _ended(child)
    took = time.monotonic() - t0
    assert child.returncode == 0 and line.strip() == "loaded", err
    assert took < 8, took           # not the 12 s of the writes
    assert "reused" not in err and "Bad file descriptor" not in err and "Fatal" not in err, err
    assert not _entries(cache) and len(_files(cache)) <= 1
    load_file(url, "cpu", cache_dir=cache, chunk_size=CHUNK)
    _filled_right(url, path, cache, tensors)


def test_a_fork_child_leaves_the_parents_writes_alone(range_http_server, tmp_path, monkeypatch):
    """A fork child of a process whose fill has writes queued and running
    has none of its writers: its copy of the cache closes at once (no
    write to wait for), removes nothing and closes only its own copies of
    the descriptors; the parent's writes go on, and its close makes the
    entry.  (The child closes the cache alone: a copy of the client's
    running event loop is no fork child's to close.)"""
    url, path, tensors = _serve(range_http_server)
    cache = tmp_path / "cache"
    held = _HeldWrites(monkeypatch)
    try:
        ck = Checkpoint.open(url, cache_dir=cache)
        same(ck.load("cpu", chunk_size=CHUNK), tensors)
        (partial,) = os.listdir(cache)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                t0 = time.monotonic()
                ck._shards.cache.close()
                ok = time.monotonic() - t0 < 5 and os.path.exists(cache / partial)
                os.write(write, b"1" if ok else b"0")
            except BaseException as e:
                os.write(write, repr(e).encode())
            finally:
                os._exit(0)
        os.close(write)
        try:
            answered = select.select([read], [], [], 20)[0]
            if not answered:
                os.kill(pid, signal.SIGKILL)
            assert answered and os.read(read, 1000) == b"1"     # (not hung on the parent's writers)
        finally:
            os.close(read)
            os.waitpid(pid, 0)
        held.release()
        ck.close()
    finally:
        held.release()
    assert wait_for_cache_fills(timeout=30)     # (the writes left: the finisher's)
    assert held.done == TENSORS and not held.wrong
    _filled_right(url, path, cache, tensors)


def test_a_close_as_the_interpreter_ends_waits_for_no_writer(range_http_server, tmp_path,
                                                             monkeypatch):
    """A cache closed while the interpreter ends (a checkpoint's finalizer)
    with writes still running: its writers are daemons, stopped where they
    stand, so the close waits for none of them and closes no descriptor
    (the process's end does); the fill is no entry, and its partial file,
    once its lock is gone with the process, is replaced by the next fill."""
    url, path, tensors = _serve(range_http_server)
    cache = tmp_path / "cache"
    held = _HeldWrites(monkeypatch)
    try:
        ck = Checkpoint.open(url, cache_dir=cache)
        same(ck.load("cpu", chunk_size=CHUNK), tensors)
        shards = ck._shards
        (fill,) = shards.cache._fills.values()
        fds = list(fill.fds)
        with monkeypatch.context() as m:
            m.setattr(sys, "is_finalizing", lambda: True)
            closing = threading.Thread(target=shards.cache.close, daemon=True)
            closing.start()
            closing.join(5)
        assert not closing.is_alive()               # no write waited for
        assert fill.fds == fds and all(os.path.exists(f"/proc/self/fd/{fd}") for fd in fds)
        held.release()
        for thread in list(shards.cache._writers.threads):
            thread.join(30)
    finally:
        held.release()
    assert held.done >= 1 and not held.wrong
    assert not _entries(cache) and len(_partials(cache)) == 1
    _cache.close_recorded(fill.fds)                 # (what the process's end does: its lock goes)
    ck.close()
    load_file(url, "cpu", cache_dir=cache, chunk_size=CHUNK)
    _filled_right(url, path, cache, tensors)
