# cython: language_level=3
"""The HIP (ROCm) runtime behind the runtime table (see ``_table.pxd``).

Each table entry is a small ``noexcept nogil`` adapter around one HIP
runtime call, returning the runtime's own ``hipError_t`` (HIP uses CUDA's
numbers for the codes the state machine cares about).  ``ctx`` is unused:
HIP keeps its state (current device, last error per thread) itself.

Compiled as C with ``-D__HIP_PLATFORM_AMD__`` against ``libamdhip64``.
Without a GPU the module still imports; Debian's HIP 5.2 then returns
101 ``hipErrorInvalidDevice`` from ``hipHostRegister`` and ``hipHostMalloc``.
"""

from instant_staging.runtime._table cimport Runtime

BACKEND = "rocm"


cdef extern from "hip/hip_runtime_api.h" nogil:
    ctypedef int hipError_t
    ctypedef void* hipStream_t
    ctypedef int hipMemcpyKind

    int HIP_VERSION
    unsigned int hipStreamNonBlocking

    hipError_t hipHostRegister(void* ptr, size_t size, unsigned int flags)
    hipError_t hipHostUnregister(void* ptr)
    hipError_t hipHostMalloc(void** ptr, size_t size, unsigned int flags)
    hipError_t hipHostFree(void* ptr)
    hipError_t hipGetLastError()
    hipError_t hipPeekAtLastError()
    const char* hipGetErrorName(hipError_t error)
    const char* hipGetErrorString(hipError_t error)
    hipError_t hipRuntimeGetVersion(int* version)
    hipError_t hipDriverGetVersion(int* version)
    hipError_t hipGetDeviceCount(int* count)
    hipError_t hipGetDevice(int* device)
    hipError_t hipSetDevice(int device)
    hipError_t hipDeviceGetName(char* name, int length, int device)
    hipError_t hipMalloc(void** ptr, size_t size)
    hipError_t hipFree(void* ptr)
    hipError_t hipMemcpyAsync(void* dst, const void* src, size_t count,
                              hipMemcpyKind kind, hipStream_t stream)
    hipError_t hipStreamCreateWithFlags(hipStream_t* stream, unsigned int flags)
    hipError_t hipStreamDestroy(hipStream_t stream)
    hipError_t hipStreamSynchronize(hipStream_t stream)
    hipError_t hipDeviceSynchronize()
    ctypedef void* hipEvent_t
    unsigned int hipEventDisableTiming
    hipError_t hipEventCreateWithFlags(hipEvent_t* event, unsigned int flags)
    hipError_t hipEventDestroy(hipEvent_t event)
    hipError_t hipEventRecord(hipEvent_t event, hipStream_t stream)
    hipError_t hipEventSynchronize(hipEvent_t event)


# hipPointerGetAttributes differs across HIP versions, so it is translated in
# C, where the preprocessor sees HIP_VERSION_MAJOR:
#  - HIP 6+: field `type`, numbered as CUDA's (0 unregistered, 1 host,
#    2 device, 3 managed) plus hipMemoryTypeArray 10 and Unified 11.
#  - HIP 5: field `memoryType`, numbered host 0, device 1, array 2, unified 3
#    (managed memory shows as `isManaged`), and a pointer HIP does not know
#    is hipErrorInvalidValue where CUDA reports success with type 0.
cdef extern from *:
    """
    static hipError_t ist_hip_pointer_type(const void *ptr, int *out)
    {
        hipPointerAttribute_t a;
        hipError_t e;
        memset(&a, 0, sizeof a);
        *out = 0;
        e = hipPointerGetAttributes(&a, ptr);
    #if HIP_VERSION_MAJOR >= 6
        if (e != hipSuccess)
            return e;
        switch (a.type) {
        case hipMemoryTypeHost: *out = 1; break;
        case hipMemoryTypeDevice: case hipMemoryTypeArray: *out = 2; break;
        case hipMemoryTypeManaged: case hipMemoryTypeUnified: *out = 3; break;
        default: *out = 0; break;
        }
    #else
        if (e == hipErrorInvalidValue && ptr != NULL) {
            /* Unknown to HIP 5: report it unregistered, as CUDA does, and
               clear the error it left so it cannot surface later. */
            (void)hipGetLastError();
            return hipSuccess;
        }
        if (e != hipSuccess)
            return e;
        if (a.isManaged) {
            *out = 3;
        } else {
            switch (a.memoryType) {
            case hipMemoryTypeHost: *out = 1; break;
            case hipMemoryTypeDevice: case hipMemoryTypeArray: *out = 2; break;
            case hipMemoryTypeUnified: *out = 3; break;
            default: *out = 0; break;
            }
        }
    #endif
        return e;
    }
    """
    hipError_t ist_hip_pointer_type(const void* ptr, int* out) nogil


# The HIP version of the headers this module was compiled against
# (major * 10000000 + minor * 100000 + patch).
HEADER_VERSION = HIP_VERSION


# -- adapters: exactly the typedef signatures of _table.pxd ----------------

cdef int _host_register(void* ctx, void* ptr, size_t size,
                        unsigned int flags) noexcept nogil:
    return hipHostRegister(ptr, size, flags)

cdef int _host_unregister(void* ctx, void* ptr) noexcept nogil:
    return hipHostUnregister(ptr)

cdef int _host_alloc(void* ctx, void** ptr, size_t size,
                     unsigned int flags) noexcept nogil:
    # hipHostMalloc flags 0/1/2/4 mean what cudaHostAlloc's do.
    return hipHostMalloc(ptr, size, flags)

cdef int _free_host(void* ctx, void* ptr) noexcept nogil:
    return hipHostFree(ptr)

cdef int _get_last_error(void* ctx) noexcept nogil:
    return hipGetLastError()

cdef int _peek_last_error(void* ctx) noexcept nogil:
    return hipPeekAtLastError()

cdef const char* _error_name(void* ctx, int code) noexcept nogil:
    return hipGetErrorName(<hipError_t>code)

cdef const char* _error_string(void* ctx, int code) noexcept nogil:
    return hipGetErrorString(<hipError_t>code)

cdef int _runtime_version(void* ctx, int* value) noexcept nogil:
    return hipRuntimeGetVersion(value)

cdef int _driver_version(void* ctx, int* value) noexcept nogil:
    return hipDriverGetVersion(value)

cdef int _device_count(void* ctx, int* value) noexcept nogil:
    return hipGetDeviceCount(value)

cdef int _get_device(void* ctx, int* value) noexcept nogil:
    return hipGetDevice(value)

cdef int _set_device(void* ctx, int value) noexcept nogil:
    return hipSetDevice(value)

cdef int _device_name(void* ctx, int device, char* name, size_t length) noexcept nogil:
    cdef int code
    if length == 0:
        return 1                                # hipErrorInvalidValue
    if length > 0x7fffffff:                     # hipDeviceGetName takes an int
        length = 0x7fffffff
    code = hipDeviceGetName(name, <int>length, device)
    name[length - 1] = 0
    return code

cdef int _pointer_type(void* ctx, void* ptr, int* memory_type) noexcept nogil:
    return ist_hip_pointer_type(ptr, memory_type)

cdef int _device_malloc(void* ctx, void** ptr, size_t size) noexcept nogil:
    return hipMalloc(ptr, size)

cdef int _device_free(void* ctx, void* ptr) noexcept nogil:
    return hipFree(ptr)

cdef int _memcpy_async(void* ctx, void* dst, const void* src, size_t size,
                       int kind, void* stream) noexcept nogil:
    return hipMemcpyAsync(dst, src, size, <hipMemcpyKind>kind, <hipStream_t>stream)

cdef int _stream_create(void* ctx, void** stream) noexcept nogil:
    # Non-blocking: loader copies must not serialise with the null stream.
    return hipStreamCreateWithFlags(<hipStream_t*>stream, hipStreamNonBlocking)

cdef int _stream_destroy(void* ctx, void* stream) noexcept nogil:
    return hipStreamDestroy(<hipStream_t>stream)

cdef int _stream_synchronize(void* ctx, void* stream) noexcept nogil:
    return hipStreamSynchronize(<hipStream_t>stream)

cdef int _device_synchronize(void* ctx) noexcept nogil:
    return hipDeviceSynchronize()

cdef int _event_create(void* ctx, void** event) noexcept nogil:
    # No timing: recording a timed event costs more, and slots only need ordering.
    return hipEventCreateWithFlags(<hipEvent_t*>event, hipEventDisableTiming)

cdef int _event_destroy(void* ctx, void* event) noexcept nogil:
    return hipEventDestroy(<hipEvent_t>event)

cdef int _event_record(void* ctx, void* event, void* stream) noexcept nogil:
    return hipEventRecord(<hipEvent_t>event, <hipStream_t>stream)

cdef int _event_synchronize(void* ctx, void* event) noexcept nogil:
    return hipEventSynchronize(<hipEvent_t>event)


cdef class HipRuntime(Runtime):
    """The HIP runtime this module was linked against, as a runtime table."""

    def __cinit__(self):
        _fill_table(&self.table, NULL)
        self.name = "rocm"


cdef HipRuntime _RUNTIME = None


def runtime():
    """The process-wide HipRuntime, created on first use.

    Creating it calls nothing in HIP, so it works without a GPU.
    """
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = HipRuntime()
    return _RUNTIME


include "_fill.pxi"   # _fill_table: every entry from the adapters above
