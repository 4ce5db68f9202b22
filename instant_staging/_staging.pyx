# cython: language_level=3
"""StagingBuffer: the allocation state machine.

A large pinned host buffer that survives drivers refusing big
registrations.  The steps are those of docs/design.md, one method each, entered
only after the previous one failed:

    1. allocate          page-aligned ordinary memory (mmap), exactly `size`
    2. prefault          fault the pages in with threads (an optimisation)
    3. register          one host_register of the whole range -> REGISTERED
    4. register_segment  adjacent `segment_size` ranges       -> SEGMENTED
    5. rollback          undo the segments if one failed
    6. runtime_alloc     cudaHostAlloc / hipHostMalloc         -> RUNTIME_PINNED
    7. pageable          ordinary memory, opt-in               -> PAGEABLE

The runtime is reached only through its table (``_table.pxd``), so the
same code runs against CUDA, HIP, the simulated runtime, or any of them
wrapped in faults.  Every runtime call is made with the GIL released, and
after every failed call the pending runtime error is cleared so that it
cannot surface later in an unrelated call of the caller's.
"""

cimport cython

import atexit
import logging
import math
import os
import sys
import threading
import time
import weakref

from cpython.buffer cimport PyBuffer_FillInfo
from libc.errno cimport errno, ENOMEM
from libc.stdint cimport intptr_t, uintptr_t
from libc.stdlib cimport malloc, free
from posix.mman cimport (mmap, munmap, madvise, MAP_FAILED, MAP_PRIVATE,
                         MAP_ANONYMOUS, PROT_READ, PROT_WRITE, MADV_DONTNEED,
                         MADV_HUGEPAGE)
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec
from posix.unistd cimport getpid, sysconf, _SC_PAGESIZE

from instant_staging._pthread cimport pthread_t, pthread_create, pthread_join
from instant_staging.runtime._table cimport ERROR_RUNTIME_UNLOADING, Runtime, RuntimeTable

from instant_staging import envs
from instant_staging._hugepages import decide as _decide_hugepages
from instant_staging._types import (Attempt, Kind, ReleaseError, RollbackError,
                                    StagingError, format_size)
from instant_staging.defaults import MAX_PREFAULT_THREADS, usable_cpus
from instant_staging.defaults import SEGMENT_SIZE as DEFAULT_SEGMENT_SIZE
from instant_staging.runtime import API_NAMES

logger = logging.getLogger("instant_staging")

cdef size_t PAGE = <size_t>sysconf(_SC_PAGESIZE)
cdef size_t HUGE_PAGE = 2 << 20


_KINDS = {KIND_REGISTERED: Kind.REGISTERED, KIND_SEGMENTED: Kind.SEGMENTED,
          KIND_RUNTIME_PINNED: Kind.RUNTIME_PINNED, KIND_PAGEABLE: Kind.PAGEABLE}


# -- argument checking: everything is rejected before anything is allocated --

_SIZE_MAX = 2 * sys.maxsize + 1        # size_t's range (ssize_t's width)

cdef size_t _int_arg(name, value, object minimum) except? 0:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value > _SIZE_MAX:
        # Checked here: the conversion to size_t would raise OverflowError.
        raise ValueError(f"{name} must be <= {_SIZE_MAX}, got {value}")
    return value


def _check_flags(name, value):
    _int_arg(name, value, 0)
    if value >= 1 << 32:
        raise ValueError(f"{name} must fit in 32 bits, got {value:#x}")


def auto_prefault_threads(size_t size, *, size_t bytes_per_thread=32 << 20,
                          int max_threads=16):
    """How many threads prefault `size` bytes when prefault_threads=None.

    INSTANT_STAGING_PREFAULT_THREADS overrides (an int in [0, 1024]; 0
    disables; parsed by ``envs``).  Otherwise one thread per
    `bytes_per_thread`, at most `max_threads` (16: where more stopped
    gaining) and at most the CPUs this process may run on; and none where
    that comes to fewer than two: one thread writing each page is slower
    than the registration faulting the pages itself, two threads only a
    little faster (docs/design.md, "Measured: prefault threads").

    Args:
        size: the buffer's bytes.
        bytes_per_thread: bytes per thread; default 32 MiB.
        max_threads: the most threads; default 16.

    Returns:
        The thread count (0: no prefault).

    Raises:
        ValueError: a bad INSTANT_STAGING_PREFAULT_THREADS.
    """
    threads = envs.get("INSTANT_STAGING_PREFAULT_THREADS")     # a bad value: ValueError
    if threads is not None:
        return threads
    threads = min(max_threads, usable_cpus(), size // max(bytes_per_thread, 1))
    return threads if threads >= 2 else 0


# -- step 2 and release: page workers (plain C threads, no GIL) ------------

# Release drops the pages with threads only where each gets this much
# (32 MiB of 4 KiB pages take milliseconds to free, a thread's start tens
# of microseconds): a small buffer is one munmap, as before.
cdef size_t DROP_BYTES_PER_THREAD = 32 << 20

cdef struct PageRange:
    char* start
    size_t length

ctypedef void* (*PageWork)(void*) noexcept nogil


cdef void* _touch_pages(void* arg) noexcept nogil:
    # One write per page makes the kernel allocate it now, in this thread,
    # instead of one page at a time inside the driver's registration.
    cdef PageRange* r = <PageRange*>arg
    cdef volatile char* p = r.start
    cdef size_t i = 0
    while i < r.length:
        p[i] = 0
        i += PAGE
    return NULL


cdef void* _drop_pages(void* arg) noexcept nogil:
    # Frees this range's pages now, in this thread; the munmap that follows
    # finds them gone.  One thread freeing 4 KiB pages takes about as long
    # as the threads took to fault them in: a refused registration paid
    # both before cudaHostAlloc (docs/design.md, "Measured: releasing pages
    # in threads").
    cdef PageRange* r = <PageRange*>arg
    madvise(r.start, r.length, MADV_DONTNEED)
    return NULL


cdef int _in_threads(char* ptr, size_t size, int threads, size_t grain,
                     PageWork work) noexcept nogil:
    """Runs ``work`` on ``threads`` adjacent ranges of [ptr, ptr + size), cut
    at multiples of ``grain`` from ptr, and joins them; returns 0 or the errno
    of the pthread_create that failed (the ranges not started are left
    undone: each caller's next step covers them)."""
    cdef PageRange* ranges = <PageRange*>malloc(threads * sizeof(PageRange))
    cdef pthread_t* ids = <pthread_t*>malloc(threads * sizeof(pthread_t))
    cdef size_t grains = (size + grain - 1) // grain
    cdef size_t per = (grains + threads - 1) // threads
    cdef int i, started = 0, rc = 0
    cdef size_t first
    if ranges == NULL or ids == NULL:
        free(ranges)
        free(ids)
        return ENOMEM
    for i in range(threads):
        first = i * per
        if first >= grains:
            break
        ranges[i].start = ptr + first * grain
        ranges[i].length = min(per * grain, size - first * grain)  # within the mapping
        rc = pthread_create(&ids[i], NULL, work, &ranges[i])
        if rc != 0:
            break
        started += 1
    for i in range(started):
        pthread_join(ids[i], NULL)
    free(ranges)
    free(ids)
    return rc


cdef int _prefault(char* ptr, size_t size, int threads) noexcept nogil:
    """Touches every page with `threads` threads; returns 0 or an errno (the
    pages left are faulted by registration, as without prefault)."""
    return _in_threads(ptr, size, threads, PAGE, _touch_pages)


cdef void _unmap_range(char* ptr, size_t length, int threads) noexcept nogil:
    """munmap, its pages first freed by up to `threads` threads.  The ranges
    are cut at 2 MiB so that no huge page is split to be freed."""
    threads = min(<size_t>threads, length // DROP_BYTES_PER_THREAD)
    if threads >= 2:
        _in_threads(ptr, length, threads, HUGE_PAGE, _drop_pages)
    munmap(ptr, length)


# -- ordinary memory ---------------------------------------------------------

cdef char* _map(size_t size, size_t alignment, size_t* mapped) noexcept nogil:
    """Anonymous private mapping of `size` bytes at `alignment`; NULL on failure.

    Over-maps by alignment - PAGE and trims both ends, so the buffer's pages
    are exactly round_up(size, PAGE): nothing extra stays resident.
    """
    global errno
    cdef size_t extra = alignment - PAGE if alignment > PAGE else 0
    if size > <size_t>-1 - (PAGE - 1) - extra:
        # length + extra would wrap around: a tiny mapping, then trimming
        # would unmap whatever lies above it (the interpreter's own memory).
        errno = ENOMEM  # no-cython-lint (libc's errno, declared global above)
        return NULL
    cdef size_t length = (size + PAGE - 1) // PAGE * PAGE
    cdef void* base = mmap(NULL, length + extra, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    if base == MAP_FAILED:
        return NULL
    cdef uintptr_t start = <uintptr_t>base
    cdef uintptr_t aligned = (start + alignment - 1) // alignment * alignment
    if aligned > start:
        munmap(base, aligned - start)
    if start + length + extra > aligned + length:
        munmap(<void*>(aligned + length), start + length + extra - aligned - length)
    mapped[0] = length
    return <char*>aligned


cdef double _now() noexcept nogil:
    """Seconds on the monotonic clock (time.perf_counter's), without the GIL."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


# A thread that makes a buffer while another thread runs Python (the
# loader's PendingStaging, loader/_prepare.py) sets ``beside.entering`` (a
# threading.Event) on itself: set as its steps 1-3 begin, without the GIL.
# Its caller waits for that, so that its Python before them runs at once,
# not in the turns the GIL gives it while the other thread computes.
beside = threading.local()

_live = weakref.WeakSet()


def _close_all_at_exit():
    # Release while the runtime is still loaded: Python's atexit handlers
    # run before the C runtime's own teardown.
    for buf in list(_live):
        if (<StagingBuffer>buf)._holds > 0:
            # A load's reader threads may still write into it (the loader's
            # own exit hook stops the loads it can; a hold left means one
            # could not be stopped).  Never unmap under a reader.
            continue
        if (<StagingBuffer>buf)._exports > 0:
            # A memoryview still uses the memory, and may after this handler:
            # later atexit handlers and daemon threads run on.  Leave it
            # mapped; exit returns it, and the driver drops the pinning with
            # the process (or __dealloc__ releases it once the view goes).
            continue
        try:
            (<StagingBuffer>buf)._release(False)
        except BaseException:
            pass


atexit.register(_close_all_at_exit)


@cython.no_gc_clear  # release needs the runtime and segments, even in a cycle
cdef class StagingBuffer:
    """StagingBuffer(size, *, alignment=None, segment_size=DEFAULT_SEGMENT_SIZE,
                  copy_unit=None, register_flags=0, alloc_flags=0,
                  prefault_threads=None, hugepages=None, allow_pageable=False,
                  runtime=None)
--

    A pinned host staging buffer that falls back instead of failing.

    ``kind`` says which path worked, ``attempts`` what every step did.
    ``spans()`` splits a byte range at registration boundaries: on a real
    driver one copy may not cross two registrations.  Release happens once,
    from ``close()``, the context manager, or garbage collection.

    Args:
        size: bytes, an int >= 1.
        alignment: the mapping's alignment, a power of two >= the page size;
            None (the default): the page size.  With huge pages it is at
            least 2 MiB.
        segment_size: bytes per registration when the whole range cannot
            be registered at once (step 4), a positive multiple of the page
            size; default DEFAULT_SEGMENT_SIZE.
        copy_unit: None, or the size of the chunks copied out of the buffer:
            segment_size is then rounded down to a multiple of it (and of the
            page), so that copy_unit-aligned chunks never straddle two
            registrations.
        register_flags: flags of the runtime's register call; default 0.
        alloc_flags: flags of the runtime's own pinned allocation (step 6);
            default 0.
        prefault_threads: threads that fault the pages in before
            registration (0 disables); None (the default):
            ``auto_prefault_threads(size)``.
        hugepages: advise MADV_HUGEPAGE; None (the default):
            INSTANT_STAGING_HUGEPAGES where set, else huge pages where THP
            allows them and their 2 MiB blocks are free
            (``hugepages_reason`` says which).
        allow_pageable: True: fall back to ordinary, not pinned memory
            (step 7) when nothing could be pinned; default False (that is
            then an error).
        runtime: an instant_staging Runtime; None (the default):
            ``default_runtime()``.

    Raises:
        TypeError, ValueError: an argument of the wrong type or out of range
            (checked before the first allocation).
        StagingError: no memory of an accepted kind could be had
            (``attempts`` says what every step did); RollbackError when
            undoing the registered segments failed too (the memory is then
            retained, still registered).
    """

    def __cinit__(self, *args, **kwargs):
        self._ptr = NULL
        self._kind = KIND_NONE
        self._owner_pid = getpid()

    def __init__(self, size, *, alignment=None, segment_size=DEFAULT_SEGMENT_SIZE,
                 copy_unit=None, register_flags=0, alloc_flags=0,
                 prefault_threads=None, hugepages=None, allow_pageable=False,
                 runtime=None):
        if self._attempts is not None:
            raise RuntimeError("StagingBuffer.__init__ may run only once")
        # Every check comes before the first allocation.
        self._size = _int_arg("size", size, 1)
        if alignment is None:
            alignment = PAGE
        _int_arg("alignment", alignment, PAGE)
        if alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two >= the page size ({PAGE}), got {alignment}")
        _int_arg("segment_size", segment_size, 1)
        if segment_size % PAGE:
            raise ValueError(f"segment_size must be a positive multiple of the page size ({PAGE}), "
                             f"got {segment_size}")
        self._segment_size = segment_size
        if copy_unit is not None:
            self._segment_size = _segment_for_copy_unit(segment_size, copy_unit)
        _check_flags("register_flags", register_flags)
        _check_flags("alloc_flags", alloc_flags)
        if prefault_threads is not None:
            _int_arg("prefault_threads", prefault_threads, 0)
            if prefault_threads > MAX_PREFAULT_THREADS:
                raise ValueError(f"prefault_threads must be <= {MAX_PREFAULT_THREADS}, "
                                 f"got {prefault_threads}")
        # None: INSTANT_STAGING_HUGEPAGES where set, else huge pages where THP
        # allows them and their 2 MiB blocks are free (``_hugepages.py``: half
        # the pinning time, and no compaction stall on a fragmented host;
        # docs/design.md, "Measured: huge pages").
        hugepages, self._hugepages_reason = _decide_hugepages(self._size, hugepages)
        if runtime is None:
            from instant_staging.runtime import default_runtime
            runtime = default_runtime()
        elif not isinstance(runtime, Runtime):
            raise TypeError(f"runtime must be an instant_staging Runtime, not {type(runtime).__name__}")
        threads = auto_prefault_threads(self._size) if prefault_threads is None else prefault_threads
        if hugepages:
            alignment = max(alignment, HUGE_PAGE)
        self._runtime = runtime
        self._threads = threads
        self._attempts = []
        self._retained = []
        try:
            self._run(alignment, threads, bool(hugepages), register_flags,
                      alloc_flags, bool(allow_pageable))
            _live.add(self)
        except BaseException:
            # Whatever was reached, and only that: the registrations newest
            # first, then the mapping or the runtime allocation.
            self._release(False)
            raise

    # -- the state machine (the life cycle of _staging.pxd) ------------------

    cdef int _run(self, size_t alignment, int threads, bint hugepages,
                  unsigned int register_flags, unsigned int alloc_flags,
                  bint allow_pageable) except -1:
        cdef int code
        cdef FirstSteps first
        cdef RuntimeTable* rt = &self._runtime.table
        # Steps 1-3 in one stretch without the GIL, recorded after: a buffer
        # made by a thread beside a load (loader/_prepare.py's
        # PendingStaging) waited for the GIL after each step while the
        # load's thread ran Python, and a server's first load then waited
        # for it (docs/design.md, "Measured: a server's first load").
        entering = getattr(beside, "entering", None)
        if entering is not None:
            entering.set()
        with nogil:
            self._first_steps(rt, alignment, threads, hugepages, register_flags, &first)
        # 1. allocate: page-aligned ordinary memory of exactly `size` bytes.
        err = first.map_err
        self._record("allocate", err == 0, 0, os.strerror(err) if err else "", 0, self._size,
                     first.map_s)
        if err != 0:
            raise StagingError(f"could not allocate {format_size(self._size)} of host memory: "
                               f"{os.strerror(err)}", self._attempts)
        # 2. prefault: an optimisation; a failure leaves the pages to step 3.
        if first.advise_err > 0:
            # THP disabled or unsupported: ordinary pages still work.
            reason = os.strerror(first.advise_err)
            self._hugepages_reason += f"; MADV_HUGEPAGE refused ({reason})"
            logger.info("MADV_HUGEPAGE refused (%s); continuing with 4 KiB pages", reason)
        if first.prefaulted:
            err = first.prefault_err
            self._record("prefault", err == 0, 0, os.strerror(err) if err else "", 0, self._size,
                         first.prefault_s)
        # 3. register: the whole range at once.
        code = first.register_code
        self._record("register", code == 0, code, self._name(code), 0, self._size, first.register_s)
        if code == 0:
            self._kind = KIND_REGISTERED
            return 0
        # 4. register_segment, skipped when it would repeat step 3.
        if self._size > self._segment_size:
            logger.warning(
                "%s of %s failed with %s; retrying as %d segments of %s "
                "(segment_size= changes the segment size)",
                API_NAMES["register"], format_size(self._size), self._describe(code),
                (self._size + self._segment_size - 1) // self._segment_size,
                format_size(self._segment_size))
            code = self._step_register_segments(register_flags)
            if code == 0:
                self._kind = KIND_SEGMENTED
                return 0
            # 5. rollback: a segment failed; undo the ones registered.
            failed_offset = self._nregistered * self._unit
            count = self._nregistered
            if self._step_rollback() != 0:
                raise RollbackError(
                    f"segment at offset {failed_offset} failed with {self._describe(code)} "
                    f"and rolling back {count} segment(s) failed for {len(self._retained)}; "
                    f"the buffer's memory is retained, still registered: "
                    + ", ".join(f"{p:#x}+{format_size(n)}" for p, n in self._retained),
                    self._attempts, retained_ranges=self._retained)
        # 6. runtime_alloc: free the ordinary memory, then the runtime's own.
        self._unmap()
        if self._hugepages:
            self._hugepages = False
            self._hugepages_reason += "; not for the fallback's memory (the runtime's own)"
        logger.warning(
            "%s could not pin %s (%s); falling back to %s of the same size",
            API_NAMES["register"], format_size(self._size), self._last_failure(),
            API_NAMES["alloc"])
        if self._step_runtime_alloc(alloc_flags) == 0:
            self._kind = KIND_RUNTIME_PINNED
            return 0
        # 7. pageable: ordinary memory again, only when the caller accepts it.
        if allow_pageable:
            logger.warning(
                "no pinned memory for %s (%s); using pageable memory: host-to-device "
                "copies will be several times slower (allow_pageable=False makes this an error)",
                format_size(self._size), self._last_failure())
            if self._step_pageable(alignment) == 0:
                self._kind = KIND_PAGEABLE
                return 0
        raise StagingError(self._failure_message(allow_pageable), self._attempts)

    cdef void _first_steps(self, RuntimeTable* rt, size_t alignment, int threads, bint hugepages,
                           unsigned int flags, FirstSteps* out) noexcept nogil:
        """Steps 1-3 without the GIL, each timed into ``out``; what is held
        moves as each call returns (``_map_size``, ``_nregistered``)."""
        cdef double t0 = _now()
        out.advise_err = -1
        out.prefaulted = False
        out.map_err = self._step_allocate(alignment)
        out.map_s = _now() - t0
        if out.map_err != 0:
            return
        t0 = _now()
        out.prefault_err = self._step_prefault(threads, hugepages, &out.advise_err)
        out.prefaulted = threads > 0
        out.prefault_s = _now() - t0
        t0 = _now()
        out.register_code = self._step_register(rt, flags)
        out.register_s = _now() - t0

    cdef int _step_allocate(self, size_t alignment) noexcept nogil:
        """Step 1: page-aligned ordinary memory of exactly `size` bytes; 0 or an errno."""
        self._unit = self._size
        self._nranges = 1
        return self._map_memory(alignment)

    cdef int _map_memory(self, size_t alignment) noexcept nogil:
        """Steps 1 and 7: maps the buffer's ordinary memory; 0 or an errno."""
        self._ptr = _map(self._size, alignment, &self._map_size)
        return errno if self._ptr == NULL else 0

    cdef int _step_prefault(self, int threads, bint hugepages, int* advise_err) noexcept nogil:
        """Step 2: fault the pages in with threads; 0 or an errno (not fatal).
        ``advise_err``: MADV_HUGEPAGE's errno where it was asked and refused,
        0 where it was taken."""
        if hugepages:
            if madvise(self._ptr, self._map_size, MADV_HUGEPAGE) != 0:
                advise_err[0] = errno
            else:
                advise_err[0] = 0
                self._hugepages = True
        if threads <= 0:
            return 0
        return _prefault(self._ptr, self._size, threads)

    cdef int _step_register(self, RuntimeTable* rt, unsigned int flags) noexcept nogil:
        """Step 3: one registration of the whole range; 0 or the runtime's code."""
        self._unit = self._size
        self._nranges = 1
        return self._register_range(rt, flags)

    cdef int _step_register_segments(self, unsigned int flags) except -1:
        """Step 4: adjacent segments; 0, or the code of the segment that failed
        (at offset _nregistered * _unit, the others still registered)."""
        cdef int code
        self._unit = self._segment_size
        self._nranges = (self._size + self._unit - 1) // self._unit
        while self._nregistered < self._nranges:
            code = self._register_next(flags, "register_segment")
            if code != 0:
                return code
        return 0

    cdef int _step_rollback(self) except -1:
        """Step 5: unregister every registered segment, newest first; 0, or
        the number of ranges left registered (then the memory is retained)."""
        while self._nregistered > 0:
            self._unregister_newest("rollback")
        self._unit = self._size
        self._nranges = 1
        return len(self._retained)

    cdef int _step_runtime_alloc(self, unsigned int flags) except -1:
        """Step 6: the runtime's own pinned allocation; 0 or the runtime's code."""
        cdef RuntimeTable* rt = &self._runtime.table
        cdef void* ptr = NULL
        cdef int code
        cdef size_t size = self._size
        cdef double t0 = time.perf_counter()
        with nogil:
            code = rt.host_alloc(rt.ctx, &ptr, size, flags)
            if code == 0:
                self._ptr = <char*>ptr
                self._host_alloc = True
        if code != 0:
            self._clear_error()
        self._record("runtime_alloc", code == 0, code, self._name(code), 0, size,
                     time.perf_counter() - t0)
        return code

    cdef int _step_pageable(self, size_t alignment) except -1:
        """Step 7 (allow_pageable=True): ordinary memory, not pinned; 0 or an errno."""
        cdef double t0 = time.perf_counter()
        cdef int err
        with nogil:
            err = self._map_memory(alignment)
        self._record("pageable", err == 0, 0, os.strerror(err) if err else "", 0, self._size,
                     time.perf_counter() - t0)
        return err

    # -- one runtime call each, recorded as an Attempt -----------------------

    cdef int _register_next(self, unsigned int flags, str step) except -1:
        # Registers range _nregistered (step 4's segments), recorded.
        cdef RuntimeTable* rt = &self._runtime.table
        cdef size_t offset = self._nregistered * self._unit
        cdef size_t length = min(self._unit, self._size - offset)
        cdef int code
        cdef double t0 = time.perf_counter()
        with nogil:
            code = self._register_range(rt, flags)
        self._record(step, code == 0, code, self._name(code), offset, length,
                     time.perf_counter() - t0)
        return code

    cdef int _register_range(self, RuntimeTable* rt, unsigned int flags) noexcept nogil:
        # Registers range _nregistered; the count moves before any Python runs.
        cdef size_t offset = self._nregistered * self._unit
        cdef size_t length = min(self._unit, self._size - offset)
        cdef int code = rt.host_register(rt.ctx, self._ptr + offset, length, flags)
        if code == 0:
            self._nregistered += 1
        else:
            rt.get_last_error(rt.ctx)  # same runtime instance, same thread
        return code

    cdef int _unregister_newest(self, str step) except -1:
        # Unregisters range _nregistered - 1; a failure retains the memory.
        cdef RuntimeTable* rt = &self._runtime.table
        cdef size_t offset = (self._nregistered - 1) * self._unit
        cdef size_t length = min(self._unit, self._size - offset)
        cdef void* ptr = self._ptr + offset
        cdef int code
        cdef double t0 = time.perf_counter()
        with nogil:
            code = rt.host_unregister(rt.ctx, ptr)
            self._nregistered -= 1
            if code != 0:
                self._retain = True
                rt.get_last_error(rt.ctx)
        if code != 0:
            self._retained.insert(0, (<intptr_t>ptr, length))
        if step is not None:
            self._record(step, code == 0, code, self._name(code), offset, length,
                         time.perf_counter() - t0)
        return code

    cdef void _clear_error(self) noexcept:
        # Same runtime instance, same thread as the failed call.
        cdef RuntimeTable* rt = &self._runtime.table
        with nogil:
            rt.get_last_error(rt.ctx)

    cdef void _unmap(self) noexcept:
        cdef char* ptr = self._ptr
        cdef size_t length = self._map_size
        # The prefault's threads free the pages too (not in a fork child,
        # which only drops its copy of the mapping).
        cdef int threads = self._threads if getpid() == self._owner_pid else 0
        if ptr != NULL and length and not self._retain:
            self._map_size = 0
            self._ptr = NULL
            with nogil:
                _unmap_range(ptr, length, threads)

    cdef int _record(self, str step, bint ok, int code, str name, size_t offset,
                     size_t size, double seconds) except -1:
        self._attempts.append(Attempt(step, ok, code, name, offset, size, seconds))
        return 0

    cdef str _name(self, int code):
        return self._runtime.error_name(code) if code else ""

    cdef str _describe(self, int code):
        return f"{self._runtime.error_name(code)} ({self._runtime.error_string(code)})"

    cdef str _last_failure(self):
        failed = [a for a in self._attempts if not a.ok and a.code]
        return ", ".join(sorted({a.name for a in failed})) or "no runtime error"

    cdef str _failure_message(self, bint allow_pageable):
        steps = "; ".join(f"{a.step} at {a.offset} failed with {a.name}"
                          for a in self._attempts if not a.ok)
        hint = ("pageable memory could not be allocated either" if allow_pageable else
                "allow_pageable=True accepts unpinned memory, several times slower to copy")
        return f"no staging buffer of {format_size(self._size)}: {steps}; {hint}"

    # -- release: what is held, exactly once ---------------------------------

    cdef object _release(self, bint raise_errors, bint dealloc=False):
        # Every resource is freed before any Python code runs (an exception
        # there, KeyboardInterrupt included, leaves nothing held).
        if self._released:
            return None
        self._released = True   # set before any GIL release: one releaser wins
        cdef RuntimeTable* rt
        cdef int code = 0
        cdef list retained = []
        cdef list codes = []
        cdef char* ptr = self._ptr
        if getpid() != self._owner_pid:
            # The registration belongs to the parent's process; the child only
            # drops its own copy of the mapping and makes no runtime call.
            self._nregistered = 0
            if self._host_alloc:
                self._host_alloc = False
                self._ptr = NULL
        else:
            while self._nregistered > 0:
                code = self._unregister_newest(None)
                if code != 0:
                    codes.append(code)
            if self._retain:
                retained = self._retained
            elif self._host_alloc:
                rt = &self._runtime.table
                with nogil:
                    code = rt.free_host(rt.ctx, ptr)
                self._host_alloc = False
                if code != 0:
                    self._clear_error()
                    self._retain = True
                    retained = [(<intptr_t>ptr, self._size)]
                    codes.append(code)
        if self._retain:
            self._ptr = NULL       # leaked on purpose: never freed while registered
            self._map_size = 0
        self._unmap()
        self._ptr = NULL
        if not dealloc:
            # (In __dealloc__ the weak reference is already gone; a new one
            # to a dying object must not be made.)
            _live.discard(self)
        if codes:
            return self._report_leak(retained, codes, raise_errors)
        return None

    cdef object _report_leak(self, list retained, list codes, bint raise_errors):
        # The runtime torn down at exit (ERROR_RUNTIME_UNLOADING), or the
        # interpreter finalizing: a release that meets it stays quiet.
        if all(c == ERROR_RUNTIME_UNLOADING for c in codes) or sys.is_finalizing():
            return None
        names = ", ".join(sorted({self._runtime.error_name(c) for c in codes}))
        kind = _KINDS[self._kind].name if self._kind != KIND_NONE else "partly built"
        message = (f"releasing a {format_size(self._size)} {kind} staging buffer "
                   f"failed with {names}; its memory is leaked on purpose: "
                   + ", ".join(f"{p:#x}+{format_size(n)}" for p, n in retained))
        error = ReleaseError(message, code=codes[-1], retained_ranges=retained)
        if raise_errors:
            raise error
        logger.error("%s", message)

    def close(self):
        """Releases the memory with the call matching its kind.  Idempotent.

        Raises:
            BufferError: a memoryview (or ``as_tensor()``) of the buffer is
                alive, or a load uses it (close or cancel the load first: its
                reader threads write into the buffer until they are joined).
            StagingError: the runtime refused to unregister (the memory is
                then leaked on purpose, never freed while registered).
        """
        if self._holds > 0:
            raise BufferError("cannot close a StagingBuffer while a load is using it: "
                              "close the load's iterator first (that stops and joins "
                              "its reader threads)")
        if self._exports > 0:
            raise BufferError(f"cannot close a StagingBuffer with {self._exports} "
                              "exported buffer(s) (memoryviews) still alive")
        self._release(True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __dealloc__(self):
        # Not the kind: what is held decides (a buffer whose __init__ was
        # interrupted holds memory with no kind yet).
        if self._released:
            return
        try:
            self._release(False, True)
        except BaseException:
            pass

    # -- the buffer protocol -------------------------------------------------

    def __getbuffer__(self, Py_buffer* view, int flags):
        if self._released or self._ptr == NULL:
            raise ValueError("operation on a closed StagingBuffer")
        PyBuffer_FillInfo(view, self, self._ptr, self._size, 0, flags)
        self._exports += 1

    def __releasebuffer__(self, Py_buffer* view):
        self._exports -= 1

    # -- what callers read ---------------------------------------------------

    @property
    def kind(self):
        """The Kind reached (kept after close), or None."""
        return _KINDS.get(self._kind)

    @property
    def pinned(self):
        return self._kind in (KIND_REGISTERED, KIND_SEGMENTED, KIND_RUNTIME_PINNED)

    @property
    def ptr(self):
        """The buffer's address as an int; 0 once closed."""
        return 0 if self._released else <intptr_t>self._ptr

    @property
    def size(self):
        return self._size

    @property
    def closed(self):
        return self._released

    @property
    def segment_size(self):
        """The segment size in effect (segment_size rounded for copy_unit)."""
        return self._segment_size

    @property
    def segments(self):
        """((offset, size), ...): one entry unless SEGMENTED (kept after close)."""
        if self._kind == KIND_NONE:
            return ()
        return tuple((i * self._unit, min(self._unit, self._size - i * self._unit))
                     for i in range(self._nranges))

    @property
    def attempts(self):
        return tuple(self._attempts or ())

    @property
    def hugepages(self):
        """Whether the memory was advised MADV_HUGEPAGE (and the kernel took
        the advice); False for a runtime allocation (RUNTIME_PINNED) and
        where the choice was 4 KiB pages.  ``hugepages_reason`` says why."""
        return bool(self._hugepages)

    @property
    def hugepages_reason(self):
        """Why ``hugepages`` is what it is: the argument, the variable, or
        auto's reading of the host ('auto: THP madvise, 812 free 2 MiB blocks
        for the 1024 needed ...')."""
        return self._hugepages_reason or ""

    @property
    def runtime(self):
        return self._runtime

    def spans(self, offset=0, nbytes=None):
        """The buffer's memory in spans that cross no registration boundary.

        Args:
            offset: the first byte, in [0, size]; default 0.
            nbytes: bytes from ``offset``; None (the default): to the end.

        Returns:
            [(ptr, size), ...] covering [offset, offset + nbytes), split so
            that no span crosses a registration boundary.

        Raises:
            ValueError: the buffer is closed, or the range is outside it.
        """
        if self._released or self._ptr == NULL:
            raise ValueError("operation on a closed StagingBuffer")
        _int_arg("offset", offset, 0)
        if offset > self._size:
            raise ValueError(f"offset {offset} is outside the buffer of {self._size} bytes")
        if nbytes is None:
            nbytes = self._size - offset
        _int_arg("nbytes", nbytes, 0)
        if offset + nbytes > self._size:
            raise ValueError(f"span [{offset}, {offset + nbytes}) is outside the buffer "
                             f"of {self._size} bytes")
        cdef list out = []
        end = offset + nbytes
        base = <intptr_t>self._ptr
        for seg_offset, seg_size in self.segments:
            lo = max(offset, seg_offset)
            hi = min(end, seg_offset + seg_size)
            if lo < hi:
                out.append((base + lo, hi - lo))
        return out

    def as_tensor(self):
        """The buffer as a 1-D ``torch.uint8`` CPU tensor sharing its memory.

        The tensor (and every view of it) keeps a memoryview of the buffer,
        so ``close()`` raises BufferError while any of them lives.  Prefer it
        to ``torch.frombuffer(buf)``, which releases its export at once:
        after ``close()`` such a tensor points at unmapped memory.

        Returns:
            The tensor, ``size`` elements.

        Raises:
            ValueError: the buffer is closed.
            ImportError: torch is not installed.
        """
        if self._released or self._ptr == NULL:
            raise ValueError("operation on a closed StagingBuffer")
        import torch
        return torch.frombuffer(memoryview(self), dtype=torch.uint8)

    def __len__(self):
        return self._size

    def __repr__(self):
        state = "closed" if self._released else f"ptr={self.ptr:#x}"
        kind = self.kind.name if self.kind else "none"
        return f"<StagingBuffer {format_size(self._size)} {kind} {state}>"


def _segment_for_copy_unit(segment_size, copy_unit):
    """segment_size rounded down to a multiple of copy_unit (and of the page),
    so that copy_unit-aligned chunks never straddle two registrations."""
    _int_arg("copy_unit", copy_unit, 1)
    if copy_unit > segment_size:
        raise ValueError(f"copy_unit ({copy_unit}) must not be larger than segment_size ({segment_size})")
    unit = copy_unit * PAGE // math.gcd(copy_unit, PAGE)
    rounded = segment_size // unit * unit
    if rounded == 0:
        raise ValueError(f"no segment size <= {segment_size} is a multiple of both copy_unit "
                         f"({copy_unit}) and the page size ({PAGE})")
    return rounded
