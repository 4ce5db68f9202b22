# cython: language_level=3
"""The loader's copy pipeline: reader threads in C, without the GIL.

At 40 GB/s and 8 MiB chunks a loader moves 5,000 chunks a second; Python
threads would hold the GIL for every read, copy and event call.  Here the
whole per-chunk path runs in plain C threads:

    claim the next chunk -> wait for the slot's previous copy (its event)
    -> pread the chunk into the slot -> copy each piece to its tensor
    -> record the slot's event

A *chunk* is a contiguous file range of at most one slot; a *piece* is
the part of one tensor inside one chunk, so small tensors share a chunk
and large ones span several.  Each thread owns its own slots (as in the
C program of FIELD_NOTES.md that reached 41 GB/s), so no thread waits on
another.  Device copies go through the runtime table on the thread's
own stream (after ``set_device``: the current device is per thread); in
host mode a piece is a ``memcpy`` into CPU memory.

A tensor is reported done only once every copy into it has finished, so
a consumer may use it on any stream.  The first error stops every
thread; each thread then waits for its in-flight copies before it exits,
so ``join()`` returning means nothing writes into the destinations any
more and they may be freed.
"""

from libc.stdint cimport intptr_t, int64_t
from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memcpy
from libc.errno cimport errno, EINTR
from posix.unistd cimport pread
from posix.time cimport clock_gettime, timespec, CLOCK_REALTIME

from instant_staging._runtime cimport Runtime, RuntimeTable, MEMCPY_HOST_TO_DEVICE

cdef extern from "<stdlib.h>" nogil:
    int posix_memalign(void** memptr, size_t alignment, size_t size)

from instant_staging._pthread cimport (
    pthread_t, pthread_mutex_t, pthread_cond_t, pthread_create, pthread_join,
    pthread_mutex_init, pthread_mutex_destroy, pthread_mutex_lock, pthread_mutex_unlock,
    pthread_cond_init, pthread_cond_destroy, pthread_cond_broadcast, pthread_cond_timedwait)

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

# benchmarks/profile_load.py takes the pipeline apart: SKIP_READ copies
# whatever the slot holds (the copy side alone), SKIP_COPY only reads (the
# read side alone, the host's parallel-read ceiling).
cdef enum:
    SKIP_NONE = 0
    SKIP_READ_BIT = 1
    SKIP_COPY_BIT = 2

# The same, for Python callers.
HOST, DEVICE = MODE_HOST, MODE_DEVICE
SKIP_READ, SKIP_COPY = SKIP_READ_BIT, SKIP_COPY_BIT
READ_ERROR, END_OF_FILE, RUNTIME_ERROR, THREAD_ERROR = ERR_READ, ERR_EOF, ERR_RUNTIME, ERR_THREAD

# Which runtime call failed (error()[2]).
CALLS = ("", "set_device", "stream_create", "event_create", "memcpy_async",
         "event_record", "event_synchronize", "stream_synchronize")
cdef enum:
    CALL_NONE, CALL_SET_DEVICE, CALL_STREAM_CREATE, CALL_EVENT_CREATE, CALL_MEMCPY,
    CALL_EVENT_RECORD, CALL_EVENT_SYNCHRONIZE, CALL_STREAM_SYNCHRONIZE


cdef struct Chunk:
    int fd
    int64_t offset          # in the file
    size_t length
    Py_ssize_t first_piece
    Py_ssize_t n_pieces


cdef struct Piece:
    Py_ssize_t tensor
    size_t offset           # in the chunk
    intptr_t dst
    size_t nbytes


cdef struct Shared:
    pthread_mutex_t lock
    pthread_cond_t cond
    Chunk* chunks
    Py_ssize_t n_chunks
    Py_ssize_t next_chunk
    Piece* pieces
    size_t* remaining       # per tensor: bytes not yet copied
    Py_ssize_t* done        # tensors in the order they completed
    Py_ssize_t n_done
    unsigned long long done_bytes
    int stop
    int running
    RuntimeTable* rt
    int mode
    int device
    Py_ssize_t fail_chunk   # tests: this chunk's read fails with EIO
    int skip                # benchmarks: SKIP_READ / SKIP_COPY bits
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


cdef int _read_chunk(Shared* sh, Py_ssize_t c, char* slot) noexcept nogil:
    cdef Chunk* ch = &sh.chunks[c]
    cdef size_t got = 0
    cdef ssize_t n
    if c == sh.fail_chunk:
        _fail(sh, ERR_READ, 5, CALL_NONE, c, ch.offset)   # EIO
        return -1
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


cdef int _copy_host(Shared* sh, Py_ssize_t c, char* slot) noexcept nogil:
    cdef Chunk* ch = &sh.chunks[c]
    cdef Piece* p
    cdef Py_ssize_t i
    for i in range(ch.first_piece, ch.first_piece + ch.n_pieces):
        p = &sh.pieces[i]
        memcpy(<void*>p.dst, slot + p.offset, p.nbytes)
    _complete(sh, c)
    return 0


cdef int _copy_device(Worker* w, Py_ssize_t c, int s) noexcept nogil:
    cdef Shared* sh = w.sh
    cdef RuntimeTable* rt = sh.rt
    cdef Chunk* ch = &sh.chunks[c]
    cdef Piece* p
    cdef Py_ssize_t i
    for i in range(ch.first_piece, ch.first_piece + ch.n_pieces):
        p = &sh.pieces[i]
        if _runtime_call(w, rt.memcpy_async(rt.ctx, <void*>p.dst, w.slots[s] + p.offset,
                                            p.nbytes, MEMCPY_HOST_TO_DEVICE, w.stream),
                         CALL_MEMCPY, c, ch.offset + <int64_t>p.offset):
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
        if not (sh.skip & SKIP_READ_BIT) and _read_chunk(sh, c, w.slots[s]) != 0:
            return
        if sh.skip & SKIP_COPY_BIT:
            _complete(sh, c)
        elif sh.mode == MODE_HOST:
            _copy_host(sh, c, w.slots[s])
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


# -- the Python face ---------------------------------------------------------

cdef class Pipeline:
    """Copies tensors from open files into destination memory through slots.

    Pipeline(runtime, mode, device, slots, threads, fds, begins, ends, dsts,
             chunk_size, fail_chunk=-1, skip=0)

    Tensor i is the byte range [begins[i], ends[i]) of file descriptor
    fds[i], copied to address dsts[i]; list tensors in reading order (file,
    then offset).  ``slots`` are addresses of chunk_size-byte slots, none
    crossing a registration boundary.  ``start()`` launches the threads;
    ``wait()`` reports progress; ``join()`` waits for them all.  ``skip``
    (benchmarks only) is SKIP_READ and/or SKIP_COPY: leave that side out.
    """

    cdef Shared sh
    cdef Worker* workers
    cdef int n_workers
    cdef int started
    cdef bint joined
    cdef Py_ssize_t seen
    cdef Py_ssize_t n_tensors
    cdef char** slot_ptrs
    cdef void** events
    cdef Py_ssize_t* pending
    cdef Runtime runtime
    cdef bint sync_init

    def __cinit__(self, *args, **kwargs):
        self.joined = True

    def __init__(self, Runtime runtime, int mode, int device, slots, int threads,
                 fds, begins, ends, dsts, size_t chunk_size, Py_ssize_t fail_chunk=-1,
                 int skip=0):
        if mode not in (MODE_HOST, MODE_DEVICE):
            raise ValueError(f"mode must be MODE_HOST or MODE_DEVICE, got {mode}")
        if mode == MODE_DEVICE and runtime is None:
            raise ValueError("device mode needs a runtime")
        if skip & ~(SKIP_READ_BIT | SKIP_COPY_BIT):
            raise ValueError(f"skip must be a combination of SKIP_READ and SKIP_COPY, got {skip}")
        if chunk_size == 0 or not slots or threads < 1:
            raise ValueError("need chunk_size > 0, at least one slot and one thread")
        if mode == MODE_DEVICE and not _has_copy_entries(&runtime.table):
            raise RuntimeError(f"runtime {runtime.name!r} lacks the stream, event or copy "
                               "entries of the runtime table that device copies need")
        self.runtime = runtime
        self.sh.rt = &runtime.table if runtime is not None else NULL
        self.sh.mode = mode
        self.sh.device = device
        self.sh.fail_chunk = fail_chunk
        self.sh.skip = skip
        pthread_mutex_init(&self.sh.lock, NULL)
        pthread_cond_init(&self.sh.cond, NULL)
        self.sync_init = True
        self._plan(fds, begins, ends, dsts, chunk_size)
        self._assign(slots, min(threads, len(slots)))

    cdef _plan(self, fds, begins, ends, dsts, size_t chunk_size):
        """Cuts the tensors into chunks of at most chunk_size and their pieces."""
        cdef Py_ssize_t n = len(fds), i, bound = 0, nc = 0, np_ = 0
        cdef int64_t b, e, pos, start = 0
        cdef size_t length = 0, take
        cdef intptr_t dst
        cdef int fd, cur_fd = -1
        cdef bint open_ = False
        if not (len(begins) == len(ends) == len(dsts) == n):
            raise ValueError("fds, begins, ends and dsts must have the same length")
        for i in range(n):
            bound += (<int64_t>ends[i] - <int64_t>begins[i] + chunk_size - 1) // chunk_size + 1
        self.n_tensors = n
        self.sh.chunks = <Chunk*>malloc(max(bound, 1) * sizeof(Chunk))
        self.sh.pieces = <Piece*>malloc(max(bound, 1) * sizeof(Piece))
        self.sh.remaining = <size_t*>calloc(max(n, 1), sizeof(size_t))
        self.sh.done = <Py_ssize_t*>malloc(max(n, 1) * sizeof(Py_ssize_t))
        if (self.sh.chunks == NULL or self.sh.pieces == NULL or self.sh.remaining == NULL
                or self.sh.done == NULL):
            raise MemoryError()
        for i in range(n):
            fd, b, e, dst = fds[i], begins[i], ends[i], dsts[i]
            if e < b:
                raise ValueError(f"tensor {i} ends before it begins")
            self.sh.remaining[i] = <size_t>(e - b)
            if e == b:     # nothing to copy: done from the start
                self.sh.done[self.sh.n_done] = i
                self.sh.n_done += 1
                continue
            pos = b
            while pos < e:
                if open_ and (fd != cur_fd or pos != start + <int64_t>length or length == chunk_size):
                    nc += 1
                    open_ = False
                if not open_:
                    self.sh.chunks[nc].fd = fd
                    self.sh.chunks[nc].offset = pos
                    self.sh.chunks[nc].length = 0
                    self.sh.chunks[nc].first_piece = np_
                    self.sh.chunks[nc].n_pieces = 0
                    cur_fd, start, length, open_ = fd, pos, 0, True
                take = min(<size_t>(e - pos), chunk_size - length)
                self.sh.pieces[np_].tensor = i
                self.sh.pieces[np_].offset = length
                self.sh.pieces[np_].dst = dst + <intptr_t>(pos - b)
                self.sh.pieces[np_].nbytes = take
                np_ += 1
                self.sh.chunks[nc].n_pieces += 1
                length += take
                self.sh.chunks[nc].length = length
                pos += <int64_t>take
        if open_:
            nc += 1
        self.sh.n_chunks = nc

    cdef _assign(self, slots, int threads):
        """Gives thread t the slots t, t + threads, t + 2 * threads, ..."""
        cdef Py_ssize_t n = len(slots), i
        cdef int t, k
        threads = max(1, min(threads, self.sh.n_chunks))
        self.workers = <Worker*>calloc(threads, sizeof(Worker))
        self.slot_ptrs = <char**>malloc(n * sizeof(char*))
        self.events = <void**>calloc(n, sizeof(void*))
        self.pending = <Py_ssize_t*>malloc(n * sizeof(Py_ssize_t))
        if (self.workers == NULL or self.slot_ptrs == NULL or self.events == NULL
                or self.pending == NULL):
            raise MemoryError()
        self.n_workers = threads
        k = 0
        for t in range(threads):
            self.workers[t].sh = &self.sh
            self.workers[t].slots = &self.slot_ptrs[k]
            self.workers[t].events = &self.events[k]
            self.workers[t].pending = &self.pending[k]
            i = t
            while i < n:
                self.slot_ptrs[k] = <char*><intptr_t>slots[i]
                self.pending[k] = -1
                k += 1
                i += threads
            self.workers[t].n_slots = <int>(&self.slot_ptrs[k] - self.workers[t].slots)

    @property
    def n_chunks(self):
        return self.sh.n_chunks

    @property
    def n_threads(self):
        return self.n_workers

    def start(self):
        """Starts the reader threads (fewer if the system refuses some)."""
        cdef int t, rc = 0
        if self.started or not self.joined:
            raise RuntimeError("a Pipeline runs once")
        self.joined = False
        with nogil:
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
            _fail(&self.sh, ERR_THREAD, rc, CALL_NONE, -1, 0)
            self.joined = True

    def wait(self, double timeout):
        """Waits up to ``timeout`` seconds for a tensor to finish.

        Returns ``(finished_tensors, done_bytes, all_threads_exited, failed)``
        where finished_tensors are the tensors finished since the last call.
        """
        cdef Py_ssize_t n
        cdef unsigned long long nbytes
        cdef int running, failed
        cdef timespec deadline
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
        finished = [self.sh.done[i] for i in range(self.seen, n)]
        self.seen = n
        return finished, nbytes, running == 0, bool(failed)

    def abort(self):
        """Asks the threads to stop after their current chunk."""
        with nogil:
            pthread_mutex_lock(&self.sh.lock)
            self.sh.stop = 1
            pthread_cond_broadcast(&self.sh.cond)
            pthread_mutex_unlock(&self.sh.lock)

    def join(self):
        """Waits for every thread; afterwards no copy is in flight."""
        self._join()

    cdef void _join(self) noexcept:
        cdef int t
        if self.joined:
            return
        with nogil:
            for t in range(self.started):
                pthread_join(self.workers[t].tid, NULL)
        self.joined = True

    def error(self):
        """None, or ``(kind, code, call, chunk, offset)`` of the first error."""
        if self.sh.err_kind == ERR_NONE:
            return None
        return (self.sh.err_kind, self.sh.err_code, CALLS[self.sh.err_call],
                self.sh.err_chunk, self.sh.err_offset)

    def tensor_at(self, Py_ssize_t chunk, int64_t offset):
        """The tensor whose piece of ``chunk`` holds file ``offset`` (or the
        chunk's first tensor); -1 without a chunk."""
        cdef Chunk* ch
        cdef Piece* p
        cdef Py_ssize_t i
        if chunk < 0 or chunk >= self.sh.n_chunks:
            return -1
        ch = &self.sh.chunks[chunk]
        for i in range(ch.first_piece, ch.first_piece + ch.n_pieces):
            p = &self.sh.pieces[i]
            if ch.offset + <int64_t>(p.offset + p.nbytes) > offset:
                return p.tensor
        return self.sh.pieces[ch.first_piece].tensor

    def chunk_fd(self, Py_ssize_t chunk):
        return self.sh.chunks[chunk].fd if 0 <= chunk < self.sh.n_chunks else -1

    def __dealloc__(self):
        if self.sync_init:
            with nogil:
                pthread_mutex_lock(&self.sh.lock)
                self.sh.stop = 1
                pthread_mutex_unlock(&self.sh.lock)
        self._join()
        free(self.sh.chunks)
        free(self.sh.pieces)
        free(self.sh.remaining)
        free(self.sh.done)
        free(self.workers)
        free(self.slot_ptrs)
        free(self.events)
        free(self.pending)
        if self.sync_init:
            pthread_mutex_destroy(&self.sh.lock)
            pthread_cond_destroy(&self.sh.cond)


cdef class HostArea:
    """Ordinary page-aligned memory for slots when pinning buys nothing
    (a load to the CPU without a staging buffer)."""

    cdef char* ptr
    cdef readonly size_t size

    def __cinit__(self, size_t size):
        cdef void* p = NULL
        if size == 0:
            raise ValueError("size must be > 0")
        if posix_memalign(&p, 4096, size) != 0:
            raise MemoryError(f"could not allocate {size} bytes of host memory")
        self.ptr = <char*>p
        self.size = size

    def spans(self, offset=0, nbytes=None):
        """The whole area as one span, like StagingBuffer.spans()."""
        if self.ptr == NULL:
            raise ValueError("operation on a closed HostArea")
        return [(<intptr_t>self.ptr, self.size)]

    @property
    def closed(self):
        return self.ptr == NULL

    def close(self):
        free(self.ptr)
        self.ptr = NULL

    def __dealloc__(self):
        free(self.ptr)

