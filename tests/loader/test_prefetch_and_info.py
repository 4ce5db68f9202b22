"""Gaps a mutation run found (issue 40): prefetch's argument check comes
before the device, a tensor taken twice is refused at once, and
``Checkpoint.info(name).file`` names the shard that holds the tensor."""

import json
import os

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from instant_staging.loader import Checkpoint, safe_open


def _file(tmp_path, mib=12):
    # 6 tensors, several chunks: a prefetch is still running after its first
    path = str(tmp_path / "model.safetensors")
    n = mib * (1 << 20) // 4 // 6
    safetensors_torch.save_file({f"t{i}": torch.full((n,), float(i)) for i in range(6)}, path)
    return path


@pytest.mark.parametrize("threads", [0, -1, 1.5, True])
def test_prefetch_refuses_a_bad_thread_count_before_the_device(tmp_path, threads):
    # a device this host cannot have: the thread count is said first
    with safe_open(_file(tmp_path, 1), "pt") as f, \
            pytest.raises(ValueError, match=r"^threads must be an int >= 1"):
        f.prefetch(device="cuda:97", threads=threads)


def test_a_tensor_taken_twice_is_refused_at_once(tmp_path):
    with safe_open(_file(tmp_path), "pt") as f, f.prefetch(threads=1) as loader:
        assert torch.equal(loader.take("t0")[:4], torch.zeros(4))
        with pytest.raises(KeyError, match="'t0' was taken already"):
            loader.take("t0")
        assert not loader._done            # the load was not drained to say so
        with pytest.raises(KeyError, match="'nope' is not in this prefetch"):
            loader.take("nope")
        assert torch.equal(loader.take("t5")[:4], torch.full((4,), 5.0))


def test_info_names_the_shard_that_holds_the_tensor(tmp_path):
    shards = {"model-00001-of-00002.safetensors": {"a": torch.zeros(4), "z": torch.ones(2)},
              "model-00002-of-00002.safetensors": {"b": torch.ones(3), "m": torch.zeros(1)}}
    weight_map = {}
    for fname, tensors in shards.items():
        safetensors_torch.save_file(tensors, str(tmp_path / fname))
        weight_map.update({n: fname for n in tensors})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with Checkpoint.open(str(tmp_path)) as ck:
        for name, fname in weight_map.items():
            assert os.path.basename(ck.info(name).file) == fname, name
