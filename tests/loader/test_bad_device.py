"""Every bad ``device`` is an error naming it, before anything is allocated
(issue 21, finding 4): a ValueError for a value torch cannot parse or that
names a device the loader cannot load to, a TypeError for another type, the
same from load_file, iter_load, safe_open, load and from_pretrained."""

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

from instant_staging.loader import _staging_pool, iter_load, load, load_file, safe_open

BAD_VALUES = ["", "mps", "meta", "cuda:x", "cpu:0:1", "CPU", " cpu", "cuda:-1", "xla",
              "cuda:99999999999999999999", -1, 2 ** 70, torch.device("meta")]
BAD_TYPES = [True, False, 1.5, None, b"cpu", ["cpu"]]
NO_GPU = [] if torch.cuda.is_available() else ["cuda", "cuda:0", 0, torch.device("cuda", 1)]


@pytest.fixture
def path(tmp_path):
    p = tmp_path / "m.safetensors"
    st.save_file({"a": torch.arange(8.0), "b": torch.ones(2, 3, dtype=torch.int64)}, p)
    return p


def entry_points(path):
    data = path.read_bytes()
    return {
        "load_file": lambda d: load_file(path, d),
        "iter_load": lambda d: iter_load(path, d),
        "load_file_kw": lambda d: load_file(path, device=d, dtype=torch.float16),
        "safe_open": lambda d: safe_open(path, framework="pt", device=d),
        "load": lambda d: load(data, d),
    }


@pytest.fixture
def allocations(monkeypatch):
    """torch tensors made and staging buffers taken while the test runs."""
    made = []
    real_empty, real_take = torch.empty, _staging_pool.take
    monkeypatch.setattr(torch, "empty", lambda *a, **k: made.append(a) or real_empty(*a, **k))
    monkeypatch.setattr(_staging_pool, "take",
                        lambda *a, **k: made.append(("staging", a)) or real_take(*a, **k))
    return made


def named(device, message):
    return repr(device) in message or str(device) in message


@pytest.mark.parametrize("entry", ["load_file", "iter_load", "load_file_kw", "safe_open", "load"])
@pytest.mark.parametrize("device", BAD_VALUES + NO_GPU, ids=repr)
def test_a_bad_device_value_is_a_value_error_naming_it(path, entry, device, allocations):
    call = entry_points(path)[entry]
    with pytest.raises(ValueError) as e:
        call(device)
    assert named(device, str(e.value)), str(e.value)
    assert not allocations


@pytest.mark.parametrize("entry", ["load_file", "iter_load", "safe_open", "load"])
@pytest.mark.parametrize("device", BAD_TYPES, ids=repr)
def test_a_device_of_another_type_is_a_type_error_naming_it(path, entry, device, allocations):
    call = entry_points(path)[entry]
    with pytest.raises(TypeError) as e:
        call(device)
    message = str(e.value)
    assert type(device).__name__ in message and repr(device) in message, message
    assert not allocations


@pytest.mark.parametrize("device", ["cpu", "cpu:0", torch.device("cpu")], ids=repr)
def test_good_cpu_devices(path, device):
    expected = st.load_file(path)
    for call in entry_points(path).values():
        got = call(device)
        if isinstance(got, safe_open):
            with got:
                got = {k: got.get_tensor(k) for k in got.keys()}  # noqa: SIM118 - safe_open is no dict
        got = dict(got)
        if "a" in got and got["a"].dtype == torch.float16:
            continue
        assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_from_pretrained_names_the_device(tmp_path):
    pytest.importorskip("transformers")
    from instant_staging.integrations.transformers import from_pretrained
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="device '' is not a device"):
        from_pretrained(tmp_path, device="")


@pytest.mark.parametrize("device", ["", "mps", -1])
def test_the_device_is_checked_before_the_source(tmp_path, device, touched_files):
    """A bad device is named even when the source is bad too, and no file is
    opened for it."""
    missing = tmp_path / "absent.safetensors"
    for call in (lambda: load_file(missing, device), lambda: iter_load(missing, device),
                 lambda: safe_open(missing, "pt", device), lambda: load(b"", device)):
        with pytest.raises(ValueError) as e:
            call()
        assert named(device, str(e.value)), str(e.value)
    assert not touched_files


@pytest.fixture
def touched_files(monkeypatch):
    import os
    seen = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **k: seen.append(p) or real_open(p, *a, **k))
    return seen
