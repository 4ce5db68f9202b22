"""An index names files inside its checkpoint only, and a malformed index is
a SafetensorsError naming it (issue 21, findings 11 and 12).

A ``weight_map`` entry that is absolute, has a ``..`` component or a NUL is
refused before any file is looked at (``os.open`` and ``os.stat`` are
watched), by ``load_file``, the CLI's ``load`` and ``from_pretrained``
alike; symbolic links stay allowed (the hub cache's layout is loaded and
compared with safetensors).  No error echoes bytes of a file that is not a
safetensors file.
"""

import json
import os
import struct

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

from instant_staging.loader import SafetensorsError, load_file

from support.cli import cli

SECRET = b"password=hunter2 and more secret text, long enough to be read"


@pytest.fixture
def outside(tmp_path):
    """``model/`` with one good shard and an index; beside it a valid
    safetensors file and a secret text file that the model must never read."""
    model = tmp_path / "model"
    model.mkdir()
    st.save_file({"a": torch.arange(4.0)}, model / "x.safetensors")
    st.save_file({"b": torch.arange(4.0) + 10}, tmp_path / "outside.safetensors")
    (tmp_path / "secret.txt").write_bytes(SECRET)
    return model


def write_index(model, entry):
    with open(model / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": {"a": "x.safetensors", "b": entry}}, f)
    return model / "model.safetensors.index.json"


def escaping(tmp_path):
    return ["../outside.safetensors", str(tmp_path / "outside.safetensors"),
            "sub/../../outside.safetensors", "..", "../secret.txt",
            "x.safetensors\0../../outside.safetensors", "./../outside.safetensors"]


@pytest.fixture
def touched(monkeypatch):
    """Paths passed to os.open and os.stat while a test runs."""
    seen = []
    real_open, real_stat = os.open, os.stat

    def watch_open(path, *a, **k):
        seen.append(os.fsdecode(path))
        return real_open(path, *a, **k)

    def watch_stat(path, *a, **k):
        if not isinstance(path, int):
            seen.append(os.fsdecode(path))
        return real_stat(path, *a, **k)

    monkeypatch.setattr(os, "open", watch_open)
    monkeypatch.setattr(os, "stat", watch_stat)
    return seen


@pytest.mark.parametrize("k", range(7))
def test_an_index_naming_a_file_outside_is_refused_before_any_file_is_touched(tmp_path, outside, k,
                                                                             touched):
    entry = escaping(tmp_path)[k]
    index = write_index(outside, entry)
    for source in (outside, index):
        del touched[:]
        with pytest.raises(SafetensorsError) as e:
            load_file(source)
        message = str(e.value)
        assert str(index) in message and "tensor 'b'" in message, message
        assert repr(entry) in message, message
        assert not [p for p in touched if "outside" in p or "secret" in p], touched
        assert not [p for p in touched if p.endswith("x.safetensors")], "a shard was opened"


def test_the_cli_refuses_it_in_one_line(tmp_path, outside):
    write_index(outside, "../outside.safetensors")
    proc = cli("load", str(outside))
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert "'..' component" in proc.stderr and "../outside.safetensors" in proc.stderr, proc.stderr


def test_from_pretrained_refuses_it(tmp_path, outside):
    pytest.importorskip("transformers")
    from instant_staging.integrations.transformers import from_pretrained
    write_index(outside, str(tmp_path / "outside.safetensors"))
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 1,
              "n_embd": 8, "n_head": 2, "vocab_size": 16, "n_positions": 8}
    (outside / "config.json").write_text(json.dumps(config))
    with pytest.raises(SafetensorsError, match="absolute path"):
        from_pretrained(outside, device="cpu")


@pytest.mark.parametrize("entry", ["sub/y.safetensors", "./y.safetensors", "..y.safetensors",
                                   "y..safetensors"])
def test_relative_names_inside_are_allowed(outside, entry):
    target = outside / entry
    target.parent.mkdir(exist_ok=True)
    st.save_file({"b": torch.arange(3, dtype=torch.int16)}, target)
    got = load_file(write_index(outside, entry))
    assert torch.equal(got["b"], torch.arange(3, dtype=torch.int16))


def test_hub_cache_symlinks_to_blobs_still_load(tmp_path):
    """snapshots/<rev>/shard -> ../../blobs/<sha>, as huggingface_hub lays out
    its cache: the names are plain; where the links resolve is not checked."""
    repo = tmp_path / "models--org--m"
    blobs, snap = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    expected, weight_map = {}, {}
    g = torch.Generator().manual_seed(3)
    for k in range(2):
        part = {f"l{k}.w": torch.randn(8, 5 + k, generator=g)}
        name = f"model-{k + 1:05d}-of-00002.safetensors"
        st.save_file(part, blobs / f"sha{k}")
        os.symlink(f"../../blobs/sha{k}", snap / name)
        expected.update(st.load_file(snap / name))
        weight_map.update(dict.fromkeys(part, name))
    (blobs / "shaindex").write_text(json.dumps({"weight_map": weight_map}))
    os.symlink("../../blobs/shaindex", snap / "model.safetensors.index.json")
    got = load_file(snap)
    assert set(got) == set(expected)
    for name in expected:
        assert got[name].dtype == expected[name].dtype and torch.equal(got[name], expected[name])


# -- no error echoes the bytes of a file that is not a safetensors file --------

@pytest.mark.parametrize("content", [
    SECRET,                                               # text: a huge "length"
    struct.pack("<Q", 99_999_999) + b"secret",            # a small one, beyond the file
    struct.pack("<Q", 12_345) + SECRET,
])
def test_errors_do_not_echo_a_non_safetensors_file(tmp_path, content):
    path = tmp_path / "m.safetensors"
    path.write_bytes(content)
    with pytest.raises(SafetensorsError) as e:
        load_file(path)
    from safetensors import SafetensorError
    with pytest.raises(SafetensorError):
        st.load_file(path)                 # safetensors refuses it too
    message = str(e.value)
    (length,) = struct.unpack("<Q", content[:8])
    assert str(length) not in message and f"{length:,}" not in message, message
    assert "hunter2" not in message and "secret" not in message, message


def test_a_number_beyond_the_double_range_is_not_echoed(tmp_path):
    header = b'{"a":{"dtype":"F32","shape":[1e999123],"data_offsets":[0,4]}}'
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    with pytest.raises(SafetensorsError, match="beyond the double range") as e:
        load_file(path)
    assert "999123" not in str(e.value)


# -- a malformed index is a SafetensorsError naming it -------------------------

@pytest.mark.parametrize("depth", [2_000, 100_000])
def test_a_deeply_nested_index_is_a_safetensors_error(tmp_path, depth):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"a": ' + "[" * depth + "]" * depth + "}}")
    for source in (index, tmp_path):
        with pytest.raises(SafetensorsError, match="nests deeper") as e:
            load_file(source)
        assert str(index) in str(e.value)


@pytest.mark.parametrize("content, match", [
    (b"\xff\xfe\xfd", "not UTF-8"),
    (b'{"weight_map": {"a": "x.safetensors"}', "not valid JSON"),
    (b'{"weight_map": {"a": "x.safetensors", "b": 1e999}}', "weight_map"),
    (b'{"weight_map": {"a": ""}}', "weight_map"),
    (b'{"weight_map": ["x.safetensors"]}', "weight_map"),
    (b'"x.safetensors"', "weight_map"),
    (b'{"weight_map": {"a": "' + b"9" * 5000 + b'"}, "n": ' + b"9" * 5000 + b"}", "not valid JSON"),
])
def test_every_malformed_index_is_a_safetensors_error_naming_it(tmp_path, content, match):
    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(content)
    with pytest.raises(SafetensorsError, match=match) as e:
        load_file(index)
    assert str(index) in str(e.value)
    assert "\\xff" not in str(e.value)     # the bytes themselves are not echoed
