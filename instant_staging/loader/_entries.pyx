# cython: language_level=3, boundscheck=False, wraparound=False
"""A load's columns of its checkpoint's entries, walked in C.

A checkpoint's ``entries`` is a list of ``(file index, TensorEntry)``
pairs, one per tensor, in reading order.  Each load asks it for a few
columns: the names it hands out, the file ranges the plan cuts, the torch
dtype of each tensor.  A loop in Python per column was most of a load's
preparation past the headers once checkpoints hold tens of thousands of
tensors (docs/design.md, "Measured: the start per tensor"); these walk the
list in C.  Each returns a new list whose item k is entry k's.

The entries are the header's ``TensorEntry`` tuples: name, dtype, shape,
begin, end, in that order (``_header.py``).
"""

from cpython.dict cimport PyDict_GetItem
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.object cimport PyObject
from cpython.tuple cimport PyTuple_GET_ITEM

from ._tuples cimport _BEGIN, _DTYPE, _END, _NAME, _SHAPE, check_kind, record, triple


cdef inline tuple _entry(list entries, Py_ssize_t k):
    return <tuple>PyTuple_GET_ITEM(<tuple>PyList_GET_ITEM(entries, k), 1)


def names(list entries):
    """Each entry's name."""
    cdef Py_ssize_t k, n = PyList_GET_SIZE(entries)
    out = [None] * n
    for k in range(n):
        out[k] = <object>PyTuple_GET_ITEM(_entry(entries, k), _NAME)
    return out


def ranges(list entries, list fds):
    """Each entry's ``(fd, begin, end)`` (``Plan``'s tensors), ``fds`` the
    descriptors by file index (untracked: ``_tuples.pxd``)."""
    cdef Py_ssize_t k, n = PyList_GET_SIZE(entries)
    cdef tuple pair, t
    out = [None] * n
    for k in range(n):
        pair = <tuple>PyList_GET_ITEM(entries, k)
        t = <tuple>PyTuple_GET_ITEM(pair, 1)
        out[k] = triple(fds[<object>PyTuple_GET_ITEM(pair, 0)],
                        <object>PyTuple_GET_ITEM(t, _BEGIN), <object>PyTuple_GET_ITEM(t, _END))
    return out


def dtypes(list entries, dict known, miss):
    """Each entry's torch dtype: ``known[entry.dtype]`` for an entry with
    bytes, else ``miss(k)``, which is asked for every entry without bytes
    and for each dtype ``known`` lacks (and may add it to ``known``, the
    same dict, so that it is asked once)."""
    cdef Py_ssize_t k, n = PyList_GET_SIZE(entries)
    cdef tuple t
    cdef PyObject* found
    out = [None] * n
    for k in range(n):
        t = _entry(entries, k)
        found = NULL
        if <object>PyTuple_GET_ITEM(t, _END) != <object>PyTuple_GET_ITEM(t, _BEGIN):
            found = PyDict_GetItem(known, <object>PyTuple_GET_ITEM(t, _DTYPE))
        out[k] = <object>found if found != NULL else miss(k)
    return out


def infos(list entries, list paths, type kind):
    """``{name: kind(name, dtype, shape, nbytes, path)}`` of every entry,
    ``paths`` by file index, ``kind`` a NamedTuple of those five fields
    (``Checkpoint.info``'s ``TensorInfo``; untracked: ``_tuples.pxd``)."""
    cdef Py_ssize_t k, n = PyList_GET_SIZE(entries)
    cdef tuple pair, t
    check_kind(kind)
    out = {}
    for k in range(n):
        pair = <tuple>PyList_GET_ITEM(entries, k)
        t = <tuple>PyTuple_GET_ITEM(pair, 1)
        name = <object>PyTuple_GET_ITEM(t, _NAME)
        out[name] = record(kind, name, <object>PyTuple_GET_ITEM(t, _DTYPE),
                           <object>PyTuple_GET_ITEM(t, _SHAPE),
                           <object>PyTuple_GET_ITEM(t, _END) - <object>PyTuple_GET_ITEM(t, _BEGIN),
                           paths[<object>PyTuple_GET_ITEM(pair, 0)])
    return out
