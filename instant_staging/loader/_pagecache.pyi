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

from collections.abc import Iterable

def page_cached(fd: int, offset: int) -> bool: ...

class Warmer:
    def __init__(self, ranges: Iterable[tuple[int, int, int]], piece_bytes: int,
                 threads: int) -> None: ...
    def stop(self) -> None: ...
    def close(self) -> None: ...
    @property
    def bytes_read(self) -> int: ...
    @property
    def threads(self) -> int: ...
    @property
    def closed(self) -> bool: ...
