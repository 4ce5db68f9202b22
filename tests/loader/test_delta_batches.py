"""A delta's sparse patches are checked, kept and scattered in batches
(``DELTA_PATCH_BATCH`` positions): one view over the span of a batch's
destinations takes every write, so these tests carve the destinations out
of one buffer with bytes between them that no write may touch."""

import pytest

torch = pytest.importorskip("torch")
import safetensors
import safetensors.torch as st

import instant_staging.loader._delta as delta_module
from instant_staging.loader import (
    DeltaError,
    UpdateFailed,
    VersionedWeights,
    apply_delta,
    apply_update,
    save_delta,
)

GAP = 7         # elements between two destinations: odd, so no alignment is assumed


def carved(shapes, dtype, fill, device="cpu"):
    """``({name: view of one buffer}, buffer)``: each destination a view,
    ``GAP`` elements of ``fill`` before, between and after them."""
    sizes = {n: torch.Size(s).numel() for n, s in shapes.items()}
    buffer = torch.full((sum(sizes.values()) + GAP * (len(sizes) + 1),), fill, dtype=dtype,
                        device=device)
    out, at = {}, GAP
    for name, shape in shapes.items():
        out[name] = buffer[at:at + sizes[name]].view(shape)
        at += sizes[name] + GAP
    return out, buffer


def gaps(dests, buffer):
    """The buffer's elements no destination holds, as raw bytes."""
    keep = torch.ones(buffer.numel(), dtype=torch.bool, device=buffer.device)
    base = buffer.data_ptr()
    for t in dests.values():
        start = (t.data_ptr() - base) // buffer.element_size()
        keep[start:start + t.numel()] = False
    return buffer[keep].view(torch.uint8).clone()


def raw(t):
    return t.contiguous().reshape(-1).view(torch.uint8).cpu()


SHAPES = {f"expert.{i}.w": (6, 5) for i in range(9)} | {"norm": (30,), "head": (4, 30)}


def steps(dtype=torch.bfloat16, shapes=SHAPES):
    """(base, new): every tensor sparse in the delta, two positions of each
    changed ("head": ten, so that it can be a batch of its own); the even
    names change at their high positions and the odd ones at their low
    positions, so that a batch's positions fall back at the joins."""
    g = torch.Generator().manual_seed(3)
    base = {n: torch.randn(s, generator=g).to(dtype) for n, s in shapes.items()}
    new = {n: t.clone() for n, t in base.items()}
    for i, (name, t) in enumerate(new.items()):
        flat = t.view(-1)
        where = [flat.numel() - 1, flat.numel() - 4] if i % 2 == 0 else [0, 2]
        if name == "head":
            where = list(range(flat.numel() - 10, flat.numel()))
        flat[where] = torch.arange(len(where)).to(dtype) + 7
    return base, new


def cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return "cuda:0"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
# 1: every patch a batch of its own; 48: the patches of two positions in one
# batch, "head"'s ten alone (ten >= 48 / 16); 2**24: all in one batch
@pytest.mark.parametrize("batch", [1, 48, 1 << 24])
def test_patches_in_batches_write_only_their_positions(tmp_path, monkeypatch, batch, device):
    monkeypatch.setattr(delta_module, "DELTA_PATCH_BATCH", batch)
    device = cuda() if device == "cuda" else device
    base, new = steps()
    path = tmp_path / "d.safetensors"
    info = save_delta(new, base, path, base_version="v1", version="v2")
    assert set(info.sparse) == set(SHAPES) and not info.full
    dests, buffer = carved(SHAPES, torch.bfloat16, -1.0, device)
    for n, t in dests.items():
        t.copy_(base[n])
    around = gaps(dests, buffer)
    ptrs = {n: t.data_ptr() for n, t in dests.items()}
    versions = {n: t._version for n, t in dests.items()}
    apply_delta(dests, path, version="v1")
    assert all(torch.equal(raw(dests[n]), raw(new[n])) for n in new)
    assert torch.equal(gaps(dests, buffer), around)        # nothing between them written
    assert {n: t.data_ptr() for n, t in dests.items()} == ptrs
    assert all(t._version > versions[n] for n, t in dests.items())
    if device != "cpu":         # separate allocations too, on the device
        dests = {n: t.to(device) for n, t in base.items()}
        apply_delta(dests, path, version="v1")
        assert all(torch.equal(raw(dests[n]), raw(new[n])) for n in new)


def tampered(tmp_path, name, positions):
    """A delta of ``steps()`` whose ``name``'s positions are ``positions``."""
    base, new = steps()
    good = tmp_path / "good.safetensors"
    save_delta(new, base, good, base_version="v1", version="v2")
    with safetensors.safe_open(good, "pt") as f:
        metadata = f.metadata()
    tensors = st.load_file(good)
    tensors[name + ".idx"] = torch.tensor(positions, dtype=torch.int32)
    bad = tmp_path / "bad.safetensors"
    st.save_file(tensors, bad, metadata)
    return base, bad


@pytest.mark.parametrize("positions", [[3, 3], [5, 1], [-1, 4], [4, 30]],
                         ids=["repeated", "backwards", "negative", "past-the-end"])
@pytest.mark.parametrize("batch", [1, 48, 1 << 24])
def test_a_bad_position_inside_a_batch_names_its_tensor_and_writes_nothing(
        tmp_path, monkeypatch, positions, batch):
    monkeypatch.setattr(delta_module, "DELTA_PATCH_BATCH", batch)
    base, bad = tampered(tmp_path, "expert.4.w", positions)
    dests, buffer = carved(SHAPES, torch.bfloat16, -1.0)
    for n, t in dests.items():
        t.copy_(base[n])
    before = buffer.clone()
    with pytest.raises(DeltaError, match=r"sparse tensor 'expert\.4\.w'.*\[0, 30\).*nothing was "
                                         "written"):
        apply_delta(dests, bad, version="v1")
    assert torch.equal(raw(buffer), raw(before))


def test_a_row_plan_keeps_each_shard_s_positions_in_one_batch(tmp_path):
    base, new = steps()
    path = tmp_path / "d.safetensors"
    save_delta(new, base, path, base_version="v1", version="v2")
    # the second half of the rows of every 2-D tensor (rank 1 of 2)
    plan = {n: (slice(s[0] // 2, s[0]) if len(s) == 2 else None) for n, s in SHAPES.items()}
    shapes = {n: ((s[0] - s[0] // 2, s[1]) if len(s) == 2 else s) for n, s in SHAPES.items()}
    dests, buffer = carved(shapes, torch.bfloat16, -1.0)
    for n, t in dests.items():
        t.copy_(base[n][plan[n]] if plan[n] is not None else base[n])
    around = gaps(dests, buffer)
    report = apply_update(dests, path, version="v2", base_version="v1", plan=plan)
    for n, t in dests.items():
        want = new[n][plan[n]] if plan[n] is not None else new[n]
        assert torch.equal(raw(t), raw(want)), n
    assert torch.equal(gaps(dests, buffer), around)
    # the bytes it wrote: two bytes a changed element inside the shards
    inside = sum(int((part(new, n).view(torch.int16) != part(base, n).view(torch.int16)).sum())
                 for n in SHAPES)
    assert inside == 2 * 5 + 10 + 2 and report.nbytes == 2 * inside


def part(tensors, name):
    rows = {n: (slice(s[0] // 2, s[0]) if len(s) == 2 else slice(None)) for n, s in SHAPES.items()}
    return tensors[name][rows[name]].contiguous()


class Stop(Exception):
    pass


def test_a_failure_between_batches_rolls_every_batch_back(tmp_path, monkeypatch):
    monkeypatch.setattr(delta_module, "DELTA_PATCH_BATCH", 48)
    shapes = {f"expert.{i}.w": (6, 5) for i in range(60)}       # batches of 24, 24 and 12
    base, new = steps(shapes=shapes)
    path = tmp_path / "d.safetensors"
    save_delta(new, base, path, base_version="v1", version="v2")
    dests, buffer = carved(shapes, torch.bfloat16, -1.0)
    for n, t in dests.items():
        t.copy_(base[n])
    before = buffer.clone()
    # the third batch's scatter fails: two batches were written
    real, calls = delta_module.scatter_target, []

    def failing(torch_, dests_, batch):
        calls.append(batch.names)
        if len(calls) == 3:
            raise Stop()
        return real(torch_, dests_, batch)
    monkeypatch.setattr(delta_module, "scatter_target", failing)
    held = VersionedWeights(dests, version="v1")
    with pytest.raises(UpdateFailed) as e:
        held.update(path, version="v2")
    assert e.value.rolled_back and held.version == "v1"
    assert [len(names) for names in calls] == [24, 24, 12]
    assert torch.equal(raw(buffer), raw(before))
