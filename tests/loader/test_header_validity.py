"""A file is valid exactly when safetensors accepts it, and then our tensors
are its tensors, bit for bit.

Three layers: upstream's own validation tests (safetensors/src/tensor.rs,
ported as byte strings), the hostile cases of issue 10 and the edges of
serde_json that safetensors inherits (each compared with the installed
safetensors), and a hypothesis differential test over generated valid
files and their mutations.  Every rejection must be a SafetensorsError,
whatever the path type.
"""

import collections
import gc
import json
import os
import pathlib
import struct

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")
safe_open = pytest.importorskip("safetensors").safe_open
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from instant_staging.loader import SafetensorsError, load_file
from instant_staging.loader._header import read_header

from support.headers import CASES, D8, TJ, UPSTREAM, blob, encode, raw, shifted, valid_file


def theirs(path):
    """safetensors' verdict: its tensors, or None for a rejected file."""
    try:
        return st.load_file(path)
    except Exception:
        return None


def ours(path):
    """Our verdict: our tensors, or None; any rejection must be SafetensorsError."""
    try:
        return load_file(path, "cpu")
    except SafetensorsError:
        return None


def _head(path):
    with open(path, "rb") as f:
        return f.read(300)


def assert_agree(path):
    expected, got = theirs(path), ours(path)
    if expected is None or got is None:
        assert got is None and expected is None, (
            f"safetensors {'accepts' if expected is not None else 'rejects'} "
            f"but we {'accept' if got is not None else 'reject'}: {_head(path)!r}")
        return False
    assert set(got) == set(expected)
    with safe_open(path, framework="pt") as f:
        fd = os.open(path, os.O_RDONLY)
        try:
            assert read_header(fd, path).metadata == f.metadata()
        finally:
            os.close(fd)
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and tuple(got[name].shape) == tuple(t.shape), name
        assert raw(got[name]) == raw(t), name
    return True


def write(tmp_path, data, name="f.safetensors"):
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


# -- upstream's tests (safetensors/src/tensor.rs), as files --------------------

@pytest.mark.parametrize("name", sorted(UPSTREAM))
def test_upstream_cases(tmp_path, name):
    data, accepted = UPSTREAM[name]
    path = write(tmp_path, data)
    assert (theirs(path) is not None) == accepted     # the port is faithful
    assert (ours(path) is not None) == accepted
    assert_agree(path)


# -- hostile and serde_json edge cases, each compared with safetensors ---------

# A name given twice whose first (shadowed) entry is invalid: safetensors
# deserializes every entry, so it rejects the file although the last entry
# is valid; a shadowed entry that is only unloadable (a dtype torch lacks,
# offsets that do not cover the data) is dropped, and the file accepted.
SHADOWED = {
    "unknown_dtype": '{"dtype":"F99","shape":[2],"data_offsets":[0,8]}',
    "missing_dtype": '{"shape":[2],"data_offsets":[0,8]}',
    "float_offsets": '{"dtype":"F32","shape":[2],"data_offsets":[0.0,8]}',
    "bool_offsets": '{"dtype":"F32","shape":[2],"data_offsets":[false,8]}',
    "negative_dimension": '{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}',
    "string_dimension": '{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}',
    "three_offsets": '{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}',
    "number": '5',
    "null": 'null',
    "field_twice": '{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}',
    "array_of_2": '["F32",[2]]',
    "dimension_2_64": '{"dtype":"F32","shape":[18446744073709551616],"data_offsets":[0,8]}',
    "f6": '{"dtype":"F6_E2M3","shape":[2],"data_offsets":[0,8]}',
    "gap": '{"dtype":"F32","shape":[1],"data_offsets":[8,12]}',
    "wrong_size": '{"dtype":"F32","shape":[3],"data_offsets":[0,8]}',
    "dimension_2_63": '{"dtype":"F32","shape":[9223372036854775808],"data_offsets":[0,8]}',
    "map_dtype": '{"dtype":{"F32":null},"shape":[2],"data_offsets":[0,8]}',
    "array_form": '["F32",[2],[0,8]]',
}
SHADOWED_REJECTED = {"unknown_dtype", "missing_dtype", "float_offsets", "bool_offsets",
                     "negative_dimension", "string_dimension", "three_offsets", "number", "null",
                     "field_twice", "array_of_2", "dimension_2_64"}


@pytest.mark.parametrize("name", sorted(SHADOWED))
def test_every_entry_of_a_name_given_twice_is_checked(tmp_path, name):
    """safetensors' verdict on the file, stated: the last entry of "a" is
    valid, so the shadowed one alone decides."""
    path = write(tmp_path, blob('{"a":%s,"a":%s}' % (SHADOWED[name], TJ), D8))
    rejected = theirs(path) is None
    assert rejected == (name in SHADOWED_REJECTED), "safetensors changed its mind"
    if rejected:
        with pytest.raises(SafetensorsError, match="'a'"):
            load_file(path, "cpu")
    assert_agree(path)


@pytest.mark.parametrize("shape, nbytes", [([2], 4), ([1], 8)])
def test_byte_count_is_checked_by_both_readings(tmp_path, shape, nbytes):
    """An F32 tensor whose offsets hold fewer or more bytes than its shape
    needs: the C entry rules decline it, the Python rules reject it, each
    by itself, and so does the loader (a randomized test alone once found
    the check missing)."""
    from instant_staging.loader import _canonical
    from instant_staging.loader import _header as H
    tensors = [("a", "F32", tuple(shape), 0, nbytes)]
    what = f"F32 {shape} in {nbytes} bytes"
    assert _canonical.checked(tensors, 8, H.DTYPE_BITS, H.TensorEntry) is None, (
        f"the C entry rules accept {what}")
    try:
        H._check_coverage(tensors, "x")
    except SafetensorsError as e:
        assert f"needs {4 * shape[0]} bytes" in str(e), str(e)
    else:
        raise AssertionError(f"the Python entry rules accept {what}")
    path = write(tmp_path, blob({"a": {"dtype": "F32", "shape": shape, "data_offsets": [0, nbytes]}},
                                bytes(nbytes)))
    assert theirs(path) is None
    assert ours(path) is None, f"the loader accepts {what}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_case_agrees_with_safetensors(tmp_path, name):
    assert_agree(write(tmp_path, CASES[name]))


def test_leading_whitespace_and_shifted_data_decided_as_safetensors(tmp_path):
    # The two cases issue 10 found wrong, stated without the oracle.
    assert ours(write(tmp_path, CASES["leading_whitespace"])) is not None
    for k in range(1, 8):
        assert ours(write(tmp_path, shifted(k), f"s{k}.safetensors")) is None


@pytest.mark.parametrize("name", ["nested_10000", "5000_digit_dimension", "zero_size_dimension_2_63",
                                  "lone_surrogate_name", "duplicate_field", "gap"])
@pytest.mark.parametrize("kind", ["str", "bytes", "pathlike"])
def test_every_invalid_file_is_safetensors_error_whatever_the_path_type(tmp_path, name, kind):
    path = write(tmp_path, CASES[name])
    arg = {"str": path, "bytes": os.fsencode(path), "pathlike": pathlib.Path(path)}[kind]
    with pytest.raises(SafetensorsError) as info:
        load_file(arg, "cpu")
    assert info.value.path == path


# -- generated files and their mutations --------------------------------------

MUTATIONS = ["none", "length+k", "length-k", "shuffle", "trailing", "truncate", "whitespace",
             "nesting", "huge_dim", "zero_size_huge_dim", "swap_offsets", "shift_offsets",
             "duplicate", "metadata", "gap"]


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=valid_file(), mutation=hs.sampled_from(MUTATIONS), k=hs.integers(1, 9),
       seed=hs.randoms(use_true_random=False), compact=hs.booleans())
def test_differential_against_safetensors(tmp_path_factory, spec, mutation, k, seed, compact):
    entries, data = spec
    entries = [list(e) for e in entries]
    lead, metadata, order, extra = "", None, None, b""
    length_delta = 0
    if mutation == "length+k":
        length_delta = k
    elif mutation == "length-k":
        length_delta = -k
    elif mutation == "shuffle":
        order = list(range(len(entries)))
        seed.shuffle(order)
    elif mutation == "trailing":
        extra = bytes(k)
    elif mutation == "truncate":
        data = data[:max(0, len(data) - k)]
    elif mutation == "whitespace":
        lead = seed.choice([" ", "\n", "\t", "\r", "\x0b", "\x0c"]) * k
    elif mutation == "nesting" and entries:
        depth = seed.choice([100, 125, 126, 127, 1000, 10_000])
        header = (encode(entries, pad=False, compact=compact)[:-1] + b',"z":'
                  + b"[" * depth + b"]" * depth + b"}")
        path = write(tmp_path_factory.mktemp("n"), struct.pack("<Q", len(header)) + header + data)
        assert_agree(path)
        return
    elif mutation == "huge_dim" and entries:
        entries[0][2] = entries[0][2] + [seed.choice([2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1, 2 ** 64, 10 ** 40])]
    elif mutation == "zero_size_huge_dim":
        entries.append(["zz", "F32", [0, seed.choice([2 ** 62, 2 ** 63, 2 ** 64 - 1])],
                        entries[-1][4] if entries else 0, entries[-1][4] if entries else 0])
    elif mutation == "swap_offsets" and len(entries) >= 2:
        i, j = seed.sample(range(len(entries)), 2)
        entries[i][3:5], entries[j][3:5] = entries[j][3:5], entries[i][3:5]
    elif mutation == "shift_offsets" and entries:
        i = seed.randrange(len(entries))
        entries[i][3] += seed.choice([-1, 1]) if entries[i][3] else 1
        entries[i][4] += seed.choice([0, 1])
    elif mutation == "duplicate" and entries:
        header = encode(entries, pad=False, compact=compact)[:-1] + b"," \
            + json.dumps(entries[0][0]).encode() + b":" \
            + json.dumps({"dtype": entries[0][1], "shape": entries[0][2],
                          "data_offsets": entries[0][3:5]}).encode() + b"}"
        path = write(tmp_path_factory.mktemp("d"), struct.pack("<Q", len(header)) + header + data)
        assert_agree(path)
        return
    elif mutation == "metadata":
        metadata = seed.choice([{}, {"a": "b"}, None, {"x": 1}])
    elif mutation == "gap" and entries:
        i = seed.randrange(len(entries))
        for e in entries[i:]:
            e[3] += k
            e[4] += k
        data = data + bytes(k)
    header = encode(entries, metadata=metadata, lead=lead, order=order, compact=compact)
    length = max(0, len(header) + length_delta)
    body = struct.pack("<Q", length) + header + data + extra
    path = write(tmp_path_factory.mktemp("h"), body)
    assert_agree(path)


# -- the canonical form: read by _canonical, decided as by the JSON parser ---------

def _both_paths(text):
    """(_canonical's reading, _parse's reading or its error), comparable."""
    from instant_staging.loader import _header as H
    raw = text.encode("utf-8", "surrogatepass")
    fast = H._canonical(raw)
    try:
        exact = H._parse(text, raw, "x")
    except SafetensorsError as e:
        exact = e
    return fast, exact


def test_files_safetensors_writes_take_the_canonical_path(tmp_path):
    from instant_staging.loader import _header as H
    tensors = {"b": torch.zeros(2, 3), "a.weight": torch.ones(4, dtype=torch.bfloat16),
               "\u00e9\u4e2d": torch.zeros(1, dtype=torch.int64), "scalar": torch.tensor(1.0),
               "empty": torch.zeros(0, 5)}
    for metadata in (None, {"format": "pt", "k": "v w"}):
        path = str(tmp_path / "m.safetensors")
        st.save_file(tensors, path, metadata=metadata)
        with open(path, "rb") as f:
            raw = f.read()
        text = raw[8:8 + struct.unpack("<Q", raw[:8])[0]].decode()
        fast, exact = _both_paths(text)
        assert fast is not None, text
        assert fast[0] == exact[0] and sorted(fast[1]) == sorted(exact[1])
        fd = os.open(path, os.O_RDONLY)
        try:
            header = H.read_header(fd, path)
        finally:
            os.close(fd)
        assert header.metadata == metadata
        # Strings and integers only: the collector never walks them.
        assert not any(gc.is_tracked(t) or gc.is_tracked(t.shape) for t in header.tensors)


@pytest.mark.parametrize("text", [
    '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
    '{"__metadata__":{"a":"b"},"__metadata__":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
    '{"a":{"dtype":"F31","shape":[1],"data_offsets":[0,4]}}',
    '{"a":{"dtype":"F32","shape":[01],"data_offsets":[0,4]}}',
    '{"a":{"dtype":"F32","shape":[18446744073709551616],"data_offsets":[0,4]}}',
    '{"a":{"shape":[1],"dtype":"F32","data_offsets":[0,4]}}',
    '{"a\\u0041":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
    '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}} x',
    ' {"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
    '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},}',
    '{"__metadata__":{"a":1},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
    '{"__metadata__":{"a":"b"}}x',
    '{}',
])
def test_anything_else_takes_the_full_parser(text):
    fast, _ = _both_paths(text)
    assert fast is None


@pytest.mark.parametrize("text", [
    '{"__metadata__":{}}',
    '{"__metadata__":{"a":"b","a":"c"},"x":{"dtype":"U8","shape":[],"data_offsets":[0,1]}}',
    '{"x":{"dtype":"F4","shape":[9223372036854775808,2],"data_offsets":[0,1]}}   ',
    '{"\u00e9 \x7f":{"dtype":"BOOL","shape":[0,3],"data_offsets":[0,0]}}',
])
def test_canonical_reading_equals_the_parser(text):
    fast, exact = _both_paths(text)
    assert fast is not None and not isinstance(exact, Exception)
    assert fast[0] == exact[0] and fast[1] == exact[1]


# Bytes that matter to the canonical reading: its punctuation, digits, dtype
# letters, an escape, a control character, a space, and a multi-byte letter.
_NEAR_MISSES = list('{}[]:,"\\ 0123456789AFBUI_xn') + ["\x01", "\u00e9", "\x7f"]


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=valid_file(), metadata=hs.sampled_from([None, {}, {"format": "pt", "k": "v"}]),
       edits=hs.lists(hs.tuples(hs.sampled_from(["insert", "delete", "replace"]),
                                hs.integers(0, 10 ** 6), hs.sampled_from(_NEAR_MISSES)),
                      max_size=2))
def test_canonical_reading_never_differs_from_the_parser(spec, metadata, edits):
    """A compact header, edited a byte or two where the reading decides: the
    C reading accepts exactly what it can read as the JSON parser does, and
    declines the rest (None) for the parser to judge."""
    entries, _ = spec
    text = encode(entries, metadata=metadata, pad=False, compact=True).decode()
    fast, exact = _both_paths(text)
    plain = not any(c in '"\\' or ord(c) < 0x20 for e in entries for c in e[0])
    if (entries or metadata is not None) and plain:
        assert fast is not None, text          # what safetensors writes, without escapes
    for op, where, ch in edits:
        i = where % (len(text) + 1)
        if op == "insert":
            text = text[:i] + ch + text[i:]
        elif op == "delete":
            text = text[:i] + text[i + 1:]
        else:
            text = text[:i] + ch + text[i + 1:]
    fast, exact = _both_paths(text)
    if fast is not None:
        assert not isinstance(exact, Exception), (text, exact)
        assert fast[0] == exact[0] and fast[1] == exact[1], text


def _entry_rules(tensors, data_start):
    """Both readings of the entries' rules: the C one (None: declined) and
    the Python one (its Header's tensors, or the error it raised)."""
    from instant_staging.loader import _canonical
    from instant_staging.loader import _header as H
    fast = _canonical.checked([tuple(t) for t in tensors], data_start, H.DTYPE_BITS, H.TensorEntry)
    try:
        end = H._check_coverage(tensors, "x")
        exact = H._checked_slowly(tensors, "x", data_start + end, data_start, None).tensors
    except SafetensorsError as e:
        exact = e
    return fast, exact


_BIG = [2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1, 2 ** 32]


def _edit_values(entries, edits):
    """Applies ``(what, k, value)`` edits where an entry rule decides: the
    last dimension, an offset, the dtype, or an F4 row (entries
    ``[name, dtype, shape, begin, end]``, shape a tuple or a list)."""
    from instant_staging.loader import _header as H
    for what, k, value in edits:
        if not entries:
            return
        t = entries[k % len(entries)]
        more = type(t[2])([value])
        if what == "dim" and t[2]:
            t[2] = t[2][:-1] + more
        elif what == "begin":
            t[3] = value
        elif what == "end":
            t[4] = value
        elif what == "dtype":
            t[1] = sorted(H.DTYPE_BITS)[value % len(H.DTYPE_BITS)]
        elif what == "f4":
            t[1], t[2] = "F4", t[2] + more


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=valid_file(), data_start=hs.integers(8, 10 ** 6),
       edits=hs.lists(hs.tuples(hs.sampled_from(["dim", "begin", "end", "dtype", "f4"]),
                                hs.integers(0, 99), hs.sampled_from(_BIG + [0, 1, 2, 3])),
                      max_size=2))
def test_c_entry_rules_never_differ_from_the_python_rules(spec, data_start, edits):
    """Entries sorted by offset, edited where a rule decides (a dimension, an
    offset, the dtype): the C check accepts exactly what the Python rules
    accept, with the same entries, and declines (None) the rest; it never
    declines an entry list safetensors' writer makes."""
    from instant_staging.loader import _header as H
    tensors = [[n, d, tuple(s), b, e] for n, d, s, b, e in spec[0]]
    if tensors:
        fast, exact = _entry_rules(tensors, data_start)
        assert fast is not None and fast[0] == exact
    _edit_values(tensors, edits)
    tensors.sort(key=lambda t: (t[3], t[4]))
    fast, exact = _entry_rules(tensors, data_start)
    if fast is not None:
        assert not isinstance(exact, Exception), (tensors, exact)
        assert fast[0] == exact and all(type(t) is H.TensorEntry for t in fast[0])


# -- the one-pass table: read and checked together ------------------------------

def _table_and_two_passes(raw):
    """(_canonical.table's reading, read + sort + checked's), comparable."""
    from instant_staging.loader import _canonical
    from instant_staging.loader import _header as H
    fast = _canonical.table(raw, H._DTYPE_BYTES, H.DTYPE_BITS, H.TensorEntry)
    two = H._canonical(raw)
    if two is not None:
        metadata, tensors = two
        tensors.sort(key=H._OFFSETS)
        entries = _canonical.checked(tensors, 8 + len(raw), H.DTYPE_BITS, H.TensorEntry)
        two = None if entries is None else (metadata, *entries)
    return fast, two


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=valid_file(), metadata=hs.sampled_from([None, {}, {"format": "pt"}]),
       shuffle=hs.randoms(use_true_random=False),
       values=hs.lists(hs.tuples(hs.sampled_from(["dim", "begin", "end", "dtype", "f4"]),
                                 hs.integers(0, 99), hs.sampled_from(_BIG + [0, 1, 2, 3])),
                       max_size=2),
       edits=hs.lists(hs.tuples(hs.sampled_from(["insert", "delete", "replace"]),
                                hs.integers(0, 10 ** 6), hs.sampled_from(_NEAR_MISSES)),
                      max_size=1))
def test_table_reading_equals_read_then_checked(spec, metadata, shuffle, values, edits):
    """The loader's one-pass table accepts exactly what the canonical
    reading and the C entry rules accept one after the other, with the same
    metadata, entries (TensorEntry, sorted, absolute offsets) and end; a
    value or a byte edited where a rule or the reading decides included.
    Every file safetensors writes (plain names) takes it."""
    from instant_staging.loader import _header as H
    entries = [list(e) for e in spec[0]]
    order = list(range(len(entries)))
    shuffle.shuffle(order)                  # the header's order is not the data's
    text = encode(entries, metadata=metadata, pad=False, compact=True, order=order).decode()
    fast, two = _table_and_two_passes(text.encode())
    plain = not any(c in '"\\' or ord(c) < 0x20 for e in entries for c in e[0])
    if (entries or metadata is not None) and plain:
        assert fast is not None, text
    assert fast == two, text
    _edit_values(entries, values)
    text = encode(entries, metadata=metadata, pad=False, compact=True, order=order).decode()
    for op, where, ch in edits:
        i = where % (len(text) + 1)
        text = text[:i] + ("" if op == "delete" else ch) + text[i + (op != "insert"):]
    fast, two = _table_and_two_passes(text.encode("utf-8", "surrogatepass"))
    assert fast == two, text
    if fast is not None:
        assert all(type(t) is H.TensorEntry for t in fast[1])


def test_table_reuses_the_shapes_it_made_and_takes_only_five_field_named_tuples():
    # The table keeps the last few shapes it made (loader/_canonical.pyx):
    # six shapes in turn, more than it keeps, in and out of order, give
    # the two readings' entries, equal tuples, and shapes shared only
    # between equal ones.
    from instant_staging.loader import _canonical
    from instant_staging.loader import _header as H
    shapes = [[2, 3], [3, 2], [6], [1, 6], [6, 1], [1, 2, 3]]
    entries, pos = [], 0
    for k in range(40):
        entries.append([f"t{k:02d}", "F32", shapes[k % 5 if k < 20 else k % 6], pos, pos + 24])
        pos += 24
    for order in (list(range(40)), list(reversed(range(40)))):
        raw = encode(entries, pad=False, compact=True, order=order)
        fast, two = _table_and_two_passes(raw)
        assert fast is not None and fast == two
        got = {t.name: t.shape for t in fast[1]}
        assert got == {name: tuple(shape) for name, _, shape, _, _ in entries}
        made = {id(shape): shape for shape in got.values()}
        assert len({shape for shape in made.values()}) == 6 <= len(made)
    for kind in (tuple, collections.namedtuple("Three", "a b c"),
                 type("WithDict", (H.TensorEntry,), {})):
        with pytest.raises(TypeError, match="five fields"):
            _canonical.table(raw, H._DTYPE_BYTES, H.DTYPE_BITS, kind)


@pytest.mark.parametrize("text", [
    # a name twice: the reading declines (the parser keeps the last)
    '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
    # __metadata__ as an entry
    '{"__metadata__":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
    # empty tensors at one offset: their header order is kept (a stable sort)
    '{"z":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"a":{"dtype":"F32","shape":[0,2],"data_offsets":[0,0]},'
    '"m":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}',
    # a gap, an overlap, a byte count off by one, an odd F4 row
    '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"U8","shape":[1],"data_offsets":[2,3]}}',
    '{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}',
    '{"a":{"dtype":"F16","shape":[2],"data_offsets":[0,3]}}',
    '{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,1]}}',
    '{"__metadata__":{"format":"pt"}}',
])
def test_table_reading_on_the_edge_cases(text):
    fast, two = _table_and_two_passes(text.encode())
    assert fast == two
