"""The one load skeleton (loader/_run.py's ``run``) and its one teardown
(``_LoadState.close()``), for a load of one process (the ``_Solo``
strategy): whatever step a load ends at (an error, Ctrl-C, a close), it
leaves nothing behind.

Each case loads on the simulated device (support.tensors' SimTarget: its
tensors and blocks are the simulated runtime's device allocations) with a
staging buffer made beside the load as ``iter_load`` makes it, raises at
one step, and checks what the simulated runtime counts: no device
allocation left, the buffer back in the pool and not held (it closes, and
then no registration is left), no descriptor of the file open, no reader
or staging thread left.  A process group's load runs the same skeleton
with its own strategy: tests/loader/test_distributed.py's ``leak_*``
scenarios do the same for each of its steps.
"""

import gc
import os
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors.torch")

import instant_staging as ist
from instant_staging.loader import (
    LoadError,
    LoadOptions,
    _pipeline,
    _prepare,
    _run,
    _shards,
    _staging_pool,
    empty_cache,
)
from instant_staging.testing import FaultPlan, SimulatedRuntime

from support.calls import raise_on_call, raising
from support.tensors import CHUNK, SimTarget, random_tensor, save


@pytest.fixture
def sim(monkeypatch):
    """``(runtime, buffers made)``: the loads' own staging buffers made on
    one simulated runtime, none kept before or after."""
    rt, made = SimulatedRuntime(), []

    def make(size, segment):
        buf = ist.StagingBuffer(size, runtime=rt, segment_size=segment, prefault_threads=0)
        made.append(buf)
        return buf
    monkeypatch.setattr(_staging_pool, "_make", make)
    empty_cache()
    yield rt, made
    empty_cache()


@pytest.fixture
def path(tmp_path):
    # Back to back (one block), then one of every other dtype: blocks and
    # tensors of their own, over many chunks.
    tensors = {f"w.{i}": random_tensor(torch.bfloat16, [64, 33 + i], i) for i in range(6)}
    tensors.update({f"x.{i}": random_tensor(dt, [97 + i], 10 + i)
                    for i, dt in enumerate([torch.uint8, torch.int32, torch.float64, torch.bool])})
    return save(tmp_path, tensors)


def begin(path, rt, *, views=True, faults=None, progress=None):
    """iter_load's single path up to its iterator (the plan made and the
    staging buffer started beside it: ``_prepare.planned``)."""
    checkpoint = _shards.Shards().open([path])
    checkpoint.select(None)
    target = SimTarget(rt)
    dtypes = [target.check(t, checkpoint.paths[i]) for i, t in checkpoint.entries]
    options = LoadOptions(CHUNK, 4, 2, progress=progress, views=views)
    return _run.LoadIterator(_prepare.planned(checkpoint, target, dtypes, options,
                                              faults and FaultPlan.parse(faults)))


def open_files(path):
    """Descriptors of this process open on ``path``."""
    real, n = os.path.realpath(path), 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == real
        except OSError:
            pass
    return n


def threads_now():
    return len(os.listdir("/proc/self/task"))


def assert_nothing_left(rt, made, path, threads_before):
    gc.collect()
    assert rt.live_device_allocs == 0                   # every tensor and block freed
    assert open_files(path) == 0                        # the file closed
    assert list(_staging_pool.kept().values()) == made  # the buffer given back, not lost
    for buf in made:
        buf.close()                                     # no load holds it (BufferError if one did)
    assert rt.live_registrations == 0 and rt.live_host_allocs == 0
    deadline = time.monotonic() + 10                    # (the staging thread ends just after its buffer)
    while threads_now() > threads_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threads_now() <= threads_before
    assert not [t for t in threading.enumerate() if t.name.startswith("instant_staging")]


# One case per step of run() (and the skeleton's exits); each installs its
# fault with monkeypatch and says what the load then raises.
def _at_plan(mp):            # 1. plan the reads
    mp.setattr(_run._Solo, "plan_reads", raising(RuntimeError("injected at plan")))


def _at_before_copies(mp):   # 2. while the staging buffer is made
    mp.setattr(SimTarget, "before_copies", raising(RuntimeError("injected at before_copies")))


def _at_blocks(mp):          # 2./3. the device blocks
    mp.setattr(SimTarget, "allocate_blocks", raising(RuntimeError("injected at blocks")))


def _at_take(mp):            # 2. taking the buffer being made
    mp.setattr(_prepare.PendingStaging, "take", raising(RuntimeError("injected at take")))


def _at_pipeline(mp):        # 2. the reader pipeline (the buffer taken)
    mp.setattr(_pipeline, "Pipeline", raising(KeyboardInterrupt()))


def _at_allocate(mp):        # 3. the fifth tensor of its own (the readers running)
    mp.setattr(_run, "_allocate", raise_on_call(5, MemoryError("injected at allocate"), _run._allocate))


def _at_read(mp):            # 5. a read fails under the readers
    pass


STEPS = {
    "plan": (_at_plan, {}, RuntimeError, "injected at plan"),
    "before_copies": (_at_before_copies, {}, RuntimeError, "injected at before_copies"),
    "blocks": (_at_blocks, {}, RuntimeError, "injected at blocks"),
    "take": (_at_take, {}, RuntimeError, "injected at take"),
    "pipeline": (_at_pipeline, {}, KeyboardInterrupt, None),
    "allocate": (_at_allocate, {"views": False}, MemoryError, "injected at allocate"),
    "read": (_at_read, {"faults": "read#3=EIO"}, LoadError, "Input/output error"),
}


@pytest.mark.parametrize("step", list(STEPS))
def test_an_error_at_each_step_leaves_nothing(step, sim, path, monkeypatch):
    rt, made = sim
    inject, kw, exc, words = STEPS[step]
    before = threads_now()
    it = begin(path, rt, **kw)
    inject(monkeypatch)
    with pytest.raises(exc, match=words) as info, it:
        dict(it)
    monkeypatch.undo()
    assert info.value is not None           # the error (and its traceback) still alive
    assert it.report is None and it.staging_kind in (None, ist.Kind.REGISTERED)
    del it
    assert_nothing_left(rt, made, path, before)
    assert len(made) == 1       # (begun while preparing, given back by the teardown)


@pytest.mark.parametrize("exc", [ValueError("injected in progress"), KeyboardInterrupt()],
                         ids=["error", "interrupt"])
def test_an_error_of_the_consumer_while_the_readers_run_leaves_nothing(exc, sim, path):
    # progress() runs in the consumer's thread inside step 5, readers running.
    rt, made = sim
    before = threads_now()
    it = begin(path, rt, progress=raise_on_call(1, exc, lambda done, total: None))
    with pytest.raises(type(exc)), it:
        dict(it)
    del it
    assert_nothing_left(rt, made, path, before)


@pytest.mark.parametrize("how", ["close", "drop", "never_started"])
def test_a_load_closed_at_any_point_leaves_nothing(how, sim, path):
    # GeneratorExit in step 5 (closed after one tensor), the iterator
    # dropped there, or closed before its generator ran (the teardown then
    # runs from LoadIterator.close, not from the generator's finally).
    rt, made = sim
    before = threads_now()
    it = begin(path, rt)
    if how != "never_started":
        name, tensor = next(it)
        assert name in it.names and tensor.device.type == "cpu"     # (SimTarget's CPU copy)
    if how == "drop":
        del it
    else:
        it.close()
        with pytest.raises(LoadError, match="cancelled"):
            next(it)
        del it
    assert_nothing_left(rt, made, path, before)


def test_the_teardown_runs_once_whoever_calls_it(sim, path):
    # The generator's finally and LoadIterator.close() both call
    # _LoadState.close(): the buffer goes back to the pool once (a second
    # give would hand one buffer to two later loads).
    rt, made = sim
    it = begin(path, rt)
    with it:
        dict(it)
    state = it._state
    state.close()
    state.close()
    assert list(_staging_pool.kept().values()) == made
    first = _staging_pool.take_kept(0, 1, CHUNK)
    assert first is made[0] and _staging_pool.take_kept(0, 1, CHUNK) is None
    _staging_pool.give(0, first)
    assert open_files(path) == 0
