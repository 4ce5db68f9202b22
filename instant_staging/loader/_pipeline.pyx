# cython: language_level=3
"""The loader's copy pipeline: reader threads in C, without the GIL.

A loader moves thousands of chunks a second (docs/design.md, "Measured:
chunks a second"); Python threads would hold the GIL for every read, copy
and event call.  Here the
whole per-chunk path runs in plain C threads:

    claim the next chunk -> wait for the slot's previous copy (its event)
    -> pread the chunk into the slot -> copy each piece to its tensor
       (the pieces of one device block's tensors as one copy)
    -> record the slot's event

(A remote chunk bound for CPU tensors skips the slot: its pieces are
copied from the client's buffer, ``_fetch_to_host``.)

A *chunk* is a contiguous file range of at most ``chunk_size`` bytes; a
*piece* is the part of one tensor inside one chunk, so small tensors share
a chunk and large ones span several.  A ``Plan`` cuts the tensors into
chunks and pieces; a ``Pipeline`` runs one plan once.  Each thread owns its
own slots (as in the C program of docs/design.md ("Measured") that came
closest to the host's ceiling), so no thread waits on another.  Device
copies go through the staging buffer's runtime table on the thread's own
stream (after ``set_device``: the current device is per thread); in host
mode a piece is a ``memcpy`` into CPU memory.

Slots are whole chunks inside each registration of the staging buffer
(``StagingBuffer.segments``), so no copy ever spans two registrations,
whatever the chunk size and whatever kind the buffer reached; a slot is as
long as the plan's longest chunk.  The slot count is bounded by what the
load can use: at most one per chunk, and at most ``MAX_SLOTS_PER_THREAD``
per thread.

Lifetimes.  A Pipeline *holds* its staging buffer from construction until
its threads are joined (``StagingBuffer.close()`` raises meanwhile, and
the buffer's atexit release skips it), and nothing here closes file
descriptors: the caller closes them after ``close()`` returned.
``cancel()`` and ``close()`` may be called from any thread, concurrently
with ``wait()`` in another; ``close()`` stops the threads, waits for every
in-flight copy, joins them and only then drops the hold.  A tensor is
reported done only once every copy into it has finished.  The first error
stops every thread; each thread then waits for its in-flight copies before
it exits.  In a fork child (where the reader threads do not exist)
``wait()`` raises instead of waiting forever, and ``close()`` neither locks
nor joins.  At interpreter exit every running pipeline is cancelled and
joined before the staging buffers' own atexit release runs, and a
consumer thread inside a load (``enter_load``/``leave_load``) parks where
it is, never to return into torch or its caller's loop while the
interpreter finalizes.

Faults (docs/design.md "Faults"): the ``read`` and ``copy`` rules of a
``FaultPlan`` are resolved when the plan is made, by position, not by
time: ``read#N`` is the N-th chunk of this plan and ``copy#N`` its N-th
piece, in reading order (file, then offset), 1-based, whichever thread
ends up doing it; ``>SIZE``/``>=SIZE`` compare the chunk's or the piece's
length.  So a rule fails the same chunk in every run, with any number of
threads.  ``read=EIO`` (an errno) fails that chunk's read with the errno;
``read=short`` makes the file end where the chunk begins; ``copy=CODE``
fails that piece's copy with the runtime code, in host mode too.
"""

cimport cython

import atexit
import os
import time
import weakref

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE
from libc.stdint cimport intptr_t, int64_t
from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memcpy
from libc.errno cimport errno, EINTR
from posix.unistd cimport pread, getpid
from posix.time cimport clock_gettime, timespec, CLOCK_REALTIME

from instant_staging._pthread cimport (
    pthread_t, pthread_mutex_t, pthread_cond_t, pthread_create, pthread_join,
    pthread_mutex_init, pthread_mutex_destroy, pthread_mutex_lock, pthread_mutex_unlock,
    pthread_cond_init, pthread_cond_destroy, pthread_cond_broadcast, pthread_cond_wait,
    pthread_cond_timedwait)
from instant_staging.runtime._table cimport Runtime, RuntimeTable, MEMCPY_HOST_TO_DEVICE
from instant_staging._staging cimport StagingBuffer

from instant_staging.defaults import MAX_SLOTS_PER_THREAD

cdef extern from "<stdlib.h>" nogil:
    int posix_memalign(void** memptr, size_t alignment, size_t size)

cdef extern from "<unistd.h>" nogil:
    unsigned int sleep(unsigned int seconds)

cdef extern from "<pthread.h>" nogil:
    pthread_t pthread_self()
    int pthread_equal(pthread_t a, pthread_t b)

# Where the pieces go.
cdef enum:
    MODE_HOST = 0      # memcpy into host memory
    MODE_DEVICE = 1    # memcpy_async through the runtime table

# What went wrong (error()[0]).
cdef enum:
    ERR_NONE = 0
    ERR_READ = 1       # pread failed; code is the errno
    ERR_EOF = 2        # the file ended before the chunk did
    ERR_RUNTIME = 3    # a runtime call failed; code is the runtime's
    ERR_THREAD = 4     # no reader thread could be started; code is the errno
    ERR_CANCELLED = 5  # cancel() (another thread, or interpreter exit)
    ERR_FETCH = 6      # the fetch callable raised (a remote source); it keeps the exception

# benchmarks/profile_load.py takes the pipeline apart: SKIP_READ copies
# whatever the slot holds (the copy side alone), SKIP_COPY only reads (the
# read side alone: the host's parallel-read ceiling).
cdef enum:
    SKIP_READ_BIT = 1
    SKIP_COPY_BIT = 2

# A read fault that makes the file end where the chunk begins
# (faults.SHORT_READ; errno values are positive).
cdef int FAULT_SHORT = -1

# The same, for Python callers.
HOST, DEVICE = MODE_HOST, MODE_DEVICE
READ_ERROR, END_OF_FILE, RUNTIME_ERROR, CANCELLED, FETCH_ERROR = (
    ERR_READ, ERR_EOF, ERR_RUNTIME, ERR_CANCELLED, ERR_FETCH)
SKIP_READ, SKIP_COPY = SKIP_READ_BIT, SKIP_COPY_BIT

# Which runtime call failed (error()[2]).
CALLS = ("", "set_device", "stream_create", "event_create", "memcpy_async",
         "event_record", "event_synchronize", "stream_synchronize", "memcpy")
cdef enum:
    CALL_NONE, CALL_SET_DEVICE, CALL_STREAM_CREATE, CALL_EVENT_CREATE, CALL_MEMCPY,
    CALL_EVENT_RECORD, CALL_EVENT_SYNCHRONIZE, CALL_STREAM_SYNCHRONIZE, CALL_HOST_MEMCPY


cdef struct Chunk:
    int fd
    int fault               # read fault: 0, an errno, or FAULT_SHORT
    int64_t offset          # in the file
    size_t length
    Py_ssize_t first_piece
    Py_ssize_t n_pieces


cdef struct Piece:
    Py_ssize_t tensor
    size_t offset           # in the chunk
    size_t dst_offset       # in the tensor
    size_t nbytes
    int fault               # copy fault: 0 or the runtime code
    bint joins              # its destination continues the piece before's (one block)


cdef struct Shared:
    pthread_mutex_t lock
    pthread_cond_t cond
    Chunk* chunks
    Py_ssize_t n_chunks
    Py_ssize_t next_chunk
    Piece* pieces
    intptr_t* dsts          # per tensor: where its bytes go
    Py_ssize_t n_ready      # dsts[0:n_ready] are known (provide() adds more)
    int skip                # SKIP_* bits (benchmarks)
    size_t* remaining       # per tensor: bytes not yet copied
    Py_ssize_t* done        # tensors in the order they completed
    # NULL: pread the chunk's fd; else a Python callable that fills the slot
    # (borrowed: Pipeline.fetch owns it)
    void* fetch
    Py_ssize_t n_done
    unsigned long long done_bytes
    int stop
    int running
    RuntimeTable* rt
    int mode
    int device
    int err_kind
    int err_code
    int err_call
    Py_ssize_t err_chunk
    int64_t err_offset


cdef struct Worker:
    Shared* sh
    char** slots
    int n_slots
    void** events
    Py_ssize_t* pending     # per slot: chunk whose copy is in flight, or -1
    void* stream
    bint has_stream
    pthread_t tid


# -- shared state, under the lock ------------------------------------------

cdef void _fail(Shared* sh, int kind, int code, int call, Py_ssize_t chunk,
                int64_t offset) noexcept nogil:
    pthread_mutex_lock(&sh.lock)
    if sh.err_kind == ERR_NONE:     # the first error is the one reported
        sh.err_kind = kind
        sh.err_code = code
        sh.err_call = call
        sh.err_chunk = chunk
        sh.err_offset = offset
    sh.stop = 1
    pthread_cond_broadcast(&sh.cond)
    pthread_mutex_unlock(&sh.lock)


cdef Py_ssize_t _claim(Shared* sh) noexcept nogil:
    cdef Py_ssize_t c = -1
    pthread_mutex_lock(&sh.lock)
    if not sh.stop and sh.next_chunk < sh.n_chunks:
        c = sh.next_chunk
        sh.next_chunk += 1
    pthread_mutex_unlock(&sh.lock)
    return c


cdef void _complete(Shared* sh, Py_ssize_t c) noexcept nogil:
    """Every copy of chunk c has finished: count its bytes, finish tensors."""
    cdef Chunk* ch = &sh.chunks[c]
    cdef Piece* p
    cdef Py_ssize_t i
    cdef bint finished = False
    pthread_mutex_lock(&sh.lock)
    for i in range(ch.first_piece, ch.first_piece + ch.n_pieces):
        p = &sh.pieces[i]
        sh.remaining[p.tensor] -= p.nbytes
        sh.done_bytes += p.nbytes
        if sh.remaining[p.tensor] == 0:
            sh.done[sh.n_done] = p.tensor
            sh.n_done += 1
            finished = True
    if finished:
        pthread_cond_broadcast(&sh.cond)
    pthread_mutex_unlock(&sh.lock)


cdef int _await_dsts(Shared* sh, Py_ssize_t c) noexcept nogil:
    """Waits until every tensor of chunk c has its destination; -1 once
    the load stops instead.  Destinations come in tensor order, while the
    consumer allocates (``provide``), so reading never waits for them."""
    cdef Chunk* ch = &sh.chunks[c]
    cdef Py_ssize_t last = sh.pieces[ch.first_piece + ch.n_pieces - 1].tensor
    cdef int rc = 0
    pthread_mutex_lock(&sh.lock)
    while sh.n_ready <= last and not sh.stop:
        pthread_cond_wait(&sh.cond, &sh.lock)
    if sh.n_ready <= last:
        rc = -1
    pthread_mutex_unlock(&sh.lock)
    return rc


# -- one reader thread -----------------------------------------------------

cdef int _runtime_call(Worker* w, int code, int call, Py_ssize_t c, int64_t offset) noexcept nogil:
    if code != 0:
        w.sh.rt.get_last_error(w.sh.rt.ctx)   # same thread as the failed call
        _fail(w.sh, ERR_RUNTIME, code, call, c, offset)
    return code


cdef int _setup_device(Worker* w) noexcept nogil:
    cdef RuntimeTable* rt = w.sh.rt
    cdef int i
    if _runtime_call(w, rt.set_device(rt.ctx, w.sh.device), CALL_SET_DEVICE, -1, 0):
        return -1
    if _runtime_call(w, rt.stream_create(rt.ctx, &w.stream), CALL_STREAM_CREATE, -1, 0):
        return -1
    w.has_stream = True
    for i in range(w.n_slots):
        if _runtime_call(w, rt.event_create(rt.ctx, &w.events[i]), CALL_EVENT_CREATE, -1, 0):
            w.events[i] = NULL
            return -1
    return 0


cdef int _fetched(Shared* sh, Py_ssize_t c, Py_buffer* view) noexcept nogil:
    """A remote chunk: ``fetch(file, offset, length)`` returns a buffer of
    exactly ``length`` bytes (the client's own memory, never written to),
    held in ``view`` (which keeps the client's object) until the caller's
    ``PyBuffer_Release``.  ``ch.fd`` is the file's index in the checkpoint.
    The fetch keeps its own exception; here it is only ERR_FETCH (-1, no
    view held)."""
    cdef Chunk* ch = &sh.chunks[c]
    cdef bint held = False
    with gil:
        try:
            data = (<object>sh.fetch)(ch.fd, ch.offset, ch.length)
            PyObject_GetBuffer(data, view, PyBUF_SIMPLE)
            held = True
            data = None
            if <size_t>view.len != ch.length:
                PyBuffer_Release(view)
                held = False
        except BaseException:
            pass
    if not held:
        _fail(sh, ERR_FETCH, 0, CALL_NONE, c, ch.offset)
        return -1
    return 0


cdef int _fetch_chunk(Shared* sh, Py_ssize_t c, char* slot) noexcept nogil:
    """A remote chunk copied into the slot without the GIL (``_fetched``)."""
    cdef Py_buffer view
    if _fetched(sh, c, &view) != 0:
        return -1
    memcpy(slot, view.buf, sh.chunks[c].length)
    with gil:
        PyBuffer_Release(&view)
    return 0


cdef int _fetch_to_host(Shared* sh, Py_ssize_t c) noexcept nogil:
    """A remote chunk whose tensors are in CPU memory: each piece copied
    from the client's buffer (``_fetched``) straight into its tensor, as
    ``_copy_host`` copies from a slot (through a slot, every byte would be
    copied twice); the buffer held until the copies ended."""
    cdef Py_buffer view
    cdef int rc = -1
    if _fetched(sh, c, &view) != 0:
        return -1
    if _await_dsts(sh, c) == 0:
        rc = _copy_host(sh, c, <char*>view.buf)
    with gil:
        PyBuffer_Release(&view)
    return rc


cdef int _read_chunk(Shared* sh, Py_ssize_t c, char* slot) noexcept nogil:
    cdef Chunk* ch = &sh.chunks[c]
    cdef size_t got = 0
    cdef ssize_t n
    if ch.fault != 0:               # a read rule of the fault plan
        if ch.fault == FAULT_SHORT:
            _fail(sh, ERR_EOF, 0, CALL_NONE, c, ch.offset)
        else:
            _fail(sh, ERR_READ, ch.fault, CALL_NONE, c, ch.offset)
        return -1
    if sh.fetch != NULL:
        return _fetch_chunk(sh, c, slot)
    while got < ch.length:
        n = pread(ch.fd, slot + got, ch.length - got, ch.offset + <int64_t>got)
        if n < 0:
            if errno == EINTR:
                continue
            _fail(sh, ERR_READ, errno, CALL_NONE, c, ch.offset + <int64_t>got)
            return -1
        if n == 0:
            _fail(sh, ERR_EOF, 0, CALL_NONE, c, ch.offset + <int64_t>got)
            return -1
        got += <size_t>n
    return 0


cdef Py_ssize_t _next_copy(Shared* sh, Chunk* ch, Py_ssize_t i, size_t* src, char** dst,
                           size_t* nbytes) noexcept nogil:
    """Pieces i, i + 1, ... of chunk ``ch`` as one copy while each piece's
    destination follows the previous one's (the tensors of one device block,
    ``loader/_blocks.pyx``: a chunk of 4 MiB holding 500 norms is one copy,
    not 500): sets the copy's offset in the slot, its destination and its
    length; returns the piece after it.  Pieces tile their chunk in order,
    so the slot side is always contiguous.  Only a piece the plan says
    joins (``Plan(joins=)``: its tensor continues the block of the one
    before, or the given destination of the one before inside one
    allocation) extends a copy: two allocations that merely happen to be
    adjacent are two copies (a copy spanning two allocations is no valid
    range for the driver, as one spanning two registrations is not).  A
    piece with a copy fault ends the copy before it (the caller fails that
    piece, as ``copy#N`` says)."""
    cdef Py_ssize_t end = ch.first_piece + ch.n_pieces
    cdef Piece* p = &sh.pieces[i]
    src[0] = p.offset
    dst[0] = <char*>(sh.dsts[p.tensor] + <intptr_t>p.dst_offset)
    nbytes[0] = p.nbytes
    i += 1
    while i < end:
        p = &sh.pieces[i]
        if (p.fault != 0 or not p.joins
                or <char*>(sh.dsts[p.tensor] + <intptr_t>p.dst_offset) != dst[0] + nbytes[0]):
            break
        nbytes[0] += p.nbytes
        i += 1
    return i


cdef int _copy_host(Shared* sh, Py_ssize_t c, char* slot) noexcept nogil:
    cdef Chunk* ch = &sh.chunks[c]
    cdef Piece* p
    cdef Py_ssize_t i = ch.first_piece, end = ch.first_piece + ch.n_pieces
    cdef size_t src, nbytes
    cdef char* dst
    while i < end:
        p = &sh.pieces[i]
        if p.fault != 0:            # a copy rule of the fault plan
            _fail(sh, ERR_RUNTIME, p.fault, CALL_HOST_MEMCPY, c, ch.offset + <int64_t>p.offset)
            return -1
        i = _next_copy(sh, ch, i, &src, &dst, &nbytes)
        memcpy(dst, slot + src, nbytes)
    _complete(sh, c)
    return 0


cdef int _copy_device(Worker* w, Py_ssize_t c, int s) noexcept nogil:
    cdef Shared* sh = w.sh
    cdef RuntimeTable* rt = sh.rt
    cdef Chunk* ch = &sh.chunks[c]
    cdef Piece* p
    cdef Py_ssize_t i = ch.first_piece, end = ch.first_piece + ch.n_pieces
    cdef size_t src, nbytes
    cdef char* dst
    cdef int code
    while i < end:
        p = &sh.pieces[i]
        if p.fault != 0:            # a copy rule: fails as the runtime would, uncalled
            _fail(sh, ERR_RUNTIME, p.fault, CALL_MEMCPY, c, ch.offset + <int64_t>p.offset)
            return -1
        i = _next_copy(sh, ch, i, &src, &dst, &nbytes)
        code = rt.memcpy_async(rt.ctx, <void*>dst, w.slots[s] + src, nbytes,
                               MEMCPY_HOST_TO_DEVICE, w.stream)
        if _runtime_call(w, code, CALL_MEMCPY, c, ch.offset + <int64_t>src):
            return -1
    if _runtime_call(w, rt.event_record(rt.ctx, w.events[s], w.stream),
                     CALL_EVENT_RECORD, c, ch.offset):
        return -1
    w.pending[s] = c
    return 0


cdef int _wait_slot(Worker* w, int s) noexcept nogil:
    """Waits for the copy out of slot s, then reports its chunk done."""
    cdef RuntimeTable* rt = w.sh.rt
    cdef Py_ssize_t c = w.pending[s]
    if c < 0:
        return 0
    w.pending[s] = -1
    if _runtime_call(w, rt.event_synchronize(rt.ctx, w.events[s]), CALL_EVENT_SYNCHRONIZE,
                     c, w.sh.chunks[c].offset):
        return -1
    _complete(w.sh, c)
    return 0


cdef void _run(Worker* w) noexcept nogil:
    cdef Shared* sh = w.sh
    cdef Py_ssize_t c
    cdef int s, turn = 0
    while True:
        c = _claim(sh)
        if c < 0:
            return
        s = turn % w.n_slots
        turn += 1
        if _wait_slot(w, s) != 0:
            return
        if sh.fetch != NULL and sh.mode == MODE_HOST and sh.skip == 0 and sh.chunks[c].fault == 0:
            if _fetch_to_host(sh, c) != 0:
                return
            continue
        if not (sh.skip & SKIP_READ_BIT) and _read_chunk(sh, c, w.slots[s]) != 0:
            return
        if sh.skip & SKIP_COPY_BIT:
            _complete(sh, c)
            continue
        if _await_dsts(sh, c) != 0:
            return
        if sh.mode == MODE_HOST:
            if _copy_host(sh, c, w.slots[s]) != 0:
                return
        elif _copy_device(w, c, s) != 0:
            return


cdef void _drain(Worker* w) noexcept nogil:
    """Waits for every copy this thread issued, then frees its stream and events."""
    cdef RuntimeTable* rt = w.sh.rt
    cdef int i
    if w.sh.mode != MODE_DEVICE:
        return
    for i in range(w.n_slots):
        if w.pending[i] >= 0 and w.events[i] != NULL:
            _wait_slot(w, i)
    if w.has_stream:
        # Also covers copies of a chunk whose event was never recorded.
        _runtime_call(w, rt.stream_synchronize(rt.ctx, w.stream), CALL_STREAM_SYNCHRONIZE, -1, 0)
    for i in range(w.n_slots):
        if w.events[i] != NULL:
            rt.event_destroy(rt.ctx, w.events[i])
            w.events[i] = NULL
    if w.has_stream:
        rt.stream_destroy(rt.ctx, w.stream)
        w.has_stream = False
    rt.get_last_error(rt.ctx)   # nothing of ours stays pending on this thread


cdef void* _work(void* arg) noexcept nogil:
    cdef Worker* w = <Worker*>arg
    cdef Shared* sh = w.sh
    if sh.mode == MODE_HOST or _setup_device(w) == 0:
        _run(w)
    _drain(w)
    pthread_mutex_lock(&sh.lock)
    sh.running -= 1
    pthread_cond_broadcast(&sh.cond)
    pthread_mutex_unlock(&sh.lock)
    return NULL


cdef bint _has_copy_entries(RuntimeTable* t) noexcept:
    return (t.set_device != NULL and t.get_last_error != NULL and t.memcpy_async != NULL
            and t.stream_create != NULL and t.stream_destroy != NULL
            and t.stream_synchronize != NULL and t.event_create != NULL
            and t.event_destroy != NULL and t.event_record != NULL
            and t.event_synchronize != NULL)


# -- the plan ----------------------------------------------------------------

def _group_bytes(list ranges, list joins):
    """Per tensor: the bytes of its group where it starts one (itself and
    the tensors after it that join it, lying back to back in one file),
    else its own."""
    cdef Py_ssize_t n = len(ranges), i, j
    out = [0] * n
    i = 0
    while i < n:
        fd, b, e = ranges[i]
        j = i + 1
        while j < n and joins[j] and ranges[j][0] == fd and ranges[j][1] == e:
            e = ranges[j][2]
            j += 1
        out[i] = e - b
        for k in range(i + 1, j):
            out[k] = ranges[k][2] - ranges[k][1]
        i = j
    return out


cdef class Plan:
    """Plan(tensors, chunk_size, *, faults=None, packed=False, joins=None):
    chunks and pieces of a load.

    ``tensors`` is a sequence of ``(fd, begin, end)`` file ranges, in
    reading order (file, then offset); tensor i is the i-th of them.
    ``packed``: the tensors with bytes are views of device blocks (see
    ``joins``), so a chunk is one copy per block however many tensors it
    holds, and chunks are cut every ``chunk_size`` bytes; otherwise a
    tensor that fits in one chunk starts a new chunk rather than being
    split (one copy per tensor).
    ``joins[i]`` (None: none): tensor i's destination continues tensor
    i - 1's, in one allocation (a view of the same block; in a load into
    given tensors, ``_into.joins``: destinations back to back in one
    allocation), so a chunk holding both copies them as one (and, not
    packed, such a group that fits in one chunk is cut into one); pieces
    of other tensors are copied one by one, wherever their destinations
    lie.
    ``faults`` is a ``FaultPlan`` (or None) whose ``read`` and ``copy``
    rules are resolved here, by position (see the module docstring).
    Allocates nothing but its own tables; no file is read.
    """

    cdef Chunk* chunks
    cdef Piece* pieces
    cdef size_t* sizes
    cdef readonly Py_ssize_t n_chunks
    cdef readonly Py_ssize_t n_pieces
    cdef readonly Py_ssize_t n_tensors
    cdef readonly size_t max_chunk       # the longest chunk: what a slot must hold
    cdef readonly unsigned long long total_bytes
    cdef bint taken                      # a Pipeline runs it: interleave_files refused

    def __init__(self, tensors, chunk_size, *, faults=None, bint packed=False, joins=None):
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
            raise TypeError(f"chunk_size must be an int, not {type(chunk_size).__name__}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if self.chunks != NULL:
            raise RuntimeError("Plan.__init__ may run only once")
        ranges = tensors if type(tensors) is list else list(tensors)
        cdef int64_t b, e
        cdef unsigned long long total = 0
        for i, (_, b, e) in enumerate(ranges):
            if b < 0 or e < b:
                raise ValueError(f"tensor {i}: bad file range [{b}, {e})")
            total += <unsigned long long>(e - b)
        # A chunk never exceeds what there is to read (so a huge chunk_size
        # neither overflows nor asks for huge slots).
        joins = list(joins) if joins is not None else [False] * len(ranges)
        if len(joins) != len(ranges):
            raise ValueError(f"{len(joins)} joins for {len(ranges)} tensors")
        self._cut(ranges, min(chunk_size, max(total, 1)), packed, joins)
        self.total_bytes = total
        if faults is not None:
            self._faults(faults)

    cdef _cut(self, list ranges, size_t chunk_size, bint packed, list joins):
        """Cuts the tensors into chunks of at most chunk_size and their pieces.

        Consecutive tensors of one file share a chunk while they fit whole
        (packed: while the chunk has room); a larger tensor fills whole
        chunks, and its tail may share the next.  Not packed, a *group*
        (a tensor and those after it that join it: one copy wherever a
        chunk holds them together) is kept whole as a tensor is: one that
        fits in a chunk but not in what is left of the open one starts the
        next; a tensor that joins the one before never starts a chunk for
        want of room (its piece is part of the same copy)."""
        cdef Py_ssize_t n = len(ranges), i, bound = 0, nc = 0, np_ = 0
        cdef int64_t b, e, pos, start = 0
        cdef size_t length = 0, take, need
        cdef int fd, cur_fd = -1
        cdef bint open_ = False
        for _, b, e in ranges:
            bound += (e - b) // <int64_t>chunk_size + 2
        groups = _group_bytes(ranges, joins)
        self.n_tensors = n
        self.chunks = <Chunk*>calloc(max(bound, 1), sizeof(Chunk))
        self.pieces = <Piece*>calloc(max(bound, 1), sizeof(Piece))
        self.sizes = <size_t*>calloc(max(n, 1), sizeof(size_t))
        if self.chunks == NULL or self.pieces == NULL or self.sizes == NULL:
            raise MemoryError(f"no memory to plan {bound} chunks of {chunk_size} bytes")
        for i in range(n):
            fd, b, e = ranges[i]
            self.sizes[i] = <size_t>(e - b)
            pos = b
            need = <size_t>groups[i] if <size_t>groups[i] <= chunk_size else <size_t>(e - b)
            if not packed and open_ and not joins[i] and need > chunk_size - length:
                # A tensor that does not fit in what is left of the open chunk
                # starts the next one: a tensor of at most chunk_size is then
                # one piece, one copy (a MoE shard's experts, many cut in two
                # pieces, lowered what the copies could move; docs/design.md,
                # "Measured: a tensor in one piece").
                nc += 1
                open_ = False
            while pos < e:
                if open_ and (fd != cur_fd or pos != start + <int64_t>length or length == chunk_size):
                    nc += 1
                    open_ = False
                if not open_:
                    self.chunks[nc].fd = fd
                    self.chunks[nc].offset = pos
                    self.chunks[nc].length = 0
                    self.chunks[nc].first_piece = np_
                    self.chunks[nc].n_pieces = 0
                    cur_fd, start, length, open_ = fd, pos, 0, True
                take = min(<size_t>(e - pos), chunk_size - length)
                self.pieces[np_].tensor = i
                self.pieces[np_].offset = length
                self.pieces[np_].dst_offset = <size_t>(pos - b)
                self.pieces[np_].nbytes = take
                self.pieces[np_].joins = pos == b and joins[i]
                np_ += 1
                self.chunks[nc].n_pieces += 1
                length += take
                self.chunks[nc].length = length
                if length > self.max_chunk:
                    self.max_chunk = length
                pos += <int64_t>take
        if open_:
            nc += 1
        self.n_chunks = nc
        self.n_pieces = np_

    cdef _faults(self, plan):
        from instant_staging.faults import FaultPlan
        if not isinstance(plan, FaultPlan):
            raise TypeError(f"faults must be a FaultPlan or None, not {type(plan).__name__}")
        reads = [r for r in plan.rules if r.op == "read"]
        copies = [r for r in plan.rules if r.op == "copy"]
        cdef Py_ssize_t i
        if reads:
            for i in range(self.n_chunks):
                for rule in reads:
                    if rule.matches(i + 1, self.chunks[i].length):
                        self.chunks[i].fault = rule.code
                        break
        if copies:
            for i in range(self.n_pieces):
                for rule in copies:
                    if rule.matches(i + 1, self.pieces[i].nbytes):
                        self.pieces[i].fault = rule.code
                        break

    def tensor_at(self, Py_ssize_t chunk, int64_t offset):
        """The tensor whose piece of ``chunk`` holds file ``offset`` (or the
        chunk's first tensor); -1 without a chunk."""
        cdef Chunk* ch
        cdef Piece* p
        cdef Py_ssize_t i
        if chunk < 0 or chunk >= self.n_chunks:
            return -1
        ch = &self.chunks[chunk]
        for i in range(ch.first_piece, ch.first_piece + ch.n_pieces):
            p = &self.pieces[i]
            if ch.offset + <int64_t>(p.offset + p.nbytes) > offset:
                return p.tensor
        return self.pieces[ch.first_piece].tensor

    def chunk(self, Py_ssize_t chunk):
        """``(file, offset, length)`` of ``chunk``: what a reader reads (or a
        remote source fetches: ``_remote.RemoteShards.prefetch``) for it."""
        if chunk < 0 or chunk >= self.n_chunks:
            raise IndexError(f"chunk {chunk} of {self.n_chunks}")
        return (self.chunks[chunk].fd, self.chunks[chunk].offset, self.chunks[chunk].length)

    def interleave_files(self):
        """Reorders the chunks so that each file's are spread evenly over the
        load (by their place in their file; each file's keep their order),
        where they came file by file: the readers then take the files'
        chunks in turn.  For a load that fills a cache (``_cache``): each
        object's ranges are written into a partial file of its own, and a
        file system writes one file's ranges one at a time (ext4 and xfs
        take its inode's lock for each), several files' side by side
        (docs/design.md, "Measured: a cache fill's writes").  Before the
        load's pipeline is made; nothing else changes."""
        cdef Py_ssize_t i, n = self.n_chunks
        cdef Chunk* moved
        if self.taken:
            raise RuntimeError("a Plan's chunks are reordered only before a Pipeline runs it")
        counts, place = {}, []
        for i in range(n):
            k = counts.get(self.chunks[i].fd, 0)
            counts[self.chunks[i].fd] = k + 1
            place.append(k)
        if len(counts) < 2:
            return
        order = sorted(range(n), key=lambda c: ((place[c] + 0.5) / counts[self.chunks[c].fd], c))
        moved = <Chunk*>malloc(n * sizeof(Chunk))
        if moved == NULL:
            raise MemoryError(f"no memory to reorder {n} chunks")
        for i in range(n):
            moved[i] = self.chunks[<Py_ssize_t>order[i]]
        free(self.chunks)
        self.chunks = moved

    def __dealloc__(self):
        free(self.chunks)
        free(self.pieces)
        free(self.sizes)


# -- running pipelines, for the exit hook ------------------------------------

# How long the exit hook lets a consumer thread inside a load run to where
# it parks (the next batch of allocations, the next wait(), the end of its
# next(): about a millisecond).
_PARK_WAIT = 2.0

_running = weakref.WeakSet()

# Set by the exit hook: from then on a consumer thread other than the one
# running the hook parks instead of going on (``_park_if_exiting``).
cdef bint _exiting = False
cdef pthread_t _exit_thread

# Threads inside a load's code for its consumer (``enter_load()`` to
# ``leave_load()``: a LoadIterator's next()), and how many of them parked
# at exit; a thread's own depth, so that a next() inside a next() (a
# progress callback's) counts it once.
cdef extern from *:
    """
    static int is_inside = 0, is_parked = 0;
    static __thread int is_depth = 0;
    static void is_enter(void) {
        if (is_depth++ == 0) __atomic_add_fetch(&is_inside, 1, __ATOMIC_SEQ_CST);
    }
    static void is_leave(void) {
        if (--is_depth == 0) __atomic_sub_fetch(&is_inside, 1, __ATOMIC_SEQ_CST);
    }
    static void is_count_parked(void) {
        if (is_depth > 0) __atomic_add_fetch(&is_parked, 1, __ATOMIC_SEQ_CST);
    }
    /* Threads inside a load, not parked, other than the calling one. */
    static int is_running_inside(void) {
        return __atomic_load_n(&is_inside, __ATOMIC_SEQ_CST)
               - __atomic_load_n(&is_parked, __ATOMIC_SEQ_CST) - (is_depth > 0);
    }
    /* A fork child has only the thread that forked. */
    static void is_forget_others(void) {
        is_inside = is_depth > 0;
        is_parked = 0;
    }
    """
    void is_enter() noexcept nogil
    void is_leave() noexcept nogil
    void is_count_parked() noexcept nogil
    int is_running_inside() noexcept nogil
    void is_forget_others() noexcept nogil


cdef void _park_if_exiting() noexcept nogil:
    # At exit only daemon threads are left besides the main thread; one
    # that went on would race the interpreter's finalization through
    # Python and torch code (torch aborts the process when a daemon thread
    # is caught inside one of its calls that released the GIL: "terminate
    # called without an active exception", from a view being made or a
    # tensor being freed).  Parked without the GIL it is simply dropped
    # with the process.  It is counted first: the exit hook waits for it.
    if _exiting and not pthread_equal(pthread_self(), _exit_thread):
        is_count_parked()
        while True:
            sleep(3600)


def enter_load():
    """The calling thread runs a load's code for its consumer from here
    (``LoadIterator.__next__``) until ``leave_load()``; after interpreter
    exit began, it parks here instead."""
    is_enter()
    with nogil:
        _park_if_exiting()


def leave_load():
    """The calling thread leaves a load's code, its result (a tensor, an
    error) going to its caller; after interpreter exit began, it parks here
    instead, so that no caller's loop goes on to free or use a tensor
    while the interpreter finalizes."""
    with nogil:
        _park_if_exiting()
    is_leave()


def _stop_all_at_exit():
    # Registered after _staging's hook (imported above), so it runs first:
    # every reader is stopped and joined (no write into a staging buffer,
    # no call into a runtime being torn down) before the buffers are
    # released; consumers stay parked (above).
    global _exiting, _exit_thread
    _exit_thread = pthread_self()
    _exiting = True
    pipes = list(_running)
    for pipe in pipes:
        try:
            pipe.close()
        except BaseException:
            pass
    # A consumer inside a load (allocating its tensors, making views:
    # torch calls that release the GIL) is let run to where it parks, so
    # that the finalization never catches it inside one.
    deadline = time.monotonic() + _PARK_WAIT
    while is_running_inside() > 0 and time.monotonic() < deadline:
        time.sleep(0.001)


def _forget_other_threads():
    is_forget_others()


os.register_at_fork(after_in_child=_forget_other_threads)
atexit.register(_stop_all_at_exit)


# -- the Python face ---------------------------------------------------------

@cython.no_gc_clear  # __dealloc__ joins the threads and drops the hold on staging
cdef class Pipeline:
    """Runs a Plan once: reader threads copy its tensors out of slots.

    Pipeline(plan, *, threads, staging=None, depth=None, device=None, skip=0, fetch=None)

    staging  a StagingBuffer whose registrations give the slots (whole
             slots inside each registration); held until the threads are
             joined.  Required with ``device``.
    depth    without ``staging`` (host mode only): this many slots of
             ordinary memory owned by the pipeline; with it, at most this
             many of its slots (None: all, up to MAX_SLOTS_PER_THREAD per
             thread).
    device   None: pieces are memcpy'd to host addresses; an int: copied to
             that device through ``staging.runtime``.
    threads  reader threads wanted (fewer when there are fewer slots or
             chunks).
    skip     benchmarks only: SKIP_READ and/or SKIP_COPY leave that side out.
    fetch    None: chunks are pread from the plan's descriptors; else a
             callable ``fetch(file, offset, length) -> buffer`` (a remote
             source, ``_remote.py``; the plan's "descriptors" are then file
             indexes), called by the reader threads with the GIL; its
             ``cancel()``, where it has one, is called by ``cancel()`` and
             ``close()``.

    ``start(dsts)`` launches the threads (``dsts[i]``: where tensor i goes;
    with ``more=True`` only the first tensors' destinations, the rest
    following through ``provide(dsts)`` while the threads already read);
    ``wait()`` reports progress; ``cancel()`` asks them to stop; ``close()``
    stops, joins and releases the staging buffer (idempotent, any thread).
    """

    cdef Plan plan
    cdef Shared sh
    cdef Worker* workers
    cdef int n_workers
    cdef int started
    cdef bint joined
    cdef bint closed
    cdef bint sync_init
    cdef pthread_mutex_t join_lock
    cdef Py_ssize_t seen
    cdef char** slot_ptrs
    cdef Py_ssize_t n_slots
    cdef size_t slot_size
    cdef char* own_slots
    cdef void** events
    cdef Py_ssize_t* pending
    cdef Runtime runtime
    cdef StagingBuffer staging
    cdef bint holding
    cdef int pid
    cdef readonly object fetch
    cdef object __weakref__

    def __cinit__(self, *args, **kwargs):
        self.joined = True
        self.pid = getpid()

    def __init__(self, Plan plan not None, *, threads, StagingBuffer staging=None,
                 depth=None, device=None, int skip=0, fetch=None):
        if self.plan is not None:
            raise RuntimeError("Pipeline.__init__ may run only once")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        if skip & ~(SKIP_READ_BIT | SKIP_COPY_BIT):
            raise ValueError(f"skip must be a combination of SKIP_READ and SKIP_COPY, got {skip}")
        self.sh.skip = skip
        if fetch is not None:
            if not callable(fetch):
                raise TypeError(f"fetch must be callable, not {type(fetch).__name__}")
            self.fetch = fetch
            self.sh.fetch = <void*>fetch
        if device is not None and staging is None:
            raise ValueError("device copies need a staging buffer (its runtime copies)")
        if staging is None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
            raise ValueError(f"without a staging buffer, depth must be an int >= 1, got {depth!r}")
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
            raise ValueError(f"depth must be None or an int >= 1, got {depth!r}")
        self.plan = plan
        self.slot_size = max(plan.max_chunk, 1)
        # A thread gains nothing from more slots than MAX_SLOTS_PER_THREAD,
        # and the load from more than one per chunk.
        cdef Py_ssize_t cap = max(1, min(plan.n_chunks, min(threads, 1 << 20) * MAX_SLOTS_PER_THREAD))
        if depth is not None:
            cap = min(cap, depth)
        if device is not None:
            if not _has_copy_entries(&staging._runtime.table):
                raise RuntimeError(f"runtime {staging._runtime.name!r} lacks the stream, event or "
                                   "copy entries of the runtime table that device copies need")
            self.runtime = staging._runtime
            self.sh.rt = &self.runtime.table
            self.sh.mode = MODE_DEVICE
            self.sh.device = device
        else:
            self.sh.mode = MODE_HOST
        if staging is not None:
            self._hold(staging)
            self._staging_slots(cap)
        else:
            self._own_slots(cap)
        pthread_mutex_init(&self.sh.lock, NULL)
        pthread_cond_init(&self.sh.cond, NULL)
        pthread_mutex_init(&self.join_lock, NULL)
        self.sync_init = True
        self.sh.chunks = plan.chunks
        plan.taken = True           # (its chunks are read from here: never reordered after)
        self.sh.pieces = plan.pieces
        self.sh.n_chunks = plan.n_chunks
        self.sh.remaining = <size_t*>calloc(max(plan.n_tensors, 1), sizeof(size_t))
        self.sh.done = <Py_ssize_t*>malloc(max(plan.n_tensors, 1) * sizeof(Py_ssize_t))
        self.sh.dsts = <intptr_t*>calloc(max(plan.n_tensors, 1), sizeof(intptr_t))
        if self.sh.remaining == NULL or self.sh.done == NULL or self.sh.dsts == NULL:
            raise MemoryError()
        self._assign(<int>min(threads, self.n_slots, max(plan.n_chunks, 1)))

    cdef _hold(self, StagingBuffer staging):
        # Check and take in one step under the GIL: two loads through one
        # buffer would overwrite each other's slots.
        if staging._released or staging._ptr == NULL:
            raise ValueError("staging buffer is closed")
        if staging._holds > 0:
            raise RuntimeError("this staging buffer is in use by another load; "
                               "loads through one buffer must not overlap")
        staging._holds += 1
        self.staging = staging
        self.holding = True

    cdef _release_hold(self):
        if self.holding:
            self.holding = False
            self.staging._holds -= 1

    cdef _staging_slots(self, Py_ssize_t cap):
        """Whole slots inside each registration, at most ``cap``."""
        cdef StagingBuffer buf = self.staging
        cdef Py_ssize_t n = 0, k
        cdef size_t r, nreg = buf.n_registrations(), seg_offset = 0, seg_size = 0, i
        for r in range(nreg):
            buf.registration(r, &seg_offset, &seg_size)
            n += <Py_ssize_t>min(<size_t>cap, seg_size // self.slot_size)
            if n >= cap:
                n = cap
                break
        if n == 0:
            self._release_hold()
            raise ValueError(
                f"the staging buffer ({buf.size} bytes in {nreg} registration(s)) holds no "
                f"chunk of {self.slot_size} bytes inside one registration: pass a larger "
                "buffer or a smaller chunk_size")
        self.slot_ptrs = <char**>malloc(n * sizeof(char*))
        if self.slot_ptrs == NULL:
            raise MemoryError()
        k = 0
        for r in range(nreg):
            buf.registration(r, &seg_offset, &seg_size)
            i = 0
            while k < n and (i + 1) * self.slot_size <= seg_size:
                self.slot_ptrs[k] = buf.data() + seg_offset + i * self.slot_size
                k += 1
                i += 1
        self.n_slots = n

    cdef _own_slots(self, Py_ssize_t n):
        """n slots of ordinary page-aligned memory: a copy to CPU memory
        gains nothing from pinning."""
        cdef void* p = NULL
        cdef Py_ssize_t k
        if posix_memalign(&p, 4096, n * self.slot_size) != 0:
            raise MemoryError(f"could not allocate {n} slots of {self.slot_size} bytes")
        self.own_slots = <char*>p
        self.slot_ptrs = <char**>malloc(n * sizeof(char*))
        if self.slot_ptrs == NULL:
            raise MemoryError()
        for k in range(n):
            self.slot_ptrs[k] = self.own_slots + k * self.slot_size
        self.n_slots = n

    cdef _assign(self, int threads):
        """Gives thread t the slots t, t + threads, t + 2 * threads, ..."""
        cdef Py_ssize_t n = self.n_slots, i, k, per
        cdef int t
        cdef char** ordered
        threads = max(1, threads)
        self.workers = <Worker*>calloc(threads, sizeof(Worker))
        ordered = <char**>malloc(n * sizeof(char*))
        self.events = <void**>calloc(n, sizeof(void*))
        self.pending = <Py_ssize_t*>malloc(n * sizeof(Py_ssize_t))
        if self.workers == NULL or ordered == NULL or self.events == NULL or self.pending == NULL:
            free(ordered)
            raise MemoryError()
        self.n_workers = threads
        k = 0
        for t in range(threads):
            self.workers[t].sh = &self.sh
            self.workers[t].slots = &ordered[k]
            self.workers[t].events = &self.events[k]
            self.workers[t].pending = &self.pending[k]
            per = 0
            i = t
            while i < n:
                ordered[k] = self.slot_ptrs[i]
                self.pending[k] = -1
                k += 1
                per += 1
                i += threads
            self.workers[t].n_slots = <int>per
        free(self.slot_ptrs)
        self.slot_ptrs = ordered

    @property
    def n_chunks(self):
        return self.sh.n_chunks

    @property
    def n_threads(self):
        return self.n_workers

    @property
    def slots(self):
        """Slot count of this pipeline."""
        return self.n_slots

    @property
    def slot_bytes(self):
        return self.slot_size

    def start(self, dsts, *, bint more=False):
        """Starts the reader threads (fewer if the system refuses some);
        ``dsts[i]`` is the address tensor i of the plan is copied to.  With
        ``more=True``, ``dsts`` may cover only the first tensors and
        ``provide()`` gives the others' in order; a thread whose chunk needs
        one not given yet waits for it (or for the load to stop)."""
        cdef int t, rc = 0
        cdef Py_ssize_t i
        if self.started or self.plan is None:
            raise RuntimeError("a Pipeline runs once")
        if self.closed:
            return      # cancelled before it started: wait() reports CANCELLED
        if len(dsts) > self.plan.n_tensors or (not more and len(dsts) != self.plan.n_tensors):
            raise ValueError(f"{len(dsts)} destinations for {self.plan.n_tensors} tensors")
        if getpid() != self.pid:
            raise RuntimeError("a Pipeline made before fork() cannot start in the child")
        for i in range(len(dsts)):
            self.sh.dsts[i] = <intptr_t>dsts[i]
        self.sh.n_ready = len(dsts)
        for i in range(self.plan.n_tensors):
            self.sh.remaining[i] = self.plan.sizes[i]
            if self.plan.sizes[i] == 0:      # nothing to copy: done from the start
                self.sh.done[self.sh.n_done] = i
                self.sh.n_done += 1
        _running.add(self)
        with nogil:
            pthread_mutex_lock(&self.join_lock)
            self.joined = False
            pthread_mutex_lock(&self.sh.lock)
            self.sh.running = self.n_workers
            pthread_mutex_unlock(&self.sh.lock)
            for t in range(self.n_workers):
                rc = pthread_create(&self.workers[t].tid, NULL, _work, &self.workers[t])
                if rc != 0:
                    break
                self.started += 1
            pthread_mutex_lock(&self.sh.lock)
            self.sh.running -= self.n_workers - self.started
            pthread_mutex_unlock(&self.sh.lock)
            if self.started == 0:
                self.joined = True
            pthread_mutex_unlock(&self.join_lock)
        if self.started == 0:
            _fail(&self.sh, ERR_THREAD, rc, CALL_NONE, -1, 0)

    def provide(self, dsts):
        """The destinations of the next tensors after those already given
        (``start(..., more=True)``).  Only the thread that started the load.
        Returns False once the load is closed (allocate no more): then
        nothing reads them.  At interpreter exit it parks the calling thread
        (see ``_park_if_exiting``) instead of returning."""
        cdef Py_ssize_t n = len(dsts), i, first
        if not self.sync_init or self.plan is None:
            raise RuntimeError("Pipeline was not initialised")
        with nogil:
            _park_if_exiting()
        if self.closed:
            return False
        first = self.sh.n_ready      # only this thread writes n_ready
        if first + n > self.plan.n_tensors:
            raise ValueError(f"{first + n} destinations for {self.plan.n_tensors} tensors")
        for i in range(n):
            self.sh.dsts[first + i] = <intptr_t>dsts[i]
        with nogil:
            pthread_mutex_lock(&self.sh.lock)
            self.sh.n_ready = first + n
            pthread_cond_broadcast(&self.sh.cond)
            pthread_mutex_unlock(&self.sh.lock)
        return True

    def wait(self, double timeout):
        """Waits up to ``timeout`` seconds for a tensor to finish.

        Returns ``(finished_tensors, done_bytes, all_threads_exited, failed)``
        where finished_tensors are the tensors finished since the last call.
        In a fork child (the threads are the parent's) it raises.
        """
        cdef Py_ssize_t n
        cdef unsigned long long nbytes
        cdef int running, failed
        cdef timespec deadline
        if getpid() != self.pid:
            raise RuntimeError(f"this load was started by process {self.pid}; its reader "
                               "threads do not exist in this forked child")
        if not self.sync_init:
            raise RuntimeError("Pipeline was not initialised")
        with nogil:
            _park_if_exiting()
        clock_gettime(CLOCK_REALTIME, &deadline)
        deadline.tv_sec += <long>timeout
        deadline.tv_nsec += <long>((timeout - <long>timeout) * 1e9)
        if deadline.tv_nsec >= 1000000000:
            deadline.tv_sec += 1
            deadline.tv_nsec -= 1000000000
        with nogil:
            pthread_mutex_lock(&self.sh.lock)
            if (self.sh.n_done == self.seen and self.sh.running > 0
                    and self.sh.err_kind == ERR_NONE and timeout > 0):
                pthread_cond_timedwait(&self.sh.cond, &self.sh.lock, &deadline)
            n = self.sh.n_done
            nbytes = self.sh.done_bytes
            running = self.sh.running
            failed = self.sh.err_kind != ERR_NONE
            pthread_mutex_unlock(&self.sh.lock)
            _park_if_exiting()
        finished = [self.sh.done[i] for i in range(self.seen, n)]
        self.seen = n
        return finished, nbytes, running == 0, bool(failed)

    def cancel(self):
        """Asks the threads to stop after their current chunk; the load then
        reports CANCELLED unless it already failed.  Any thread."""
        if not self.sync_init or getpid() != self.pid:
            return
        _fail(&self.sh, ERR_CANCELLED, 0, CALL_NONE, -1, 0)
        self._cancel_fetch()

    cdef _cancel_fetch(self):
        # A remote fetch waiting to retry a range ends its wait (_remote._Fetch).
        cancel = getattr(self.fetch, "cancel", None)
        if cancel is not None:
            cancel()

    def close(self):
        """Cancels, waits for every in-flight copy, joins the threads, then
        releases the staging buffer.  Idempotent; any thread."""
        if not self.sync_init:
            self._release_hold()
            return
        if getpid() != self.pid:
            # A fork child: the threads (and maybe a held lock) are the
            # parent's.  Touch neither; nothing runs here.
            self.joined = True
        else:
            # A load closed before it finished was cancelled (a finished
            # one has no reader left to notice).
            _fail(&self.sh, ERR_CANCELLED, 0, CALL_NONE, -1, 0)
            self._cancel_fetch()
            self._join()
        self.closed = True
        _running.discard(self)
        self._release_hold()
        free(self.own_slots)
        self.own_slots = NULL

    cdef void _join(self) noexcept:
        cdef int t
        # join_lock: close() may run in several threads at once (a cancel
        # from a watchdog, the consumer, the exit hook): one joins each thread.
        with nogil:
            pthread_mutex_lock(&self.join_lock)
            if not self.joined:
                for t in range(self.started):
                    pthread_join(self.workers[t].tid, NULL)
                self.joined = True
            pthread_mutex_unlock(&self.join_lock)

    def error(self):
        """None, or ``(kind, code, call, chunk, offset)`` of the first error."""
        if self.sh.err_kind == ERR_NONE:
            return None
        return (self.sh.err_kind, self.sh.err_code, CALLS[self.sh.err_call],
                self.sh.err_chunk, self.sh.err_offset)

    def __dealloc__(self):
        # (In a fork child the parent's threads do not exist: nothing to
        # stop or join, and its locks may have been copied held.)
        if self.sync_init and getpid() == self.pid:
            with nogil:
                pthread_mutex_lock(&self.sh.lock)
                self.sh.stop = 1
                pthread_mutex_unlock(&self.sh.lock)
            self._join()
        if self.holding:
            self.staging._holds -= 1
        free(self.sh.remaining)
        free(self.sh.done)
        free(self.sh.dsts)
        free(self.workers)
        free(self.slot_ptrs)
        free(self.events)
        free(self.pending)
        free(self.own_slots)
        if self.sync_init and getpid() == self.pid:
            pthread_mutex_destroy(&self.sh.lock)
            pthread_cond_destroy(&self.sh.cond)
            pthread_mutex_destroy(&self.join_lock)
