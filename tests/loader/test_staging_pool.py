"""The loader's kept staging buffers (loader/_staging_pool.py).

A load that made its own staging buffer gives it back to the pool, the
next load to the same device takes it; ``empty_cache()``, a too-small or
too-large buffer, INSTANT_STAGING_KEEP_STAGING=0, fork and exit release it.
The simulated runtime counts live registrations: every test asserts on
them.  Loads run the device path through test_loader's SimTarget, with
the pool's buffers made on the same simulated runtime.
"""

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors.torch")

import instant_staging as ist
from instant_staging import defaults
from instant_staging.loader import _prepare, _shards, _staging_pool, empty_cache, iter_load, load_file
from instant_staging.testing import SimulatedRuntime

from support import PAGE, run_child
from support.tensors import CHUNK, SimTarget, assert_same, iterator, mixed_tensors, save

SEGMENT = 64 * PAGE


# Each test with the staging pool empty (tests/loader/conftest.py).
pytestmark = pytest.mark.usefixtures("empty_pool")


def make_sim(rt, size, made):
    def make():
        buf = ist.StagingBuffer(size, runtime=rt, segment_size=SEGMENT, prefault_threads=0)
        made.append(buf)
        return buf
    return make


def test_given_back_buffer_is_taken_by_the_next_load():
    rt, made = SimulatedRuntime(), []
    buf = _staging_pool.take(0, 8 * PAGE, SEGMENT, make_sim(rt, 8 * PAGE, made))
    _staging_pool.give(0, buf)
    assert not buf.closed and rt.live_registrations == 1
    assert _staging_pool.kept() == {0: buf}
    again = _staging_pool.take(0, 4 * PAGE, SEGMENT, make_sim(rt, 4 * PAGE, made))
    assert again is buf and len(made) == 1          # smaller request: the kept one
    assert _staging_pool.kept() == {}               # a load holds it, the pool does not
    _staging_pool.give(0, again)
    empty_cache()
    assert buf.closed and rt.live_registrations == 0 and _staging_pool.kept() == {}


def test_too_small_or_finer_segments_are_replaced():
    rt, made = SimulatedRuntime(), []
    small = _staging_pool.take(0, 4 * PAGE, SEGMENT, make_sim(rt, 4 * PAGE, made))
    _staging_pool.give(0, small)
    big = _staging_pool.take(0, 8 * PAGE, SEGMENT, make_sim(rt, 8 * PAGE, made))
    assert big is not small and small.closed and rt.live_registrations == 1
    _staging_pool.give(0, big)
    # Registrations smaller than the load's slots: a fresh buffer, as a load
    # that keeps nothing would make.
    other = _staging_pool.take(0, 8 * PAGE, 2 * SEGMENT, make_sim(rt, 8 * PAGE, made))
    assert other is not big and big.closed and len(made) == 3
    _staging_pool.give(0, other)
    empty_cache()
    assert rt.live_registrations == 0


def test_devices_are_kept_apart_and_the_larger_of_two_wins():
    rt, made = SimulatedRuntime(), []
    a = _staging_pool.take(0, 4 * PAGE, SEGMENT, make_sim(rt, 4 * PAGE, made))
    b = _staging_pool.take(0, 8 * PAGE, SEGMENT, make_sim(rt, 8 * PAGE, made))   # concurrent
    c = _staging_pool.take(1, 4 * PAGE, SEGMENT, make_sim(rt, 4 * PAGE, made))
    _staging_pool.give(0, b)
    _staging_pool.give(0, a)            # smaller than the one kept: closed
    _staging_pool.give(1, c)
    assert a.closed and _staging_pool.kept() == {0: b, 1: c}
    assert rt.live_registrations == 2
    empty_cache()
    assert rt.live_registrations == 0


def test_keep_off_and_too_large_close_at_once(monkeypatch):
    rt, made = SimulatedRuntime(), []
    monkeypatch.setenv("INSTANT_STAGING_KEEP_STAGING", "0")
    buf = _staging_pool.take(0, 4 * PAGE, SEGMENT, make_sim(rt, 4 * PAGE, made))
    _staging_pool.give(0, buf)
    assert buf.closed and _staging_pool.kept() == {} and rt.live_registrations == 0
    monkeypatch.setenv("INSTANT_STAGING_KEEP_STAGING", "1")
    monkeypatch.setattr(_staging_pool, "KEEP_STAGING_MAX", 4 * PAGE - 1)
    buf = _staging_pool.take(0, 4 * PAGE, SEGMENT, make_sim(rt, 4 * PAGE, made))
    _staging_pool.give(0, buf)
    assert buf.closed and _staging_pool.kept() == {} and rt.live_registrations == 0


def test_keep_max_is_twice_a_default_load():
    assert defaults.KEEP_STAGING_MAX == 2 * defaults.IO_DEPTH * defaults.CHUNK_SIZE


@pytest.mark.parametrize("value", ["yes", "2", "true", "-1"])
def test_bad_keep_value_fails_before_anything_is_allocated(tmp_path, monkeypatch, value):
    path = save(tmp_path, mixed_tensors(count=3))
    monkeypatch.setenv("INSTANT_STAGING_KEEP_STAGING", value)
    with pytest.raises(ValueError, match="INSTANT_STAGING_KEEP_STAGING"):
        load_file(path, "cpu")


def test_closed_kept_buffer_is_not_handed_out():
    rt, made = SimulatedRuntime(), []
    buf = _staging_pool.take(0, 4 * PAGE, SEGMENT, make_sim(rt, 4 * PAGE, made))
    _staging_pool.give(0, buf)
    buf.close()                         # closed behind the pool's back
    other = _staging_pool.take(0, 4 * PAGE, SEGMENT, make_sim(rt, 4 * PAGE, made))
    assert other is not buf and not other.closed
    _staging_pool.give(0, other)
    empty_cache()
    assert rt.live_registrations == 0


def test_take_kept_takes_only_a_fitting_buffer_and_never_makes_or_closes():
    rt = SimulatedRuntime()
    segment = defaults.staging_segment_size(PAGE)       # what a load of PAGE slots asks for
    fine = ist.StagingBuffer(4 * PAGE, runtime=rt, segment_size=SEGMENT, prefault_threads=0)
    _staging_pool.give(0, fine)
    assert _staging_pool.take_kept(0, 4 * PAGE, PAGE) is None       # finer segments
    assert _staging_pool.kept() == {0: fine} and not fine.closed    # left for own() to close
    empty_cache()
    buf = ist.StagingBuffer(4 * PAGE, runtime=rt, segment_size=segment, prefault_threads=0)
    _staging_pool.give(0, buf)
    assert _staging_pool.take_kept(0, 8 * PAGE, PAGE) is None       # too small
    assert _staging_pool.take_kept(1, 4 * PAGE, PAGE) is None       # another device's
    assert _staging_pool.kept() == {0: buf} and not buf.closed
    assert _staging_pool.take_kept(0, 4 * PAGE, PAGE) is buf
    assert _staging_pool.kept() == {}
    _staging_pool.give(0, buf)
    empty_cache()
    assert rt.live_registrations == 0


def test_a_kept_buffer_is_taken_without_the_staging_thread(monkeypatch):
    # _StagingStart takes what the pool holds at once (no thread, ready at
    # once); abandon() gives it back; without one, the thread makes it.
    rt, made = SimulatedRuntime(), []
    size, segment = 4 * PAGE, defaults.staging_segment_size(PAGE)
    buf = ist.StagingBuffer(size, runtime=rt, segment_size=segment, prefault_threads=0)
    _staging_pool.give(0, buf)
    start = _prepare.PendingStaging(0, size, PAGE)
    assert start._thread is None and start.ready() and _staging_pool.kept() == {}
    start.abandon()
    assert _staging_pool.kept() == {0: buf}
    start = _prepare.PendingStaging(0, size, PAGE)
    assert start.take() is buf and _staging_pool.kept() == {}
    monkeypatch.setattr(_staging_pool, "_make", lambda size_, segment: made.append(1) or buf)
    start = _prepare.PendingStaging(0, size, PAGE)           # nothing kept: the thread makes one
    assert start._thread is not None and start.take() is buf and made == [1]
    _staging_pool.give(0, buf)
    empty_cache()
    assert rt.live_registrations == 0


# -- through loads -------------------------------------------------------------

def device_load(path, rt, made, **kw):
    """A load to the simulated device that makes its own staging buffer."""
    checkpoint = _shards.Shards().open([path])
    target = SimTarget(rt)
    dtypes = [target.check(t, checkpoint.paths[i]) for i, t in checkpoint.entries]
    with iterator(checkpoint, target, dtypes, chunk_size=CHUNK, io_depth=4,
                            threads=2, **kw) as it:
        out = {name: target.result(handle) if isinstance(handle, tuple) else handle
               for name, handle in it}
        return out, it.staging_kind


@pytest.fixture
def sim_pool(monkeypatch):
    """Loads' own staging buffers made on one simulated runtime."""
    rt, made = SimulatedRuntime(), []

    def make_staging(size, segment):
        buf = ist.StagingBuffer(size, runtime=rt, segment_size=segment, prefault_threads=0)
        made.append(buf)
        return buf
    monkeypatch.setattr(_staging_pool, "_make", make_staging)
    return rt, made


def test_loads_share_one_buffer(tmp_path, sim_pool):
    rt, made = sim_pool
    tensors = mixed_tensors(count=20)
    path = save(tmp_path, tensors)
    for _ in range(3):
        loaded, kind = device_load(path, rt, made)
        assert_same(loaded, tensors)
        assert kind is ist.Kind.REGISTERED
    assert len(made) == 1 and rt.live_registrations == 1
    empty_cache()
    assert rt.live_registrations == 0 and rt.live_host_allocs == 0


def test_failed_load_gives_its_buffer_back_reusable(tmp_path, sim_pool):
    rt, made = sim_pool
    tensors = mixed_tensors(count=20)
    path = save(tmp_path, tensors)
    from instant_staging.faults import FaultPlan
    from instant_staging.loader import LoadError
    with pytest.raises(LoadError):
        device_load(path, rt, made, faults=FaultPlan.parse("read#3=EIO"))
    assert _staging_pool.kept() == {0: made[0]}
    loaded, _ = device_load(path, rt, made)
    assert_same(loaded, tensors)
    assert len(made) == 1
    empty_cache()
    assert rt.live_registrations == 0


def test_interrupted_load_gives_its_buffer_back(tmp_path, sim_pool):
    rt, made = sim_pool
    path = save(tmp_path, mixed_tensors(count=20))
    checkpoint = _shards.Shards().open([path])
    target = SimTarget(rt)
    dtypes = [target.check(t, checkpoint.paths[i]) for i, t in checkpoint.entries]
    it = iterator(checkpoint, target, dtypes, chunk_size=CHUNK, io_depth=4, threads=2)
    next(it)
    assert _staging_pool.kept() == {}           # the load holds it
    with pytest.raises(BufferError):
        made[0].close()
    it.close()
    assert _staging_pool.kept() == {0: made[0]} and not made[0].closed
    empty_cache()
    assert rt.live_registrations == 0


# -- fork and exit: in subprocesses --------------------------------------------

_FORK_CHILD = r"""
import os, sys
import instant_staging as ist
from instant_staging.loader import _staging_pool
from instant_staging.testing import SimulatedRuntime
rt = SimulatedRuntime()
buf = ist.StagingBuffer(1 << 20, runtime=rt, prefault_threads=0)
_staging_pool.give(0, buf)
calls = len(rt.calls)
pid = os.fork()
if pid == 0:
    ok = _staging_pool.kept() == {}
    made = []
    other = _staging_pool.take(0, 1 << 20, 1 << 20, lambda: made.append(1) or "new")
    ok = ok and other == "new" and made == [1]
    del buf
    import gc; gc.collect()
    ok = ok and len(rt.calls) == calls        # the parent's registration untouched
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
print("parent kept", _staging_pool.kept() == {0: buf}, rt.live_registrations)
"""


def test_fork_child_never_uses_the_parents_buffer():
    proc = run_child(_FORK_CHILD)
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr
    assert "child 0" in out and "parent kept True 1" in out


_EXIT_CHILD = r"""
import atexit
state = {}
# Registered before instant_staging's own hook, so it runs after it (LIFO).
atexit.register(lambda: print("at exit live", state["rt"].live_registrations, flush=True))
import instant_staging as ist
from instant_staging.loader import _staging_pool
from instant_staging.testing import SimulatedRuntime
state["rt"] = rt = SimulatedRuntime()
_staging_pool.give(0, ist.StagingBuffer(1 << 20, runtime=rt, prefault_threads=0))
print("kept live", rt.live_registrations, flush=True)
"""


def test_kept_buffer_is_released_at_exit():
    proc = run_child(_EXIT_CHILD)
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr
    assert "kept live 1" in out and "at exit live 0" in out


def test_env_forwarded(monkeypatch):
    # The variable is read at each give(), not cached at import.
    monkeypatch.setenv("INSTANT_STAGING_KEEP_STAGING", "0")
    from instant_staging.loader._options import keep_staging
    assert keep_staging() is False
    monkeypatch.setenv("INSTANT_STAGING_KEEP_STAGING", "1")
    assert keep_staging() is True
    monkeypatch.delenv("INSTANT_STAGING_KEEP_STAGING")
    assert keep_staging() is defaults.KEEP_STAGING is True
    assert os.environ.get("INSTANT_STAGING_KEEP_STAGING") is None


# -- on a real GPU ---------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_loads_share_the_kept_buffer_and_empty_cache_unpins(tmp_path):
    tensors = mixed_tensors(seed=11, count=64)
    tensors["big"] = torch.randint(0, 256, (24 << 20,), dtype=torch.uint8)
    path = save(tmp_path, tensors)
    loaded = load_file(path, "cuda:0")
    assert_same({n: t.cpu() for n, t in loaded.items()}, tensors)
    (buf,) = _staging_pool.kept().values()
    ptr, rt = buf.ptr, buf.runtime
    assert buf.kind is ist.Kind.REGISTERED and rt.pointer_type(ptr) == (0, 1)
    with iter_load(path, "cuda:0") as it:
        loaded = dict([next(it)])                   # the load starts at the first next()
        assert _staging_pool.kept() == {}           # this load holds it
        loaded.update(it)
    assert_same({n: t.cpu() for n, t in loaded.items()}, tensors)
    assert _staging_pool.kept() == {0: buf}         # the same buffer, given back
    empty_cache()
    assert buf.closed and rt.pointer_type(ptr)[1] == 0   # unregistered


@pytest.mark.gpu
def test_gpu_exit_with_a_kept_buffer(tmp_path):
    path = save(tmp_path, mixed_tensors(seed=12, count=8))
    code = (f"from instant_staging.loader import load_file, _staging_pool\n"
            f"load_file({path!r}, 'cuda:0')\n"
            f"assert len(_staging_pool.kept()) == 1\n"
            f"print('kept', flush=True)\n")
    proc = run_child(code)
    assert proc.returncode == 0 and "kept" in proc.stdout, proc.stderr
    assert proc.stderr == ""
