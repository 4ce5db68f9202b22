"""The header cases our reader is compared with safetensors on, shared by
the header, bytes and dtype tests: upstream's own validation tests
(safetensors/src/tensor.rs, as byte strings), the hostile cases of issue
10 and the edges of serde_json that safetensors inherits, and a
hypothesis strategy of valid files with their encoder.  Without torch or
hypothesis the test module importing this is skipped, as if it had asked.
"""

import json
import struct

import pytest

torch = pytest.importorskip("torch")
hs = pytest.importorskip("hypothesis.strategies")


def blob(header, data=b"", length=None):
    """8-byte length + header (str/bytes, or an object dumped as JSON) + data."""
    if isinstance(header, (dict, list)):
        header = json.dumps(header)
    if isinstance(header, str):
        header = header.encode("utf-8", "surrogatepass")
    n = len(header) if length is None else length
    return struct.pack("<Q", n) + header + data


def raw(t):
    if t.numel() == 0:
        return b""
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


T = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
TJ = json.dumps(T)
D8 = bytes(range(8))


# -- upstream's tests (safetensors/src/tensor.rs), as files --------------------

UPSTREAM = {
    # name: (bytes, accepted)
    "deserialization": (b'<\x00\x00\x00\x00\x00\x00\x00{"test":{"dtype":"I32","shape":[2,2],'
                        b'"data_offsets":[0,16]}}' + b"\x00" * 16, True),
    "empty_shapes_allowed": (b'8\x00\x00\x00\x00\x00\x00\x00{"test":{"dtype":"I32","shape":[],'
                             b'"data_offsets":[0,4]}}\x00\x00\x00\x00', True),
    "empty": (b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ", True),
    "empty_with_metadata": (b'(\x00\x00\x00\x00\x00\x00\x00{"__metadata__":{"framework":"pt"}}     ',
                            True),
    "metadata_incomplete_buffer_extra": (
        b'<\x00\x00\x00\x00\x00\x00\x00{"test":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]}}'
        + b"\x00" * 16 + b"extra_bogus_data_for_polyglot_file", False),
    "metadata_incomplete_buffer_missing": (
        b'<\x00\x00\x00\x00\x00\x00\x00{"test":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]}}'
        + b"\x00" * 14, False),
    "header_too_large": (b'<\x00\x00\x00\x00\xff\xff\xff{"test":{"dtype":"I32","shape":[2,2],'
                         b'"data_offsets":[0,16]}}' + b"\x00" * 16, False),
    "header_too_small": (b"", False),
    "invalid_header_length": (b"<\x00\x00\x00\x00\x00\x00\x00", False),
    "invalid_header_non_utf8": (b"\x01\x00\x00\x00\x00\x00\x00\x00\xff", False),
    "invalid_header_not_json": (b"\x01\x00\x00\x00\x00\x00\x00\x00{", False),
    "whitespace_padded_header": (b"\x06\x00\x00\x00\x00\x00\x00\x00{}\x0d\x20\x09\x0a", True),
    "whitespace_leading_padded_header": (b"\x06\x00\x00\x00\x00\x00\x00\x00\x09\x0a{}\x0d\x20", True),
    "zero_sized_tensor": (b'<\x00\x00\x00\x00\x00\x00\x00{"test":{"dtype":"I32","shape":[2,0],'
                          b'"data_offsets":[0, 0]}}', True),
    "invalid_info": (b'<\x00\x00\x00\x00\x00\x00\x00{"test":{"dtype":"I32","shape":[2,2],'
                     b'"data_offsets":[0, 4]}}', False),
    "validation_overflow_shape": (
        b'O\x00\x00\x00\x00\x00\x00\x00{"test":{"dtype":"I32","shape":[2,18446744073709551614],'
        b'"data_offsets":[0,16]}}' + b"\x00" * 16, False),
    "validation_overflow_bytes": (
        b'N\x00\x00\x00\x00\x00\x00\x00{"test":{"dtype":"I32","shape":[2,9223372036854775807],'
        b'"data_offsets":[0,16]}}' + b"\x00" * 16, False),
    "json_attack": (blob({f"weight_{i}": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
                          for i in range(10)}, b"\x00" * 16), False),
}


# -- hostile and serde_json edge cases ------------------------------------------

# An entry with one extra (ignored) field "x" holding %s.
EXTRA = '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":%s}}'


def nested(k):
    return '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":%s}}' % ("[" * k + "]" * k)


def shifted(k):
    header = ('{"a":%s}' % TJ).encode()
    header += b" " * (-len(header) % 8 + 8)
    return struct.pack("<Q", len(header) - k) + header + D8


CASES = {
    "leading_whitespace": blob(' \n\t\r{"a":%s}' % TJ, D8),
    "trailing_whitespace": blob('{"a":%s} \r\n\t' % TJ, D8),
    "gap": blob({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                 "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}, bytes(12)),
    "trailing_bytes": blob({"a": T}, D8 + b"\0"),
    "overlap": blob({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                     "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, D8),
    "duplicate_name_last_wins": blob('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                                     '"a":%s}' % TJ, D8),
    "duplicate_name_last_short": blob('{"a":%s,'
                                      '"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}' % TJ, D8),
    "duplicate_field": blob('{"a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}}', D8),
    "duplicate_metadata": blob('{"__metadata__":{},"__metadata__":{},"a":%s}' % TJ, D8),
    "duplicate_metadata_null": blob('{"__metadata__":null,"__metadata__":null,"a":%s}' % TJ, D8),
    "duplicate_metadata_key": blob('{"__metadata__":{"x":"1","x":"2"},"a":%s}' % TJ, D8),
    "extra_field": blob({"a": dict(T, foo=[1, {"b": None}])}, D8),
    "duplicate_extra_field": blob('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1,"x":2}}', D8),
    "metadata_null": blob({"__metadata__": None, "a": T}, D8),
    "metadata_not_strings": blob({"__metadata__": {"x": 1}, "a": T}, D8),
    "metadata_list": blob({"__metadata__": [], "a": T}, D8),
    "metadata_null_value": blob('{"__metadata__":{"x":null},"a":%s}' % TJ, D8),
    "escaped_metadata_name": blob('{"\\u005f_metadata__":{"x":"1"},"a":%s}' % TJ, D8),
    "nan": blob('{"a":%s,"b":NaN}' % TJ, D8),
    "infinity_in_extra": blob('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":-Infinity}}', D8),
    "float_overflow_in_extra": blob('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1e999}}', D8),
    "float_in_extra": blob('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1e300}}', D8),
    "big_int_in_extra": blob(EXTRA % ("9" * 300), D8),
    "huge_int_in_extra": blob(EXTRA % ("9" * 400), D8),
    "5000_digit_dimension": blob('{"a":{"dtype":"F32","shape":[%s],"data_offsets":[0,8]}}' % ("9" * 5000),
                                 D8),
    "float_dimension": blob('{"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}}', D8),
    "exp_dimension": blob('{"a":{"dtype":"F32","shape":[2e0],"data_offsets":[0,8]}}', D8),
    "negative_dimension": blob('{"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}', D8),
    "minus_zero_dimension": blob('{"a":{"dtype":"F32","shape":[-0],"data_offsets":[0,0]}}'),
    "bool_dimension": blob('{"a":{"dtype":"F32","shape":[true],"data_offsets":[0,4]}}', D8[:4]),
    "dimension_2_64": blob({"a": {"dtype": "F32", "shape": [0, 2 ** 64], "data_offsets": [0, 0]}}),
    "zero_size_dimension_2_63": blob({"a": {"dtype": "F32", "shape": [0, 2 ** 63], "data_offsets": [0, 0]}}),
    "zero_size_dimension_u64_max": blob({"a": {"dtype": "F32", "shape": [0, 2 ** 64 - 1],
                                               "data_offsets": [0, 0]}}),
    "zero_size_dimension_2_62": blob({"a": {"dtype": "F32", "shape": [0, 2 ** 62], "data_offsets": [0, 0]}}),
    "zero_size_overflowing_prefix": blob({"a": {"dtype": "F32", "shape": [2 ** 40, 2 ** 40, 0],
                                                "data_offsets": [0, 0]}}),
    "zero_size_zero_first": blob({"a": {"dtype": "F32", "shape": [0, 2 ** 40, 2 ** 40],
                                        "data_offsets": [0, 0]}}),
    "bits_overflow": blob({"a": {"dtype": "F32", "shape": [2 ** 62], "data_offsets": [0, 0]}}),
    "zero_size_inside_another": blob({"a": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}, "b": T},
                                     D8),
    "zero_size_at_end": blob({"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]}, "b": T}, D8),
    "offsets_three": blob({"a": dict(T, data_offsets=[0, 8, 8])}, D8),
    "offsets_float": blob('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8.0]}}', D8),
    "offsets_object": blob('{"a":{"dtype":"F32","shape":[2],"data_offsets":{"0":0,"1":8}}}', D8),
    "missing_shape": blob({"a": {"dtype": "F32", "data_offsets": [0, 8]}}, D8),
    "lowercase_dtype": blob({"a": dict(T, dtype="f32")}, D8),
    "dtype_null": blob({"a": dict(T, dtype=None)}, D8),
    "dtype_map_form": blob('{"a":{"dtype":{"F32":null},"shape":[2],"data_offsets":[0,8]}}', D8),
    "entry_null": blob({"a": None}),
    "entry_array": blob('{"a":["F32",[2],[0,8]]}', D8),
    "entry_array_4": blob('{"a":["F32",[2],[0,8],1]}', D8),
    "entry_array_2": blob('{"a":["F32",[2]]}', D8),
    "root_array": blob("[]"),
    "empty_header": blob(""),
    "bom": blob('\ufeff{"a":%s}' % TJ, D8),
    "nul_padding": blob(('{"a":%s}' % TJ).encode() + b"\0\0", D8),
    "vertical_tab": blob('\x0b{"a":%s}' % TJ, D8),
    "control_char_in_name": blob('{"a\x01":%s}' % TJ, D8),
    "trailing_json": blob('{"a":%s} x' % TJ, D8),
    "lone_surrogate_name": blob('{"\\ud800":%s}' % TJ, D8),
    "lone_surrogate_extra": blob('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":"\\udc00"}}', D8),
    "surrogate_pair_name": blob('{"\\ud83d\\ude00":%s}' % TJ, D8),
    "empty_name": blob({"": T}, D8),
    "nested_125": blob(nested(125), D8),
    "nested_126": blob(nested(126), D8),
    "nested_10000": blob(nested(10000), D8),
    "nested_objects_120": blob('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":%s}}'
                               % ('{"y":' * 120 + "1" + "}" * 120), D8),
    "dims_65": blob({"a": {"dtype": "F32", "shape": [1] * 65, "data_offsets": [0, 4]}}, D8[:4]),
    "f6": blob({"a": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]}}, D8[:3]),
    "f4": blob({"a": {"dtype": "F4", "shape": [2, 4], "data_offsets": [0, 4]}}, D8[:4]),
    "f4_odd_last": blob({"a": {"dtype": "F4", "shape": [3, 2], "data_offsets": [0, 3]}}, D8[:3]),
    "f4_odd_last_dim": blob({"a": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]}}, D8[:3]),
    "f4_half_byte": blob({"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, D8[:2]),
    "f4_scalar": blob({"a": {"dtype": "F4", "shape": [], "data_offsets": [0, 1]}}, D8[:1]),
    "f4_zero": blob({"a": {"dtype": "F4", "shape": [3, 0], "data_offsets": [0, 0]}}),
    "f4_zero_odd": blob({"a": {"dtype": "F4", "shape": [0, 3], "data_offsets": [0, 0]}}),
    "c64": blob({"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, D8),
    "e8m0": blob({"a": {"dtype": "F8_E8M0", "shape": [8], "data_offsets": [0, 8]}}, D8),
    "header_too_long": blob('{"a":%s}' % TJ, D8, length=len('{"a":%s}' % TJ) + 1),
}
for _k in range(1, 8):
    CASES[f"header_length_short_by_{_k}"] = shifted(_k)


# -- generated files ----------------------------------------------------------------

DTYPES = [("F32", torch.float32), ("F16", torch.float16), ("BF16", torch.bfloat16), ("I64", torch.int64),
          ("I8", torch.int8), ("U8", torch.uint8), ("BOOL", torch.bool), ("F64", torch.float64),
          ("I16", torch.int16), ("I32", torch.int32)]
BITS = {"F32": 32, "F16": 16, "BF16": 16, "I64": 64, "I8": 8, "U8": 8, "BOOL": 8, "F64": 64,
        "I16": 16, "I32": 32}


@hs.composite
def valid_file(draw):
    """(entries, data): entries as [name, dtype, shape, begin, end], data bytes."""
    n = draw(hs.integers(0, 5))
    names = draw(hs.lists(hs.text(min_size=0, max_size=6), min_size=n, max_size=n, unique=True))
    entries, offset = [], 0
    for name in names:
        dtype = draw(hs.sampled_from([d for d, _ in DTYPES]))
        shape = draw(hs.lists(hs.integers(0, 4), max_size=3))
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * BITS[dtype] // 8
        entries.append([name, dtype, shape, offset, offset + nbytes])
        offset += nbytes
    data = draw(hs.binary(min_size=offset, max_size=offset))
    if "BOOL" in [e[1] for e in entries]:
        data = bytes(b & 1 for b in data)     # safetensors' bools are 0 or 1
    return entries, data


def encode(entries, metadata=None, lead="", pad=True, order=None, compact=False):
    """compact: as safetensors writes it (no spaces, UTF-8 names), the form
    _header._canonical reads without the JSON parser."""
    obj = {}
    if metadata is not None:
        obj["__metadata__"] = metadata
    for name, dtype, shape, b, e in (entries if order is None else [entries[i] for i in order]):
        obj[name] = {"dtype": dtype, "shape": shape, "data_offsets": [b, e]}
    text = lead + (json.dumps(obj, separators=(",", ":"), ensure_ascii=False) if compact
                   else json.dumps(obj))
    header = text.encode("utf-8", "surrogatepass")
    if pad:
        header += b" " * (-len(header) % 8)
    return header
