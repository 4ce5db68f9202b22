"""The loader's front door: ``Checkpoint`` (DESIGN.md, "The loader").

Opened once from every local source form; answers what is in it without
reading a data byte; loads with ``names=`` and ``plan=`` (row slices, bit
for bit what safetensors' ``get_slice(name)[a:b]`` gives); reports what
each load did; holds its files until the last of its loads let go.
"""

import json
import os

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
from safetensors import safe_open as upstream_open

from instant_staging.loader import Checkpoint, LoadReport, SafetensorsError, load_file

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int64,
          torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.int32, torch.float64]


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, dtype in enumerate(DTYPES):
        shape = (7 + k, 3 + k % 4)
        raw = torch.randint(0, 256, (shape[0] * shape[1] * dtype.itemsize,), dtype=torch.uint8,
                            generator=g)
        t = raw.view(dtype).reshape(shape) if dtype != torch.bool else (raw[: shape[0] * shape[1]] & 1
                                                                         ).bool().reshape(shape)
        out[f"t{k}.{str(dtype).split('.')[-1]}"] = t.clone()
    out["scalar"] = torch.tensor(3.5)
    out["empty"] = torch.zeros((0, 4))
    return out


@pytest.fixture
def sharded(tmp_path):
    """A directory of two shards with an index, and its tensors."""
    tensors = _tensors()
    names = list(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        safetensors_torch.save_file({n: tensors[n] for n in part}, str(tmp_path / fname),
                                    metadata={"format": "pt", "shard": str(i)})
        weight_map.update({n: fname for n in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tmp_path, tensors


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def test_every_source_form_opens_the_same_checkpoint(sharded):
    d, tensors = sharded
    shards = sorted(str(p) for p in d.glob("*.safetensors"))
    forms = [d, str(d), str(d / "model.safetensors.index.json"), shards]
    seen = []
    for form in forms:
        with Checkpoint.open(form) as ck:
            seen.append((ck.files, sorted(ck.names()), ck.nbytes))
    assert all(s == seen[0] for s in seen)
    assert sorted(seen[0][1]) == sorted(tensors)
    with Checkpoint.open(shards[0]) as one:
        assert one.files == [shards[0]]


def test_inspect_reads_no_data_byte(sharded, monkeypatch):
    """Names, infos, metadata and sizes come from the headers: after opening,
    not one byte of any file is read (os.pread/preadv counted)."""
    d, tensors = sharded
    with Checkpoint.open(d) as ck:
        reads = []
        for name in ("pread", "preadv", "read", "readv"):
            real = getattr(os, name)
            monkeypatch.setattr(os, name,
                                lambda *a, _r=real, _n=name, **k: (reads.append(_n), _r(*a, **k))[1])
        names = ck.names()
        infos = {n: ck.info(n) for n in names}
        meta = ck.metadata()
        total = ck.nbytes
        monkeypatch.undo()
    assert reads == []
    assert meta == {"format": "pt", "shard": "0"}
    assert total == sum(t.numel() * t.element_size() for t in tensors.values())
    for name, t in tensors.items():
        info = infos[name]
        assert info.shape == tuple(t.shape) and info.nbytes == t.numel() * t.element_size()
        assert os.path.dirname(info.file) == str(d)
    with Checkpoint.open(d) as ck, pytest.raises(KeyError, match="nope"):
        ck.info("nope")


def test_load_equals_safetensors_and_report_adds_up(sharded):
    d, tensors = sharded
    with Checkpoint.open(d) as ck:
        got = ck.load("cpu")
        report = ck.last_report
        again = ck.load("cpu", names=["scalar", "t0.float32"])     # opened once, loaded twice
    assert list(got) == ck.names()
    for name, t in tensors.items():
        _same(got[name], t)
    assert set(again) == {"scalar", "t0.float32"}
    assert isinstance(report, LoadReport)
    assert report.tensors == len(tensors) and report.bytes == ck.nbytes
    assert report.device == "cpu" and report.staging_kind is None
    assert report.phases["open"] == 0.0           # opened before the load
    assert abs(sum(report.phases.values()) - report.seconds) < 1e-6
    assert report.gbps == pytest.approx(report.bytes / report.seconds / 1e9)


def test_a_selection_by_names_takes_the_checkpoints_order_from_one_table(sharded):
    # A load of names looks them up in one table per checkpoint, made once
    # for all its loads (vLLM's batches: hundreds of loads of one
    # checkpoint), and keeps the reading order whatever the names' order;
    # unknown names are a KeyError naming them, a predicate is asked per
    # tensor, a share already narrowed is narrowed again by the same rule.
    import random

    from instant_staging.loader import _shards
    d, _ = sharded
    paths = sorted(str(p) for p in d.glob("*.safetensors"))
    ck = _shards.Shards().open(paths)
    try:
        everything = [t.name for _, t in ck.entries]
        rng = random.Random(0)
        for _ in range(20):
            names = rng.sample(everything, rng.randint(0, len(everything)))
            share = ck.share(lambda: None)
            share.select(names)
            assert [t.name for _, t in share.entries] == [n for n in everything if n in names]
            assert share.total_bytes == sum(t.nbytes for _, t in share.entries)
            again = set(rng.sample(names, len(names) // 2))
            share.select(again)
            assert [t.name for _, t in share.entries] == [n for n in everything if n in again]
            left = [n for n in everything if n not in again]
            if left:        # the checkpoint has it, this selection no longer
                with pytest.raises(KeyError, match="1 tensor name"):
                    share.select([left[0]])
        assert ck.share(lambda: None).name_places() is ck.name_places()
        assert ck.entries is ck.all_entries and len(ck.entries) == len(everything)
        share = ck.share(lambda: None)
        with pytest.raises(KeyError, match=r"2 tensor name.*'nope'.*'zz'"):
            share.select(["zz", everything[0], "nope"])
        share.select(lambda name: name.startswith("t1"))
        assert [t.name for _, t in share.entries] == [n for n in everything if n.startswith("t1")]
    finally:
        ck.close()


def test_load_file_report_counts_the_opening(sharded):
    d, _ = sharded
    from instant_staging.loader import iter_load
    with iter_load(d, "cpu") as it:
        assert it.report is None                 # not finished
        for _ in it:
            pass
    r = it.report
    assert r.phases["open"] > 0 and abs(sum(r.phases.values()) - r.seconds) < 1e-6


@pytest.mark.parametrize("part", [slice(0, 3), slice(2, 5), slice(1, None), slice(None, 2),
                                  slice(-3, None), slice(4, 2), slice(0, 100)])
def test_plan_rows_equal_safetensors_slices(sharded, part):
    d, tensors = sharded
    plan = {n: part for n, t in tensors.items() if t.dim() >= 1}
    plan["scalar"] = None
    with Checkpoint.open(d) as ck:
        got = ck.load("cpu", plan=plan)
        nbytes = ck.last_report.bytes
    assert set(got) == set(plan)
    want_bytes = 0
    for shard in d.glob("*.safetensors"):
        with upstream_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if name not in plan:
                    continue
                want = f.get_tensor(name) if plan[name] is None else f.get_slice(name)[plan[name]]
                _same(got[name], want)
                want_bytes += want.numel() * want.element_size()
    assert nbytes == want_bytes                   # only the rows' bytes were read


def test_plan_reads_only_its_rows(sharded, monkeypatch):
    """A plan's load reads only the planned rows: a checkpoint whose other
    rows are overwritten with garbage still gives the right slice."""
    d, tensors = sharded
    name = "t0.float32"                            # 7 x 3 float32: rows of 12 bytes
    with Checkpoint.open(d) as ck:
        file = ck.info(name).file
    with open(file, "rb") as fh:
        raw = fh.read()
    length = int.from_bytes(raw[:8], "little")
    offsets = json.loads(raw[8:8 + length])[name]["data_offsets"]
    header = 8 + length
    with open(file, "r+b") as fh:                   # rows 0-1 and 5-6 garbage
        fh.seek(header + offsets[0])
        fh.write(b"\xff" * 24)
        fh.seek(header + offsets[0] + 5 * 12)
        fh.write(b"\xff" * 24)
    with Checkpoint.open(d) as ck:                  # (opened after the write: it is the file's)
        got = ck.load("cpu", plan={name: slice(2, 5)})
    _same(got[name], tensors[name][2:5])


def test_plan_errors_before_anything_is_read(tmp_path):
    path = tmp_path / "f4.safetensors"
    safetensors_torch.save_file({"w": torch.zeros(8, 6), "v": torch.zeros(5)}, str(path))
    with Checkpoint.open(path) as ck:
        with pytest.raises(KeyError, match="missing"):
            ck.load("cpu", plan={"missing": None})
        with pytest.raises(ValueError, match="step"):
            ck.load("cpu", plan={"w": slice(0, 4, 2)})
        with pytest.raises(TypeError, match="slice"):
            ck.load("cpu", plan={"w": (0, 4)})
        with pytest.raises(TypeError, match="dict"):
            ck.load("cpu", plan=[("w", None)])
        with pytest.raises(ValueError, match="not both"):
            ck.load("cpu", names=["w"], plan={"w": None})
        assert ck.load("cpu", plan={"v": slice(1, 3)})["v"].shape == (2,)


def test_plan_of_packed_rows_that_are_not_whole_bytes(tmp_path):
    """F4 packs two values a byte: a 1-D F4 tensor's row is 4 bits, which
    cannot be sliced; a 2-D one with an even last dimension can."""
    from instant_staging.loader import DTYPE_BITS
    assert DTYPE_BITS["F4"] == 4
    header = {"odd": {"dtype": "F4", "shape": [6], "data_offsets": [0, 3]},
              "even": {"dtype": "F4", "shape": [4, 2], "data_offsets": [3, 7]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path = tmp_path / "f4.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(range(7)))
    with Checkpoint.open(path) as ck:
        with pytest.raises(SafetensorsError, match="not whole bytes"):
            ck.load("cpu", plan={"odd": slice(0, 2)})
        if hasattr(torch, "float4_e2m1fn_x2"):
            rows = ck.load("cpu", plan={"even": slice(1, 3)})["even"]
            assert bytes(rows.view(torch.uint8).reshape(-1).tolist()) == bytes([4, 5])


def test_closed_checkpoint_and_loads_that_outlive_it(sharded):
    """A load started before close() keeps the files until it ends; the
    checkpoint's descriptors close once no load holds them."""
    d, tensors = sharded
    ck = Checkpoint.open(d)
    fds = list(ck._shards.fds)
    it = ck.iter_load("cpu")
    ck.close()
    assert ck.closed and all(_is_open(fd) for fd in fds)
    with pytest.raises(ValueError, match="closed"):
        ck.load("cpu")
    got = dict(it)
    it.close()
    assert len(got) == len(tensors)
    assert not any(_is_open(fd) for fd in fds)
    ck.close()                                    # idempotent


def test_failed_load_leaves_the_checkpoint_usable(sharded):
    d, tensors = sharded
    with Checkpoint.open(d) as ck:
        with pytest.raises(KeyError):
            ck.load("cpu", names=["nope"])
        with pytest.raises(ValueError):
            ck.load("mps:x")
        assert len(ck.load("cpu")) == len(tensors)


def test_load_file_closes_every_descriptor(sharded):
    d, _ = sharded
    before = set(os.listdir("/proc/self/fd"))
    load_file(d)
    with pytest.raises(KeyError):
        load_file(d, names=["nope"])
    assert set(os.listdir("/proc/self/fd")) == before


def _is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def test_safe_open_prefetch_hands_each_tensor_out_once(sharded):
    """safetensors 0.9's prefetch(plan): the planned tensors (rows of a
    slice) equal get_tensor / get_slice's, each handed out once, by take or
    by iterating; close() frees what was not taken and the file with it."""
    from instant_staging.loader import safe_open
    d, _ = sharded
    shard = str(sorted(d.glob("*.safetensors"))[0])
    fds = set(os.listdir("/proc/self/fd"))
    with safe_open(shard, framework="pt") as f:
        names = f.offset_keys()
        plan = {n: (slice(1, 4) if f.get_slice(n).get_shape() else None) for n in names}
        with f.prefetch(plan) as ld:
            assert ld.names() == names and len(ld) == len(names)
            first = ld.take(names[0])
            with pytest.raises(KeyError):
                ld.take(names[0])
            rest = dict(ld)
        assert set(rest) == set(names[1:])
        got = {names[0]: first, **rest}
        for n in names:
            _same(got[n], f.get_slice(n)[1:4] if plan[n] is not None else f.get_tensor(n))
        with f.prefetch() as whole:                  # every tensor whole; closed untaken
            whole.take(names[-1])
        with pytest.raises(KeyError):
            f.prefetch({"nope": None})
        with pytest.raises(ValueError, match="step"):
            f.prefetch({names[0]: slice(0, 4, 2)})
    assert set(os.listdir("/proc/self/fd")) == fds


def test_safe_open_prefetch_checks_its_plan_as_safetensors_09(tmp_path):
    """The plan's errors of safetensors 0.9.0rc1's own prefetch tests (their
    patterns, test_pread_backend.py), checked before the device (a cuda
    device on a host without one is not the error) and before any read;
    a plan's rows are explicit: out of range is an error, never clipped."""
    import torch
    from safetensors.torch import save_file

    from instant_staging.loader import safe_open
    path = str(tmp_path / "tiny.safetensors")
    source = {"fp32_2d": torch.arange(12, dtype=torch.float32).reshape(3, 4),
              "scalar_fp32": torch.tensor(7.5), "i64_1d": torch.arange(5)}
    save_file(source, path)
    with safe_open(path, framework="pt") as f:
        for device in (None, "cuda:0", "cpu"):
            for plan, error, pattern in [
                ({"nope": None}, KeyError, "does not contain"),
                ({"fp32_2d": slice(0, 3, 2)}, ValueError, "step 1"),
                ({"scalar_fp32": slice(0, 1)}, ValueError, "0-d"),
                ({"fp32_2d": 3}, TypeError, "None or a slice"),
                ({"fp32_2d": slice(0, 10)}, ValueError, "out of range"),
                ({"fp32_2d": slice(0, 3, 0)}, ValueError, "invalid prefetch plan slice"),
                ({}, ValueError, "selects no tensors"),
            ]:
                with pytest.raises(error, match=pattern):
                    f.prefetch(plan, device=device)
        with f.prefetch({"fp32_2d": slice(-3, 3), "i64_1d": slice(2, 5)}) as loader:
            assert tuple(loader.take("fp32_2d").shape) == (3, 4)
            assert torch.equal(loader.take("i64_1d"), source["i64_1d"][2:5])
        with f.prefetch({"fp32_2d": slice(2, 2)}) as loader:
            assert tuple(loader.take("fp32_2d").shape) == (0, 4)


def test_close_closes_every_descriptor_even_past_an_error():
    """A descriptor that close() refuses (here one never opened) is removed
    like the others, the rest are still closed, and the error comes last."""
    import errno

    from instant_staging.loader._fds import close_recorded, open_recorded
    fds = []
    for _ in range(3):
        open_recorded(fds, os.devnull, os.O_RDONLY)
    opened = list(fds)
    fds.insert(1, max(opened) + 1000)
    with pytest.raises(OSError) as e:
        close_recorded(fds)
    assert e.value.errno == errno.EBADF
    assert fds == [] and not any(_is_open(fd) for fd in opened)
    close_recorded(fds)                           # idempotent
