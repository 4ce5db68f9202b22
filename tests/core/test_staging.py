"""The state machine on the simulated runtime: every path, every release."""

import gc
import logging

import pytest

import instant_staging as ist
from instant_staging.testing import SimulatedRuntime

from support import PAGE, SEG, SIZE, make


def steps(buf_or_err):
    return [(a.step, a.ok) for a in buf_or_err.attempts]


def ops(rt, *names):
    return [c for c in rt.calls if c[0] in names]


def test_whole_registration_fast_path():
    rt, buf = make()
    assert buf.kind is ist.Kind.REGISTERED and buf.pinned
    assert steps(buf) == [("allocate", True), ("register", True)]
    assert buf.segments == ((0, SIZE),)
    assert rt.live_registrations == 1 and rt.registered_ranges() == [(buf.ptr, SIZE)]
    assert rt.pointer_type(buf.ptr + SIZE - 1) == (0, 1)
    assert buf.ptr % PAGE == 0 and buf.size == SIZE and len(memoryview(buf)) == SIZE
    buf.close()
    assert rt.live_registrations == 0 and buf.closed and buf.ptr == 0
    assert [c[0] for c in ops(rt, "host_register", "host_unregister")] == [
        "host_register", "host_unregister"]


def test_segmented_retry_after_whole_registration_fails():
    rt, buf = make("register#1=invalid_value")
    assert buf.kind is ist.Kind.SEGMENTED
    assert steps(buf) == [("allocate", True), ("register", False),
                          ("register_segment", True), ("register_segment", True),
                          ("register_segment", True)]
    assert buf.attempts[1].code == 1 and buf.attempts[1].name == rt.error_name(1)
    assert buf.segments == ((0, SEG), (SEG, SEG), (2 * SEG, SIZE - 2 * SEG))
    assert rt.registered_ranges() == [(buf.ptr + o, n) for o, n in buf.segments]
    assert rt.covers(buf.ptr, SIZE)
    assert rt.pending_error == 0
    buf.close()
    unregs = [c[1] for c in ops(rt, "host_unregister")]
    assert unregs == [buf_ptr for buf_ptr in sorted(unregs, reverse=True)]  # newest first
    assert rt.live_registrations == 0


def test_default_segment_size_is_256_mib():
    """The seed's default (docs/design.md step 4), pinned: a buffer built
    without segment_size= whose whole registration fails is cut into
    256 MiB segments, the last one short."""
    MiB = 1 << 20
    rt = SimulatedRuntime(faults="register#1=invalid_value")
    with ist.StagingBuffer(600 * MiB, prefault_threads=0, runtime=rt) as buf:
        assert buf.kind is ist.Kind.SEGMENTED
        assert buf.segments == ((0, 256 * MiB), (256 * MiB, 256 * MiB), (512 * MiB, 88 * MiB)), (
            f"default segments {[(o // MiB, n // MiB) for o, n in buf.segments]} (MiB), "
            "not 256 MiB each")


def test_segmentation_skipped_when_buffer_fits_one_segment():
    _rt, buf = make("register=invalid_value", size=SEG)
    assert buf.kind is ist.Kind.RUNTIME_PINNED
    assert [a.step for a in buf.attempts] == ["allocate", "register", "runtime_alloc"]


def test_rollback_then_runtime_pinned():
    # Call 1 is the whole range, 2 and 3 segments, 4 the third segment.
    rt, buf = make("register#1=invalid_value;register#4=memory_allocation")
    assert buf.kind is ist.Kind.RUNTIME_PINNED
    assert steps(buf) == [("allocate", True), ("register", False),
                          ("register_segment", True), ("register_segment", True),
                          ("register_segment", False), ("rollback", True),
                          ("rollback", True), ("runtime_alloc", True)]
    rollbacks = [a.offset for a in buf.attempts if a.step == "rollback"]
    assert rollbacks == [SEG, 0]                      # newest first
    assert rt.live_registrations == 0 and rt.live_host_allocs == 1
    assert rt.pointer_type(buf.ptr) == (0, 1)
    buf.close()
    assert rt.live_host_allocs == 0
    assert [c[0] for c in rt.calls][-1] == "free_host"


def test_rollback_failure_retains_memory():
    rt = SimulatedRuntime(faults="register#1=invalid_value;register#4=invalid_value;"
                                 "unregister#1=invalid_value")
    with pytest.raises(ist.RollbackError) as info:
        ist.StagingBuffer(SIZE, runtime=rt, segment_size=SEG, prefault_threads=0)
    err = info.value
    assert isinstance(err, ist.StagingError)
    assert err.retained_ranges == tuple(rt.registered_ranges())
    assert len(err.retained_ranges) == 1 and err.retained_ranges[0][1] == SEG
    assert [a.step for a in err.attempts][-2:] == ["rollback", "rollback"]
    assert [a.ok for a in err.attempts][-2:] == [False, True]
    assert rt.pending_error == 0 and rt.live_host_allocs == 0
    assert "retained" in str(err)
    gc.collect()                                      # nothing freed behind our back
    assert rt.registered_ranges() == list(err.retained_ranges)


def test_runtime_pinned_when_every_registration_fails():
    rt, buf = make("register=invalid_value")
    assert buf.kind is ist.Kind.RUNTIME_PINNED
    assert steps(buf) == [("allocate", True), ("register", False),
                          ("register_segment", False), ("runtime_alloc", True)]
    assert rt.live_registrations == 0 and rt.live_host_allocs == 1
    with buf:
        memoryview(buf)[:4] = b"abcd"
        assert bytes(memoryview(buf)[:4]) == b"abcd"
    assert rt.live_host_allocs == 0


def test_fallback_failure_leaves_nothing():
    rt = SimulatedRuntime(faults="register=not_supported;host_alloc=memory_allocation")
    with pytest.raises(ist.StagingError) as info:
        ist.StagingBuffer(SIZE, runtime=rt, segment_size=SEG, prefault_threads=0)
    err = info.value
    assert not isinstance(err, ist.RollbackError)
    assert err.code == 2
    assert [a.step for a in err.attempts] == ["allocate", "register", "register_segment",
                                              "runtime_alloc"]
    assert rt.error_name(801) in str(err) and "allow_pageable" in str(err)
    assert rt.live_registrations == 0 and rt.live_host_allocs == 0
    assert rt.pending_error == 0 and rt.get_last_error() == 0


def test_pageable_is_opt_in(caplog):
    rt = SimulatedRuntime(faults="register=invalid_value;host_alloc=memory_allocation")
    with caplog.at_level(logging.WARNING, "instant_staging"):
        buf = ist.StagingBuffer(SIZE, runtime=rt, segment_size=SEG, prefault_threads=0,
                                allow_pageable=True)
    assert buf.kind is ist.Kind.PAGEABLE and not buf.pinned
    assert buf.attempts[-1].step == "pageable"
    assert any("slower" in r.getMessage() for r in caplog.records)
    mv = memoryview(buf)
    mv[-1] = 7
    assert mv[-1] == 7
    mv.release()
    buf.close()
    assert rt.live_registrations == 0 and rt.live_host_allocs == 0


def test_each_fallback_logged_once_with_names_sizes_and_knob(caplog):
    with caplog.at_level(logging.WARNING, "instant_staging"):
        rt, buf = make("register=invalid_value")
    messages = [r.getMessage() for r in caplog.records if r.name == "instant_staging"]
    assert len(messages) == 2, messages
    assert rt.error_name(1) in messages[0] and "segment_size" in messages[0]
    assert "KiB" in messages[0] and "as 3 segments" in messages[0]
    assert "HostAlloc" in messages[1] or "hipHostMalloc" in messages[1]
    buf.close()


@pytest.mark.parametrize("release", ["close", "with", "gc"])
@pytest.mark.parametrize("faults,kind,free_op", [
    (None, ist.Kind.REGISTERED, "host_unregister"),
    ("register#1=invalid_value", ist.Kind.SEGMENTED, "host_unregister"),
    ("register=invalid_value", ist.Kind.RUNTIME_PINNED, "free_host"),
    ("register=invalid_value;host_alloc=invalid_value", ist.Kind.PAGEABLE, None),
])
def test_release_dispatches_on_kind(release, faults, kind, free_op):
    rt = SimulatedRuntime(faults=faults)
    kw = dict(runtime=rt, segment_size=SEG, prefault_threads=0, allow_pageable=True)
    if release == "with":
        with ist.StagingBuffer(SIZE, **kw) as buf:
            assert buf.kind is kind
    else:
        buf = ist.StagingBuffer(SIZE, **kw)
        assert buf.kind is kind
        if release == "close":
            buf.close()
            buf.close()                               # idempotent
        else:
            del buf
            gc.collect()
    assert rt.live_registrations == 0 and rt.live_host_allocs == 0
    released = [c[0] for c in ops(rt, "host_unregister", "free_host") if c[-1] == 0]
    expected = {None: 0, "host_unregister": 1 if kind is ist.Kind.REGISTERED else 3,
                "free_host": 1}[free_op]
    assert released == [free_op] * expected


def test_release_failure_leaks_on_purpose_and_close_raises():
    rt, buf = make("unregister=invalid_value")
    assert buf.kind is ist.Kind.REGISTERED
    with pytest.raises(ist.StagingError) as info:
        buf.close()
    assert info.value.retained_ranges == ((rt.registered_ranges()[0]),)
    assert rt.live_registrations == 1 and buf.closed and rt.pending_error == 0
    buf.close()                                       # once only


def test_release_failure_in_gc_logs(caplog):
    rt, buf = make("unregister=invalid_value")
    with caplog.at_level(logging.ERROR, "instant_staging"):
        del buf
        gc.collect()
    assert any("leaked on purpose" in r.getMessage() for r in caplog.records)
    assert rt.live_registrations == 1


def test_close_while_exported_raises_buffer_error():
    rt, buf = make()
    view = memoryview(buf)
    assert view.readonly is False and view.format == "B" and view.ndim == 1
    with pytest.raises(BufferError):
        buf.close()
    assert rt.live_registrations == 1
    view.release()
    buf.close()
    assert rt.live_registrations == 0
    with pytest.raises(ValueError):
        memoryview(buf)


def test_memoryview_keeps_buffer_alive():
    rt, buf = make()
    view = memoryview(buf)
    del buf
    gc.collect()
    view[0] = 1                                       # still mapped and registered
    assert rt.live_registrations == 1
    view.release()
    gc.collect()
    assert rt.live_registrations == 0


def test_spans_never_cross_a_registration_and_copies_succeed():
    rt, buf = make("register#1=invalid_value")
    assert buf.kind is ist.Kind.SEGMENTED
    spans = buf.spans()
    assert [n for _, n in spans] == [n for _, n in buf.segments]
    assert buf.spans(SEG - 10, 20) == [(buf.ptr + SEG - 10, 10), (buf.ptr + SEG, 10)]
    assert buf.spans(5, 0) == []
    memoryview(buf)[:] = bytes(range(256)) * (SIZE // 256) + bytes(SIZE % 256)
    code, dev = rt.device_malloc(SIZE)
    assert code == 0
    # One copy of the whole buffer spans registrations: the driver refuses it.
    assert rt.memcpy_async(dev, buf.ptr, SIZE, 1) == 1
    assert rt.get_last_error() == 1
    offset = 0
    for ptr, n in buf.spans():
        assert rt.memcpy_async(dev + offset, ptr, n, 1) == 0
        offset += n
    out = bytearray(SIZE)
    import ctypes
    host = (ctypes.c_char * SIZE).from_buffer(out)
    assert rt.memcpy_async(ctypes.addressof(host), dev, SIZE, 2) == 0
    assert bytes(out) == bytes(memoryview(buf))
    del host
    rt.device_free(dev)
    buf.close()


def test_copy_unit_rounds_segments_so_chunks_never_straddle():
    unit = 3 * PAGE
    rt, buf = make("register#1=invalid_value", size=20 * PAGE, segment_size=8 * PAGE,
                   copy_unit=unit)
    assert buf.segment_size == 6 * PAGE
    assert buf.kind is ist.Kind.SEGMENTED
    _code, dev = rt.device_malloc(buf.size)
    for offset in range(0, buf.size, unit):
        n = min(unit, buf.size - offset)
        assert len(buf.spans(offset, n)) == 1
        assert rt.memcpy_async(dev + offset, buf.ptr + offset, n, 1) == 0
    rt.device_free(dev)
    buf.close()


def test_prefault_and_hugepages_do_not_change_the_outcome():
    outcomes = []
    for threads, huge in ((0, False), (4, False), (0, True), (3, True)):
        _rt, buf = make("register#1=invalid_value", prefault_threads=threads, hugepages=huge)
        memoryview(buf)[:] = b"\x5a" * SIZE
        outcomes.append((buf.kind, [a.step for a in buf.attempts if a.step != "prefault"],
                         buf.segments, bytes(memoryview(buf)) == b"\x5a" * SIZE))
        assert [a.step for a in buf.attempts].count("prefault") == (1 if threads else 0)
        if huge:
            assert buf.ptr % (2 << 20) == 0
        buf.close()
    assert all(o == outcomes[0] for o in outcomes)


def test_size_is_never_rounded():
    rt, buf = make(size=PAGE + 1)
    assert buf.size == PAGE + 1 == len(memoryview(buf))
    assert rt.registered_ranges() == [(buf.ptr, PAGE + 1)]
    buf.close()


# Bad input (arguments, spans, fault specs) is table-driven in test_bad_input.py.


def test_repr():
    _rt, buf = make("register#1=invalid_value")
    assert "SEGMENTED" in repr(buf)
    buf.close()
    assert "closed" in repr(buf)


def test_format_size_never_leaves_a_bare_point():
    assert ist.format_size((256 << 20) + 5) == "256 MiB"
    assert ist.format_size(1536) == "1.5 KiB"
    assert ist.format_size(100) == "100 B"
