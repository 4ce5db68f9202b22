"""Step 2, the prefault, and opt-in huge pages on the simulated runtime.

The prefault is an optimisation: with or without it, with or without huge
pages, a buffer must reach the same kind through the same attempts and
hold the same bytes.  Thread counts are checked before anything is
allocated; a prefault that cannot start its threads is recorded and the
buffer is made anyway.  The benchmarks must run end to end without a GPU.
No assertion here depends on timing.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import instant_staging as ist
from instant_staging.testing import SimulatedRuntime

from support import KIND_FAULTS, PACKAGE_PARENT, PAGE, ROOT, SEG, SIZE, rss

HUGE = 2 << 20
TOO_BIG = 1 << 60               # mmap would fail: a ValueError proves nothing was tried

FAULTS = [(KIND_FAULTS[kind.name], kind) for kind in ist.Kind]
FAULTS.insert(2, ("register#1=invalid_value;register#3=invalid_value",   # second segment:
                  ist.Kind.RUNTIME_PINNED))                               # rollback


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    # The knobs under test must not leak in from the shell running pytest.
    for name in ("INSTANT_STAGING_PREFAULT_THREADS", "INSTANT_STAGING_HUGEPAGES",
                 "INSTANT_STAGING_FAULTS"):
        monkeypatch.delenv(name, raising=False)


def outcome(faults, size=SIZE, **kw):
    """Builds a buffer, writes a pattern, and returns what must not depend
    on the prefault: kind, attempts other than the prefault, segments,
    contents (before and after writing), and what the runtime holds."""
    rt = SimulatedRuntime(faults=faults)
    buf = ist.StagingBuffer(size, runtime=rt, segment_size=SEG, allow_pageable=True, **kw)
    view = memoryview(buf)
    fresh = bytes(view) == bytes(size)
    pattern = bytes((i * 7 + 3) % 256 for i in range(size))
    view[:] = pattern
    same = bytes(view) == pattern
    view.release()
    prefaults = [a for a in buf.attempts if a.step == "prefault"]
    result = dict(
        kind=buf.kind,
        attempts=[(a.step, a.ok, a.code, a.name, a.offset, a.size)
                  for a in buf.attempts if a.step != "prefault"],
        segments=buf.segments, fresh_zero=fresh, round_trip=same,
        live=(rt.live_registrations, rt.live_host_allocs))
    aligned_huge = buf.ptr % HUGE == 0
    buf.close()
    assert rt.live_registrations == 0 and rt.live_host_allocs == 0
    return result, prefaults, aligned_huge


@pytest.mark.parametrize("faults,kind", FAULTS)
def test_prefault_and_hugepages_do_not_change_kind_attempts_or_contents(faults, kind):
    baseline, _, _ = outcome(faults, prefault_threads=0, hugepages=False)
    assert baseline["kind"] is kind
    assert baseline["round_trip"]
    # Fresh mappings read as zeros (the prefault writes zeros); runtime
    # allocations need not.
    assert baseline["fresh_zero"] or kind is ist.Kind.RUNTIME_PINNED
    for threads in (0, 1, 3, 16):
        for huge in (False, True):
            got, prefaults, aligned = outcome(faults, prefault_threads=threads, hugepages=huge)
            assert got == baseline, (threads, huge)
            if threads:
                # Exactly one prefault attempt, right after allocate, over
                # the whole buffer, successful, with its time.
                assert len(prefaults) == 1
                p = prefaults[0]
                assert p.ok and p.code == 0 and (p.offset, p.size) == (0, SIZE)
                assert p.seconds >= 0
            else:
                assert prefaults == []
            if huge and kind is not ist.Kind.RUNTIME_PINNED:
                assert aligned  # MADV_HUGEPAGE needs a 2 MiB-aligned mapping


def test_prefault_attempt_comes_right_after_allocate():
    rt = SimulatedRuntime()
    with ist.StagingBuffer(SIZE, runtime=rt, prefault_threads=2) as buf:
        assert [a.step for a in buf.attempts] == ["allocate", "prefault", "register"]


@pytest.mark.parametrize("size,threads", [(PAGE, 8), (3 * PAGE + 1, 1024),
                                          (5 << 20, 7), (HUGE + PAGE, 3)])
def test_more_threads_than_pages_and_uneven_splits(size, threads):
    # Threads beyond the page count are never started; uneven last ranges
    # stay inside the mapping.  The memory reads as zeros, as unprefaulted.
    rt = SimulatedRuntime()
    for huge in (False, True):
        with ist.StagingBuffer(size, runtime=rt, prefault_threads=threads,
                               hugepages=huge) as buf:
            assert buf.attempts[1].step == "prefault" and buf.attempts[1].ok
            view = memoryview(buf)
            assert view.nbytes == size and bytes(view[-PAGE:]) == bytes(min(PAGE, size))
            view.release()


def test_segment_count_in_the_fallback_warning(caplog):
    # size_t arithmetic once made this 18446744073709551615-ish.
    rt = SimulatedRuntime("register#1=invalid_value")
    with caplog.at_level("WARNING", logger="instant_staging"):
        ist.StagingBuffer(SIZE, runtime=rt, segment_size=SEG, prefault_threads=0).close()
    assert f"retrying as 3 segments of {ist.format_size(SEG)}" in caplog.text


# -- auto_prefault_threads ---------------------------------------------------


@pytest.fixture
def cpus(monkeypatch):
    """Sets how many CPUs auto_prefault_threads sees."""
    def set_cpus(n):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)))
    return set_cpus


def test_auto_threads_h200_host(cpus):
    cpus(16)
    assert ist.auto_prefault_threads(2 << 30) == 16    # the measured 0.70 -> ~0.2 s
    assert ist.auto_prefault_threads(8 << 30) == 16


def test_auto_threads_bounded_by_16_and_by_cpus(cpus):
    cpus(128)
    assert ist.auto_prefault_threads(1 << 40) == 16    # no gain measured past 16
    cpus(6)
    assert ist.auto_prefault_threads(2 << 30) == 6
    cpus(1)
    assert ist.auto_prefault_threads(2 << 30) == 0     # one thread is slower than none


def test_auto_threads_small_sizes(cpus):
    cpus(64)
    assert ist.auto_prefault_threads(1) == 0
    assert ist.auto_prefault_threads(4 << 20) == 0
    assert ist.auto_prefault_threads((64 << 20) - 1) == 0
    assert ist.auto_prefault_threads(64 << 20) == 2
    assert ist.auto_prefault_threads(256 << 20) == 8
    counts = [ist.auto_prefault_threads(s << 20) for s in range(0, 4096, 16)]
    assert counts == sorted(counts)                     # never fewer for more bytes
    assert all(c == 0 or c >= 2 for c in counts)        # never exactly one


def test_auto_threads_rate_and_cap(cpus, monkeypatch):
    # The loader's own buffer: one thread per 4 MiB, up to its reader threads.
    cpus(64)
    assert ist.auto_prefault_threads(128 << 20, bytes_per_thread=4 << 20) == 16
    assert ist.auto_prefault_threads(128 << 20, bytes_per_thread=4 << 20, max_threads=8) == 8
    assert ist.auto_prefault_threads(4 << 20, bytes_per_thread=4 << 20) == 0   # never one
    monkeypatch.setenv("INSTANT_STAGING_PREFAULT_THREADS", "3")
    assert ist.auto_prefault_threads(128 << 20, bytes_per_thread=4 << 20) == 3  # the user's


def test_auto_threads_without_sched_getaffinity(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert ist.auto_prefault_threads(2 << 30) == 4


@pytest.mark.parametrize("value,expected", [("3", 3), (" 5 ", 5), ("0", 0), ("1", 1),
                                            ("1024", 1024)])
def test_env_overrides_auto(monkeypatch, cpus, value, expected):
    cpus(16)
    monkeypatch.setenv("INSTANT_STAGING_PREFAULT_THREADS", value)
    assert ist.auto_prefault_threads(PAGE) == expected          # even for tiny sizes
    assert ist.auto_prefault_threads(2 << 30) == expected
    rt = SimulatedRuntime()
    with ist.StagingBuffer(SIZE, runtime=rt) as buf:
        assert [a.step for a in buf.attempts].count("prefault") == (1 if expected else 0)


def test_explicit_threads_win_over_env(monkeypatch):
    monkeypatch.setenv("INSTANT_STAGING_PREFAULT_THREADS", "not a number")
    with ist.StagingBuffer(SIZE, runtime=SimulatedRuntime(), prefault_threads=0) as buf:
        assert "prefault" not in [a.step for a in buf.attempts]


# -- bad thread counts: rejected before anything is allocated ----------------


@pytest.mark.parametrize("value", ["abc", "-1", "2.5", "1e3", "1025", "0x10", "4 threads"])
def test_env_garbage_rejected_before_allocation(monkeypatch, value):
    monkeypatch.setenv("INSTANT_STAGING_PREFAULT_THREADS", value)
    with pytest.raises(ValueError, match="INSTANT_STAGING_PREFAULT_THREADS"):
        ist.auto_prefault_threads(SIZE)
    rt = SimulatedRuntime()
    # TOO_BIG could never be mapped: a ValueError (not StagingError) shows
    # the check came first.
    with pytest.raises(ValueError, match="INSTANT_STAGING_PREFAULT_THREADS"):
        ist.StagingBuffer(TOO_BIG, runtime=rt)
    assert list(rt.calls) == []


@pytest.mark.parametrize("value,exc,message", [
    (-1, ValueError, "prefault_threads must be >= 0"),
    (-(1 << 40), ValueError, "prefault_threads must be >= 0"),
    (1025, ValueError, "prefault_threads must be <= 1024"),
    (2.0, TypeError, "prefault_threads must be an int"),
    ("4", TypeError, "prefault_threads must be an int"),
    (True, TypeError, "prefault_threads must be an int"),
])
def test_bad_thread_counts_rejected_before_allocation(value, exc, message):
    rt = SimulatedRuntime()
    with pytest.raises(exc, match=message):
        ist.StagingBuffer(TOO_BIG, runtime=rt, prefault_threads=value)
    assert list(rt.calls) == []


def test_allocation_failure_is_still_a_staging_error():
    # The control for TOO_BIG above: with valid arguments it fails in allocate.
    with pytest.raises(ist.StagingError) as info:
        ist.StagingBuffer(TOO_BIG, runtime=SimulatedRuntime(), prefault_threads=0)
    assert [a.step for a in info.value.attempts] == ["allocate"]


# -- huge pages: opt-in ------------------------------------------------------


@pytest.mark.parametrize("threads, hugepages", [(0, False), (1, False), (4, False), (4, True)])
@pytest.mark.parametrize("kind_faults", [None, "register=invalid_value"])
def test_release_frees_every_page(threads, hugepages, kind_faults):
    """The threads that faulted the pages free them again (MADV_DONTNEED in
    2 MiB-aligned ranges, then munmap): a released buffer, and the mapping a
    refused registration abandons before cudaHostAlloc, leave nothing
    resident, whatever the thread count."""
    size = 256 << 20
    rt = SimulatedRuntime(faults=kind_faults)
    before = rss()
    buf = ist.StagingBuffer(size, runtime=rt, prefault_threads=threads, hugepages=hugepages)
    if kind_faults is None:
        view = memoryview(buf)
        for offset in range(0, size, PAGE):       # resident, whatever prefaulted
            view[offset] = 1
        view.release()
        assert rss() - before >= size * 0.9
    else:
        # Steps 1-2 mapped and faulted it; step 6 let it go before host_alloc
        # (the simulated host_alloc's memory is not touched yet).
        assert buf.kind is ist.Kind.RUNTIME_PINNED
        assert rss() - before < size * 0.1
    buf.close()
    assert rss() - before < size * 0.1


def vma_flags(ptr):
    """The VmFlags of the mapping holding `ptr` ('hg': MADV_HUGEPAGE)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    return set()


def thp_available():
    return os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(not thp_available(), reason="kernel without transparent huge pages")
@pytest.mark.parametrize("threads", [0, 2])
def test_hugepages_auto_where_free_forced_either_way(threads, monkeypatch):
    from instant_staging import _hugepages
    monkeypatch.delenv("INSTANT_STAGING_HUGEPAGES", raising=False)
    rt = SimulatedRuntime()
    size = 4 * HUGE
    # The host's own reading decides None; the mapping carries what it said.
    with ist.StagingBuffer(size, runtime=rt, prefault_threads=threads) as buf:
        assert buf.hugepages is _hugepages.huge_pages_free(size)
        assert ("hg" in vma_flags(buf.ptr)) is buf.hugepages
    # A host whose 2 MiB blocks are all taken: 4 KiB pages, no compaction asked.
    full = {_hugepages.THP_ENABLED: "always [madvise] never\n",
            _hugepages.BUDDYINFO: "Node 0, zone Normal 9 9 9 9 9 9 9 9 9 0 0\n"}
    monkeypatch.setattr(_hugepages, "_read", full.get)
    with ist.StagingBuffer(size, runtime=rt, prefault_threads=threads) as buf:
        assert "hg" not in vma_flags(buf.ptr) and not buf.hugepages
    with ist.StagingBuffer(size, runtime=rt, prefault_threads=threads, hugepages=True) as buf:
        assert "hg" in vma_flags(buf.ptr) and buf.ptr % HUGE == 0 and buf.hugepages
    # and one whose blocks are free: huge pages unless refused.
    full[_hugepages.BUDDYINFO] = "Node 0, zone Normal 0 0 0 0 0 0 0 0 0 8 0\n"
    with ist.StagingBuffer(size, runtime=rt, prefault_threads=threads) as buf:
        assert "hg" in vma_flags(buf.ptr) and buf.ptr % HUGE == 0
    with ist.StagingBuffer(size, runtime=rt, prefault_threads=threads, hugepages=False) as buf:
        assert "hg" not in vma_flags(buf.ptr)


@pytest.mark.skipif(not thp_available(), reason="kernel without transparent huge pages")
@pytest.mark.parametrize("value,on", [("1", True), ("true", True), ("YES", True), (" on ", True),
                                      ("0", False), ("false", False), ("no", False),
                                      ("off", False), ("", False)])
def test_hugepages_env(monkeypatch, value, on):
    monkeypatch.setenv("INSTANT_STAGING_HUGEPAGES", value)
    with ist.StagingBuffer(SIZE, runtime=SimulatedRuntime(), prefault_threads=2) as buf:
        assert ("hg" in vma_flags(buf.ptr)) is on
        assert buf.kind is ist.Kind.REGISTERED


@pytest.mark.parametrize("value", ["2", "enabled", "always"])
def test_hugepages_env_garbage_rejected_before_allocation(monkeypatch, value):
    monkeypatch.setenv("INSTANT_STAGING_HUGEPAGES", value)
    rt = SimulatedRuntime()
    with pytest.raises(ValueError, match="INSTANT_STAGING_HUGEPAGES"):
        ist.StagingBuffer(TOO_BIG, runtime=rt)
    assert list(rt.calls) == []
    # An explicit argument does not consult the variable.
    with ist.StagingBuffer(SIZE, runtime=rt, hugepages=False, prefault_threads=0) as buf:
        assert buf.kind is ist.Kind.REGISTERED


# -- a prefault that fails is recorded, not fatal ----------------------------

FAILING_PREFAULT = textwrap.dedent("""
    import json, resource
    import instant_staging as ist
    from instant_staging.testing import SimulatedRuntime

    def vm_size():
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024

    rt = SimulatedRuntime()
    size = 64 << 10
    # Room for the buffer and a little more, not for one thread stack
    # (glibc maps 2-8 MiB per thread): pthread_create fails with EAGAIN.
    limit = vm_size() + size + (1 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
    buf = ist.StagingBuffer(size, runtime=rt, prefault_threads=4)
    view = memoryview(buf)
    view[:] = b"\\x5a" * size
    data_ok = bytes(view) == b"\\x5a" * size
    view.release()
    out = dict(kind=buf.kind.name, data_ok=data_ok,
               attempts=[list(a) for a in buf.attempts],
               live=rt.live_registrations)
    buf.close()
    out["live_after"] = rt.live_registrations
    print(json.dumps(out))
""")


def _subprocess_env():
    env = dict(os.environ)
    # The package the tests import (the built tree or tox's installed wheel),
    # never the unbuilt sources a child would find from the repository root.
    env["PYTHONPATH"] = PACKAGE_PARENT + os.pathsep + env.get("PYTHONPATH", "")
    for name in ("INSTANT_STAGING_PREFAULT_THREADS", "INSTANT_STAGING_HUGEPAGES",
                 "INSTANT_STAGING_FAULTS"):
        env.pop(name, None)
    return env


def test_prefault_that_cannot_start_threads_is_recorded_and_not_fatal(tmp_path):
    proc = subprocess.run([sys.executable, "-c", FAILING_PREFAULT], capture_output=True,
                          text=True, timeout=60, env=_subprocess_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    steps = [(a[0], a[1]) for a in out["attempts"]]
    if ("prefault", True) in steps:
        pytest.skip("could not make pthread_create fail under RLIMIT_AS on this host")
    assert steps == [("allocate", True), ("prefault", False), ("register", True)]
    _step, _ok, code, name, offset, size, seconds = out["attempts"][1]
    assert name and code == 0 and seconds >= 0          # errno text, no runtime code
    assert (offset, size) == (0, 64 << 10)
    assert out["kind"] == "REGISTERED" and out["data_ok"]
    assert out["live"] == 1 and out["live_after"] == 0


# -- the benchmarks, end to end on the simulated runtime ---------------------


def run_bench(script, tmp_path, *extra):
    path = tmp_path / f"{script}.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", f"{script}.py"),
         "--sizes", "8MiB", "--runs", "1", "--simulate", "--json", str(path), *extra],
        capture_output=True, text=True, timeout=120, env=_subprocess_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SIMULATED" in proc.stdout and "NO GPU" in proc.stdout
    return json.loads(path.read_text()), proc.stdout


def check_common(doc, benchmark):
    assert doc["benchmark"] == benchmark and doc["schema"] == 1
    assert doc["gpu"] is False and doc["simulated_because"] == "--simulate"
    assert doc["environment"]["gpu"] is False and doc["environment"]["kernel"]
    assert doc["config"]["sizes"] == [8 << 20] and doc["config"]["runs"] == 1
    assert doc["targets"] and all(t["status"] == "SKIP" for t in doc["targets"])
    assert all(set(t) == {"name", "status", "value", "detail"} for t in doc["targets"])


def test_bench_alloc_runs_end_to_end(tmp_path):
    doc, out = run_bench("bench_alloc", tmp_path)
    check_common(doc, "alloc")
    assert "torch_pinned" in doc["skipped"]
    by_kind = {e["kind"]: e for e in doc["results"]}
    assert set(by_kind) == {"default", "registered", "hugepages", "no_prefault", "segmented",
                            "runtime_pinned", "host_alloc", "register_untouched"}
    for kind, e in by_kind.items():
        assert e["size"] == 8 << 20 and e["error"] is None, (kind, e["error"])
        assert e["n_runs"] == 1 and len(e["create_s"]) == len(e["release_s"]) == 1
        assert isinstance(e["create_median_s"], float) and e["release_median_s"] >= 0
        assert e["reached_expected"], (kind, e["reached"])
        mem = e["memory"]
        assert mem["ok"], (kind, mem["problems"])
        assert {"rss_delta", "rss_peak_delta", "sys_delta", "sys_peak_delta",
                "expected", "own_mapping"} <= set(mem)
    assert by_kind["segmented"]["reached"] == ["SEGMENTED"]
    assert by_kind["runtime_pinned"]["reached"] == ["RUNTIME_PINNED"]
    assert "register" in by_kind["registered"]["phases_median_s"]
    # The default's choice of pages is the auto rule's, with its reason.
    (pages,) = {p.split(":")[0] for p in by_kind["default"]["pages"]}
    assert pages in ("huge pages", "4 KiB pages") and "auto" in by_kind["default"]["pages"][0]
    assert "runtime_alloc" in by_kind["runtime_pinned"]["phases_median_s"]
    assert "Targets" in out and "SKIP" in out


def test_bench_h2d_runs_end_to_end(tmp_path):
    doc, _out = run_bench("bench_h2d", tmp_path)
    check_common(doc, "h2d")
    assert "memcpy_async" in doc["copy_api"]
    by_kind = {e["kind"]: e for e in doc["results"]}
    assert set(by_kind) == {"registered", "hugepages", "segmented", "runtime_pinned",
                            "pageable_fallback", "host_alloc", "pageable"}
    for kind, e in by_kind.items():
        assert e["error"] is None and e["reached_expected"], (kind, e)
        chunked = e["modes"]["chunked"]
        assert chunked["verified"] and len(chunked["gbps"]) == 1
        assert chunked["gbps_median"] > 0
        if kind == "segmented":
            assert "skipped" in e["modes"]["whole"]
        else:
            assert e["modes"]["whole"]["verified"]
    assert by_kind["pageable_fallback"]["reached"] == "PAGEABLE"
    assert by_kind["registered"]["pinned"] and not by_kind["pageable"]["pinned"]


def test_benchmarks_fall_back_to_the_simulated_runtime_without_a_gpu():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import _common
    finally:
        sys.path.pop(0)
    setup = _common.pick_runtime()
    code, count = ist.real_runtime().device_count()
    if code == 0 and count > 0:
        assert setup.gpu and setup.why_simulated is None
    else:
        assert not setup.gpu and setup.why_simulated and setup.runtime.name == "simulated"
        assert "SIMULATED" in setup.label
