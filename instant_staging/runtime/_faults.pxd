"""FaultyRuntime: a runtime table that fails chosen calls (see _faults.pyx)."""

from instant_staging.runtime._table cimport Runtime, RuntimeTable


# Reports a Python exception raised inside a nogil table entry (a broken
# plan, a bug of the simulation) on stderr and returns ERROR_UNKNOWN: such a
# call fails closed, never passes as success.  Shared with _simulated.pyx.
cdef int internal_error(str where) noexcept


cdef struct FaultCtx:
    RuntimeTable inner                # a copy of the wrapped runtime's table
    void* owner                       # the FaultyRuntime (borrowed)


cdef class FaultyRuntime(Runtime):
    cdef FaultCtx _ctx                # this table's ctx points here
    cdef void* _inner_borrowed        # the inner runtime when it owns us
    cdef readonly object plan
    cdef dict _registered             # ptr -> size registered through us
    cdef dict _allocated              # ptr -> size allocated through us
    cdef dict _pending                # thread id -> injected code not yet read

    cdef int _setup(self, Runtime inner, object plan, bint own) except -1
    cdef int _enter(self, int op, void* ptr, size_t size) noexcept
    cdef void _leave(self, int op, void* ptr, size_t size, int code) noexcept
    cdef int _take_pending(self) noexcept
    cdef int _peek_pending(self) noexcept
