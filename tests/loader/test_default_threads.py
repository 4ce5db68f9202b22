"""A default thread count never warns, and the CLI and the API run the same
one (issue 40, items 6 and 8): the remote default (REMOTE_THREADS) and
prefetch's (PREFETCH_THREADS) are capped at what the host can use,
silently (``defaults.default_threads``); a value the user sets above it
is still capped with a warning."""

import json
import logging
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from instant_staging import defaults
from instant_staging.loader import Checkpoint, _options, safe_open

from support import PACKAGE_PARENT, child_env
from support.remote_servers import range_http_server_fixture  # noqa: F401


@pytest.fixture
def one_cpu(monkeypatch, caplog):
    """This process as a host of one usable CPU (the cap: 2 threads), the
    cap's once-per-value memory cleared, warnings recorded."""
    monkeypatch.setattr(defaults, "usable_cpus", lambda: 1)
    monkeypatch.setattr(_options, "_warned", set())
    for name in ("INSTANT_STAGING_THREADS", "INSTANT_STAGING_IO_DEPTH", "INSTANT_STAGING_CHUNK_SIZE"):
        monkeypatch.delenv(name, raising=False)
    caplog.set_level(logging.WARNING, logger="instant_staging")
    return caplog


def _capped(caplog):
    return [r.getMessage() for r in caplog.records if "more than this host can use" in r.getMessage()]


def _tensors(mib):
    # 6 tensors, ``mib`` MiB in all: several chunks of the default chunk
    # size, so that the load runs every thread it may
    n = mib * (1 << 20) // 4 // 6
    return {f"t{i}": torch.full((n,), float(i)) for i in range(6)}


def _file(tmp_path):
    path = str(tmp_path / "model.safetensors")
    safetensors_torch.save_file(_tensors(12), path)
    return path


def test_the_pinned_figures():
    # (benchmarks/RESULTS.md, "Object storage": 16 MiB ranges reached the
    # client's ceiling where 8 MiB fell short)
    assert defaults.REMOTE_CHUNK_SIZE == 16 << 20
    assert defaults.REMOTE_THREADS == 16
    assert defaults.PREFETCH_THREADS == 8


def test_prefetchs_default_never_warns(one_cpu, tmp_path):
    with safe_open(_file(tmp_path), "pt") as f:
        with f.prefetch() as loader:
            assert loader._it.threads == 2          # PREFETCH_THREADS capped, silently
            assert torch.equal(loader.take("t3"), _tensors(12)["t3"])
        assert _capped(one_cpu) == []
        with f.prefetch(threads=8) as loader:       # the user's value: capped, said
            assert loader._it.threads == 2
        assert len(_capped(one_cpu)) == 1


def test_a_remote_load_runs_the_same_default_in_the_api_and_the_cli(one_cpu, range_http_server,
                                                                    tmp_path):
    # an https:// source is read by obstore, an extra (instant_staging[remote])
    # that the quick run (tox -e quick) does not install
    pytest.importorskip("obstore")
    # 3 chunks of REMOTE_CHUNK_SIZE
    safetensors_torch.save_file(_tensors(40), os.path.join(range_http_server.root,
                                                          "model.safetensors"))
    url = range_http_server.url_for("model.safetensors")
    with Checkpoint.open(url) as ck, ck.iter_load("cpu") as it:
        for _ in it:
            pass
    assert it.report.threads == 2 and _capped(one_cpu) == []
    # The command on one CPU (its affinity): the same figure in --json, and
    # no warning about a value nobody set.
    code = ("import os, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from instant_staging.cli.main import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "load", url, "--device", "cpu", "--json"],
                          cwd=PACKAGE_PARENT, env=child_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "more than this host can use" not in proc.stderr, proc.stderr
    assert json.loads(proc.stdout)["threads"] == 2


def test_a_remote_load_keeps_its_own_ranges_where_only_threads_is_given(range_http_server,
                                                                       monkeypatch):
    # (issue 54, item 1: a remote load given threads= alone read 2 MiB
    # ranges, eight times the GETs of its 16 MiB ones; each knob left to
    # the loader is now the checkpoint's own, whatever the others are)
    pytest.importorskip("obstore")
    for name in ("INSTANT_STAGING_CHUNK_SIZE", "INSTANT_STAGING_IO_DEPTH", "INSTANT_STAGING_THREADS"):
        monkeypatch.delenv(name, raising=False)
    safetensors_torch.save_file(_tensors(40), os.path.join(range_http_server.root,
                                                          "model.safetensors"))
    url = range_http_server.url_for("model.safetensors")
    with Checkpoint.open(url) as ck:
        ck.load("cpu", threads=1)
        assert (ck.last_report.chunk_size, ck.last_report.threads) == (defaults.REMOTE_CHUNK_SIZE, 1)
        ck.load("cpu", chunk_size=4 << 20)
        assert ck.last_report.chunk_size == 4 << 20
        ck.load("cpu", chunk_size=4 << 20, threads=1)
        assert (ck.last_report.chunk_size, ck.last_report.threads) == (4 << 20, 1)
        monkeypatch.setenv("INSTANT_STAGING_CHUNK_SIZE", "8MiB")     # a variable sets it as well
        ck.load("cpu", threads=1)
        assert ck.last_report.chunk_size == 8 << 20
