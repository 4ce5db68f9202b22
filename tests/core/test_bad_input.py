"""Every rejected value and its message, table-driven.

docs/design.md "Bad input": a clear error before anything is allocated,
TypeError for a wrong type, ValueError for a wrong value.  Each row asserts
the exception, a fragment of its message, and that nothing was allocated:
the SimulatedRuntime saw no call, its live counters are 0, and no
StagingBuffer survived.  Covered: StagingBuffer arguments, fault specs (in
every place a spec enters), prefault thread counts (argument and
INSTANT_STAGING_PREFAULT_THREADS), and spans().
"""

import gc

import pytest

import instant_staging as ist
from instant_staging.testing import FaultPlan, SimulatedRuntime, inject_faults

from support import PAGE, SEG, SIZE, run_child

BIG = 2 ** 64                   # one past size_t


def live_buffers():
    """StagingBuffers still alive anywhere in this process."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is ist.StagingBuffer)


def assert_nothing_allocated(rt, buffers_before):
    assert rt.calls == []
    assert rt.live_registrations == 0 and rt.live_host_allocs == 0
    assert rt.pending_error == 0
    assert live_buffers() == buffers_before


# -- StagingBuffer arguments -----------------------------------------------------

BAD = [
    # size
    (dict(size="1GiB"), TypeError, "size must be an int"),
    (dict(size=1.5), TypeError, "size must be an int"),
    (dict(size=True), TypeError, "size must be an int"),
    (dict(size=None), TypeError, "size must be an int"),
    (dict(size=0), ValueError, "size must be >= 1"),
    (dict(size=-5), ValueError, "size must be >= 1"),
    (dict(size=BIG), ValueError, "size must be <="),
    # alignment
    (dict(alignment=PAGE * 3), ValueError, "power of two"),
    (dict(alignment=PAGE // 2), ValueError, "alignment must be >="),
    (dict(alignment=0), ValueError, "alignment must be >="),
    (dict(alignment=-PAGE), ValueError, "alignment must be >="),
    (dict(alignment=BIG), ValueError, "alignment must be <="),
    (dict(alignment="4096"), TypeError, "alignment must be an int"),
    (dict(alignment=float(PAGE)), TypeError, "alignment must be an int"),
    # segment_size
    (dict(segment_size=0), ValueError, "segment_size must be >= 1"),
    (dict(segment_size=-PAGE), ValueError, "segment_size must be >= 1"),
    (dict(segment_size=PAGE + 1), ValueError, "multiple of the page size"),
    (dict(segment_size=PAGE // 2), ValueError, "multiple of the page size"),
    (dict(segment_size=BIG), ValueError, "segment_size must be <="),
    (dict(segment_size="256MiB"), TypeError, "segment_size must be an int"),
    (dict(segment_size=None), TypeError, "segment_size must be an int"),
    # copy_unit
    (dict(copy_unit=SEG + 1), ValueError, "copy_unit"),
    (dict(copy_unit=0), ValueError, "copy_unit must be >= 1"),
    (dict(copy_unit=-1), ValueError, "copy_unit must be >= 1"),
    (dict(copy_unit=3 * PAGE + 1), ValueError, "no segment size"),   # lcm with the page > SEG
    (dict(copy_unit=BIG), ValueError, "copy_unit must be <="),
    (dict(copy_unit=1.0), TypeError, "copy_unit must be an int"),
    # flags
    (dict(register_flags=-1), ValueError, "register_flags"),
    (dict(register_flags=1 << 32), ValueError, "register_flags must fit in 32 bits"),
    (dict(register_flags=1 << 70), ValueError, "register_flags"),
    (dict(register_flags="0"), TypeError, "register_flags must be an int"),
    (dict(alloc_flags=1 << 40), ValueError, "alloc_flags"),
    (dict(alloc_flags=-2), ValueError, "alloc_flags"),
    (dict(alloc_flags=None), TypeError, "alloc_flags must be an int"),
    # prefault_threads
    (dict(prefault_threads=-1), ValueError, "prefault_threads must be >= 0"),
    (dict(prefault_threads=1025), ValueError, "prefault_threads must be <= 1024"),
    (dict(prefault_threads=1 << 70), ValueError, "prefault_threads must be <="),
    (dict(prefault_threads=2.0), TypeError, "prefault_threads must be an int"),
    (dict(prefault_threads="4"), TypeError, "prefault_threads must be an int"),
    (dict(prefault_threads=True), TypeError, "prefault_threads must be an int"),
    # runtime
    (dict(runtime="cuda"), TypeError, "runtime must be"),
    (dict(runtime=object()), TypeError, "runtime must be"),
    (dict(runtime=SimulatedRuntime), TypeError, "runtime must be"),   # the class
    # the call itself
    (dict(bogus=1), TypeError, "bogus"),
]


def _id(kwargs):
    # (an object's repr holds its address: an id that differs between
    # processes, which pytest-xdist's workers must agree on)
    name, value = next(iter(kwargs.items()))
    shown = repr(value) if type(value).__repr__ is not object.__repr__ else type(value).__name__
    return f"{name}={shown}"[:40]


@pytest.mark.parametrize("kwargs,exc,message", BAD,
                         ids=[_id(k) for k, _, _ in BAD])
def test_bad_argument_rejected_before_allocation(kwargs, exc, message):
    rt = SimulatedRuntime()
    before = live_buffers()
    kw = dict(size=SIZE, segment_size=SEG, runtime=rt, prefault_threads=0)
    kw.update(kwargs)
    size = kw.pop("size")
    with pytest.raises(exc, match=message):
        ist.StagingBuffer(size, **kw)
    assert_nothing_allocated(rt, before)


@pytest.mark.parametrize("args", [(), (SIZE, SEG)], ids=["no size", "positional segment"])
def test_wrong_call_shapes(args):
    """size is required; everything after it is keyword-only."""
    rt = SimulatedRuntime()
    before = live_buffers()
    with pytest.raises(TypeError):
        ist.StagingBuffer(*args, runtime=rt)
    assert_nothing_allocated(rt, before)


def test_init_may_not_run_twice():
    rt, rt2 = SimulatedRuntime(), SimulatedRuntime()
    buf = ist.StagingBuffer(PAGE, runtime=rt, prefault_threads=0)
    with pytest.raises(RuntimeError, match="only once"):
        buf.__init__(PAGE, runtime=rt2)
    assert rt2.calls == [] and rt.live_registrations == 1
    buf.close()
    assert rt.live_registrations == 0


@pytest.mark.parametrize("size,alignment", [
    (2 ** 63, None),                 # more than any host has: mmap says ENOMEM
    (2 ** 64 - 1, None),             # rounding up to a page would wrap
    (2 ** 64 - PAGE, None),
    (2 ** 63 + 2 * PAGE, 2 ** 63),   # over-mapping for the alignment would wrap
    (PAGE, 2 ** 63),
])
def test_impossible_sizes_fail_in_allocate_without_a_crash(size, alignment):
    """Valid values no host can satisfy: StagingError from step 1, no runtime call.

    Run in a child process: the wrapped-length bug this guards against
    unmapped the interpreter's own memory (SIGSEGV).
    """
    out = run_child(f"""
        import instant_staging as ist
        from instant_staging.testing import SimulatedRuntime
        rt = SimulatedRuntime()
        try:
            ist.StagingBuffer({size}, alignment={alignment}, runtime=rt, prefault_threads=0)
        except ist.StagingError as e:
            assert [(a.step, a.ok) for a in e.attempts] == [("allocate", False)], e.attempts
            assert "could not allocate" in str(e), str(e)
            assert ". " not in str(e).split(":")[0], str(e)     # "8. GiB": a stray dot
            assert rt.calls == [], rt.calls
            print("ok")
    """)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# -- fault specs -------------------------------------------------------------------

BAD_SPECS = [
    ("bogus=1", "unknown operation"),
    ("=invalid_value", "missing operation"),
    ("register", "missing '=ERROR'"),
    ("register=", "missing error"),
    ("register=bogus", "unknown error"),
    ("register=-1", "unknown error"),
    ("register=0", "success"),
    ("register=2147483648", "does not fit"),
    ("register#0=1", "call index"),
    ("register#-1=1", "call index"),
    ("register#x=1", "call index"),
    ("register#1.5=1", "call index"),
    ("register#=1", "missing N"),
    ("register>=1", "missing '=ERROR'"),       # '>=' wins: SIZE 1, then no '='
    ("register>=", "missing '=ERROR'"),
    ("register>=invalid_value", "missing '=ERROR'"),
    ("register>abc=1", "not a size"),
    ("register>1TiB=1", "not a size"),
    ("register>-1=1", "non-negative"),
    ("register>1.5=1", "whole"),
    ("register!1=1", "expected"),
    ("register 1=1", "expected"),
    ("register#1=1=2", "unknown error"),
    ("register=1;;unregister#2=invalid_value;host_alloc==2", "unknown error"),
    ("register=1;free=1", "unknown operation"),
]


def _bad_rule(spec):
    """The rule of `spec` the error must name (the last one, in these rows)."""
    return [r for r in spec.split(";") if r.strip()][-1].strip()


def _spec_entry_points():
    """Every way a spec enters the package, each returning what it built."""
    return {
        "FaultPlan.parse": lambda spec: FaultPlan.parse(spec),
        "SimulatedRuntime": lambda spec: SimulatedRuntime(faults=spec),
        "inject_faults": lambda spec: inject_faults(SimulatedRuntime(), spec),
    }


@pytest.mark.parametrize("entry", sorted(_spec_entry_points()))
@pytest.mark.parametrize("spec,message", BAD_SPECS, ids=[s for s, _ in BAD_SPECS])
def test_malformed_fault_spec_names_the_rule(spec, message, entry):
    with pytest.raises(ValueError) as info:
        _spec_entry_points()[entry](spec)
    text = str(info.value)
    assert message in text, text
    assert _bad_rule(spec) in text, text


@pytest.mark.parametrize("spec,message", BAD_SPECS[:6], ids=[s for s, _ in BAD_SPECS[:6]])
def test_malformed_env_fault_spec_fails_before_allocation(spec, message, monkeypatch):
    """INSTANT_STAGING_FAULTS is parsed when a buffer asks for the default
    runtime: the error comes before the allocate step."""
    monkeypatch.setenv("INSTANT_STAGING_FAULTS", spec)
    before = live_buffers()
    with pytest.raises(ValueError, match=message):
        ist.StagingBuffer(SIZE, prefault_threads=0)
    assert live_buffers() == before


@pytest.mark.parametrize("spec", [5, None, b"register=1", ["register=1"]])
def test_fault_spec_of_the_wrong_type(spec):
    with pytest.raises(TypeError):
        FaultPlan.parse(spec)


# -- prefault thread counts ----------------------------------------------------------

BAD_ENV_THREADS = ["-1", "abc", "1.5", "1025", "99999999999", "0x10", "4 threads"]


@pytest.mark.parametrize("value", BAD_ENV_THREADS)
def test_bad_prefault_threads_env(value, monkeypatch):
    monkeypatch.setenv("INSTANT_STAGING_PREFAULT_THREADS", value)
    rt = SimulatedRuntime()
    before = live_buffers()
    with pytest.raises(ValueError, match="INSTANT_STAGING_PREFAULT_THREADS") as info:
        ist.StagingBuffer(SIZE, runtime=rt)        # prefault_threads=None: the env decides
    assert repr(value) in str(info.value)
    assert_nothing_allocated(rt, before)
    with pytest.raises(ValueError, match="INSTANT_STAGING_PREFAULT_THREADS"):
        ist.auto_prefault_threads(SIZE)


@pytest.mark.parametrize("value,threads", [("0", 0), (" 3 ", 3), ("1024", 1024), ("", None)])
def test_good_prefault_threads_env(value, threads, monkeypatch):
    """The rows just inside the bounds, so the rejections above are not vacuous."""
    monkeypatch.setenv("INSTANT_STAGING_PREFAULT_THREADS", value)
    if threads is not None:
        assert ist.auto_prefault_threads(SIZE) == threads
    rt = SimulatedRuntime()
    with ist.StagingBuffer(SIZE, runtime=rt):     # at most one thread per page
        pass
    assert rt.live_registrations == 0


def test_explicit_prefault_threads_ignore_the_env(monkeypatch):
    monkeypatch.setenv("INSTANT_STAGING_PREFAULT_THREADS", "abc")
    rt = SimulatedRuntime()
    with ist.StagingBuffer(SIZE, runtime=rt, prefault_threads=0) as buf:
        assert [a.step for a in buf.attempts] == ["allocate", "register"]


@pytest.mark.parametrize("value", ["maybe", "2", "enable", "y"])
def test_bad_hugepages_env(value, monkeypatch):
    """INSTANT_STAGING_HUGEPAGES, read when hugepages=None, is checked as strictly."""
    monkeypatch.setenv("INSTANT_STAGING_HUGEPAGES", value)
    rt = SimulatedRuntime()
    before = live_buffers()
    with pytest.raises(ValueError, match="INSTANT_STAGING_HUGEPAGES") as info:
        ist.StagingBuffer(SIZE, runtime=rt, prefault_threads=0)
    assert repr(value) in str(info.value)
    assert_nothing_allocated(rt, before)


# -- spans -----------------------------------------------------------------------------

BAD_SPANS = [
    ((-1, None), ValueError, "offset must be >= 0"),
    ((SIZE + 1, None), ValueError, "outside the buffer"),
    ((0, SIZE + 1), ValueError, "outside the buffer"),
    ((SIZE - 1, 2), ValueError, "outside the buffer"),
    ((0, -1), ValueError, "nbytes must be >= 0"),
    ((BIG, None), ValueError, "offset"),
    ((0, BIG), ValueError, "nbytes"),
    (("0", None), TypeError, "offset must be an int"),
    ((None, None), TypeError, "offset must be an int"),
    ((0, 1.5), TypeError, "nbytes must be an int"),
    ((True, None), TypeError, "offset must be an int"),
]


@pytest.mark.parametrize("args,exc,message", BAD_SPANS, ids=[repr(a) for a, _, _ in BAD_SPANS])
def test_bad_spans(args, exc, message):
    rt = SimulatedRuntime(faults="register#1=invalid_value")     # SEGMENTED: 3 ranges
    buf = ist.StagingBuffer(SIZE, runtime=rt, segment_size=SEG, prefault_threads=0)
    calls = rt.calls
    with pytest.raises(exc, match=message):
        buf.spans(*args)
    assert rt.calls == calls                       # no runtime call, nothing changed
    assert rt.covers(buf.ptr, SIZE) and not buf.closed
    buf.close()
    with pytest.raises(ValueError, match="closed"):
        buf.spans()
    with pytest.raises(ValueError, match="closed"):
        buf.spans(*args)                           # closed wins over the bad range
    assert rt.live_registrations == 0


def test_edge_spans_are_accepted():
    """The boundary rows just inside: empty spans at both ends, the whole buffer."""
    rt = SimulatedRuntime()
    with ist.StagingBuffer(SIZE, runtime=rt, prefault_threads=0) as buf:
        assert buf.spans(0, 0) == [] and buf.spans(SIZE) == [] and buf.spans(SIZE, 0) == []
        assert buf.spans(SIZE - 1, 1) == [(buf.ptr + SIZE - 1, 1)]
        assert buf.spans() == [(buf.ptr, SIZE)]


def test_a_fifo_or_a_device_is_an_error_not_a_wait(tmp_path):
    # Opening a FIFO for reading waits for a writer: load_file and safe_open
    # waited forever.  Now they refuse whatever is not a regular file, and
    # leave no descriptor open.
    import os
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    out = run_child(f"""
        import os
        from instant_staging.loader import SafetensorsError, load_file, safe_open
        fds = len(os.listdir("/proc/self/fd"))
        for call in (lambda: load_file({str(fifo)!r}), lambda: safe_open({str(fifo)!r}, "pt"),
                     lambda: load_file("/dev/zero")):
            try:
                call()
            except SafetensorsError as e:
                assert "not a regular file" in str(e), e
            else:
                raise SystemExit("no error")
        assert len(os.listdir("/proc/self/fd")) == fds
        print("ok")
    """, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
