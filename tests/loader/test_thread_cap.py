"""Reader threads and slots are bounded by what the host can use (issue 21,
finding 1): ``threads`` above ``defaults.max_reader_threads()`` and
``io_depth`` above ``defaults.max_io_depth(threads)`` are capped there with
one warning, whether they come from the argument, INSTANT_STAGING_THREADS /
INSTANT_STAGING_IO_DEPTH or the CLI's flags.  The threads a load starts are
counted in /proc while a cold load runs (the reader threads are C threads
Python does not list)."""

import json
import logging
import os

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

from instant_staging import defaults
from instant_staging.loader import _options, iter_load, load_file, safe_open

from support import drop_from_page_cache
from support.cli import cli

CHUNK = 64 << 10
N_CHUNKS = 300      # far more chunks than any cap here: unbounded, one thread each


@pytest.fixture
def many_chunks(tmp_path):
    g = torch.Generator().manual_seed(1)
    tensors = {f"t{i:03d}": torch.randint(0, 1 << 30, (CHUNK // 4,), generator=g, dtype=torch.int32)
               for i in range(N_CHUNKS)}
    path = tmp_path / "m.safetensors"
    st.save_file(tensors, path)
    return path, tensors


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(_options, "_warned", set(), raising=False)
    for name in ("INSTANT_STAGING_THREADS", "INSTANT_STAGING_IO_DEPTH", "INSTANT_STAGING_CHUNK_SIZE"):
        monkeypatch.delenv(name, raising=False)


def tasks():
    return len(os.listdir("/proc/self/task"))


def peak_tasks_while_loading(path, **kwargs):
    """(most tasks of this process seen during the load beyond those before
    it, its LoadIterator's thread count, the tensors).  The file is dropped
    from the page cache first: hot, every reader thread had finished before
    the first tensor came out (0 seen, 300 started); cold, 296 of 300 were
    alive then."""
    drop_from_page_cache(path)
    before, peak = tasks(), 0
    with iter_load(path, "cpu", chunk_size=CHUNK, **kwargs) as it:
        got = {}
        for name, t in it:
            peak = max(peak, tasks())
            got[name] = t
        return peak - before, it.threads, got


def test_cap_is_twice_the_usable_cpus():
    assert defaults.max_reader_threads() == defaults.THREADS_PER_CPU * defaults.usable_cpus()
    assert defaults.reader_threads() <= defaults.max_reader_threads()
    assert defaults.max_io_depth(3) == 3 * defaults.MAX_SLOTS_PER_THREAD


@pytest.mark.parametrize("how", ["argument", "env"])
def test_huge_threads_start_at_most_the_cap(many_chunks, monkeypatch, caplog, how):
    path, tensors = many_chunks
    cap = defaults.max_reader_threads()
    kwargs = {}
    if how == "argument":
        kwargs["threads"] = 10 ** 11
    else:
        monkeypatch.setenv("INSTANT_STAGING_THREADS", str(10 ** 11))
    with caplog.at_level(logging.WARNING, logger="instant_staging"):
        extra, threads, got = peak_tasks_while_loading(path, **kwargs)
    assert threads == cap
    assert extra <= cap, f"{extra} threads started for a cap of {cap}"
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    warned = [r.getMessage() for r in caplog.records if "capped at" in r.getMessage()]
    name = "threads" if how == "argument" else "INSTANT_STAGING_THREADS"
    assert warned == [f"{name}=100000000000 is more than this host can use: capped at {cap} "
                      f"({defaults.THREADS_PER_CPU} per usable CPU, {defaults.usable_cpus()} here)"]


def test_the_warning_comes_once_per_value(many_chunks, caplog):
    path, _ = many_chunks
    with caplog.at_level(logging.WARNING, logger="instant_staging"):
        for _ in range(3):
            load_file(path, threads=10 ** 6)
        with safe_open(path, "pt") as f:
            f.get_tensor("t000")
    assert sum("capped at" in r.getMessage() for r in caplog.records) == 1


def test_threads_within_the_cap_are_kept_without_a_warning(many_chunks, caplog):
    path, _ = many_chunks
    with caplog.at_level(logging.WARNING, logger="instant_staging"):
        _, threads, _ = peak_tasks_while_loading(path, threads=defaults.max_reader_threads())
    assert threads == defaults.max_reader_threads()
    assert not [r for r in caplog.records if "capped" in r.getMessage()]


@pytest.mark.parametrize("how", ["argument", "env"])
def test_huge_io_depth_is_capped_at_the_slots_the_threads_use(monkeypatch, caplog, how):
    if how == "env":
        monkeypatch.setenv("INSTANT_STAGING_IO_DEPTH", "99999999999")
        args = (None, None, 2)
    else:
        args = (None, 99_999_999_999, 2)
    with caplog.at_level(logging.WARNING, logger="instant_staging"):
        _, depth, threads = _options.knobs(*args)
    assert (depth, threads) == (2 * defaults.MAX_SLOTS_PER_THREAD, 2)
    name = "io_depth" if how == "argument" else "INSTANT_STAGING_IO_DEPTH"
    assert any(r.getMessage().startswith(f"{name}=99999999999 is more than this host can use")
               for r in caplog.records)


def test_bad_values_are_still_refused_not_capped():
    for value, exc in ((True, TypeError), ("8", TypeError), (0, ValueError), (-5, ValueError)):
        with pytest.raises(exc, match="threads"):
            load_file("/nonexistent.safetensors", threads=value)


def test_the_cli_caps_threads_and_io_depth(many_chunks):
    path, _ = many_chunks
    proc = cli("load", str(path), "--device", "cpu", "--chunk-size", "64KiB",
                    "--threads", "99999999999", "--io-depth", "99999999999", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    cap = defaults.max_reader_threads()
    assert report["threads"] == cap
    assert report["io_depth"] == cap * defaults.MAX_SLOTS_PER_THREAD
    assert report["staging"]["size"] <= cap * defaults.MAX_SLOTS_PER_THREAD * CHUNK
    assert "threads=99999999999 is more than this host can use" in proc.stderr
    assert "Traceback" not in proc.stderr
