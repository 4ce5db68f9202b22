"""StagingBuffer's C-level surface, for Cython callers.

``from instant_staging._staging cimport StagingBuffer`` gives another
extension the pointer and size of a buffer without a Python call::

    cdef StagingBuffer buf = StagingBuffer(1 << 30)
    cdef char* p = buf.data()           # NULL once released
    cdef size_t n = buf.nbytes()
"""

from instant_staging._runtime cimport Runtime

# The kind a buffer reached (mirrors instant_staging.Kind); NONE until
# construction succeeds, and for a buffer whose memory had to be retained.
cdef enum:
    KIND_NONE = 0
    KIND_REGISTERED = 1
    KIND_SEGMENTED = 2
    KIND_RUNTIME_PINNED = 3
    KIND_PAGEABLE = 4


cdef class StagingBuffer:
    cdef char* _ptr                  # the buffer; NULL once released
    cdef size_t _size                # exactly the size asked for
    cdef size_t _map_size            # bytes mapped for ordinary memory, else 0
    cdef size_t _segment_size        # after copy_unit rounding
    cdef int _kind                   # KIND_*
    cdef int _exports                # live buffer-protocol exports
    cdef int _holds                  # running loads using it (loader/_pipeline.pyx)
    cdef bint _released
    cdef int _owner_pid              # pinning does not survive fork
    cdef Runtime _runtime
    cdef list _attempts              # [Attempt, ...]
    cdef list _segments              # [(offset, size), ...] as registered
    cdef object __weakref__

    cdef int _register(self, size_t offset, size_t length, unsigned int flags, str step) except? -1
    cdef int _unregister(self, size_t offset, size_t length, str step) except? -1
    cdef void _clear_error(self) noexcept
    cdef void _unmap(self) noexcept
    cdef object _release(self, bint raise_errors, bint dealloc=*)
    cdef object _release_in_fork_child(self)
    cdef object _leak(self, list retained, list codes, bint raise_errors)

    cdef inline char* data(self) noexcept nogil:
        return self._ptr

    cdef inline size_t nbytes(self) noexcept nogil:
        return self._size
