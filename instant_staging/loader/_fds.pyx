# cython: language_level=3
"""File descriptors recorded in the same step that opens or closes them.

Python runs a signal handler (Ctrl-C's KeyboardInterrupt) between two
bytecodes of the main thread, and as a call returns: a descriptor that
``os.open`` returned and Python code then appends to a list is lost if the
interrupt lands in between (a leak for the life of the process), and one
closed and then removed from the list is closed a second time by the next
``close()``, when its number may already be another file's (worse than a
leak).  Here each step is one call in C during which no Python code runs
(no bytecode, so no handler, and the GIL held, so no other thread): a
descriptor is in the list exactly while it is open.
"""

import os

from libc.errno cimport EINTR, errno
from posix.unistd cimport close as c_close

_os_open = os.open


def open_recorded(list fds, path, int flags):
    """``os.open(path, flags)`` (its errors, its EINTR retry), the
    descriptor appended to ``fds`` before any Python code runs; returns it."""
    fd = _os_open(path, flags)
    try:
        fds.append(fd)
    except BaseException:       # no memory for one more item: leave nothing open
        c_close(fd)
        raise
    return fd


def close_recorded(list fds):
    """Closes every descriptor of ``fds``, newest first, each removed from
    the list in the same step; idempotent (an empty list closes nothing).

    Linux releases the number whatever ``close()`` returns, so every one is
    removed and the rest are still closed; the first error (EINTR aside:
    the descriptor is released) is raised after the last."""
    cdef int fd, err = 0
    while fds:
        fd = fds[len(fds) - 1]
        if c_close(fd) != 0 and errno != EINTR and not err:
            err = errno
        del fds[len(fds) - 1]
    if err:
        raise OSError(err, os.strerror(err))
