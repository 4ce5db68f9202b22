"""The load command: usage errors, progress output, reports, driven in
subprocesses and through its Python API."""

import io

import pytest

import instant_staging as ist
from instant_staging.cli import load as load_cmd
from instant_staging.testing import SimulatedRuntime

from _cli import MiB, cli, cli_json, needs_no_gpu
from conftest import drop_from_page_cache

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
    assert proc.stdout.startswith(f"{count} tensors, ") and "GB/s" in proc.stdout
    assert "staging: HOST" in proc.stdout
    assert "loaded 100%" in proc.stderr  # not a terminal: plain progress lines


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
    path, _, _ = weights
    r = cli_json("load", str(path), code=1)
    assert r["ok"] is False and r["error"]["type"] == "NoDevice"
    assert "--device cpu" in r["error"]["message"]
    proc = cli("load", str(path))
    assert proc.returncode == 1 and "load failed: NoDevice: cannot load to cuda:0" in proc.stderr
    assert proc.stdout == ""


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
    path = str(tmp_path / "m.safetensors")
    save_file({f"t{i:02d}": torch.full([64 << 10], float(i)) for i in range(32)}, path)
    hot = cli_json("load", path, "--device", "cpu")
    assert (hot["chunk_size"], hot["threads"]) == (ist.defaults.CHUNK_SIZE, None)
    drop_from_page_cache(path)
    cold = cli_json("load", path, "--device", "cpu")
    assert cold["ok"] and cold["tensors"] == 32
    assert (cold["chunk_size"], cold["threads"]) == (ist.defaults.COLD_CHUNK_SIZE,
                                                     ist.defaults.COLD_THREADS)
