"""save_file, save and deltas from device tensors on a real GPU: the staged
path (device to the pinned staging buffer, then pwrite) gives safetensors'
own bytes for the same tensors on the host, and a delta saved from device
tensors applies in place on the device, keeping each destination's storage."""

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

from instant_staging.loader import TORCH_DTYPES, apply_delta, load_file, save, save_delta, save_file


def _every_dtype(device):
    g = torch.Generator().manual_seed(7)
    out = {}
    for i, attr in enumerate(TORCH_DTYPES.values()):
        dtype = getattr(torch, attr, None)
        if dtype is None:
            continue
        size = torch.empty((), dtype=dtype).element_size()
        # Sizes around a staging slot's edges: tiny, odd, and several MiB.
        for k, numel in enumerate((1, 1027, (3 << 20) // size + 5)):
            raw = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=g)
            if dtype is torch.bool:
                raw = raw % 2
            out[f"t{i}.{k}"] = raw.view(dtype).to(device)
    out["empty"] = torch.empty((0, 4), dtype=torch.float16, device=device)
    out["scalar"] = torch.tensor(3.5, dtype=torch.float32, device=device)
    return out


def _bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.gpu
def test_gpu_save_file_is_safetensors_bytes(tmp_path, gpu):
    tensors = _every_dtype("cuda:0")
    host = {k: v.cpu() for k, v in tensors.items()}
    save_file(tensors, tmp_path / "ours.safetensors", metadata={"format": "pt"})
    st.save_file(host, tmp_path / "theirs.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()
    assert save(tensors, metadata={"format": "pt"}) == st.save(host, metadata={"format": "pt"})
    back = load_file(tmp_path / "ours.safetensors", "cuda:0")
    assert all(torch.equal(_bytes(back[k].cpu()), _bytes(host[k])) for k in host)


@pytest.mark.gpu
def test_gpu_delta_applies_in_place(tmp_path, gpu):
    base = {f"model.layers.{i}.w": torch.randn(512, 256, device="cuda:0") for i in range(4)}
    new = {k: v.clone() for k, v in base.items()}
    new["model.layers.1.w"].view(-1)[::97] += 1.0       # sparse: about 1% changed
    new["model.layers.3.w"] += 1.0                      # whole
    path = tmp_path / "delta.safetensors"
    save_delta(new, base, path, base_version="v1", version="v2")
    model = {k: v.clone() for k, v in base.items()}
    ptrs = {k: v.data_ptr() for k, v in model.items()}
    apply_delta(model, path, version="v1")
    for k in model:
        assert torch.equal(model[k], new[k]), k
        assert model[k].data_ptr() == ptrs[k], k
    before = {k: v.clone() for k, v in model.items()}
    with pytest.raises(ValueError):
        apply_delta(model, path, version="v2")           # the delta is for v1
    assert all(torch.equal(model[k], before[k]) for k in model)
