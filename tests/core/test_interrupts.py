"""An exception at any point of StagingBuffer(...) releases exactly what was
reached: the registrations newest first, then the mapping or the runtime
allocation; nothing of the state machine is reachable from Python.

Deterministic: the module's ``Attempt`` (built right after every runtime
call and every step) and ``logger.warning`` (called between steps) are
replaced by ones that raise KeyboardInterrupt at the n-th call, for every n.
Then real signals, in subprocesses: SIGINT storms while buffers are built
in a loop, and Ctrl-C during a 1 GiB buffer, repeated, with live counters
and the process's memory checked.
"""

import json
import logging

import pytest

import instant_staging as ist
from instant_staging import _staging
from instant_staging.testing import SimulatedRuntime

from support import KIND_FAULTS, MiB, run_child

SIZE = 32 * MiB + 100            # five segments of 8 MiB, the last one short
SEG = 8 * MiB
ROLLBACK = "register#1=invalid_value;register#4=invalid_value"      # -> RUNTIME_PINNED
ROLLBACK_FAILS = ROLLBACK + ";unregister#1=invalid_value"           # -> RollbackError
SPECS = list(KIND_FAULTS.values()) + [ROLLBACK, ROLLBACK_FAILS]


def vm_size():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize")


def build(rt, **kw):
    return ist.StagingBuffer(SIZE, segment_size=SEG, prefault_threads=0, allow_pageable=True,
                             runtime=rt, **kw)


def calls_without_interrupt(spec, attribute):
    """How often one construction calls _staging.<attribute>."""
    counter = Interrupt(None, getattr(_staging, attribute))
    rt = SimulatedRuntime(faults=spec)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_staging, attribute, counter)
            build(rt).close()
    except ist.RollbackError:
        pass
    return counter.calls


class Interrupt:
    """Calls through to `wrapped`, except the n-th call: KeyboardInterrupt."""

    def __init__(self, n, wrapped):
        self.n, self.wrapped, self.calls = n, wrapped, 0

    def __call__(self, *args, **kw):
        self.calls += 1
        if self.calls == self.n:
            raise KeyboardInterrupt
        return self.wrapped(*args, **kw)


def check_interrupted_everywhere(spec, attribute, target):
    total = calls_without_interrupt(spec, attribute)
    assert total >= 1
    before = vm_size()
    for n in range(1, total + 1):
        rt = SimulatedRuntime(faults=spec)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(target, attribute, Interrupt(n, getattr(target, attribute)))
            with pytest.raises(KeyboardInterrupt):
                build(rt)
        # A rollback whose unregister fails retains that one range, on purpose.
        assert rt.live_registrations <= (1 if spec == ROLLBACK_FAILS else 0), (spec, n)
        assert rt.live_host_allocs == 0, (spec, n)
        assert rt.pending_error == 0, (spec, n)
    # Each interrupted construction mapped SIZE bytes: all of it is gone
    # (retained memory of ROLLBACK_FAILS excepted, at most one per run).
    retained = total * SIZE if spec == ROLLBACK_FAILS else 0
    assert vm_size() - before < SIZE + retained


@pytest.mark.parametrize("spec", SPECS)
def test_interrupt_after_every_runtime_call_and_step(spec):
    # Attempt(...) is built right after each runtime call / step returns.
    check_interrupted_everywhere(spec, "Attempt", _staging)


@pytest.mark.parametrize("spec", [s for s in SPECS if s])  # a fallback logs a warning
def test_interrupt_at_every_fallback_warning(spec, caplog):
    caplog.set_level(logging.WARNING, "instant_staging")
    check_interrupted_everywhere_logger(spec)


def check_interrupted_everywhere_logger(spec):
    logger = _staging.logger
    total = 0
    rt = SimulatedRuntime(faults=spec)
    counter = Interrupt(None, logger.warning)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(logger, "warning", counter)
        try:
            build(rt).close()
        except ist.RollbackError:
            pass
    total = counter.calls
    assert total >= 1
    for n in range(1, total + 1):
        rt = SimulatedRuntime(faults=spec)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(logger, "warning", Interrupt(n, logger.warning))
            with pytest.raises(KeyboardInterrupt):
                build(rt)
        assert rt.live_registrations == 0 and rt.live_host_allocs == 0, (spec, n)


def test_interrupt_right_after_a_successful_register():
    # The registration exists when the interrupt comes: it is unregistered.
    rt = SimulatedRuntime()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_staging, "Attempt", Interrupt(2, _staging.Attempt))   # allocate, register
        with pytest.raises(KeyboardInterrupt):
            build(rt)
    ops = [c[0] for c in rt.calls if c[0] in ("host_register", "host_unregister")]
    assert ops == ["host_register", "host_unregister"]
    assert rt.live_registrations == 0


def test_interrupted_segments_are_unregistered_newest_first():
    rt = SimulatedRuntime(faults="register#1=invalid_value")
    with pytest.MonkeyPatch.context() as mp:
        # allocate, register, then segments 1..3: interrupted after the third.
        mp.setattr(_staging, "Attempt", Interrupt(5, _staging.Attempt))
        with pytest.raises(KeyboardInterrupt):
            build(rt)
    regs = [c[1] for c in rt.calls if c[0] == "host_register" and c[-1] == 0]
    unregs = [c[1] for c in rt.calls if c[0] == "host_unregister"]
    assert len(regs) == 3 and unregs == regs[::-1]
    assert rt.live_registrations == 0


def test_state_machine_is_not_reachable_from_python():
    rt = SimulatedRuntime()
    with build(rt) as buf:
        for name in ("_run", "_step_allocate", "_step_prefault", "_step_register",
                     "_step_register_segments", "_step_rollback", "_step_runtime_alloc",
                     "_step_pageable", "_register_next", "_unregister_newest", "_release",
                     "_record", "_unmap", "_clear_error", "_name", "_describe",
                     "_last_failure", "_failure_message"):
            assert not hasattr(buf, name), name
        assert rt.live_registrations == 1
    assert rt.live_registrations == 0


# -- real signals, in subprocesses ------------------------------------------------

STORM = """
import gc, os, random, signal, threading, time
import instant_staging as ist
from instant_staging.testing import SimulatedRuntime

MiB = 1 << 20
armed = False
def on_sigint(signum, frame):
    if armed:
        raise KeyboardInterrupt
signal.signal(signal.SIGINT, on_sigint)

def vm():
    with open("/proc/self/status") as f:
        return {l.split(":")[0]: int(l.split()[1]) * 1024 for l in f if l.startswith("Vm")}

stop = False
def storm():
    rng = random.Random(1)
    while not stop:
        time.sleep(rng.uniform(0, 0.0005))
        os.kill(os.getpid(), signal.SIGINT)

def build(spec_rt, arm):
    global armed
    buf = None
    try:
        armed = arm
        buf = ist.StagingBuffer(%(size)d, segment_size=%(seg)d, prefault_threads=2,
                                allow_pageable=True, runtime=spec_rt)
        armed = False
        totals["built"] += 1
    except KeyboardInterrupt:
        armed = False
        totals["interrupted"] += 1
    if buf is not None:
        buf.close()

totals = {"built": 0, "interrupted": 0}
threading.Thread(target=storm, daemon=True).start()
warm = SimulatedRuntime()
for i in range(20):          # the storm's and the workers' memory exist from here on
    build(warm, False)
base = vm()["VmSize"]
runtimes = [warm]
for spec in %(specs)r:
    rt = SimulatedRuntime(faults=spec, log_limit=0)
    runtimes.append(rt)
    for i in range(%(rounds)d):
        build(rt, True)
stop = True
signal.signal(signal.SIGINT, signal.SIG_IGN)
gc.collect()
print("LIVE", sum(rt.live_registrations + rt.live_host_allocs for rt in runtimes))
print("GROWTH", vm()["VmSize"] - base)
print("COUNTS", totals["built"], totals["interrupted"])
"""


def test_sigint_storm_while_building_leaks_nothing():
    specs = list(KIND_FAULTS.values()) + [ROLLBACK]
    size, seg = 8 * MiB + 100, 2 * MiB
    out = run_child(STORM % dict(specs=specs, rounds=60, size=size, seg=seg), timeout=300)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert lines["LIVE"] == "0", out.stdout
    _built, interrupted = map(int, lines["COUNTS"].split())
    assert interrupted > 0, out.stdout           # the storm did reach the constructor
    # One leaked mapping per interrupt would grow by `size` each time.
    assert int(lines["GROWTH"]) < 4 * size, out.stdout


CTRL_C_1GIB = """
import random, signal
import instant_staging as ist
from instant_staging.testing import SimulatedRuntime

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))

def ctrl_c(signum, frame):
    raise KeyboardInterrupt
signal.signal(signal.SIGALRM, ctrl_c)

rt = SimulatedRuntime()
base = rss()
rng = random.Random(7)
interrupted = 0
for i in range(%(rounds)d):
    try:
        signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.001, 0.05))
        buf = ist.StagingBuffer(1 << 30, prefault_threads=4, runtime=rt)
        signal.setitimer(signal.ITIMER_REAL, 0)
        buf.close()
    except KeyboardInterrupt:
        interrupted += 1
signal.setitimer(signal.ITIMER_REAL, 0)
print("LIVE", rt.live_registrations + rt.live_host_allocs)
print("GROWTH", rss() - base)
print("INTERRUPTED", interrupted)
"""


def test_ctrl_c_during_a_1gib_buffer_repeated_does_not_grow_rss():
    out = run_child(CTRL_C_1GIB % dict(rounds=6), timeout=300)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert lines["LIVE"] == "0", out.stdout
    assert int(lines["INTERRUPTED"]) > 0, out.stdout
    assert int(lines["GROWTH"]) < 256 * MiB, out.stdout   # a leak is 1 GiB per interrupt


# -- a checkpoint's file descriptors ---------------------------------------------

# Shards of one 4-byte tensor each, written by hand (no torch in the child).
SHARDS = """
import gc, json, os, random, signal, sys, threading, time
from instant_staging.loader import Checkpoint

def shards(d, n):
    os.makedirs(d)
    for i in range(n):
        header = json.dumps({f"t{i}": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}})
        header += " " * (-len(header) % 8)
        with open(os.path.join(d, f"s{i:04d}.safetensors"), "wb") as f:
            f.write(len(header).to_bytes(8, "little") + header.encode() + bytes(4))
    return d

def fds():
    return set(os.listdir("/proc/self/fd"))
"""

# A KeyboardInterrupt at each point of the loader's open and close paths
# (Checkpoint, safe_open, and the caller's lines that take them) where CPython would run a
# signal handler, in turn: every descriptor is closed in the end, and none
# twice (descriptors opened right after the interrupt, which take the numbers
# just freed, are still open after the checkpoint is gone).
TRACED = SHARDS + """
import dis
from instant_staging.loader import _checkpoint, _load, _safe_open, _shards, safe_open

# CPython runs a handler as a function starts or resumes (RESUME), after a
# call returns and after a backward jump, nowhere else: not between a `with`
# statement's __enter__ and its block, nor before its __exit__.
CHECKS_AFTER = {op for op, name in enumerate(dis.opname)
                if name.startswith("CALL") or name.startswith("JUMP_BACKWARD")}

class Interrupt:
    def __init__(self, n):
        self.n, self.seen, self.previous = n, 0, {}
    def point(self):
        self.seen += 1
        if self.seen == self.n:
            raise KeyboardInterrupt
    def __call__(self, frame, event, arg):
        if frame.f_code.co_filename not in FILES:
            return None
        frame.f_trace_opcodes = True
        if event == "call":
            self.previous[id(frame)] = None
            self.point()
        elif event == "opcode":
            op = frame.f_code.co_code[frame.f_lasti]
            last, self.previous[id(frame)] = self.previous.get(id(frame)), op
            if last in CHECKS_AFTER:
                self.point()
        return self

def cycle(d):
    ck = Checkpoint.open(d)
    ck.close()
    f = safe_open(os.path.join(d, "s0000.safetensors"), framework="pt")
    f.close()

FILES = {_checkpoint.__file__, _shards.__file__, _load.__file__, _safe_open.__file__,
         cycle.__code__.co_filename}
d = shards("ck", 8)
cycle(d)
base = fds()
leaks, reused, n, interrupted = [], [], 0, 0
while True:
    n += 1
    trace = Interrupt(n)
    sys.settrace(trace)
    try:
        cycle(d)
    except KeyboardInterrupt:
        interrupted += 1
        bystanders = [os.open(os.devnull, os.O_RDONLY) for _ in range(10)]
    else:
        bystanders = []
    sys.settrace(None)
    for fd in bystanders:
        try:
            os.fstat(fd)
            os.close(fd)
        except OSError:
            reused.append(n)
    if fds() != base:
        gc.collect()        # (only then: 0.2 s with torch imported)
    if fds() != base:
        leaks.append((n, len(fds() - base)))
        base = fds()
    if trace.seen < n:
        break
print(json.dumps({"leaks": leaks, "closed_twice": reused, "interrupted": interrupted}))
"""


def test_an_interrupt_at_any_bytecode_of_open_or_close_leaks_no_descriptor():
    out = run_child(TRACED, timeout=600)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["interrupted"] > 100, result
    assert not result["leaks"], f"(interrupt at bytecode, descriptors leaked): {result['leaks']}"
    assert not result["closed_twice"], f"a descriptor closed twice at {result['closed_twice']}"


# Real SIGINTs, at random times, while a 300-shard checkpoint is opened and
# closed again and again: every descriptor is closed once the process let go
# of the checkpoints.
STORM_SHARDS = SHARDS + """
armed = False
def on_sigint(signum, frame):
    global armed
    if armed:
        armed = False
        raise KeyboardInterrupt
signal.signal(signal.SIGINT, on_sigint)

stop = False
def storm():
    rng = random.Random(3)
    while not stop:
        time.sleep(rng.uniform(0, GAP))
        os.kill(os.getpid(), signal.SIGINT)

d = shards("ck", 300)
Checkpoint.open(d).close()
base = fds()
threading.Thread(target=storm, daemon=True).start()
interrupted = 0
for i in range(ROUNDS):
    try:
        armed = True
        ck = Checkpoint.open(d)
        ck.close()
        armed = False
    except KeyboardInterrupt:
        interrupted += 1
    ck = None
stop = True
signal.signal(signal.SIGINT, signal.SIG_IGN)
gc.collect()
print(json.dumps({"leaked": len(fds() - base), "interrupted": interrupted}))
"""


def test_sigint_storm_while_opening_and_closing_300_shards_leaks_no_descriptor():
    out = run_child("GAP, ROUNDS = 0.02, 300\n" + STORM_SHARDS, timeout=600)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["interrupted"] > 30, result
    assert result["leaked"] == 0, result
