"""Shared test setup: the sizes and the buffer factory the suites share,
and GPU tests that skip cleanly on a machine without a device."""

import functools
import mmap
import os

import pytest

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
PAGE = mmap.PAGESIZE
SEG = 4 * PAGE                  # small segments: many registrations
SIZE = 10 * PAGE + 100          # three segments of SEG, the last one short

# The fault spec that makes the SimulatedRuntime reach each kind (by name).
# Size rules rather than #N rules where threads share one runtime: which
# call fails must not depend on how they interleave.
KIND_FAULTS = {
    "REGISTERED": None,
    "SEGMENTED": "register#1=invalid_value",
    "RUNTIME_PINNED": "register=invalid_value",
    "PAGEABLE": "register=invalid_value;host_alloc=memory_allocation",
}


def make(faults=None, size=SIZE, **kw):
    """(SimulatedRuntime(faults), StagingBuffer(size) on it); segments of SEG,
    no prefault threads unless the caller says otherwise."""
    import instant_staging as ist
    from instant_staging.testing import SimulatedRuntime
    rt = SimulatedRuntime(faults=faults)
    kw.setdefault("segment_size", SEG)
    kw.setdefault("prefault_threads", 0)
    return rt, ist.StagingBuffer(size, runtime=rt, **kw)


@functools.cache
def gpu_count():
    """Devices the real runtime of this build sees (0 without a GPU or driver)."""
    try:
        from instant_staging import real_runtime
        code, count = real_runtime().device_count()
    except Exception:
        return 0
    return count if code == 0 else 0


def pytest_collection_modifyitems(config, items):
    if gpu_count() > 0:
        return
    skip = pytest.mark.skip(reason="needs a GPU: the real runtime sees no device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gpu():
    """Skips unless a GPU is present; returns the device count."""
    if gpu_count() == 0:
        pytest.skip("needs a GPU")
    return gpu_count()



def rss():
    """Resident bytes of this process, from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE

def _drop(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _cached_fraction(path):
    """The fraction of ``path``'s pages in the page cache, by mincore(2):
    unlike a read, it starts no readahead."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        pages = -(-len(m) // PAGE)
        vec = (ctypes.c_ubyte * pages)()
        anchor = ctypes.c_char.from_buffer(m)
        try:
            if libc.mincore(ctypes.addressof(anchor), len(m), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            del anchor
        return sum(v & 1 for v in vec) / pages
    finally:
        m.close()


def drop_from_page_cache(path):
    """Makes the safetensors file ``path`` cold, as _Checkpoint.resident()
    sees it; skips the test where the file system cannot tell (no
    RWF_NOWAIT) or cannot drop it (tmpfs).  The check after dropping is
    mincore's: a sampling read would start readahead and warm the file."""
    from instant_staging.loader._checkpoint import _Checkpoint
    checkpoint = _Checkpoint().open([path])
    try:
        if checkpoint.resident() != 1.0:        # hot: no sample reads the disk
            pytest.skip("this file system cannot tell resident pages (no RWF_NOWAIT)")
    finally:
        checkpoint.close()
    _drop(path)
    if _cached_fraction(path) > 0.1:
        pytest.skip("the page cache keeps this file (tmpfs?): nothing to drop")


def record_reads(monkeypatch):
    """The names the loader's single path yields from now on (in the
    order read), recorded by wrapping its generator (loader/_run.py's
    ``_load``): what the integrations actually read through us."""
    from instant_staging.loader import _run
    read, real = [], _run._load

    def spy(*args, **kwargs):
        for name, tensor in real(*args, **kwargs):
            read.append(name)
            yield name, tensor
    monkeypatch.setattr(_run, "_load", spy)
    return read
