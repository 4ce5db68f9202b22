"""Copy groups (loader/_pipeline.pyx): the readers read a chunk at a time
into their places in a group slot of several chunks, and the group's last
reader copies the group, a run of pieces that continues on both sides as
one copy.  On the simulated runtime, which refuses a copy that straddles
two registrations or two device allocations, and whose log counts every
copy, stream and event."""

import gc

import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")

import torch

import instant_staging as ist
from instant_staging.loader import LoadError, _pipeline, _shards
from instant_staging.testing import FaultPlan, SimulatedRuntime

from support.tensors import CHUNK, SimTarget, assert_same, iterator, mixed_tensors, random_tensor, save

KINDS = {
    ist.Kind.REGISTERED: (None, {}),
    ist.Kind.SEGMENTED: ("register#1=invalid_value", {"segment_size": 6 * CHUNK}),
    ist.Kind.RUNTIME_PINNED: ("register=invalid_value", {}),
}


def staging(faults=None, chunks=24, **kw):
    rt = SimulatedRuntime(faults=faults, log_limit=None)
    kw.setdefault("prefault_threads", 0)
    return rt, ist.StagingBuffer(chunks * CHUNK, runtime=rt, copy_unit=CHUNK, **kw)


def load(paths, buf, *, group, threads=3, io_depth=16, views=True, faults=None, take=None):
    """A load through SimTarget with copy groups of ``group`` chunks."""
    checkpoint = _shards.Shards().open(paths if isinstance(paths, list) else [paths])
    target = SimTarget(buf.runtime)
    dtypes = [target.check(t, checkpoint.paths[i]) for i, t in checkpoint.entries]
    saved, _pipeline.COPY_CHUNKS = _pipeline.COPY_CHUNKS, group
    try:
        with iterator(checkpoint, target, dtypes, io_depth=io_depth, threads=threads, staging=buf,
                      views=views, faults=faults and FaultPlan.parse(faults)) as it:
            out = {}
            for name, tensor in it:
                out[name] = tensor
                if take is not None and len(out) == take:
                    break
            return out
    finally:
        _pipeline.COPY_CHUNKS = saved


def calls(rt, name):
    return sum(1 for c in rt.calls if c[0] == name)


def copies(rt):
    return [c for c in rt.calls if c[0] == "memcpy_async" and c[4] == 1]


def balanced(rt):
    """Every stream and event the loads made was destroyed."""
    return (calls(rt, "stream_create") == calls(rt, "stream_destroy")
            and calls(rt, "event_create") == calls(rt, "event_destroy"))


@pytest.mark.parametrize("kind", list(KINDS), ids=lambda k: k.name)
@pytest.mark.parametrize("group", [2, 3, 4])
@pytest.mark.parametrize("threads", [1, 2, 5])
@pytest.mark.parametrize("views", [True, False], ids=["blocks", "tensors"])
def test_a_load_in_copy_groups_is_bit_exact(tmp_path, kind, group, threads, views):
    faults, kw = KINDS[kind]
    tensors = mixed_tensors(seed=group + threads)
    other = {f"big.{i}": random_tensor(torch.float32, (5 * CHUNK // 4 + i,), 90 + i) for i in range(3)}
    paths = [save(tmp_path, tensors, "a.safetensors"), save(tmp_path, other, "b.safetensors")]
    rt, buf = staging(faults, **kw)
    assert buf.kind is kind
    assert_same(load(paths, buf, group=group, threads=threads, views=views), {**tensors, **other})
    gc.collect()
    assert rt.live_device_allocs == 0 and rt.pending_error == 0 and balanced(rt)
    buf.close()
    assert rt.live_registrations == 0 and rt.live_host_allocs == 0


def test_a_group_is_one_copy_per_run_not_per_chunk(tmp_path):
    # One tensor of 40 chunks: a copy per chunk, or a copy per group of 4.
    tensor = {"w": random_tensor(torch.uint8, (40 * CHUNK,), 1)}
    path = save(tmp_path, tensor)
    counts = {}
    for group in (1, 4):
        rt, buf = staging()
        assert_same(load(path, buf, group=group), tensor)
        counts[group] = len(copies(rt))
        buf.close()
    # (the first chunk is shorter: the header's bytes precede the tensor)
    assert counts[1] >= 40 and counts[4] <= counts[1] // 4 + 2, counts


def test_a_group_never_spans_two_registrations(tmp_path):
    # Segments of 3 chunks: groups of 2 fit once in each (the third chunk
    # of a segment is left out), groups of 4 in none (a copy per chunk).
    tensor = {"w": random_tensor(torch.uint8, (30 * CHUNK,), 2)}
    path = save(tmp_path, tensor)
    for group in (2, 4):
        rt, buf = staging("register#1=invalid_value", chunks=24, segment_size=3 * CHUNK)
        assert buf.kind is ist.Kind.SEGMENTED
        assert_same(load(path, buf, group=group), tensor)
        spans = sorted(rt.registered_ranges())
        for c in copies(rt):
            src, size = c[2], c[3]
            assert any(b <= src and src + size <= b + n for b, n in spans), (c, spans)
        buf.close()


@pytest.mark.parametrize("fault", ["read#1=EIO", "read#6=EIO", "read#23=EIO", "copy#5=invalid_value",
                                   "copy#40=invalid_value"])
def test_a_fault_in_a_group_fails_the_load_and_leaves_nothing(tmp_path, fault):
    tensors = mixed_tensors(seed=7)
    path = save(tmp_path, tensors)
    rt, buf = staging()
    with pytest.raises(LoadError):
        load(path, buf, group=4, threads=4, faults=fault)
    gc.collect()
    assert rt.live_device_allocs == 0 and rt.pending_error == 0 and balanced(rt)
    assert_same(load(path, buf, group=4, threads=4), tensors)     # the buffer is reusable
    gc.collect()
    buf.close()
    assert rt.live_registrations == 0 and rt.live_device_allocs == 0 and balanced(rt)


def test_a_load_closed_after_one_tensor_leaves_nothing(tmp_path):
    tensors = mixed_tensors(seed=8, count=60)
    path = save(tmp_path, tensors)
    rt, buf = staging()
    got = load(path, buf, group=4, threads=4, take=1)
    assert len(got) == 1
    gc.collect()
    assert rt.live_device_allocs == 0 and balanced(rt)
    buf.close()
    assert rt.live_registrations == 0


def test_copy_chunks_is_checked():
    from instant_staging.loader._pipeline import Pipeline, Plan
    _rt, buf = staging()
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="copy_chunks"):
            Pipeline(Plan([(0, 0, 8 * CHUNK)], CHUNK), threads=2, staging=buf, device=0,
                     copy_chunks=bad)
    buf.close()
