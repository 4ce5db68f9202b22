"""``source`` of load_file/iter_load: a file, a list, a directory, an index.

Every form is checked against what safetensors itself loads from the same
shards (written with ``save_file`` plus an index as transformers writes
it), bit for bit; bad sources fail with a message saying what is wrong,
before anything is allocated.
"""

import json
import os

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

from instant_staging.loader import SafetensorsError, iter_load, load_file

from support import run_child


def tensors(seed, n=4):
    g = torch.Generator().manual_seed(seed)
    out = {f"layer{seed}.{i}.weight": torch.randn(3 + i, 5, generator=g) for i in range(n)}
    out[f"layer{seed}.ids"] = torch.arange(7 * seed, dtype=torch.int64)
    return out


def write_sharded(path, shards=3, index=True, names=None):
    """Shards model-0000k-of-0000n.safetensors and, with ``index``, their
    model.safetensors.index.json; returns {name: tensor} of all."""
    os.makedirs(path, exist_ok=True)
    everything, weight_map = {}, {}
    names = names or [f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)]
    for k, name in enumerate(names):
        part = tensors(k + 1)
        st.save_file(part, os.path.join(path, name))
        everything.update(part)
        weight_map.update(dict.fromkeys(part, name))
    if index:
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    return everything


def reference(paths):
    out = {}
    for p in paths:
        out.update(st.load_file(p))
    return out


def assert_equal(got, expected):
    assert set(got) == set(expected)
    for name, ref in expected.items():
        assert got[name].dtype == ref.dtype and got[name].shape == ref.shape, name
        assert torch.equal(got[name], ref), name


def test_single_file_str_pathlike_bytes(tmp_path):
    expected = tensors(1)
    path = tmp_path / "one.safetensors"
    st.save_file(expected, path)
    for source in (str(path), path, os.fsencode(path), [path]):
        assert_equal(load_file(source), expected)


def test_list_of_shards_in_given_order(tmp_path):
    expected = write_sharded(tmp_path, index=False)
    shards = sorted(tmp_path.glob("*.safetensors"))
    it = iter_load(list(reversed(shards)))
    names = it.names
    it.close()
    # reading order is the list's order: the last shard's tensors first
    assert names[0].startswith("layer3.")
    assert_equal(load_file(shards), expected)
    assert_equal(load_file(tuple(str(s) for s in shards)), expected)


def test_directory_with_index(tmp_path):
    expected = write_sharded(tmp_path)
    # a stray file the index does not list is not loaded
    st.save_file({"stray": torch.zeros(2)}, tmp_path / "zz-extra.safetensors")
    got = load_file(tmp_path)
    assert_equal(got, expected)
    assert_equal(got, reference(sorted(tmp_path.glob("model-*.safetensors"))))
    assert_equal(load_file(str(tmp_path)), expected)


def test_directory_without_index_loads_every_shard_sorted(tmp_path):
    expected = write_sharded(tmp_path, index=False, names=["b.safetensors", "a.safetensors",
                                                          "c.safetensors"])
    (tmp_path / "notes.txt").write_text("not a shard")
    (tmp_path / "sub.safetensors").mkdir()          # a directory named like a shard
    it = iter_load(tmp_path)
    names = it.names
    it.close()
    assert names[0].startswith("layer2.")           # a.safetensors holds the 2nd part
    assert_equal(load_file(tmp_path), expected)


def test_index_path(tmp_path):
    expected = write_sharded(tmp_path / "ckpt")
    index = tmp_path / "ckpt" / "model.safetensors.index.json"
    assert_equal(load_file(index), expected)
    assert_equal(load_file(str(index)), expected)
    # shards named once each although many tensors name them
    it = iter_load(index)
    assert it.total_bytes == sum(t.numel() * t.element_size() for t in expected.values())
    it.close()


def test_index_with_names_and_dtype(tmp_path):
    expected = write_sharded(tmp_path)
    pick = ["layer2.0.weight", "layer3.ids", "layer1.3.weight"]
    got = load_file(tmp_path, names=pick, dtype=torch.float16)
    assert set(got) == set(pick)
    assert got["layer3.ids"].dtype == torch.int64 and torch.equal(got["layer3.ids"], expected["layer3.ids"])
    assert torch.equal(got["layer2.0.weight"], expected["layer2.0.weight"].to(torch.float16))


def test_json_passed_as_shard_says_what_it_is(tmp_path):
    write_sharded(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    renamed = tmp_path / "index-copy.safetensors"
    renamed.write_bytes(index.read_bytes())
    with pytest.raises(SafetensorsError, match=r"JSON file .*index.*not a safetensors file"):
        load_file(renamed)
    with pytest.raises(ValueError, match=r"is a JSON file .*not a shard"):
        load_file([tmp_path / "model-00001-of-00003.safetensors", index])


def test_missing_shard_of_index(tmp_path):
    write_sharded(tmp_path)
    os.remove(tmp_path / "model-00002-of-00003.safetensors")
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00003.safetensors") as e:
        load_file(tmp_path)
    assert "model.safetensors.index.json" in str(e.value)


@pytest.mark.parametrize("kind, make", [
    ("a FIFO", os.mkfifo),
    ("a character device", lambda p: os.symlink("/dev/null", p)),   # (links are allowed)
    ("a directory", os.mkdir),
])
def test_index_naming_what_is_not_a_file_says_what_it_is(tmp_path, kind, make):
    """A shard the index lists that is there but is no regular file is
    named as what it is (not "does not exist"), and a FIFO is never opened
    (that would wait for a writer): in a child, under a timeout."""
    write_sharded(tmp_path)
    shard = tmp_path / "model-00002-of-00003.safetensors"
    os.remove(shard)
    make(str(shard))
    message = _load_error_in_child(tmp_path)
    assert "model.safetensors.index.json" in message and shard.name in message, message
    assert f"is {kind}, not a regular file" in message and "exist" not in message, message


def test_an_index_that_is_a_fifo_is_not_opened(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    os.mkfifo(index)
    message = _load_error_in_child(index)
    assert "is a FIFO, not a regular file" in message, message


def _load_error_in_child(source):
    """The SafetensorsError ``load_file(source)`` raises, read in a child
    under a timeout (a FIFO opened for reading would wait for a writer)."""
    out = run_child(f"""
        from instant_staging.loader import SafetensorsError, load_file
        try:
            load_file({str(source)!r})
        except SafetensorsError as e:
            print(e)
    """, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_index_naming_a_tensor_no_shard_holds(tmp_path):
    write_sharded(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    obj = json.loads(index.read_text())
    obj["weight_map"]["ghost.weight"] = "model-00001-of-00003.safetensors"
    obj["weight_map"]["layer1.ids"] = "model-00002-of-00003.safetensors"   # wrong shard
    index.write_text(json.dumps(obj))
    with pytest.raises(SafetensorsError, match=r"2 tensor.*'ghost.weight'.*in no shard") as e:
        load_file(tmp_path)
    assert "'layer1.ids' (listed in model-00002-of-00003.safetensors, found in model-00001" in str(e.value)


@pytest.mark.parametrize("content, match", [
    ("not json", "not valid JSON"),
    ("[1, 2]", "weight_map"),
    ('{"metadata": {}}', "weight_map"),
    ('{"weight_map": {}}', "weight_map"),
    ('{"weight_map": {"a": 3}}', "weight_map"),
])
def test_bad_index(tmp_path, content, match):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(content)
    with pytest.raises(SafetensorsError, match=match):
        load_file(index)
    with pytest.raises(SafetensorsError, match=match):
        load_file(tmp_path)


def test_empty_directory_and_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no model.safetensors.index.json and no"):
        load_file(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_file(tmp_path / "absent.safetensors")
    with pytest.raises(FileNotFoundError, match="no such index file"):
        load_file(tmp_path / "absent.safetensors.index.json")


def test_bad_source_types(tmp_path):
    with pytest.raises(ValueError, match="empty list"):
        load_file([])
    with pytest.raises(TypeError, match="not int"):
        load_file(3)
    with pytest.raises(TypeError, match="got int in the list"):
        load_file([str(tmp_path / "a.safetensors"), 3])
    with pytest.raises(TypeError, match="not a dict"):
        load_file({"a": "b"})
    write_sharded(tmp_path / "d", index=False)
    with pytest.raises(ValueError, match="is a directory"):
        load_file([tmp_path / "d"])


def test_duplicate_name_across_listed_shards(tmp_path):
    st.save_file({"a": torch.zeros(2)}, tmp_path / "x.safetensors")
    st.save_file({"a": torch.ones(2)}, tmp_path / "y.safetensors")
    with pytest.raises(SafetensorsError, match="two shards"):
        load_file(tmp_path)
