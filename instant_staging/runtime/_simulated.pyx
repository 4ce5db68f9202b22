# cython: language_level=3
"""SimulatedRuntime: a host-only runtime table with the real driver's semantics.

What docs/design.md ("Measured") records on an H200 host, reproduced without a GPU so
that CI runs every success path of the state machine and the loader:

- ``host_register`` of NULL or of 0 bytes is 1 (invalid value); a range
  overlapping a registration (or a runtime allocation) is 712 (already
  registered).
- ``host_unregister`` of a registration's start succeeds, of an interior
  pointer is 1, of anything else 713 (not registered).
- ``host_alloc`` returns page-aligned real memory; ``free_host`` of a
  pointer it did not return is 1.
- ``memcpy_async`` copies synchronously, and a host range that overlaps a
  registration or runtime allocation without lying inside exactly one is
  1 and copies nothing (a copy spanning two segments fails on the driver).
  The device side is host memory; device ranges must lie in one allocation.
- Every failure leaves its code pending until ``get_last_error`` reads it
  (one pending error per runtime, not per thread).

Every table entry is a ``noexcept nogil`` adapter that takes the GIL for
the bookkeeping (Python dicts and lists), which also serialises threads;
only the copy itself runs without it.  Calls are logged for tests.  With
``faults=`` the table is wrapped by ``FaultyRuntime`` while the counters
and the log stay here.
"""

cimport cython
from libc.stdint cimport intptr_t, uintptr_t
from libc.stdlib cimport free
from libc.string cimport memcpy, strncpy
from posix.stdlib cimport posix_memalign
from posix.unistd cimport sysconf, _SC_PAGESIZE

import bisect
import collections

from instant_staging.runtime._table cimport (
    Runtime, ERROR_INVALID_VALUE, ERROR_MEMORY_ALLOCATION, ERROR_NO_DEVICE,
    ERROR_ALREADY_REGISTERED, ERROR_NOT_REGISTERED, ERROR_INVALID_MEMCPY_DIRECTION,
    ERROR_INVALID_DEVICE, ERROR_INVALID_HANDLE, MEMCPY_HOST_TO_DEVICE,
    MEMCPY_DEVICE_TO_HOST, MEMORY_UNREGISTERED, MEMORY_HOST, MEMORY_DEVICE)
from instant_staging.runtime._faults cimport FaultyRuntime, internal_error
from instant_staging._build_config import BACKEND
from instant_staging.faults import as_plan

DEVICE_NAME = "SimulatedRuntime device"

# (name, string) as cudaGetErrorName / cudaGetErrorString give them.
_CUDA_ERRORS = {
    0: ("cudaSuccess", "no error"),
    1: ("cudaErrorInvalidValue", "invalid argument"),
    2: ("cudaErrorMemoryAllocation", "out of memory"),
    21: ("cudaErrorInvalidMemcpyDirection", "invalid copy direction for memcpy"),
    35: ("cudaErrorInsufficientDriver",
         "CUDA driver version is insufficient for CUDA runtime version"),
    100: ("cudaErrorNoDevice", "no CUDA-capable device is detected"),
    101: ("cudaErrorInvalidDevice", "invalid device ordinal"),
    400: ("cudaErrorInvalidResourceHandle", "invalid resource handle"),
    712: ("cudaErrorHostMemoryAlreadyRegistered",
          "part or all of the requested memory range is already mapped"),
    713: ("cudaErrorHostMemoryNotRegistered",
          "pointer does not correspond to a registered memory region"),
    801: ("cudaErrorNotSupported", "operation not supported"),
    999: ("cudaErrorUnknown", "unknown error"),
}

# The same for hipGetErrorName / hipGetErrorString.
_HIP_ERRORS = {
    0: ("hipSuccess", "no error"),
    1: ("hipErrorInvalidValue", "invalid argument"),
    2: ("hipErrorOutOfMemory", "out of memory"),
    21: ("hipErrorInvalidMemcpyDirection", "invalid copy direction for memcpy"),
    35: ("hipErrorInsufficientDriver",
         "driver version is insufficient for runtime version"),
    100: ("hipErrorNoDevice", "no ROCm-capable device is detected"),
    101: ("hipErrorInvalidDevice", "invalid device ordinal"),
    400: ("hipErrorInvalidHandle", "invalid resource handle"),
    712: ("hipErrorHostMemoryAlreadyRegistered",
          "part or all of the requested memory range is already mapped"),
    713: ("hipErrorHostMemoryNotRegistered",
          "pointer does not correspond to a registered memory region"),
    801: ("hipErrorNotSupported", "operation not supported"),
    999: ("hipErrorUnknown", "unknown error"),
}

# Versions as the runtime reports them: CUDA 13.0; HIP 5.2.3 (HIP_VERSION).
_VERSIONS = {"cuda": 13000, "rocm": 50200003}

# error_name/error_string hand out char pointers: the bytes behind them live
# here for the life of the process, like the driver's static strings.
_TEXT_CACHE = {}

cdef intptr_t _STREAM_BASE = 0x5157000   # dummy stream handles start here


def error_text(str backend, int code):
    """``(name, string)`` of ``code`` as the ``backend`` runtime words it."""
    table = _HIP_ERRORS if backend == "rocm" else _CUDA_ERRORS
    if code in table:
        return table[code]
    if backend == "rocm":
        return (f"hipErrorUnknown({code})", "unknown error")
    return (f"cudaErrorUnknown({code})", "unrecognized error code")


cdef object _range_containing(list starts, dict sizes, intptr_t ptr):
    # The start of the range of (disjoint, sorted) `starts` holding ptr, or None.
    cdef Py_ssize_t i = bisect.bisect_right(starts, ptr) - 1
    if i >= 0:
        start = starts[i]
        if ptr < start + sizes[start]:
            return start
    return None


cdef bint _range_overlaps(list starts, dict sizes, intptr_t ptr, size_t size):
    # Whether [ptr, ptr + size) meets any range; size > 0.  The ranges are
    # disjoint, so only the last one starting before the end can reach in.
    end = ptr + size
    cdef Py_ssize_t i = bisect.bisect_left(starts, end) - 1
    if i >= 0:
        start = starts[i]
        return start + sizes[start] > ptr
    return False


cdef void _add_range(list starts, dict sizes, intptr_t ptr, size_t size):
    sizes[ptr] = size
    bisect.insort(starts, ptr)


cdef void _remove_range(list starts, dict sizes, intptr_t ptr):
    del sizes[ptr]
    del starts[bisect.bisect_left(starts, ptr)]


@cython.no_gc_clear  # __dealloc__ needs the allocation dicts to free them
cdef class SimulatedRuntime(Runtime):
    """SimulatedRuntime(faults=None, *, device_count=1, log_limit=10000,
                     backend=None)
--

    A runtime without a GPU, behaving like the CUDA driver measured in
    docs/design.md (see the module docstring).

    Leftover allocations are freed when the runtime is collected.

    Args:
        faults: None (the default), or a spec string or ``FaultPlan`` that
            wraps its own table in ``FaultyRuntime``: calls the plan fails
            never reach the simulation, so they are neither counted nor
            logged here.
        device_count: devices, in [0, 1024]; default 1.  0 plays a host
            without a device: device calls fail with no_device (100), host
            calls still work.
        log_limit: bounds ``calls`` (None: unbounded, 0: no log); default
            10000.
        backend: "cuda" or "rocm": picks the error names; None (the
            default): those of the built backend.

    Raises:
        TypeError, ValueError: an argument of the wrong type or out of
            range; a malformed fault spec (ValueError naming the bad rule).
    """

    cdef dict _regs               # registration start -> size
    cdef list _reg_starts         # sorted starts of _regs
    cdef dict _hallocs            # host_alloc pointer -> size
    cdef list _halloc_starts
    cdef dict _dallocs            # device_malloc pointer -> size
    cdef list _dalloc_starts
    cdef set _streams
    cdef set _events
    cdef intptr_t _next_stream
    cdef int _pending             # the last error, 0 once read
    cdef int _device_count
    cdef int _device
    cdef readonly str backend     # whose error names: "cuda" or "rocm"
    cdef object _log
    cdef FaultyRuntime _faulty    # the wrapper our table came from, if faults
    cdef size_t _page

    def __cinit__(self, *args, **kwargs):
        # Here rather than in __init__ so that __dealloc__ always finds them.
        self._regs = {}
        self._reg_starts = []
        self._hallocs = {}
        self._halloc_starts = []
        self._dallocs = {}
        self._dalloc_starts = []
        self._streams = set()
        self._events = set()
        self._next_stream = _STREAM_BASE
        self._pending = 0
        self._device = 0
        self._page = <size_t>sysconf(_SC_PAGESIZE)

    def __init__(self, faults=None, *, device_count=1, log_limit=10000, backend=None):
        if isinstance(device_count, bool) or not isinstance(device_count, int):
            raise TypeError(f"device_count must be an int, not {type(device_count).__name__}")
        if not 0 <= device_count <= 1024:
            raise ValueError(f"device_count must be in [0, 1024], got {device_count}")
        if log_limit is not None:
            if isinstance(log_limit, bool) or not isinstance(log_limit, int):
                raise TypeError(f"log_limit must be an int or None, not {type(log_limit).__name__}")
            if log_limit < 0:
                raise ValueError(f"log_limit must be >= 0 or None, got {log_limit}")
        if backend is None:
            backend = BACKEND     # this build's: its error names by default
        elif backend not in ("cuda", "rocm"):
            raise ValueError(f"backend must be 'cuda' or 'rocm', got {backend!r}")
        self._device_count = device_count
        self.backend = backend
        self._log = collections.deque(maxlen=log_limit)
        self.name = "simulated"
        self._owner = None

        _fill_table(&self.table, <void*>self)  # borrowed: the table lives inside self

        self._faulty = None
        cdef FaultyRuntime wrapper
        if faults is not None and not (isinstance(faults, str) and not faults.strip()):
            # Present the wrapper's table as ours, so that whoever is handed
            # this runtime sees the faults; the wrapper borrows self (we own
            # it through _owner), so there is no reference cycle.
            wrapper = FaultyRuntime.__new__(FaultyRuntime)
            wrapper._setup(self, as_plan(faults), False)
            self._faulty = wrapper
            self._owner = wrapper
            self.table = wrapper.table
            self.name = wrapper.name

    def __dealloc__(self):
        # A test that leaks is the test's problem: free what is left, quietly.
        cdef intptr_t p
        for allocs in (self._hallocs, self._dallocs):
            if allocs:
                for key in allocs:
                    p = key
                    free(<void*>p)
                allocs.clear()

    # -- what tests assert on ------------------------------------------------

    @property
    def plan(self):
        """The FaultPlan given as ``faults``, or None."""
        return self._faulty.plan if self._faulty is not None else None

    @property
    def live_registrations(self):
        return len(self._regs)

    @property
    def live_host_allocs(self):
        return len(self._hallocs)

    @property
    def live_device_allocs(self):
        return len(self._dallocs)

    def registered_ranges(self):
        """Live registrations as a sorted list of ``(ptr, size)``."""
        return [(p, self._regs[p]) for p in self._reg_starts]

    def host_allocations(self):
        """Live ``host_alloc`` allocations as a sorted list of ``(ptr, size)``."""
        return [(p, self._hallocs[p]) for p in self._halloc_starts]

    def device_allocations(self):
        """Live ``device_malloc`` allocations as a sorted list of ``(ptr, size)``."""
        return [(p, self._dallocs[p]) for p in self._dalloc_starts]

    @property
    def pending_error(self):
        """The error ``get_last_error`` would return (an injected one first); not reset."""
        if self._faulty is not None:
            injected = self._faulty._peek_pending()
            if injected:
                return injected
        return self._pending

    @property
    def calls(self):
        """The logged calls, oldest first: ``(op, *args, code)`` tuples.

        Calls that return a pointer log it before the code:
        ``("host_alloc", size, flags, ptr, code)``,
        ``("device_malloc", size, ptr, code)``, ``("stream_create", stream, code)``.
        Queries log ``(op, *args, value, code)``.  error_name/error_string
        are not logged.
        """
        return list(self._log)

    def clear_log(self):
        self._log.clear()

    def covers(self, intptr_t ptr, Py_ssize_t size):
        """Whether registrations tile ``[ptr, ptr + size)`` exactly: the first
        starts at ``ptr``, each next where the previous ends, the last ends
        at ``ptr + size``."""
        if size <= 0:
            return False
        end = ptr + size
        pos = ptr
        while pos < end:
            length = self._regs.get(pos)
            if length is None:
                return False
            pos += length
        return pos == end

    # -- the simulation, called by the adapters with the GIL held ---------

    cdef inline int _fail(self, int code):
        # Every failure becomes the pending error, as on the driver.
        if code != 0:
            self._pending = code
        return code

    cdef inline void _record(self, tuple entry):
        self._log.append(entry)

    cdef int _host_register(self, intptr_t ptr, size_t size, unsigned int flags) except -1:
        cdef int code = 0
        if ptr == 0 or size == 0 or <uintptr_t>ptr + size < <uintptr_t>ptr:
            code = ERROR_INVALID_VALUE
        elif (_range_overlaps(self._reg_starts, self._regs, ptr, size)
              or _range_overlaps(self._halloc_starts, self._hallocs, ptr, size)):
            code = ERROR_ALREADY_REGISTERED
        else:
            _add_range(self._reg_starts, self._regs, ptr, size)
        self._record(("host_register", ptr, size, flags, code))
        return self._fail(code)

    cdef int _host_unregister(self, intptr_t ptr) except -1:
        cdef int code = 0
        if ptr in self._regs:
            _remove_range(self._reg_starts, self._regs, ptr)
        elif _range_containing(self._reg_starts, self._regs, ptr) is not None:
            code = ERROR_INVALID_VALUE  # interior pointer: measured, not 713
        else:
            code = ERROR_NOT_REGISTERED
        self._record(("host_unregister", ptr, code))
        return self._fail(code)

    cdef int _host_alloc(self, void** out, size_t size, unsigned int flags) except -1:
        cdef int code = 0
        cdef void* p = NULL
        if size != 0:  # 0 bytes: success and NULL, as cudaHostAlloc
            if posix_memalign(&p, self._page, size) != 0:
                p = NULL
                code = ERROR_MEMORY_ALLOCATION
            else:
                _add_range(self._halloc_starts, self._hallocs, <intptr_t>p, size)
        out[0] = p
        self._record(("host_alloc", size, flags, <intptr_t>p, code))
        return self._fail(code)

    cdef int _free_host(self, intptr_t ptr) except -1:
        cdef int code = 0
        if ptr in self._hallocs:
            _remove_range(self._halloc_starts, self._hallocs, ptr)
            free(<void*>ptr)
        elif ptr != 0:  # NULL: nothing to do, as free()
            code = ERROR_INVALID_VALUE
        self._record(("free_host", ptr, code))
        return self._fail(code)

    cdef int _get_last_error(self) except -1:
        cdef int code = self._pending
        self._pending = 0
        self._record(("get_last_error", code))
        return code

    cdef int _peek_last_error(self) except -1:
        self._record(("peek_last_error", self._pending))
        return self._pending

    cdef const char* _text(self, int code, int which) except NULL:
        key = (self.backend, code, which)
        text = _TEXT_CACHE.get(key)
        if text is None:
            text = _TEXT_CACHE[key] = error_text(self.backend, code)[which].encode()
        return <const char*>text

    cdef int _get_int(self, str op, int* value) except -1:
        cdef int code = 0
        if op == "device_count":
            value[0] = self._device_count
            if self._device_count == 0:
                code = ERROR_NO_DEVICE
        elif op == "get_device":
            if self._device_count == 0:
                code = ERROR_NO_DEVICE
            else:
                value[0] = self._device
        else:  # runtime_version, driver_version
            value[0] = _VERSIONS[self.backend]
        self._record((op, value[0], code))
        return self._fail(code)

    cdef int _check_device(self, int device) except -1:
        if self._device_count == 0:
            return ERROR_NO_DEVICE
        if device < 0 or device >= self._device_count:
            return ERROR_INVALID_DEVICE
        return 0

    cdef int _set_device(self, int device) except -1:
        cdef int code = self._check_device(device)
        if code == 0:
            self._device = device
        self._record(("set_device", device, code))
        return self._fail(code)

    cdef int _device_name(self, int device, char* name, size_t length) except -1:
        cdef int code = self._check_device(device)
        cdef bytes text = DEVICE_NAME.encode()
        if code == 0 and length > 0:
            strncpy(name, text, length - 1)
            name[length - 1] = 0
        self._record(("device_name", device, DEVICE_NAME if code == 0 else "", code))
        return self._fail(code)

    cdef int _pointer_type(self, intptr_t ptr, int* memory_type) except -1:
        if (_range_containing(self._reg_starts, self._regs, ptr) is not None
                or _range_containing(self._halloc_starts, self._hallocs, ptr) is not None):
            memory_type[0] = MEMORY_HOST
        elif _range_containing(self._dalloc_starts, self._dallocs, ptr) is not None:
            memory_type[0] = MEMORY_DEVICE
        else:
            memory_type[0] = MEMORY_UNREGISTERED
        self._record(("pointer_type", ptr, memory_type[0], 0))
        return 0

    cdef int _device_malloc(self, void** out, size_t size) except -1:
        cdef int code = 0
        cdef void* p = NULL
        if self._device_count == 0:
            code = ERROR_NO_DEVICE
        elif size != 0:  # 0 bytes: success and NULL, as cudaMalloc
            if posix_memalign(&p, self._page, size) != 0:
                p = NULL
                code = ERROR_MEMORY_ALLOCATION
            else:
                _add_range(self._dalloc_starts, self._dallocs, <intptr_t>p, size)
        out[0] = p
        self._record(("device_malloc", size, <intptr_t>p, code))
        return self._fail(code)

    cdef int _device_free(self, intptr_t ptr) except -1:
        cdef int code = 0
        if ptr in self._dallocs:
            _remove_range(self._dalloc_starts, self._dallocs, ptr)
            free(<void*>ptr)
        elif ptr != 0:  # cudaFree(NULL) does nothing
            code = ERROR_INVALID_VALUE
        self._record(("device_free", ptr, code))
        return self._fail(code)

    cdef int _check_host_range(self, intptr_t ptr, size_t size) except -1:
        # Pageable memory (no registration or allocation met) copies fine;
        # otherwise the range must lie inside exactly one of them.
        start = _range_containing(self._reg_starts, self._regs, ptr)
        if start is not None:
            return 0 if ptr + size <= start + self._regs[start] else ERROR_INVALID_VALUE
        start = _range_containing(self._halloc_starts, self._hallocs, ptr)
        if start is not None:
            return 0 if ptr + size <= start + self._hallocs[start] else ERROR_INVALID_VALUE
        if (_range_overlaps(self._reg_starts, self._regs, ptr, size)
                or _range_overlaps(self._halloc_starts, self._hallocs, ptr, size)):
            return ERROR_INVALID_VALUE  # starts pageable, runs into pinned memory
        return 0

    cdef int _check_copy(self, intptr_t dst, intptr_t src, size_t size, int kind,
                         intptr_t stream) except -1:
        """The code of a copy; 0 means the adapter may copy."""
        cdef int code = 0
        cdef intptr_t host = 0, device = 0
        if self._device_count == 0:
            code = ERROR_NO_DEVICE
        elif kind == MEMCPY_HOST_TO_DEVICE:
            host, device = src, dst
        elif kind == MEMCPY_DEVICE_TO_HOST:
            host, device = dst, src
        else:
            code = ERROR_INVALID_MEMCPY_DIRECTION
        if code == 0 and stream != 0 and stream not in self._streams:
            code = ERROR_INVALID_HANDLE
        if code == 0 and size != 0:
            if (host == 0 or device == 0
                    or <uintptr_t>host + size < <uintptr_t>host
                    or <uintptr_t>device + size < <uintptr_t>device):
                code = ERROR_INVALID_VALUE
            else:
                code = self._check_host_range(host, size)
            if code == 0:
                start = _range_containing(self._dalloc_starts, self._dallocs, device)
                if start is None or device + size > start + self._dallocs[start]:
                    code = ERROR_INVALID_VALUE
        self._record(("memcpy_async", dst, src, size, kind, stream, code))
        return self._fail(code)

    cdef int _stream_create(self, void** out) except -1:
        cdef int code = 0
        out[0] = NULL
        if self._device_count == 0:
            code = ERROR_NO_DEVICE
        else:
            self._next_stream += 0x10
            self._streams.add(self._next_stream)
            out[0] = <void*>self._next_stream
        self._record(("stream_create", <intptr_t>out[0], code))
        return self._fail(code)

    cdef int _stream_op(self, str op, intptr_t stream) except -1:
        cdef int code = 0
        if op == "stream_destroy":
            if stream in self._streams:
                self._streams.discard(stream)
            else:
                code = ERROR_INVALID_HANDLE
        elif stream != 0 and stream not in self._streams:  # 0: the default stream
            code = ERROR_INVALID_HANDLE
        self._record((op, stream, code))
        return self._fail(code)

    cdef int _event_create(self, void** out) except -1:
        # Copies here are synchronous, so an event only has to exist.
        cdef int code = 0
        out[0] = NULL
        if self._device_count == 0:
            code = ERROR_NO_DEVICE
        else:
            self._next_stream += 0x10
            self._events.add(self._next_stream)
            out[0] = <void*>self._next_stream
        self._record(("event_create", <intptr_t>out[0], code))
        return self._fail(code)

    cdef int _event_op(self, str op, intptr_t event, intptr_t stream) except -1:
        cdef int code = 0
        if event not in self._events:
            code = ERROR_INVALID_HANDLE
        elif op == "event_destroy":
            self._events.discard(event)
        elif op == "event_record" and stream != 0 and stream not in self._streams:
            code = ERROR_INVALID_HANDLE
        self._record((op, event, code))
        return self._fail(code)

    cdef int _device_synchronize(self) except -1:
        cdef int code = ERROR_NO_DEVICE if self._device_count == 0 else 0
        self._record(("device_synchronize", code))
        return self._fail(code)


# -- the table's entries ------------------------------------------------------
# Each takes the GIL for the bookkeeping.  An exception there (MemoryError)
# is a bug of the simulation, reported as unknown error (999), never as success.

cdef int _host_register(void* ctx, void* ptr, size_t size,
                        unsigned int flags) noexcept nogil:
    with gil:
        try:
            return (<SimulatedRuntime>ctx)._host_register(<intptr_t>ptr, size, flags)
        except BaseException:
            return internal_error("SimulatedRuntime.host_register")


cdef int _host_unregister(void* ctx, void* ptr) noexcept nogil:
    with gil:
        try:
            return (<SimulatedRuntime>ctx)._host_unregister(<intptr_t>ptr)
        except BaseException:
            return internal_error("SimulatedRuntime.host_unregister")


cdef int _host_alloc(void* ctx, void** ptr, size_t size, unsigned int flags) noexcept nogil:
    with gil:
        try:
            return (<SimulatedRuntime>ctx)._host_alloc(ptr, size, flags)
        except BaseException:
            return internal_error("SimulatedRuntime.host_alloc")


cdef int _free_host(void* ctx, void* ptr) noexcept nogil:
    with gil:
        try:
            return (<SimulatedRuntime>ctx)._free_host(<intptr_t>ptr)
        except BaseException:
            return internal_error("SimulatedRuntime.free_host")


cdef int _get_last_error(void* ctx) noexcept nogil:
    with gil:
        try:
            return (<SimulatedRuntime>ctx)._get_last_error()
        except BaseException:
            return internal_error("SimulatedRuntime.get_last_error")


cdef int _peek_last_error(void* ctx) noexcept nogil:
    with gil:
        try:
            return (<SimulatedRuntime>ctx)._peek_last_error()
        except BaseException:
            return internal_error("SimulatedRuntime.peek_last_error")


cdef const char* _error_name(void* ctx, int code) noexcept nogil:
    with gil:
        try:
            return (<SimulatedRuntime>ctx)._text(code, 0)
        except BaseException:
            internal_error("SimulatedRuntime.error_name")
            return NULL


cdef const char* _error_string(void* ctx, int code) noexcept nogil:
    with gil:
        try:
            return (<SimulatedRuntime>ctx)._text(code, 1)
        except BaseException:
            internal_error("SimulatedRuntime.error_string")
            return NULL


cdef int _runtime_version(void* ctx, int* value) noexcept nogil:
    with gil:
        try:
            return (<SimulatedRuntime>ctx)._get_int("runtime_version", value)
        except BaseException:
            return internal_error("SimulatedRuntime.runtime_version")


cdef int _driver_version(void* ctx, int* value) noexcept nogil:
    with gil:
        try:
            return (<SimulatedRuntime>ctx)._get_int("driver_version", value)
        except BaseException:
            return internal_error("SimulatedRuntime.driver_version")


cdef int _device_count(void* ctx, int* value) noexcept nogil:
    with gil:
        try:
            return (<SimulatedRuntime>ctx)._get_int("device_count", value)
        except BaseException:
            return internal_error("SimulatedRuntime.device_count")


cdef int _get_device(void* ctx, int* value) noexcept nogil:
    with gil:
        try:
            return (<SimulatedRuntime>ctx)._get_int("get_device", value)
        except BaseException:
            return internal_error("SimulatedRuntime.get_device")


cdef int _set_device(void* ctx, int device) noexcept nogil:
    with gil:
        try:
            return (<SimulatedRuntime>ctx)._set_device(device)
        except BaseException:
            return internal_error("SimulatedRuntime.set_device")


cdef int _device_name(void* ctx, int device, char* name, size_t length) noexcept nogil:
    with gil:
        try:
            return (<SimulatedRuntime>ctx)._device_name(device, name, length)
        except BaseException:
            return internal_error("SimulatedRuntime.device_name")


cdef int _pointer_type(void* ctx, void* ptr, int* memory_type) noexcept nogil:
    with gil:
        try:
            return (<SimulatedRuntime>ctx)._pointer_type(<intptr_t>ptr, memory_type)
        except BaseException:
            return internal_error("SimulatedRuntime.pointer_type")


cdef int _device_malloc(void* ctx, void** ptr, size_t size) noexcept nogil:
    with gil:
        try:
            return (<SimulatedRuntime>ctx)._device_malloc(ptr, size)
        except BaseException:
            return internal_error("SimulatedRuntime.device_malloc")


cdef int _device_free(void* ctx, void* ptr) noexcept nogil:
    with gil:
        try:
            return (<SimulatedRuntime>ctx)._device_free(<intptr_t>ptr)
        except BaseException:
            return internal_error("SimulatedRuntime.device_free")


cdef int _memcpy_async(void* ctx, void* dst, const void* src, size_t size,
                       int kind, void* stream) noexcept nogil:
    cdef int code
    with gil:
        try:
            code = (<SimulatedRuntime>ctx)._check_copy(<intptr_t>dst, <intptr_t>src,
                                                       size, kind, <intptr_t>stream)
        except BaseException:
            return internal_error("SimulatedRuntime.memcpy_async")
    # Synchronous, outside the GIL so that loader threads copy in parallel.
    if code == 0 and size != 0:
        memcpy(dst, src, size)
    return code


cdef int _stream_create(void* ctx, void** stream) noexcept nogil:
    with gil:
        try:
            return (<SimulatedRuntime>ctx)._stream_create(stream)
        except BaseException:
            return internal_error("SimulatedRuntime.stream_create")


cdef int _stream_destroy(void* ctx, void* stream) noexcept nogil:
    with gil:
        try:
            return (<SimulatedRuntime>ctx)._stream_op("stream_destroy", <intptr_t>stream)
        except BaseException:
            return internal_error("SimulatedRuntime.stream_destroy")


cdef int _stream_synchronize(void* ctx, void* stream) noexcept nogil:
    with gil:
        try:
            return (<SimulatedRuntime>ctx)._stream_op("stream_synchronize", <intptr_t>stream)
        except BaseException:
            return internal_error("SimulatedRuntime.stream_synchronize")


cdef int _device_synchronize(void* ctx) noexcept nogil:
    with gil:
        try:
            return (<SimulatedRuntime>ctx)._device_synchronize()
        except BaseException:
            return internal_error("SimulatedRuntime.device_synchronize")


cdef int _event_create(void* ctx, void** event) noexcept nogil:
    with gil:
        try:
            return (<SimulatedRuntime>ctx)._event_create(event)
        except BaseException:
            return internal_error("SimulatedRuntime.event_create")


cdef int _event_destroy(void* ctx, void* event) noexcept nogil:
    with gil:
        try:
            return (<SimulatedRuntime>ctx)._event_op("event_destroy", <intptr_t>event, 0)
        except BaseException:
            return internal_error("SimulatedRuntime.event_destroy")


cdef int _event_record(void* ctx, void* event, void* stream) noexcept nogil:
    with gil:
        try:
            return (<SimulatedRuntime>ctx)._event_op("event_record", <intptr_t>event,
                                                     <intptr_t>stream)
        except BaseException:
            return internal_error("SimulatedRuntime.event_record")


cdef int _event_synchronize(void* ctx, void* event) noexcept nogil:
    with gil:
        try:
            return (<SimulatedRuntime>ctx)._event_op("event_synchronize", <intptr_t>event, 0)
        except BaseException:
            return internal_error("SimulatedRuntime.event_synchronize")


include "_fill.pxi"   # _fill_table: every entry from the adapters above
