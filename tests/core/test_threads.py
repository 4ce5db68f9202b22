"""Threads: buffers created, filled, exported and released concurrently.

Every runtime call of the state machine is made with the GIL released, so
other threads run in the middle of a construction or a release.  The
SimulatedRuntime is shared between threads (it serialises its books under
the GIL) and its log is unbounded, so each test can count, per buffer, the
registrations and the releases: every range released exactly once, no
call refused by the simulation (a second unregister would be 713), nothing
live at the end.  A short switch interval makes the interleavings dense.
"""

import collections
import gc
import sys
import threading

import pytest

import instant_staging as ist
from instant_staging.testing import SimulatedRuntime

from support import PAGE, SEG

THREADS = 8

# One runtime per kind, shared by all threads.  Size rules rather than #N
# rules: which call fails must not depend on how the threads interleave.
KIND_FAULTS = {
    ist.Kind.REGISTERED: None,
    ist.Kind.SEGMENTED: f"register>{SEG}=invalid_value",
    ist.Kind.RUNTIME_PINNED: "register=invalid_value",
    ist.Kind.PAGEABLE: "register=not_supported;host_alloc=memory_allocation",
}


@pytest.fixture(autouse=True)
def dense_switching():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def run_threads(target, n=THREADS, args=()):
    """Starts n threads on target(index, *args); re-raises the first error."""
    errors = []

    def guarded(i):
        try:
            target(i, *args)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a thread hung"
    if errors:
        raise errors[0]


def assert_books_clean(rt):
    """Nothing live, nothing pending, and every range released exactly once."""
    assert rt.live_registrations == 0 and rt.live_host_allocs == 0
    assert rt.pending_error == 0
    refused = [c for c in rt.calls if c[0] in ("host_register", "host_unregister",
                                               "host_alloc", "free_host") and c[-1] != 0]
    assert refused == [], refused[:5]
    regs = collections.Counter(c[1] for c in rt.calls if c[0] == "host_register")
    unregs = collections.Counter(c[1] for c in rt.calls if c[0] == "host_unregister")
    assert regs == unregs
    allocs = collections.Counter(c[3] for c in rt.calls if c[0] == "host_alloc")
    frees = collections.Counter(c[1] for c in rt.calls if c[0] == "free_host")
    assert allocs == frees


def test_concurrent_create_fill_export_release():
    """8 threads, each cycling through every kind: create (sometimes with
    prefault threads of its own), fill with its own pattern, export views and
    slices, check nobody else's bytes got in, release by close, context
    manager or collection."""
    runtimes = {kind: SimulatedRuntime(faults=f, log_limit=None) for kind, f in KIND_FAULTS.items()}
    rounds = 100

    def worker(i):
        pattern = bytes([i + 1]) * 7
        for r in range(rounds):
            kind = list(runtimes)[(i + r) % len(runtimes)]
            size = (5 + (i * 7 + r) % 8) * PAGE - (r % 3) * 100     # > SEG: segmentable
            buf = ist.StagingBuffer(size, segment_size=SEG, runtime=runtimes[kind],
                                    prefault_threads=(r % 4 == 0) * 2, allow_pageable=True)
            assert buf.kind is kind
            fill = (pattern * (size // len(pattern) + 1))[:size]
            view = memoryview(buf)
            view[:] = fill
            piece = view[size // 2:]
            assert sum(n for _, n in buf.spans()) == size
            assert bytes(view) == fill                    # no other thread's bytes
            view.release()
            assert bytes(piece) == fill[size // 2:]
            piece.release()
            how = r % 3
            if how == 0:
                buf.close()
                assert buf.closed
            elif how == 1:
                with buf:
                    pass
            else:
                del buf                                   # released by __dealloc__

    run_threads(worker)
    gc.collect()
    for rt in runtimes.values():
        assert_books_clean(rt)
    assert sum(1 for c in runtimes[ist.Kind.REGISTERED].calls if c[0] == "host_register") \
        == THREADS * rounds // 4


@pytest.mark.parametrize("kind", [ist.Kind.SEGMENTED, ist.Kind.RUNTIME_PINNED])
def test_two_threads_close_the_same_buffer(kind):
    """Both return; the memory is released once (segmented: every segment
    once, though each unregister releases the GIL for the other thread)."""
    rt = SimulatedRuntime(faults=KIND_FAULTS[kind], log_limit=None)
    for _ in range(150):
        buf = ist.StagingBuffer(12 * PAGE, segment_size=PAGE, runtime=rt, prefault_threads=0)
        assert buf.kind is kind
        barrier = threading.Barrier(2)

        def closer(i):
            barrier.wait()
            buf.close()
            assert buf.closed

        run_threads(closer, n=2)
        buf = None                                        # the closure holds the cell
    assert_books_clean(rt)


def test_two_threads_close_when_release_fails_one_error():
    """An unregister fault at release: exactly one of the two closers gets
    the StagingError, and the range it names is the one left registered."""
    rt = SimulatedRuntime(faults="register>4KiB=invalid_value;unregister>=4KiB=not_registered",
                          log_limit=None)
    for _ in range(60):
        buf = ist.StagingBuffer(6 * PAGE, segment_size=PAGE, runtime=rt, prefault_threads=0)
        assert buf.kind is ist.Kind.SEGMENTED
        barrier = threading.Barrier(2)
        raised = []

        def closer(i):
            barrier.wait()
            try:
                buf.close()
            except ist.StagingError as e:
                raised.append(e)

        before = len(rt.registered_ranges())
        run_threads(closer, n=2)
        assert len(raised) == 1, raised
        assert len(raised[0].retained_ranges) == 6
        assert len(rt.registered_ranges()) == before      # all six leaked on purpose
        unregs = [c for c in rt.calls if c[0] == "host_unregister"]
        assert unregs == []                                # injected: never reached the books
    assert rt.plan.counts["unregister"] == 60 * 6         # one release attempt per segment


def test_close_races_dealloc():
    """One thread closes while another drops the last other reference and
    collects: release runs once, from whichever gets there first."""
    rt = SimulatedRuntime(faults=KIND_FAULTS[ist.Kind.SEGMENTED], log_limit=None)
    for r in range(200):
        holder = [ist.StagingBuffer(8 * PAGE, segment_size=PAGE, runtime=rt,
                                    prefault_threads=0)]
        barrier = threading.Barrier(2)

        def closer(i):
            if i == 0:
                buf = holder[0]
                barrier.wait()
                buf.close()
                del buf
            else:
                barrier.wait()
                holder.clear()
                if r % 10 == 0:
                    gc.collect()

        run_threads(closer, n=2)
    gc.collect()
    assert_books_clean(rt)


def test_close_while_other_threads_export():
    """close() races threads taking and dropping views: it either raises
    BufferError (a view is alive, memory intact) or wins, after which no new
    view can be taken.  A view never outlives the mapping (that would crash)."""
    rt = SimulatedRuntime(faults=KIND_FAULTS[ist.Kind.SEGMENTED], log_limit=None)
    for _ in range(40):
        buf = ist.StagingBuffer(8 * PAGE, segment_size=2 * PAGE, runtime=rt, prefault_threads=0)
        stop = threading.Event()
        outcome = collections.Counter()

        def user(i):
            if i == 0:
                while True:
                    try:
                        buf.close()
                        outcome["closed"] += 1
                        stop.set()
                        return
                    except BufferError:
                        outcome["refused"] += 1
            else:
                while not stop.is_set():
                    try:
                        view = memoryview(buf)
                    except ValueError:                # closed: no new view
                        break
                    view[i] = i
                    assert view[i] == i               # still mapped under the view
                    view.release()

        run_threads(user, n=4)
        assert outcome["closed"] == 1 and buf.closed
    assert_books_clean(rt)
