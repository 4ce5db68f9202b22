"""Every dtype safetensors knows gets correct results or a clear error naming
the tensor and the dtype, before anything is read (issue 21, finding 14).

Whole-byte dtypes: load_file, get_tensor and slices equal safetensors' bit
for bit; ``dtype=`` converts each floating one as torch's ``.to()`` does.
F4 (torch's float4_e2m1fn_x2, two values of the last dimension per byte):
get_tensor and slices that take the last dimension whole give the packed
tensor; other slices, and ``dtype=`` (torch converts F4 to nothing), are
errors naming the tensor and F4 before anything is read or allocated;
float4_e2m1fn_x2 is no conversion target.  F6_*: safetensors.torch refuses
them and so do we, saying which dtype.
"""

import contextlib

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")
from safetensors import SafetensorError
from safetensors import safe_open as st_safe_open

from instant_staging.loader import (
    TORCH_DTYPES,
    SafetensorsError,
    _safe_open,
    _staging_pool,
    load_file,
    safe_open,
)
from instant_staging.loader._header import DTYPE_BITS

from support.headers import blob

WHOLE = sorted(name for name, bits in DTYPE_BITS.items() if bits % 8 == 0)
INDICES = [slice(None), slice(1, 3), 2, (slice(None), 1), (Ellipsis, slice(0, 2)), (), -1]


def as_bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def same(got, ref):
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert torch.equal(as_bytes(got), as_bytes(ref))


def random_of(dtype, shape, seed=0):
    """A tensor of ``dtype`` whose bytes are random (bools 0/1)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * dtype.itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


@pytest.fixture
def allocations(monkeypatch):
    made = []
    real_empty, real_take = torch.empty, _staging_pool.take

    def empty(*a, **k):
        if k.get("device") != "meta":
            made.append(a)
        return real_empty(*a, **k)
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(_staging_pool, "take",
                        lambda *a, **k: made.append(("staging", a)) or real_take(*a, **k))
    return made


@pytest.fixture
def no_reads(monkeypatch):
    reads = []
    monkeypatch.setattr(_safe_open, "LoadIterator",
                        lambda *a, **k: reads.append(a) or contextlib.nullcontext(iter(())))
    return reads


@pytest.mark.parametrize("name", WHOLE)
def test_whole_byte_dtypes_equal_safetensors(tmp_path, name):
    dtype = getattr(torch, TORCH_DTYPES[name])
    path = tmp_path / "m.safetensors"
    st.save_file({"t": random_of(dtype, (4, 3), seed=len(name)), "s": random_of(dtype, (5,))}, path)
    ref = st.load_file(path)
    got = load_file(path)
    for k in ref:
        same(got[k], ref[k])
    with safe_open(path, "pt") as f, st_safe_open(path, "pt") as g:
        assert f.get_slice("t").get_dtype() == g.get_slice("t").get_dtype() == name
        for index in INDICES:
            same(f.get_slice("t")[index], g.get_slice("t")[index])
        same(f.get_tensor("s"), g.get_tensor("s"))


@pytest.mark.parametrize("name", WHOLE)
def test_dtype_conversion_of_every_whole_byte_dtype(tmp_path, name):
    dtype = getattr(torch, TORCH_DTYPES[name])
    path = tmp_path / "m.safetensors"
    st.save_file({"t": random_of(dtype, (4, 3), seed=3)}, path)
    ref = st.load_file(path)["t"]
    got = load_file(path, dtype=torch.bfloat16)["t"]
    if dtype.is_floating_point:
        expected = ref.to(torch.bfloat16)
        assert got.dtype == torch.bfloat16
        assert torch.equal(as_bytes(got), as_bytes(expected))       # NaNs as .to() makes them
    else:
        same(got, ref)          # integer, bool and complex tensors are kept


# -- F4 ------------------------------------------------------------------------------

@pytest.fixture
def f4(tmp_path):
    """A file with F4 tensors of file shapes [4, 6] and [12] (torch's packed
    [4, 3] and [6]) and an F32 one; returns (path, {name: packed tensor})."""
    tensors = {"w": random_of(torch.float4_e2m1fn_x2, (4, 3), seed=1),
               "v": random_of(torch.float4_e2m1fn_x2, (6,), seed=2),
               "x": torch.randn(4, 6)}
    path = tmp_path / "f4.safetensors"
    st.save_file(tensors, path)
    return path, tensors


def test_f4_load_file_and_get_tensor_equal_safetensors(f4):
    path, tensors = f4
    ref = st.load_file(path)
    got = load_file(path)
    for k in tensors:
        same(got[k], ref[k])
    with safe_open(path, "pt") as f, st_safe_open(path, "pt") as g:
        for k in tensors:
            same(f.get_tensor(k), g.get_tensor(k))
        assert f.get_slice("w").get_shape() == g.get_slice("w").get_shape() == [4, 6]
        assert f.get_slice("w").get_dtype() == "F4"


@pytest.mark.parametrize("index", [slice(None), slice(1, 3), 2, -1, (1, slice(None)), (Ellipsis,),
                                   (None, 2), (slice(0, 4, 2), Ellipsis), (), (slice(None), slice(0, 6)),
                                   (slice(1, 3), slice(-100, 100))], ids=repr)
def test_f4_slices_that_take_the_last_dimension_whole(f4, index):
    path, tensors = f4
    with safe_open(path, "pt") as f:
        got = f.get_slice("w")[index]
    expected = tensors["w"].view(torch.uint8)[index].view(torch.float4_e2m1fn_x2)
    same(got, expected)
    # safetensors' own F4 slices fail whatever the index (its view has the
    # file's shape over half the bytes): nothing to compare with there
    with st_safe_open(path, "pt") as g, pytest.raises(RuntimeError):
        g.get_slice("w")[index]


def test_f4_1d_slices(f4):
    path, tensors = f4
    with safe_open(path, "pt") as f:
        same(f.get_slice("v")[:], tensors["v"])
        same(f.get_slice("v")[()], tensors["v"])
        with pytest.raises(SafetensorsError, match=r"'v'.*F4.*whole"):
            f.get_slice("v")[0:4]


@pytest.mark.parametrize("index", [(Ellipsis, 0), (slice(None), slice(0, 2)), (slice(None), 1),
                                   (0, 3), (slice(None), slice(None, None, 2)), [0, 1],
                                   torch.tensor([0, 1]), (slice(None), [0, 1])], ids=repr)
def test_f4_slices_of_the_last_dimension_are_clear_errors_before_reading(f4, index, no_reads):
    path, _ = f4
    with safe_open(path, "pt") as f, pytest.raises(SafetensorsError) as e:
        f.get_slice("w")[index]
    message = str(e.value)
    assert "tensor 'w'" in message and "F4" in message and "float4_e2m1fn_x2" in message, message
    assert isinstance(e.value, SafetensorError)
    assert no_reads == []


def test_f4_out_of_range_is_torchs_error_in_the_files_shape(f4, no_reads):
    path, _ = f4
    with safe_open(path, "pt") as f:
        with pytest.raises(IndexError, match="index 9 is out of bounds for dimension 0 with size 4"):
            f.get_slice("w")[9]
        with pytest.raises(IndexError, match="too many indices"):
            f.get_slice("w")[0, 0, 0]
    assert no_reads == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, "float64",
                                   torch.float8_e4m3fn])
def test_dtype_conversion_of_f4_is_refused_before_anything_is_allocated(f4, dtype, allocations):
    path, _ = f4
    with pytest.raises(ValueError) as e:
        load_file(path, dtype=dtype)
    message = str(e.value)
    assert str(path) in message and "F4" in message and "float4_e2m1fn_x2" in message, message
    assert "tensor 'v'" in message or "tensor 'w'" in message
    assert not allocations
    # without the F4 tensors the same conversion loads
    got = load_file(path, dtype=dtype, names=["x"])
    assert got["x"].dtype == (getattr(torch, dtype) if isinstance(dtype, str) else dtype)


@pytest.mark.parametrize("target", [torch.float4_e2m1fn_x2, "float4_e2m1fn_x2"])
def test_float4_is_no_conversion_target(f4, target, allocations):
    path, _ = f4
    with pytest.raises(ValueError, match="float4_e2m1fn_x2 cannot be a conversion target"):
        load_file(path, dtype=target, names=["x"])
    assert not allocations


# -- F6: known to safetensors, refused by safetensors.torch ---------------------

@pytest.mark.parametrize("name", ["F6_E2M3", "F6_E3M2"])
def test_f6_is_refused_naming_the_dtype(tmp_path, name):
    path = tmp_path / "f6.safetensors"
    path.write_bytes(blob({"a": {"dtype": name, "shape": [4], "data_offsets": [0, 3]}}, b"\0\1\2"))
    with pytest.raises(SafetensorError):
        st.load_file(path)
    with pytest.raises(SafetensorsError) as e:
        load_file(path)
    message = str(e.value)
    assert "tensor 'a'" in message and name in message and "no torch dtype" in message, message
