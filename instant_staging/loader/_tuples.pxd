"""Tuples of the loader's per-tensor tables, made in C.

A header's ``TensorEntry`` rows, a plan's ``_blocks.Run`` rows and the
ranges the plan cuts come one per tensor, tens of thousands of them in a
large MoE checkpoint.  Made through Python (``tuple.__new__(Kind,
(...))``) each cost a call and a tuple to copy; made with the collector
tracking them, each collection while a load held them walked every one
(docs/design.md, "Measured: the start per tensor").  These make them as
``tuple.__new__`` does and untrack them: they hold strings, integers,
bools and tuples of integers only, so they can be in no cycle.
"""

from cpython.object cimport PyObject, PyTypeObject
from cpython.ref cimport Py_DECREF, Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM

# TensorEntry's fields, by place (``_header.py``).
cdef enum:
    _NAME = 0
    _DTYPE = 1
    _SHAPE = 2
    _BEGIN = 3
    _END = 4

cdef extern from "Python.h":
    void PyObject_GC_UnTrack(void* op)
    PyObject* PyType_GenericAlloc(PyTypeObject* t, Py_ssize_t n) except NULL


cdef inline void _put(object t, Py_ssize_t i, object item) noexcept:
    Py_INCREF(item)             # (SET_ITEM steals a reference)
    PyTuple_SET_ITEM(t, i, item)


cdef inline object untracked(object t):
    PyObject_GC_UnTrack(<void*>t)
    return t


cdef inline tuple triple(object a, object b, object c):
    """``(a, b, c)``, untracked."""
    t = PyTuple_New(3)
    _put(t, 0, a)
    _put(t, 1, b)
    _put(t, 2, c)
    return untracked(t)


cdef inline check_kind(type kind):
    """TypeError unless ``kind`` is what ``record`` makes: a NamedTuple of
    five fields without a ``__dict__``."""
    if not (issubclass(kind, tuple) and len(getattr(kind, "_fields", ())) == 5
            and not kind.__dictoffset__):
        raise TypeError(f"{kind.__name__} is not a NamedTuple of five fields without a __dict__")


cdef inline object record(type kind, object a, object b, object c, object d, object e):
    """``kind(a, b, c, d, e)`` of a NamedTuple ``kind`` of five fields
    without a ``__dict__`` (``__slots__ = ()``: ``check_kind``), untracked."""
    made = <object>PyType_GenericAlloc(<PyTypeObject*>kind, 5)
    Py_DECREF(made)             # (the cast took a reference of its own)
    _put(made, 0, a)
    _put(made, 1, b)
    _put(made, 2, c)
    _put(made, 3, d)
    _put(made, 4, e)
    return untracked(made)
