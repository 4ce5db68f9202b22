"""The runtime table: the one seam between the state machine and a GPU runtime.

Every runtime the package knows (CUDA, HIP, the simulated one, and any of
them wrapped in faults) fills one ``RuntimeTable``: a struct of ``nogil``
function pointers, each taking the runtime's own context first.  The state
machine in ``_staging.pyx`` calls nothing else, so the same compiled code
runs against all of them.  Codes are the runtime's own (CUDA and HIP agree
on the ones used here); 0 is success.
"""

# Error codes shared by the CUDA and HIP runtimes for the calls used here:
# the one table of them (ERROR_CODES in _table.pyx is its Python face,
# the fault grammar's error names).
cdef enum:
    SUCCESS = 0
    ERROR_INVALID_VALUE = 1
    ERROR_MEMORY_ALLOCATION = 2
    ERROR_RUNTIME_UNLOADING = 4        # cudaErrorCudartUnloading / hipErrorDeinitialized
    ERROR_INVALID_MEMCPY_DIRECTION = 21
    ERROR_NO_DEVICE = 100
    ERROR_INVALID_DEVICE = 101
    ERROR_INVALID_HANDLE = 400
    ERROR_ALREADY_REGISTERED = 712
    ERROR_NOT_REGISTERED = 713
    ERROR_NOT_SUPPORTED = 801
    ERROR_UNKNOWN = 999

# cudaMemcpyKind / hipMemcpyKind values (identical in both runtimes).
cdef enum:
    MEMCPY_HOST_TO_DEVICE = 1
    MEMCPY_DEVICE_TO_HOST = 2

# cudaMemoryType / hipMemoryType as reported by pointer_type():
# 0 unregistered, 1 host (pinned), 2 device, 3 managed.  HIP's own
# numbering differs; _hip.pyx translates it to these.
cdef enum:
    MEMORY_UNREGISTERED = 0
    MEMORY_HOST = 1
    MEMORY_DEVICE = 2
    MEMORY_MANAGED = 3

ctypedef int (*host_register_t)(void* ctx, void* ptr, size_t size,
                                unsigned int flags) noexcept nogil
ctypedef int (*host_ptr_t)(void* ctx, void* ptr) noexcept nogil
ctypedef int (*host_alloc_t)(void* ctx, void** ptr, size_t size,
                             unsigned int flags) noexcept nogil
ctypedef int (*status_t)(void* ctx) noexcept nogil
ctypedef const char* (*error_text_t)(void* ctx, int code) noexcept nogil
ctypedef int (*get_int_t)(void* ctx, int* value) noexcept nogil
ctypedef int (*set_int_t)(void* ctx, int value) noexcept nogil
ctypedef int (*pointer_type_t)(void* ctx, void* ptr, int* memory_type) noexcept nogil
ctypedef int (*device_name_t)(void* ctx, int device, char* name, size_t length) noexcept nogil
ctypedef int (*device_malloc_t)(void* ctx, void** ptr, size_t size) noexcept nogil
ctypedef int (*memcpy_t)(void* ctx, void* dst, const void* src, size_t size,
                         int kind, void* stream) noexcept nogil
ctypedef int (*stream_create_t)(void* ctx, void** stream) noexcept nogil
ctypedef int (*event_record_t)(void* ctx, void* event, void* stream) noexcept nogil


cdef struct RuntimeTable:
    void* ctx                         # passed back to every function
    # What the state machine uses.
    host_register_t host_register     # cudaHostRegister / hipHostRegister
    host_ptr_t host_unregister        # cudaHostUnregister / hipHostUnregister
    host_alloc_t host_alloc           # cudaHostAlloc / hipHostMalloc
    host_ptr_t free_host              # cudaFreeHost / hipHostFree
    status_t get_last_error           # returns and resets the pending error
    status_t peek_last_error          # returns it, leaves it pending
    error_text_t error_name           # "cudaErrorInvalidValue"
    error_text_t error_string         # "invalid argument"
    # What probes, tests and benchmarks use.
    get_int_t runtime_version
    get_int_t driver_version
    get_int_t device_count
    get_int_t get_device
    set_int_t set_device
    device_name_t device_name
    pointer_type_t pointer_type       # cudaPointerGetAttributes().type
    device_malloc_t device_malloc
    host_ptr_t device_free
    memcpy_t memcpy_async             # cudaMemcpyAsync on `stream`
    stream_create_t stream_create
    host_ptr_t stream_destroy
    host_ptr_t stream_synchronize
    status_t device_synchronize
    stream_create_t event_create      # cudaEventCreateWithFlags(disable timing)
    host_ptr_t event_destroy
    event_record_t event_record       # cudaEventRecord(event, stream)
    host_ptr_t event_synchronize


cdef class Runtime:
    """A runtime table with the Python object that owns its context."""
    cdef RuntimeTable table
    cdef readonly str name            # "cuda", "rocm", "simulated", ...
    cdef object _owner                # keeps whatever ctx points at alive
