"""``instant_staging.loader.load(data, device)`` against ``safetensors.torch.load``
(issue 21, finding 3).

The same verdict on every case of tests/loader/test_header_validity.py (upstream's,
the hostile ones, serde_json's edges) and on generated files and their
mutations; then the same tensors, bit for bit, with each tensor owning its
memory.  Bad ``data`` and bad ``device`` fail before anything is allocated.
"""

import mmap
import os
import struct
import tempfile
import warnings

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from instant_staging.loader import SafetensorsError, load

from support.headers import CASES, UPSTREAM, encode, raw, valid_file


def theirs(data):
    """safetensors.torch.load's tensors, or None where it rejects ``data``.
    Where its Rust side accepted the bytes but its Python side fails (F4
    and F8_E8M0 lack from its dtype table: KeyError; a zero-element tensor
    whose contiguous strides overflow int64: torch.empty's RuntimeError),
    the verdict of its load_file on the same bytes decides, as for ours."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")    # frombuffer of read-only bytes
            return st.load(bytes(data))
    except (KeyError, RuntimeError):
        pass                       # valid bytes its torch side cannot make
    except Exception:
        return None
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "f.safetensors")
        with open(path, "wb") as f:
            f.write(data)
        try:
            return st.load_file(path)
        except Exception:
            return None


def ours(data):
    try:
        return load(data)
    except SafetensorsError:
        return None


def assert_agree(data):
    expected, got = theirs(data), ours(data)
    assert (expected is None) == (got is None), (
        f"safetensors {'rejects' if expected is None else 'accepts'}, we "
        f"{'reject' if got is None else 'accept'}: {bytes(data[:200])!r}")
    if got is None:
        return
    assert set(got) == set(expected)
    for name, t in expected.items():
        g = got[name]
        assert g.dtype == t.dtype and g.shape == t.shape and g.device.type == "cpu", name
        assert raw(g) == raw(t), name


@pytest.mark.parametrize("name", sorted(UPSTREAM))
def test_upstream_cases(name):
    data, accepted = UPSTREAM[name]
    assert (ours(data) is not None) == accepted
    assert_agree(data)


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_cases(name):
    assert_agree(CASES[name])


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=valid_file(), mutation=hs.sampled_from(["none", "length", "truncate", "trailing",
                                                     "lead"]),
       k=hs.integers(1, 9), compact=hs.booleans())
def test_differential_against_safetensors_load(spec, mutation, k, compact):
    entries, data = spec
    header = encode(entries, lead=" " * k if mutation == "lead" else "", compact=compact)
    length = len(header) + (k if mutation == "length" else 0)
    body = struct.pack("<Q", length) + header + data
    if mutation == "truncate":
        body = body[:-k]
    elif mutation == "trailing":
        body += bytes(k)
    assert_agree(body)


def every_dtype():
    g = torch.Generator().manual_seed(5)
    out = {}
    for name, dtype in [("f32", torch.float32), ("f16", torch.float16), ("bf16", torch.bfloat16),
                        ("f64", torch.float64), ("i8", torch.int8), ("u8", torch.uint8),
                        ("i16", torch.int16), ("u16", torch.uint16), ("i32", torch.int32),
                        ("u32", torch.uint32), ("i64", torch.int64), ("u64", torch.uint64),
                        ("c64", torch.complex64), ("f8e4", torch.float8_e4m3fn),
                        ("f8e5", torch.float8_e5m2), ("f8e8", torch.float8_e8m0fnu)]:
        bits = torch.randint(0, 256, (3, 8 * dtype.itemsize), generator=g, dtype=torch.uint8)
        out[name] = bits.view(dtype)
    out["bool"] = torch.tensor([[True, False], [False, True]])
    out["scalar"] = torch.tensor(1.5)
    out["empty"] = torch.zeros(0, 3, dtype=torch.float16)
    return out


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "mmap"])
def test_every_dtype_bit_for_bit_and_owning_its_memory(tmp_path, kind):
    tensors = every_dtype()
    data = st.save(tensors)
    expected = theirs(data)
    if kind == "mmap":
        path = tmp_path / "m.safetensors"
        path.write_bytes(data)
        with open(path, "rb") as f:
            arg = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    else:
        arg = {"bytes": data, "bytearray": bytearray(data), "memoryview": memoryview(data)}[kind]
    got = load(arg)
    assert list(got) == list(st.load_file(_write(tmp_path, data)))    # the file's order
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        assert got[name].stride() == t.stride(), name
        assert raw(got[name]) == raw(t), name
    if kind in ("bytearray", "mmap"):
        arg[:] = bytes(len(arg))          # the tensors own their memory
        if kind == "mmap":
            arg.close()
        for name, t in expected.items():
            assert raw(got[name]) == raw(t), name


def _write(tmp_path, data):
    path = tmp_path / "ref.safetensors"
    path.write_bytes(data)
    return path


def test_f4_is_loaded_as_load_file_loads_it(tmp_path):
    packed = torch.randint(0, 256, (2, 3), dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    data = st.save({"w": packed})
    got = load(data)["w"]
    ref = st.load_file(_write(tmp_path, data))["w"]
    assert got.dtype == ref.dtype == torch.float4_e2m1fn_x2 and got.shape == ref.shape
    assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize("data, exc, match", [
    ("a str", TypeError, "not a str"),
    (3, TypeError, "not int"),
    (None, TypeError, "not NoneType"),
    (memoryview(bytes(16))[::2], ValueError, "contiguous"),
    (b"", SafetensorsError, "too short"),
])
def test_bad_data(data, exc, match):
    with pytest.raises(exc, match=match):
        load(data)


@pytest.mark.parametrize("device", ["", "mps", "meta", "cuda:x", "cpu:0:1", -1, True, 1.5, None])
def test_bad_device_is_a_value_or_type_error_before_allocating(device, monkeypatch):
    data = st.save({"a": torch.zeros(4)})
    calls = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: calls.append(a) or real_empty(*a, **k))
    with pytest.raises((ValueError, TypeError)) as e:
        load(data, device)
    assert repr(device) in str(e.value) or str(device) in str(e.value), str(e.value)
    assert not calls
