"""The compiled backend (CUDA or HIP) through its runtime table.

CI has no GPU, so most of these check the failure path the state machine
sees there: every pinning call fails with the runtime's own code and name.
Tests marked ``gpu`` run only where the runtime finds a device.
"""

import ctypes
import mmap
import threading

import pytest

from instant_staging import _build_config
from instant_staging.runtime import backend_module
from instant_staging.runtime._table import Runtime

from support import PAGE

BACKEND = _build_config.BACKEND
backend = backend_module()
rt = backend.runtime()

PREFIX = {"cuda": "cuda", "rocm": "hip"}[BACKEND]
# What pinning returns without a usable GPU: CUDA with no driver 35
# cudaErrorInsufficientDriver (100 cudaErrorNoDevice with a driver but no
# GPU); Debian's HIP 5.2 101 hipErrorInvalidDevice (100 on other versions).
NO_GPU_CODES = {"cuda": {35, 100}, "rocm": {100, 101}}[BACKEND]

_count_code, _count = rt.device_count()
HAVE_GPU = _count_code == 0 and _count > 0
no_gpu = pytest.mark.skipif(HAVE_GPU, reason="a GPU is present: pinning succeeds")
gpu = pytest.mark.skipif(not HAVE_GPU, reason=f"no GPU (device_count -> {_count_code})")



def address(buffer):
    """The address of a writable buffer, without keeping it exported."""
    view = (ctypes.c_char * len(buffer)).from_buffer(buffer)
    try:
        return ctypes.addressof(view)
    finally:
        del view


@pytest.fixture(params=["bytearray", "mmap"])
def host_buffer(request):
    """(address, size) of ordinary pageable memory."""
    size = 4 * PAGE
    buf = bytearray(size) if request.param == "bytearray" else mmap.mmap(-1, size)
    yield address(buf), size
    if request.param == "mmap":
        buf.close()


def names(code):
    return rt.error_name(code), rt.error_string(code)


# -- the module itself ----------------------------------------------------

def test_module_identity():
    assert backend.BACKEND == BACKEND
    assert isinstance(rt, Runtime)
    assert rt.name == BACKEND
    assert backend.runtime() is rt
    assert repr(rt) == f"<{type(rt).__name__} {BACKEND!r}>"
    assert backend.HEADER_VERSION > 0


def test_error_names_are_the_runtimes_own():
    expected = {
        "cuda": {0: "cudaSuccess", 1: "cudaErrorInvalidValue",
                 2: "cudaErrorMemoryAllocation", 100: "cudaErrorNoDevice",
                 712: "cudaErrorHostMemoryAlreadyRegistered",
                 713: "cudaErrorHostMemoryNotRegistered", 801: "cudaErrorNotSupported"},
        "rocm": {0: "hipSuccess", 1: "hipErrorInvalidValue",
                 2: "hipErrorOutOfMemory", 100: "hipErrorNoDevice",
                 712: "hipErrorHostMemoryAlreadyRegistered",
                 713: "hipErrorHostMemoryNotRegistered", 801: "hipErrorNotSupported"},
    }[BACKEND]
    for code, name in expected.items():
        assert rt.error_name(code) == name
        assert rt.error_string(code)            # HIP 5 repeats the name here


def test_unknown_code_has_a_name():
    name = rt.error_name(123456)
    assert isinstance(name, str) and name


def test_runtime_version_works_without_a_gpu():
    code, version = rt.runtime_version()
    assert code == 0
    assert version > 0
    if BACKEND == "cuda":
        assert version >= 11000                 # 13000 for CUDA 13.0


def test_driver_version_does_not_raise():
    code, version = rt.driver_version()
    assert code == 0 or code in NO_GPU_CODES
    assert version >= 0                         # CUDA without a driver: 0


# -- what CI sees: no GPU ---------------------------------------------------

@no_gpu
def test_device_count_fails():
    assert _count_code != 0 or _count == 0


@no_gpu
def test_host_register_fails_with_the_runtimes_code(host_buffer):
    ptr, size = host_buffer
    code = rt.host_register(ptr, size, 0)
    assert code in NO_GPU_CODES
    name, text = names(code)
    assert name.startswith(PREFIX + "Error")
    assert text
    if BACKEND == "cuda":
        assert name == "cudaErrorInsufficientDriver" or code == 100


@no_gpu
def test_failed_register_leaves_its_code_pending(host_buffer):
    ptr, size = host_buffer
    code = rt.host_register(ptr, size, 0)
    assert code != 0
    assert rt.peek_last_error() == code
    assert rt.get_last_error() == code
    # A read clears the error, except an initialisation failure (no driver,
    # no device), which both runtimes keep: every read returns it again.
    assert rt.get_last_error() in (0, code)


@no_gpu
def test_failed_initialisation_stays_pending():
    # Measured on the GPU-less CI machines (CUDA 13.0 static, HIP 5.2.3):
    # cudaGetLastError/hipGetLastError cannot clear a failed initialisation.
    # The state machine must not expect 0 after clearing there.
    code = rt.host_register(PAGE, PAGE, 0)
    assert code in NO_GPU_CODES
    assert [rt.get_last_error() for _ in range(3)] == [code] * 3


@no_gpu
@pytest.mark.parametrize("size", [PAGE, 1 << 20])
def test_host_alloc_fails_with_ptr_0(size):
    code, ptr = rt.host_alloc(size, 0)
    assert code in NO_GPU_CODES
    assert ptr == 0
    assert rt.error_name(code).startswith(PREFIX + "Error")
    assert rt.get_last_error() == code


@no_gpu
def test_other_calls_fail_cleanly(host_buffer):
    ptr, _size = host_buffer
    assert rt.host_unregister(ptr) != 0
    assert rt.pointer_type(ptr)[0] != 0
    code, name = rt.device_name(0)
    assert code != 0 and name == ""
    code, dev = rt.device_malloc(PAGE)
    assert code != 0 and dev == 0
    code, stream = rt.stream_create()
    assert code != 0 and stream == 0
    assert rt.device_synchronize() != 0
    rt.get_last_error()


@no_gpu
def test_concurrent_calls_from_threads():
    # The wrappers drop the GIL: several threads inside the runtime at once.
    codes = []
    lock = threading.Lock()

    def work():
        for _ in range(50):
            c = rt.host_register(PAGE, PAGE, 0)
            with lock:
                codes.append(c)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(codes) == 200 and set(codes) <= NO_GPU_CODES


# -- with a GPU ---------------------------------------------------------------

@pytest.fixture
def pages():
    """A page-aligned, touched mmap of 16 pages and its address."""
    size = 16 * PAGE
    m = mmap.mmap(-1, size)
    m[:] = bytes(range(256)) * (size // 256)
    yield m, address(m), size
    m.close()


@pytest.mark.gpu
@gpu
def test_register_unregister_and_pointer_type(pages):
    _m, ptr, size = pages
    assert rt.pointer_type(ptr) == (0, 0)       # unregistered host memory
    assert rt.host_register(ptr, size, 0) == 0
    try:
        assert rt.pointer_type(ptr) == (0, 1)
        assert rt.pointer_type(ptr + size // 2) == (0, 1)
        assert rt.host_register(ptr, size, 0) == 712
        assert rt.get_last_error() == 712
        assert rt.get_last_error() == 0
    finally:
        assert rt.host_unregister(ptr) == 0
    assert rt.pointer_type(ptr) == (0, 0)
    assert rt.host_unregister(ptr) == 713
    assert rt.get_last_error() == 713
    assert rt.get_last_error() == 0


@pytest.mark.gpu
@gpu
def test_host_alloc_and_free():
    code, ptr = rt.host_alloc(1 << 20, 0)
    assert code == 0 and ptr != 0
    try:
        assert rt.pointer_type(ptr) == (0, 1)
    finally:
        assert rt.free_host(ptr) == 0


@pytest.mark.gpu
@gpu
def test_device_info():
    code, device = rt.get_device()
    assert code == 0 and 0 <= device < _count
    assert rt.set_device(device) == 0
    code, name = rt.device_name(device)
    assert code == 0 and name
    code, version = rt.driver_version()
    assert code == 0 and version > 0


@pytest.mark.gpu
@gpu
def test_round_trip_copy_through_registered_memory(pages):
    m, ptr, size = pages
    assert rt.host_register(ptr, size, 0) == 0
    code, dev = rt.device_malloc(size)
    assert code == 0
    code, stream = rt.stream_create()
    assert code == 0
    try:
        assert rt.pointer_type(dev) == (0, 2)
        assert rt.memcpy_async(dev, ptr, size, 1, stream) == 0
        assert rt.stream_synchronize(stream) == 0
        expected = bytes(m)
        m[:] = bytes(size)
        assert rt.memcpy_async(ptr, dev, size, 2, stream) == 0
        assert rt.stream_synchronize(stream) == 0
        assert bytes(m) == expected
        assert rt.device_synchronize() == 0
    finally:
        assert rt.stream_destroy(stream) == 0
        assert rt.device_free(dev) == 0
        assert rt.host_unregister(ptr) == 0
