"""``backend=`` as safetensors 0.8's ``safe_open`` and ``load_file`` take it:
"mmap" and "pread" load the same tensors (ours reads with pread into the
staging slots either way); anything else is refused before a file is opened."""

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")
from safetensors import safe_open as st_safe_open

from instant_staging.loader import iter_load, load_file, safe_open


@pytest.fixture
def path(tmp_path):
    p = tmp_path / "m.safetensors"
    st.save_file({"a": torch.randn(3, 4), "b": torch.arange(5)}, p)
    return p


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_both_backends_load_what_safetensors_loads(path, backend):
    ref = st.load_file(path, backend=backend)
    for got in (load_file(path, backend=backend), dict(iter_load(path, backend=backend))):
        assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    with safe_open(path, "pt", backend=backend) as f, st_safe_open(path, "pt", backend=backend) as g:
        assert f.keys() == g.keys()
        assert torch.equal(f.get_slice("a")[:, 1:3], g.get_slice("a")[:, 1:3])


@pytest.mark.parametrize("backend, exc", [("not_a_backend", ValueError), ("", ValueError),
                                          ("MMAP", ValueError), (None, TypeError), (1, TypeError)])
def test_other_backends_are_refused_before_opening(tmp_path, backend, exc):
    missing = tmp_path / "absent.safetensors"          # never reached
    for call in (lambda: load_file(missing, backend=backend),
                 lambda: iter_load(missing, backend=backend),
                 lambda: safe_open(missing, "pt", backend=backend)):
        with pytest.raises(exc, match="backend"):
            call()
