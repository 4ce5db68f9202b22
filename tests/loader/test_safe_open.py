"""``safe_open`` against ``safetensors.safe_open(..., framework="pt")``.

Same keys (sorted), offset_keys, metadata (None without one), tensors and
slices for many index forms: equal values, shape, dtype, and the same
strides where a dimension has more than one element (a CPU slice is a view,
as safetensors' view of its mmap).  Errors for bad indices are torch's own,
raised before anything is read.  Only the rows a slice needs are read.
"""

import contextlib
import os
import warnings

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")
from safetensors import safe_open as st_safe_open

from instant_staging.loader import _safe_open, safe_open

INDICES = [
    0, 1, -1, -4, 3,
    slice(None), slice(1, 3), slice(-2, None), slice(None, None, 2), slice(1, None, 3),
    slice(3, 1), slice(0, 100), slice(-100, 2), slice(2, 2),
    (), (0,), (0, 1), (-1, -1, -1), (slice(1, 3), 2), (slice(1, 3), slice(None), slice(2, 5)),
    (slice(None), slice(None), 2), (slice(None), 1), (slice(None), slice(1, 4, 2)),
    (0, slice(1, 4, 2)), (2, slice(None, None, 2), slice(-3, None)),
    (Ellipsis, 1), (1, Ellipsis), (Ellipsis,), (slice(1, 3), Ellipsis, 0), (Ellipsis, slice(0, 2)),
    None, (None, 0), (None, slice(1, 3)), (0, None, 1), (slice(None), None),
    [0, 2], [3], torch.tensor([0, 3]), torch.tensor([[1], [2]]), True,
]
BAD_INDICES = [4, -5, slice(None, None, -1), slice(1, 3, 0), (0, 0, 0, 0), 1.0, "a",
               (slice(None), 5)]


def nontrivial_strides(t):
    return [s for s, n in zip(t.stride(), t.shape) if n > 1]


def assert_same(got, ref):
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert got.device == ref.device
    assert nontrivial_strides(got) == nontrivial_strides(ref)
    # bit for bit (NaN-safe): compare the bytes of contiguous copies
    def as_bytes(t):
        return t.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)
    assert torch.equal(as_bytes(got), as_bytes(ref))


@pytest.fixture
def checkpoint(tmp_path):
    g = torch.Generator().manual_seed(3)
    tensors = {
        "w3": torch.randn(4, 5, 6, generator=g),
        "w2": torch.randn(7, 9, generator=g).to(torch.bfloat16),
        "v": torch.arange(11, dtype=torch.int32),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
        "empty_inner": torch.zeros(3, 0, 2, dtype=torch.float16),
        "mask": torch.rand(5, 3, generator=g) > 0.5,
        "a_first": torch.ones(2, dtype=torch.uint8),
    }
    path = tmp_path / "m.safetensors"
    st.save_file(tensors, path, metadata={"format": "pt", "step": "7"})
    return path, tensors


def test_keys_metadata_tensors(checkpoint):
    path, tensors = checkpoint
    with safe_open(path, framework="pt") as f, st_safe_open(str(path), framework="pt") as g:
        assert f.keys() == g.keys() == sorted(tensors)
        assert f.offset_keys() == g.offset_keys()
        assert f.metadata() == g.metadata() == {"format": "pt", "step": "7"}
        names = f.keys()   # safe_open is not iterable (as safetensors')
        for name in names:
            assert_same(f.get_tensor(name), g.get_tensor(name))
            s, t = f.get_slice(name), g.get_slice(name)
            assert s.get_shape() == t.get_shape() and s.get_dtype() == t.get_dtype()
        got, ref = f.get_tensors(), g.get_tensors()
        assert list(got) == list(ref)
        for name in ref:
            assert_same(got[name], ref[name])


@pytest.mark.parametrize("metadata", [None, {}])
def test_metadata_absent_or_empty(tmp_path, metadata):
    path = tmp_path / "m.safetensors"
    st.save_file({"a": torch.zeros(2)}, path, metadata=metadata)
    with safe_open(path, "pt") as f, st_safe_open(str(path), "pt") as g:
        assert f.metadata() == g.metadata()
        assert (f.metadata() is None) == (g.metadata() is None)


@pytest.mark.parametrize("name", ["w3", "w2", "mask"])
@pytest.mark.parametrize("index", INDICES, ids=repr)
def test_slice_like_safetensors(checkpoint, name, index):
    path, _ = checkpoint
    with safe_open(path, framework="pt") as f, st_safe_open(str(path), framework="pt") as g:
        s, t = f.get_slice(name), g.get_slice(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")      # torch's deprecation of list indices
            try:
                ref = t[index]
            except Exception as e:  # e.g. too many indices for a 2-D tensor
                with pytest.raises(type(e)):
                    s[index]
                return
            got = s[index]
        assert_same(got, ref)


@pytest.mark.parametrize("index", BAD_INDICES, ids=repr)
def test_bad_index_is_torchs_error_before_reading(checkpoint, index, monkeypatch):
    path, _ = checkpoint
    reads = []
    monkeypatch.setattr(_safe_open, "LoadIterator",
                        lambda *a, **k: reads.append(a) or contextlib.nullcontext(iter(())))
    with st_safe_open(str(path), framework="pt") as g, pytest.raises(Exception) as ref:
        g.get_slice("w3")[index]
    with safe_open(path, framework="pt") as f, pytest.raises(type(ref.value)) as got:
        f.get_slice("w3")[index]
    assert str(got.value) == str(ref.value)
    assert reads == []


def test_tensor_index_out_of_bounds_like_safetensors(checkpoint):
    # values of a tensor index are only known to torch when it indexes: the
    # rows are read, the error is torch's, and nothing of the read survives it
    path, _ = checkpoint
    index = torch.tensor([0, 7])
    with st_safe_open(str(path), framework="pt") as g, pytest.raises(IndexError) as ref:
        g.get_slice("w3")[index]
    with safe_open(path, framework="pt") as f, pytest.raises(IndexError) as got:
        f.get_slice("w3")[index]
    assert str(got.value) == str(ref.value)


@pytest.mark.parametrize("name, index", [
    ("scalar", ()), ("scalar", Ellipsis), ("scalar", None), ("empty", slice(None)),
    ("empty", (slice(None), 1)), ("empty_inner", 1), ("empty_inner", (slice(0, 2), slice(None))),
    ("v", slice(2, 9, 3)), ("v", -1),
])
def test_slice_edge_tensors(checkpoint, name, index):
    path, _ = checkpoint
    with safe_open(path, "pt") as f, st_safe_open(str(path), "pt") as g:
        assert_same(f.get_slice(name)[index], g.get_slice(name)[index])
    with safe_open(path, "pt") as f:
        for bad in (0, slice(None)):
            if name == "scalar":
                with pytest.raises(IndexError):
                    f.get_slice(name)[bad]


def reads_of(monkeypatch):
    """The byte ranges each safe_open read asks for: of the pipeline, or read
    in the caller's thread (one small tensor to the CPU: ``_read_here``)."""
    seen = []
    real, here = _safe_open.LoadIterator, _safe_open._File._read_here

    def spy(prepared):
        seen.append([(e.begin, e.end) for _, e in prepared.shards.entries])
        return real(prepared)

    def spy_here(self, entry, dtype):
        got = here(self, entry, dtype)
        if got is not None:
            seen.append([(entry.begin, entry.end)])
        return got
    monkeypatch.setattr(_safe_open, "LoadIterator", spy)
    monkeypatch.setattr(_safe_open._File, "_read_here", spy_here)
    return seen


def test_reads_only_the_rows_asked(checkpoint, monkeypatch):
    path, _tensors = checkpoint
    seen = reads_of(monkeypatch)
    with safe_open(path, "pt") as f:
        entry = f._entries["w3"]
        row = 5 * 6 * 4
        f.get_slice("w3")[1:3]
        f.get_slice("w3")[2]
        f.get_slice("w3")[-1, 2:4]
        f.get_slice("w3")[0:4:2, 1]                    # rows 0..2, narrowed on the device
        f.get_slice("w3")[:, 1:3]                      # a later dimension: every row it covers
        f.get_slice("w3")[3:1]                         # nothing
        f.get_tensor("v")
    b = entry.begin
    assert seen == [[(b + row, b + 3 * row)], [(b + 2 * row, b + 3 * row)],
                    [(b + 3 * row, b + 4 * row)], [(b, b + 3 * row)], [(b, b + 4 * row)],
                    [(b, b)], [(f._entries["v"].begin, f._entries["v"].end)]]


def test_a_small_tensor_read_in_the_callers_thread_fails_as_the_pipeline_words_it(
        tmp_path, monkeypatch):
    # get_tensor of one small tensor to the CPU reads it in the caller's
    # thread (no pipeline); a file that shrank since it was opened, or a
    # fault rule set, goes through the pipeline, which words the error as
    # for every load (a file changed since it was opened: refused before it
    # is read, issue 53), and nothing else changes.
    from instant_staging.loader import LoadError
    path = str(tmp_path / "m.safetensors")
    st.save_file({"a": torch.arange(100, dtype=torch.float32), "b": torch.ones(50)}, path)
    pipelines = []
    real = _safe_open.LoadIterator
    monkeypatch.setattr(_safe_open, "LoadIterator",
                        lambda *a, **k: pipelines.append(1) or real(*a, **k))
    with safe_open(path, "pt") as f:
        assert torch.equal(f.get_tensor("a"), torch.arange(100, dtype=torch.float32))
        assert pipelines == []                      # read here, in this thread
        os.truncate(path, os.path.getsize(path) - 100)
        with pytest.raises(LoadError, match=r"written to since the checkpoint was opened"):
            f.get_tensor("b")
    st.save_file({"a": torch.arange(100, dtype=torch.float32)}, path)
    monkeypatch.setenv("INSTANT_STAGING_FAULTS", "read=EIO")
    with safe_open(path, "pt") as f, pytest.raises(LoadError, match=r"EIO|Input/output"):
        f.get_tensor("a")


def test_slice_of_dim1_is_a_view_on_cpu_like_safetensors(checkpoint):
    path, tensors = checkpoint
    with safe_open(path, "pt") as f:
        half = f.get_slice("w2")[:, :4]
    assert not half.is_contiguous() and torch.equal(half, tensors["w2"][:, :4])


def test_errors(checkpoint, tmp_path):
    path, _ = checkpoint
    with pytest.raises(ValueError, match="framework 'np' is not supported"):
        safe_open(path, framework="np")
    with pytest.raises(TypeError, match="framework must be a string"):
        safe_open(path, framework=None)
    with pytest.raises(ValueError, match="device"):
        safe_open(path, framework="pt", device="mps")
    with pytest.raises(FileNotFoundError):
        safe_open(tmp_path / "absent.safetensors", framework="pt")
    for fw in ("pt", "torch", "pytorch", "PT"):
        safe_open(path, framework=fw).close()
    f = safe_open(path, framework="pt")
    with pytest.raises(KeyError, match="does not contain tensor 'nope'"):
        f.get_tensor("nope")
    with pytest.raises(KeyError, match="'nope'"):
        f.get_slice("nope")
    s = f.get_slice("w3")
    f.close()
    f.close()
    for call in (f.keys, f.metadata, lambda: f.get_tensor("w3"), lambda: f.get_slice("w3")):
        with pytest.raises(ValueError, match="closed"):
            call()
    s[0]          # a slice outlives its handle (tests/loader/test_slice_lifetime.py)


def test_file_closed_after_with(checkpoint):
    import gc
    import os
    path, _ = checkpoint
    gc.collect()        # an earlier test's garbage holding a file (a slice) closes now, not below
    before = set(os.listdir("/proc/self/fd"))
    with safe_open(path, "pt") as f:
        f.get_tensor("w3")
        assert len(set(os.listdir("/proc/self/fd")) - before) == 1
    assert set(os.listdir("/proc/self/fd")) - before == set()


@pytest.mark.gpu
def test_gpu_tensor_parallel_halves_like_safetensors(checkpoint, gpu):
    """A TP=2 rank's share of every 2-D matrix, on dim 0 and dim 1."""
    path, _ = checkpoint
    with safe_open(path, "pt", device="cuda:0") as f, st_safe_open(str(path), "pt", device="cuda:0") as g:
        names = f.keys()   # safe_open is not iterable (as safetensors')
        for name in names:
            for index in INDICES[:30]:
                try:
                    ref = g.get_slice(name)[index]
                except (IndexError, ValueError):     # not an index of this tensor
                    continue
                assert_same(f.get_slice(name)[index], ref)
            shape = f.get_slice(name).get_shape()
            if len(shape) == 2:
                for rank in (0, 1):
                    h0, h1 = shape[0] // 2, shape[1] // 2
                    for index in ((slice(rank * h0, (rank + 1) * h0),),
                                  (slice(None), slice(rank * h1, (rank + 1) * h1))):
                        assert_same(f.get_slice(name)[index], g.get_slice(name)[index])
