"""Weight updates (issue 56; docs/guides/rl-updates.md): ``apply_update`` and
``VersionedWeights`` check everything before the first byte is written (a
wrong update leaves the tensors bit-identical, on every path), write in
place, and never hide a failure after the first write: the holder says
"mixed" and names what was written, and reports no version until an
update succeeds; a rollback writes the old bytes back."""

import os

import pytest

torch = pytest.importorskip("torch")

from instant_staging.loader import (
    Checkpoint,
    UpdateFailed,
    UpdateRefused,
    VersionedWeights,
    apply_update,
    device_digests,
    save_delta,
    save_file,
    tensor_digest,
)

from support.tensors import CHUNK, raw_bytes


def weights(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed.weight": torch.randn(64, 32, generator=g).bfloat16(),
        "model.layers.0.w": torch.randn(32, 48, generator=g),
        "model.layers.0.b": torch.randn(48, generator=g),
        "model.layers.1.w": torch.randn(32, 48, generator=g),
        "model.layers.1.b": torch.randn(48, generator=g),
        "model.norm.weight": torch.randn(32, generator=g).half(),
    }


def snapshot(tensors):
    return {n: (t.data_ptr(), raw_bytes(t).clone()) for n, t in tensors.items()}


def same_as(tensors, snap):
    return all(t.data_ptr() == snap[n][0] and torch.equal(raw_bytes(t), snap[n][1])
               for n, t in tensors.items())


def holds(tensors, expected):
    return all(torch.equal(raw_bytes(tensors[n]), raw_bytes(expected[n])) for n in tensors)


@pytest.fixture
def steps(tmp_path):
    """Version v0 held by a model; v1 a full checkpoint; v2 a delta over v1."""
    v0, v1 = weights(0), weights(1)
    v2 = {n: t.clone() for n, t in v1.items()}
    v2["model.layers.0.w"].view(-1)[[1, 70, 900]] += 1       # sparse
    v2["model.norm.weight"] += 1                               # whole
    full = tmp_path / "v1.safetensors"
    save_file(v1, full, version="v1", digests=True)
    delta = tmp_path / "v2.delta.safetensors"
    save_delta(v2, v1, delta, base_version="v1", version="v2", digests=True)
    model = {n: t.clone() for n, t in v0.items()}
    return model, v0, v1, v2, full, delta


def test_a_full_update_then_a_delta_write_in_place_and_say_their_versions(steps):
    model, _, v1, v2, full, delta = steps
    held = VersionedWeights(model, version="v0")
    ptrs = {n: t.data_ptr() for n, t in model.items()}
    report = held.update(full, version="v1", return_digests=True)
    assert str(held.state) == "version v1" and held.version == "v1"
    assert holds(model, v1) and {n: t.data_ptr() for n, t in model.items()} == ptrs
    assert not report.delta and set(report.written) == set(model)
    assert report.nbytes == sum(t.nbytes for t in v1.values())
    assert report.digests == device_digests(v1)             # the trainer's side: the same digests
    report = held.update(delta, version="v2")
    assert report.delta and report.base_version == "v1" and held.version == "v2"
    assert set(report.written) == {"model.layers.0.w", "model.norm.weight"}
    assert holds(model, v2) and {n: t.data_ptr() for n, t in model.items()} == ptrs


def test_a_sparse_write_bumps_the_autograd_version(steps):
    model, _, _, _, full, delta = steps
    apply_update(model, full, version="v1")
    before = model["model.layers.0.w"]._version
    apply_update(model, delta, version="v2", base_version="v1")
    assert model["model.layers.0.w"]._version > before


def _refusals(tmp_path, v1, full, delta):
    """``(label, call(model, holder-version) -> None)`` of every wrong update."""
    missing = {n: t for n, t in v1.items() if n != "model.layers.1.b"}
    save_file(missing, tmp_path / "missing.safetensors", version="v1")
    shape = dict(v1, **{"model.layers.1.b": torch.zeros(47)})
    save_file(shape, tmp_path / "shape.safetensors", version="v1")
    dtype = dict(v1, **{"model.layers.1.b": torch.zeros(48, dtype=torch.float64)})
    save_file(dtype, tmp_path / "dtype.safetensors", version="v1")
    extra = dict(v1, **{"model.layers.2.w": torch.zeros(3)})
    save_file(extra, tmp_path / "extra.safetensors", version="v1")
    save_file(v1, tmp_path / "nodigests.safetensors", version="v1")
    wrong = {n: tensor_digest(t) for n, t in v1.items()}
    wrong["model.layers.0.b"] = tensor_digest(torch.zeros(48))

    def changed(model, version):
        with Checkpoint.open(full) as ck:
            with open(full, "r+b") as f:                   # written to after it was opened
                f.seek(-4, os.SEEK_END)
                f.write(b"\x00\x00\x80\x7f")
            apply_update(model, ck, version="v1", base_version=version)

    return [
        ("a missing name", lambda m, v: apply_update(m, tmp_path / "missing.safetensors",
                                                     version="v1", base_version=v)),
        ("a wrong shape", lambda m, v: apply_update(m, tmp_path / "shape.safetensors",
                                                    version="v1", base_version=v)),
        ("a wrong dtype", lambda m, v: apply_update(m, tmp_path / "dtype.safetensors",
                                                    version="v1", base_version=v)),
        ("an unexpected name", lambda m, v: apply_update(m, tmp_path / "extra.safetensors",
                                                         version="v1", base_version=v)),
        ("another version in the file", lambda m, v: apply_update(m, full, version="v9",
                                                                  base_version=v)),
        ("a delta for another version", lambda m, v: apply_update(m, delta, version="v2",
                                                                   base_version="v7")),
        ("a delta over an unknown version", lambda m, v: apply_update(m, delta, version="v2")),
        ("a changed source", changed),
        ("digests that differ", lambda m, v: apply_update(m, full, version="v1", digests=wrong)),
        ("digests the file lacks", lambda m, v: apply_update(
            m, tmp_path / "nodigests.safetensors", version="v1",
            digests={"model.norm.weight": tensor_digest(v1["model.norm.weight"])})),
        ("two names on one destination", lambda m, v: apply_update(
            m, full, version="v1", name_map=lambda n: "model.layers.0.b" if ".b" in n else n)),
    ]


def test_every_wrong_update_leaves_the_tensors_bit_identical(tmp_path, steps):
    model, _, v1, _, full, delta = steps
    snap = snapshot(model)
    refusals = _refusals(tmp_path, v1, full, delta)
    for label, call in refusals:
        with pytest.raises(UpdateRefused, match="nothing was written"):
            call(model, "v0")
        assert same_as(model, snap), label
    assert len(refusals) == 11


def test_the_holder_keeps_its_version_when_an_update_is_refused(steps):
    model, _, _, _, full, delta = steps
    held = VersionedWeights(model, version="v0")
    snap = snapshot(model)
    with pytest.raises(UpdateRefused, match="applies to version 'v1'; the tensors hold 'v0'"):
        held.update(delta, version="v2")
    with pytest.raises(UpdateRefused, match="holds version 'v1'"):
        held.update(full, version="v3")
    assert str(held.state) == "version v0" and same_as(model, snap)


class Interrupt:
    """A progress callback that raises once ``after`` bytes were written."""

    def __init__(self, after, error=None):
        self.after, self.error = after, error or RuntimeError("the disk went away")

    def __call__(self, done, total):
        if done >= self.after:
            raise self.error


def test_a_failure_after_the_first_write_says_mixed_until_a_full_update(steps):
    model, v0, v1, v2, full, delta = steps
    held = VersionedWeights(model, version="v0")
    with pytest.raises(UpdateFailed, match="failed after its first write") as e:
        held.update(full, version="v1", progress=Interrupt(2 * CHUNK), chunk_size=CHUNK,
                    threads=1)
    assert not e.value.rolled_back and e.value.__cause__ is not None
    assert set(e.value.written) <= set(model) and held.state.written == e.value.written
    assert held.version is None and held.state.mixed
    assert held.state.target == "v1" and held.state.version_before == "v0"
    assert str(held.state).startswith("mixed: ")
    assert not holds(model, v0)          # (some of v1 written, all of it at times)
    # no delta goes over a mix; a full update installs a version again
    with pytest.raises(UpdateRefused, match="unknown"):
        held.update(delta, version="v2")
    held.update(full, version="v1")
    assert held.version == "v1" and holds(model, v1)
    held.update(delta, version="v2")
    assert held.version == "v2" and holds(model, v2)


def test_ctrl_c_after_the_first_write_is_itself_and_says_mixed(steps):
    model, _, _, _, full, _ = steps
    held = VersionedWeights(model, version="v0")
    with pytest.raises(KeyboardInterrupt) as e:
        held.update(full, version="v1", progress=Interrupt(CHUNK, KeyboardInterrupt()),
                    chunk_size=CHUNK, threads=1)
    assert isinstance(e.value.update_failed, UpdateFailed)
    assert held.state.mixed and held.version is None


def test_a_rollback_writes_the_old_bytes_back(steps):
    model, _, _, _, full, _ = steps
    held = VersionedWeights(model, version="v0")
    snap = snapshot(model)
    with pytest.raises(UpdateFailed, match="rolled back") as e:
        held.update(full, version="v1", rollback=True, progress=Interrupt(CHUNK),
                    chunk_size=CHUNK, threads=1)
    assert e.value.rolled_back
    assert same_as(model, snap) and str(held.state) == "version v0"


def test_a_delta_is_rolled_back_by_default(steps):
    model, _, v1, _, full, delta = steps
    held = VersionedWeights(model, version="v0")
    held.update(full, version="v1")
    snap = snapshot(model)
    # the delta's whole tensor is read after its patches: fail it part-way
    with pytest.raises(UpdateFailed) as e:
        held.update(delta, version="v2", progress=Interrupt(1), chunk_size=CHUNK, threads=1)
    assert e.value.rolled_back and held.version == "v1" and same_as(model, snap)
    assert holds(model, v1)


def test_a_name_map_and_a_row_plan_write_one_rank_s_shard(steps):
    model, _, v1, v2, full, delta = steps
    # a rank of two holding the first half of the rows of the ".w" tensors,
    # under its own names
    rank = {("shard." + n): (t[: t.shape[0] // 2].clone() if n.endswith(".w") else t.clone())
            for n, t in model.items()}
    plan = {n: slice(0, t.shape[0] // 2) if n.endswith(".w") else None for n, t in v1.items()}
    held = VersionedWeights(rank, version="v0", name_map=lambda n: "shard." + n, plan=plan)
    held.update(full, version="v1")
    held.update(delta, version="v2")
    for n, t in v2.items():
        want = t[: t.shape[0] // 2] if n.endswith(".w") else t
        assert torch.equal(raw_bytes(rank["shard." + n]), raw_bytes(want.contiguous())), n


def test_a_name_map_may_skip_names(steps):
    model, _, v1, _, full, _ = steps
    part = {n: t for n, t in model.items() if "layers.1" not in n}
    report = apply_update(part, full, version="v1",
                          name_map=lambda n: None if "layers.1" in n else n)
    assert set(report.written) == set(part) and holds(part, v1)


def test_a_full_update_must_write_every_held_tensor(steps):
    model, _, _, _, full, _ = steps
    held = VersionedWeights(dict(model, extra=torch.zeros(3)), version="v0")
    snap = snapshot(model)
    with pytest.raises(UpdateRefused, match="does not write"):
        held.update(full, version="v1")
    assert same_as(model, snap)


def test_bad_arguments_are_type_errors(steps):
    model, _, _, _, full, _ = steps
    with pytest.raises(TypeError, match="version"):
        apply_update(model, full, version="")
    with pytest.raises(TypeError, match="unexpected keyword"):
        apply_update(model, full, version="v1", dtype=torch.float16)
    with pytest.raises(TypeError, match="rollback"):
        apply_update(model, full, version="v1", rollback="yes")


@pytest.mark.slow
def test_bench_update_quick(tmp_path):
    from support import run_bench_quick
    doc = run_bench_quick(tmp_path, "bench_update.py", "--layouts", "dense")
    methods = [x["method"] for x in doc["results"]]
    assert methods == ["load_file", "update full", "update full+rb", "update full+dg",
                       "update delta 2%", "digests"]
    assert all(x["exact"] is True and x["best"] > 0 for x in doc["results"])
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".delta.safetensors")]
