"""The load command: usage errors, progress output, reports, driven in
subprocesses and through its Python API."""

import io
import os
import re
import subprocess
import sys

import pytest

import instant_staging as ist
from instant_staging.cli import load as load_cmd
from instant_staging.testing import SimulatedRuntime

from support import PACKAGE_PARENT, MiB, child_env, drop_from_page_cache
from support.cli import cli, cli_json, needs_no_gpu

# A size or rate in decimal units: the package shows binary ones only (KiB,
# MiB, GiB; GiB/s), the units its sizes are given in.
DECIMAL = re.compile(r"\d (?:kB|KB|MB|GB|TB)\b|[kMGT]B/s")

# -- load ----------------------------------------------------------------------------------



def test_load_missing_file_is_a_usage_error(tmp_path):
    proc = cli("load", str(tmp_path / "nope.safetensors"))
    assert proc.returncode == 2 and "no such file" in proc.stderr


def test_load_bad_io_depth_is_a_usage_error(tmp_path):
    (tmp_path / "x").write_bytes(b"")
    proc = cli("load", str(tmp_path / "x"), "--io-depth", "0")
    assert proc.returncode == 2 and "must be >= 1" in proc.stderr


def test_progress_bar_and_plain_lines():
    out = io.StringIO()
    bar = load_cmd.Progress(out, bar=True, interval=0)
    for done in range(0, 101, 25):
        bar(done * MiB, 100 * MiB)
    bar.close()
    text = out.getvalue()
    assert text.count("\r") == 5 and text.endswith("\n")
    assert "100% 100 MiB / 100 MiB" in text and "#" * load_cmd.Progress.WIDTH in text
    out = io.StringIO()
    plain = load_cmd.Progress(out, bar=False)
    for done in range(0, 101, 5):
        plain(done, 100)
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 and lines[0].startswith("loaded 10%") and "\r" not in out.getvalue()
    quiet = load_cmd.Progress(io.StringIO(), bar=False, quiet=True)
    quiet(50, 100)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize("bar", [False, True])
def test_progress_rate_is_bytes_moved_over_the_time_of_moving_them(bar):
    # The CLI makes its Progress before torch is imported and the staging
    # buffer made: 5 s of start-up, then 10 GiB moved in 0.1 s (100 GiB/s).
    out, clock = io.StringIO(), Clock()
    progress = load_cmd.Progress(out, bar=bar, interval=0, clock=clock)
    clock.now += 5.0
    total = 10 << 30
    progress(0, total)                      # the load's first report
    for step in range(1, 11):
        clock.now += 0.01
        progress(total * step // 10, total)
    progress.close()
    lines = [t for t in out.getvalue().replace("\r", "\n").splitlines() if t.strip()]
    rates = [float(t.rsplit(", ", 1)[1].split()[0]) for t in lines if "GiB/s" in t]
    assert len(rates) == 10 and all(r == 100.0 for r in rates), lines
    assert lines[-1].strip().endswith("10 GiB / 10 GiB, 100.0 GiB/s" if bar else
                                      "loaded 100%: 10 GiB of 10 GiB, 100.0 GiB/s")
    for line in lines:                      # the package's one unit system: binary
        assert not DECIMAL.search(line), line
    # A first report that already holds bytes counts only what came after it.
    out, clock = io.StringIO(), Clock()
    progress = load_cmd.Progress(out, bar=False, clock=clock)
    progress(total // 2, total)             # no interval yet: no rate
    clock.now += 0.05
    progress(total, total)
    assert out.getvalue().splitlines() == ["loaded 50%: 5 GiB of 10 GiB",
                                           "loaded 100%: 10 GiB of 10 GiB, 100.0 GiB/s"]


def test_format_rate():
    from instant_staging._types import format_rate
    assert [format_rate(r) for r in (0, 999, 1536, 5 * MiB, 36.3e9)] == [
        "0 B/s", "999 B/s", "1.5 KiB/s", "5.0 MiB/s", "33.8 GiB/s"]
    assert format_rate(36.3e9, digits=2) == "33.81 GiB/s"


def test_tqdm_bar_in_the_same_units():
    """tqdm's own bar would say kB, MB and MB/s: ours gives it our sizes and rate."""
    pytest.importorskip("tqdm")
    from instant_staging.loader import _progress
    out, clock = io.StringIO(), Clock()
    bar = _progress.TqdmProgress(out, clock=clock)
    total = 4 << 30
    bar(0, total)
    for step in range(1, 11):
        clock.now += 0.01
        bar(total * step // 10, total)
    text = out.getvalue()
    assert "4 GiB / 4 GiB, 40.0 GiB/s" in text, text
    assert not DECIMAL.search(text), text


@pytest.fixture
def weights(tmp_path):
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    gen = torch.Generator().manual_seed(3)
    tensors = {f"layer.{i}.weight": torch.randn(256, 1024 + i, generator=gen)
               for i in range(6)}
    tensors["bias"] = torch.arange(1000, dtype=torch.int32)
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file(tensors, str(path))
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return path, len(tensors), nbytes


def test_load_to_cpu_reports_tensors_bytes_and_seconds(weights):
    path, count, nbytes = weights
    r = cli_json("load", str(path), "--device", "cpu", "--chunk-size", "64KiB",
                 "--io-depth", "4", "--threads", "2", "--verify")
    assert r["command"] == "load" and r["ok"] is True and r["files"] == [str(path)]
    assert r["tensors"] == count and r["bytes"] == nbytes and r["verified"] is True
    assert r["device"] == "cpu" and r["seconds"] > 0 and r["gbps"] > 0
    assert (r["chunk_size"], r["io_depth"], r["threads"]) == (64 << 10, 4, 2)
    assert r["staging"] == {"kind": "HOST", "pinned": False, "size": 256 << 10,
                            "segment_size": None, "seconds": 0.0, "hugepages": None,
                            "attempts": []}
    proc = cli("load", str(path), "--device", "cpu", "--chunk-size", "64KiB")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"{count} tensors, ") and "iB/s" in proc.stdout
    first = proc.stdout.splitlines()[0]
    assert " MiB to cpu in " in first, first
    assert "staging: HOST" in proc.stdout
    assert "loaded 100%" in proc.stderr  # not a terminal: plain progress lines
    # one unit system in all of a load's output (it said "6.29 MB to cpu"
    # beside "staging: HOST, 256 KiB")
    assert not DECIMAL.search(proc.stdout + proc.stderr), proc.stdout + proc.stderr


def test_load_of_a_bad_file_exits_1(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 64)
    r = cli_json("load", str(bad), "--device", "cpu", code=1)
    assert r["ok"] is False and r["error"]["type"] == "SafetensorsError"
    assert str(bad) in r["error"]["message"]


def test_load_staging_smaller_than_a_chunk_is_a_usage_error(tmp_path):
    (tmp_path / "x").write_bytes(b"")
    proc = cli("load", str(tmp_path / "x"), "--chunk-size", "8MiB", "--staging-size", "4MiB")
    assert proc.returncode == 2 and "--staging-size" in proc.stderr


def test_load_staging_size_on_the_cpu_is_a_usage_error(weights):
    # A CPU load stages through memory of its own: a --staging-size there
    # would be reported as used and not be.
    path, _, _ = weights
    proc = cli("load", str(path), "--device", "cpu", "--staging-size", "64MiB")
    assert proc.returncode == 2 and proc.stdout == ""
    assert "--staging-size sizes the pinned buffer of a GPU load" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()[-1]) > 0


@pytest.mark.gpu
def test_load_reports_tensors_bytes_and_kind(weights):
    path, count, nbytes = weights
    r = cli_json("load", str(path), "--chunk-size", "1MiB", "--io-depth", "4", "--verify")
    assert r["command"] == "load" and r["ok"] is True
    assert r["tensors"] == count and r["bytes"] == nbytes and r["verified"] is True
    assert r["seconds"] > 0 and r["gbps"] > 0 and r["device"] == "cuda:0"
    assert r["staging"]["kind"] == "REGISTERED" and r["staging"]["size"] == 4 * MiB
    assert r["staging"]["segment_size"] % MiB == 0
    assert isinstance(r["staging"]["hugepages"]["on"], bool) and r["staging"]["hugepages"]["why"]
    proc = cli("load", str(path), "--chunk-size", "1MiB")
    assert proc.returncode == 0
    assert f"{count} tensors" in proc.stdout and "staging: REGISTERED" in proc.stdout
    assert "loaded 100%" in proc.stderr  # not a terminal: plain progress lines


@pytest.mark.gpu
def test_load_with_faults_reports_the_fallback_kind(weights):
    path, count, _ = weights
    r = cli_json("load", str(path), "--chunk-size", "1MiB", "--io-depth", "4",
                 env={"INSTANT_STAGING_FAULTS": "register=invalid_value"})
    assert r["tensors"] == count and r["staging"]["kind"] == "RUNTIME_PINNED"


@needs_no_gpu
def test_load_without_gpu_says_so_and_exits_1(weights):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    path, _, _ = weights
    r = cli_json("load", str(path), "--device", "cuda:0", code=1)
    assert r["ok"] is False and r["error"]["type"] == "NoDevice"
    assert "--device cpu" in r["error"]["message"]
    proc = cli("load", str(path), "--device", "cuda:0")
    assert proc.returncode == 1 and "load failed: NoDevice: cannot load to cuda:0" in proc.stderr
    assert proc.stdout == ""


def test_load_without_a_device_goes_where_torch_can(weights):
    """No --device: the current CUDA device where torch sees one, else the CPU."""
    torch = pytest.importorskip("torch")
    path, _, _ = weights
    r = cli_json("load", str(path))
    assert r["ok"] is True
    assert r["device"] == (f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")


def test_load_staging_error_reports_the_attempts(monkeypatch, weights):
    # What a GPU host that pins nothing shows (loads to cuda need a GPU, so
    # the device check is skipped here: the staging error comes first).
    monkeypatch.setattr(load_cmd, "_check_device", lambda device: None)
    rt = SimulatedRuntime(faults="register=invalid_value;host_alloc=memory_allocation")
    with pytest.raises(ist.StagingError) as info:
        load_cmd.load([weights[0]], chunk_size=1 * MiB, io_depth=4, runtime=rt)
    assert [a.step for a in info.value.attempts][-1] == "runtime_alloc"
    assert rt.live_registrations == 0 and rt.live_host_allocs == 0


def test_load_reads_a_cold_checkpoint_with_the_cold_defaults(tmp_path):
    # As load_file: every knob left unset, a checkpoint the page cache lacks.
    import torch
    from safetensors.torch import save_file
    for attempt in range(3):        # a fresh file where the fallback (RWF_NOWAIT) misreports
        path = str(tmp_path / f"m{attempt}.safetensors")    # (loader/test_loader.py's on_a_cold_file)
        save_file({f"t{i:02d}": torch.full([64 << 10], float(i)) for i in range(32)}, path)
        hot = cli_json("load", path, "--device", "cpu")
        # (threads: the reader threads that ran, at most one per chunk)
        assert hot["chunk_size"] == ist.defaults.CHUNK_SIZE and hot["threads"] >= 1
        drop_from_page_cache(path)
        cold = cli_json("load", path, "--device", "cpu")
        assert cold["ok"] and cold["tensors"] == 32
        if cold["chunk_size"] == ist.defaults.COLD_CHUNK_SIZE:
            assert cold["threads"] <= ist.defaults.default_threads(ist.defaults.COLD_THREADS)
            return
    raise AssertionError(f"a cold checkpoint was loaded with {cold['chunk_size']} byte chunks "
                         f"and {cold['threads']} threads, three times")


def test_load_help_states_the_defaults_this_host_uses():
    """--io-depth and --threads say what the loader will use here (the help
    said 32 slots on a host whose one CPU runs one thread of 2 slots)."""
    one_cpu = min(os.sched_getaffinity(0))
    proc = subprocess.run([sys.executable, "-m", "instant_staging", "load", "--help"],
                          cwd=PACKAGE_PARENT, env=child_env({"COLUMNS": "1000"}),
                          capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: os.sched_setaffinity(0, {one_cpu}))
    assert proc.returncode == 0, proc.stderr
    # One entry per option, wrapping undone ("--chunk-size CHUNK_SIZE" puts its help below).
    text = " ".join(proc.stdout.split("options:", 1)[1].split())
    lines = {opt: text.split(f" {opt} ", 1)[1].split(" --", 1)[0]
             for opt in ("--chunk-size", "--io-depth", "--threads")}
    d, cold = ist.defaults, "for a checkpoint the page cache lacks"
    assert (f"else {d.SLOTS_PER_THREAD} per reader thread: {d.SLOTS_PER_THREAD} on this host; "
            f"{d.io_depth_for(None, d.COLD_THREADS)} {cold}") in lines["--io-depth"], lines
    assert f"at most {d.MAX_THREADS}: 1 on this host; {d.COLD_THREADS} {cold}" in lines["--threads"]
    assert (f"else {ist.format_size(d.CHUNK_SIZE)}; {ist.format_size(d.COLD_CHUNK_SIZE)} {cold}"
            in lines["--chunk-size"])


def test_progress_for_a_rank_names_it_and_the_whole():
    from instant_staging.loader import _progress
    out = io.StringIO()
    bar = _progress.for_rank(load_cmd.Progress(out, bar=True, interval=0), 1, 2, 512_000_000)
    bar(0, 256_000_000)
    bar(256_000_000, 256_000_000)
    bar.close()
    last = out.getvalue().split("\r")[-1]
    assert last.startswith("rank 1 of 2: [") and "(its share of 488.28 MiB)" in last, last
    assert "100% 244.14 MiB / 244.14 MiB" in last
    # A caller's callable gets this rank's share, as it is; one rank needs no label.
    calls = []
    mine = calls.append
    assert _progress.for_rank(mine, 1, 2, 10) is mine
    alone = load_cmd.Progress(io.StringIO(), bar=False)
    assert _progress.for_rank(alone, 0, 1, 10).label is None
