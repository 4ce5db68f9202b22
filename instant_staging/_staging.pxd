"""StagingBuffer: its C-level surface and its life cycle.

Cython callers ``from instant_staging cimport StagingBuffer`` (or from
``instant_staging._staging``) and read, without a Python call and without
the GIL::

    cdef StagingBuffer buf = StagingBuffer(1 << 30)
    cdef char* p = buf.data()               # NULL once released
    cdef size_t n = buf.nbytes()
    cdef size_t off, length
    for i in range(buf.n_registrations()):  # 0 once released
        buf.registration(i, &off, &length)  # one copy never crosses these

Life cycle (docs/design.md, "The allocation state machine").  Each step
returns 0 when it reached the state it names, else the failure's code
(the runtime's own, or an errno for the ordinary-memory steps).  Steps
1-3 are ``noexcept nogil``, run in one stretch without the GIL
(``_first_steps``) and recorded by ``_run`` after it; the others are
``cdef int ... except -1`` methods that record their own attempt and
raise only for a real error (MemoryError, KeyboardInterrupt).  ``_run``
takes the decisions (which step next, the one WARNING per fallback, the
final StagingError):

    NEW                               (1-3: _first_steps, one stretch
     | 1 _step_allocate ------------- fails: StagingError   without the GIL)
     v
    MAPPED --- 2 _step_prefault (an optimisation: MAPPED either way)
     | 3 _step_register ------------> REGISTERED
     | fails, size > segment_size:
     | 4 _step_register_segments ---> SEGMENTED
     | a segment fails:
     | 5 _step_rollback ------------- an unregister fails: RETAINED, RollbackError
     v
    MAPPED --- _unmap --> NEW
     | 6 _step_runtime_alloc -------> RUNTIME_PINNED
     | fails, allow_pageable:
     | 7 _step_pageable ------------> PAGEABLE
     v
    StagingError (every attempt)

    any state --- _release ---> RELEASED   (exactly once: close(), the
    context manager, __dealloc__, the atexit hook, or a failed __init__)

What is held is tracked apart from the kind, and updated right after the
runtime call that changed it, before any Python code runs: an exception
at any point (KeyboardInterrupt between steps included) leaves exactly
the held resources for ``_release`` to free, newest first.
"""

from instant_staging.runtime._table cimport Runtime, RuntimeTable


cdef struct FirstSteps:
    # Steps 1-3 as ``_first_steps`` took them, for ``_run`` to record.
    int map_err             # step 1: 0 or an errno
    double map_s
    int advise_err          # MADV_HUGEPAGE: 0, an errno, or -1 where not asked
    bint prefaulted         # step 2 ran (threads > 0)
    int prefault_err
    double prefault_s
    int register_code
    double register_s

# The kind a buffer reached (mirrors instant_staging.Kind); NONE until
# construction succeeds.
cdef enum:
    KIND_NONE = 0
    KIND_REGISTERED = 1
    KIND_SEGMENTED = 2
    KIND_RUNTIME_PINNED = 3
    KIND_PAGEABLE = 4


cdef class StagingBuffer:
    cdef char* _ptr                  # the buffer; NULL once released
    cdef size_t _size                # exactly the size asked for
    cdef size_t _segment_size        # step 4's, after copy_unit rounding
    cdef int _kind                   # KIND_*
    cdef int _exports                # live buffer-protocol exports
    cdef int _holds                  # running loads using it (loader/_pipeline.pyx)
    cdef bint _released
    cdef int _owner_pid              # pinning does not survive fork
    cdef int _threads                # page workers: prefault, and the release of the mapping
    cdef Runtime _runtime
    cdef list _attempts              # [Attempt, ...]
    cdef bint _hugepages             # the mapping was advised MADV_HUGEPAGE
    cdef str _hugepages_reason       # why huge pages or not (_hugepages.decide)
    cdef object __weakref__

    # The ranges of the buffer: _nranges adjacent ranges of _unit bytes (the
    # last one shorter), one range unless SEGMENTED.
    cdef size_t _unit
    cdef size_t _nranges

    # What is held, whatever the kind (the state _release frees):
    cdef size_t _map_size            # bytes of ordinary memory mapped, else 0
    cdef bint _host_alloc            # _ptr is a runtime allocation (free_host)
    cdef size_t _nregistered         # ranges 0 .. _nregistered-1 are registered
    cdef bint _retain                # an unregister failed: never free the memory
    cdef list _retained              # [(ptr, size), ...] left registered, ascending

    # The life cycle's steps.
    cdef int _run(self, size_t alignment, int threads, bint hugepages,
                  unsigned int register_flags, unsigned int alloc_flags,
                  bint allow_pageable) except -1
    # Steps 1-3: one stretch without the GIL, recorded by _run after it.
    cdef void _first_steps(self, RuntimeTable* rt, size_t alignment, int threads,
                           bint hugepages, unsigned int flags, FirstSteps* out) noexcept nogil
    cdef int _step_allocate(self, size_t alignment) noexcept nogil
    cdef int _step_prefault(self, int threads, bint hugepages, int* advise_err) noexcept nogil
    cdef int _step_register(self, RuntimeTable* rt, unsigned int flags) noexcept nogil
    cdef int _step_register_segments(self, unsigned int flags) except -1
    cdef int _step_rollback(self) except -1
    cdef int _step_runtime_alloc(self, unsigned int flags) except -1
    cdef int _step_pageable(self, size_t alignment) except -1

    cdef int _map_memory(self, size_t alignment) noexcept nogil     # steps 1 and 7

    # One runtime call each, recorded as an Attempt.
    cdef int _register_next(self, unsigned int flags, str step) except -1
    cdef int _register_range(self, RuntimeTable* rt, unsigned int flags) noexcept nogil
    cdef int _unregister_newest(self, str step) except -1
    cdef void _clear_error(self) noexcept
    cdef void _unmap(self) noexcept
    cdef int _record(self, str step, bint ok, int code, str name, size_t offset,
                     size_t size, double seconds) except -1
    cdef str _name(self, int code)
    cdef str _describe(self, int code)
    cdef str _last_failure(self)
    cdef str _failure_message(self, bint allow_pageable)

    # Release: what is held, exactly once.
    cdef object _release(self, bint raise_errors, bint dealloc=*)
    cdef object _report_leak(self, list retained, list codes, bint raise_errors)

    cdef inline char* data(self) noexcept nogil:
        return self._ptr

    cdef inline size_t nbytes(self) noexcept nogil:
        return self._size

    cdef inline size_t n_registrations(self) noexcept nogil:
        """How many ranges a copy may cover without crossing a boundary
        (the registrations of a SEGMENTED buffer; one range for the other
        kinds); 0 once released."""
        if self._ptr == NULL or self._kind == KIND_NONE:
            return 0
        return self._nranges

    cdef inline int registration(self, size_t i, size_t* offset, size_t* size) noexcept nogil:
        """Range ``i``'s offset and size; -1 (nothing written) past the end."""
        if i >= self.n_registrations():
            return -1
        offset[0] = i * self._unit
        size[0] = self._unit if self._size - offset[0] > self._unit else self._size - offset[0]
        return 0
