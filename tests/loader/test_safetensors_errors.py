"""Errors a safetensors user catches catch ours (issue 21, finding 2).

Where safetensors is importable, an invalid file, a ``safe_open`` used after
close and a missing tensor are ``safetensors.SafetensorError`` as well as
what they were (ValueError, KeyError), and pickle; a missing file is a
FileNotFoundError with safetensors' own message.  Without safetensors (a
child where it cannot be imported) they are what they were.  Importing
``instant_staging`` imports neither safetensors nor the loader.
"""

import errno
import json
import pickle

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")
from safetensors import SafetensorError
from safetensors import safe_open as st_safe_open

from instant_staging.loader import SafetensorsError, load_file, safe_open

from support import run_child


@pytest.fixture
def path(tmp_path):
    p = tmp_path / "m.safetensors"
    st.save_file({"a": torch.zeros(2, 2), "b": torch.zeros(2, 3, dtype=torch.uint8)}, p)
    return p


def caught(call, *args, **kwargs):
    """The exception ``call(*args, **kwargs)`` raises (it must raise)."""
    try:
        call(*args, **kwargs)
    except BaseException as e:
        return e
    raise AssertionError("no exception")


def test_invalid_file_is_a_safetensor_error_and_a_value_error(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\0\0\0\0\0\0\0{}")
    for call in (lambda: load_file(bad), lambda: safe_open(bad, "pt")):
        e = caught(call)
        assert isinstance(e, SafetensorError) and isinstance(e, ValueError)
        assert isinstance(e, SafetensorsError) and str(bad) in str(e)
        with pytest.raises(SafetensorError):
            st.load_file(bad)           # safetensors agrees it is invalid
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and str(back) == str(e) and back.path == e.path


def test_use_after_close_like_safetensors(path):
    """test_simple.py::WindowsTestCase::test_get_correctly_dropped, and the
    same for every method of the handle."""
    with st_safe_open(path, framework="pt") as ref:
        pass
    with pytest.raises(SafetensorError, match="File is closed"):
        ref.keys()
    with safe_open(path, framework="pt") as f:
        pass
    for call in (f.keys, f.offset_keys, f.metadata, f.get_tensors, lambda: f.get_tensor("a"),
                 lambda: f.get_slice("a")):
        e = caught(call)
        assert isinstance(e, SafetensorError) and isinstance(e, ValueError), repr(e)
        assert "File is closed" in str(e) and str(path) in str(e)
    with open(path, "w") as g:         # the file is no longer held
        g.write("something")


def test_missing_tensor_is_a_key_error_and_a_safetensor_error(path):
    with st_safe_open(path, framework="pt") as ref, \
            pytest.raises(SafetensorError, match="does not contain tensor"):
        ref.get_tensor("nope")
    with safe_open(path, framework="pt") as f:
        for call in (lambda: f.get_tensor("nope"), lambda: f.get_slice("nope")):
            e = caught(call)
            assert isinstance(e, KeyError) and isinstance(e, SafetensorError), repr(e)
            assert "'nope'" in str(e)
            assert str(pickle.loads(pickle.dumps(e))) == str(e)


def test_file_not_found_carries_safetensors_message(tmp_path, monkeypatch):
    """test_simple.py::ErrorsTestCase::test_file_not_found, for safe_open and
    load_file, relative and absolute."""
    monkeypatch.chdir(tmp_path)
    for name in ("notafile", str(tmp_path / "absent.safetensors")):
        ref = caught(st_safe_open, name, framework="pt")
        assert isinstance(ref, FileNotFoundError)
        for e in (caught(safe_open, name, framework="pt"), caught(load_file, name),
                  caught(load_file, [name])):
            assert type(e) is FileNotFoundError, repr(e)
            assert str(e) == str(ref) == f"No such file or directory: {name}"
            assert e.errno == errno.ENOENT


def test_a_missing_shard_of_an_index_still_names_the_index(tmp_path):
    st.save_file({"a": torch.zeros(1)}, tmp_path / "x.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "x.safetensors", "b": "y.safetensors"}}))
    e = caught(lambda: load_file(tmp_path))
    assert isinstance(e, FileNotFoundError) and "index.json" in str(e) and "y.safetensors" in str(e)


def test_without_safetensors_the_errors_are_what_they_were():
    code = """
        import pickle, sys, tempfile, os
        sys.modules["safetensors"] = None          # import safetensors fails
        import torch
        from instant_staging.loader import SafetensorsError, load_file, safe_open
        from instant_staging.loader._errors import MissingTensorError
        for cls in (SafetensorsError, MissingTensorError):
            assert not [c for c in cls.__mro__ if c.__module__.startswith("safetensors")]
        assert issubclass(SafetensorsError, ValueError) and issubclass(MissingTensorError, KeyError)
        d = tempfile.mkdtemp()
        bad = os.path.join(d, "bad.safetensors")
        open(bad, "wb").write(b"\\x10\\0\\0\\0\\0\\0\\0\\0{}")
        try:
            load_file(bad)
        except SafetensorsError as e:
            assert str(pickle.loads(pickle.dumps(e))) == str(e)
        else:
            raise AssertionError("loaded an invalid file")
        print("ok")
    """
    proc = run_child(code)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_import_instant_staging_imports_neither_safetensors_nor_the_loader():
    proc = run_child("""
        import sys, instant_staging
        print(sorted(m for m in sys.modules if m.startswith("safetensors")
                     or m.startswith("instant_staging.loader") or m == "torch"))
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
