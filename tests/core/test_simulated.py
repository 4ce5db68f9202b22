"""SimulatedRuntime: the driver semantics of docs/design.md ("Measured"), without a GPU."""

import ctypes
import mmap
import os
import threading

import pytest

from instant_staging.testing import SimulatedRuntime

from support import PAGE

H2D, D2H = 1, 2


class Host:
    """Page-aligned anonymous memory with its address; kept open while alive."""

    def __init__(self, size):
        self.map = mmap.mmap(-1, size)
        self.ptr = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.size = size

    def fill(self, data):
        self.map[:len(data)] = data

    def read(self, offset=0, size=None):
        size = self.size - offset if size is None else size
        return bytes(self.map[offset:offset + size])


@pytest.fixture
def sim():
    # CUDA's names and versions, whichever backend this build has.
    return SimulatedRuntime(backend="cuda")


@pytest.fixture
def host():
    return Host(16 * PAGE)


# -- registration ---------------------------------------------------------------

def test_register_and_unregister(sim, host):
    assert sim.host_register(host.ptr, host.size) == 0
    assert sim.live_registrations == 1
    assert sim.registered_ranges() == [(host.ptr, host.size)]
    assert sim.host_unregister(host.ptr) == 0
    assert sim.live_registrations == 0
    assert sim.registered_ranges() == []
    assert sim.pending_error == 0


@pytest.mark.parametrize("ptr_offset, size", [(None, 4096), (0, 0)])
def test_register_null_or_empty_is_invalid_value(sim, host, ptr_offset, size):
    ptr = 0 if ptr_offset is None else host.ptr + ptr_offset
    assert sim.host_register(ptr, size) == 1
    assert sim.live_registrations == 0
    assert sim.get_last_error() == 1


@pytest.mark.parametrize("offset, size", [
    (0, 4 * PAGE),          # the same range
    (PAGE, PAGE),           # inside
    (-PAGE, 2 * PAGE),      # runs into its start
    (3 * PAGE, 2 * PAGE),   # runs out of its end
    (-PAGE, 6 * PAGE),      # contains it
    (4 * PAGE - 1, 1),      # its last byte
])
def test_overlapping_registration_is_already_registered(sim, host, offset, size):
    base = host.ptr + 4 * PAGE
    assert sim.host_register(base, 4 * PAGE) == 0
    assert sim.host_register(base + offset, size) == 712
    assert sim.get_last_error() == 712
    assert sim.registered_ranges() == [(base, 4 * PAGE)]


def test_adjacent_registrations_are_fine(sim, host):
    base = host.ptr + 4 * PAGE
    assert sim.host_register(base, 4 * PAGE) == 0
    assert sim.host_register(base - PAGE, PAGE) == 0
    assert sim.host_register(base + 4 * PAGE, PAGE) == 0
    assert sim.registered_ranges() == [(base - PAGE, PAGE), (base, 4 * PAGE),
                                       (base + 4 * PAGE, PAGE)]
    assert sim.live_registrations == 3
    assert sim.pending_error == 0


def test_registering_runtime_allocated_memory_is_already_registered(sim):
    code, ptr = sim.host_alloc(2 * PAGE)
    assert code == 0
    assert sim.host_register(ptr + PAGE, 10) == 712
    assert sim.live_registrations == 0
    assert sim.free_host(ptr) == 0


def test_unregister_interior_pointer_is_invalid_value(sim, host):
    assert sim.host_register(host.ptr, 4 * PAGE) == 0
    assert sim.host_unregister(host.ptr + 1) == 1
    assert sim.get_last_error() == 1
    assert sim.host_unregister(host.ptr + 4 * PAGE - 1) == 1
    assert sim.live_registrations == 1
    assert sim.host_unregister(host.ptr) == 0


def test_unregister_unknown_or_twice_is_not_registered(sim, host):
    assert sim.host_unregister(host.ptr) == 713
    assert sim.get_last_error() == 713
    assert sim.host_register(host.ptr, PAGE) == 0
    assert sim.host_unregister(host.ptr + PAGE) == 713  # just past its end
    assert sim.host_unregister(host.ptr) == 0
    assert sim.host_unregister(host.ptr) == 713
    assert sim.host_unregister(0) == 713


# -- the last error ----------------------------------------------------------------

def test_last_error_set_until_read(sim, host):
    assert sim.pending_error == 0
    assert sim.host_unregister(host.ptr) == 713
    assert sim.pending_error == 713
    assert sim.peek_last_error() == 713
    assert sim.pending_error == 713        # peeking does not reset
    # A success does not clear it.
    assert sim.host_register(host.ptr, PAGE) == 0
    assert sim.pending_error == 713
    assert sim.get_last_error() == 713
    assert sim.get_last_error() == 0
    assert sim.pending_error == 0


def test_later_failure_replaces_pending_error(sim, host):
    assert sim.host_unregister(host.ptr) == 713
    assert sim.host_register(0, 1) == 1
    assert sim.get_last_error() == 1
    assert sim.get_last_error() == 0


# -- runtime allocation ------------------------------------------------------------

def test_host_alloc_page_aligned_real_memory(sim):
    code, ptr = sim.host_alloc(3 * PAGE + 5)
    assert code == 0
    assert ptr and ptr % PAGE == 0
    ctypes.memset(ptr, 0xAB, 3 * PAGE + 5)   # writable all the way
    assert ctypes.string_at(ptr + 3 * PAGE, 5) == b"\xab" * 5
    assert sim.live_host_allocs == 1
    assert sim.host_allocations() == [(ptr, 3 * PAGE + 5)]
    assert sim.pointer_type(ptr + 7) == (0, 1)
    assert sim.free_host(ptr) == 0
    assert sim.live_host_allocs == 0
    assert sim.host_allocations() == []


def test_free_host_unknown_is_invalid_value(sim, host):
    assert sim.free_host(host.ptr) == 1
    assert sim.get_last_error() == 1
    _code, ptr = sim.host_alloc(PAGE)
    assert sim.free_host(ptr + 8) == 1     # interior
    assert sim.free_host(ptr) == 0
    assert sim.free_host(ptr) == 1         # twice
    # A registration is not a runtime allocation.
    assert sim.host_register(host.ptr, PAGE) == 0
    assert sim.free_host(host.ptr) == 1
    assert sim.live_registrations == 1


def test_host_alloc_failure_is_memory_allocation(sim):
    assert sim.host_alloc(1 << 62) == (2, 0)
    assert sim.get_last_error() == 2
    assert sim.live_host_allocs == 0


def test_zero_sizes(sim):
    assert sim.host_alloc(0) == (0, 0)
    assert sim.free_host(0) == 0
    assert sim.device_malloc(0) == (0, 0)
    assert sim.device_free(0) == 0
    assert sim.live_host_allocs == 0 and sim.live_device_allocs == 0


# -- device side and copies -----------------------------------------------------------

def test_device_queries(sim):
    assert sim.device_count() == (0, 1)
    assert sim.get_device() == (0, 0)
    assert sim.set_device(0) == 0
    assert sim.device_name(0) == (0, "SimulatedRuntime device")
    assert sim.runtime_version() == (0, 13000)
    assert sim.driver_version() == (0, 13000)
    assert sim.device_synchronize() == 0
    assert sim.set_device(1) == 101
    assert sim.get_last_error() == 101
    assert sim.device_name(-1) == (101, "")


def test_several_devices():
    sim = SimulatedRuntime(device_count=4)
    assert sim.device_count() == (0, 4)
    assert sim.set_device(3) == 0
    assert sim.get_device() == (0, 3)


def test_no_device():
    sim = SimulatedRuntime(device_count=0)
    assert sim.device_count() == (100, 0)
    assert sim.get_last_error() == 100
    assert sim.device_malloc(64) == (100, 0)
    assert sim.stream_create() == (100, 0)
    assert sim.memcpy_async(1, 1, 1, H2D) == 100
    # Host memory still works.
    host = Host(PAGE)
    assert sim.host_register(host.ptr, PAGE) == 0
    assert sim.host_unregister(host.ptr) == 0


def test_device_malloc_and_free(sim):
    code, dev = sim.device_malloc(1000)
    assert code == 0 and dev
    assert sim.live_device_allocs == 1
    assert sim.device_allocations() == [(dev, 1000)]
    assert sim.pointer_type(dev + 999) == (0, 2)
    assert sim.device_free(dev + 1) == 1
    assert sim.device_free(dev) == 0
    assert sim.device_free(dev) == 1
    assert sim.live_device_allocs == 0


def test_pointer_type(sim, host):
    assert sim.pointer_type(host.ptr) == (0, 0)
    assert sim.host_register(host.ptr, 2 * PAGE) == 0
    assert sim.pointer_type(host.ptr) == (0, 1)
    assert sim.pointer_type(host.ptr + 2 * PAGE - 1) == (0, 1)
    assert sim.pointer_type(host.ptr + 2 * PAGE) == (0, 0)
    assert sim.host_unregister(host.ptr) == 0
    assert sim.pointer_type(host.ptr) == (0, 0)


def test_copy_round_trip_inside_one_registration(sim, host):
    payload = bytes(range(256)) * 16
    host.fill(payload)
    assert sim.host_register(host.ptr, host.size) == 0
    code, dev = sim.device_malloc(len(payload))
    assert code == 0
    assert sim.memcpy_async(dev, host.ptr, len(payload), H2D) == 0
    back = Host(PAGE * 2)
    assert sim.memcpy_async(back.ptr, dev, len(payload), D2H) == 0
    assert back.read(0, len(payload)) == payload
    assert sim.pending_error == 0
    sim.device_free(dev)


def test_copy_spanning_two_registrations_fails_and_copies_nothing(sim, host):
    host.fill(b"\x11" * host.size)
    assert sim.host_register(host.ptr, 4 * PAGE) == 0
    assert sim.host_register(host.ptr + 4 * PAGE, 4 * PAGE) == 0
    _code, dev = sim.device_malloc(8 * PAGE)
    ctypes.memset(dev, 0x22, 8 * PAGE)
    # One byte over the boundary is enough.
    assert sim.memcpy_async(dev, host.ptr + 2 * PAGE, 2 * PAGE + 1, H2D) == 1
    assert sim.get_last_error() == 1
    assert ctypes.string_at(dev, 8 * PAGE) == b"\x22" * (8 * PAGE)
    # The same the other way round.
    assert sim.memcpy_async(host.ptr + PAGE, dev, 4 * PAGE, D2H) == 1
    assert host.read() == b"\x11" * host.size
    # Each half on its own copies.
    assert sim.memcpy_async(dev, host.ptr + 2 * PAGE, 2 * PAGE, H2D) == 0
    assert sim.memcpy_async(dev, host.ptr + 4 * PAGE, 4 * PAGE, H2D) == 0
    assert ctypes.string_at(dev, 4 * PAGE) == b"\x11" * (4 * PAGE)


def test_copy_from_pageable_memory(sim, host):
    host.fill(b"pageable")
    _code, dev = sim.device_malloc(8)
    assert sim.memcpy_async(dev, host.ptr, 8, H2D) == 0
    assert ctypes.string_at(dev, 8) == b"pageable"


def test_copy_partly_pageable_partly_registered_fails(sim, host):
    assert sim.host_register(host.ptr + 4 * PAGE, 4 * PAGE) == 0
    _code, dev = sim.device_malloc(16 * PAGE)
    assert sim.memcpy_async(dev, host.ptr + 3 * PAGE, 2 * PAGE, H2D) == 1   # runs in
    assert sim.memcpy_async(dev, host.ptr + 7 * PAGE, 2 * PAGE, H2D) == 1   # runs out
    assert sim.memcpy_async(dev, host.ptr, 16 * PAGE, H2D) == 1             # contains it


def test_copy_spanning_runtime_allocation_fails(sim):
    _, ptr = sim.host_alloc(2 * PAGE)
    _code, dev = sim.device_malloc(4 * PAGE)
    assert sim.memcpy_async(dev, ptr, 2 * PAGE, H2D) == 0
    assert sim.memcpy_async(dev, ptr + PAGE, 2 * PAGE, H2D) == 1


def test_copy_device_range_must_lie_in_one_allocation(sim, host):
    _code, dev = sim.device_malloc(PAGE)
    assert sim.memcpy_async(dev + 1, host.ptr, PAGE, H2D) == 1
    assert sim.memcpy_async(host.ptr, dev + PAGE, 1, D2H) == 1
    assert sim.memcpy_async(host.ptr + 8, host.ptr, 8, H2D) == 1   # not device memory
    assert sim.memcpy_async(0, host.ptr, 8, H2D) == 1
    assert sim.memcpy_async(dev, host.ptr, PAGE, H2D) == 0
    assert sim.memcpy_async(dev, host.ptr, 0, H2D) == 0


def test_copy_direction_and_streams(sim, host):
    code, dev = sim.device_malloc(64)
    assert sim.memcpy_async(dev, host.ptr, 64, 0) == 21
    assert sim.error_name(21) == "cudaErrorInvalidMemcpyDirection"
    assert sim.memcpy_async(dev, host.ptr, 64, H2D, 0xdead0) == 400
    code, stream = sim.stream_create()
    assert code == 0 and stream
    _code2, stream2 = sim.stream_create()
    assert stream2 != stream
    assert sim.memcpy_async(dev, host.ptr, 64, H2D, stream) == 0
    assert sim.stream_synchronize(stream) == 0
    assert sim.stream_synchronize(0) == 0
    assert sim.stream_destroy(stream) == 0
    assert sim.stream_destroy(stream) == 400
    assert sim.stream_synchronize(stream) == 400


# -- counters, covers, log ------------------------------------------------------------

def test_counters(sim, host):
    for i in range(4):
        assert sim.host_register(host.ptr + i * PAGE, PAGE) == 0
    ptrs = [sim.host_alloc(PAGE)[1] for _ in range(3)]
    devs = [sim.device_malloc(PAGE)[1] for _ in range(2)]
    assert (sim.live_registrations, sim.live_host_allocs, sim.live_device_allocs) == (4, 3, 2)
    assert sim.host_allocations() == sorted((p, PAGE) for p in ptrs)
    for i in range(4):
        assert sim.host_unregister(host.ptr + i * PAGE) == 0
    for p in ptrs:
        assert sim.free_host(p) == 0
    for d in devs:
        assert sim.device_free(d) == 0
    assert (sim.live_registrations, sim.live_host_allocs, sim.live_device_allocs) == (0, 0, 0)


def test_covers(sim, host):
    p = host.ptr
    assert not sim.covers(p, PAGE)
    assert sim.host_register(p, 2 * PAGE) == 0
    assert sim.host_register(p + 2 * PAGE, 3 * PAGE) == 0
    assert sim.covers(p, 5 * PAGE)
    assert sim.covers(p, 2 * PAGE)
    assert not sim.covers(p, 4 * PAGE)        # ends inside a registration
    assert not sim.covers(p + PAGE, 4 * PAGE)  # starts inside one
    assert not sim.covers(p, 6 * PAGE)        # runs past the last
    assert not sim.covers(p, 0)
    assert sim.host_register(p + 6 * PAGE, PAGE) == 0
    assert not sim.covers(p, 7 * PAGE)        # a gap
    assert sim.covers(p + 6 * PAGE, PAGE)


def test_call_log(sim, host):
    _, hptr = sim.host_alloc(PAGE, 2)
    sim.host_register(host.ptr, PAGE)
    sim.host_register(host.ptr, PAGE)
    sim.get_last_error()
    sim.host_unregister(host.ptr)
    sim.free_host(hptr)
    sim.peek_last_error()
    sim.error_name(1)  # not logged
    assert sim.calls == [
        ("host_alloc", PAGE, 2, hptr, 0),
        ("host_register", host.ptr, PAGE, 0, 0),
        ("host_register", host.ptr, PAGE, 0, 712),
        ("get_last_error", 712),
        ("host_unregister", host.ptr, 0),
        ("free_host", hptr, 0),
        ("peek_last_error", 0),
    ]
    sim.clear_log()
    assert sim.calls == []
    _code, dev = sim.device_malloc(16)
    sim.memcpy_async(dev, host.ptr, 16, H2D)
    assert sim.calls == [("device_malloc", 16, dev, 0),
                         ("memcpy_async", dev, host.ptr, 16, H2D, 0, 0)]


def test_log_limit(host):
    sim = SimulatedRuntime(log_limit=3)
    for _ in range(5):
        sim.host_unregister(host.ptr)
    assert sim.calls == [("host_unregister", host.ptr, 713)] * 3
    quiet = SimulatedRuntime(log_limit=0)
    quiet.host_unregister(host.ptr)
    assert quiet.calls == []
    assert quiet.pending_error == 713
    unbounded = SimulatedRuntime(log_limit=None)
    for _ in range(20000):
        unbounded.peek_last_error()
    assert len(unbounded.calls) == 20000


def test_constructor_arguments():
    with pytest.raises(ValueError):
        SimulatedRuntime(device_count=-1)
    with pytest.raises(TypeError):
        SimulatedRuntime(device_count="1")
    with pytest.raises(ValueError):
        SimulatedRuntime(log_limit=-1)
    with pytest.raises(ValueError):
        SimulatedRuntime(backend="metal")
    with pytest.raises(TypeError):
        SimulatedRuntime(1)  # not a spec or plan
    sim = SimulatedRuntime()
    assert sim.name == "simulated"
    assert "simulated" in repr(sim)


# -- error names ------------------------------------------------------------------------

@pytest.mark.parametrize("code, name, string", [
    (0, "cudaSuccess", "no error"),
    (1, "cudaErrorInvalidValue", "invalid argument"),
    (2, "cudaErrorMemoryAllocation", "out of memory"),
    (100, "cudaErrorNoDevice", "no CUDA-capable device is detected"),
    (712, "cudaErrorHostMemoryAlreadyRegistered",
     "part or all of the requested memory range is already mapped"),
    (713, "cudaErrorHostMemoryNotRegistered",
     "pointer does not correspond to a registered memory region"),
    (801, "cudaErrorNotSupported", "operation not supported"),
    (4242, "cudaErrorUnknown(4242)", "unrecognized error code"),
])
def test_cuda_error_names(code, name, string):
    sim = SimulatedRuntime(backend="cuda")
    assert sim.error_name(code) == name
    assert sim.error_string(code) == string


@pytest.mark.parametrize("code, name", [
    (1, "hipErrorInvalidValue"), (2, "hipErrorOutOfMemory"), (100, "hipErrorNoDevice"),
    (712, "hipErrorHostMemoryAlreadyRegistered"), (713, "hipErrorHostMemoryNotRegistered"),
    (801, "hipErrorNotSupported"), (4242, "hipErrorUnknown(4242)"),
])
def test_hip_error_names(code, name):
    sim = SimulatedRuntime(backend="rocm")
    assert sim.error_name(code) == name
    assert sim.error_string(1) == "invalid argument"


def test_default_names_follow_the_build():
    try:
        from instant_staging._build_config import BACKEND
    except ImportError:
        BACKEND = "cuda"
    sim = SimulatedRuntime()
    assert sim.backend == ("rocm" if BACKEND == "rocm" else "cuda")
    assert sim.error_name(1) == ("hipErrorInvalidValue" if BACKEND == "rocm"
                                 else "cudaErrorInvalidValue")


# -- lifetime and threads -----------------------------------------------------------------

def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_dealloc_frees_leftovers():
    size = 64 << 20
    sim = SimulatedRuntime()
    code, ptr = sim.host_alloc(size)
    assert code == 0
    code, dev = sim.device_malloc(size)
    assert code == 0
    ctypes.memset(ptr, 1, size)  # make both resident
    ctypes.memset(dev, 1, size)
    before = _rss()
    del sim  # leaked by the "test": freed, not a crash
    assert before - _rss() > size  # most of the 128 MiB went back


def test_threads_register_concurrently():
    sim = SimulatedRuntime(log_limit=None)
    n_threads, per_thread = 8, 200
    host = Host(n_threads * per_thread * 64)
    errors = []

    def work(t):
        base = host.ptr + t * per_thread * 64
        for i in range(per_thread):
            if sim.host_register(base + i * 64, 64) != 0:
                errors.append(("register", t, i))
        for i in range(per_thread):
            if sim.host_unregister(base + i * 64) != 0:
                errors.append(("unregister", t, i))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sim.live_registrations == 0
    assert len(sim.calls) == 2 * n_threads * per_thread


def test_threads_racing_for_one_range():
    sim = SimulatedRuntime()
    host = Host(PAGE)
    codes = []
    barrier = threading.Barrier(8)

    def work():
        barrier.wait()
        codes.append(sim.host_register(host.ptr, PAGE))

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(codes) == [0] + [712] * 7
    assert sim.live_registrations == 1


def test_events_exist_only_between_create_and_destroy():
    rt = SimulatedRuntime()
    code, stream = rt.stream_create()
    code, event = rt.event_create()
    assert code == 0 and event != 0
    assert rt.event_record(event, stream) == 0
    assert rt.event_synchronize(event) == 0
    assert rt.event_destroy(event) == 0
    assert rt.event_synchronize(event) != 0          # destroyed: invalid handle
    assert rt.get_last_error() != 0 and rt.get_last_error() == 0
    assert rt.stream_destroy(stream) == 0
