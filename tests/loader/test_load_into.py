"""Reload in place (issue 42): ``Checkpoint.load_into`` and ``load_into``
write each tensor into the caller's tensor (same storage, same
``data_ptr``, nothing of its size allocated); every mismatch is refused
before any byte is written; a failure part-way names what was written and
leaks nothing.  The device path runs on the simulated runtime."""

import os
import threading

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

import instant_staging as ist
from instant_staging.loader import (
    Checkpoint,
    CheckpointChangedError,
    LoadError,
    MissingNameError,
    _given,
    _into,
    _options,
    _prepare,
    _shards,
    empty_cache,
    load_into,
)
from instant_staging.loader._header import TensorEntry
from instant_staging.testing import FaultPlan, SimulatedRuntime

from support import run_child
from support.tensors import (
    CHUNK,
    SimBlock,
    SimTarget,
    mixed_tensors,
    random_tensor,
    raw_bytes,
    save,
    sim_staging,
)


def _zeros_like(tensors):
    return {k: torch.zeros_like(v) for k, v in tensors.items()}


def _snapshot(dests):
    return {k: (v.data_ptr(), v.untyped_storage().data_ptr(), raw_bytes(v).clone())
            for k, v in dests.items()}


def _assert_in_place(dests, before, expected):
    for name, t in dests.items():
        ptr, storage, _ = before[name]
        assert t.data_ptr() == ptr and t.untyped_storage().data_ptr() == storage, name
        assert torch.equal(raw_bytes(t), raw_bytes(expected[name])), name


def _fds():
    return sorted(os.listdir("/proc/self/fd"))


@pytest.fixture
def model(tmp_path):
    tensors = mixed_tensors(seed=3)
    tensors["empty"] = torch.empty(0, 7)
    return save(tmp_path, tensors), tensors


def test_every_tensor_written_in_place(model):
    path, tensors = model
    dests = _zeros_like(tensors)
    before = _snapshot(dests)
    report = load_into(path, dests, chunk_size=CHUNK, threads=2)
    _assert_in_place(dests, before, tensors)
    assert report.tensors == len(tensors) and report.bytes == sum(t.nbytes for t in tensors.values())
    assert report.device == "cpu"


def test_nothing_of_a_tensors_size_is_allocated(model, monkeypatch):
    path, tensors = model
    dests = _zeros_like(tensors)
    smallest = min(t.nbytes for t in tensors.values() if t.nbytes)
    made = []
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        made.append(t.nbytes)
        return t
    monkeypatch.setattr(torch, "empty", empty)
    with Checkpoint.open(path) as ck:
        ck.load_into(dests, chunk_size=CHUNK)
        assert ck.last_report.tensors == len(tensors)
    assert not [n for n in made if n >= smallest], made
    _assert_in_place(dests, _snapshot(dests), tensors)


def test_a_row_plan_writes_a_ranks_rows_into_its_shard(tmp_path):
    full = {"w": torch.randn(64, 300), "b": torch.randn(64), "s": torch.randn(5, 5)}
    path = save(tmp_path, full)
    shard = {"w": torch.zeros(16, 300), "b": torch.zeros(16), "s": torch.zeros(5, 5)}
    before = _snapshot(shard)
    with Checkpoint.open(path) as ck:
        ck.load_into(shard, plan={"w": slice(16, 32), "b": slice(16, 32), "s": None},
                     chunk_size=CHUNK)
        _assert_in_place(shard, before, {"w": full["w"][16:32], "b": full["b"][16:32], "s": full["s"]})
        with pytest.raises(ValueError, match=r"tensors\['w'\] has shape \(16, 300\), the checkpoint's "
                                             r"rows the plan selects \(8, 300\)"):
            ck.load_into({"w": shard["w"]}, plan={"w": slice(0, 8)})


def test_names_select_and_strict_false_skips(tmp_path):
    full = {"a": torch.randn(10), "b": torch.randn(10), "c": torch.randn(10)}
    path = save(tmp_path, full)
    with Checkpoint.open(path) as ck:
        dests = {"a": torch.zeros(10)}
        ck.load_into(dests, names=["a"])
        assert torch.equal(dests["a"], full["a"])
        dests = {"b": torch.zeros(10)}
        ck.load_into(dests, strict=False)
        assert torch.equal(dests["b"], full["b"])
        dests = {"c": torch.zeros(10)}
        ck.load_into(dests, names=lambda n: n == "c")
        assert torch.equal(dests["c"], full["c"])


def _bad_cases(tensors):
    """``(case, tensors to pass, kwargs, error type, message pattern)``."""
    first = next(iter(tensors))
    d = _zeros_like(tensors)
    name32 = next(k for k, v in tensors.items() if v.dtype == torch.float32 and v.dim() == 2
                  and v.shape[0] > 1)
    t = tensors[name32]
    cases = [
        ("missing", {**d, "nope": torch.zeros(3)}, {}, MissingNameError, r"not in the checkpoint.*'nope'"),
        ("unexpected", {k: v for k, v in d.items() if k != first}, {}, ValueError,
         rf"no destination in tensors.*{first!r}"),
        ("not selected", d, {"names": [first]}, ValueError, r"not selected by names="),
        ("unknown in names", {first: d[first]}, {"names": [first, "ghost"]}, KeyError, "ghost"),
        ("dtype", {**d, name32: torch.zeros(t.shape, dtype=torch.float64)}, {}, TypeError,
         rf"tensors\[{name32!r}\] is torch.float64"),
        ("shape", {**d, name32: torch.zeros(t.numel())}, {}, ValueError,
         rf"tensors\[{name32!r}\] has shape"),
        ("non-contiguous", {**d, name32: torch.zeros(tuple(reversed(t.shape))).t()}, {}, ValueError,
         rf"tensors\[{name32!r}\].*not contiguous"),
        ("meta device", {**d, name32: torch.empty(t.shape, device="meta")}, {}, ValueError,
         rf"tensors\[{name32!r}\] is on meta"),
        ("not a tensor", {**d, name32: [0.0]}, {}, TypeError, r"must be a torch.Tensor"),
        ("not a mapping", [d[first]], {}, TypeError, r"tensors must be a mapping"),
        ("process_group", d, {"process_group": object()}, TypeError, r"takes no process_group="),
        ("dtype=", d, {"dtype": torch.float16}, TypeError, r"takes no dtype="),
        ("strict", d, {"strict": 1}, TypeError, r"strict must be a bool"),
        ("names and plan", d, {"names": [first], "plan": {first: None}}, ValueError, "not both"),
    ]
    # two names over one storage (tied weights passed twice)
    shared = torch.zeros(t.numel() * 2, dtype=t.dtype)
    other = next(k for k, v in tensors.items() if k != name32 and v.dtype == t.dtype and v.numel())
    tied = {**d, name32: shared[:t.numel()].view(t.shape),
            other: shared[t.numel() - 1:t.numel() - 1 + tensors[other].numel()].view(tensors[other].shape)}
    cases.append(("shared memory", tied, {}, ValueError, r"share memory"))
    return cases


@pytest.mark.parametrize("door", ["module", "checkpoint"])
def test_every_mismatch_is_refused_before_any_byte_is_written(model, door):
    path, tensors = model
    with Checkpoint.open(path) as ck:
        for case, dests, kwargs, error, pattern in _bad_cases(tensors):
            values = dests.values() if isinstance(dests, dict) else dests
            before = [raw_bytes(v).clone() for v in values
                      if isinstance(v, torch.Tensor) and v.device.type == "cpu"]
            fds = _fds()
            with pytest.raises(error, match=pattern):
                if door == "module":
                    load_into(path, dests, chunk_size=CHUNK, **kwargs)
                else:
                    ck.load_into(dests, chunk_size=CHUNK, **kwargs)
            after = [raw_bytes(v) for v in values
                     if isinstance(v, torch.Tensor) and v.device.type == "cpu"]
            assert all(torch.equal(a, b) for a, b in zip(before, after)), case
            assert _fds() == fds, case


def test_a_missing_name_is_a_key_error_and_a_value_error(model):
    path, _ = model
    with pytest.raises(MissingNameError) as e:
        load_into(path, {"nope": torch.zeros(1)})
    assert isinstance(e.value, KeyError) and isinstance(e.value, ValueError)
    assert str(e.value).startswith("1 tensor(s) of tensors are not in the checkpoint")


def _check_partial(e, tensors, dests, names_in_order):
    # (written: those handed out before the failure; one finished just as
    # it came may be counted unwritten, so none at times)
    assert e.unwritten, (e.written, e.unwritten)
    for part in (e.written, e.unwritten):
        assert part == [n for n in names_in_order if n in set(part)]     # reading order
    assert set(e.written) | set(e.unwritten) == set(dests)
    for name in e.written:
        assert torch.equal(raw_bytes(dests[name]), raw_bytes(tensors[name])), name


def test_a_read_error_part_way_names_the_written_tensors(model, monkeypatch):
    path, tensors = model
    monkeypatch.setenv("INSTANT_STAGING_FAULTS", "read#12=EIO")
    dests = _zeros_like(tensors)
    fds, threads = _fds(), threading.active_count()
    with Checkpoint.open(path) as ck:
        order = ck.names()
        with pytest.raises(LoadError, match=r"Input/output error.*load_into: \d+ of \d+ tensor\(s\) "
                                            r"written before the failure") as e:
            ck.load_into(dests, chunk_size=CHUNK, threads=1)
    _check_partial(e.value, tensors, dests, order)
    assert _fds() == fds and threading.active_count() == threads


def test_a_failure_with_a_simulated_staging_buffer_leaks_nothing(model):
    path, tensors = model
    rt, buf = sim_staging(faults=FaultPlan.parse("read#15=EIO"))
    dests = _zeros_like(tensors)
    with pytest.raises(LoadError) as e:
        load_into(path, dests, staging=buf, chunk_size=CHUNK, threads=1)
    assert e.value.unwritten and len(e.value.written) + len(e.value.unwritten) == len(tensors)
    buf.close()
    assert rt.live_registrations == 0 and rt.live_host_allocs == 0


def test_verify_checks_the_written_bytes(model):
    path, tensors = model
    dests = _zeros_like(tensors)
    load_into(path, dests, verify=True, chunk_size=CHUNK)
    _assert_in_place(dests, _snapshot(dests), tensors)


# -- the device path, on the simulated runtime ------------------------------------

class SimInPlace(SimTarget):
    """The device path writing into given simulated device allocations."""

    def __init__(self, rt, dests):
        super().__init__(rt)
        self.dests = dests

    def allocate(self, entry, dtype):
        block = self.dests[entry.name]
        return (block, entry, dtype), block.ptr

    def joins(self, dtype, views):
        return False


def _device_copy(rt, block, nbytes):
    out = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        assert rt.memcpy_async(out.data_ptr(), block.ptr, nbytes, 2) == 0
    return out


@pytest.mark.parametrize("faults", [None, "copy#12=invalid_value", "read#15=EIO"])
def test_the_device_path_writes_into_the_given_addresses(model, faults):
    path, tensors = model
    rt = SimulatedRuntime()
    staging = ist.StagingBuffer(8 * CHUNK, runtime=rt, segment_size=2 * CHUNK, copy_unit=CHUNK,
                                prefault_threads=0)
    shards = _shards.Shards().open([path])
    blocks = {t.name: SimBlock(rt, t.nbytes) for _, t in shards.entries}
    ptrs = {k: b.ptr for k, b in blocks.items()}
    target = SimInPlace(rt, blocks)
    dtypes = target.dtypes(shards.entries, shards.paths)
    options = _options.LoadOptions(CHUNK, 4, 1, staging=staging, views=False)
    prepared = _prepare.planned(shards, target, dtypes, options, faults and FaultPlan.parse(faults))
    allocs = rt.live_device_allocs
    if faults is None:
        report = _into.write(prepared)
        assert report.tensors == len(tensors)
        written = list(tensors)
    else:
        with pytest.raises(LoadError) as e:
            _into.write(prepared)
        written = e.value.written
        assert e.value.unwritten and len(written) + len(e.value.unwritten) == len(tensors)
    assert rt.live_device_allocs == allocs          # nothing allocated on the "device"
    for name in written:
        assert blocks[name].ptr == ptrs[name]
        got = _device_copy(rt, blocks[name], tensors[name].nbytes)
        assert torch.equal(got, raw_bytes(tensors[name].contiguous())), name
    staging.close()
    assert rt.live_registrations == 0 and rt.live_host_allocs == 0
    assert shards.fds == []


# -- one copy for destinations back to back in one allocation -------------------

def _fine_moe(experts=12):
    """A fine-grained MoE layer: experts of half a chunk each (two fill one),
    a norm before them that shifts every pair by its bytes."""
    tensors = {"a.norm": random_tensor(torch.bfloat16, [64], 0)}
    for e in range(experts):
        tensors[f"b.expert.{e:02d}"] = random_tensor(torch.bfloat16, [CHUNK // 4], e + 1)
    tensors["c.router"] = random_tensor(torch.bfloat16, [3, 40], 99)
    return tensors


def _sim_destinations(rt, shards, how):
    """``({name: ptr}, [SimBlock, ...])`` of the destinations of ``shards``'
    tensors: ``flat``, one allocation holding them all back to back in
    reading order (views of one flat tensor); ``pairs``, as torch's caching
    allocator cuts tensors of 1 MiB two to a segment of 2 MiB in allocation
    order; ``separate``, an allocation each."""
    entries = [t for _, t in shards.entries]
    if how == "flat":
        block = SimBlock(rt, sum(t.nbytes for t in entries))
        ptrs, at = {}, block.ptr
        for t in entries:
            ptrs[t.name], at = at, at + t.nbytes
        return ptrs, [block]
    blocks, ptrs = [], {}
    if how == "pairs":      # (the experts two to an allocation, the others one each)
        halves = [t for t in entries if t.nbytes == CHUNK // 2]
        groups = [halves[k:k + 2] for k in range(0, len(halves), 2)]
        groups += [[t] for t in entries if t.nbytes != CHUNK // 2]
        for group in groups:
            blocks.append(SimBlock(rt, sum(t.nbytes for t in group)))
            at = blocks[-1].ptr
            for t in group:
                ptrs[t.name], at = at, at + t.nbytes
        return ptrs, blocks
    for t in entries:
        blocks.append(SimBlock(rt, t.nbytes))
        ptrs[t.name] = blocks[-1].ptr
    return ptrs, blocks


def _sim_allocation(rt, addresses):
    def allocation(k):
        return next(((p, n) for p, n in rt.device_allocations() if p <= addresses[k] < p + n), None)
    return allocation


class SimAt(SimTarget):
    """The device path writing to given simulated addresses."""

    def __init__(self, rt, ptrs):
        super().__init__(rt)
        self.ptrs = ptrs

    def allocate(self, entry, dtype):
        return entry.name, self.ptrs[entry.name]

    def joins(self, dtype, views):
        return False

    def result(self, handle):
        return handle


def _sim_write(tmp_path, tensors, how, faults=None, merge=True):
    """Writes ``tensors``' file into simulated destinations laid out as
    ``how`` says; ``(runtime, plan, copies, bytes per name, error)``."""
    path = save(tmp_path, tensors)
    rt = SimulatedRuntime()
    staging = ist.StagingBuffer(8 * CHUNK, runtime=rt, segment_size=2 * CHUNK, copy_unit=CHUNK,
                                prefault_threads=0)
    shards = _shards.Shards().open([path])
    ptrs, blocks = _sim_destinations(rt, shards, how)
    target = SimAt(rt, ptrs)
    dtypes = target.dtypes(shards.entries, shards.paths)
    addresses = [ptrs[t.name] for _, t in shards.entries]
    joins = _given.joins(shards.entries, addresses, _sim_allocation(rt, addresses)) if merge else None
    options = _options.LoadOptions(CHUNK, 4, 2, staging=staging, views=False)
    prepared = _prepare.planned(shards, target, dtypes, options, faults and FaultPlan.parse(faults),
                                joins=joins)
    plan = prepared.reads.plan
    allocs, error = rt.live_device_allocs, None
    rt.clear_log()
    try:
        _into.write(prepared)
    except LoadError as e:
        error = e
    assert rt.live_device_allocs == allocs          # nothing allocated on the "device"
    copies = [c for c in rt.calls if c[0] == "memcpy_async" and c[4] == 1]
    got = {n: _device_copy(rt, _At(p), tensors[n].nbytes) for n, p in ptrs.items()}
    staging.close()
    assert rt.live_registrations == 0 and rt.live_host_allocs == 0 and shards.fds == []
    del blocks
    return rt, plan, copies, got, error


class _At:
    def __init__(self, ptr):
        self.ptr = ptr


@pytest.mark.parametrize("how", ["flat", "pairs", "separate"])
def test_destinations_back_to_back_in_one_allocation_take_one_copy(tmp_path, how):
    tensors = _fine_moe()
    _, plan, copies, got, error = _sim_write(tmp_path, tensors, how)
    assert error is None
    for name, ref in tensors.items():
        assert torch.equal(got[name], raw_bytes(ref)), name
    if how == "flat":           # one copy a chunk, as a load_file into its blocks
        assert len(copies) == plan.n_chunks
    elif how == "pairs":        # each pair of experts in one chunk, one copy; the norm, the router
        assert plan.n_chunks == 1 + 6 + 1 and len(copies) == 1 + 6 + 1
    else:                       # an allocation each: a copy each
        assert len(copies) == plan.n_pieces == len(tensors)
    _, _, unmerged, _, _ = _sim_write(tmp_path, tensors, how, merge=False)
    assert len(unmerged) == len(tensors) and len(copies) <= len(unmerged)


def test_a_failure_part_way_through_merged_copies_names_the_written_tensors(tmp_path):
    # Chunks 1-2 written (the norm, experts 0-1 in one copy), chunk 3 (experts
    # 2-3, one copy) fails to read: both its tensors unwritten, as all after.
    tensors = _fine_moe()
    names = list(tensors)
    _, plan, _, got, error = _sim_write(tmp_path, tensors, "pairs", faults="read#3=EIO")
    assert isinstance(error, LoadError) and plan.n_chunks == 8
    assert set(error.written) <= set(names[:3]) and "b.expert.02" in error.unwritten
    assert error.written + error.unwritten == [n for n in names if n in error.written] + [
        n for n in names if n in error.unwritten]
    assert set(error.written) | set(error.unwritten) == set(names)
    for name in error.written:
        assert torch.equal(got[name], raw_bytes(tensors[name])), name


def test_a_copy_fault_in_a_merged_group_fails_its_chunk(tmp_path):
    # copy#3 is expert 1's piece: the copy of expert 0 stops before it, and
    # neither is written (their chunk never completed).
    tensors = _fine_moe()
    _, _, _, got, error = _sim_write(tmp_path, tensors, "flat", faults="copy#3=invalid_value")
    assert isinstance(error, LoadError) and "memcpy_async" in str(error)
    assert {"b.expert.00", "b.expert.01"} <= set(error.unwritten)
    for name in error.written:
        assert torch.equal(got[name], raw_bytes(tensors[name])), name


def E(name, begin, end, dtype="U8"):
    """An entry of ``end - begin`` bytes (``(end - begin,)`` U8: one a byte)."""
    return TensorEntry(name, dtype, (end - begin,), begin, end)


def test_joins_need_both_file_and_allocation_back_to_back():
    flat = torch.zeros(64, dtype=torch.uint8)
    other = torch.zeros(16, dtype=torch.uint8)
    dests = {"a": flat[:16], "b": flat[16:32], "c": flat[32:48], "d": other, "e": flat[48:64],
             "z": flat[48:48]}
    target = _into.InPlace(torch, torch.device("cpu"), dests)

    def joins(entries):         # (the destinations' allocations: their storages)
        return target.place(entries, [torch.uint8] * len(entries), ["0", "1"])
    entries = [(0, E("a", 0, 16)), (0, E("b", 16, 32)), (0, E("z", 32, 32)), (0, E("c", 32, 48)),
               (1, E("e", 48, 64)), (1, E("d", 64, 80))]
    # b follows a; c follows b in memory and file, but the empty z between
    # them ends the group; e is in another file; d in another allocation.
    assert joins(entries) == [False, True, False, False, False, False]
    entries = [(0, E("a", 0, 16)), (0, E("b", 16, 32)), (0, E("c", 32, 48)), (0, E("e", 48, 64))]
    assert joins(entries) == [False, True, True, True]
    assert target.placed() == ([dests[n] for n in "abce"], [dests[n].data_ptr() for n in "abce"])
    entries[2] = (0, E("c", 33, 49))    # a gap in the file
    assert joins(entries)[2:] == [False, False]


def test_a_load_into_views_of_one_flat_tensor_is_exact(model):
    path, tensors = model
    flat = torch.zeros(sum(t.nbytes for t in tensors.values()), dtype=torch.uint8)
    dests, at = {}, 0
    with Checkpoint.open(path) as ck:
        for name in ck.names():     # (reading order)
            t = tensors[name]
            dests[name] = flat[at:at + t.nbytes].view(t.dtype).view(t.shape)
            at += t.nbytes
        ck.load_into(dests, chunk_size=CHUNK, threads=2)
    for name, t in tensors.items():
        assert torch.equal(raw_bytes(dests[name]), raw_bytes(t)), name


# -- a remote object that changed, Ctrl-C -----------------------------------------

def test_an_interrupt_part_way_names_the_written_tensors_and_leaks_nothing(tmp_path):
    tensors = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(16)}
    path = save(tmp_path, tensors)
    child = run_child(f"""
        import os, signal, threading, torch
        from instant_staging.loader import Checkpoint
        names = [f"t{{i}}" for i in range(16)]
        dests = {{n: torch.zeros(1 << 20) for n in names}}
        fds = sorted(os.listdir("/proc/self/fd"))
        threads = threading.active_count()
        seen = []
        def progress(done, total):
            # A Ctrl-C in the consumer's thread, raised where the handler
            # would raise it (a signal sent here landed after the load's end
            # on a loaded 2-core host): at the first report part-way.
            seen.append(done)
            if 0 < done < total:
                raise KeyboardInterrupt
        try:
            with Checkpoint.open({path!r}) as ck:
                ck.load_into(dests, chunk_size=64 * 1024, threads=1, progress=progress)
        except KeyboardInterrupt as e:
            ok = all(torch.equal(dests[n], torch.full((1 << 20,), float(n[1:]))) for n in e.written)
            print("interrupted", len(e.written), len(e.unwritten), ok,
                  sorted(os.listdir("/proc/self/fd")) == fds, threading.active_count() == threads)
        else:
            print("finished")
    """)
    assert child.returncode == 0, child.stderr
    words = child.stdout.split()
    assert words[0] == "interrupted", child.stdout
    # (the tensors finished by then may not all be handed out yet: none, at times)
    assert int(words[2]) > 0 and int(words[1]) + int(words[2]) == 16
    assert words[3:] == ["True", "True", "True"], child.stdout


def test_a_remote_object_that_changed_names_the_written_tensors(tmp_path):
    pytest.importorskip("obstore")
    from instant_staging.loader import RemoteChangedError

    from support.remote_servers import RangeHTTPServer

    def model(value):
        return {f"t{i}": torch.full((16 * 1024,), float(value * 100 + i)) for i in range(8)}
    root = tmp_path / "root"
    root.mkdir()
    path = str(root / "model.safetensors")
    st.save_file(model(1), path)
    with RangeHTTPServer(root) as server:
        seen = []
        later = os.stat(path).st_mtime_ns + 5 * 10**9

        def hook(request):
            if request.method == "GET" and request.range and not request.range.startswith("bytes=0-"):
                seen.append(request)
                if len(seen) == 3:
                    st.save_file(model(2), path)
                    os.utime(path, ns=(later, later))
        server.ignore_if_match = True
        server.on_request = hook
        dests = {f"t{i}": torch.zeros(16 * 1024) for i in range(8)}
        with pytest.raises(RemoteChangedError, match="changed while it was loaded") as e:
            load_into(server.url_for("model.safetensors"), dests, chunk_size=64 * 1024, threads=1)
    assert e.value.unwritten and len(e.value.written) + len(e.value.unwritten) == 8
    for name in e.value.written:
        assert torch.equal(dests[name], model(1)[name]), name


@pytest.mark.gpu
def test_gpu_and_pinned_destinations(tmp_path):
    tensors = {**mixed_tensors(seed=5), "big": torch.randn(2048, 1024)}      # 8 MiB
    path = save(tmp_path, tensors)
    empty_cache()
    for device in ("cuda", "pinned"):
        if device == "cuda":
            dests = {k: v.to("cuda") for k, v in _zeros_like(tensors).items()}
        else:
            dests = {k: v.pin_memory() for k, v in _zeros_like(tensors).items()}
        before = {k: v.data_ptr() for k, v in dests.items()}
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_stats()["allocated_bytes.all.current"]
        load_into(path, dests, chunk_size=CHUNK)
        peak = torch.cuda.memory_stats()["allocated_bytes.all.peak"] - base
        assert peak < (1 << 20), peak          # nothing of "big"'s size on the device
        for k, v in dests.items():
            assert v.data_ptr() == before[k]
            assert torch.equal(raw_bytes(v.cpu()), raw_bytes(tensors[k])), k
    with pytest.raises(ValueError, match="one load writes to one device"):
        load_into(path, {**_zeros_like(tensors), next(iter(tensors)): torch.zeros(1, device="cuda")})


# -- a file copied over between two loads (issue 53) -------------------------------

def _copy_over(path, tensors):
    """Writes ``tensors`` over ``path`` as ``cp`` does (the same inode,
    truncated and rewritten), its modification time moved on for sure."""
    other = path + ".next"
    st.save_file(tensors, other)
    before = os.stat(path)
    with open(other, "rb") as src, open(path, "r+b") as dst:
        dst.truncate(0)
        dst.write(src.read())
    os.unlink(other)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    assert os.stat(path).st_ino == before.st_ino


def test_a_file_copied_over_is_refused_before_any_byte_and_reopen_recovers(tmp_path):
    # A server keeps the checkpoint open; the trainer cps its next step over
    # it: the header opened no longer describes the file.  The next load
    # writes nothing (the model keeps its weights) and says to reopen.
    step1 = {"a": torch.full((300,), 1.0), "b": torch.full((7, 9), 1.0, dtype=torch.bfloat16)}
    step2 = {"a": torch.full((300,), 2.0), "z": torch.zeros(5),
             "b": torch.full((7, 9), 2.0, dtype=torch.bfloat16)}    # (other offsets)
    path = save(tmp_path, step1)
    dests = _zeros_like(step1)
    ck = Checkpoint.open(path)
    ck.load_into(dests)
    _copy_over(path, step2)
    before = _snapshot(dests)
    for _ in range(2):              # the same each time until reopened
        with pytest.raises(CheckpointChangedError, match=r"reopen the checkpoint") as e:
            ck.load_into(dests, chunk_size=CHUNK, threads=2)
        assert isinstance(e.value, LoadError) and e.value.path == path
        _assert_in_place(dests, before, step1)
    for door in (lambda: ck.load("cpu"), lambda: list(ck.iter_load("cpu"))):
        with pytest.raises(CheckpointChangedError, match=r"written to since the checkpoint was opened"):
            door()
    fds = _fds()
    new = ck.reopen()
    assert ck.closed and not new.closed and new.files == ck.files
    new.load_into(dests, strict=False)
    _assert_in_place(dests, before, {n: step2[n] for n in dests})
    new.close()
    assert len(_fds()) <= len(fds)


def test_a_reopen_that_fails_leaves_the_checkpoint_open(tmp_path):
    path = save(tmp_path, {"a": torch.ones(4)})
    with Checkpoint.open([path]) as ck:
        os.rename(path, path + ".gone")
        with pytest.raises(FileNotFoundError):
            ck.reopen()
        assert not ck.closed and torch.equal(ck.load()["a"], torch.ones(4))


# -- autograd: a reload is an in-place write (issue 53) ------------------------------

def _forward(model):
    """A loss whose backward needs the weight as it was (saved by the square)."""
    return model(torch.ones(1, 6)).sum() + (model.weight ** 2).sum()


@pytest.mark.parametrize("fallback", [False, True])
def test_a_reload_between_forward_and_backward_makes_backward_raise(tmp_path, monkeypatch, fallback):
    # As load_state_dict's copy_ does: the backward would otherwise mix the
    # old weights' activations with the new weights, silently.
    if fallback:        # torch whose increment_version takes one tensor at a time
        from torch.autograd import graph
        real = graph.increment_version

        def one_at_a_time(t):
            if not isinstance(t, torch.Tensor):
                raise TypeError("a list")
            real(t)
        monkeypatch.setattr(graph, "increment_version", one_at_a_time)
    model = torch.nn.Linear(6, 4)
    path = save(tmp_path, {k: v.detach().clone() + 1 for k, v in model.state_dict().items()})
    loss = _forward(model)
    model.load_state_dict(st.load_file(path))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    versions = {k: v._version for k, v in model.state_dict().items()}
    loss = _forward(model)
    with Checkpoint.open(path) as ck:
        ck.load_into(model.state_dict())
    assert all(v._version > versions[k] for k, v in model.state_dict().items())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    _forward(model).backward()      # a forward after the reload: fine
    # a load that fails part-way bumps them too (some bytes may be new)
    versions = {k: v._version for k, v in model.state_dict().items()}
    monkeypatch.setenv("INSTANT_STAGING_FAULTS", "read#1=EIO")
    with pytest.raises(LoadError):
        load_into(path, model.state_dict())
    assert all(v._version > versions[k] for k, v in model.state_dict().items())


# -- what a mutation run found untested (issue 53) -----------------------------------

def test_a_merged_copy_never_runs_into_the_next_allocation():
    # Two allocations back to back in memory (the caching allocator's
    # segments may be): a tensor following in the file and in memory, but
    # in the next allocation, starts a copy of its own.
    addresses = [1000, 1016, 1032, 1048]
    allocations = [(1000, 32), (1000, 32), (1032, 32), (1032, 32)]
    entries = [(0, E(n, 16 * k, 16 * k + 16)) for k, n in enumerate("abcd")]
    assert _given.joins(entries, addresses, allocations.__getitem__) == [False, True, False, True]
    # d only partly inside c's allocation: no join either
    allocations = [(1000, 32), (1000, 32), (1032, 24), (1032, 24)]
    assert _given.joins(entries, addresses, allocations.__getitem__) == [False, True, False, False]


def test_written_is_in_reading_order_whatever_the_finishing_order():
    error = LoadError("boom")
    _into._name_written(error, ["d", "a", "c"], ["a", "b", "c", "d", "e"])
    assert error.written == ["a", "c", "d"] and error.unwritten == ["b", "e"]
    assert "3 of 5 tensor(s) written before the failure ('a', 'c', 'd')" in str(error)


def test_the_module_level_load_into_takes_strict_false(tmp_path):
    full = {"a": torch.randn(10), "b": torch.randn(10)}
    path = save(tmp_path, full)
    dests = {"b": torch.zeros(10)}
    with pytest.raises(ValueError, match="strict=False skips them"):
        load_into(path, dests)
    report = load_into(path, dests, strict=False)
    assert torch.equal(dests["b"], full["b"]) and report.tensors == 1


# -- the destinations walked in C (issue 54, 4) ------------------------------------

def test_tied_names_are_named_in_order_whatever_the_mapping_order():
    # The pair an overlap names is the first of the spans sorted by (start,
    # end, name), the mapping's order aside; spans out of address order are
    # sorted before they are compared.
    flat = torch.zeros(64)
    for order in ("xyz", "zyx", "yzx"):
        dests = {"y": flat[:16], "x": flat[:16], "z": flat[40:48]}
        dests = {n: dests[n] for n in order}
        with pytest.raises(ValueError, match=r"tensors\['x'\] and tensors\['y'\] share memory"):
            _into.check_destinations(dests)
    dests = {"c": flat[40:48], "a": flat[:16], "b": flat[15:20]}
    with pytest.raises(ValueError, match=r"tensors\['a'\] and tensors\['b'\] share memory"):
        _into.check_destinations(dests)
    dests = {"c": flat[40:48], "a": flat[:16], "b": flat[16:20], "e": flat[0:0]}
    assert _into.check_destinations(dests)[2] == dests      # back to back, and an empty one


def test_a_packed_dtype_is_checked_against_its_torch_shape():
    # F4: torch's tensor holds two elements a byte along the last dimension.
    target = _into.InPlace(torch, torch.device("cpu"),
                           {"w": torch.empty((4, 4), dtype=torch.float4_e2m1fn_x2)})
    entries = [(0, E("w", 0, 16, "F4")._replace(shape=(4, 8)))]
    assert target.place(entries, [torch.float4_e2m1fn_x2], ["f"]) == [False]
    target.dests["w"] = torch.empty((4, 8), dtype=torch.float4_e2m1fn_x2)    # the file's shape
    with pytest.raises(ValueError, match=r"tensors\['w'\] has shape \(4, 8\), the checkpoint's "
                                         r"tensor \(4, 4\) \(f\)"):
        target.place(entries, [torch.float4_e2m1fn_x2], ["f"])


def test_allocations_ask_the_driver_in_c_and_the_storage_once_it_cannot_say():
    import ctypes
    flat = torch.zeros(64, dtype=torch.uint8)
    tensors = [flat[:16], flat[16:32], flat[32:48]]
    addresses = [t.data_ptr() for t in tensors]
    asked = []

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_uint64),
                      ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64)
    def driver(base, size, ptr):
        asked.append(ptr)
        if len(asked) > 1:
            return 201              # (CUDA_ERROR_INVALID_CONTEXT)
        base[0], size[0] = ptr - 5, 7
        return 0
    found = _given.Allocations(tensors, addresses, ctypes.cast(driver, ctypes.c_void_p).value)
    assert found(1) == (addresses[1] - 5, 7) and asked == [addresses[1]]
    storage = (flat.untyped_storage().data_ptr(), flat.untyped_storage().nbytes())
    assert found(2) == storage and asked == [addresses[1], addresses[2]]
    assert found(0) == storage and len(asked) == 2      # (the driver no longer asked)
    with pytest.raises(IndexError):
        found(3)
    # joins asks it for a group's first destination: a's allocation (the
    # driver's 7 bytes) does not hold b, so b starts a group of its own;
    # b's (the storage: the driver failed) holds c
    asked.clear()
    entries = [(0, E(n, 16 * k, 16 * k + 16)) for k, n in enumerate("abc")]
    found = _given.Allocations(tensors, addresses, ctypes.cast(driver, ctypes.c_void_p).value)
    assert _given.joins(entries, addresses, found) == [False, False, True]
    assert asked == [addresses[0], addresses[1]]
