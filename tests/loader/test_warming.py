"""The disk's head start (issue 28): a load of a cold checkpoint to a GPU
reads it into the page cache from the moment its device is checked (in a
fresh process, CUDA's start), and then ahead of the load's readers
(``_pagecache.Warmer``, ``_prepare.usable_target``); a server's (CUDA
started) beside them (issue 45).

The contract it keeps: a device of a bad form is named before anything is
opened; a device that turns out unusable is still the first error the user
sees, before any device tensor is allocated, and the reads already started
are stopped and joined (no thread left, no descriptor, nothing cached after
the error).  Without a GPU, CUDA's start is played by a device check that
takes its time and then finds no GPU (or is interrupted); the load that
goes on is the GPU tests'."""

import json
import os
import time

import pytest

torch = pytest.importorskip("torch")

from instant_staging.loader import Checkpoint, _pagecache, _shards, iter_load, load_file

from support import cached_fraction, drop_from_page_cache, run_child
from support.tensors import assert_same, random_tensor, save

MiB = 1 << 20


def _tasks():
    return len(os.listdir("/proc/self/task"))


def _fds():
    return len(os.listdir("/proc/self/fd"))


def _settles(tasks, seconds=10):
    """Waits for the process to be back to ``tasks`` threads."""
    deadline = time.monotonic() + seconds
    while _tasks() != tasks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _tasks() == tasks


@pytest.fixture
def cold(tmp_path):
    """A 24 MiB checkpoint the page cache lacks, and its tensors."""
    tensors = {f"t{i}": random_tensor(torch.float32, [MiB // 2 + i], i) for i in range(12)}
    path = save(tmp_path, tensors)
    drop_from_page_cache(path)
    return path, tensors


@pytest.fixture
def warmers(monkeypatch):
    """The Warmers the loader starts while the test runs."""
    made = []

    class Recorded(_pagecache.Warmer):
        def __init__(self, *args):
            super().__init__(*args)
            made.append(self)
    monkeypatch.setattr(_shards, "Warmer", Recorded)
    return made


def _fresh_process(monkeypatch, check_seconds=0.3, then=None):
    """torch as in a fresh process on a host whose device check (CUDA's
    start) takes ``check_seconds`` and then finds no GPU, or raises ``then``."""
    def is_available():
        time.sleep(check_seconds)
        if then is not None:
            raise then
        return False
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", is_available)


# -- the Warmer -------------------------------------------------------------------

def test_a_warmer_reads_its_ranges_in_and_nothing_else(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(64 * MiB))
    drop_from_page_cache_raw(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        tasks = _tasks()
        warmer = _pagecache.Warmer([(fd, 0, 4 * MiB), (fd, 8 * MiB, 2 * MiB + 5)], MiB, 3)
        assert warmer.threads == 3
        deadline = time.monotonic() + 30
        while warmer.bytes_read < 6 * MiB + 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        warmer.close()
        warmer.close()                          # idempotent
        assert warmer.bytes_read == 6 * MiB + 5
        assert _tasks() == tasks                # joined
        pages = _cached_pages(path)
        assert all(pages[: 4 * MiB // 4096]) and all(pages[8 * MiB // 4096: 10 * MiB // 4096])
        # (the kernel's readahead may bring some MiB more in; not the rest)
        assert not any(pages[40 * MiB // 4096:])
    finally:
        os.close(fd)


def test_a_stopped_warmer_ends_after_its_reads_in_flight(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(32 * MiB))
    drop_from_page_cache_raw(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        warmer = _pagecache.Warmer([(fd, 0, 32 * MiB)], MiB, 2)
        warmer.stop()
        # The threads read from construction: what they read before stop()
        # depends on the scheduler; after it, one piece a thread at most.
        at_stop = warmer.bytes_read
        warmer.close()
        assert warmer.bytes_read <= at_stop + 2 * MiB
    finally:
        os.close(fd)


def test_a_warmer_read_that_fails_ends_quietly(tmp_path):
    # Advisory: the load's own read of the range reports the error.
    fd = os.open(tmp_path, os.O_RDONLY)        # a directory: pread fails (EISDIR)
    try:
        warmer = _pagecache.Warmer([(fd, 0, 4 * MiB), (fd, 4 * MiB, MiB)], MiB, 2)
        warmer.close()
        assert warmer.bytes_read == 0
    finally:
        os.close(fd)


@pytest.mark.parametrize("args", [(MiB, 0), (0, 2)])
def test_a_warmer_of_no_threads_or_pieces_is_refused(args):
    with pytest.raises(ValueError):
        _pagecache.Warmer([], *args)


def test_a_warmer_starts_once(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        warmer = _pagecache.Warmer([], MiB, 1)
        with pytest.raises(RuntimeError, match="only once"):
            warmer.__init__([(fd, 0, MiB)], MiB, 1)
        warmer.close()
        assert warmer.closed and warmer.bytes_read == 0
    finally:
        os.close(fd)


def test_a_forked_child_joins_nothing_and_the_parent_joins_its_own(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(8 * MiB))
    proc = run_child(f"""
        import os, sys
        from instant_staging.loader._pagecache import Warmer
        fd = os.open({str(path)!r}, os.O_RDONLY)
        w = Warmer([(fd, 0, 8 << 20)], 1 << 20, 2)
        pid = os.fork()
        if pid == 0:
            w.close()           # the parent's threads are not here: returns at once
            del w
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        import time             # the parent's threads read on (close() would stop them early)
        deadline = time.monotonic() + 30
        while w.bytes_read < 8 << 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        w.close()
        print(os.waitstatus_to_exitcode(status), w.bytes_read, len(os.listdir("/proc/self/task")))
    """, timeout=60)
    assert proc.returncode == 0, proc.stderr
    code, read, tasks = map(int, proc.stdout.split())
    assert code == 0 and read == 8 * MiB and tasks == 1


# -- the load: who starts it, and the device's errors first -----------------------

@pytest.mark.parametrize("process", ["fresh", "server"])
def test_a_cold_load_reads_while_the_device_is_checked_and_stops_on_its_error(
        cold, monkeypatch, warmers, process):
    # A fresh process reads while CUDA starts; a server (CUDA started)
    # waits for no start, but the disk's head start keeps more reads in
    # flight than the cold readers do, so it starts there too.
    path, _ = cold
    _fresh_process(monkeypatch)
    if process == "server":
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    tasks, fds = _tasks(), _fds()
    with pytest.raises(ValueError, match="not available"):
        load_file(path, "cuda:0")
    assert len(warmers) == 1 and warmers[0].threads >= 1
    # the disk read while the device was checked ...
    assert warmers[0].bytes_read > 0 and cached_fraction(path) > 0
    # ... and not after its error: joined, the files closed
    assert warmers[0].closed and _tasks() == tasks and _fds() == fds
    read = warmers[0].bytes_read
    time.sleep(0.2)
    assert warmers[0].bytes_read == read


def test_a_load_that_fails_after_the_device_check_joins_the_reads(cold, monkeypatch, warmers):
    # The device is found (torch says so), and the load goes on until it
    # fails without a GPU (the staging buffer's runtime, or torch's first
    # device tensor): its teardown stops and joins the reads before it
    # closes the files.
    path, _ = cold
    _fresh_process(monkeypatch, check_seconds=0.2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: time.sleep(0.2) or True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    tasks, fds = _tasks(), _fds()
    with pytest.raises(Exception) as info:
        load_file(path, "cuda:0")
    assert not isinstance(info.value, ValueError) or "not available" not in str(info.value)
    assert len(warmers) == 1 and warmers[0].bytes_read > 0
    assert warmers[0].closed and _fds() == fds
    _settles(tasks)     # (the staging buffer's thread, if any, ends by itself)


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_device_check_stops_the_reads(cold, monkeypatch, warmers, interrupt):
    path, _ = cold
    _fresh_process(monkeypatch, check_seconds=0.1, then=interrupt("in CUDA's start"))
    tasks, fds = _tasks(), _fds()
    with pytest.raises(interrupt):
        load_file(path, "cuda:0")
    assert len(warmers) == 1 and warmers[0].closed
    assert _tasks() == tasks and _fds() == fds


def test_a_checkpoint_kept_open_stops_and_joins_its_reads_on_the_device_error(
        cold, monkeypatch, warmers):
    path, _ = cold
    _fresh_process(monkeypatch)
    tasks = _tasks()
    with Checkpoint.open(path) as checkpoint:
        with pytest.raises(ValueError, match="not available"):
            checkpoint.load("cuda:0")
        assert len(warmers) == 1 and _tasks() == tasks
        # the checkpoint is still good for a load that can run
        assert_same(checkpoint.load("cpu"), cold[1])


@pytest.mark.parametrize("bad", ["missing file", "unknown name", "names and plan"])
def test_an_unusable_device_is_the_first_error(cold, tmp_path, monkeypatch, warmers, bad):
    path, _ = cold
    _fresh_process(monkeypatch, check_seconds=0)
    fds = _fds()
    if bad == "missing file":
        call = lambda: load_file(tmp_path / "missing.safetensors", "cuda:0")   # noqa: E731
    elif bad == "unknown name":
        call = lambda: load_file(path, "cuda:0", names=["t0", "nope"])          # noqa: E731
    else:
        def call():
            with Checkpoint.open(path) as checkpoint:
                checkpoint.load("cuda:0", names=["t0"], plan={"t0": None})
    with pytest.raises(ValueError, match="not available") if bad != "names and plan" else \
            pytest.raises(ValueError, match="not both"):
        call()
    assert not warmers and _fds() == fds


def test_a_device_of_a_bad_form_is_named_before_anything_is_opened(cold, monkeypatch):
    path, _ = cold
    opened = []
    real = os.open
    monkeypatch.setattr(os, "open", lambda *a, **k: opened.append(a[0]) or real(*a, **k))
    with pytest.raises(ValueError, match="cuda:x"):
        load_file(path, "cuda:x")
    assert not opened


@pytest.mark.parametrize("case", ["hot", "knobs set", "cpu"])
def test_no_warming_where_nothing_waits_for_the_disk(cold, monkeypatch, warmers, case):
    path, tensors = cold
    _fresh_process(monkeypatch, check_seconds=0)
    kwargs, device = {}, "cuda:0"
    if case == "hot":
        load_file(path)                         # reading it brings it in
    elif case == "knobs set":
        kwargs["threads"] = 2
    else:
        device = "cpu"
    if device == "cpu":
        assert_same(load_file(path, device, **kwargs), tensors)
    else:
        with pytest.raises(ValueError, match="not available"):
            load_file(path, device, **kwargs)
    assert not warmers


@pytest.fixture
def warmed_ranges(monkeypatch):
    """The ranges of each Warmer the loader starts, in a fresh process whose
    device check takes 0.5 s (the Warmers record, and read nothing)."""
    _fresh_process(monkeypatch, check_seconds=0.5)
    seen = []

    class Recorded(_pagecache.Warmer):
        def __init__(self, ranges, *args):
            seen.append(list(ranges))
    monkeypatch.setattr(_shards, "Warmer", Recorded)
    return seen


def _data_begin(path, name):
    """Where ``name``'s bytes begin in the file at ``path``."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return 8 + size + json.loads(f.read(size))[name]["data_offsets"][0]


def test_a_selection_warms_only_its_own_bytes(cold, warmed_ranges):
    path, tensors = cold
    with pytest.raises(ValueError, match="not available"):
        iter_load(path, "cuda:0", names=["t3", "t7"])
    assert [(off, length) for _, off, length in warmed_ranges[0]] == [
        (_data_begin(path, n), tensors[n].numel() * 4) for n in ("t3", "t7")]


def test_a_plan_warms_only_its_rows(cold, warmed_ranges):
    # A tensor-parallel rank loading its plan alone reads ahead only the
    # rows it keeps, not the whole checkpoint.
    path, tensors = cold
    rows = slice(1000, 3000)
    with Checkpoint.open(path) as checkpoint, pytest.raises(ValueError, match="not available"):
        checkpoint.load("cuda:0", plan={"t3": rows, "t7": None})
    assert [(off, length) for _, off, length in warmed_ranges[0]] == [
        (_data_begin(path, "t3") + rows.start * 4, (rows.stop - rows.start) * 4),
        (_data_begin(path, "t7"), tensors["t7"].numel() * 4)]


def test_the_load_knobs_follow_the_sample_taken_before_the_warming(cold, monkeypatch):
    # A sample taken after the warming began could find the first pages
    # cached and choose the hot knobs for a checkpoint read from disk.
    path, _ = cold
    with Checkpoint.open(path) as checkpoint:
        shards = checkpoint._shards
        assert shards.warm_if_cold(MiB, 2)
        assert not shards.warm_if_cold(MiB, 2)      # once per checkpoint
        shards.stop_warming()
        monkeypatch.setattr(type(shards), "resident", lambda self, samples=8: 1.0)
        assert shards.default_knobs()["threads"] == 4


def drop_from_page_cache_raw(path):
    """As drop_from_page_cache, for a file that is not a checkpoint."""
    from support import _drop
    _drop(path)
    if cached_fraction(path) > 0.1:
        pytest.skip("the page cache keeps this file (tmpfs?): nothing to drop")


def _cached_pages(path):
    """Per page of ``path``, whether the page cache holds it (mincore)."""
    import ctypes
    import mmap
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        pages = -(-len(m) // 4096)
        vec = (ctypes.c_ubyte * pages)()
        anchor = ctypes.c_char.from_buffer(m)
        try:
            assert libc.mincore(ctypes.addressof(anchor), len(m), vec) == 0
        finally:
            del anchor
        return [b & 1 for b in vec]
    finally:
        m.close()


@pytest.mark.gpu
@pytest.mark.parametrize("server", [False, True], ids=["fresh process", "server"])
def test_a_cold_checkpoint_loads_with_the_disk_s_head_start(cold, server):
    """On a GPU: a cold checkpoint, in a fresh process (nothing started: the
    disk reads while CUDA starts) or a server's (CUDA started: beside the
    readers); the tensors are safetensors'."""
    path, _ = cold
    proc = run_child(f"""
        import torch
        from safetensors.torch import load_file as st_load
        from instant_staging.loader import _shards, _pagecache, load_file
        if {server}:
            torch.ones(1, device="cuda:0")
        made = []
        class Recorded(_pagecache.Warmer):
            def __init__(self, *a):
                super().__init__(*a)
                made.append(self)
        _shards.Warmer = Recorded
        got = load_file({str(path)!r}, "cuda:0")
        torch.cuda.synchronize()
        want = st_load({str(path)!r})
        assert list(got) == list(want)
        for k in want:
            assert torch.equal(got[k].cpu().view(torch.uint8), want[k].view(torch.uint8)), k
        # (it read ahead of the readers until the load's teardown joined it)
        print(len(made), made[0].bytes_read if made else 0, int(bool(made) and made[0].closed))
    """, timeout=300)
    assert proc.returncode == 0, proc.stderr
    count, read, joined = map(int, proc.stdout.split())
    assert count == 1 and read > 0 and joined
