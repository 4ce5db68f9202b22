# cython: language_level=3, boundscheck=False, wraparound=False
"""The canonical safetensors header, read in C.

safetensors writes its header compactly, the metadata first, each entry's
keys in one order, padded with spaces::

    {"__metadata__":{"format":"pt"},"a":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},...}

Such a header, with no escape in any string and no number of 20 digits or
more (so below 2**64), means exactly what its bytes say.  ``read`` reads
it in one pass; for anything else it returns None and ``_header._parse``
(the JSON parser with serde_json's rules) decides the header and words
its errors.  So this module only decides *whether* the fast reading
applies, never whether a file is valid: a header it declines is read the
slow way, and ``tests/loader/test_header_validity.py`` checks that both
readings agree.

Python (regular expressions) took a tenth of a MoE shard's load on a
slow host; this takes about a tenth of that (docs/design.md, "Measured:
the fast header reading").

``checked`` does the same for the entries' rules (``_header``'s coverage,
byte counts and torch's limits): it accepts entries that pass them all,
else returns None and ``_header`` applies them one by one and words the
error.

``read`` and ``table`` read the entries into a C table (offsets, dtype,
dimensions; no Python object per tensor).  ``table`` is ``read`` and
``checked`` in one pass, the loader's path for every header: the table is
checked and sorted in C, and only what passes becomes the header's
``TensorEntry`` objects, each made once.  It accepts exactly what
``read`` followed by ``checked`` accepts, with the same result
(``tests/loader/test_header_validity.py`` compares them); the intermediate
tuples, the sort keys and the second walk were a third of a fine-grained
MoE shard's header time (docs/design.md, "Measured: the header table").
"""

from cpython.long cimport PyLong_FromUnsignedLongLong
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdlib cimport free, qsort, realloc
from libc.string cimport memcmp

from ._tuples cimport check_kind, record, untracked

cdef struct Cursor:
    const unsigned char* s
    Py_ssize_t pos
    Py_ssize_t end


cdef inline bint _literal(Cursor* c, const char* text, Py_ssize_t n) noexcept:
    if c.end - c.pos < n or memcmp(c.s + c.pos, text, n) != 0:
        return False
    c.pos += n
    return True


cdef inline bint _char(Cursor* c, unsigned char ch) noexcept:
    if c.pos < c.end and c.s[c.pos] == ch:
        c.pos += 1
        return True
    return False


cdef inline Py_ssize_t _plain_string(Cursor* c, Py_ssize_t* length) noexcept:
    """A JSON string with no escape and no control character: its first
    byte's offset (its ``length`` set), past the closing quote; -1 if not."""
    cdef Py_ssize_t start, i
    cdef unsigned char ch
    if not _char(c, c'"'):
        return -1
    start = i = c.pos
    while i < c.end:
        ch = c.s[i]
        if ch == c'"':
            length[0] = i - start
            c.pos = i + 1
            return start
        if ch == c'\\' or ch < 0x20:
            return -1
        i += 1
    return -1


cdef inline bint _u64(Cursor* c, unsigned long long* value) noexcept:
    """``0`` or up to 19 digits without a leading zero (so below 2**64)."""
    cdef unsigned long long v = 0
    cdef int digits = 0
    if c.pos >= c.end:
        return False
    if c.s[c.pos] == c'0':
        c.pos += 1
        value[0] = 0
        return True
    while c.pos < c.end and digits < 19 and c'0' <= c.s[c.pos] <= c'9':
        v = v * 10 + (c.s[c.pos] - c'0')
        c.pos += 1
        digits += 1
    value[0] = v
    return digits > 0


cdef object _text(Cursor* c, Py_ssize_t start, Py_ssize_t length):
    # The header was checked to be UTF-8 before; None would send it to the parser.
    try:
        return PyUnicode_DecodeUTF8(<const char*>c.s + start, length, NULL)
    except UnicodeDecodeError:
        return None


cdef object _metadata(Cursor* c):
    """After ``{"__metadata__":``: the map of strings to strings, the last
    of a key winning; None if it is not one."""
    cdef Py_ssize_t k, kn, v, vn
    out = {}
    if not _char(c, c'{'):
        return None
    if _char(c, c'}'):
        return out
    while True:
        k = _plain_string(c, &kn)
        if k < 0 or not _char(c, c':'):
            return None
        v = _plain_string(c, &vn)
        if v < 0:
            return None
        key, value = _text(c, k, kn), _text(c, v, vn)
        if key is None or value is None:
            return None
        out[key] = value
        if _char(c, c'}'):
            return out
        if not _char(c, c','):
            return None


cdef object _opening(Cursor* c, bytes raw):
    """Starts the reading of ``raw`` at its first entry: ``(True,
    metadata)``, or ``(False, metadata)`` for a header of metadata alone
    (read to its end); None if it declines."""
    c.s = <const unsigned char*><const char*>raw
    c.pos = 0
    c.end = len(raw)
    while c.end > 0 and c.s[c.end - 1] == c' ':
        c.end -= 1
    metadata = None
    if _literal(c, b'{"__metadata__":', 16):
        metadata = _metadata(c)
        if metadata is None:
            return None
        if _char(c, c'}'):
            return (False, metadata) if c.pos == c.end else None
        if not _char(c, c','):
            return None
    elif not _char(c, c'{'):
        return None
    return True, metadata


cdef object _dtype_key(Cursor* c, Py_ssize_t* name, Py_ssize_t* name_len):
    """``"name":{"dtype":"X`` up to ``","shape":[``: X as bytes (``name``
    and ``name_len`` set), None if it is not that."""
    cdef Py_ssize_t d
    name[0] = _plain_string(c, name_len)
    if name[0] < 0 or not _literal(c, b':{"dtype":"', 11):
        return None
    d = c.pos
    while c.pos < c.end and (c'A' <= c.s[c.pos] <= c'Z' or c'0' <= c.s[c.pos] <= c'9'
                             or c.s[c.pos] == c'_'):
        c.pos += 1
    key = (<const char*>c.s + d)[:c.pos - d]
    return key if _literal(c, b'","shape":[', 11) else None


cdef inline bint _offsets(Cursor* c, unsigned long long* begin, unsigned long long* end) noexcept:
    """``,"data_offsets":[b,e]}``."""
    return (_literal(c, b',"data_offsets":[', 17) and _u64(c, begin) and _char(c, c',')
            and _u64(c, end) and _literal(c, b']}', 2))


# -- the entries' rules, accepted in C ------------------------------------------

cdef extern from *:
    """
    static inline int _is_mul_overflow(unsigned long long a, unsigned long long b,
                                       unsigned long long* out) {
        return __builtin_mul_overflow(a, b, out);
    }
    """
    bint _is_mul_overflow(unsigned long long a, unsigned long long b,
                          unsigned long long* out) noexcept nogil

cdef unsigned long long _TORCH_DIM_LIMIT = 1ULL << 63


def checked(list tensors, unsigned long long data_start, dict bits, type entry):
    """``(entries, end)`` for ``tensors`` (``(name, dtype, shape, begin,
    end)`` sorted by offsets) where every one passes ``_header``'s entry
    rules (coverage, byte counts, what torch can hold): each made as
    ``entry`` with absolute offsets (``data_start`` added); else None, and
    ``_header`` applies the rules itself and words the error.  Like
    ``read``, this only decides whether the fast path applies.

    About a third of the Python rules' time for a MoE shard's entries
    (docs/design.md, "Measured: the fast header reading")."""
    cdef unsigned long long start = 0, b, e, numel, nbits, d, dtype_bits
    out = []
    try:
        for item in tensors:
            name, dtype, shape, begin, stop = item
            b, e = begin, stop
            if b != start or e < b:
                return None
            start = e
            numel = 1
            for dim in shape:
                d = dim
                if d >= _TORCH_DIM_LIMIT or _is_mul_overflow(numel, d, &numel):
                    return None
            dtype_bits = bits[dtype]
            if _is_mul_overflow(numel, dtype_bits, &nbits) or nbits % 8 or e - b != nbits // 8:
                return None
            if dtype == "F4" and (not shape or shape[len(shape) - 1] % 2):
                return None
            out.append(tuple.__new__(entry, (name, dtype, shape, begin + data_start,
                                             stop + data_start)))
    except (OverflowError, TypeError, KeyError, ValueError):
        return None
    return out, start


# -- the C table: read, and read and checked in one pass -------------------------

cdef struct Row:
    Py_ssize_t name         # the name's offset in the header, and its length
    Py_ssize_t name_len
    Py_ssize_t dtype        # index into the header's list of dtype names
    Py_ssize_t dims         # index of the first dimension in the dims array
    Py_ssize_t ndim
    unsigned long long begin
    unsigned long long end
    Py_ssize_t order        # the entry's place in the header (a stable sort)


cdef int _by_offsets(const void* a, const void* b) noexcept nogil:
    cdef const Row* x = <const Row*>a
    cdef const Row* y = <const Row*>b
    if x.begin != y.begin:
        return -1 if x.begin < y.begin else 1
    if x.end != y.end:
        return -1 if x.end < y.end else 1
    return -1 if x.order < y.order else (1 if x.order > y.order else 0)


cdef struct Table:
    Row* rows
    Py_ssize_t n, cap
    unsigned long long* dims
    Py_ssize_t ndims, dims_cap


cdef bint _grow(void** p, Py_ssize_t* cap, Py_ssize_t need, size_t item) noexcept:
    cdef Py_ssize_t c = cap[0]
    cdef void* q
    if need <= c:
        return True
    while c < need:
        c = c * 2 if c else 64
    q = realloc(p[0], c * item)
    if q == NULL:
        return False
    p[0], cap[0] = q, c
    return True


cdef bint _row(Cursor* c, Table* t, dict dtype_index) except -1:
    """One ``"name":{"dtype":...}`` into the table; False if it is not
    exactly the canonical entry (the reading declines)."""
    cdef Py_ssize_t n, nn
    cdef unsigned long long begin, end, dim
    cdef Row* r
    key = _dtype_key(c, &n, &nn)
    k = dtype_index.get(key) if key is not None else None
    if k is None:
        return False
    if not _grow(<void**>&t.rows, &t.cap, t.n + 1, sizeof(Row)):
        raise MemoryError()
    r = &t.rows[t.n]
    r.name, r.name_len, r.dtype, r.dims, r.ndim, r.order = n, nn, k, t.ndims, 0, t.n
    if not _char(c, c']'):
        while True:
            if not _u64(c, &dim):
                return False
            if not _grow(<void**>&t.dims, &t.dims_cap, t.ndims + 1, sizeof(unsigned long long)):
                raise MemoryError()
            t.dims[t.ndims] = dim
            t.ndims += 1
            r.ndim += 1
            if _char(c, c']'):
                break
            if not _char(c, c','):
                return False
    if not _offsets(c, &begin, &end):
        return False
    r.begin, r.end = begin, end
    t.n += 1
    return True


cdef bint _rules(const Row* r, const unsigned long long* dims, unsigned long long bits,
                 bint f4) noexcept:
    """``checked``'s rules for one entry but its place: the byte count and
    torch's limits."""
    cdef unsigned long long numel = 1, nbits
    cdef Py_ssize_t i
    if r.end < r.begin:
        return False
    for i in range(r.ndim):
        if dims[r.dims + i] >= _TORCH_DIM_LIMIT or _is_mul_overflow(numel, dims[r.dims + i], &numel):
            return False
    if _is_mul_overflow(numel, bits, &nbits) or nbits % 8 or r.end - r.begin != nbits // 8:
        return False
    if f4 and (r.ndim == 0 or dims[r.dims + r.ndim - 1] % 2):
        return False
    return True


cdef class _Rows:
    """A canonical header read into a C table, freed with the object:
    ``ok`` False where the reading declines.  ``dtype_names`` holds each
    dtype a row names, by index."""

    cdef bytes raw          # the cursor points into it
    cdef Cursor c
    cdef Table t
    cdef bint ok
    cdef object metadata
    cdef list dtype_names

    def __cinit__(self, bytes raw, dict dtypes):
        self.raw, self.ok, self.metadata, self.dtype_names = raw, False, None, []
        self.t.rows, self.t.n, self.t.cap = NULL, 0, 0
        self.t.dims, self.t.ndims, self.t.dims_cap = NULL, 0, 0
        dtype_index = {}
        for key, name in dtypes.items():
            dtype_index[key] = len(self.dtype_names)
            self.dtype_names.append(name)
        opened = _opening(&self.c, raw)
        if opened is None:
            return
        entries_follow, self.metadata = opened
        while entries_follow:
            if not _row(&self.c, &self.t, dtype_index):
                return
            if _char(&self.c, c'}'):
                if self.c.pos != self.c.end:
                    return
                break
            if not _char(&self.c, c','):
                return
        self.ok = True

    def __dealloc__(self):
        free(self.t.rows)
        free(self.t.dims)


cdef tuple _shape(const Table* t, const Row* r):
    cdef Py_ssize_t j
    shape = PyTuple_New(r.ndim)
    for j in range(r.ndim):
        dim = PyLong_FromUnsignedLongLong(t.dims[r.dims + j])
        Py_INCREF(dim)          # (SET_ITEM steals a reference)
        PyTuple_SET_ITEM(shape, j, dim)
    return untracked(shape)     # integers only: in no cycle


cdef enum:
    _SHAPES = 4      # shapes kept for reuse in table()


cdef bint _in_order(const Table* t) noexcept:
    # safetensors writes the entries in their data's order: no sort needed.
    cdef Py_ssize_t i
    for i in range(1, t.n):
        if _by_offsets(&t.rows[i - 1], &t.rows[i]) > 0:
            return False
    return True


cdef inline bint _same_dims(const Table* t, const Row* a, const Row* b) noexcept:
    return a.ndim == b.ndim and memcmp(&t.dims[a.dims], &t.dims[b.dims],
                                       b.ndim * sizeof(unsigned long long)) == 0


cdef bint _unique(set names, Py_ssize_t n):
    # A name given twice, or one the parser must judge: the reading declines.
    return len(names) == n and "__metadata__" not in names


def read(bytes raw, dict dtypes):
    """``(metadata, [(name, dtype, shape, begin, end), ...])`` of a canonical
    header ``raw`` (UTF-8, already checked), in the header's order, else
    None.  ``dtypes`` maps each known dtype's name as bytes to it as a str;
    another name declines."""
    cdef _Rows rows = _Rows(raw, dtypes)
    cdef Py_ssize_t i
    cdef const Row* r
    if not rows.ok:
        return None
    entries, names = [], set()
    for i in range(rows.t.n):
        r = &rows.t.rows[i]
        name = _text(&rows.c, r.name, r.name_len)
        if name is None:
            return None
        names.add(name)
        entries.append((name, rows.dtype_names[r.dtype], _shape(&rows.t, r), r.begin, r.end))
    return (rows.metadata, entries) if _unique(names, rows.t.n) else None


def table(bytes raw, dict dtypes, dict bits, type entry):
    """``read`` and ``checked`` in one pass: ``(metadata, entries, end)``
    for a canonical header ``raw`` whose entries pass every rule of
    ``checked`` (``entries`` sorted by offsets, made as ``entry``, a
    NamedTuple of five fields without a ``__dict__``, with absolute
    offsets: the data section starts at ``8 + len(raw)``), else None.
    ``dtypes`` and ``bits`` are ``read``'s and ``checked``'s."""
    cdef _Rows rows = _Rows(raw, dtypes)
    cdef Py_ssize_t i
    cdef const Row* r
    cdef unsigned long long start = 0, data_start = 8 + len(raw)
    if not rows.ok:
        return None
    names_of = rows.dtype_names
    dtype_bits = [bits.get(name) for name in names_of]
    check_kind(entry)
    for i in range(rows.t.n):
        r = &rows.t.rows[i]
        size = dtype_bits[r.dtype]
        if size is None or not _rules(r, rows.t.dims, size, names_of[r.dtype] == "F4"):
            return None
    if not _in_order(&rows.t):
        qsort(rows.t.rows, rows.t.n, sizeof(Row), _by_offsets)
    out, names = [], set()
    # The shapes made last, reused: a checkpoint's tensors repeat a few
    # shapes (an expert's projections, layer after layer).
    cdef const Row* made_for[_SHAPES]
    shapes = [None] * _SHAPES
    cdef Py_ssize_t k, next_shape = 0
    for i in range(rows.t.n):
        r = &rows.t.rows[i]
        if r.begin != start:
            return None
        start = r.end
        name = _text(&rows.c, r.name, r.name_len)
        if name is None:
            return None
        names.add(name)
        for k in range(_SHAPES):
            if k < next_shape and _same_dims(&rows.t, made_for[k], r):
                shape = shapes[k]
                break
        else:
            shape = _shape(&rows.t, r)
            k = next_shape % _SHAPES
            shapes[k], made_for[k] = shape, r
            next_shape += 1
        # (untracked, as _tuples.pxd says: every collection while a
        # checkpoint was open walked each of its entries)
        out.append(record(entry, name, names_of[r.dtype], shape,
                          PyLong_FromUnsignedLongLong(r.begin + data_start),
                          PyLong_FromUnsignedLongLong(r.end + data_start)))
    return (rows.metadata, out, start) if _unique(names, rows.t.n) else None
