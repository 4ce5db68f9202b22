# cython: language_level=3
"""Whether a page of a file is in the page cache, asked without reading it.

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
"""

from libc.errno cimport errno
from libc.stdint cimport uint64_t

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
