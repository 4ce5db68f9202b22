"""Deltas (docs/guides/saving.md, "The delta format"): save_delta writes
what changed, sparse where smaller; apply_delta checks the base version and
every destination before the first write, then writes in place."""

import json

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")
import safetensors
from torch.utils._python_dispatch import TorchDispatchMode

from instant_staging.loader import (
    DeltaError,
    apply_delta,
    parse_delta,
    read_delta,
    save_delta,
    save_file,
)


def model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(64, 32, generator=g).bfloat16(),
        "layer.0.w": torch.randn(32, 32, generator=g),
        "layer.0.b": torch.randn(32, generator=g),
        "ids": torch.arange(10, dtype=torch.int64),
        "mask": torch.zeros(16, dtype=torch.bool),
        "f8": torch.randn(40, generator=g).to(torch.float8_e4m3fn),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(1.5),
    }


def stepped(base):
    """A training step: a few positions of most tensors, all of one."""
    new = {n: t.clone() for n, t in base.items()}
    new["embed"].view(-1)[[3, 700, 1500]] += 1
    new["layer.0.w"].view(-1)[5] = float("nan")
    new["layer.0.b"] += 0.5                      # every element: stored whole
    new["mask"][2] = True
    new["f8"].view(torch.uint8)[7] ^= 1
    new["scalar"].fill_(-0.0 if base["scalar"].item() == 0 else 2.5)
    return new


def bytes_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("base_as", ["dict", "file"])
def test_a_delta_holds_only_what_changed_and_applies_to_the_new_bytes(tmp_path, base_as):
    base = model()
    new = stepped(base)
    base_arg = base
    if base_as == "file":
        save_file({n: t.contiguous() for n, t in base.items()}, tmp_path / "base.safetensors")
        base_arg = tmp_path / "base.safetensors"
    info = save_delta(new, base_arg, tmp_path / "d.safetensors", base_version="v1", version="v2")
    assert set(info.sparse) == {"embed", "layer.0.w", "mask", "f8"}
    assert set(info.full) == {"layer.0.b", "scalar"}
    assert read_delta(tmp_path / "d.safetensors") == info
    raw = st.load_file(tmp_path / "d.safetensors")
    assert raw["embed.idx"].tolist() == [3, 700, 1500] and raw["embed.idx"].dtype == torch.int32
    assert raw["embed.val"].dtype == torch.bfloat16      # the new values, not differences
    assert torch.equal(raw["embed.val"], new["embed"].view(-1)[[3, 700, 1500]])
    assert "ids" not in raw and "empty" not in raw       # unchanged: left out

    dest = {n: t.clone() for n, t in base.items()}
    ptrs = {n: t.data_ptr() for n, t in dest.items()}
    versions = {n: t._version for n, t in dest.items()}
    assert apply_delta(dest, tmp_path / "d.safetensors", version="v1").version == "v2"
    assert all(bytes_equal(dest[n], new[n]) for n in new)
    assert {n: t.data_ptr() for n, t in dest.items()} == ptrs
    assert all(dest[n]._version > versions[n] for n in info.sparse)


def test_a_delta_for_another_version_writes_nothing(tmp_path):
    base = model()
    save_delta(stepped(base), base, tmp_path / "d.safetensors", base_version="v1", version="v2")
    dest = {n: t.clone() for n, t in base.items()}
    with pytest.raises(DeltaError, match=r"version 'v1'.*'v7'"):
        apply_delta(dest, tmp_path / "d.safetensors", version="v7")
    assert all(bytes_equal(dest[n], base[n]) for n in base)


@pytest.mark.parametrize("break_it, words", [
    (lambda d: d.pop("layer.0.b"), "no destination"),           # a whole tensor's
    (lambda d: d.pop("embed"), "no destination"),               # a sparse tensor's
    (lambda d: d.__setitem__("embed", torch.zeros(64, 32)), "destination is torch.float32"),
    (lambda d: d.__setitem__("layer.0.b", torch.zeros(33)), "destination"),
    (lambda d: d.__setitem__("layer.0.w", torch.zeros(32, 32).t()), "not contiguous"),
])
def test_a_mismatched_destination_is_refused_before_any_write(tmp_path, break_it, words):
    base = model()
    save_delta(stepped(base), base, tmp_path / "d.safetensors", base_version="v1", version="v2")
    dest = {n: t.clone() for n, t in base.items()}
    break_it(dest)
    before = {n: t.clone() for n, t in dest.items()}
    with pytest.raises(DeltaError, match=words):
        apply_delta(dest, tmp_path / "d.safetensors", version="v1")
    assert all(bytes_equal(dest[n], before[n]) for n in dest)


def test_positions_out_of_range_or_order_are_refused_before_any_write(tmp_path):
    meta = {"instant_staging.delta": "1", "instant_staging.base_version": "a",
            "instant_staging.version": "b", "instant_staging.sparse": json.dumps({"w": [4]})}
    dest = {"w": torch.zeros(4), "v": torch.zeros(2)}
    for positions in ([1, 4], [2, 1], [-1, 2], [1, 1]):
        save_file({"w.idx": torch.tensor(positions, dtype=torch.int32),
                   "w.val": torch.ones(2), "v": torch.ones(2)}, tmp_path / "d.safetensors", meta)
        with pytest.raises(DeltaError, match="strictly increasing"):
            apply_delta(dest, tmp_path / "d.safetensors", version="a")
        assert not dest["w"].any() and not dest["v"].any()


def test_the_format_is_checked_from_the_header():
    good = {"instant_staging.delta": "1", "instant_staging.base_version": "a",
            "instant_staging.version": "b", "instant_staging.sparse": '{"w":[2,3]}'}
    entries = {"w.idx": ("I64", (2,)), "w.val": ("F32", (2,)), "full": ("BF16", (4,))}
    info = parse_delta(good, entries)
    assert info.sparse == {"w": (2, 3)} and info.full == ("full",)
    cases = [
        (None, entries, "not a delta"),
        ({**good, "instant_staging.delta": "2"}, entries, "format '2'"),
        ({k: v for k, v in good.items() if k != "instant_staging.base_version"}, entries, "base_version"),
        ({**good, "instant_staging.sparse": "[1]"}, entries, "JSON object"),
        ({**good, "instant_staging.sparse": '{"w":[2,-3]}'}, entries, "shape"),
        (good, {"w.val": ("F32", (2,))}, "no 'w.idx'"),
        (good, {**entries, "w.idx": ("F32", (2,))}, "I32 or I64"),
        (good, {**entries, "w.val": ("F32", (3,))}, "as long as"),
        (good, {**entries, "w": ("F32", (2, 3))}, "both whole and sparse"),
    ]
    for meta, ents, words in cases:
        with pytest.raises(DeltaError, match=words):
            parse_delta(meta, ents)


def test_a_full_checkpoint_is_not_a_delta(tmp_path):
    save_file(model(), tmp_path / "full.safetensors")
    with pytest.raises(DeltaError, match="not a delta"):
        apply_delta(model(), tmp_path / "full.safetensors", version="v1")


def test_save_delta_refuses_a_base_that_does_not_match(tmp_path):
    base = model()
    new = stepped(base)
    with pytest.raises(ValueError, match="no tensor 'extra'"):
        save_delta({**new, "extra": torch.ones(1)}, base, tmp_path / "d", base_version="a", version="b")
    with pytest.raises(ValueError, match="in the base"):
        save_delta({**new, "ids": torch.arange(11)}, base, tmp_path / "d", base_version="a", version="b")
    with pytest.raises(ValueError, match="version"):
        save_delta(new, base, tmp_path / "d", base_version="", version="b")
    # safetensors' own messages, as save_file gives them
    with pytest.raises(ValueError, match=r"Expected a dict of \[str, torch\.Tensor\]"):
        save_delta(list(new.items()), base, tmp_path / "d", base_version="a", version="b")
    with pytest.raises(ValueError, match=r"Key `ids` is invalid, expected torch\.Tensor"):
        save_delta({**new, "ids": 3}, base, tmp_path / "d", base_version="a", version="b")
    assert not (tmp_path / "d").exists()


def test_a_sparse_name_whose_keys_collide_is_stored_whole(tmp_path):
    base = {"w": torch.zeros(100), "w.idx": torch.zeros(3)}
    new = {"w": base["w"].clone(), "w.idx": base["w.idx"].clone()}
    new["w"][5] = 1
    info = save_delta(new, base, tmp_path / "d.safetensors", base_version="a", version="b")
    assert info.sparse == {} and info.full == ("w",)


def test_a_chain_of_deltas_has_no_drift_and_digests_cover_the_file(tmp_path):
    cur = model(1)
    dest = {n: t.clone() for n, t in cur.items()}
    for step in range(3):
        new = stepped(cur)
        path = tmp_path / f"d{step}.safetensors"
        save_delta(new, cur, path, base_version=f"v{step}", version=f"v{step + 1}", digests=True)
        apply_delta(dest, path, version=f"v{step}")
        cur = new
    assert all(bytes_equal(dest[n], cur[n]) for n in cur)
    with safetensors.safe_open(path, "pt") as f:
        assert "instant_staging.digests" in f.metadata()


def one_at_a_time(tensors, base):
    """save_delta's choice made a tensor at a time, as it was before tensors
    were compared in batches: ``(tensors to save_file, sparse)``."""
    f4 = getattr(torch, "float4_e2m1fn_x2", None)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    out, sparse = {}, {}
    for name, tensor in tensors.items():
        old = base[name]
        if tensor.numel() == 0:
            continue
        if tensor.dtype == f4:
            if not torch.equal(tensor.view(torch.uint8), old.view(torch.uint8)):
                out[name] = tensor
            continue
        new_bits = tensor.contiguous().reshape(-1).view(ints[tensor.element_size()])
        changed = new_bits != old.contiguous().reshape(-1).view(ints[tensor.element_size()])
        count = int(changed.sum())
        if count == 0:
            continue
        size = tensor.element_size()
        if count * (4 + size) >= tensor.numel() * size or f"{name}.idx" in tensors \
                or f"{name}.val" in tensors:
            out[name] = tensor
            continue
        positions = changed.nonzero().reshape(-1)
        out[f"{name}.idx"] = positions.to(torch.int32)
        out[f"{name}.val"] = new_bits[positions].view(tensor.dtype)
        sparse[name] = list(tensor.shape)
    return out, sparse


def mixed_step(seed=5):
    """Many small tensors of one size (a model's experts), big ones, odd
    sizes, several dtypes, a view, an empty one and an F4 one, each changed
    in a few places, in many, or not at all."""
    g = torch.Generator().manual_seed(seed)
    base = {f"expert.{i}.w": torch.randn(16, 16, generator=g).bfloat16() for i in range(60)}
    base.update({
        "big": torch.randn(300, 40, generator=g),
        "odd": torch.randn(37, generator=g).half(),
        "ids": torch.arange(-50, 51, dtype=torch.int64),
        "bytes": torch.randint(0, 256, (333,), dtype=torch.uint8, generator=g),
        "mask": torch.rand(90, generator=g) > 0.5,
        "f8": torch.randn(70, generator=g).to(torch.float8_e4m3fn),
        "view": torch.randn(40, 6, generator=g)[:, 2],
        "empty": torch.zeros(0, 7),
        "scalar": torch.tensor(3.0),
    })
    if hasattr(torch, "float4_e2m1fn_x2"):
        base["f4"] = torch.randint(0, 256, (6, 4), dtype=torch.uint8,
                                   generator=g).view(torch.float4_e2m1fn_x2)
    new = {n: t.clone() for n, t in base.items()}
    for i in range(0, 60, 3):                  # a third of the experts: a few elements
        new[f"expert.{i}.w"].view(-1)[[i, 100 + i, 255]] += 1
    new["expert.1.w"] += 1                     # every element: whole
    new["big"].view(-1)[::97] = float("nan")
    new["odd"].view(-1)[:30] += 1              # most: whole
    new["ids"][[0, 100]] = 7
    new["bytes"][::50] ^= 0xFF
    new["mask"][4] = not bool(new["mask"][4])
    new["f8"].view(torch.uint8)[[1, 69]] ^= 1
    new["view"] = new["view"].clone()[None].expand(2, -1)[1]        # still not contiguous
    new["view"][7] = -1.0
    new["scalar"].fill_(-3.0)
    if "f4" in new:
        new["f4"].view(torch.uint8)[2, 1] ^= 0x10
    return base, new


@pytest.mark.parametrize("batch, mask", [(1, 1), (700, 1000), (5000, 300), (1 << 30, 1 << 22)])
@pytest.mark.parametrize("base_as", ["dict", "file"])
def test_batched_comparison_writes_the_file_a_tensor_at_a_time_did(tmp_path, monkeypatch,
                                                                  batch, mask, base_as):
    from instant_staging.loader import _delta
    monkeypatch.setattr(_delta, "DELTA_BASE_BATCH", batch)
    monkeypatch.setattr(_delta, "DELTA_MASK_CPU", mask)
    base, new = mixed_step()
    base_arg = base
    if base_as == "file":
        save_file({n: t.contiguous() for n, t in base.items()}, tmp_path / "base.safetensors")
        base_arg = tmp_path / "base.safetensors"
    info = save_delta(new, base_arg, tmp_path / "d.safetensors", base_version="v1",
                      version="v2", metadata={"run": "7"})
    out, sparse = one_at_a_time(new, base)
    save_file(out, tmp_path / "want.safetensors",
              {"run": "7", "instant_staging.delta": "1", "instant_staging.base_version": "v1",
               "instant_staging.sparse": json.dumps(sparse, separators=(",", ":"))},
              version="v2")
    assert (tmp_path / "d.safetensors").read_bytes() == (tmp_path / "want.safetensors").read_bytes()
    assert len(info.sparse) > 20 and "expert.1.w" in info.full and "f8" in info.sparse
    dest = {n: t.clone() for n, t in base.items()}
    apply_delta(dest, tmp_path / "d.safetensors", version="v1")
    assert all(bytes_equal(dest[n], new[n]) for n in new)


class _Syncs(TorchDispatchMode):
    """Counts the operations that wait for the device: a scalar read, a
    comparison to a bool, a nonzero (its size)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.count += name in ("_local_scalar_dense", "equal", "nonzero", "is_nonzero")
        return func(*args, **(kwargs or {}))


def test_a_batch_of_many_tensors_waits_for_the_device_a_few_times_not_per_tensor(tmp_path):
    base, new = mixed_step()
    with _Syncs() as syncs:
        save_delta(new, base, tmp_path / "d.safetensors", base_version="v1", version="v2")
    assert syncs.count <= 2


@pytest.mark.gpu
@pytest.mark.parametrize("base_on", ["cuda", "cpu"])
def test_batched_comparison_on_a_gpu_writes_the_file_a_tensor_at_a_time_did(tmp_path, gpu,
                                                                            base_on):
    base, new = mixed_step()
    want, sparse = one_at_a_time(new, base)
    save_file(want, tmp_path / "want.safetensors",
              {"instant_staging.delta": "1", "instant_staging.base_version": "v1",
               "instant_staging.sparse": json.dumps(sparse, separators=(",", ":"))},
              version="v2")
    on_gpu = {n: t.cuda() for n, t in new.items()}
    base_arg = {n: t.cuda() for n, t in base.items()} if base_on == "cuda" else base
    save_delta(on_gpu, base_arg, tmp_path / "d.safetensors", base_version="v1", version="v2")
    assert (tmp_path / "d.safetensors").read_bytes() == (tmp_path / "want.safetensors").read_bytes()
