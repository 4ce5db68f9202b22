# cython: language_level=3
"""The page cache: whether a page of a file is in it, asked without reading
it, and a checkpoint read ahead into it from CUDA's start on.

cachestat(2) (Linux 6.5) counts the cached pages of a range of an open file
and starts no I/O.  A sampling read with RWF_NOWAIT, the fallback, is not
that: on a page not cached it starts the page's readahead, and on a virtual
machine whose disk is the host's page cache that read can finish before the
kernel judges it, so a cold file looks cached.  mincore(2) on a mapping
starts no I/O either, but reports only this process's mapped pages to a
caller that may not write the file: a shared, read-only model cache would
always look cold.

``page_cached`` raises OSError where it cannot tell: ENOSYS (an older
kernel), EPERM (a seccomp filter that does not know the call), EOPNOTSUPP
(hugetlbfs); the caller falls back.

``Warmer`` reads byte ranges of open files, in order, into the page cache
with C threads that never take the GIL: the first load of a cold checkpoint
in a process waits for CUDA's start (the device check, the staging buffer's
registration), in calls that may hold the GIL throughout, and the disk reads
meanwhile; then it keeps reading ahead of the load's readers, with more
reads in flight than they keep.  What it read is thrown away; the load's
own reads then find it cached.  It is advisory: a failed read ends that
thread's warming, and the load's own read of the range reports the error.

Who owns what: the Warmer's threads read descriptors its owner (a
``Shards``) keeps open until ``close()`` has joined them (the load's
teardown, or an unusable device, closes it); ``stop()`` only asks them to
end after their reads in flight, and ``close()`` is that and the join.
Its scratch buffer is freed after the join.  At interpreter exit the
threads, which run no Python code, end with the process; in a forked
child they do not exist and ``close()`` joins nothing.
"""

from libc.errno cimport errno, EINTR
from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport free, malloc
from posix.unistd cimport getpid, pread

from instant_staging._pthread cimport (
    pthread_t, pthread_mutex_t, pthread_create, pthread_join, pthread_mutex_init,
    pthread_mutex_destroy, pthread_mutex_lock, pthread_mutex_unlock)

import os

cdef extern from "<unistd.h>" nogil:
    long syscall(long number, ...)

cdef extern from *:
    """
    /* cachestat(2)'s number is 451 on every architecture (a syscall added
       after the tables were unified); libc headers older than Linux 6.5
       lack SYS_cachestat. */
    #define IS_SYS_CACHESTAT 451
    struct is_cachestat_range { uint64_t off; uint64_t len; };
    struct is_cachestat {
        uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
    };
    """
    long IS_SYS_CACHESTAT
    struct is_cachestat_range:
        uint64_t off
        uint64_t len
    struct is_cachestat:
        uint64_t nr_cache


def page_cached(int fd, uint64_t offset):
    """Whether the page holding byte ``offset`` of ``fd`` is in the page
    cache (cachestat(2) on that one byte's page); OSError where the kernel
    cannot say."""
    cdef is_cachestat_range span
    cdef is_cachestat counts
    cdef long rc
    span.off = offset
    span.len = 1
    with nogil:
        rc = syscall(IS_SYS_CACHESTAT, <unsigned int>fd, &span, &counts, <unsigned int>0)
    if rc != 0:
        raise OSError(errno, os.strerror(errno))
    return counts.nr_cache > 0


cdef struct Piece:
    int fd
    int64_t offset
    int64_t length


cdef struct Shared:
    pthread_mutex_t lock
    Piece* pieces
    Py_ssize_t n_pieces
    Py_ssize_t next         # the next piece to read (under lock)
    bint stop               # (under lock)
    int64_t bytes_read      # (under lock)
    char* scratch           # every thread reads into it: its contents are never used
    size_t piece_bytes


cdef void* _warm(void* arg) noexcept nogil:
    cdef Shared* sh = <Shared*>arg
    cdef Piece* p
    cdef Py_ssize_t i
    cdef int64_t done
    cdef ssize_t got
    while True:
        pthread_mutex_lock(&sh.lock)
        i = sh.next
        if sh.stop or i >= sh.n_pieces:
            pthread_mutex_unlock(&sh.lock)
            return NULL
        sh.next += 1
        pthread_mutex_unlock(&sh.lock)
        p = &sh.pieces[i]
        done = 0
        while done < p.length:
            got = pread(p.fd, sh.scratch, <size_t>(p.length - done), p.offset + done)
            if got < 0 and errno == EINTR:
                continue
            if got <= 0:
                return NULL         # advisory: the load's own read reports it
            done += got
        pthread_mutex_lock(&sh.lock)
        sh.bytes_read += done
        pthread_mutex_unlock(&sh.lock)


cdef class Warmer:
    """Reads ``ranges`` ((descriptor, offset, length), in that order) into
    the page cache in pieces of ``piece_bytes`` with ``threads`` C threads,
    from construction until ``stop()`` or the last piece; ``close()`` joins
    them (idempotent)."""

    cdef Shared sh
    cdef pthread_t* tids
    cdef int started
    cdef bint joined
    cdef int pid

    cdef bint initialised

    def __cinit__(self, *args, **kwargs):
        # What __dealloc__ needs, whatever __init__ does (or if it never runs).
        self.pid = getpid()
        self.joined = True
        pthread_mutex_init(&self.sh.lock, NULL)

    def __init__(self, ranges, size_t piece_bytes, int threads):
        cdef Py_ssize_t n = 0, k = 0
        cdef int64_t off, end
        cdef int rc = 0, t
        if self.initialised:
            raise RuntimeError("Warmer.__init__ may run only once")
        self.initialised = True
        if piece_bytes < 1 or threads < 1:
            raise ValueError("piece_bytes and threads must be >= 1")
        ranges = [(int(fd), int(offset), int(length)) for fd, offset, length in ranges]
        for _fd, _offset, length in ranges:
            n += -(-length // piece_bytes) if length > 0 else 0
        self.sh.pieces = <Piece*>malloc(max(n, 1) * sizeof(Piece))
        self.sh.scratch = <char*>malloc(piece_bytes)
        self.tids = <pthread_t*>malloc(threads * sizeof(pthread_t))
        if self.sh.pieces == NULL or self.sh.scratch == NULL or self.tids == NULL:
            raise MemoryError()
        for fd, offset, length in ranges:
            off, end = offset, offset + length
            while off < end:
                self.sh.pieces[k].fd = fd
                self.sh.pieces[k].offset = off
                self.sh.pieces[k].length = min(<int64_t>piece_bytes, end - off)
                off += self.sh.pieces[k].length
                k += 1
        self.sh.n_pieces = k
        self.sh.piece_bytes = piece_bytes
        self.joined = False
        with nogil:
            for t in range(min(threads, max(k, 1))):
                rc = pthread_create(&self.tids[t], NULL, _warm, &self.sh)
                if rc != 0:
                    break       # fewer threads (or none): it is only a head start
                self.started += 1

    def stop(self):
        """Asks the threads to end after the read in flight; returns at once."""
        with nogil:
            pthread_mutex_lock(&self.sh.lock)
            self.sh.stop = True
            pthread_mutex_unlock(&self.sh.lock)

    def close(self):
        """Stops and joins the threads: afterwards nothing reads the
        descriptors (idempotent; in a forked child, joins nothing)."""
        cdef int t
        self.stop()
        if self.joined or getpid() != self.pid:
            return
        with nogil:
            for t in range(self.started):
                pthread_join(self.tids[t], NULL)
        self.joined = True
        free(self.sh.scratch)
        self.sh.scratch = NULL

    @property
    def bytes_read(self):
        """Bytes read into the page cache so far."""
        cdef int64_t n
        pthread_mutex_lock(&self.sh.lock)       # (held by a thread for an addition at most)
        n = self.sh.bytes_read
        pthread_mutex_unlock(&self.sh.lock)
        return n

    @property
    def threads(self):
        """Threads started."""
        return self.started

    @property
    def closed(self):
        """Whether ``close()`` joined the threads."""
        return self.joined

    def __dealloc__(self):
        cdef int t
        if not self.joined and getpid() == self.pid:
            with nogil:
                pthread_mutex_lock(&self.sh.lock)
                self.sh.stop = True
                pthread_mutex_unlock(&self.sh.lock)
                for t in range(self.started):
                    pthread_join(self.tids[t], NULL)
            self.joined = True
        if self.joined:         # (a child's copy: the parent's threads may use them)
            free(self.sh.scratch)
            free(self.sh.pieces)
            free(self.tids)
            pthread_mutex_destroy(&self.sh.lock)
