"""Views into device blocks (loader/_blocks.pyx) and the staging buffer made
beside the load's start (loader/_run.py's _StagingStart).

The device path runs on the simulated runtime through test_loader's
SimTarget: blocks are its device allocations, so a copy that strays out of
its block, or spans two registrations, fails as on the real driver.  Every
result is compared bit for bit with safetensors' own load, views against
tensors of their own, on small copies of the layouts that lost to
per-tensor copies (a MoE shard, an AWQ checkpoint) and on files whose
offsets forbid views.
"""

import gc
import os
import struct
import textwrap

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

import instant_staging as ist
from instant_staging.loader import (
    LoadOptions,
    TensorInfo,
    _blocks,
    _entries,
    _prepare,
    _run,
    _shards,
    _staging_pool,
    empty_cache,
)
from instant_staging.loader._header import TensorEntry
from instant_staging.loader._target import _TorchTarget
from instant_staging.testing import FaultPlan, SimulatedRuntime

from support import KIND_FAULTS, TESTS, run_child
from support.tensors import CHUNK, SimBlock, SimTarget, assert_same, random_tensor, save

# -- the layouts, small -----------------------------------------------------------

def moe_tensors(layers=2, experts=8, hidden=64, ffn=48):
    """A MoE shard's names and shapes (bench_load's moe_layout, shrunk)."""
    out, seed = {}, 0
    for i in range(layers):
        p = f"model.layers.{i}."
        for e in range(experts):
            for m, shape in (("gate_proj", [ffn, hidden]), ("up_proj", [ffn, hidden]),
                             ("down_proj", [hidden, ffn])):
                out[f"{p}mlp.experts.{e}.{m}.weight"] = random_tensor(torch.bfloat16, shape, seed)
                seed += 1
        out[p + "mlp.gate.weight"] = random_tensor(torch.bfloat16, [experts, hidden], seed)
        out[p + "input_layernorm.weight"] = random_tensor(torch.bfloat16, [hidden], seed + 1)
        seed += 2
    return out


def awq_tensors(layers=2, hidden=256, ffn=512, group=128):
    """An AWQ checkpoint's tensors: I32 qweight/qzeros, F16 scales, F16 norms."""
    out, seed = {}, 100
    for i in range(layers):
        p = f"model.layers.{i}."
        for m, (k, n) in (("self_attn.q_proj", (hidden, hidden)), ("mlp.up_proj", (hidden, ffn)),
                          ("mlp.down_proj", (ffn, hidden))):
            out[f"{p}{m}.qweight"] = random_tensor(torch.int32, [k, n // 8], seed)
            out[f"{p}{m}.qzeros"] = random_tensor(torch.int32, [k // group, n // 8], seed + 1)
            out[f"{p}{m}.scales"] = random_tensor(torch.float16, [k // group, n], seed + 2)
            seed += 3
        out[p + "input_layernorm.weight"] = random_tensor(torch.float16, [hidden], seed)
        seed += 1
    out["model.embed_tokens.weight"] = random_tensor(torch.float16, [97, hidden], seed)
    return out


def odd_tensors():
    """Offsets that forbid views of one block: odd byte counts before
    wider dtypes (safetensors writes them back to back, unaligned)."""
    return {"a.bytes": random_tensor(torch.uint8, [3], 1), "b.half": random_tensor(torch.float16, [5], 2),
            "c.int": random_tensor(torch.int32, [7], 3), "d.double": random_tensor(torch.float64, [9], 4),
            "e.flag": random_tensor(torch.bool, [1], 5), "f.empty": torch.empty(0, dtype=torch.float32),
            "g.wide": random_tensor(torch.bfloat16, [3, 300], 6)}


def write_unsorted(tmp_path, tensors, name="odd.safetensors"):
    """A valid file with the tensors in the given order (safetensors' own
    writer sorts them by dtype, which keeps most offsets aligned)."""
    import json
    header, data = {}, b""
    for n, t in tensors.items():
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[n] = {"dtype": _DT[t.dtype], "shape": list(t.shape),
                     "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    path = str(tmp_path / name)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)
    return path


_DT = {torch.uint8: "U8", torch.float16: "F16", torch.int32: "I32", torch.float64: "F64",
       torch.bool: "BOOL", torch.float32: "F32", torch.bfloat16: "BF16"}


# -- loading on the simulated device ------------------------------------------

@pytest.fixture
def sim_pool(monkeypatch):
    """The loads' own staging buffers made on one simulated runtime."""
    made = []
    state = {"rt": SimulatedRuntime()}

    def make_staging(size, segment):
        buf = ist.StagingBuffer(size, runtime=state["rt"], segment_size=state.get("segment", segment),
                                prefault_threads=0, allow_pageable=state.get("pageable", False))
        made.append(buf)
        return buf
    monkeypatch.setattr(_staging_pool, "_make", make_staging)
    empty_cache()
    yield state, made
    empty_cache()


def begin_device_load(paths, rt, *, views=True, staging=None, faults=None,
                      names=None, chunk=CHUNK, threads=3, target_type=None, verify=True):
    """iter_load's single path on the simulated device, up to its iterator:
    the plan and its runs, and the staging buffer started beside it (none
    where ``staging`` is given).  Returns ``(LoadIterator, its ReadPlan,
    the checkpoint)``."""
    checkpoint = _shards.Shards().open(paths if isinstance(paths, list) else [paths])
    checkpoint.select(names)
    target = (target_type or SimTarget)(rt)
    dtypes = [target.check(t, checkpoint.paths[i]) for i, t in checkpoint.entries]
    options = LoadOptions(chunk, 4, threads, staging=staging, verify=verify,
                          views=views)
    prepared = _prepare.planned(checkpoint, target, dtypes, options,
                                faults and FaultPlan.parse(faults))
    return _run.LoadIterator(prepared), prepared.reads, checkpoint


def device_load(paths, rt, **kw):
    """The same load, consumed: ``({name: CPU copy}, its _Start)``."""
    it, start, _ = begin_device_load(paths, rt, **kw)
    with it:
        out = dict(it)          # SimTarget.result: CPU copies of the device bytes
    return out, start


def copies(rt):
    return [c for c in rt.calls if c[0] == "memcpy_async" and c[4] == 1]


@pytest.mark.parametrize("layout", [moe_tensors, awq_tensors], ids=["moe", "awq"])
def test_views_equal_safetensors_and_copy_once_per_chunk(tmp_path, sim_pool, layout):
    state, _ = sim_pool
    tensors = layout()
    path = save(tmp_path, tensors)
    expected = st.load_file(path)
    rt = state["rt"]
    per_tensor, _ = device_load(path, rt, views=False)
    n_per_tensor = len(copies(rt))
    rt.clear_log()
    loaded, start = device_load(path, rt)
    assert_same(loaded, expected)
    assert_same(per_tensor, expected)
    assert [r.block for r in start.runs] == [True]          # one file, back to back: one block
    assert len(copies(rt)) == start.plan.n_chunks < n_per_tensor
    assert rt.live_device_allocs == 0                        # every block freed with its views
    empty_cache()
    assert rt.live_registrations == 0 and rt.live_host_allocs == 0


def test_offsets_that_forbid_views_start_new_blocks(tmp_path, sim_pool):
    state, _ = sim_pool
    tensors = odd_tensors()
    path = write_unsorted(tmp_path, tensors)
    expected = st.load_file(path)
    loaded, start = device_load(path, state["rt"])
    assert_same(loaded, expected)
    blocks = [r for r in start.runs if r.block]
    assert len(blocks) > 1
    entries = [t for _, t in start_entries(path)]
    for r in blocks:        # every view sits at a multiple of ALIGN in its block
        assert all((t.begin - r.begin) % _blocks.ALIGN == 0 for t in entries[r.first:r.stop])
    entries = start_entries(path)
    assert [entries[r.first][1].name for r in start.runs if not r.block] == ["f.empty"]


def _runs_as_python(entries, joins):
    # The rule as it was written in Python before it moved to C
    # (loader/_blocks.pyx): the reference the C loop is held to.
    out, run = [], None

    def close(stop):
        first, _, begin, end = run
        out.append(_blocks.Run(first, stop, begin, end - begin, True))

    for k, (i, t) in enumerate(entries):
        view = joins[k] and t.end > t.begin
        if run is not None and not (view and i == run[1] and t.begin == run[3]
                                    and (t.begin - run[2]) % _blocks.ALIGN == 0):
            close(k)
            run = None
        if not view:
            out.append(_blocks.Run(k, k + 1, t.begin, t.end - t.begin, False))
        elif run is None:
            run = [k, i, t.begin, t.end]
        else:
            run[3] = t.end
    if run is not None:
        close(len(entries))
    return out


@settings(max_examples=300, deadline=None)
@given(hs.lists(hs.tuples(hs.integers(0, 2), hs.sampled_from([0, 1, 2, 8, 16, 24, 48, 4096]),
                          hs.integers(0, 40), hs.booleans()), max_size=40))
def test_runs_in_c_follow_the_rule_as_written(layout):
    # Files in order, each tensor after a gap (0: back to back) of nbytes,
    # viewable or not by its dtype: blocks break at a file, a gap, a
    # misaligned offset, an empty or unviewable tensor, as the rule says.
    entries, joins, pos, last = [], [], 0, None
    for k, (file_step, nbytes, gap, view) in enumerate(layout):
        file = (last or 0) + (file_step > 1)
        if file != last:
            pos = 8
        pos += gap
        entries.append((file, TensorEntry(f"t{k}", "U8", (nbytes,), pos, pos + nbytes)))
        joins.append(view)
        pos += nbytes
        last = file
    got = _blocks.runs(entries, joins)
    assert got == _runs_as_python(entries, joins)
    assert all(type(r) is _blocks.Run and type(r.block) is bool for r in got)
    assert not any(gc.is_tracked(r) for r in got)      # (loader/_tuples.pxd)
    assert _blocks.joined(got) == [k > r.first for r in got for k in range(r.first, r.stop)]
    with pytest.raises(ValueError, match="joins for"):
        _blocks.runs(entries, joins + [True])


@settings(max_examples=200, deadline=None)
@given(hs.lists(hs.tuples(hs.integers(0, 3), hs.sampled_from(["BF16", "F32", "U8", "I64"]),
                          hs.sampled_from([0, 1, 8, 4096])), max_size=30),
       hs.sets(hs.sampled_from(["BF16", "F32", "U8", "I64"])))
def test_entry_columns_in_c_equal_the_python_loops(layout, known_dtypes):
    # _entries.pyx: the columns a load takes of its entries, as the loops
    # it replaced wrote them; miss() asked for every tensor without bytes
    # and once for each dtype not yet known (it adds it, as check() does).
    entries, pos = [], 8
    for k, (file, dtype, nbytes) in enumerate(layout):
        entries.append((file, TensorEntry(f"t{k}", dtype, (nbytes,), pos, pos + nbytes)))
        pos += nbytes
    fds = [100, 101, 102, 103]
    assert _entries.names(entries) == [t.name for _, t in entries]
    ranges = _entries.ranges(entries, fds)
    assert ranges == [(fds[i], t.begin, t.end) for i, t in entries]
    assert not any(gc.is_tracked(r) for r in ranges)
    known = {d: f"torch.{d}" for d in known_dtypes}
    asked = []

    def miss(k):
        asked.append(k)
        dtype = entries[k][1].dtype
        known[dtype] = f"torch.{dtype}"
        return known[dtype]

    expected_asks, seen = [], set(known_dtypes)
    for k, (_, t) in enumerate(entries):
        if t.end == t.begin or t.dtype not in seen:
            expected_asks.append(k)
            seen.add(t.dtype)
    assert _entries.dtypes(entries, known, miss) == [f"torch.{t.dtype}" for _, t in entries]
    assert asked == expected_asks
    paths = ["a", "b", "c", "d"]
    infos = _entries.infos(entries, paths, TensorInfo)
    assert infos == {t.name: TensorInfo(t.name, t.dtype, t.shape, t.nbytes, paths[i])
                     for i, t in entries}
    assert all(type(v) is TensorInfo and not gc.is_tracked(v) for v in infos.values())
    with pytest.raises(TypeError, match="five fields"):
        _entries.infos(entries, paths, tuple)


def start_entries(path):
    ck = _shards.Shards().open([path])
    try:
        return ck.entries
    finally:
        ck.close()


def test_a_names_gap_splits_the_block_and_reads_only_the_selected(tmp_path, sim_pool):
    state, _ = sim_pool
    tensors = moe_tensors()
    path = save(tmp_path, tensors)
    keep = sorted(tensors)[::3]
    loaded, start = device_load(path, state["rt"], names=keep)
    assert_same(loaded, {n: tensors[n] for n in keep})
    assert len(start.runs) > 1 and all(r.block for r in start.runs)
    assert start.plan.total_bytes == sum(tensors[n].nbytes for n in keep)


def test_shards_get_a_block_each(tmp_path, sim_pool):
    state, _ = sim_pool
    tensors = awq_tensors()
    names = sorted(tensors)
    paths = [save(tmp_path, {n: tensors[n] for n in names[:7]}, "a.safetensors"),
             save(tmp_path, {n: tensors[n] for n in names[7:]}, "b.safetensors")]
    loaded, start = device_load(paths, state["rt"])
    assert_same(loaded, tensors)
    assert len(start.runs) == 2


def test_faults_fail_the_same_piece_with_views(tmp_path, sim_pool):
    state, _ = sim_pool
    path = save(tmp_path, moe_tensors())
    rt = state["rt"]
    from instant_staging.loader import LoadError
    for spec in ("copy#3=invalid_value", "read#2=EIO", "read#4=short"):
        with pytest.raises(LoadError):
            device_load(path, rt, faults=spec)
        gc.collect()
        assert rt.live_device_allocs == 0, spec
    empty_cache()
    assert rt.live_registrations == 0


class BackToBack(SimTarget):
    """Tensors of their own that happen to lie back to back in device
    memory (one simulated allocation carved in reading order, as two
    cudaMalloc's may follow each other)."""

    def __init__(self, rt):
        super().__init__(rt)
        self.pool, self.used = SimBlock(rt, 1 << 20), 0

    def allocate(self, entry, dtype):
        ptr, self.used = self.pool.ptr + self.used, self.used + entry.nbytes
        assert self.used <= self.pool.nbytes
        return (self.pool, entry, dtype, ptr - self.pool.ptr), ptr


def test_tensors_of_their_own_are_never_one_copy_even_back_to_back(tmp_path, sim_pool):
    # Only the tensors of one block are joined into one copy: two
    # allocations that merely follow each other are copied apart (a copy
    # spanning two allocations is no valid range for the driver).
    state, _ = sim_pool
    rt = state["rt"]
    tensors = moe_tensors()
    path = save(tmp_path, tensors)
    loaded, start = device_load(path, rt, views=False, target_type=BackToBack, chunk=1 << 14)
    assert_same(loaded, st.load_file(path))
    assert len(copies(rt)) == start.plan.n_pieces > start.plan.n_chunks


# -- the staging buffer made beside the start ----------------------------------

class ViewsInterrupted(SimTarget):
    """Ctrl-C while the views of a block are made, once the readers have
    its addresses."""

    def views(self, run, block, entries, dtypes):
        raise KeyboardInterrupt


def test_a_ctrl_c_while_the_views_are_made_keeps_the_block_until_the_readers_stop(
        tmp_path, monkeypatch):
    # The readers may copy into a block from its first address on: whatever
    # ends the load, the block lives until they are joined (a block freed
    # before would be memory torch can hand to another tensor while our
    # copies still write it).
    from instant_staging.loader import _pipeline
    rt = SimulatedRuntime()
    alive_at_join = []

    class Recording(_pipeline.Pipeline):
        def close(self):
            if not alive_at_join:
                alive_at_join.append(rt.live_device_allocs)
            super().close()
    monkeypatch.setattr(_pipeline, "Pipeline", Recording)
    path = save(tmp_path, moe_tensors())
    buf = ist.StagingBuffer(8 * CHUNK, runtime=rt, segment_size=2 * CHUNK, prefault_threads=0)
    it, start, _ = begin_device_load(path, rt, staging=buf, threads=1,
                                     target_type=ViewsInterrupted, verify=False)
    assert [r.block for r in start.runs] == [True]
    with pytest.raises(KeyboardInterrupt):
        next(it)
    assert alive_at_join == [1]                 # the block, at the readers' join
    gc.collect()
    assert rt.live_device_allocs == 0
    assert not [c for c in rt.calls if c[0] == "memcpy_async" and c[-1] != 0]
    buf.close()
    assert rt.live_registrations == 0


def registered_at_each_copy(rt):
    """Replays the runtime's log: every host-to-device copy's source lies in
    a live registration or runtime allocation when it is issued (a copy
    from memory not yet registered would be pageable: slow, and not what
    the load made)."""
    live = {}
    for call in rt.calls:
        op = call[0]
        if op == "host_register" and call[-1] == 0:
            live[call[1]] = call[2]
        elif op == "host_unregister" and call[-1] == 0:
            live.pop(call[1], None)
        elif op == "host_alloc" and call[-1] == 0:
            live[call[3]] = call[1]
        elif op == "free_host" and call[-1] == 0:
            live.pop(call[1], None)
        elif op == "memcpy_async" and call[4] == 1 and call[3]:
            src, size = call[2], call[3]
            assert any(s <= src and src + size <= s + n for s, n in live.items()), call
    return True


@pytest.mark.parametrize("kind", list(KIND_FAULTS))
def test_staging_start_under_each_fault_plan(tmp_path, sim_pool, kind):
    state, made = sim_pool
    faults = KIND_FAULTS[kind]
    rt = state["rt"] = SimulatedRuntime(faults=faults)
    state["pageable"] = kind == "PAGEABLE"
    state["segment"] = 2 * CHUNK            # registrations of two slots: SEGMENTED reachable
    tensors = moe_tensors()
    path = save(tmp_path, tensors)
    loaded, _ = device_load(path, rt)
    assert_same(loaded, st.load_file(path))
    assert made and made[0].kind is ist.Kind[kind]
    if kind != "PAGEABLE":
        assert registered_at_each_copy(rt)
    empty_cache()
    assert rt.live_registrations == 0 and rt.live_host_allocs == 0 and rt.live_device_allocs == 0


def test_staging_start_that_fails_raises_from_the_load_and_leaks_nothing(tmp_path, sim_pool):
    state, _ = sim_pool
    rt = state["rt"] = SimulatedRuntime(faults="register=invalid_value;host_alloc=memory_allocation")
    path = save(tmp_path, moe_tensors())
    with pytest.raises(ist.StagingError, match="register at 0 failed"):
        device_load(path, rt)
    gc.collect()
    assert rt.live_registrations == 0 and rt.live_host_allocs == 0 and rt.live_device_allocs == 0


def test_rollback_failure_in_the_staging_start_is_the_loads_error(tmp_path, sim_pool):
    state, _ = sim_pool
    rt = state["rt"] = SimulatedRuntime(
        faults="register#1=invalid_value;register#3=invalid_value;unregister#1=invalid_value")
    state["segment"] = 2 * CHUNK
    path = save(tmp_path, moe_tensors())
    with pytest.raises(ist.RollbackError):
        device_load(path, rt)
    gc.collect()
    assert rt.live_device_allocs == 0


@pytest.mark.parametrize("how", ["close", "drop"])
def test_a_load_never_iterated_gives_the_buffer_being_made_back(tmp_path, sim_pool, how):
    state, made = sim_pool
    rt = state["rt"]
    path = save(tmp_path, moe_tensors())
    it, _, checkpoint = begin_device_load(path, rt, threads=2, verify=False)
    if how == "close":
        it.close()
    else:
        del it
        gc.collect()
    assert checkpoint.fds == []
    assert len(made) == 1 and _staging_pool.kept() == {0: made[0]}      # kept, not leaked
    empty_cache()
    assert rt.live_registrations == 0 and rt.live_device_allocs == 0


# A child process's load to the simulated device whose staging buffer takes
# SLEEP seconds to make: ``it``, never iterated yet; ``rt`` is also
# ``state["rt"]`` (``state``, ``TESTS`` and ``SLEEP`` come first).
SLOW_START = """
import os, sys, tempfile, time
sys.path.insert(0, TESTS)
import torch
from safetensors.torch import save_file
import instant_staging as ist
from instant_staging.loader import LoadOptions, _prepare, _shards, _run, _staging_pool, empty_cache
from instant_staging.testing import SimulatedRuntime
from support.tensors import SimTarget
rt = state["rt"] = SimulatedRuntime()
def make(size, segment):
    time.sleep(SLEEP)
    return ist.StagingBuffer(size, runtime=rt, segment_size=segment, prefault_threads=0)
_staging_pool._make = make
p = os.path.join(tempfile.mkdtemp(), "m.safetensors")
save_file({f"t{i}": torch.full((1000,), i, dtype=torch.int32) for i in range(50)}, p)
ck = _shards.Shards().open([p])
target = SimTarget(rt)
dtypes = [target.check(t, p) for _, t in ck.entries]
it = _run.LoadIterator(_prepare.planned(ck, target, dtypes, LoadOptions(8192, 4, 2)))
"""


# Registered before instant_staging is imported, so it runs after the
# staging module's exit hook: the buffers made, and those still registered.
EXIT_REPORT = """
import atexit
state = {}
atexit.register(lambda: print(
    "made", sum(c[0] == "host_register" and c[-1] == 0 for c in state["rt"].calls),
    "live", state["rt"].live_registrations, flush=True))
"""


def run_slow_start(before, after, sleep):
    """Runs ``before`` + SLOW_START + ``after`` in a child (dedented)."""
    return run_child(f"TESTS = {TESTS!r}\nSLEEP = {sleep!r}\n" + textwrap.dedent(before)
                     + SLOW_START + textwrap.dedent(after), timeout=60)


def test_fork_while_the_staging_buffer_is_made():
    # The child inherits the load (and maybe the buffer being made) but not
    # the thread: closing it there neither waits forever nor touches the
    # parent's registration; the parent's load still finishes.
    r = run_slow_start("state = {}", """
        pid = os.fork()
        if pid == 0:
            it.close()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        out = dict(it)
        from safetensors.torch import load_file as st_load
        ref = st_load(p)
        assert all(torch.equal(out[n], ref[n]) for n in ref)
        it.close()
        empty_cache()
        print("ok", status, rt.live_registrations, flush=True)
    """, sleep=0.2)                       # still being made at the fork
    assert r.returncode == 0 and "ok 0 0" in r.stdout, r.stderr[-2000:]


# -- views of torch tensors -------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int32, torch.float64, torch.uint8, torch.bool],
                         ids=str)
def test_torch_views_have_the_files_shape_and_bytes(dtype):
    # The torch target's views (set_ on the block's storage) on the CPU.
    target = _TorchTarget(torch, torch.device("cpu"))
    item = torch.empty((), dtype=dtype).element_size()
    a = random_tensor(dtype, [3, 5], 1)
    b = random_tensor(dtype, [7], 2)
    raw = torch.cat([a.reshape(-1).view(torch.uint8), torch.zeros(16 - a.nbytes % 16, dtype=torch.uint8)
                     if a.nbytes % 16 else torch.zeros(0, dtype=torch.uint8), b.view(torch.uint8)])
    off = raw.numel() - b.nbytes
    entries = [(0, TensorEntry("a", "X", (3, 5), 100, 100 + a.nbytes)),
               (0, TensorEntry("b", "X", (7,), 100 + off, 100 + off + b.nbytes))]
    run = _blocks.Run(0, 2, 100, raw.numel(), True)
    assert target.addresses(run, raw, entries) == [raw.data_ptr(), raw.data_ptr() + off]
    placed = target.views(run, raw, entries, [dtype, dtype])
    va, vb = (target.tensor(h) for h in placed)
    assert va.dtype == dtype and va.shape == (3, 5) and va.is_contiguous() and va._base is None
    assert torch.equal(va, a) and torch.equal(vb, b) and vb.data_ptr() == raw.data_ptr() + off
    assert off % item == 0
    assert va.untyped_storage().data_ptr() == vb.untyped_storage().data_ptr() == raw.data_ptr()
    del raw, placed, va
    assert torch.equal(vb, b)       # a view alone holds its block's storage


@pytest.fixture
def views_on_the_cpu(monkeypatch):
    """The torch target's whole view path (allocate_blocks, place, tensor,
    result) run end to end on the CPU: views are a GPU load's, so here the
    rule is told to ignore the device; the pipeline then memcpy's each
    chunk into the blocks (one copy per run of adjacent destinations)."""
    rule = _TorchTarget.joins

    def joins(self, dtype, views):
        device, self.device = self.device, torch.device("cuda", 0)
        try:
            return rule(self, dtype, views)
        finally:
            self.device = device
    monkeypatch.setattr(_TorchTarget, "joins", joins)


@pytest.mark.parametrize("layout", [moe_tensors, awq_tensors, odd_tensors], ids=["moe", "awq", "odd"])
def test_torch_views_end_to_end_equal_safetensors(tmp_path, views_on_the_cpu, layout):
    from instant_staging.loader import load_file
    tensors = layout()
    path = write_unsorted(tmp_path, tensors) if layout is odd_tensors else save(tmp_path, tensors)
    expected = st.load_file(path)
    loaded = load_file(path, "cpu", chunk_size=1024, threads=3)
    assert list(loaded) == list(load_file(path, "cpu", views=False))
    for name, ref in expected.items():
        got = loaded[name]
        assert got.dtype == ref.dtype and got.shape == ref.shape and got.is_contiguous(), name
        assert torch.equal(got.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)), name
    storages = {t.untyped_storage().data_ptr() for t in loaded.values() if t.numel()}
    if layout is not odd_tensors:       # (there, each tensor is unaligned to the one before)
        assert len(storages) < sum(1 for t in loaded.values() if t.numel())      # shared blocks
    assert all(t.data_ptr() % _blocks.ALIGN == 0 for t in loaded.values() if t.numel())


def test_torch_views_with_dtype_conversion_convert_tensors_of_their_own(tmp_path, views_on_the_cpu):
    from instant_staging.loader import load_file
    tensors = awq_tensors()
    path = save(tmp_path, tensors)
    loaded = load_file(path, "cpu", dtype=torch.float32, chunk_size=4096)
    for name, ref in tensors.items():
        got = loaded[name]
        if ref.is_floating_point():     # (random bytes: NaNs too, so compared as bits)
            assert got.dtype == torch.float32, name
            assert torch.equal(got.view(torch.int32), ref.float().view(torch.int32)), name
        else:           # int32 qweight/qzeros: views, kept as they are
            assert got.dtype == ref.dtype and torch.equal(got, ref), name
    ints = [t for t in loaded.values() if not t.is_floating_point()]
    assert len({t.untyped_storage().data_ptr() for t in ints}) < len(ints)


def test_torch_views_under_inference_mode_and_no_grad(tmp_path, views_on_the_cpu):
    from instant_staging.loader import load_file
    tensors = moe_tensors()
    path = save(tmp_path, tensors)
    for mode in (torch.inference_mode, torch.no_grad):
        with mode():
            loaded = load_file(path, "cpu")
            first = sorted(loaded)[0]
            param = torch.nn.Parameter(loaded[first])      # as a model's load_state_dict(assign=True)
        assert all(torch.equal(loaded[n].view(torch.int16), t.view(torch.int16))
                   for n, t in tensors.items())
        assert torch.equal(param.detach().view(torch.int16), tensors[first].view(torch.int16))


def test_the_staging_buffer_is_made_on_the_loads_device(monkeypatch):
    # A load to device 1 registers its buffer with device 1 current in the
    # making thread, not device 0 (a new thread's): no context on a GPU the
    # process may never use.
    import instant_staging.runtime as runtime_module
    rt = SimulatedRuntime(device_count=2)
    current = []

    def make_staging(size, segment):
        current.append(rt.get_device())
        return ist.StagingBuffer(size, runtime=rt, segment_size=segment, prefault_threads=0)
    monkeypatch.setattr(runtime_module, "default_runtime", lambda: rt)
    monkeypatch.setattr(_staging_pool, "_make", make_staging)
    empty_cache()
    start = _prepare.PendingStaging(1, 1 << 20, 1 << 16)
    buf = start.take()
    try:
        assert current == [(0, 1)]
        assert ("set_device", 1, 0) in rt.calls
    finally:
        buf.close()
    assert rt.live_registrations == 0


def test_a_load_dropped_by_the_collector_on_the_making_thread_gives_the_buffer_back(sim_pool,
                                                                                   monkeypatch):
    # The garbage collector may run a dropped load's close (abandon) on the
    # thread that makes its buffer, inside the making: a thread cannot join
    # itself, so the buffer, once made, goes to the pool from there.
    state, made = sim_pool
    rt = state["rt"]
    holder = []
    real_make = _staging_pool._make

    def make_then_collected(size, segment):
        holder[0].abandon()         # as a __del__ run by the collector here would
        return real_make(size, segment)
    monkeypatch.setattr(_staging_pool, "_make", make_then_collected)
    holder.append(_prepare.PendingStaging.__new__(_prepare.PendingStaging))
    holder[0].__init__(0, 1 << 20, 1 << 16)        # starts the thread: holder[0] is there
    holder[0]._thread.join(10)
    assert not holder[0]._thread.is_alive()
    assert len(made) == 1 and _staging_pool.kept() == {0: made[0]}
    empty_cache()
    assert rt.live_registrations == 0


def test_ctrl_c_while_next_waits_for_the_buffer_keeps_the_making_thread_waited_for():
    # A Ctrl-C (here SIGALRM raising it) lands while next() waits for the
    # buffer being made: the buffer once made goes to the pool; and an exit
    # that follows such an interrupt waits for the making, then releases it
    # (an interrupted Thread.join() marked the running thread stopped, and
    # the exit finalized the interpreter inside its registration).
    r = run_slow_start(EXIT_REPORT + textwrap.dedent("""
        import signal, threading
        def interrupt(*args):
            raise KeyboardInterrupt
        signal.signal(signal.SIGALRM, interrupt)
    """), """
        making = [t for t in threading.enumerate() if t.name == "instant_staging-staging"]
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        try:
            next(it)
        except KeyboardInterrupt:
            pass
        making[0].join(10)
        print("kept", len(_staging_pool.kept()), flush=True)
        empty_cache()
        second = _prepare.PendingStaging(0, 1 << 20, 1 << 16)
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        try:
            second.take()           # interrupted; the program then ends
        except KeyboardInterrupt:
            print("interrupted again", flush=True)
    """, sleep=0.5)
    assert r.returncode == 0, r.stderr[-2000:]
    # kept: pooled once made; the exit waited for the second making (made 2)
    # and released both (live 0)
    assert r.stdout.split() == ["kept", "1", "interrupted", "again",
                                "made", "2", "live", "0"], (r.stdout, r.stderr[-2000:])


def test_no_allocation_under_the_pools_lock(sim_pool, monkeypatch):
    # A collection that runs while the pool's lock is held (any allocation
    # of a tracked object may start one) would deadlock when a finalizer
    # gives a buffer back: with every allocation collecting, none runs there.
    import threading
    state, _ = sim_pool
    rt = state["rt"]
    held_during_collection = []
    lock = threading.Lock()

    class Watched:
        def __enter__(self):
            lock.acquire()

        def __exit__(self, *exc):
            lock.release()
    monkeypatch.setattr(_staging_pool, "_lock", Watched())

    def watch(phase, info):
        if phase == "start":
            held_during_collection.append(lock.locked())
    bufs = [ist.StagingBuffer(1 << 16, runtime=rt, prefault_threads=0) for _ in range(3)]
    threshold = gc.get_threshold()
    gc.callbacks.append(watch)
    gc.set_threshold(1)
    try:
        _staging_pool.give(0, bufs[0])
        _staging_pool.give(1, bufs[1])
        _staging_pool.kept()
        taken = _staging_pool.take(0, 1 << 16, 1, lambda: bufs[2])
        _staging_pool.give(0, taken)
        empty_cache()
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(watch)
    assert held_during_collection and not any(held_during_collection)
    bufs[2].close()
    assert rt.live_registrations == 0


def test_interpreter_exit_while_the_staging_buffer_is_made():
    # The making thread is not a daemon: the exit waits for it (a bounded
    # call), then the staging module's exit hook releases the buffer no load
    # took.  A check registered before instant_staging is imported runs after
    # that hook.
    r = run_slow_start(EXIT_REPORT, """
        print("exiting", flush=True)       # it: never iterated
    """, sleep=0.3)
    assert r.returncode == 0, r.stderr[-2000:]
    # made 1: the exit waited for the buffer; live 0: and released it
    assert r.stdout.split() == ["exiting", "made", "1", "live", "0"], (r.stdout, r.stderr[-2000:])


def test_an_interrupt_while_waiting_for_the_staging_buffer_gives_it_back(tmp_path, sim_pool, monkeypatch):
    # Ctrl-C arrives while the load waits for the buffer being made: the
    # load ends, and the buffer, once made, goes to the pool (not lost).
    state, made = sim_pool
    rt = state["rt"]
    path = save(tmp_path, moe_tensors())
    real_take = _prepare.PendingStaging.take

    def interrupted(self):
        raise KeyboardInterrupt
    monkeypatch.setattr(_prepare.PendingStaging, "take", interrupted)
    with pytest.raises(KeyboardInterrupt):
        device_load(path, rt)
    monkeypatch.setattr(_prepare.PendingStaging, "take", real_take)
    assert len(made) == 1 and _staging_pool.kept() == {0: made[0]}
    gc.collect()
    assert rt.live_device_allocs == 0
    empty_cache()
    assert rt.live_registrations == 0


def test_a_close_from_another_thread_while_the_buffer_is_made_cancels_the_next(tmp_path, sim_pool,
                                                                               monkeypatch):
    # A watchdog closes the load while its next() waits for the staging
    # buffer being made (the pipeline not yet there): that next() raises
    # the cancel, as LoadIterator says, instead of handing out a tensor.
    import threading
    import time

    from instant_staging.loader import LoadError
    state, made = sim_pool
    rt = state["rt"]
    path = save(tmp_path, moe_tensors())
    release, waiting = threading.Event(), threading.Event()
    real_take = _prepare.PendingStaging.take

    def slow_take(self):
        waiting.set()
        release.wait(10)
        return real_take(self)
    monkeypatch.setattr(_prepare.PendingStaging, "take", slow_take)
    it, _, checkpoint = begin_device_load(path, rt, threads=2, verify=False)
    got = []

    def consume():
        try:
            got.append(next(it))
        except Exception as e:
            got.append(e)
    consumer = threading.Thread(target=consume)
    consumer.start()
    assert waiting.wait(10)
    closer = threading.Thread(target=it.close)
    closer.start()
    time.sleep(0.2)             # the close has seen no pipeline and waits for the lock
    release.set()
    consumer.join(10)
    closer.join(10)
    assert not consumer.is_alive() and not closer.is_alive()
    assert len(got) == 1 and isinstance(got[0], LoadError) and "cancelled" in str(got[0]), got
    got.clear()
    gc.collect()
    assert rt.live_device_allocs == 0 and checkpoint.fds == []
    assert len(made) == 1 and _staging_pool.kept() == {0: made[0]}
    empty_cache()
    assert rt.live_registrations == 0


# -- random layouts (hypothesis) ----------------------------------------------------

_RANDOM_DTYPES = list(_DT)


class OddBlocksOnly(SimTarget):
    """Every other block "out of memory" (``_TorchTarget.allocate_blocks``
    leaves it out): its tensors get their own allocations, in a plan cut
    for views (``packed``), so they are split across chunks."""

    def allocate_blocks(self, run_list, entries, dtypes):
        blocks = super().allocate_blocks(run_list, entries, dtypes)
        return {r: b for r, b in blocks.items() if r % 2}


@hs.composite
def random_layouts(draw):
    """Files of tensors in a random order (unaligned offsets, zero-size
    ones), a random names= subset, a chunk size from 1 byte up."""
    n = draw(hs.integers(1, 12))
    tensors = {}
    for k in range(n):
        dtype = draw(hs.sampled_from(_RANDOM_DTYPES))
        shape = draw(hs.lists(hs.integers(0, 9), max_size=3))
        tensors[f"t{k}"] = random_tensor(dtype, shape, k)
    names = list(tensors)
    order = draw(hs.permutations(names))
    cuts = sorted(draw(hs.sets(hs.integers(1, max(n - 1, 1)), max_size=2))) if n > 1 else []
    files = [order[a:b] for a, b in zip([0] + cuts, cuts + [n]) if order[a:b]]
    keep = draw(hs.none() | hs.sets(hs.sampled_from(names), min_size=1))
    chunk = draw(hs.integers(1, 600))
    return tensors, files, keep, chunk


def assert_freed(rt):
    """Nothing of the loads on ``rt`` is left: no device allocation once
    the garbage is collected, no registration or runtime allocation once
    the kept staging buffer is released."""
    gc.collect()
    assert rt.live_device_allocs == 0
    empty_cache()
    assert rt.live_registrations == 0 and rt.live_host_allocs == 0


def write_layout(directory, layout):
    """A random layout's files in ``directory``: ``(paths, safetensors' own
    load of the selected tensors, names= for the load)``."""
    tensors, files, keep, _ = layout
    paths = [write_unsorted(directory, {n: tensors[n] for n in f}, f"{i}.safetensors")
             for i, f in enumerate(files)]
    expected = {}
    for p in paths:
        expected.update(st.load_file(p))
    if keep is None:
        return paths, expected, None
    return paths, {n: t for n, t in expected.items() if n in keep}, sorted(keep)


@settings(max_examples=int(os.environ.get("HYP_N", 60)), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=random_layouts())
def test_random_layouts_through_views_equal_safetensors(tmp_path_factory, sim_pool, layout):
    state, _ = sim_pool
    chunk = layout[3]
    empty_cache()           # (a buffer kept from an example before is another runtime's)
    rt = state["rt"] = SimulatedRuntime()
    paths, expected, names = write_layout(tmp_path_factory.mktemp("random"), layout)
    loaded, start = device_load(paths, rt, names=names, chunk=chunk)
    apart, _ = device_load(paths, rt, names=names, chunk=chunk, views=False)
    fallback, _ = device_load(paths, rt, names=names, chunk=chunk, target_type=OddBlocksOnly)
    assert_same(loaded, expected)
    assert_same(apart, expected)
    assert_same(fallback, expected)
    assert start.plan.total_bytes == sum(t.nbytes for t in expected.values())
    assert_freed(rt)


@settings(max_examples=int(os.environ.get("HYP_N", 40)), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=random_layouts(), rule=hs.tuples(hs.sampled_from(["copy", "read"]), hs.integers(1, 6),
                                               hs.sampled_from(["invalid_value", "EIO", "short"])))
def test_random_faults_through_views_fail_or_equal_and_free_everything(tmp_path_factory, sim_pool,
                                                                       layout, rule):
    from instant_staging.loader import LoadError
    state, _ = sim_pool
    chunk = layout[3]
    op, n, error = rule
    if (op == "copy") != (error == "invalid_value"):
        error = "invalid_value" if op == "copy" else "EIO"
    empty_cache()
    rt = state["rt"] = SimulatedRuntime()
    paths, expected, names = write_layout(tmp_path_factory.mktemp("faults"), layout)
    try:
        loaded, _ = device_load(paths, rt, names=names, chunk=chunk, faults=f"{op}#{n}={error}")
    except LoadError:
        pass
    else:
        assert_same(loaded, expected)
    assert_freed(rt)


@settings(max_examples=int(os.environ.get("HYP_N", 40)), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=random_layouts(), dtype=hs.sampled_from([None, None, torch.float32, torch.bfloat16]))
def test_random_layouts_as_torch_views_look_like_safetensors(tmp_path_factory, views_on_the_cpu, layout,
                                                             dtype):
    from instant_staging.loader import load_file
    chunk = layout[3]
    paths, expected, names = write_layout(tmp_path_factory.mktemp("torchviews"), layout)
    loaded = load_file(paths, "cpu", names=names, chunk_size=chunk, threads=2, dtype=dtype)
    apart = load_file(paths, "cpu", names=names, chunk_size=chunk, threads=2, views=False, dtype=dtype)
    assert list(loaded) == list(apart)
    assert set(loaded) == set(expected)
    for name, got in loaded.items():
        ref = expected[name]
        if dtype is not None and ref.is_floating_point():
            ref = ref.to(dtype)         # (converted: a tensor of its own, as views=False's)
            assert torch.equal(got.reshape(-1).view(torch.uint8),
                               apart[name].reshape(-1).view(torch.uint8)), name
        assert got.dtype == ref.dtype and got.shape == ref.shape and got.stride() == ref.stride(), name
        assert got.is_contiguous() and not got.requires_grad, name
        assert torch.equal(got.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)), name
        if got.numel():         # (an empty one is a view of an empty one, as safetensors')
            assert got._base is None and got.data_ptr() % _blocks.ALIGN == 0, name
            ends = got.storage_offset() * got.element_size() + got.nbytes
            assert ends <= got.untyped_storage().nbytes(), name


def test_deterministic_fill_of_new_gpu_memory_is_waited_for_before_copies(monkeypatch):
    # torch.use_deterministic_algorithms(True) makes torch.empty fill new
    # memory with a kernel on the current stream, which the readers' copies
    # (other streams) would race: the target waits for it after allocating
    # a block or a tensor of its own.  (A CPU stand-in for the GPU's torch.)
    from types import SimpleNamespace
    synced = []
    fake = SimpleNamespace(
        empty=lambda *a, device=None, **k: torch.empty(*a, **k),
        uint8=torch.uint8, utils=torch.utils,
        are_deterministic_algorithms_enabled=lambda: torch.are_deterministic_algorithms_enabled(),
        cuda=SimpleNamespace(OutOfMemoryError=torch.cuda.OutOfMemoryError,
                             current_stream=lambda d: SimpleNamespace(synchronize=lambda: synced.append(d))))
    target = _TorchTarget(torch, torch.device("cpu"))
    target.torch, target.device = fake, torch.device("cuda", 0)
    entry = TensorEntry("a", "F32", (4,), 0, 16)
    run = _blocks.Run(0, 1, 0, 16, True)
    target.allocate(entry, torch.float32)
    target.allocate_blocks([run], [(0, entry)], [torch.float32])
    assert synced == []                     # nothing filled: nothing to wait for
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    target.allocate(entry, torch.float32)
    target.allocate_blocks([run], [(0, entry)], [torch.float32])
    assert len(synced) == 2
