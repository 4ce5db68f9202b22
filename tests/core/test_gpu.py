"""On a real GPU: every pinned kind is really pinned and copies at pinned speed.

Issue 2's proof.  Each kind is forced through faults on the real runtime
(a fresh plan per test, so ``#N`` counts from this test's first call):
a 2 GiB buffer in 256 MiB segments is filled, copied to the device in
8 MiB chunks split by ``spans()``, read back and compared, and the
driver's own view of the pointers (``pointer_type``) is checked inside
every segment and after release.  Also the fact of docs/design.md ("Measured") behind
``spans()``: one copy across two registrations fails with invalid value
and copies nothing.  ``pytest -s`` shows the timings.
"""

import gc
import time

import pytest

import instant_staging as ist
from instant_staging import real_runtime
from instant_staging.testing import FaultPlan, inject_faults

from support import GiB, MiB

pytestmark = pytest.mark.gpu

SIZE = 2 * GiB
SEGMENT = 256 * MiB
CHUNK = 8 * MiB
H2D, D2H = 1, 2
MEMORY_UNREGISTERED, MEMORY_HOST = 0, 1

KINDS = [("REGISTERED", None),
         ("SEGMENTED", "register#1=invalid_value"),
         ("RUNTIME_PINNED", "register=invalid_value")]


def runtime_with(spec):
    """The real runtime, wrapped in a fresh plan when ``spec`` is given."""
    rt = real_runtime()
    return inject_faults(rt, FaultPlan.parse(spec)) if spec else rt


def chunks(size, chunk):
    for index, offset in enumerate(range(0, size, chunk)):
        yield index, offset, min(chunk, size - offset)


def fill(torch, host, size):
    # Chunk i holds a random block plus i (mod 256): a chunk copied to the
    # wrong place, or not at all, cannot match.
    block = torch.randint(0, 256, (CHUNK,), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(2))
    for index, offset, n in chunks(size, CHUNK):
        torch.add(block[:n], index % 256, out=host[offset:offset + n])


def copy_to_device(torch, buf, device_tensor):
    """8 MiB chunks, each split at registration boundaries; returns seconds."""
    view = memoryview(buf)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _, offset, n in chunks(buf.size, CHUNK):
        for ptr, length in buf.spans(offset, n):
            a = ptr - buf.ptr
            src = torch.frombuffer(view[a:a + length], dtype=torch.uint8)
            device_tensor[a:a + length].copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    del src
    view.release()
    return seconds


def assert_pinned_inside_every_segment(rt, buf):
    for offset, length in buf.segments:
        for at in (offset, offset + length // 2, offset + length - 1):
            assert rt.pointer_type(buf.ptr + at) == (0, MEMORY_HOST), (buf.kind, offset, at)


@pytest.mark.parametrize("kind,spec", KINDS, ids=[k for k, _ in KINDS])
def test_each_pinned_kind_is_pinned_and_copies_correctly(kind, spec):
    torch = pytest.importorskip("torch")
    rt = runtime_with(spec)
    t0 = time.perf_counter()
    buf = ist.StagingBuffer(SIZE, segment_size=SEGMENT, runtime=rt)
    created = time.perf_counter() - t0
    assert buf.kind is ist.Kind[kind] and buf.pinned
    if kind == "SEGMENTED":
        assert len(buf.segments) == SIZE // SEGMENT
    assert_pinned_inside_every_segment(rt, buf)

    host_view = memoryview(buf)
    host = torch.frombuffer(host_view, dtype=torch.uint8)
    fill(torch, host, SIZE)
    device_tensor = torch.empty(SIZE, dtype=torch.uint8, device="cuda")
    seconds = copy_to_device(torch, buf, device_tensor)
    back = device_tensor.cpu()
    assert torch.equal(back, host), f"{kind}: data read back differs"
    gbps = SIZE / seconds / 1e9
    print(f"\n{kind}: created in {created:.3f} s, host-to-device {gbps:.1f} GB/s "
          f"({len(buf.segments)} segment(s))")
    assert gbps > 10, f"{kind} copied at {gbps:.1f} GB/s: not at pinned speed"

    del host, back, device_tensor
    host_view.release()
    gc.collect()
    ptr = buf.ptr
    buf.close()
    if kind in ("REGISTERED", "SEGMENTED"):
        # The driver no longer knows the range.
        assert rt.pointer_type(ptr) == (0, MEMORY_UNREGISTERED)
        assert rt.pointer_type(ptr + SIZE - 1) == (0, MEMORY_UNREGISTERED)
    assert rt.get_last_error() == 0


def _copy_spans(rt, buf, device_ptr, stream, kind):
    for ptr, length in buf.spans():
        device = device_ptr + (ptr - buf.ptr)
        dst, src = (device, ptr) if kind == H2D else (ptr, device)
        assert rt.memcpy_async(dst, src, length, kind, stream) == 0
    assert rt.stream_synchronize(stream) == 0


def test_one_copy_across_two_registrations_fails_and_spans_succeed():
    rt = runtime_with("register#1=invalid_value")
    size = 2 * SEGMENT
    buf = ist.StagingBuffer(size, segment_size=SEGMENT, runtime=rt)
    assert buf.kind is ist.Kind.SEGMENTED and len(buf.segments) == 2
    view = memoryview(buf)
    code, device_ptr = rt.device_malloc(size)
    assert code == 0
    code, stream = rt.stream_create()
    assert code == 0
    try:
        # The device starts all zeros (copied from a zeroed buffer, by spans).
        view[:] = bytes(size)
        _copy_spans(rt, buf, device_ptr, stream, H2D)
        pattern = bytes(range(256)) * (size // 256)
        view[:] = pattern

        # The whole buffer in one copy, and a small copy across the boundary.
        assert rt.memcpy_async(device_ptr, buf.ptr, size, H2D, stream) == 1
        assert rt.get_last_error() == 1 and rt.get_last_error() == 0
        at = SEGMENT - 4 * MiB
        assert rt.memcpy_async(device_ptr + at, buf.ptr + at, CHUNK, H2D, stream) == 1
        assert rt.get_last_error() == 1
        assert rt.stream_synchronize(stream) == 0

        # They copied nothing: the device still holds zeros.
        _copy_spans(rt, buf, device_ptr, stream, D2H)
        assert view.tobytes() == bytes(size)

        # Split by spans(), the same copy succeeds and the data comes back.
        view[:] = pattern
        _copy_spans(rt, buf, device_ptr, stream, H2D)
        view[:] = bytes(size)
        _copy_spans(rt, buf, device_ptr, stream, D2H)
        assert view.tobytes() == pattern
    finally:
        rt.stream_destroy(stream)
        rt.device_free(device_ptr)
        view.release()
        buf.close()
    assert rt.get_last_error() == 0
