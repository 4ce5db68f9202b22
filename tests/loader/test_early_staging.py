"""A server's first load begins its staging buffer at its door
(loader/_prepare.py ``early_staging``), before its checkpoint is opened and
planned, and the load uses it where it fits (``begin_staging``).

The device path runs on the simulated runtime (``SimTarget``), with CUDA
said to be started (``_prepare._started``) and the pool's buffers made on
the same simulated runtime, whose counters every test asserts on: an
early buffer that the load uses, one that does not fit (kept aside, given
to the pool at the load's end), one whose making fails (its warnings and
its error never added to the load's), a door that fails after it began
one (discarded: the failed call leaves nothing pinned), a Ctrl-C at every
bytecode of the door, and fork.
"""

import logging
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors.torch")

import instant_staging as ist
from instant_staging import defaults
from instant_staging.loader import (
    Checkpoint,
    LoadOptions,
    _checkpoint,
    _load,
    _prepare,
    _shards,
    _staging_pool,
    empty_cache,
    iter_load,
    load_file,
)
from instant_staging.testing import SimulatedRuntime

from support import PAGE, run_child
from support.tensors import CHUNK, SimTarget, assert_same, mixed_tensors, save

# The knobs of every load here: 4 slots of CHUNK, 2 threads.
KNOBS = {"chunk_size": CHUNK, "io_depth": 4, "threads": 2}
EARLY = 4 * CHUNK           # what a load with KNOBS asks, and begins at the door


# Each test with the staging pool empty (tests/loader/conftest.py).
pytestmark = pytest.mark.usefixtures("empty_pool")


class Sim:
    """The device path on one simulated runtime (with ``faults``): CUDA said
    started, loads to "cuda:0" through SimTarget, the pool's buffers made
    on the same runtime; ``gate`` holds back the making of a buffer of
    ``EARLY`` bytes until set."""

    def __init__(self, monkeypatch, faults=None):
        self.rt = SimulatedRuntime(faults=faults)
        self.made, self.events = [], []
        self.gate = threading.Event()
        self.gate.set()
        monkeypatch.setattr(_prepare, "_started", lambda torch: True)
        monkeypatch.setattr(_checkpoint, "usable_target",
                            lambda parsed, shards=None, tuned=False: SimTarget(self.rt))
        monkeypatch.setattr(_staging_pool, "_make", self.make)
        real_open = _shards.Shards.open

        def open_(shards, paths):
            self.events.append("open")
            return real_open(shards, paths)
        monkeypatch.setattr(_shards.Shards, "open", open_)
        real_early = _prepare.early_staging

        def early(*args):
            pending = real_early(*args)
            self.events.append("early" if pending is not None else "no early")
            return pending
        monkeypatch.setattr(_load, "early_staging", early)
        monkeypatch.setattr(_checkpoint, "early_staging", early)

    def make(self, size, segment):
        if size == EARLY:
            assert self.gate.wait(30)
        try:
            buf = ist.StagingBuffer(size, runtime=self.rt, segment_size=segment, prefault_threads=0)
        except ist.StagingError as e:
            self.made.append(("failed", size))
            raise ist.StagingError(f"no pinned staging buffer of {size} bytes", e.attempts) from None
        self.made.append(buf)
        return buf

    def live(self):
        return self.rt.live_registrations + self.rt.live_host_allocs


def results(loaded, rt):
    target = SimTarget(rt)
    return {name: target.result(handle) if isinstance(handle, tuple) else handle
            for name, handle in loaded.items()}


@pytest.fixture
def tensors():
    return mixed_tensors(seed=3, count=24)


def test_a_first_load_begins_its_buffer_before_opening_and_uses_it(tmp_path, monkeypatch, tensors):
    sim = Sim(monkeypatch)
    path = save(tmp_path, tensors)
    assert_same(results(load_file(path, "cuda:0", **KNOBS), sim.rt), tensors)
    assert sim.events == ["early", "open"]          # begun before the checkpoint is opened
    (buf,) = sim.made                               # the load used it: no second buffer
    assert buf.size == EARLY and buf.kind is ist.Kind.REGISTERED
    assert _staging_pool.kept() == {0: buf}         # given back as the load's own
    # The next load takes the kept one: nothing begun at its door.
    assert_same(results(load_file(path, "cuda:0", **KNOBS), sim.rt), tensors)
    assert sim.events[2:] == ["no early", "open"] and len(sim.made) == 1
    empty_cache()
    assert sim.live() == 0


def test_checkpoint_load_begins_it_too(tmp_path, monkeypatch, tensors):
    sim = Sim(monkeypatch)
    path = save(tmp_path, tensors)
    with Checkpoint.open(path) as ck:
        assert sim.events == ["open"]
        assert_same(results(ck.load("cuda:0", **KNOBS), sim.rt), tensors)
        assert sim.events == ["open", "early"] and len(sim.made) == 1
        assert ck.last_report.staging_kind == "REGISTERED"
    empty_cache()
    assert sim.live() == 0


def test_none_begun_where_the_load_would_not_make_one(tmp_path, monkeypatch):
    sim = Sim(monkeypatch)
    parsed = _prepare.parse_target("cuda:0", None)
    options = LoadOptions.build(**KNOBS)
    assert _prepare.early_staging(_prepare.parse_target("cpu", None), options) is None
    given = ist.StagingBuffer(EARLY, runtime=sim.rt, prefault_threads=0)
    assert _prepare.early_staging(parsed, LoadOptions.build(staging=given, **KNOBS)) is None
    assert _prepare.early_staging(parsed, options, remote=True) is None      # a URL's knobs differ
    big = LoadOptions.build(chunk_size=defaults.KEEP_STAGING_MAX, io_depth=2, threads=2)
    assert _prepare.early_staging(parsed, big) is None                       # never kept
    monkeypatch.setattr(_prepare, "_started", lambda torch: False)
    assert _prepare.early_staging(parsed, options) is None                   # no server's CUDA
    monkeypatch.setattr(_prepare, "_started", lambda torch: True)
    _staging_pool.give(0, ist.StagingBuffer(PAGE, runtime=sim.rt, prefault_threads=0))
    assert _prepare.early_staging(parsed, options) is None                   # one kept: no first load
    assert sim.made == []
    given.close()
    empty_cache()
    assert sim.live() == 0


def planned_with(sim, path, early, **knobs):
    shards = _shards.Shards().open([path])
    target = SimTarget(sim.rt)
    dtypes = target.dtypes(shards.entries, shards.paths)
    return _prepare.planned(shards, target, dtypes, LoadOptions.build(**knobs), early=early)


def run(prepared, sim):
    from instant_staging.loader._run import LoadIterator
    with LoadIterator(prepared) as it:
        return results(dict(it), sim.rt)


def test_one_that_does_not_fit_is_kept_aside_and_given_to_the_pool_at_the_end(tmp_path, monkeypatch,
                                                                            tensors):
    sim = Sim(monkeypatch)
    path = save(tmp_path, tensors)
    early = _prepare.PendingStaging(0, EARLY, CHUNK, early=True)
    # Twice the slots: more than it holds.
    prepared = planned_with(sim, path, early, chunk_size=CHUNK, io_depth=8, threads=2)
    assert prepared.reads.spare is early and prepared.reads.staging is not early
    assert_same(run(prepared, sim), tensors)
    sizes = sorted(b.size for b in sim.made)
    assert sizes == [EARLY, 2 * EARLY]
    # Both given back: the pool keeps the larger and closes the other.
    assert {d: b.size for d, b in _staging_pool.kept().items()} == {0: 2 * EARLY}
    empty_cache()
    assert sim.live() == 0


def test_one_still_being_made_for_a_much_smaller_load_is_kept_aside(tmp_path, monkeypatch):
    sim = Sim(monkeypatch)
    path = save(tmp_path, {"a": torch.arange(CHUNK // 8, dtype=torch.int32)})   # one chunk
    sim.gate.clear()
    early = _prepare.PendingStaging(0, EARLY, CHUNK, early=True)
    prepared = planned_with(sim, path, early, **KNOBS)   # asks one slot: a quarter of it
    assert prepared.reads.spare is early and prepared.reads.staging is not early
    sim.gate.set()
    run(prepared, sim)
    empty_cache()
    assert sim.live() == 0


def test_what_an_early_one_fits(monkeypatch):
    sim = Sim(monkeypatch)
    sim.gate.clear()
    early = _prepare.PendingStaging(0, EARLY, CHUNK, early=True)
    assert early.fits(0, EARLY, CHUNK) and early.fits(0, EARLY // 2, CHUNK)
    assert not early.fits(0, EARLY // 2 - 1, CHUNK)         # being made: at most twice the need
    sim.gate.set()
    early._wait()
    assert early.fits(0, CHUNK, CHUNK)                      # made: any smaller need
    assert not early.fits(1, CHUNK, CHUNK)                  # another device's
    assert not early.fits(0, EARLY + 1, CHUNK)              # too small
    too_fine = defaults.SEGMENT_SIZE + PAGE                 # slots longer than its segments
    assert not early.fits(0, too_fine, too_fine)
    early.abandon()
    empty_cache()
    assert sim.live() == 0


def test_the_caller_returns_once_the_thread_is_in_its_steps_without_the_gil(monkeypatch):
    # The thread's Python (its device, the buffer's checks) runs before the
    # caller goes on: held by the caller's GIL, it used to reach its steps
    # only once the caller waited for the buffer.
    sim = Sim(monkeypatch)
    seen = []
    real_set = _prepare._use_device
    monkeypatch.setattr(_prepare, "_use_device", lambda device: seen.append("device") or real_set(device))
    monkeypatch.setattr(sys, "getswitchinterval", lambda: 60.0)     # (the wait's bound, generous)
    early = _prepare.PendingStaging(0, EARLY, CHUNK, early=True)
    assert seen == ["device"] and early._entered.is_set()
    buf = early.take()
    assert buf.kind is ist.Kind.REGISTERED and [a.step for a in buf.attempts] == ["allocate", "register"]
    _staging_pool.give(0, buf)
    empty_cache()
    assert sim.live() == 0


def test_a_thread_held_up_before_its_steps_holds_the_caller_one_switch_interval_at_most(monkeypatch):
    sim = Sim(monkeypatch)
    sim.gate.clear()                    # the making held before its buffer's steps
    t0 = time.monotonic()
    early = _prepare.PendingStaging(0, EARLY, CHUNK, early=True)
    assert time.monotonic() - t0 < 10 * sys.getswitchinterval() + 0.5 and not early.ready()
    sim.gate.set()
    early.abandon()
    empty_cache()
    assert sim.live() == 0


def fallback_warnings(caplog):
    return [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == "instant_staging"]


def test_a_fitting_ones_warnings_are_logged_once_when_the_load_takes_it(tmp_path, monkeypatch,
                                                                     tensors, caplog):
    sim = Sim(monkeypatch, faults="register=invalid_value")
    path = save(tmp_path, tensors)
    with caplog.at_level(logging.WARNING, logger="instant_staging"), \
            iter_load(path, "cuda:0", **KNOBS) as it:
        it._state.reads.staging._wait()         # made, its warning held until the take
        assert fallback_warnings(caplog) == []
        loaded = dict(it)
        assert it.staging_kind is ist.Kind.RUNTIME_PINNED
    assert_same(results(loaded, sim.rt), tensors)
    (warning,) = fallback_warnings(caplog)
    assert "falling back" in warning.getMessage()
    empty_cache()
    assert sim.live() == 0


def test_a_fitting_one_that_failed_is_the_loads_one_error(tmp_path, monkeypatch, tensors, caplog):
    sim = Sim(monkeypatch, faults="register=invalid_value;host_alloc=memory_allocation")
    path = save(tmp_path, tensors)
    with caplog.at_level(logging.WARNING, logger="instant_staging"), \
            pytest.raises(ist.StagingError, match="no pinned staging buffer"):
        load_file(path, "cuda:0", **KNOBS)
    assert sim.made == [("failed", EARLY)]          # not made twice
    assert len(fallback_warnings(caplog)) == 1      # the state machine's one fallback warning
    assert _staging_pool.kept() == {} and sim.live() == 0


def test_one_that_does_not_fit_never_adds_a_warning_or_an_error(tmp_path, monkeypatch, tensors,
                                                                caplog):
    # It fails (or falls back, with a warning): the load's own buffer, made
    # after it, is made without either.  One that failed is not used by a
    # load that asks less either (which might have its smaller buffer).
    for faults, io_depth in (("register#1=invalid_value", 8),
                             ("register#1=invalid_value;host_alloc#1=memory_allocation", 8),
                             ("register#1=invalid_value;host_alloc#1=memory_allocation", 2)):
        sim = Sim(monkeypatch, faults=faults)
        path = save(tmp_path, tensors)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="instant_staging"):
            early = _prepare.PendingStaging(0, EARLY, CHUNK, early=True)
            early._wait()
            prepared = planned_with(sim, path, early, chunk_size=CHUNK, io_depth=io_depth, threads=2)
            assert prepared.reads.spare is early
            assert_same(run(prepared, sim), tensors)
        assert fallback_warnings(caplog) == [], faults
        empty_cache()
        assert sim.live() == 0


@pytest.mark.parametrize("bad", ["missing", "names", "header"])
def test_a_door_that_fails_after_beginning_one_leaves_nothing_pinned(tmp_path, monkeypatch, tensors,
                                                                   bad):
    sim = Sim(monkeypatch)
    path = save(tmp_path, tensors)
    if bad == "header":
        with open(path, "r+b") as f:
            f.write(b"\xff" * 8)            # a header length past the file's end
    source = str(tmp_path / "nope.safetensors") if bad == "missing" else path
    names = ["nope"] if bad == "names" else None
    with pytest.raises((FileNotFoundError, KeyError, ValueError)):
        load_file(source, "cuda:0", names=names, **KNOBS)
    assert sim.events[0] == "early"
    assert len(sim.made) == 1 and sim.made[0].closed    # made, then closed: not kept
    assert _staging_pool.kept() == {} and sim.live() == 0


def test_a_closed_checkpoint_begins_none(tmp_path, monkeypatch, tensors):
    sim = Sim(monkeypatch)
    ck = Checkpoint.open(save(tmp_path, tensors))
    ck.close()
    with pytest.raises(ValueError, match="closed"):
        ck.load("cuda:0", **KNOBS)
    assert sim.made == []


def test_bad_arguments_begin_none(tmp_path, monkeypatch, tensors):
    sim = Sim(monkeypatch)
    path = save(tmp_path, tensors)
    with pytest.raises(ValueError):
        load_file(path, "cuda:0", chunk_size=0)
    with pytest.raises(TypeError):
        load_file(path, "cuda:0", dtype=3)
    with Checkpoint.open(path) as ck, pytest.raises(ValueError, match="not both"):
        ck.load("cuda:0", names=["a"], plan={"a": None})
    assert sim.made == [] and "early" not in sim.events


# -- Ctrl-C at every bytecode of the door -----------------------------------------------

def _staging_threads():
    return [t for t in threading.enumerate() if t.name == "instant_staging-staging"]


class Interrupt:
    """A trace function raising KeyboardInterrupt at the n-th point of
    ``files`` where CPython could run a signal handler (a function's start,
    after a call returns, after a backward jump)."""

    def __init__(self, n, files):
        import dis
        self.n, self.seen, self.files, self.previous = n, 0, files, {}
        self.after = {op for op, name in enumerate(dis.opname)
                      if name.startswith("CALL") or name.startswith("JUMP_BACKWARD")}

    def point(self, frame):
        self.seen += 1
        if self.seen == self.n:
            self.where = f"{frame.f_code.co_name} line {frame.f_lineno}"
            raise KeyboardInterrupt

    def __call__(self, frame, event, arg):
        if frame.f_code.co_filename not in self.files:
            return None
        frame.f_trace_opcodes = True
        if event == "call":
            self.previous[id(frame)] = None
            self.point(frame)
        elif event == "opcode":
            op = frame.f_code.co_code[frame.f_lasti]
            last, self.previous[id(frame)] = self.previous.get(id(frame)), op
            if last in self.after:
                self.point(frame)
        return self


@pytest.mark.slow
# (an interrupt inside a dropped load's __del__ is printed, as CPython prints it)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("entry", ["module", "checkpoint"])
def test_ctrl_c_at_any_bytecode_of_the_door_leaks_nothing(tmp_path, monkeypatch, entry):
    import gc
    import sys

    from instant_staging.loader import _run
    sim = Sim(monkeypatch)
    path = save(tmp_path, mixed_tensors(seed=4, count=6))
    files = {_load.__file__, _checkpoint.__file__, _prepare.__file__, _run.__file__}
    ck = Checkpoint.open(path)

    def door():
        it = iter_load(path, "cuda:0", **KNOBS) if entry == "module" else ck.iter_load("cuda:0", **KNOBS)
        it.close()
    door()
    empty_cache()
    n, interrupted = 0, 0
    while True:
        n += 1
        trace = Interrupt(n, files)
        sys.settrace(trace)
        try:
            door()
        except KeyboardInterrupt:
            interrupted += 1
        finally:
            sys.settrace(None)
        for t in _staging_threads():
            t.join(30)
        sim.made.clear()        # (this test's own references)
        empty_cache()
        if sim.live():
            gc.collect()        # (only then: 0.2 s with torch imported)
            empty_cache()
        assert sim.live() == 0, f"(interrupt at {trace.where}) a staging buffer left pinned"
        if trace.seen < n:
            break
    ck.close()
    assert interrupted > 50


# -- fork ----------------------------------------------------------------------------

_FORK = r"""
import os, sys
import instant_staging as ist
from instant_staging.loader import _prepare, _staging_pool
from instant_staging.testing import SimulatedRuntime
rt = SimulatedRuntime()
_staging_pool._make = lambda size, segment: ist.StagingBuffer(size, runtime=rt, segment_size=segment,
                                                              prefault_threads=0)
early = _prepare.PendingStaging(0, 1 << 20, 1 << 16, early=True)
pid = os.fork()
if pid == 0:
    calls = len(rt.calls)
    early.discard()                 # the parent's thread is not here: nothing waited for or closed
    os._exit(0 if len(rt.calls) == calls else 3)
_, status = os.waitpid(pid, 0)
early.discard()
print("child", os.waitstatus_to_exitcode(status), "parent live", rt.live_registrations,
      "kept", len(_staging_pool.kept()))
"""


def test_fork_child_discards_only_its_copy():
    proc = run_child(_FORK)
    assert proc.returncode == 0, proc.stderr
    assert "child 0 parent live 0 kept 0" in proc.stdout, proc.stdout
