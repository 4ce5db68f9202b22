# cython: language_level=3, boundscheck=False, wraparound=False
"""A load into given tensors (``_into.py``): its destinations checked and
their addresses gathered in C, one pass each over them.

Every check runs before any byte is written, and a fine-grained MoE
checkpoint has thousands of destinations: checked tensor by tensor in
Python (each attribute asked in a loop of its own: device, contiguity,
overlap, then dtype, shape, then each address for the copies' joins and
again for the readers), they were most of what a load into tensors spent
before its first copy beyond what ``load_file`` spends (docs/design.md,
"Measured: a load into tensors, per tensor").  Here each pass reads each
tensor's attributes once through the Python API, without the
interpreter's loop, and keeps them in arrays:

- ``check`` (at the door, no checkpoint needed): every destination a
  dense, contiguous torch tensor on the one device, none overlapping
  another;
- ``places`` (the checkpoint opened, its selection known): in reading
  order, each destination's dtype and shape against its tensor's, and its
  address;
- ``joins``: which copies continue the one before (``Plan(joins=)``),
  the allocation holding each destination asked of the driver in C
  (``Allocations``).

Each error is the one ``_into.py`` documents, its wording here.
"""

from cpython.dict cimport PyDict_GetItem, PyDict_Next
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.object cimport PyObject
from cpython.tuple cimport PyTuple_GET_ITEM
from libc.stdint cimport uint64_t
from libc.stdlib cimport free, malloc

from ._header import PACKED_DTYPES as _PACKED_DTYPES
from ._header import torch_shape
from ._tuples cimport _BEGIN, _DTYPE, _END, _NAME, _SHAPE

cdef extern from "Python.h":
    int PyUnicode_Compare(object a, object b) except? -1

cdef extern from "<stdlib.h>":
    # (libc's, its comparator declared with the GIL held: ours compares names)
    void qsort(void* base, size_t n, size_t size,
               int (*compare)(const void*, const void*) noexcept)


cdef struct Span:
    uint64_t begin
    uint64_t end
    PyObject* name          # (borrowed: the destinations' dict holds it)


cdef int _before(const void* a, const void* b) noexcept:
    # (begin, end, name): the order of sorting the tuples, so that the pair
    # an overlap names is the same whatever the dict's order
    cdef const Span* x = <const Span*>a
    cdef const Span* y = <const Span*>b
    if x.begin != y.begin:
        return -1 if x.begin < y.begin else 1
    if x.end != y.end:
        return -1 if x.end < y.end else 1
    return PyUnicode_Compare(<object>x.name, <object>y.name)


def _describe(t):
    return f"{tuple(t.shape)} {t.dtype} on {t.device}"


def check(dict dests, tensor, strided):
    """``(device, name)``: the device of the destinations ``dests`` (``{name:
    tensor}``) and the first name on it, once each is checked: names are
    str, values are ``tensor`` (torch.Tensor), dense (layout ``strided``),
    contiguous, with no conjugate or negative bit, all on one device of the
    CPU or a CUDA/ROCm GPU, and no two share a byte.  ``(None, None)`` for
    no destinations.  A TypeError or ValueError naming the first bad one,
    in ``dests``' order."""
    cdef Py_ssize_t pos = 0, n = len(dests), m = 0, k
    cdef PyObject* key
    cdef PyObject* value
    cdef Span* spans
    cdef uint64_t nbytes
    device = first = None
    spans = <Span*>malloc(max(n, 1) * sizeof(Span))
    if spans == NULL:
        raise MemoryError()
    try:
        while PyDict_Next(dests, &pos, &key, &value):
            name, t = <object>key, <object>value
            if not isinstance(name, str):
                raise TypeError(f"tensors: names must be str, not {type(name).__name__} {name!r}")
            if not isinstance(t, tensor):
                raise TypeError(f"tensors[{name!r}] must be a torch.Tensor, not {type(t).__name__}")
            at = t.device
            if at != device:
                if device is not None:
                    raise ValueError(f"tensors[{name!r}] is on {at}, tensors[{first!r}] on "
                                     f"{device}: one load writes to one device (a load per device "
                                     "for the others)")
                if at.type not in ("cpu", "cuda"):
                    raise ValueError(f"tensors[{name!r}] is on {at}: the loader writes to the CPU "
                                     "or a CUDA/ROCm device")
                device, first = at, name
            if t.layout is not strided:
                raise ValueError(f"tensors[{name!r}] is a {t.layout} tensor: only dense (strided) "
                                 "tensors are written in place")
            if not t.is_contiguous():
                raise ValueError(f"tensors[{name!r}] ({_describe(t)}, strides {t.stride()}) is not "
                                 "contiguous: its bytes could not be written as the file lays "
                                 "them out")
            if t.is_conj() or t.is_neg():
                raise ValueError(f"tensors[{name!r}] has its conjugate or negative bit set: its "
                                 "memory is not what it shows")
            nbytes = t.nbytes
            if nbytes:
                spans[m].begin = t.data_ptr()
                spans[m].end = spans[m].begin + nbytes
                spans[m].name = key
                m += 1
        for k in range(1, m):
            if _before(&spans[k - 1], &spans[k]) > 0:
                qsort(spans, m, sizeof(Span), _before)
                break
        for k in range(1, m):
            if spans[k].begin < spans[k - 1].end:
                raise ValueError(f"tensors[{<object>spans[k - 1].name!r}] and "
                                 f"tensors[{<object>spans[k].name!r}] share memory: each byte is "
                                 "written once (pass one name of tied weights)")
    finally:
        free(spans)
    return device, first


def places(list entries, list dtypes, dict dests, list paths, bint rows=False):
    """``(tensors, addresses)`` of ``entries`` (``[(file index,
    TensorEntry)]``, reading order; ``paths`` by file index): each one's
    destination ``dests[name]`` and its ``data_ptr()``, once each has
    ``dtypes[k]`` (no conversion: a TypeError) and its tensor's torch shape
    (``rows``: a plan's, whose shapes are the rows'; a ValueError)."""
    cdef Py_ssize_t k, n = PyList_GET_SIZE(entries)
    cdef tuple pair, e
    cdef PyObject* found
    if len(dtypes) != n:
        raise ValueError(f"{len(dtypes)} dtypes for {n} entries")
    tensors = [None] * n
    addresses = [None] * n
    for k in range(n):
        pair = <tuple>PyList_GET_ITEM(entries, k)
        e = <tuple>PyTuple_GET_ITEM(pair, 1)
        name = <object>PyTuple_GET_ITEM(e, _NAME)
        found = PyDict_GetItem(dests, name)
        if found == NULL:
            raise KeyError(name)
        t = <object>found
        dtype = <object>PyList_GET_ITEM(dtypes, k)
        have = t.dtype
        if have is not dtype and have != dtype:
            raise TypeError(f"tensors[{name!r}] is {have}, the checkpoint's tensor is "
                            f"{<object>PyTuple_GET_ITEM(e, _DTYPE)} ({dtype}): a load into "
                            f"tensors converts nothing "
                            f"({paths[<object>PyTuple_GET_ITEM(pair, 0)]})")
        shape = <object>PyTuple_GET_ITEM(e, _SHAPE)
        if <object>PyTuple_GET_ITEM(e, _DTYPE) in _PACKED_DTYPES:
            shape = torch_shape(e)
        have = t.shape
        if have != shape:
            raise ValueError(f"tensors[{name!r}] has shape {tuple(have)}, the checkpoint's "
                             f"{'rows the plan selects' if rows else 'tensor'} {tuple(shape)} "
                             f"({paths[<object>PyTuple_GET_ITEM(pair, 0)]})")
        tensors[k] = t
        addresses[k] = t.data_ptr()
    return tensors, addresses


# cuMemGetAddressRange_v2 (CUdeviceptr* base, size_t* size, CUdeviceptr ptr)
# and hipMemGetAddressRange (void** base, size_t* size, void* ptr): one
# calling convention (every argument an integer register).
ctypedef int (*range_fn)(uint64_t* base, size_t* size, uint64_t ptr) noexcept nogil


cdef class Allocations:
    """The allocation holding each destination of a load into given
    tensors, for ``joins``: ``tensors[k]``'s, at ``addresses[k]``, as
    ``(base, size)``.  On a GPU the driver's (``driver``: the address of
    ``cuMemGetAddressRange_v2`` or ``hipMemGetAddressRange``, called in C;
    one segment of torch's caching allocator holds many tensors); else, or
    from the first time the driver cannot say (no context on this thread),
    the tensor's storage's."""

    cdef list tensors, addresses
    cdef range_fn driver

    def __init__(self, list tensors, list addresses, size_t driver=0):
        if len(tensors) != len(addresses):
            raise ValueError(f"{len(tensors)} tensors for {len(addresses)} addresses")
        self.tensors, self.addresses = tensors, addresses
        self.driver = <range_fn>driver

    cdef int find(self, Py_ssize_t k, uint64_t* base, uint64_t* size) except -1:
        cdef size_t got = 0
        cdef uint64_t ptr
        if self.driver != NULL:
            ptr = <object>PyList_GET_ITEM(self.addresses, k)
            if self.driver(base, &got, ptr) == 0:
                size[0] = got
                return 0
            self.driver = NULL
        storage = (<object>PyList_GET_ITEM(self.tensors, k)).untyped_storage()
        base[0] = storage.data_ptr()
        size[0] = storage.nbytes()
        return 0

    def __call__(self, Py_ssize_t k):
        """``(base, size)`` of the allocation holding destination ``k``."""
        cdef uint64_t base = 0, size = 0
        if not 0 <= k < PyList_GET_SIZE(self.tensors):
            raise IndexError(k)
        self.find(k, &base, &size)
        return base, size


def joins(list entries, list addresses, allocation):
    """``Plan(joins=)`` of a load into given destinations: per entry of
    ``entries`` (``[(file index, TensorEntry)]``, reading order), whether
    its destination continues the one before's, so that a chunk holding
    both copies them as one: their bytes back to back in one file, their
    destinations (``addresses[k]``) back to back inside one allocation.
    ``allocation(k)``: ``(base, size)`` of one holding destination ``k``,
    None where unknown (then no join); an ``Allocations`` is asked in C.
    Asked once per group, for its first destination."""
    cdef Py_ssize_t k, n = PyList_GET_SIZE(entries), before = -1, i, file = -1
    cdef tuple pair, e
    cdef uint64_t b, stop, ptr, nbytes, end = 0, dst = 0, base = 0, size = 0, lo = 0, hi = 0
    cdef bint span = False, fast = type(allocation) is Allocations
    if len(addresses) != n:
        raise ValueError(f"{len(addresses)} addresses for {n} entries")
    out = [False] * n
    for k in range(n):
        pair = <tuple>PyList_GET_ITEM(entries, k)
        i = <object>PyTuple_GET_ITEM(pair, 0)
        e = <tuple>PyTuple_GET_ITEM(pair, 1)
        b = <object>PyTuple_GET_ITEM(e, _BEGIN)
        stop = <object>PyTuple_GET_ITEM(e, _END)
        nbytes = stop - b
        if not nbytes:
            file, span = -1, False
            continue
        ptr = <object>PyList_GET_ITEM(addresses, k)
        if i == file and b == end and ptr == dst:
            if not span:
                if fast:
                    (<Allocations>allocation).find(before, &base, &size)
                    span = True
                else:
                    found = allocation(before)
                    if found is not None:
                        base, size = found
                        span = True
                if span:
                    lo, hi = base, base + size
            if span and lo <= ptr and ptr + nbytes <= hi:
                out[k] = True
            else:
                span = False
        else:
            span = False
        file, end, dst, before = i, stop, ptr + nbytes, k
    return out
