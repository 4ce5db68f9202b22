"""save_file and save (docs/guides/saving.md): safetensors' own bytes for
every dtype and edge case, its errors for the same bad input, the staged
path (run on the CPU through a simulated-runtime staging buffer), digests,
and publishing: a failed save leaves the old file and nothing else, a
reader beside a save gets one whole version, a save killed by SIGKILL
leaves the old file or the new one."""

import json
import os
import random
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")
import safetensors

import instant_staging as ist
from instant_staging.defaults import DIGEST_BLOCK
from instant_staging.loader import (
    TORCH_DTYPES,
    SafetensorsError,
    _save,
    load_file,
    save,
    save_file,
    tensor_digest,
)
from instant_staging.testing import SimulatedRuntime

from support import PACKAGE_PARENT, child_env
from support.tensors import random_tensor as rand

ALL_DTYPES = [getattr(torch, a) for a in TORCH_DTYPES.values() if hasattr(torch, a)]


def every_dtype(seed=0):
    """Three tensors of every dtype torch and safetensors share, inserted
    in a shuffled order, with names that sort apart from their dtypes."""
    out = []
    for i, dtype in enumerate(ALL_DTYPES):
        for k, shape in enumerate([(3, 5), (7,), (2, 1, 4)]):
            out.append((f"{'zyx'[k]}.{i}.{str(dtype)[6:]}", rand(dtype, shape, seed + 10 * i + k)))
    random.Random(seed).shuffle(out)
    return dict(out)


def staged_buffer(size=1 << 20, segment=None):
    kwargs = {"segment_size": segment} if segment else {}
    return ist.StagingBuffer(size, runtime=SimulatedRuntime(), **kwargs)


# -- the same bytes ---------------------------------------------------------------------

def test_every_dtype_is_saved_byte_for_byte_as_safetensors_saves_it(tmp_path):
    assert len(ALL_DTYPES) >= 19
    tensors = every_dtype()
    assert save(tensors) == st.save(tensors)
    assert save(tensors, {"format": "pt"}) == st.save(tensors, {"format": "pt"})
    save_file(tensors, tmp_path / "ours.safetensors", {"format": "pt"})
    st.save_file(tensors, tmp_path / "theirs.safetensors", {"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()
    back = load_file(tmp_path / "ours.safetensors")
    assert all(torch.equal(back[n].view(torch.uint8), t.view(torch.uint8)) for n, t in tensors.items())


@pytest.mark.parametrize("tensors, metadata", [
    ({}, None),
    ({}, {"k": "v"}),
    ({"s": torch.tensor(2.5)}, None),
    ({"s": torch.tensor(7, dtype=torch.int64), "b": torch.tensor(True)}, None),
    ({"zero": torch.zeros(0, 3), "one": torch.ones(1), "also0": torch.zeros(4, 0, dtype=torch.int8)}, None),
    ({"x": torch.ones(2)}, {}),
    ({"x": torch.ones(2)}, {"__metadata__": "x"}),
    ({"a\"\\\n\x01\x1f\x7fé€😀/": torch.ones(1), "": torch.ones(3), "\t": torch.ones(1)}, None),
    ({"f4": torch.arange(6, dtype=torch.uint8).view(torch.float4_e2m1fn_x2).reshape(2, 3)}, None),
    ({"view": torch.arange(8.0)[2:5], "grad": torch.ones(3, requires_grad=True)}, None),
], ids=["empty", "empty-meta", "scalar", "scalars", "zero-size", "empty-metadata", "meta-names",
        "escapes", "f4", "views"])
def test_edge_cases_are_safetensors_bytes(tensors, metadata):
    assert save(tensors, metadata) == st.save(tensors, metadata)


def test_empty_metadata_without_tensors_is_a_file_that_reads_back():
    # safetensors writes `{},"__metadata__":{}}` here, which it cannot read
    # back itself; ours is the header it meant.
    data = save({}, {})
    assert data[8:].rstrip() == b'{"__metadata__":{}}'
    with pytest.raises(safetensors.SafetensorError):
        st.load(st.save({}, {}))


def test_several_metadata_keys_keep_the_dicts_order():
    # safetensors' order of two or more keys is its hash map's, new in each
    # process: the same header once its keys are put in that order.
    tensors, metadata = {"w": torch.ones(3)}, {"b": "1", "a": "2", "c": "3", "long key": "v" * 9}
    ours, theirs = save(tensors, metadata), st.save(tensors, metadata)
    n = struct.unpack("<Q", ours[:8])[0]
    assert list(json.loads(ours[8:8 + n])["__metadata__"]) == list(metadata)
    order = json.loads(theirs[8:8 + n])["__metadata__"]
    assert save(tensors, dict(order)) == theirs


def test_conjugate_and_negative_views_are_saved_with_their_values():
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    loaded = st.load(save({"c": z.conj(), "n": torch.ones(2).neg().t()}))
    assert torch.equal(loaded["c"], z.conj().resolve_conj())
    assert torch.equal(loaded["n"], -torch.ones(2))


# -- the same errors ---------------------------------------------------------------------

x = torch.zeros(6)
BAD = {
    "not-a-dict": ([("a", torch.zeros(1))], None),
    "not-a-tensor": ({"a": 1}, None),
    "sparse": ({"a": torch.zeros(3).to_sparse()}, None),
    "shared": ({"a": x, "b": x[:2]}, None),
    "same-tensor": ({"a": x, "b": x}, None),
    "non-contiguous": ({"a": torch.zeros(2, 3).t()}, None),
    "expanded": ({"a": torch.zeros(3, 1).expand(3, 2)}, None),
    "int-name": ({1: torch.zeros(1)}, None),
    "int-metadata": ({"a": torch.zeros(1)}, {"k": 1}),
    "int-metadata-key": ({"a": torch.zeros(1)}, {1: "v"}),
    "list-metadata": ({"a": torch.zeros(1)}, [("k", "v")]),
    "surrogate-name": ({"a\ud800": torch.zeros(1)}, None),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_raises_what_safetensors_raises(case, tmp_path):
    tensors, metadata = BAD[case]
    with pytest.raises(Exception) as theirs:
        st.save(tensors, metadata)
    with pytest.raises(type(theirs.value)):
        save(tensors, metadata)
    target = tmp_path / "m.safetensors"
    with pytest.raises(type(theirs.value)):
        save_file(tensors, target, metadata)
    assert os.listdir(tmp_path) == []


def test_disjoint_views_of_one_storage_are_not_shared():
    tensors = {"a": x[:3], "b": x[3:]}
    assert save(tensors) == st.save(tensors)


@pytest.mark.parametrize("tensors, error, words", [
    ({"__metadata__": torch.zeros(1)}, ValueError, "__metadata__"),
    ({"m": torch.zeros(2, device="meta")}, ValueError, "meta device"),
    ({"c": torch.zeros(2, dtype=torch.complex128)}, ValueError, "no dtype"),
    ({"f4": torch.zeros((), dtype=torch.uint8).view(torch.float4_e2m1fn_x2)}, SafetensorsError, "0-d F4"),
])
def test_what_safetensors_fails_less_clearly_is_named(tensors, error, words, tmp_path):
    with pytest.raises(error, match=words):
        save_file(tensors, tmp_path / "m.safetensors")
    assert os.listdir(tmp_path) == []


def test_a_bad_target_is_named_before_anything_is_written(tmp_path):
    with pytest.raises(IsADirectoryError):
        save_file({"a": torch.ones(1)}, tmp_path)
    with pytest.raises(FileNotFoundError):
        save_file({"a": torch.ones(1)}, tmp_path / "missing" / "m.safetensors")
    with pytest.raises(ValueError, match="read-only"):     # buckets: test_save_upload.py
        save_file({"a": torch.ones(1)}, "https://host/m.safetensors")
    with pytest.raises(TypeError):
        save_file({"a": torch.ones(1)}, 3)


def test_our_metadata_keys_only_when_asked_and_never_twice():
    tensors = {"a": torch.ones(3)}
    assert save(tensors, {"k": "v"}) == st.save(tensors, {"k": "v"})
    with pytest.raises(ValueError, match="already holds"):
        save(tensors, {"instant_staging.version": "a"}, version="b")
    with pytest.raises(TypeError):
        save(tensors, version=3)


# -- the staged path, digests -------------------------------------------------------------

def publish_staged(tensors, path, buf, chunk, metadata=None, **kwargs):
    plan = _save.make_plan(tensors, metadata, version=kwargs.pop("version", None),
                           digests=kwargs.pop("digests", False))
    _save.publish(plan, os.fspath(path), staging=buf, chunk=chunk, stage_cpu=True, **kwargs)


@pytest.mark.parametrize("threads", [1, 3])
def test_the_staged_path_writes_the_same_bytes(tmp_path, threads):
    tensors = every_dtype(seed=5)
    tensors["big"] = rand(torch.float32, (5000,), 1)        # several chunks
    tensors["odd"] = rand(torch.uint8, (4097,), 2)
    with staged_buffer(1 << 16, segment=3 * 4096) as buf:   # 2 slots a segment, many segments
        publish_staged(tensors, tmp_path / "m.safetensors", buf, chunk=4096, threads=threads)
        assert not buf.closed
    assert (tmp_path / "m.safetensors").read_bytes() == st.save(tensors)


def test_digests_are_tensor_digest_of_every_tensor_on_both_paths(tmp_path):
    tensors = {"big": rand(torch.bfloat16, (DIGEST_BLOCK + 3000,), 3),     # 2+ blocks
               "small": rand(torch.int32, (5,), 4), "empty": torch.zeros(0)}
    direct = save(tensors, version="v7", digests=True)
    with staged_buffer(4 * DIGEST_BLOCK, segment=2 * DIGEST_BLOCK) as buf:
        publish_staged(tensors, tmp_path / "s.safetensors", buf, chunk=DIGEST_BLOCK,
                       version="v7", digests=True, threads=2)
    save_file(tensors, tmp_path / "d.safetensors", version="v7", digests=True)
    assert (tmp_path / "s.safetensors").read_bytes() == direct
    assert (tmp_path / "d.safetensors").read_bytes() == direct
    with safetensors.safe_open(tmp_path / "d.safetensors", "pt") as f:
        meta = f.metadata()
    assert meta["instant_staging.version"] == "v7"
    found = json.loads(meta["instant_staging.digests"])
    assert found["algorithm"] == _save.DIGEST_ALGORITHM
    assert found["tensors"] == {n: tensor_digest(t) for n, t in tensors.items()}
    changed = tensors["big"].clone()
    changed.view(torch.uint8)[-1] ^= 1
    assert tensor_digest(changed) != found["tensors"]["big"]


# -- publishing ------------------------------------------------------------------------------

def test_a_save_replaces_the_file_whole_and_leaves_nothing_beside_it(tmp_path):
    target = tmp_path / "m.safetensors"
    save_file({"a": torch.zeros(4)}, target)
    save_file({"b": torch.ones(8)}, target, sync=False)
    assert os.listdir(tmp_path) == ["m.safetensors"]
    assert target.read_bytes() == st.save({"b": torch.ones(8)})


@pytest.mark.parametrize("where", ["write", "sync", "staged-write"])
def test_a_failed_save_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch, where):
    target = tmp_path / "m.safetensors"
    save_file({"old": torch.zeros(4)}, target)
    old = target.read_bytes()
    calls = []

    def failing(*args):
        calls.append(1)
        raise OSError(28, "No space left on device")
    tensors = {"new": rand(torch.float32, (9000,), 0)}
    if where == "sync":
        monkeypatch.setattr(_save.os, "fsync", failing)
    else:
        real = _save._pwrite_all
        monkeypatch.setattr(_save, "_pwrite_all",
                            lambda fd, view, off: failing() if off > 64 else real(fd, view, off))
    with pytest.raises(OSError, match="No space"):
        if where == "staged-write":
            with staged_buffer(1 << 16, segment=4 * 4096) as buf:
                publish_staged(tensors, target, buf, chunk=4096, threads=2)
                buf.close()     # every slot back, no view of it left
        else:
            save_file(tensors, target)
    assert calls
    assert os.listdir(tmp_path) == ["m.safetensors"]
    assert target.read_bytes() == old


def test_a_reader_beside_a_save_loads_one_whole_version(tmp_path):
    target = tmp_path / "m.safetensors"
    versions = [{"w": torch.full((64, 1024), float(v)), "b": torch.full((v + 1,), float(v))}
                for v in range(2)]
    save_file(versions[0], target)
    stop = threading.Event()
    errors = []

    def saver():
        i = 0
        while not stop.is_set():
            i += 1
            save_file(versions[i % 2], target, sync=False)

    thread = threading.Thread(target=saver)
    thread.start()
    seen = set()
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            got = load_file(target)
            v = int(got["b"].numel()) - 1
            if not all(torch.equal(got[n], versions[v][n]) for n in versions[v]):
                errors.append(v)
            seen.add(v)
    finally:
        stop.set()
        thread.join()
    assert not errors
    assert seen == {0, 1}


KILLED = textwrap.dedent("""
    import sys, time, torch
    from instant_staging.loader import _save, save_file
    real = _save._pwrite_all
    def slow(fd, view, offset):
        time.sleep(0.002)
        real(fd, view, offset)
    _save._pwrite_all = slow
    v = int(sys.argv[2])
    print("ready", flush=True)
    while True:
        save_file({"w": torch.full((1 << 18,), float(v))}, sys.argv[1])
        v += 1
""")


@pytest.mark.slow
def test_a_save_killed_mid_write_leaves_a_whole_file(tmp_path):
    target = tmp_path / "m.safetensors"
    save_file({"w": torch.full((1 << 18,), -1.0)}, target)
    for attempt in range(4):
        # (the package under test, not the checkout's unbuilt sources: child_env)
        proc = subprocess.Popen([sys.executable, "-c", KILLED, str(target), str(100 * attempt)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env(),
                                cwd=PACKAGE_PARENT)
        line = proc.stdout.readline().strip()
        if line != b"ready":
            proc.kill()
            raise AssertionError(proc.communicate()[1].decode())
        time.sleep(0.05 + 0.1 * random.random())
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        w = st.load_file(target)["w"]
        assert torch.equal(w, torch.full_like(w, w[0].item()))
        leftovers = [n for n in os.listdir(tmp_path) if n != "m.safetensors"]
        assert all(n.startswith(".m.safetensors.") and n.endswith(".tmp") for n in leftovers)


def test_small_tensors_are_packed_into_chunk_sized_writes():
    tensors = {f"t{i:03d}": torch.full((100 + i,), i, dtype=torch.uint8) for i in range(50)}
    plan = _save.make_plan(tensors, None)
    packed = _save.pieces(plan.entries, 1024)
    assert all(p.size <= 1024 for p in packed) and len(packed) == -(-sum(100 + i for i in range(50)) // 1024)
    at = 0
    for p in packed:        # back to back, every byte once, parts adding up
        assert p.begin == at and p.size == sum(n for _, _, n in p.parts)
        at += p.size
    assert at == plan.size - plan.data_start
    whole = _save.pieces(plan.entries, 64, whole=True)
    assert all(len(p.parts) == 1 and p.parts[0][1] % 64 == 0 for p in whole)


def test_a_short_pwritev_writes_the_rest(tmp_path, monkeypatch):
    real = os.pwritev

    def short(fd, views, offset):       # the first buffer and half of the second
        return real(fd, [views[0], views[1][:len(views[1]) // 2]], offset)
    monkeypatch.setattr(_save.os, "pwritev", short)
    tensors = {f"t{i}": rand(torch.float32, (10 + i,), i) for i in range(20)}
    save_file(tensors, tmp_path / "m.safetensors")
    assert (tmp_path / "m.safetensors").read_bytes() == st.save(tensors)


def test_bench_save_quick(tmp_path):
    from support import run_bench_quick
    doc = run_bench_quick(tmp_path, "bench_save.py", "--layouts", "dense,finemoe")
    methods = [(x["layout"], x["method"]) for x in doc["results"]]
    assert ("finemoe", "delta 2%") in methods and ("dense", "ceiling disk") in methods
    assert all(x["best"] > 0 for x in doc["results"])
    assert all(x["exact"] is True for x in doc["results"] if x["method"].startswith("instant"))
    assert [p for p in os.listdir(tmp_path) if p != "bench_save.json"] == []


def test_more_small_tensors_than_one_write_takes_buffers(tmp_path, monkeypatch):
    monkeypatch.setattr(_save, "_MAX_PARTS", 7)
    tensors = {f"t{i:03d}": rand(torch.int16, (3,), i) for i in range(60)}
    assert all(len(p.parts) <= 7 for p in _save.pieces(_save.make_plan(tensors, None).entries, 1 << 20))
    save_file(tensors, tmp_path / "m.safetensors")
    assert (tmp_path / "m.safetensors").read_bytes() == st.save(tensors)
