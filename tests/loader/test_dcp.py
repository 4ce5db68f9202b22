"""SafetensorsStorageWriter (loader/_dcp.py) against torch.distributed.checkpoint's
own HuggingFaceStorageWriter: the same file names, the same index byte for
byte, the same shard files (their header as a JSON object, their data byte
for byte: safetensors orders the three metadata keys by its hash map), read
back by DCP's reader, safetensors and our loader.

In one process (dcp.save without a group): every dtype, the staged path,
tied and non-contiguous tensors, the refusals before any write, a save
failing part-way.  In a gloo group of 2 processes (tests/loader/_dcp_worker.py):
a model sharded with FSDP2 saved each rank its shares and consolidated, a
rank-0 save of the whole state dict, ranks that would write one file
(refused), a rank failing in the middle of a file (each file whole: old
or new; the index and the consolidated files the old save's).
"""

import hashlib
import json
import os
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
if not hasattr(dcp, "HuggingFaceStorageWriter"):
    pytest.skip("torch.distributed.checkpoint without HuggingFaceStorageWriter",
                allow_module_level=True)

import instant_staging as ist
from instant_staging.loader import SafetensorsStorageWriter, _save, load_file
from instant_staging.testing import SimulatedRuntime

from support.ranks import free_port, rank_env, run_ranks

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_dcp_worker.py")
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.complex64, torch.uint16, torch.uint32, torch.uint64]


def rand(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for d in shape:
        numel *= d
    raw = torch.randint(0, 256, (numel * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=g)
    if dtype is torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and \
        torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def flipped(tensor):
    out = tensor.clone()
    if out.numel():
        out.reshape(-1).view(torch.uint8).bitwise_not_()
    return out


def state_dict():
    sd = {f"layers.{i}.w": rand(dtype, (3, 5) if i % 2 else (7,), i) for i, dtype in enumerate(DTYPES)}
    sd["embed"] = rand(torch.float32, (10, 4), 99)
    sd["lm_head"] = sd["embed"]                         # tied
    sd["scalar"] = torch.tensor(2.5)
    sd["empty"] = torch.zeros(0, 3)
    return sd


def mapping(sd):
    return {name: 1 + i % 2 for i, name in enumerate(sd)}


def save(sd, writer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # "assuming the intent is to save in a single process"
        dcp.save(sd, storage_writer=writer)


def header(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return n, json.loads(f.read(n)), f.read()


def sharding_info(path):
    """DCP_SHARDING_INFO as an object (DCP's writer lists device tensors by size)."""
    n, head, data = header(path)
    head["__metadata__"]["DCP_SHARDING_INFO"] = json.loads(head["__metadata__"]["DCP_SHARDING_INFO"])
    return n, head, data


def same_checkpoint(theirs, ours):
    """The same files; each safetensors file the same header (as JSON, of
    the same length) and the same data; each index the same bytes."""
    names = sorted(os.listdir(theirs))
    assert sorted(os.listdir(ours)) == names
    for name in names:
        a, b = theirs / name, ours / name
        if a.is_dir():
            continue
        if name.endswith(".json"):
            assert a.read_bytes() == b.read_bytes(), name
        else:
            assert header(a) == header(b), name
    return names


# -- one process ------------------------------------------------------------------------

@pytest.mark.parametrize("files", ["one", "two"])
def test_the_same_checkpoint_as_dcps_writer(tmp_path, files):
    sd = state_dict()
    m = mapping(sd) if files == "two" else None
    # DCP's writer refuses tied CPU tensors in one file (safetensors' check;
    # device tensors it copies to the host apart): ours writes each name's bytes.
    untied = dict(sd, lm_head=sd["lm_head"].clone())
    save(untied, dcp.HuggingFaceStorageWriter(str(tmp_path / "theirs"), fqn_to_index_mapping=m))
    save(sd, SafetensorsStorageWriter(tmp_path / "ours", fqn_to_index_mapping=m))
    names = same_checkpoint(tmp_path / "theirs", tmp_path / "ours")
    assert ("model.safetensors.index.json" in names) and len(names) == (3 if m else 2)
    for name in names:
        if name.endswith(".safetensors"):   # DCP's keys, in the order it passes them
            meta = header(tmp_path / "ours" / name)[1]["__metadata__"]
            assert list(meta) == ["DCP_SHARDING_INFO", "DCP_VERSION", "format"]
    got = load_file(str(tmp_path / "ours"))
    assert sorted(got) == sorted(sd)
    for name, tensor in sd.items():
        assert same(got[name], tensor), name


def test_dcps_reader_loads_it_back(tmp_path):
    sd = state_dict()
    save(sd, SafetensorsStorageWriter(tmp_path, fqn_to_index_mapping=mapping(sd)))
    target = {k: torch.zeros_like(v) for k, v in sd.items() if k != "lm_head"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=dcp.HuggingFaceStorageReader(str(tmp_path)))
    for name, tensor in target.items():
        assert same(tensor, sd[name]), name


def test_the_staged_path_and_a_non_contiguous_tensor(tmp_path):
    sd = state_dict()
    sd["big"] = rand(torch.float32, (5000,), 7)           # several chunks
    sd["t"] = rand(torch.float16, (40, 30), 8).t()        # not contiguous: written contiguous
    save(sd, SafetensorsStorageWriter(tmp_path / "plain"))
    with ist.StagingBuffer(1 << 16, runtime=SimulatedRuntime(), segment_size=3 * 4096) as buf:
        writer = SafetensorsStorageWriter(tmp_path / "staged", thread_count=3, staging=buf)
        writer._publish_options = {"stage_cpu": True, "chunk": 4096}
        save(sd, writer)
        assert not buf.closed
    name = "model-00001-of-00001.safetensors"
    assert (tmp_path / "staged" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()
    assert same(load_file(str(tmp_path / "staged"))["t"], sd["t"])


@pytest.mark.parametrize("case", ["not a tensor", "unmapped", "consolidation alone", "threads",
                                  "index 0"])
def test_refused_before_anything_is_written(tmp_path, case):
    sd = {"a": torch.ones(3), "b": torch.zeros(2)}
    kwargs = {}
    if case == "not a tensor":
        sd["step"] = 12
    elif case == "unmapped":
        kwargs["fqn_to_index_mapping"] = {"a": 1}
    elif case == "consolidation alone":
        kwargs["enable_consolidation"] = True
    elif case == "threads":
        kwargs["thread_count"] = 0
    else:
        kwargs["fqn_to_index_mapping"] = {"a": 0, "b": 1}
    words = {"not a tensor": "tensors only", "unmapped": "no file for", "threads": "thread_count",
             "consolidation alone": "save_distributed=True", "index 0": "count from 1"}[case]
    with pytest.raises(BaseException, match=words):   # DCP's CheckpointException is a BaseException
        save(sd, SafetensorsStorageWriter(tmp_path / "c", **kwargs))
    assert not [f for f in os.listdir(tmp_path / "c") if f.endswith((".safetensors", ".json"))] \
        if (tmp_path / "c").exists() else True


def test_two_shares_of_one_name_on_a_rank_are_refused(tmp_path):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    def share(row):
        chunk = ChunkStorageMetadata(offsets=torch.Size([row, 0]), sizes=torch.Size([1, 4]))
        return WriteItem(index=MetadataIndex("w", [row, 0]), type=WriteItemType.SHARD,
                         tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties(
                             dtype=torch.float32), size=torch.Size([2, 4])))
    writer = SafetensorsStorageWriter(tmp_path)
    writer.set_up_storage_writer(True, rank=0)
    with pytest.raises(ValueError, match="two shares of \\['w'\\] on one rank"):
        writer.prepare_local_plan(SavePlan([share(0), share(1)]))
    assert writer.prepare_local_plan(SavePlan([share(0)])).items
    assert os.listdir(tmp_path) == []


def test_a_failed_save_leaves_every_file_whole_and_the_old_index(tmp_path, monkeypatch):
    sd = state_dict()
    m = mapping(sd)
    save(sd, SafetensorsStorageWriter(tmp_path, fqn_to_index_mapping=m))
    before = {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)}
    real, calls = _save._pwritev_all, []

    def failing(fd, views, offset):
        calls.append(offset)
        if len(calls) > 1:      # the first file written, the second failing in its data
            raise OSError(28, "No space left on device")
        return real(fd, views, offset)
    monkeypatch.setattr(_save, "_pwritev_all", failing)
    new = {k: flipped(v) for k, v in sd.items() if k != "lm_head"}
    with pytest.raises(BaseException, match="No space left"):
        save(new, SafetensorsStorageWriter(tmp_path, fqn_to_index_mapping=m, thread_count=1))
    assert sorted(os.listdir(tmp_path)) == sorted(before)          # no temporary file left
    changed = [f for f in before if (tmp_path / f).read_bytes() != before[f]]
    assert changed == ["model-00001-of-00002.safetensors"]       # the first file, whole and new
    got = st.load_file(tmp_path / changed[0])
    assert got and all(same(t, new[k]) for k, t in got.items())
    assert sorted(load_file(str(tmp_path))) == sorted(sd)         # the old index, every file whole


@pytest.mark.gpu
def test_gpu_tensors_staged_are_dcps_files(tmp_path, gpu):
    sd = {k: v.to("cuda:0") for k, v in state_dict().items()}
    sd["lm_head"] = sd["embed"]                             # tied, on the device
    sd["big"] = rand(torch.bfloat16, (3 << 20,), 11).to("cuda:0")     # several chunks
    m = mapping(sd)
    save(sd, dcp.HuggingFaceStorageWriter(str(tmp_path / "theirs"), fqn_to_index_mapping=m))
    save(sd, SafetensorsStorageWriter(tmp_path / "ours", fqn_to_index_mapping=m))
    names = sorted(os.listdir(tmp_path / "theirs"))
    assert sorted(os.listdir(tmp_path / "ours")) == names
    for name in names:
        a, b = tmp_path / "theirs" / name, tmp_path / "ours" / name
        if name.endswith(".json"):      # the same object (DCP lists device tensors by size)
            assert json.loads(a.read_text()) == json.loads(b.read_text())
        else:
            assert sharding_info(a) == sharding_info(b), name


def test_bench_save_dcp_quick(tmp_path):
    from support import run_bench_quick
    doc = run_bench_quick(tmp_path, "bench_save_dcp.py", "--layouts", "dense")
    methods = [x["method"] for x in doc["results"]]
    # (ours before DCP's one-thread writer, the slowest: a run cut short has our row)
    assert methods[0] == "ceiling disk" and methods[-2:] == ["instant_staging", "dcp hf writer"]
    assert all(x["best"] > 0 for x in doc["results"])
    ours = doc["results"][-2]
    assert ours["same"] is True and ours["files"] > 1
    assert [p for p in os.listdir(tmp_path) if p != "bench_save_dcp.json"] == []


# -- a gloo group of two processes ----------------------------------------------------------

def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_fsdp2_on_two_gloo_ranks(tmp_path):
    port = free_port()
    run_ranks(lambda r: [sys.executable, WORKER, str(tmp_path), str(port), str(r)], 2, rank_env())
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    expected = torch.load(tmp_path / "expected.pt")

    # Each rank its shares, then the coordinator's whole files and index.
    names = same_checkpoint(tmp_path / "theirs" / "sharded", tmp_path / "ours" / "sharded")
    assert names == [f"shard-0000{r}-model-0000{i}-of-00002.safetensors"
                     for r in (1, 2) for i in (1, 2)]
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs))
    index = "model.safetensors.index.json"
    assert (ours / index).read_bytes() == (theirs / index).read_bytes()
    for i in (1, 2):
        name = f"model-0000{i}-of-00002.safetensors"
        got, want = st.load_file(ours / name), st.load_file(theirs / name)
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[k], want[k]) and torch.equal(got[k], expected[k]) for k in got)
        # ours in safetensors' own layout (DCP's consolidation writes its own header)
        assert (ours / name).read_bytes() == st.save(got, {"format": "pt"})
    assert all(s["reloaded ours/sharded"] and s["reloaded ours"] for s in seen)

    # The whole state dict from rank 0.
    same_checkpoint(tmp_path / "theirs0", tmp_path / "ours0")
    got = load_file(str(tmp_path / "ours0"))
    assert all(torch.equal(got[k], expected[k]) for k in expected)

    # Two ranks' shares under one name: refused on both ranks before any write.
    assert all("would both write model-00001-of-00001.safetensors" in s["clash"] for s in seen)
    assert os.listdir(tmp_path / "clash") == []

    # Rank 1 failed in its second file: both ranks raised; every file whole,
    # old or new; the consolidated files and the index the old save's.
    assert all("No space left on device" in s["failed"] for s in seen)
    assert [s["written"] for s in seen] == [2, 2]
    before = seen[0]["before"]
    failed = tmp_path / "failed"
    after = {os.path.relpath(os.path.join(root, f), failed)
             for root, _, files in os.walk(failed) for f in files}
    assert after == set(before)                                    # no temporary file left
    new = {f for f in before if digest(failed / f) != before[f]}
    assert new == {f"sharded/shard-00001-model-0000{i}-of-00002.safetensors" for i in (1, 2)} \
        | {"sharded/shard-00002-model-00001-of-00002.safetensors"}
    for f in before:
        if f.endswith(".safetensors"):
            st.load_file(failed / f)
