# cython: language_level=3
"""Python face of the runtime table (see ``_table.pxd``).

``Runtime`` holds one filled ``RuntimeTable``.  Its methods are thin
wrappers, one per table entry, that release the GIL around the call and
return the runtime's own status code (0 is success), with any output as
a second value.  Pointers cross into Python as integers, as in CuPy's
``cupy_backends.cuda.api.runtime``.  The wrappers do not raise on a failed
call; ``check`` is the one idiom that does (CuPy's ``check_status``): it
clears the pending error on this same runtime and raises RuntimeCallError.
"""

from libc.stdint cimport intptr_t

from instant_staging._types import RuntimeCallError

# The error names of the fault grammar and their codes (_table.pxd's enum).
ERROR_CODES = {
    "invalid_value": ERROR_INVALID_VALUE,
    "memory_allocation": ERROR_MEMORY_ALLOCATION,
    "no_device": ERROR_NO_DEVICE,
    "already_registered": ERROR_ALREADY_REGISTERED,
    "not_registered": ERROR_NOT_REGISTERED,
    "not_supported": ERROR_NOT_SUPPORTED,
}

cdef unsigned long _HEAPTYPE = 1 << 9      # Py_TPFLAGS_HEAPTYPE: a class made in Python


cdef class Runtime:
    """A GPU runtime reached through a table of nogil function pointers.

    Instances come from ``instant_staging.runtime.real_runtime()``,
    ``instant_staging.testing.SimulatedRuntime`` or
    ``instant_staging.testing.inject_faults``; this base class is never
    filled by itself.
    """

    def __cinit__(self, *args, **kwargs):
        # Only an extension type below this one fills the table; calling an
        # empty table would jump to NULL.
        for cls in type(self).__mro__:
            if not (cls.__flags__ & _HEAPTYPE):
                break
        if cls is Runtime:
            raise TypeError("Runtime cannot be instantiated (its table is empty): use "
                            "instant_staging.real_runtime(), testing.SimulatedRuntime "
                            "or testing.inject_faults")

    def __repr__(self):
        return f"<{type(self).__name__} {self.name!r}>"

    def check(self, int code, value=None, call="runtime call"):
        """``value`` when ``code`` is 0; otherwise clears the pending error
        (same runtime, same thread) and raises RuntimeCallError naming
        ``call``.  ``rt.check(*rt.device_count(), call="device_count")``."""
        if code == 0:
            return value
        with nogil:
            self.table.get_last_error(self.table.ctx)
        raise RuntimeCallError(call, code, self.error_name(code))

    # -- what the state machine uses -------------------------------------

    def host_register(self, intptr_t ptr, size_t size, unsigned int flags=0):
        cdef int code
        with nogil:
            code = self.table.host_register(self.table.ctx, <void*>ptr, size, flags)
        return code

    def host_unregister(self, intptr_t ptr):
        cdef int code
        with nogil:
            code = self.table.host_unregister(self.table.ctx, <void*>ptr)
        return code

    def host_alloc(self, size_t size, unsigned int flags=0):
        """Returns ``(code, ptr)``; ptr is 0 on failure."""
        cdef int code
        cdef void* ptr = NULL
        with nogil:
            code = self.table.host_alloc(self.table.ctx, &ptr, size, flags)
        return code, (<intptr_t>ptr if code == 0 else 0)

    def free_host(self, intptr_t ptr):
        cdef int code
        with nogil:
            code = self.table.free_host(self.table.ctx, <void*>ptr)
        return code

    def get_last_error(self):
        cdef int code
        with nogil:
            code = self.table.get_last_error(self.table.ctx)
        return code

    def peek_last_error(self):
        cdef int code
        with nogil:
            code = self.table.peek_last_error(self.table.ctx)
        return code

    def error_name(self, int code):
        cdef const char* text
        with nogil:
            text = self.table.error_name(self.table.ctx, code)
        return _text(text, code)

    def error_string(self, int code):
        cdef const char* text
        with nogil:
            text = self.table.error_string(self.table.ctx, code)
        return _text(text, code)

    # -- what probes, tests and benchmarks use ---------------------------

    def runtime_version(self):
        return _get_int(self.table.runtime_version, self.table.ctx)

    def driver_version(self):
        return _get_int(self.table.driver_version, self.table.ctx)

    def device_count(self):
        return _get_int(self.table.device_count, self.table.ctx)

    def get_device(self):
        return _get_int(self.table.get_device, self.table.ctx)

    def set_device(self, int device):
        cdef int code
        with nogil:
            code = self.table.set_device(self.table.ctx, device)
        return code

    def device_name(self, int device):
        """Returns ``(code, name)``."""
        cdef char buf[256]
        cdef int code
        buf[0] = 0
        with nogil:
            code = self.table.device_name(self.table.ctx, device, buf, sizeof(buf))
        buf[255] = 0
        return code, (buf.decode("utf-8", "replace") if code == 0 else "")

    def pointer_type(self, intptr_t ptr):
        """Returns ``(code, memory_type)``: 0 unregistered, 1 host, 2 device, 3 managed."""
        return _get_int_at(self.table.pointer_type, self.table.ctx, <void*>ptr)

    def device_malloc(self, size_t size):
        """Returns ``(code, ptr)``."""
        cdef int code
        cdef void* ptr = NULL
        with nogil:
            code = self.table.device_malloc(self.table.ctx, &ptr, size)
        return code, (<intptr_t>ptr if code == 0 else 0)

    def device_free(self, intptr_t ptr):
        cdef int code
        with nogil:
            code = self.table.device_free(self.table.ctx, <void*>ptr)
        return code

    def memcpy_async(self, intptr_t dst, intptr_t src, size_t size, int kind,
                     intptr_t stream=0):
        """``kind`` 1 host to device, 2 device to host."""
        cdef int code
        with nogil:
            code = self.table.memcpy_async(self.table.ctx, <void*>dst,
                                           <const void*>src, size, kind,
                                           <void*>stream)
        return code

    def stream_create(self):
        """Returns ``(code, stream)``."""
        cdef int code
        cdef void* stream = NULL
        with nogil:
            code = self.table.stream_create(self.table.ctx, &stream)
        return code, (<intptr_t>stream if code == 0 else 0)

    def stream_destroy(self, intptr_t stream):
        cdef int code
        with nogil:
            code = self.table.stream_destroy(self.table.ctx, <void*>stream)
        return code

    def stream_synchronize(self, intptr_t stream):
        cdef int code
        with nogil:
            code = self.table.stream_synchronize(self.table.ctx, <void*>stream)
        return code

    def device_synchronize(self):
        cdef int code
        with nogil:
            code = self.table.device_synchronize(self.table.ctx)
        return code

    def event_create(self):
        """Returns ``(code, event)``; the event records no timing."""
        cdef int code
        cdef void* event = NULL
        with nogil:
            code = self.table.event_create(self.table.ctx, &event)
        return code, (<intptr_t>event if code == 0 else 0)

    def event_destroy(self, intptr_t event):
        cdef int code
        with nogil:
            code = self.table.event_destroy(self.table.ctx, <void*>event)
        return code

    def event_record(self, intptr_t event, intptr_t stream=0):
        cdef int code
        with nogil:
            code = self.table.event_record(self.table.ctx, <void*>event, <void*>stream)
        return code

    def event_synchronize(self, intptr_t event):
        cdef int code
        with nogil:
            code = self.table.event_synchronize(self.table.ctx, <void*>event)
        return code


cdef object _text(const char* text, int code):
    if text == NULL:
        return f"error {code}"
    return text.decode("utf-8", "replace")


cdef object _get_int(get_int_t fn, void* ctx):
    cdef int code
    cdef int value = 0
    with nogil:
        code = fn(ctx, &value)
    return code, value


cdef object _get_int_at(pointer_type_t fn, void* ctx, void* ptr):
    cdef int code
    cdef int value = 0
    with nogil:
        code = fn(ctx, ptr, &value)
    return code, value
