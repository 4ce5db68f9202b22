"""Safetensors header parsing for the loader (pure Python, no torch).

A safetensors file is an 8-byte little-endian header length N, N bytes of
UTF-8 JSON, then the data section.  The JSON maps each tensor name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to
the data section) and may hold a ``"__metadata__"`` map of strings.

A file is valid exactly when safetensors (0.8, ``safetensors.torch``)
accepts it; every rule below is one of its rules, checked before the
loader allocates anything (``tests/loader/test_header_validity.py`` compares
both on generated and mutated files):

- the header length is at most 100,000,000 and inside the file; the header
  is UTF-8 JSON as serde_json reads it: JSON whitespace around the object
  (leading too), no NaN/Infinity, no number beyond the double range, no
  lone surrogate escape, at most 127 levels of nesting;
- the root is an object; ``__metadata__`` (at most once) is null or maps
  strings to strings; a tensor name given twice keeps its last entry, but
  every entry must be one (safetensors deserializes each as it reads);
- an entry is an object with ``dtype``, ``shape`` and ``data_offsets``
  (each at most once; other keys are ignored) or the array ``[dtype,
  shape, data_offsets]``; dtype is a known name (or ``{"NAME": null}``);
  dimensions and offsets are integers in [0, 2**64);
- sorted by their offsets, the tensors cover the data section exactly:
  each begins where the previous one ended (no gap, no overlap), the first
  at 0, the last at the end of the file (no trailing bytes); so a header
  length too small by 1-7, whose JSON still parses thanks to the padding,
  is rejected instead of shifting every tensor;
- each tensor's byte count is its element count times its dtype's size,
  computed in 64 bits without overflow (element count, then bits; a whole
  number of bytes);
- what torch cannot hold is rejected as well (a dimension >= 2**63, a
  dtype torch lacks, F4 whose last dimension is odd).

Each problem is a ``SafetensorsError`` (a ``ValueError``) naming the file
and, where there is one, the tensor; never a RecursionError, a bare
ValueError or a TypeError, whatever the path type (str, bytes, PathLike).
"""

import json
import math
import operator
import os
import re
import struct
from typing import NamedTuple, Optional

from ._canonical import checked as _checked
from ._canonical import read as _read_canonical
from ._canonical import table as _table
from ._errors import UpstreamError

# The JSON header may not exceed this (the safetensors package's own limit).
MAX_HEADER_BYTES = 100_000_000

# Every dtype safetensors.torch loads: bits per element (F4 packs two
# elements in a byte) and the torch dtype that holds it, by its attribute
# name (a torch too old to have one is reported before anything is
# allocated: ``_target.py``).  F6_* are format dtypes that safetensors.torch
# refuses ("Dtype not understood"), so they are rejected here too.
DTYPES = {
    "BOOL": (8, "bool"), "U8": (8, "uint8"), "I8": (8, "int8"), "F4": (4, "float4_e2m1fn_x2"),
    "F8_E4M3": (8, "float8_e4m3fn"), "F8_E5M2": (8, "float8_e5m2"),
    "F8_E4M3FNUZ": (8, "float8_e4m3fnuz"), "F8_E5M2FNUZ": (8, "float8_e5m2fnuz"),
    "F8_E8M0": (8, "float8_e8m0fnu"),
    "I16": (16, "int16"), "U16": (16, "uint16"), "F16": (16, "float16"), "BF16": (16, "bfloat16"),
    "I32": (32, "int32"), "U32": (32, "uint32"), "F32": (32, "float32"),
    "I64": (64, "int64"), "U64": (64, "uint64"), "F64": (64, "float64"), "C64": (64, "complex64"),
}
DTYPE_BITS = {name: bits for name, (bits, _) in DTYPES.items()}
TORCH_DTYPES = {name: attribute for name, (_, attribute) in DTYPES.items()}

# Dtypes safetensors knows but safetensors.torch cannot load ("Dtype not
# understood": no torch dtype holds them); named as such, not as unknown.
NO_TORCH_DTYPE = {"F6_E2M3": "a 6-bit float (2 exponent, 3 mantissa bits)",
                  "F6_E3M2": "a 6-bit float (3 exponent, 2 mantissa bits)"}

# Bytes per element of the dtypes whose elements are whole bytes (all but F4).
DTYPE_SIZES = {name: bits // 8 for name, bits in DTYPE_BITS.items() if bits % 8 == 0}

# serde_json's recursion limit, as safetensors 0.8 meets it: 127 levels of
# arrays and objects (the root counts) parse, 128 do not.
MAX_DEPTH = 127

_U64 = 1 << 64
_I64_MIN = -(1 << 63)
_TORCH_DIM_LIMIT = 1 << 63          # torch sizes are int64
_FIELDS = ("dtype", "shape", "data_offsets")
_FIELD_SET = frozenset(_FIELDS)
_OFFSETS = operator.itemgetter(3, 4)    # of (name, dtype, shape, begin, end)
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# Only a \uD800-\uDFFF escape can put a surrogate into a parsed string (the
# UTF-8 decoder refuses encoded ones): without one, no string is walked.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# A number token this long is beyond the double range, whatever it is.
_MAX_NUMBER_DIGITS = 400


class SafetensorsError(ValueError, UpstreamError):
    """A malformed safetensors file.

    ``path`` and ``tensor`` say where.  Also a ``safetensors.SafetensorError``
    where safetensors is importable.
    """

    def __init__(self, message: str, path=None, tensor: Optional[str] = None):
        self.path = _path_text(path)
        self.tensor = tensor
        self.reason = message
        where = self.path or "<safetensors>"
        if tensor is not None:
            where += f": tensor {tensor!r}"
        super().__init__(f"{where}: {message}")

    def __reduce__(self):
        # The reason, not the formatted message: pickling must not prefix twice.
        return (type(self), (self.reason, self.path, self.tensor))


def _path_text(path):
    if path is None:            # bytes in memory (load()): no path
        return None
    path = os.fspath(path)
    return os.fsdecode(path) if isinstance(path, bytes) else path


class TensorEntry(NamedTuple):
    """One tensor of a file; ``begin``/``end`` are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class Header(NamedTuple):
    """A parsed file: its tensors in data order, and its metadata (None when
    the header has no ``__metadata__`` or it is null, as safetensors'
    ``metadata()`` returns)."""

    path: str
    file_size: int
    data_start: int
    tensors: list[TensorEntry]
    metadata: Optional[dict[str, str]]


def read_header(fd: int, path) -> Header:
    """Parses and validates the header of the open file ``fd``."""
    path = _path_text(path)
    size = os.fstat(fd).st_size
    length = header_length(_pread_exact(fd, min(size, 8), 0, path), size, path)
    raw = _pread_exact(fd, length, 8, path)
    return parse_header(raw, path, size)


def header_length(prefix: bytes, size: int, path) -> int:
    """The header length N that the first 8 bytes ``prefix`` of a file (or
    buffer) of ``size`` bytes give, checked against the limit and the size."""
    if size < 8:
        raise SafetensorsError(f"file of {size} bytes is too short for the 8-byte header length", path)
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES:
        if prefix[:1] in (b"{", b"["):
            raise SafetensorsError("this is a JSON file (a model.safetensors.index.json?), not a "
                                   "safetensors file: pass the index or its directory as the "
                                   "source, not as a shard", path)
        # The length is not printed, here or below: it is the first 8 bytes
        # of a file that may not be a safetensors file at all (an index once
        # could name any file, and its bytes came back in this message).
        raise SafetensorsError(f"the header length (the first 8 bytes) exceeds the limit of "
                               f"{MAX_HEADER_BYTES} bytes: not a safetensors file", path)
    if 8 + length > size:
        raise SafetensorsError(f"the header length (the first 8 bytes) goes beyond the end of the "
                               f"file ({size} bytes): truncated, or not a safetensors file", path)
    return length


def parse_header(raw: bytes, path, file_size: int) -> Header:
    """Validates the JSON header ``raw`` of a file of ``file_size`` bytes."""
    path = _path_text(path)
    data_start = 8 + len(raw)
    text = _utf8(raw, path)
    fast = _table(bytes(raw), _DTYPE_BYTES, DTYPE_BITS, TensorEntry)
    if fast is not None:        # canonical, and every entry passes (the usual file)
        metadata, out, end = fast
        _check_end(end, path, file_size, data_start)
        return Header(path, file_size, data_start, out, metadata)
    # Otherwise the reading and the rules one at a time: whichever declines
    # is what the slower path decides and words.
    canonical = _canonical(raw)
    metadata, tensors = canonical if canonical is not None else _parse(text, raw, path)
    tensors.sort(key=_OFFSETS)
    fast = _checked(tensors, data_start, DTYPE_BITS, TensorEntry)
    if fast is None:            # a rule fails (or a number is out of C's range)
        return _checked_slowly(tensors, path, file_size, data_start, metadata)
    out, end = fast
    _check_end(end, path, file_size, data_start)
    return Header(path, file_size, data_start, out, metadata)


def _checked_slowly(tensors, path, file_size, data_start, metadata):
    """parse_header's rules, applied one by one in Python: the error each
    raises is the file's (``_canonical.checked`` accepts only what passes
    them all)."""
    end = _check_coverage(tensors, path)
    _check_end(end, path, file_size, data_start)
    out = [TensorEntry(name, dtype, shape, data_start + b, data_start + e)
           for name, dtype, shape, b, e in tensors]
    for t in out:
        _check_torch(t, path)
    return Header(path, file_size, data_start, out, metadata)


def _check_end(end, path, file_size, data_start):
    if data_start + end != file_size:
        raise SafetensorsError(
            f"the tensors cover {end} bytes of data but the file holds {file_size - data_start} "
            "after the header: the header length is wrong or the file has a gap or trailing "
            "bytes (safetensors requires the data to be covered exactly)", path)


def _parse(text, raw, path):
    """``(metadata, [(name, dtype, shape, begin, end)])`` of any header, by
    the rules above; every error is raised and worded here."""
    pairs = _decode(text, raw, path)
    if not isinstance(pairs, _Pairs):
        raise SafetensorsError(f"header is a JSON {_kind(pairs)}, not an object", path)
    metadata, seen_metadata, entries = None, False, {}
    for name, value in pairs:
        if name == "__metadata__":
            if seen_metadata:
                raise SafetensorsError("__metadata__ appears twice in the header", path)
            metadata, seen_metadata = _metadata(value, path), True
        else:
            # Every entry is checked, a shadowed one too (serde deserializes
            # each before the map keeps the last of a name).
            entries[name] = _entry(name, value, path)
    tensors = list(entries.values())
    for name, dtype, *_ in tensors:     # what only torch refuses: the entries kept
        if dtype in NO_TORCH_DTYPE:
            raise SafetensorsError(f"dtype {dtype} ({NO_TORCH_DTYPE[dtype]}) has no torch dtype: "
                                   "safetensors.torch refuses it too", path, name)
    return metadata, tensors


def _pread_exact(fd, n, offset, path) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise SafetensorsError(f"file ended at byte {offset + len(data)} while reading "
                               f"{n} header bytes at {offset}", path)
    return data


class _Pairs(list):
    """A JSON object as its (key, value) pairs, duplicates kept."""


class _Reject(Exception):
    """Raised inside the JSON hooks; becomes a SafetensorsError."""


def _constant(name):
    raise _Reject(f"{name} is not JSON")


def _float(text):
    value = float(text)
    if math.isinf(value):
        raise _Reject("a number is beyond the double range")
    return value


def _int(text):
    # serde_json reads an integer as u64, else i64, else as a double (which
    # may overflow); "-0" is a double.
    if len(text) > _MAX_NUMBER_DIGITS:
        raise _Reject(f"number of {len(text)} digits is out of range")
    value = int(text)
    if text == "-0" or not _I64_MIN <= value < _U64:
        return _float(text)
    return value


# -- the canonical form, read without the JSON parser ---------------------------
#
# safetensors writes its header compactly, the metadata first, each entry's
# keys in one order (_canonical.pyx says which); such a header means exactly
# what its bytes say, and _canonical.read reads it in C.  Anything else
# (other order or spacing, an escape, a name given twice or called
# __metadata__, an unknown dtype) goes through _parse, which decides it and
# words its errors.

_DTYPE_BYTES = {name.encode(): name for name in DTYPE_BITS}


def _canonical(raw):
    """``(metadata, [(name, dtype, shape, begin, end)])`` of a canonical
    header (UTF-8 bytes), else None."""
    return _read_canonical(bytes(raw), _DTYPE_BYTES)


# -- JSON as serde_json reads it (any other header) -----------------------------

def _utf8(raw, path):
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SafetensorsError(f"header is not UTF-8 ({e.reason} at byte {8 + e.start})", path) from None


def _decode(text, raw, path):
    try:
        obj = json.loads(text, object_pairs_hook=_Pairs, parse_constant=_constant,
                         parse_float=_float, parse_int=_int)
    except json.JSONDecodeError as e:
        raise SafetensorsError(f"header is not valid JSON: {e.msg} at header byte {e.pos}", path) from None
    except _Reject as e:
        raise SafetensorsError(f"header is not valid JSON: {e}", path) from None
    except RecursionError:
        raise SafetensorsError(f"header nests more than {MAX_DEPTH} levels", path) from None
    _check_tree(obj, path, strings=_SURROGATE_ESCAPE.search(raw) is not None)
    return obj


def _check_tree(obj, path, strings=True):
    """Nesting depth, and lone surrogates where ``strings``, without recursion.

    Level by level, pushing only containers: pushing every value made this
    walk half of a large header's parse (docs/design.md, "Measured: walking
    the header")."""
    if not isinstance(obj, list):       # a scalar root: no containers to walk
        if strings and isinstance(obj, str):
            _check_strings([obj], path)
        return
    level, depth = [obj], 1
    while level:
        if depth > MAX_DEPTH and any(isinstance(v, list) for v in level):
            raise SafetensorsError(f"header nests more than {MAX_DEPTH} levels", path)
        below = []
        for value in level:
            if isinstance(value, _Pairs):
                if strings:
                    _check_strings([k for k, _ in value], path)
                value = [v for _, v in value]
            if strings:
                _check_strings(value, path)
            below.extend([v for v in value if isinstance(v, list)])    # arrays, objects
        level, depth = below, depth + 1


def _check_strings(values, path):
    for v in values:
        if isinstance(v, str) and _LONE_SURROGATE.search(v):
            raise SafetensorsError("header holds a lone surrogate escape (not valid UTF-16)", path)


def _kind(value) -> str:
    if isinstance(value, _Pairs):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return "number"


# -- the entries -------------------------------------------------------------

def _metadata(value, path) -> Optional[dict[str, str]]:
    if value is None:
        return None
    if not isinstance(value, _Pairs) or not all(isinstance(v, str) for _, v in value):
        raise SafetensorsError("__metadata__ must map strings to strings", path)
    return dict(value)


def _u64s(values) -> bool:
    """Whether ``values`` is a JSON array of integers in [0, 2**64)."""
    return (type(values) is list                           # not an object (_Pairs)
            and all(type(v) is int and 0 <= v < _U64 for v in values))   # bool is not int


def _fields(name, value, path):
    if isinstance(value, _Pairs):
        if len(value) == 3:
            found = dict(value)
            if len(found) == 3 and found.keys() == _FIELD_SET:     # the usual entry
                return found["dtype"], found["shape"], found["data_offsets"]
        found = {}
        for key, v in value:
            if key in _FIELDS:
                if key in found:
                    raise SafetensorsError(f"entry gives {key} twice", path, name)
                found[key] = v
        missing = [f for f in _FIELDS if f not in found]
        if missing:
            raise SafetensorsError(f"entry lacks {', '.join(missing)}", path, name)
        return found["dtype"], found["shape"], found["data_offsets"]
    if isinstance(value, list):
        if len(value) != 3:
            raise SafetensorsError(f"entry array has {len(value)} elements, not 3 "
                                   "(dtype, shape, data_offsets)", path, name)
        return value
    raise SafetensorsError(f"entry is a JSON {_kind(value)}, not an object", path, name)


def _entry(name, value, path):
    dtype, shape, offsets = _fields(name, value, path)
    if isinstance(dtype, _Pairs) and len(dtype) == 1 and dtype[0][1] is None:
        dtype = dtype[0][0]           # serde's map form of an enum variant
    if not isinstance(dtype, str) or (dtype not in DTYPE_BITS and dtype not in NO_TORCH_DTYPE):
        raise SafetensorsError(f"unknown dtype {dtype!r} (known: {', '.join(sorted(DTYPE_BITS))})",
                               path, name)
    if not _u64s(shape):
        raise SafetensorsError(f"shape must be a list of integers in [0, 2**64), got "
                               f"{_short(shape)}", path, name)
    if not _u64s(offsets) or len(offsets) != 2:
        raise SafetensorsError(f"data_offsets must be two integers in [0, 2**64), got "
                               f"{_short(offsets)}", path, name)
    return name, dtype, tuple(shape), offsets[0], offsets[1]


def _short(value) -> str:
    text = repr(list(value) if isinstance(value, _Pairs) else value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_coverage(tensors, path) -> int:
    """safetensors' rule: in offset order, each tensor begins where the
    previous ended and holds exactly its shape's bytes; returns the end."""
    start = 0
    for name, dtype, shape, begin, end in tensors:
        if begin != start or end < begin:
            raise SafetensorsError(
                f"data_offsets [{begin}, {end}] do not begin where the previous tensor ends "
                f"({start}): a gap or an overlap", path, name)
        start = end
        numel = 1
        for d in shape:
            numel *= d
            if numel >= _U64:
                raise SafetensorsError(f"shape {list(shape)} overflows 64 bits", path, name)
        bits = numel * DTYPE_BITS[dtype]
        if bits >= _U64:
            raise SafetensorsError(f"shape {list(shape)} of {dtype} overflows 64 bits", path, name)
        if bits % 8:
            raise SafetensorsError(f"shape {list(shape)} of {dtype} is not a whole number of bytes",
                                   path, name)
        if end - begin != bits // 8:
            raise SafetensorsError(f"shape {list(shape)} of {dtype} needs {bits // 8} bytes but "
                                   f"data_offsets [{begin}, {end}] hold {end - begin}", path, name)
    return start


def _check_torch(t, path):
    if any(d >= _TORCH_DIM_LIMIT for d in t.shape):
        raise SafetensorsError(f"shape {list(t.shape)} has a dimension >= 2**63, which torch "
                               "cannot hold", path, t.name)
    if t.dtype == "F4" and (not t.shape or t.shape[-1] % 2):
        raise SafetensorsError(f"F4 tensor of shape {list(t.shape)}: torch's float4_e2m1fn_x2 "
                               "needs an even last dimension", path, t.name)


# The file dtypes whose torch tensors have another shape than the file's
# (``torch_shape``).
PACKED_DTYPES = frozenset({"F4"})


def torch_shape(entry: TensorEntry) -> tuple[int, ...]:
    """The shape of ``entry``'s torch tensor: the file's, except F4, which
    torch packs two to a byte (float4_e2m1fn_x2) along the last dimension."""
    if entry.dtype in PACKED_DTYPES:
        return entry.shape[:-1] + (entry.shape[-1] // 2,)
    return entry.shape
