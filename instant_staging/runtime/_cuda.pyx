# cython: language_level=3
"""The CUDA runtime behind the runtime table (see ``_table.pxd``).

Each table entry is a small ``noexcept nogil`` adapter around one CUDA
runtime call, returning the runtime's own ``cudaError_t``.  ``ctx`` is
unused: the CUDA runtime keeps its state (current device, last error per
thread) itself.

The runtime is normally linked statically (``libcudart_static.a``, symbols
kept private to this module), so this module imports on a machine without
a GPU or driver; every call then returns 35 ``cudaErrorInsufficientDriver``
(``cudaRuntimeGetVersion`` still works).  Because the runtime is private,
the last error read through this table is the one this module's calls set,
never that of another libcudart in the process (torch ships its own).
"""

from libc.string cimport strncpy

from instant_staging.runtime._table cimport Runtime

BACKEND = "cuda"


cdef extern from "cuda_runtime_api.h" nogil:
    ctypedef int cudaError_t
    ctypedef void* cudaStream_t

    int CUDART_VERSION

    cdef enum cudaMemcpyKind:
        pass

    cdef struct cudaPointerAttributes:
        int type                  # enum cudaMemoryType: 0 unregistered .. 3 managed

    cdef struct cudaDeviceProp:
        char name[256]

    unsigned int cudaStreamNonBlocking

    cudaError_t cudaHostRegister(void* ptr, size_t size, unsigned int flags)
    cudaError_t cudaHostUnregister(void* ptr)
    cudaError_t cudaHostAlloc(void** ptr, size_t size, unsigned int flags)
    cudaError_t cudaFreeHost(void* ptr)
    cudaError_t cudaGetLastError()
    cudaError_t cudaPeekAtLastError()
    const char* cudaGetErrorName(cudaError_t error)
    const char* cudaGetErrorString(cudaError_t error)
    cudaError_t cudaRuntimeGetVersion(int* version)
    cudaError_t cudaDriverGetVersion(int* version)
    cudaError_t cudaGetDeviceCount(int* count)
    cudaError_t cudaGetDevice(int* device)
    cudaError_t cudaSetDevice(int device)
    cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device)
    cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attributes,
                                         const void* ptr)
    cudaError_t cudaMalloc(void** ptr, size_t size)
    cudaError_t cudaFree(void* ptr)
    cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count,
                                cudaMemcpyKind kind, cudaStream_t stream)
    cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags)
    cudaError_t cudaStreamDestroy(cudaStream_t stream)
    cudaError_t cudaStreamSynchronize(cudaStream_t stream)
    cudaError_t cudaDeviceSynchronize()
    ctypedef void* cudaEvent_t
    unsigned int cudaEventDisableTiming
    unsigned int cudaEventBlockingSync
    cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags)
    cudaError_t cudaEventDestroy(cudaEvent_t event)
    cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream)
    cudaError_t cudaEventSynchronize(cudaEvent_t event)


# The CUDA version of the headers this module was compiled against (13000 = 13.0).
HEADER_VERSION = CUDART_VERSION


# -- adapters: exactly the typedef signatures of _table.pxd ----------------

cdef int _host_register(void* ctx, void* ptr, size_t size,
                        unsigned int flags) noexcept nogil:
    return cudaHostRegister(ptr, size, flags)

cdef int _host_unregister(void* ctx, void* ptr) noexcept nogil:
    return cudaHostUnregister(ptr)

cdef int _host_alloc(void* ctx, void** ptr, size_t size,
                     unsigned int flags) noexcept nogil:
    return cudaHostAlloc(ptr, size, flags)

cdef int _free_host(void* ctx, void* ptr) noexcept nogil:
    return cudaFreeHost(ptr)

cdef int _get_last_error(void* ctx) noexcept nogil:
    return cudaGetLastError()

cdef int _peek_last_error(void* ctx) noexcept nogil:
    return cudaPeekAtLastError()

cdef const char* _error_name(void* ctx, int code) noexcept nogil:
    return cudaGetErrorName(<cudaError_t>code)

cdef const char* _error_string(void* ctx, int code) noexcept nogil:
    return cudaGetErrorString(<cudaError_t>code)

cdef int _runtime_version(void* ctx, int* value) noexcept nogil:
    return cudaRuntimeGetVersion(value)

cdef int _driver_version(void* ctx, int* value) noexcept nogil:
    return cudaDriverGetVersion(value)

cdef int _device_count(void* ctx, int* value) noexcept nogil:
    return cudaGetDeviceCount(value)

cdef int _get_device(void* ctx, int* value) noexcept nogil:
    return cudaGetDevice(value)

cdef int _set_device(void* ctx, int value) noexcept nogil:
    return cudaSetDevice(value)

cdef int _device_name(void* ctx, int device, char* name, size_t length) noexcept nogil:
    # cudaDeviceProp is large (~1 KiB) but a stack copy is cheap next to the call.
    cdef cudaDeviceProp prop
    cdef int code
    if length == 0:
        return 1                                # cudaErrorInvalidValue
    code = cudaGetDeviceProperties(&prop, device)
    if code == 0:
        strncpy(name, prop.name, length - 1)
        name[length - 1] = 0
    return code

cdef int _pointer_type(void* ctx, void* ptr, int* memory_type) noexcept nogil:
    # Since CUDA 11 an unregistered host pointer is success with type 0.
    cdef cudaPointerAttributes attributes
    cdef int code = cudaPointerGetAttributes(&attributes, ptr)
    memory_type[0] = attributes.type if code == 0 else 0
    return code

cdef int _device_malloc(void* ctx, void** ptr, size_t size) noexcept nogil:
    return cudaMalloc(ptr, size)

cdef int _device_free(void* ctx, void* ptr) noexcept nogil:
    return cudaFree(ptr)

cdef int _memcpy_async(void* ctx, void* dst, const void* src, size_t size,
                       int kind, void* stream) noexcept nogil:
    return cudaMemcpyAsync(dst, src, size, <cudaMemcpyKind>kind, <cudaStream_t>stream)

cdef int _stream_create(void* ctx, void** stream) noexcept nogil:
    # Non-blocking: loader copies must not serialise with the legacy stream.
    return cudaStreamCreateWithFlags(<cudaStream_t*>stream, cudaStreamNonBlocking)

cdef int _stream_destroy(void* ctx, void* stream) noexcept nogil:
    return cudaStreamDestroy(<cudaStream_t>stream)

cdef int _stream_synchronize(void* ctx, void* stream) noexcept nogil:
    return cudaStreamSynchronize(<cudaStream_t>stream)

cdef int _device_synchronize(void* ctx) noexcept nogil:
    return cudaDeviceSynchronize()

# No timing: recording a timed event costs more, and slots only need ordering.
cdef unsigned int _event_flags = cudaEventDisableTiming


def _set_event_blocking_sync(bint on):
    """benchmarks/profile_load.py: events made from now on put a waiting
    thread to sleep (cudaEventBlockingSync) instead of letting it spin."""
    global _event_flags
    _event_flags = cudaEventDisableTiming | (cudaEventBlockingSync if on else 0)


cdef int _event_create(void* ctx, void** event) noexcept nogil:
    return cudaEventCreateWithFlags(<cudaEvent_t*>event, _event_flags)

cdef int _event_destroy(void* ctx, void* event) noexcept nogil:
    return cudaEventDestroy(<cudaEvent_t>event)

cdef int _event_record(void* ctx, void* event, void* stream) noexcept nogil:
    return cudaEventRecord(<cudaEvent_t>event, <cudaStream_t>stream)

cdef int _event_synchronize(void* ctx, void* event) noexcept nogil:
    return cudaEventSynchronize(<cudaEvent_t>event)


cdef class CudaRuntime(Runtime):
    """The CUDA runtime this module was linked against, as a runtime table."""

    def __cinit__(self):
        _fill_table(&self.table, NULL)
        self.name = "cuda"


cdef CudaRuntime _RUNTIME = None


def runtime():
    """The process-wide CudaRuntime, created on first use.

    Creating it calls nothing in CUDA, so it works without a GPU or driver.
    """
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = CudaRuntime()
    return _RUNTIME


include "_fill.pxi"   # _fill_table: every entry from the adapters above
