# cython: language_level=3, boundscheck=False, wraparound=False
"""Tensors as views into one device block per run of tensors that lie back
to back in a file.

A copy per tensor costs a launch per tensor: small copies move a sliver
of what the link can, and checkpoints of many small tensors (MoE shards,
AWQ checkpoints) lost a noticeable part of the link to them
(docs/design.md, "Measured: a copy per tensor").  So a
load to a GPU allocates one block per *run*, copies each chunk into it at
the chunk's place in the file (the pipeline joins the pieces of a chunk
that continue one block into one copy: ``_pipeline.pyx``'s ``_next_copy``,
``Plan(joins=)``), and hands out each tensor as a view of its block.

A tensor continues the run before it when it lies in the same file right
where that one ends, at a multiple of ``ALIGN`` bytes from the run's start
(torch views need a multiple of the element size; 16 bytes keep the
alignment of a fresh allocation that vectorized kernels and cuBLAS look
for), and is kept in the file's dtype.  A misaligned tensor starts a run
of its own; a tensor that ``dtype=`` converts, or that has no bytes, gets
its own allocation (``Run.block`` False): converting a view would keep its
whole block alive beside the converted copy.

What a view means for memory: a tensor keeps its whole block alive (del of
some tensors of a run frees nothing until the last goes; ``torch.save``
of one tensor writes its block); ``tensor.clone()`` detaches one, and
``views=False`` gives each tensor its own allocation, as safetensors does.
"""

from typing import NamedTuple

from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.object cimport PyObject_IsTrue
from cpython.tuple cimport PyTuple_GET_ITEM

from ._tuples cimport check_kind, record

# Bytes a view's offset in its block is a multiple of.
ALIGN = 16
cdef long long _ALIGN = ALIGN


class Run(NamedTuple):
    """Entries ``[first, stop)`` of a load, in reading order.  ``block``:
    they share one allocation of ``nbytes`` holding the file's bytes from
    ``begin``; otherwise a single tensor allocated on its own."""

    first: int
    stop: int
    begin: int
    nbytes: int
    block: bool


def runs(list entries, list joins):
    """The runs of ``entries`` (``[(file_index, TensorEntry), ...]`` in
    reading order); ``joins[k]``: whether tensor k may be a view by its
    dtype (the target's rule: not converted); a tensor without bytes never
    is one.  (In C: a loop in Python was a noticeable part of the start of a
    load of tens of thousands of tensors; docs/design.md, "Measured: the
    start per tensor".)"""
    cdef Py_ssize_t n = PyList_GET_SIZE(entries), k, first = 0
    cdef long long begin = 0, end = 0, b, e
    cdef object file = None, i
    cdef tuple pair, t
    cdef bint view, open_ = False
    if len(joins) != n:
        raise ValueError(f"{len(joins)} joins for {n} entries")
    check_kind(Run)
    out = []
    for k in range(n):
        pair = <tuple>PyList_GET_ITEM(entries, k)
        i = <object>PyTuple_GET_ITEM(pair, 0)
        t = <tuple>PyTuple_GET_ITEM(pair, 1)
        b = <object>PyTuple_GET_ITEM(t, 3)
        e = <object>PyTuple_GET_ITEM(t, 4)
        view = PyObject_IsTrue(<object>PyList_GET_ITEM(joins, k)) and e > b
        if open_ and not (view and i == file and b == end and (b - begin) % _ALIGN == 0):
            out.append(record(Run, first, k, begin, end - begin, True))
            open_ = False
        if not view:
            out.append(record(Run, k, k + 1, b, e - b, False))
        elif not open_:
            first, file, begin, end, open_ = k, i, b, e, True
        else:
            end = e
    if open_:
        out.append(record(Run, first, n, begin, end - begin, True))
    return out


def joined(list run_list):
    """``Plan(joins=)``: whether each tensor's copy continues the one before
    it, which it does only inside one block."""
    out = []
    for r in run_list:
        out.append(False)
        if r.block:
            out.extend([True] * (r.stop - r.first - 1))
    return out


def packed(list run_list):
    """Whether every tensor with bytes is a view (the plan may then cut
    chunks without regard to tensor boundaries: ``Plan(packed=True)``)."""
    return all(r.block or not r.nbytes for r in run_list)
