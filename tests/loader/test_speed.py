"""Issue 13's mechanisms on the CPU: tensors allocated while the readers run
(``start(more=True)`` + ``provide``), two slots per reader thread, the
benchmarks' skip bits, the slot cap, and the benchmark scripts' quick
smoke mode.  Speed itself is measured in
benchmarks/ on the GPU, never here."""

import json
import mmap
import os
import threading
import time

import pytest
import safetensors.torch as st
import torch

import instant_staging as ist
from instant_staging.loader import _shards, load_file
from instant_staging.loader._pipeline import SKIP_COPY, SKIP_READ, Pipeline, Plan
from instant_staging.testing import SimulatedRuntime

from support import ROOT, run_bench_quick, run_script

PAGE = mmap.PAGESIZE
CHUNK = 2 * PAGE


def tensors(count=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"t.{i}": torch.randint(-1000, 1000, ((i * 53) % 900 + 1,), generator=g,
                                    dtype=torch.int32) for i in range(count)}


def plan_of(path, chunk=CHUNK):
    ck = _shards.Shards().open([path])
    plan = Plan([(ck.fds[i], t.begin, t.end) for i, t in ck.entries], chunk)
    return ck, plan


def run_to_end(pipe, timeout=20.0):
    finished, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, _, exited, failed = pipe.wait(0.05)
        finished += done
        if exited or failed:
            return finished
    raise AssertionError("pipeline did not finish")


@pytest.fixture
def saved(tmp_path):
    ts = tensors()
    path = str(tmp_path / "m.safetensors")
    st.save_file(ts, path)
    return path, ts


# -- destinations handed over while the threads run --------------------------

def test_provide_destinations_while_running(saved):
    path, ts = saved
    ck, plan = plan_of(path)
    try:
        outs = [torch.zeros_like(ts[t.name]) for _, t in ck.entries]
        pipe = Pipeline(plan, threads=3, depth=4)
        pipe.start([o.data_ptr() for o in outs[:2]], more=True)
        time.sleep(0.2)
        # Nothing past the given destinations can finish.
        done, _, exited, _ = pipe.wait(0.0)
        assert not exited and all(i < 2 for i in done)
        for i in range(2, len(outs), 5):
            pipe.provide([o.data_ptr() for o in outs[i:i + 5]])
        finished = done + run_to_end(pipe)
        assert pipe.error() is None
        pipe.close()
        assert sorted(finished) == list(range(len(outs)))
        for (_, t), o in zip(ck.entries, outs):
            assert torch.equal(o, ts[t.name]), t.name
    finally:
        ck.close()


def test_close_while_threads_wait_for_destinations(saved):
    path, _ = saved
    ck, plan = plan_of(path)
    try:
        pipe = Pipeline(plan, threads=4, depth=8)
        pipe.start([], more=True)
        time.sleep(0.1)
        closer = threading.Thread(target=pipe.close)
        closer.start()
        closer.join(10)
        assert not closer.is_alive(), "close() hung on threads waiting for destinations"
    finally:
        ck.close()


def test_partial_destinations_need_more(saved):
    path, _ = saved
    ck, plan = plan_of(path)
    try:
        pipe = Pipeline(plan, threads=1, depth=1)
        with pytest.raises(ValueError, match="destinations"):
            pipe.start([0, 0])
        pipe.start([], more=True)
        with pytest.raises(ValueError, match="destinations"):
            pipe.provide([0] * (plan.n_tensors + 1))
        pipe.close()
    finally:
        ck.close()


def test_allocation_failure_midway_frees_everything(saved, monkeypatch):
    # Allocation now overlaps the readers: a failure there must still stop
    # and join them and free every tensor (SimulatedRuntime counts).
    path, _ = saved
    rt = SimulatedRuntime()
    buf = ist.StagingBuffer(8 * CHUNK, runtime=rt, copy_unit=CHUNK, prefault_threads=0)
    from support.tensors import SimTarget, iterator
    target = SimTarget(rt)
    calls = []
    real = target.allocate

    def failing(entry, dtype):
        calls.append(entry)
        if len(calls) == 20:
            raise MemoryError("simulated out of device memory")
        return real(entry, dtype)
    target.allocate = failing
    ck = _shards.Shards().open([path])
    dtypes = [target.check(t, path) for _, t in ck.entries]
    with pytest.raises(MemoryError), iterator(ck, target, dtypes, staging=buf, chunk_size=CHUNK,
                                             io_depth=4, threads=3) as it:
        dict(it)
    import gc
    gc.collect()
    assert rt.live_device_allocs == 0
    buf.close()
    assert rt.live_registrations == 0


def test_default_io_depth_is_two_slots_per_thread(saved):
    path, ts = saved
    rt = SimulatedRuntime()
    buf = ist.StagingBuffer(64 * CHUNK, runtime=rt, copy_unit=CHUNK, prefault_threads=0)
    from support.tensors import SimTarget, iterator
    target = SimTarget(rt)
    ck = _shards.Shards().open([path])
    dtypes = [target.check(t, path) for _, t in ck.entries]
    with iterator(ck, target, dtypes, staging=buf, chunk_size=CHUNK, threads=3) as it:
        first = next(it)
        assert it._state.pipe.slots == 6       # not all 64 slots of the buffer
        got = dict([first, *it])
    for name, t in ts.items():
        assert torch.equal(got[name], t)
    buf.close()


def test_default_load_to_cpu(saved):
    path, ts = saved
    got = load_file(path)
    for name, t in ts.items():
        assert torch.equal(got[name], t)


# -- the benchmarks' skip bits and the slot cap --------------------------------

def test_skip_copy_reads_only(saved):
    path, ts = saved
    ck, plan = plan_of(path)
    try:
        outs = [torch.zeros_like(ts[t.name]) for _, t in ck.entries]
        pipe = Pipeline(plan, threads=2, depth=4, skip=SKIP_COPY)
        pipe.start([o.data_ptr() for o in outs])
        assert sorted(run_to_end(pipe)) == list(range(len(outs)))
        assert pipe.error() is None
        pipe.close()
        assert all(not o.any() for o in outs)    # read, never copied
    finally:
        ck.close()
    with pytest.raises(ValueError, match="skip"):
        Pipeline(plan, threads=1, depth=1, skip=SKIP_READ | SKIP_COPY | 4)


def test_depth_caps_the_slots_of_a_staging_buffer():
    rt = SimulatedRuntime()
    buf = ist.StagingBuffer(16 * CHUNK, runtime=rt, copy_unit=CHUNK, prefault_threads=0)
    plan = Plan([(0, 0, 100 * CHUNK)], CHUNK)
    pipe = Pipeline(plan, threads=2, staging=buf, device=0, depth=3)
    assert pipe.slots == 3
    pipe.close()
    pipe = Pipeline(plan, threads=2, staging=buf, device=0)
    assert pipe.slots == 16
    pipe.close()
    with pytest.raises(ValueError, match="depth"):
        Pipeline(plan, threads=2, staging=buf, device=0, depth=0)
    buf.close()


# -- the benchmarks' quick mode -------------------------------------------------

def test_bench_load_and_profile_quick(tmp_path):
    env = {"CUDA_VISIBLE_DEVICES": ""}
    doc = run_bench_quick(tmp_path, "bench_load.py")
    ours = [x for x in doc["results"] if x["method"] == "instant_staging"]
    assert {(x["layout"], x["cache"]) for x in ours} == {
        ("dense", "hot"), ("dense", "cold"), ("moe", "hot"), ("moe", "cold")}
    assert all(x["bit_exact"] is True and x["gbps_best"] > 0 for x in ours)
    assert doc["layouts"]["dense"]["tensors"] == 291 and doc["layouts"]["moe"]["tensors"] == 1188
    r = run_script(os.path.join(ROOT, "benchmarks", "profile_load.py"),
                   "--quick", "--dir", str(tmp_path), "--layouts", "moe", "--repeat", "1",
                   "--threads", "2", "--chunks", "1MiB", "--json", str(tmp_path / "p.json"), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    sections = {x["section"] for x in json.loads((tmp_path / "p.json").read_text())["results"]}
    assert {"phases", "reads", "host"} <= sections


def test_bench_judge_and_disk_quick(tmp_path):
    env = {"CUDA_VISIBLE_DEVICES": ""}
    out = tmp_path / "judge.json"
    r = run_script(os.path.join(ROOT, "benchmarks", "bench_judge.py"), "--quick", "--device", "cpu",
                   "--layouts", "moe,finemoe", "--runs", "2", "--phases", "--dir", str(tmp_path),
                   "--json", str(out), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    results = json.loads(out.read_text())["results"]
    assert [x["layout"] for x in results] == ["moe", "finemoe"]
    assert all(x["bit_exact"] and len(x["seconds"]) == 2 for x in results)
    assert set(results[0]["phases"][0]) == {"open", "prepare", "load", "after"}
    out = tmp_path / "disk.json"
    r = run_script(os.path.join(ROOT, "benchmarks", "bench_disk.py"), "--quick", "--layouts", "moe",
                   "--threads", "1,2", "--blocks", "64KiB", "--modes", "buffered,uring", "--rounds", "1",
                   "--dir", str(tmp_path), "--json", str(out), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())["results"]
    modes = {x["mode"] for x in rows}
    # uring rows where the binding and the kernel allow one, else a note says why not
    assert modes == {"buffered", "uring"} or ("no uring rows" in r.stdout and modes == {"buffered"})
    assert all(len(x["seconds"]) == 1 and x["seconds"][0] > 0 for x in rows)


def test_profile_timeline_and_first_quick(tmp_path):
    env = {"CUDA_VISIBLE_DEVICES": ""}
    out = tmp_path / "t.json"
    r = run_script(os.path.join(ROOT, "benchmarks", "profile_load.py"), "--quick", "--dir", str(tmp_path),
                   "--layouts", "finemoe", "--sections", "timeline", "--repeat", "1", "--json", str(out),
                   env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    (rec,) = json.loads(out.read_text())["results"]
    steps = ("headers parsed", "planned", "readers started", "last address given", "readers exited",
             "returned")
    assert [rec[s] for s in steps] == sorted(rec[s] for s in steps)     # stamped in order
    r = run_script(os.path.join(ROOT, "benchmarks", "profile_load.py"), "--quick", "--dir", str(tmp_path),
                   "--layouts", "moe", "--sections", "first", "--first-cold", "--json", str(out), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    first, second = json.loads(out.read_text())["results"]
    assert (first["call"], first["cold"], second["call"], second["cold"]) == ("first", True, "second", False)
    assert first["samples"] and first["samples"][-1][1] > 0 and not second["samples"]
    r = run_script(os.path.join(ROOT, "benchmarks", "profile_load.py"), "--quick", "--dir", str(tmp_path),
                   "--layouts", "moe,dense", "--sections", "first", env=env)
    assert r.returncode == 2 and "alone, with one layout" in r.stderr


def test_bench_pinning_needs_a_gpu_and_says_so():
    env = {"CUDA_VISIBLE_DEVICES": ""}
    script = os.path.join(ROOT, "benchmarks", "bench_pinning.py")
    r = run_script(script, "--sections", "register,mapped", env=env)
    assert r.returncode == 0 and "nothing to measure without a GPU" in r.stdout, r.stdout + r.stderr
    r = run_script(script, "--sections", "register,bogus", env=env)
    assert r.returncode == 2 and "bogus" in r.stderr


def test_bench_start_quick(tmp_path):
    out = tmp_path / "s.json"
    r = run_script(os.path.join(ROOT, "benchmarks", "bench_start.py"), "--tensors", "10,3000",
                   "--runs", "1", "--device", "cpu", "--dir", str(tmp_path), "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())["results"]
    assert [(x["tensors"], x["shards"]) for x in rows] == [(10, 1), (3000, 2)]
    assert all(x["open_s"] > 0 and x["prepare_s"] > 0 and x["batch_s"] > 0 for x in rows)
    each = json.loads(out.read_text())["get_tensor_us"]
    assert set(each) == {"instant_staging", "safetensors"} and min(each.values()) > 0
    r = run_script(os.path.join(ROOT, "benchmarks", "bench_start.py"), "--tensors", "ten")
    assert r.returncode == 2 and "--tensors" in r.stderr


@pytest.mark.slow
def test_profile_remote_quick(tmp_path):
    # The timeline's wrappers name the loader's seams (_remote's private
    # names): a rename that left them stamping nothing fails here.
    pytest.importorskip("obstore")
    pytest.importorskip("moto")
    env = {"CUDA_VISIBLE_DEVICES": ""}
    out = tmp_path / "r.json"
    r = run_script(os.path.join(ROOT, "benchmarks", "profile_remote.py"), "--clouds", "s3",
                   "--layouts", "moe", "--scale", "moe:16", "--device", "cpu", "--repeat", "1",
                   "--ceilings", "threads,copy", "--wider", "2", "--dir", str(tmp_path), "--json", str(out),
                   env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    (res,) = json.loads(out.read_text())["results"]
    (load,) = res["loads"]
    assert load["gets"] >= 1 and load["bytes"] == sum(c["bytes"] for c in res["ceilings"][:1])
    assert load["readers"] >= 1 and 0 < load["mean_in_flight"] <= load["max_in_flight"]
    assert [(c["method"], c["inflight"]) for c in res["ceilings"]] == [
        (f"ceiling {how}", k * load["max_in_flight"]) for how in ("threads", "copy") for k in (1, 2)]
    assert all(c["bytes"] == load["bytes"] for c in res["ceilings"])
    assert "bound (" in r.stdout
    # The what-ifs that put other requests in the read-ahead's place stamp
    # every GET of the load as the loader's own do.
    for requests in ("pool", "loops2"):
        r = run_script(os.path.join(ROOT, "benchmarks", "profile_remote.py"), "--clouds", "s3",
                       "--layouts", "moe", "--scale", "moe:16", "--device", "cpu", "--repeat", "1",
                       "--ceilings", "threads", "--wider", "", "--requests", requests,
                       "--dir", str(tmp_path), "--json", str(out), env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        doc = json.loads(out.read_text())
        (what,) = doc["results"][0]["loads"]
        assert doc["what_if"]["requests"] == requests
        assert what["gets"] == load["gets"] and what["bytes"] == load["bytes"]
