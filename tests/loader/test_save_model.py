"""save_model against huggingface_hub's save_torch_state_dict: the same file
names, the same index byte for byte, the same shards (byte for byte where
the metadata has one key: safetensors orders two or more by its hash map),
tied weights saved once with the same name kept; our loader and
safetensors read the result back."""

import json
import os

import pytest

torch = pytest.importorskip("torch")
hf = pytest.importorskip("huggingface_hub")
safetensors_torch = pytest.importorskip("safetensors.torch")

from instant_staging.loader import load_file, save_model


def state_dict():
    g = torch.Generator().manual_seed(5)
    emb = torch.randn(100, 64, generator=g)
    return {
        "model.embed.weight": emb,
        "layers.0.w": torch.randn(300, 64, generator=g).half(),
        "layers.0.t": torch.randn(50, 50, generator=g).t(),       # not contiguous
        "layers.1.w": torch.randn(2000, 10, generator=g).to(torch.bfloat16),
        "ids": torch.arange(1000),
        "empty": torch.zeros(0),
        "lm_head.weight": emb,                                     # tied
    }


def header(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n)), f.read()


def compare(a, b, one_key):
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b))
    for name in names:
        ours, theirs = ((d / name).read_bytes() for d in (b, a))
        if name.endswith(".json") or one_key:
            assert ours == theirs, name
        else:       # the same header as a JSON object, the same data
            assert header(os.path.join(b, name)) == header(os.path.join(a, name)), name
    return names


@pytest.mark.parametrize("size", ["5GB", 20000, "30KB", "1KB"])
def test_same_files_as_huggingface_hub(tmp_path, size):
    a, b = tmp_path / "hf", tmp_path / "ours"
    a.mkdir()
    hf.save_torch_state_dict(state_dict(), a, max_shard_size=size, metadata={"run": "7"})
    files = save_model(state_dict(), b, max_shard_size=size, metadata={"run": "7"})
    names = compare(a, b, one_key=False)
    assert sorted(files) == sorted(n for n in names if not n.endswith(".json"))
    sd = state_dict()
    got = load_file(str(b))
    assert sorted(got) == sorted(k for k in sd if k != "model.embed.weight")
    assert all(torch.equal(got[k], sd[k]) for k in got)
    if len(files) > 1:
        index = json.loads((b / "model.safetensors.index.json").read_text())
        assert index["metadata"]["model.embed.weight"] == "lm_head.weight"
        for f in files:
            assert safetensors_torch.load_file(b / f).keys() == set(files[f])


def test_shards_byte_identical_and_pattern(tmp_path):
    """Several shards, each with metadata {"format": "pt"} alone: byte for byte."""
    a, b = tmp_path / "hf", tmp_path / "ours"
    a.mkdir()
    sd = {f"w.{i}": torch.full((1000,), float(i)) for i in range(7)}
    hf.save_torch_state_dict(sd, a, max_shard_size="9KB", filename_pattern="weights{suffix}.st")
    save_model(sd, b, max_shard_size="9KB", filename_pattern="weights{suffix}.st")
    names = compare(a, b, one_key=True)
    assert "weights-00001-of-00004.st" in names and "weights.st.index.json" in names


def test_pattern_in_a_subdirectory_as_huggingface_hub(tmp_path):
    """The index goes beside its shards, under its own name (it once went
    to a temporary name under ``.sub/``, a directory nobody made)."""
    a, b = tmp_path / "hf", tmp_path / "ours"
    (a / "sub").mkdir(parents=True)
    (b / "sub").mkdir(parents=True)
    sd = {f"w.{i}": torch.full((1000,), float(i)) for i in range(3)}
    pattern = "sub/model{suffix}.safetensors"
    hf.save_torch_state_dict(sd, a, max_shard_size="5KB", filename_pattern=pattern)
    save_model(sd, b, max_shard_size="5KB", filename_pattern=pattern)
    assert sorted(os.listdir(b / "sub")) == sorted(os.listdir(a / "sub"))
    index = "sub/model.safetensors.index.json"
    assert (b / index).read_bytes() == (a / index).read_bytes()
    assert os.listdir(b) == ["sub"]


def test_discard_and_module(tmp_path):
    lin = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    lin[1].weight = lin[0].weight
    a, b = tmp_path / "hf", tmp_path / "ours"
    a.mkdir()
    hf.save_torch_model(lin, a, shared_tensors_to_discard=["0.weight"], max_shard_size=100)
    save_model(lin, b, shared_tensors_to_discard=["0.weight"], max_shard_size=100)
    compare(a, b, one_key=False)
    assert list(load_file(str(b))) == ["1.weight"]


def test_slices_of_one_storage(tmp_path):
    """A fused weight's rows as three tensors: huggingface_hub refuses them
    (none covers the storage); here each is saved, in the same shard, the
    storage counted once."""
    fused = torch.arange(480, dtype=torch.float32).reshape(30, 16)
    sd = {"q": fused[:10], "k": fused[10:20], "v": fused[20:], "o": torch.ones(400)}
    with pytest.raises(RuntimeError):
        hf.save_torch_state_dict(sd, tmp_path / "hf", max_shard_size=2000)
    files = save_model(sd, tmp_path / "ours", max_shard_size=2000)
    assert list(files.values()) == [["q", "k", "v"], ["o"]]
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 480 * 4 + 400 * 4
    got = load_file(str(tmp_path / "ours"))
    assert all(torch.equal(got[k], sd[k]) for k in sd)


def test_stale_files_removed_after_the_index(tmp_path):
    sd = {f"w.{i}": torch.full((1000,), float(i)) for i in range(4)}
    save_model(sd, tmp_path, max_shard_size="5KB")
    assert len(os.listdir(tmp_path)) == 5
    (tmp_path / "model.safetensors.backup").write_bytes(b"keep")
    (tmp_path / "README.md").write_bytes(b"keep")
    save_model(sd, tmp_path)            # one shard now: the index and the shards go
    assert sorted(os.listdir(tmp_path)) == ["README.md", "model.safetensors",
                                            "model.safetensors.backup"]
    got = load_file(str(tmp_path))
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    save_model(sd, tmp_path, max_shard_size="5KB", is_main_process=False)
    assert "model.safetensors" in os.listdir(tmp_path)      # another rank's: left


def test_a_failed_index_write_leaves_the_old_index_and_no_temporary(tmp_path, monkeypatch):
    from instant_staging.loader import _save_model
    sd = {f"w.{i}": torch.full((1000,), float(i)) for i in range(4)}
    save_model(sd, tmp_path, max_shard_size="5KB")
    index = tmp_path / "model.safetensors.index.json"
    old = index.read_bytes()

    def failing(fd, view, offset):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(_save_model, "_pwrite_all", failing)
    with pytest.raises(OSError, match="No space"):
        save_model({k: v + 1 for k, v in sd.items()}, tmp_path, max_shard_size="5KB")
    assert index.read_bytes() == old
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "out"
    sd = {"a": torch.ones(3)}
    with pytest.raises(ValueError, match="pickles"):
        save_model(sd, out, safe_serialization=False)
    with pytest.raises(ValueError, match="suffix"):
        save_model(sd, out, filename_pattern="model.safetensors")
    with pytest.raises(ValueError, match="unit"):
        save_model(sd, out, max_shard_size="5 GiB")
    with pytest.raises(ValueError, match=r"expected torch\.Tensor"):
        save_model({"a": torch.ones(1), "b": 3}, out)
    base = torch.zeros(10)
    with pytest.raises(RuntimeError, match="none of them covers"):
        save_model({"x": base[:6], "y": base[4:]}, out)
    with pytest.raises(ValueError, match="non contiguous"):
        # the bad tensor in the second shard: the first is not written either
        save_model({"a": torch.ones(400), "t": torch.ones(3, 4).t()}, out,
                   force_contiguous=False, max_shard_size=1620)
    assert not out.exists() or not os.listdir(out)


def test_version_in_every_shard_and_the_index(tmp_path):
    sd = {f"w.{i}": torch.full((1000,), float(i)) for i in range(3)}
    files = save_model(sd, tmp_path, max_shard_size="5KB", version="step-3")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["instant_staging.version"] == "step-3"
    for f in files:
        assert header(tmp_path / f)[0]["__metadata__"]["instant_staging.version"] == "step-3"
