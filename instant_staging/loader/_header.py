"""Strict safetensors header parsing for the loader (pure Python, no torch).

A safetensors file is an 8-byte little-endian header length N, N bytes of
UTF-8 JSON, then the data section.  The JSON maps each tensor name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to
the data section) and may hold a ``"__metadata__"`` map of strings.

Everything is checked before the loader allocates anything on a device:
a header length beyond the file, JSON that is not UTF-8 or not an object
or repeats a key, an unknown dtype, a shape whose size disagrees with its
offsets, offsets outside the data section, and overlapping tensors.  Gaps
between tensors and bytes after the last one are accepted: they harm
nothing.  Each problem is a ``SafetensorsError`` (a ``ValueError``) naming
the file and, where there is one, the tensor.
"""

import json
import os
import struct
from typing import Dict, List, NamedTuple, Optional, Tuple

# The JSON header may not exceed this (the safetensors package's own limit).
MAX_HEADER_BYTES = 100_000_000

# Every dtype of the format that has a whole number of bytes per element.
# Sub-byte types (F4, F6_*) cannot be copied bytewise into a torch tensor.
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1,
    "F8_E4M3": 1, "F8_E5M2": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}

_ENTRY_KEYS = frozenset(("dtype", "shape", "data_offsets"))


class SafetensorsError(ValueError):
    """A malformed safetensors file; ``path`` and ``tensor`` say where."""

    def __init__(self, message: str, path=None, tensor: Optional[str] = None):
        self.path = os.fspath(path) if path is not None else None
        self.tensor = tensor
        self.reason = message
        where = self.path or "<safetensors>"
        if tensor is not None:
            where += f": tensor {tensor!r}"
        super().__init__(f"{where}: {message}")

    def __reduce__(self):
        # The reason, not the formatted message: pickling must not prefix twice.
        return (type(self), (self.reason, self.path, self.tensor))


class TensorEntry(NamedTuple):
    """One tensor of a file; ``begin``/``end`` are absolute file offsets."""

    name: str
    dtype: str
    shape: Tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class Header(NamedTuple):
    """A parsed file: its tensors in data order, and its metadata."""

    path: str
    file_size: int
    data_start: int
    tensors: List[TensorEntry]
    metadata: Dict[str, str]


def read_header(fd: int, path) -> Header:
    """Parses and validates the header of the open file ``fd``."""
    path = os.fspath(path)
    size = os.fstat(fd).st_size
    if size < 8:
        raise SafetensorsError(f"file of {size} bytes is too short for the 8-byte header length", path)
    (length,) = struct.unpack("<Q", _pread_exact(fd, 8, 0, path))
    if length > MAX_HEADER_BYTES:
        raise SafetensorsError(f"header length {length} exceeds the limit of {MAX_HEADER_BYTES} bytes", path)
    if 8 + length > size:
        raise SafetensorsError(f"header length {length} goes beyond the end of the file "
                               f"({size} bytes)", path)
    raw = _pread_exact(fd, length, 8, path)
    return parse_header(raw, path, size)


def parse_header(raw: bytes, path, file_size: int) -> Header:
    """Validates the JSON header ``raw`` of a file of ``file_size`` bytes."""
    path = os.fspath(path)
    data_start = 8 + len(raw)
    data_size = file_size - data_start
    obj = _decode(raw, path)
    metadata = _metadata(obj.pop("__metadata__", None), path)
    tensors = [_entry(name, value, path, data_start, data_size) for name, value in obj.items()]
    tensors.sort(key=lambda t: (t.begin, t.end))
    _check_overlaps(tensors, path, data_start)
    return Header(path, file_size, data_start, tensors, metadata)


def _pread_exact(fd, n, offset, path) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise SafetensorsError(f"file ended at byte {offset + len(data)} while reading "
                               f"{n} header bytes at {offset}", path)
    return data


def _decode(raw, path) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SafetensorsError(f"header is not UTF-8 ({e.reason} at byte {8 + e.start})", path) from None
    if not text.startswith("{"):
        raise SafetensorsError("header is not a JSON object (it must start with '{')", path)
    try:
        obj = json.loads(text, object_pairs_hook=lambda pairs: _no_duplicates(pairs, path))
    except json.JSONDecodeError as e:
        raise SafetensorsError(f"header is not valid JSON: {e.msg} at header byte {e.pos}", path) from None
    if not isinstance(obj, dict):
        raise SafetensorsError("header is not a JSON object", path)
    return obj


def _no_duplicates(pairs, path) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise SafetensorsError("name appears twice in the header", path, key)
        out[key] = value
    return out


def _metadata(value, path) -> Dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise SafetensorsError("__metadata__ must map strings to strings", path)
    return dict(value)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _entry(name, value, path, data_start, data_size) -> TensorEntry:
    if not isinstance(value, dict):
        raise SafetensorsError("entry is not a JSON object", path, name)
    keys = set(value)
    if keys != _ENTRY_KEYS:
        missing, extra = sorted(_ENTRY_KEYS - keys), sorted(keys - _ENTRY_KEYS)
        raise SafetensorsError(f"entry must have exactly dtype, shape and data_offsets"
                               f"{' (missing ' + ', '.join(missing) + ')' if missing else ''}"
                               f"{' (unexpected ' + ', '.join(extra) + ')' if extra else ''}",
                               path, name)
    dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise SafetensorsError(f"unknown dtype {dtype!r} (known: {', '.join(sorted(DTYPE_SIZES))})",
                               path, name)
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise SafetensorsError(f"shape must be a list of non-negative integers, got {shape!r}", path, name)
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(_is_int(o) and o >= 0 for o in offsets)):
        raise SafetensorsError(f"data_offsets must be two non-negative integers, got {offsets!r}",
                               path, name)
    begin, end = offsets
    if begin > end:
        raise SafetensorsError(f"data_offsets [{begin}, {end}] end before they begin", path, name)
    if end > data_size:
        raise SafetensorsError(f"data_offsets [{begin}, {end}] lie outside the data section of "
                               f"{data_size} bytes", path, name)
    numel = 1
    for d in shape:
        numel *= d
    expected = numel * DTYPE_SIZES[dtype]
    if end - begin != expected:
        raise SafetensorsError(f"shape {shape} of {dtype} needs {expected} bytes but data_offsets "
                               f"[{begin}, {end}] hold {end - begin}", path, name)
    return TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _check_overlaps(tensors, path, data_start):
    # Sorted by begin: a tensor overlaps another only if it starts before
    # the furthest end seen so far.  Empty tensors overlap nothing.
    furthest, owner = 0, None
    for t in tensors:
        if t.begin == t.end:
            continue
        if owner is not None and t.begin < furthest:
            raise SafetensorsError(
                f"data_offsets [{t.begin - data_start}, {t.end - data_start}] overlap those of "
                f"{owner.name!r} [{owner.begin - data_start}, {owner.end - data_start}]", path, t.name)
        if t.end > furthest:
            furthest, owner = t.end, t
