"""Lifetimes, each in a fresh interpreter so that a crash is a failure, not
the end of the test run: buffers alive at exit, close() while exported, a
memoryview outliving its StagingBuffer, daemon threads at exit, and fork.

The children run on the SimulatedRuntime, whose books say exactly which
runtime calls were made; they print what they checked and the parent test
asserts on exit status, stdout and an empty stderr.
"""

import textwrap

from support import KIND_FAULTS, run_child


def script(*parts):
    """One program from snippets, each dedented on its own."""
    return "\n".join(textwrap.dedent(p) for p in parts)

# Shared by the children: buffers of every kind on simulated runtimes, and
# logging to stdout so that stderr carries only what must not happen
# (tracebacks, "Exception ignored", sanitizer reports).
PRELUDE = """
import gc, logging, os, sys
logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="LOG %(levelname)s %(message)s")
import instant_staging as ist
from instant_staging.testing import SimulatedRuntime
PAGE = os.sysconf("SC_PAGE_SIZE")
SEG = 4 * PAGE
SIZE = 10 * PAGE + 100
FAULTS = KIND_FAULTS_REPR

def make(kind, **kw):
    rt = SimulatedRuntime(faults=FAULTS[kind], log_limit=None)
    buf = ist.StagingBuffer(SIZE, segment_size=SEG, prefault_threads=0,
                            allow_pageable=True, runtime=rt, **kw)
    assert buf.kind.name == kind, buf.kind
    return rt, buf

def live(rt):
    return rt.live_registrations + rt.live_host_allocs

def runtime_ops(rt):
    return [c for c in rt.calls if c[0] in ("host_register", "host_unregister",
                                            "host_alloc", "free_host")]
KINDS = list(FAULTS)
""".replace("KIND_FAULTS_REPR", repr(KIND_FAULTS))


KINDS = ["REGISTERED", "SEGMENTED", "RUNTIME_PINNED", "PAGEABLE"]


def check(out, expect_lines):
    """The child exited 0, wrote nothing on stderr, and printed these lines."""
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr)
    assert out.stderr == "", out.stderr
    lines = [l for l in out.stdout.splitlines() if not l.startswith("LOG WARNING")]
    assert not any(l.startswith("LOG") for l in lines), lines     # no ERROR logged
    assert lines == expect_lines, out.stdout


def test_buffers_alive_at_interpreter_exit_are_released_quietly():
    """Module globals, a reference cycle, a buffer reachable only from a dying
    object: the atexit handler releases them all while the runtime is loaded.
    A handler registered before the import runs after it and sees the books."""
    out = run_child(script("""
        import atexit
        def report():
            # Registered first, so it runs last: after instant_staging's handler.
            for kind, rt in runtimes.items():
                print(kind, live(rt), len([c for c in runtime_ops(rt) if c[-1] != 0]))
        atexit.register(report)
    """, PRELUDE, """
        runtimes = {}
        keep = []
        for kind in KINDS:
            rt, buf = make(kind)
            memoryview(buf)[:] = b"\\x11" * SIZE
            runtimes[kind] = rt
            if kind == "SEGMENTED":
                cycle = [buf]
                cycle.append(cycle)          # only the collector could free it
            else:
                keep.append(buf)
        del buf, cycle
        gc.disable()                          # the cycle survives to exit
    """))
    check(out, [f"{kind} 0 0" for kind in KINDS])


def test_exported_buffer_survives_exit_handlers_and_daemon_threads():
    """A memoryview alive at exit keeps its memory mapped: a later atexit
    handler and a daemon thread still writing through it must not crash.
    (Before the fix the atexit release unmapped it: SIGSEGV.)"""
    out = run_child(script("""
        import atexit, threading, time
        def late():
            view[0] = 7
            print("late", view[0], live(rt))
        atexit.register(late)
    """, PRELUDE, """
        rt, buf = make("SEGMENTED")
        view = memoryview(buf)
        def writer():
            fill = b"x" * len(view)
            while True:
                view[:] = fill               # a loader thread still filling the buffer
        threading.Thread(target=writer, daemon=True).start()
        time.sleep(0.05)
    """))
    check(out, ["late 7 3"])


def test_close_with_an_exported_memoryview():
    """close() and the context manager refuse while a view (or a numpy array
    over the buffer) is alive; the memory and registrations stay intact."""
    out = run_child(script(PRELUDE, """
        for kind in KINDS:
            rt, buf = make(kind)
            view = memoryview(buf)
            view[:4] = b"abcd"
            before = rt.registered_ranges(), rt.host_allocations()
            try:
                buf.close()
            except BufferError as e:
                assert "exported" in str(e), e
            else:
                raise AssertionError("close() with a live view")
            try:
                with buf:
                    pass
            except BufferError:
                pass
            else:
                raise AssertionError("__exit__ with a live view")
            assert not buf.closed and (rt.registered_ranges(), rt.host_allocations()) == before
            assert bytes(view[:4]) == b"abcd"
            try:
                import numpy
            except ImportError:
                numpy = None
            if numpy is not None:
                array = numpy.frombuffer(buf, dtype=numpy.uint8)
                view.release()
                try:
                    buf.close()
                except BufferError:
                    pass
                else:
                    raise AssertionError("close() under a numpy array")
                assert bytes(array[:4]) == b"abcd"
                del array
            else:
                view.release()
            buf.close()
            assert buf.closed and live(rt) == 0
            print(kind, "ok")
    """))
    check(out, [f"{kind} ok" for kind in KINDS])


def test_memoryview_outlives_its_staging_buffer():
    """Dropping the StagingBuffer object does not release memory a view
    still reaches; the last view (or slice of it) releases it, exactly once."""
    out = run_child(script(PRELUDE, """
        for kind in KINDS:
            rt = SimulatedRuntime(faults=FAULTS[kind], log_limit=None)
            view = memoryview(ist.StagingBuffer(SIZE, segment_size=SEG, prefault_threads=0,
                                                allow_pageable=True, runtime=rt))
            gc.collect()
            held = live(rt)
            view[:] = bytes(range(256)) * (SIZE // 256) + bytes(SIZE % 256)
            piece = view[PAGE:PAGE + 16]          # a slice shares the export
            view.release()
            gc.collect()
            assert live(rt) == held, "released under a live slice"
            assert bytes(piece) == bytes(range(256))[:16], bytes(piece)
            piece.release()
            gc.collect()
            releases = [c for c in runtime_ops(rt) if c[0] in ("host_unregister", "free_host")]
            assert live(rt) == 0 and all(c[-1] == 0 for c in releases), releases
            print(kind, held, len(releases))
    """))
    check(out, ["REGISTERED 1 1", "SEGMENTED 3 3", "RUNTIME_PINNED 1 1", "PAGEABLE 0 0"])


def test_forked_child_touches_then_releases_without_runtime_calls():
    """After fork the pinning belongs to the parent.  The child may read and
    write its copy of ordinary memory (REGISTERED, SEGMENTED, PAGEABLE) and
    release every buffer (close, collection, exit) without one runtime call;
    the parent's registrations and data stay as they were."""
    out = run_child(script("""
        import atexit, json
        PARENT = __import__("os").getpid()
        def child_exit_report():
            # Runs last in the child (registered before the import): after
            # instant_staging's own atexit release of the child's copies.
            if os.getpid() != PARENT:
                with open(REPORT, "a") as f:
                    f.write(json.dumps({"exit_calls": [len(rt.calls) for rt in rts]}) + "\\n")
        atexit.register(child_exit_report)
    """, PRELUDE, """
        import json, tempfile
        REPORT = tempfile.mktemp()
        rts, bufs = [], []
        for kind in KINDS:
            rt, buf = make(kind)
            memoryview(buf)[:] = b"P" * SIZE
            rts.append(rt)
            bufs.append(buf)
        books = [(rt.registered_ranges(), rt.host_allocations()) for rt in rts]
        calls = [len(rt.calls) for rt in rts]

        pid = os.fork()
        if pid == 0:
            report = {}
            for i, buf in enumerate(bufs):
                if buf.kind.name == "RUNTIME_PINNED":
                    continue       # the driver's memory: off limits in a child (docs/FORK.md)
                view = memoryview(buf)
                assert bytes(view[:1]) == b"P"
                view[:] = b"C" * SIZE                     # touch: the child's own copy
                view.release()
            bufs[0].close()                               # close()
            bufs[1].close(); bufs[1].close()              # twice
            del bufs[2]                                   # collection
            gc.collect()
            # bufs[3] (and bufs[0..1] again) are left to the atexit release.
            report["calls"] = [len(rt.calls) for rt in rts]
            report["books"] = [(rt.registered_ranges(), rt.host_allocations()) for rt in rts]
            with open(REPORT, "a") as f:
                f.write(json.dumps(report) + "\\n")
            sys.exit(0)                                   # a normal exit: atexit runs

        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        with open(REPORT) as f:
            child, at_exit = [json.loads(line) for line in f]
        os.unlink(REPORT)
        assert child["calls"] == calls, (child["calls"], calls)      # no runtime call
        assert at_exit["exit_calls"] == calls, (at_exit, calls)
        assert [tuple(map(lambda r: [tuple(x) for x in r], b)) for b in child["books"]] == \\
               [tuple(b) for b in books]
        # The parent: registrations intact, data its own, release works.
        assert [(rt.registered_ranges(), rt.host_allocations()) for rt in rts] == books
        for rt, buf in zip(rts, bufs):
            assert bytes(memoryview(buf)) == b"P" * SIZE
            assert rt.covers(buf.ptr, SIZE) == (buf.kind.name in ("REGISTERED", "SEGMENTED"))
            buf.close()
            assert live(rt) == 0 and rt.pending_error == 0
            print(buf.kind.name, "ok")
    """))
    check(out, [f"{kind} ok" for kind in KINDS])


def test_fork_child_release_is_not_a_release_for_the_parent():
    """A buffer the child closes is closed only in the child (which unmaps
    its own copy of the memory): the parent's object still reports open and
    releases with the runtime afterwards."""
    out = run_child(script(PRELUDE, """
        def mapped(addr):
            with open("/proc/self/maps") as f:
                for line in f:
                    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                    if lo <= addr < hi:
                        return True
            return False

        rt, buf = make("REGISTERED")
        pid = os.fork()
        if pid == 0:
            addr = buf.ptr
            was_mapped = mapped(addr)
            buf.close()
            os._exit(0 if buf.closed and buf.ptr == 0 and was_mapped and not mapped(addr) else 3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert not buf.closed and rt.live_registrations == 1
        buf.close()
        assert [c[0] for c in runtime_ops(rt)] == ["host_register", "host_unregister"]
        print("ok")
    """))
    check(out, ["ok"])
