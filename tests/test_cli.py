"""The command line: probe, doctor and load, driven in subprocesses.

The probe runs on the SimulatedRuntime here (and on a GPU host with
--simulate), with faults forcing every kind the state machine can reach,
both errors, and the usage errors.  doctor's checks are fed fake /proc and
/sys files through its Python API.
"""

import io
import json
import os
import subprocess
import sys

import pytest

import instant_staging as ist
from instant_staging.cli import doctor, probe, report
from instant_staging.cli import load as load_cmd
from instant_staging.testing import SimulatedRuntime

from conftest import gpu_count

# The subprocesses import the instant_staging these tests imported (the
# source tree when built in place, site-packages under tox).
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(ist.__file__)))
MiB = 1 << 20
GiB = 1 << 30
# Small and quick: three segments of 16 MiB, 16 MiB, 8 MiB.
SMALL = ["--size", "40MiB", "--segment-size", "16MiB", "--chunk-size", "4MiB",
         "--prefault-threads", "0"]


def error_name(code):
    return SimulatedRuntime().error_name(code)


def cli(*args, env=None):
    """Runs ``python -m instant_staging ARGS``; the CompletedProcess."""
    environ = {k: v for k, v in os.environ.items() if k != "INSTANT_STAGING_FAULTS"}
    environ["PYTHONPATH"] = PACKAGE_PARENT + os.pathsep + environ.get("PYTHONPATH", "")
    environ.update(env or {})
    return subprocess.run([sys.executable, "-m", "instant_staging", *args], cwd=PACKAGE_PARENT,
                          env=environ, capture_output=True, text=True, timeout=300)


def cli_json(*args, env=None, code=0):
    proc = cli(*args, "--json", env=env)
    assert proc.returncode == code, proc.stdout + proc.stderr
    return json.loads(proc.stdout)  # one object, nothing else on stdout


def steps(result):
    return [(a["step"], a["ok"]) for a in result["attempts"]]


# -- probe: every kind, on the simulated runtime --------------------------------

SEGMENTS = [[0, 16 * MiB], [16 * MiB, 16 * MiB], [32 * MiB, 8 * MiB]]
SEGMENT_STEPS = [("register_segment", True)] * 3


@pytest.mark.parametrize("faults,kind,expected_steps,segments", [
    (None, "REGISTERED", [("allocate", True), ("register", True)], [[0, 40 * MiB]]),
    ("register#1=invalid_value", "SEGMENTED",
     [("allocate", True), ("register", False)] + SEGMENT_STEPS, SEGMENTS),
    ("register=invalid_value", "RUNTIME_PINNED",
     [("allocate", True), ("register", False), ("register_segment", False),
      ("runtime_alloc", True)], [[0, 40 * MiB]]),
    ("register#1=invalid_value;register#4=memory_allocation", "RUNTIME_PINNED",
     [("allocate", True), ("register", False), ("register_segment", True),
      ("register_segment", True), ("register_segment", False), ("rollback", True),
      ("rollback", True), ("runtime_alloc", True)], [[0, 40 * MiB]]),
])
def test_probe_reaches_each_pinned_kind_and_verifies_the_copy(faults, kind, expected_steps,
                                                              segments):
    args = ["probe", "--simulate", *SMALL] + (["--faults", faults] if faults else [])
    r = cli_json(*args)
    assert r["command"] == "probe" and r["simulated"] is True and r["gpu"] is None
    assert r["runtime_version"] is None and r["driver_version"] is None  # none was asked
    assert r["ok"] is True and r["error"] is None
    assert r["kind"] == kind and r["pinned"] is True
    assert steps(r) == expected_steps
    assert r["segments"] == segments
    assert r["faults"] == faults and r["faults_from"] == ("--faults" if faults else None)
    assert r["size"] == 40 * MiB and r["segment_size"] == 16 * MiB
    assert r["chunk_size"] == 4 * MiB and r["backend"] == ist.BACKEND
    for a in r["attempts"]:
        assert set(a) == {"step", "ok", "code", "name", "offset", "size", "seconds"}
        assert a["seconds"] >= 0
        assert (a["code"] == 0) == (a["ok"] or a["step"] in ("allocate", "prefault"))
        assert a["name"] == (error_name(a["code"]) if a["code"] else "")
    c = r["copy"]
    assert c["ok"] is True and c["verified"] is True and c["error"] is None
    assert c["bytes"] == 40 * MiB and c["chunks"] == 10 and c["copies"] == 10
    assert c["split_chunks"] == 0
    assert c["h2d_gbps"] > 0 and c["d2h_gbps"] > 0 and c["h2d_seconds"] > 0
    assert r["create_seconds"] > 0


def test_probe_text_names_steps_errors_and_kind():
    proc = cli("probe", "--simulate", *SMALL, "--faults", "register=invalid_value")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "SIMULATED" in out
    assert "faults (--faults): register=invalid_value" in out
    lines = out.splitlines()
    register = next(l for l in lines if l.strip().startswith("register "))
    assert f"FAILED {error_name(1)} (1)" in register and "[0, 40 MiB)" in register
    segment = next(l for l in lines if l.strip().startswith("register_segment"))
    assert "[0, 16 MiB)" in segment and "FAILED" in segment
    assert any(l.strip().startswith("runtime_alloc") and " ok " in l for l in lines)
    assert "SIMULATED kind: RUNTIME_PINNED (pinned)" in out
    assert "host-to-device" in out and "GB/s" in out and "data verified" in out
    # The fallbacks are logged once each, on stderr.
    assert "retrying as 3 segments of 16 MiB" in proc.stderr
    assert proc.stderr.count("falling back to") == 1


def test_probe_pageable_with_allow_pageable():
    r = cli_json("probe", "--simulate", *SMALL, "--allow-pageable",
                 "--faults", "register=invalid_value;host_alloc=memory_allocation")
    assert r["ok"] is True and r["kind"] == "PAGEABLE" and r["pinned"] is False
    assert steps(r)[-2:] == [("runtime_alloc", False), ("pageable", True)]
    assert r["attempts"][-2]["code"] == 2
    assert r["copy"]["verified"] is True
    text = cli("probe", "--simulate", *SMALL, "--allow-pageable",
               "--faults", "register=invalid_value;host_alloc=memory_allocation").stdout
    assert "kind: PAGEABLE (NOT pinned" in text


def test_probe_staging_error_exit_1_with_attempts():
    faults = "register=invalid_value;host_alloc=memory_allocation"
    r = cli_json("probe", "--simulate", *SMALL, "--faults", faults, code=1)
    assert r["ok"] is False and r["kind"] is None and r["copy"] is None
    assert r["error"]["type"] == "StagingError" and r["error"]["code"] == 2
    assert "allow_pageable" in r["error"]["message"]
    assert steps(r) == [("allocate", True), ("register", False), ("register_segment", False),
                        ("runtime_alloc", False)]
    proc = cli("probe", "--simulate", *SMALL, "--faults", faults)
    assert proc.returncode == 1
    assert "StagingError: no staging buffer of 40 MiB" in proc.stdout
    assert f"FAILED {error_name(2)} (2)" in proc.stdout


def test_probe_rollback_error_exit_1_with_retained_ranges():
    # Whole fails, segments 1 and 2 succeed, 3 fails, undoing segment 2 fails.
    faults = "register#1=invalid_value;register#4=invalid_value;unregister#1=invalid_value"
    r = cli_json("probe", "--simulate", *SMALL, "--faults", faults, code=1)
    assert r["error"]["type"] == "RollbackError"
    retained = r["error"]["retained_ranges"]
    assert len(retained) == 1 and retained[0][1] == 16 * MiB
    assert steps(r)[-2:] == [("rollback", False), ("rollback", True)]
    assert "RollbackError" in cli("probe", "--simulate", *SMALL, "--faults", faults).stdout


def test_probe_chunks_straddling_segments_are_split():
    # 6 MiB chunks over 16 MiB segments: chunks at 12 and 30 MiB straddle.
    r = cli_json("probe", "--simulate", *SMALL, "--chunk-size", "6MiB",
                 "--faults", "register#1=invalid_value")
    c = r["copy"]
    assert r["kind"] == "SEGMENTED" and c["verified"] is True
    assert c["chunks"] == 7 and c["split_chunks"] == 2 and c["copies"] == 9


def test_probe_copy_unit_rounds_segments_so_nothing_splits():
    r = cli_json("probe", "--simulate", *SMALL, "--chunk-size", "6MiB", "--copy-unit", "6MiB",
                 "--faults", "register#1=invalid_value")
    assert r["segment_size"] == 12 * MiB and r["copy_unit"] == 6 * MiB
    assert [s[1] for s in r["segments"]] == [12 * MiB] * 3 + [4 * MiB]
    assert r["copy"]["split_chunks"] == 0 and r["copy"]["verified"] is True


def test_probe_prefault_attempt_and_hugepages_accepted():
    r = cli_json("probe", "--simulate", "--size", "8MiB", "--prefault-threads", "2",
                 "--hugepages")
    assert steps(r) == [("allocate", True), ("prefault", True), ("register", True)]


def test_probe_honours_the_environment_faults():
    r = cli_json("probe", "--simulate", *SMALL, env={"INSTANT_STAGING_FAULTS":
                                                      "register=not_supported"})
    assert r["kind"] == "RUNTIME_PINNED" and r["faults_from"] == "INSTANT_STAGING_FAULTS"
    assert r["attempts"][1]["code"] == 801
    # --faults replaces the variable rather than adding to it.
    r = cli_json("probe", "--simulate", *SMALL, "--faults", "register#1=invalid_value",
                 env={"INSTANT_STAGING_FAULTS": "register=not_supported"})
    assert r["kind"] == "SEGMENTED" and r["faults_from"] == "--faults"


# -- probe without a GPU -----------------------------------------------------------

needs_no_gpu = pytest.mark.skipif(gpu_count() > 0, reason="this host has a GPU")


@needs_no_gpu
def test_probe_without_gpu_says_why_and_simulates():
    proc = cli("probe", *SMALL)
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.startswith("no usable GPU: device_count failed with ")
    assert first.endswith("running the same chain on the SimulatedRuntime")
    assert "SIMULATED kind: REGISTERED" in proc.stdout
    r = cli_json("probe", *SMALL)
    gpu = r["gpu"]
    assert r["simulated"] is True and gpu["available"] is False and gpu["device_count"] == 0
    assert gpu["code"] != 0 and gpu["error"] and gpu["error"] in first
    assert r["runtime_version"] > 0  # the real runtime's, which loads without a driver
    assert r["kind"] == "REGISTERED" and r["copy"]["verified"] is True


@needs_no_gpu
def test_probe_require_gpu_exits_1_without_one():
    proc = cli("probe", *SMALL, "--require-gpu")
    assert proc.returncode == 1
    assert proc.stdout.startswith("no usable GPU: device_count failed with ")
    assert "SIMULATED" not in proc.stdout and "kind:" not in proc.stdout
    r = cli_json("probe", *SMALL, "--require-gpu", code=1)
    assert r["ok"] is False and r["runtime"] is None and r["error"]["type"] == "NoGPU"
    assert r["attempts"] == []


def test_probe_fallback_through_the_python_api():
    # A "real" runtime that sees no device: any host can play one.
    fake = SimulatedRuntime(device_count=0)
    r = probe.probe(8 * MiB, segment_size=4 * MiB, prefault_threads=0,
                    real_runtime=lambda: fake)
    assert r["simulated"] is True and r["ok"] is True
    assert r["gpu"]["error"] == error_name(100) and r["gpu"]["code"] == 100
    assert probe.format_text(r)[0] == (
        f"no usable GPU: device_count failed with {error_name(100)} (100); "
        "running the same chain on the SimulatedRuntime")
    r = probe.probe(8 * MiB, require_gpu=True, real_runtime=lambda: fake)
    assert probe.exit_code(r) == 1 and r["runtime"] is None


def test_probe_uses_the_real_runtime_when_it_has_a_device():
    real = SimulatedRuntime(device_count=2)   # plays a GPU host
    r = probe.probe(8 * MiB, segment_size=4 * MiB, prefault_threads=0,
                    faults="register=invalid_value", real_runtime=lambda: real)
    assert r["simulated"] is False and r["gpu"]["available"] is True
    assert r["gpu"]["device_count"] == 2 and r["gpu"]["device_name"] == "SimulatedRuntime device"
    assert (r["runtime_version"], r["driver_version"]) == (real.runtime_version()[1],
                                                           real.driver_version()[1])
    assert r["kind"] == "RUNTIME_PINNED" and r["copy"]["verified"] is True
    assert real.live_host_allocs == 0 and real.live_device_allocs == 0  # all released


class UnsplitBuffer(ist.StagingBuffer):
    """A buffer whose spans() ignores the registrations, as a naive loader would."""

    def spans(self, offset=0, nbytes=None):
        return [(self.ptr + offset, self.size - offset if nbytes is None else nbytes)]


def test_copy_check_catches_a_copy_across_two_registrations():
    rt = SimulatedRuntime(faults="register#1=invalid_value")
    with UnsplitBuffer(8 * MiB, segment_size=4 * MiB, prefault_threads=0, runtime=rt) as buf:
        assert buf.kind is ist.Kind.SEGMENTED
        bad = probe.copy_check(buf, chunk_size=6 * MiB)
    assert bad["ok"] is False and bad["verified"] is False and bad["h2d_gbps"] is None
    assert bad["error"] == (f"host-to-device copy of 6 MiB at offset 0 failed with "
                            f"{error_name(1)} (1)")
    assert rt.live_device_allocs == 0 and rt.pending_error == 0
    rt = SimulatedRuntime(faults="register#1=invalid_value")
    with ist.StagingBuffer(8 * MiB, segment_size=4 * MiB, prefault_threads=0,
                           runtime=rt) as buf:
        good = probe.copy_check(buf, chunk_size=6 * MiB)
    assert good["ok"] is True and good["split_chunks"] == 1 and good["copies"] == 3
    assert rt.live_device_allocs == 0


class DeafDevice:
    """A runtime whose device-to-host copies report success and copy nothing."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def memcpy_async(self, dst, src, size, kind, stream=0):
        return 0 if kind == 2 else self.inner.memcpy_async(dst, src, size, kind, stream)


class DeafBuffer(ist.StagingBuffer):
    @property
    def runtime(self):
        return DeafDevice(super().runtime)


def test_copy_check_catches_data_that_never_came_back():
    rt = SimulatedRuntime()
    with DeafBuffer(8 * MiB, prefault_threads=0, runtime=rt) as buf:
        result = probe.copy_check(buf, chunk_size=2 * MiB)
    assert result["ok"] is False and result["verified"] is False
    assert result["error"] == ("data read back differs from what was copied, "
                               "first in the chunk at offset 0")
    assert rt.live_device_allocs == 0


# -- usage errors: exit code 2 --------------------------------------------------------

@pytest.mark.parametrize("args,message", [
    (["--size", "12XB"], "not a size: '12XB'"),
    (["--size", "0"], "must be more than 0 bytes"),
    (["--size", "-1GiB"], "--size"),
    (["--segment-size", "1.5KiB"], "segment_size must be a positive multiple of the page size"),
    (["--chunk-size", "lots"], "not a size"),
    (["--copy-unit", "32MiB", "--segment-size", "16MiB"], "copy_unit"),
    (["--prefault-threads", "-1"], "must be >= 0"),
    (["--prefault-threads", "two"], "not an integer"),
    (["--faults", "regster=invalid_value"], "bad fault rule 'regster=invalid_value'"),
    (["--faults", "register=bogus"], "bad fault rule 'register=bogus': unknown error"),
    (["--faults", "register#0=invalid_value"], "bad fault rule 'register#0=invalid_value'"),
    (["--simulate", "--require-gpu"], "not allowed with argument"),
    (["--size", "1MiB", "--simulate", "--prefault-threads", "1x"], "not an integer"),
    (["--bogus"], "unrecognized arguments"),
])
def test_probe_bad_arguments_exit_2(args, message):
    proc = cli("probe", *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert message in proc.stderr and "usage:" in proc.stderr


def test_bad_environment_fault_spec_exit_2():
    proc = cli("probe", "--simulate", *SMALL, env={"INSTANT_STAGING_FAULTS": "register>lots=1"})
    assert proc.returncode == 2
    assert "INSTANT_STAGING_FAULTS: bad fault rule 'register>lots=1'" in proc.stderr


def test_no_command_is_a_usage_error():
    assert cli().returncode == 2
    assert cli("frobnicate").returncode == 2


# -- doctor ------------------------------------------------------------------------------

CHECKS = ["build", "runtime", "driver", "devices", "nvidia_module", "kernel", "wsl",
          "memlock", "transparent_hugepages", "memory", "cgroup"]

OPEN_MODULE = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  610.43.02  Release "
               "Build  (dvs-builder@U16-I3-B03-4-3)  Mon Sep 1 00:00:00 UTC 2025\n"
               "GCC version:  gcc version 13.3.0\n")
PROPRIETARY = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.129.03  Thu Oct 19 "
               "18:56:32 UTC 2023\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
MEMINFO = "MemTotal:       {total} kB\nMemFree:         1000 kB\nMemAvailable:   {avail} kB\n"


def test_doctor_cli_json_and_text():
    r = cli_json("doctor")
    assert r["command"] == "doctor" and r["backend"] == ist.BACKEND
    assert list(r["checks"]) == CHECKS
    for name, c in r["checks"].items():
        assert set(c) == {"status", "value", "summary", "verdict"}, name
        assert c["status"] in ("ok", "info", "warn", "error")
        assert isinstance(c["summary"], str) and c["summary"]
    assert r["checks"]["build"]["value"]["backend"] == ist.BACKEND
    assert isinstance(r["problems"], list)
    proc = cli("doctor")
    assert proc.returncode == 0
    assert "RLIMIT_MEMLOCK" in proc.stdout and "transparent hugepages" in proc.stdout
    if gpu_count() == 0:
        assert r["checks"]["devices"]["status"] == "warn"
        assert "device_count failed with" in r["checks"]["devices"]["summary"]


@pytest.fixture
def host(tmp_path):
    """Writes fake /proc and /sys files; returns diagnose()'s keyword arguments."""
    def make(*, nvidia=None, version="Linux version 6.8.0-45-generic (gcc)", release="6.8.0-45",
             thp="always madvise [never]", total=64 << 20, avail=48 << 20,
             self_cgroup="0::/\n", cgroup=None, memlock=(-1, -1)):
        files = {"proc_version": version, "osrelease": release + "\n", "thp": thp + "\n",
                 "meminfo": MEMINFO.format(total=total, avail=avail),
                 "self_cgroup": self_cgroup}
        if nvidia is not None:
            files["nvidia_version"] = nvidia
        kw = {}
        for key, text in files.items():
            path = tmp_path / key
            path.write_text(text)
            kw[key] = str(path)
        kw.setdefault("nvidia_version", str(tmp_path / "absent"))
        root = tmp_path / "cgroup"
        root.mkdir(exist_ok=True)
        for rel, text in (cgroup or {}).items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        kw["cgroup_root"] = str(root)
        kw["memlock"] = memlock
        kw["runtime"] = SimulatedRuntime()
        return doctor.diagnose(**kw)
    return make


def test_doctor_healthy_host(host):
    r = host(nvidia=PROPRIETARY, thp="always [madvise] never",
             cgroup={"cgroup.controllers": "memory\n", "memory.max": "max\n"})
    c = r["checks"]
    assert list(c) == CHECKS
    assert c["runtime"]["value"] == c["driver"]["value"] and c["runtime"]["status"] == "ok"
    assert c["devices"]["value"] == {"count": 1, "names": ["SimulatedRuntime device"], "error": ""}
    assert c["nvidia_module"]["value"] == {"present": True, "flavor": "proprietary",
                                           "version": "535.129.03"}
    assert c["nvidia_module"]["status"] == "ok"
    assert c["kernel"] == {"status": "ok", "value": "6.8.0-45", "summary": "6.8.0-45",
                           "verdict": None}
    assert c["wsl"]["value"] is False
    assert c["memlock"]["value"] == {"soft": None, "hard": None}
    assert c["transparent_hugepages"]["value"] == "madvise"
    assert c["memory"]["value"] == {"total": 64 << 30, "available": 48 << 30}
    assert c["cgroup"]["value"] == {"version": 2, "limit": None, "usage": None}
    assert r["problems"] == []
    assert doctor.format_text(r)[-1] == "no known failing condition found"


def test_doctor_open_module_on_kernel_6_11(host):
    r = host(nvidia=OPEN_MODULE, release="6.11.0-19-generic")
    c = r["checks"]
    assert c["nvidia_module"]["value"] == {"present": True, "flavor": "open",
                                           "version": "610.43.02"}
    assert c["nvidia_module"]["status"] == "warn"
    assert "runtime_alloc fallback handles it" in c["nvidia_module"]["verdict"]
    assert c["kernel"]["status"] == "warn" and "over 2 GiB" in c["kernel"]["verdict"]
    assert len(r["problems"]) == 2
    text = "\n".join(doctor.format_text(r))
    assert "! nvidia module" in text and "open 610.43.02" in text
    assert "2 problem(s) found" in text


def test_doctor_open_module_elsewhere_and_driver_580(host):
    r = host(nvidia=OPEN_MODULE.replace("610.43.02", "580.159.04"), release="6.18.1")
    c = r["checks"]
    assert c["nvidia_module"]["status"] == "info" and "512 GiB" in c["nvidia_module"]["verdict"]
    assert c["kernel"]["status"] == "ok" and r["problems"] == []


def test_doctor_no_driver(host):
    r = host()
    assert r["checks"]["nvidia_module"]["value"] == {"present": False, "flavor": None,
                                                     "version": None}
    assert r["checks"]["nvidia_module"]["summary"] == "not loaded (no NVIDIA driver)"


def test_doctor_wsl_memlock_thp_memory(host):
    r = host(version="Linux version 5.15.167.4-microsoft-standard-WSL2",
             thp="[always] madvise never", memlock=(8 << 20, 8 << 20),
             total=8 << 20, avail=3 << 20)
    c = r["checks"]
    assert c["wsl"]["value"] is True and "allow_pageable" in c["wsl"]["verdict"]
    assert c["memlock"]["status"] == "warn" and "8 MiB" in c["memlock"]["verdict"]
    assert c["transparent_hugepages"]["status"] == "warn"
    assert "compaction" in c["transparent_hugepages"]["verdict"]
    assert c["memory"]["status"] == "warn"
    assert [p.split(":")[0] for p in r["problems"]] == [
        "wsl", "memlock", "transparent_hugepages", "memory"]


def test_doctor_cgroup_v2_limit_tightest_ancestor(host):
    r = host(self_cgroup="0::/kubepods/pod1\n", cgroup={
        "cgroup.controllers": "memory\n",
        "kubepods/memory.max": str(3 << 30) + "\n",
        "kubepods/pod1/memory.max": "max\n",
        "kubepods/pod1/memory.current": str(1 << 30) + "\n"})
    c = r["checks"]["cgroup"]
    assert c["value"] == {"version": 2, "limit": 3 << 30, "usage": 1 << 30}
    assert c["status"] == "warn" and "OOM" in c["verdict"]


def test_doctor_cgroup_v1_and_hybrid(host):
    # v1 memory controller beside a v2 unified hierarchy, as on many hosts.
    r = host(self_cgroup="4:memory:/job/7\n0::/\n", cgroup={
        "memory/memory.limit_in_bytes": "9223372036854771712\n",
        "memory/job/7/memory.limit_in_bytes": str(64 << 30) + "\n",
        "memory/job/7/memory.usage_in_bytes": str(2 << 30) + "\n",
        "unified/memory.max": str(1 << 30) + "\n"})
    c = r["checks"]["cgroup"]
    assert c["value"] == {"version": 1, "limit": 64 << 30, "usage": 2 << 30}
    assert c["status"] == "ok"


def test_doctor_without_a_memory_cgroup(host):
    r = host(self_cgroup="1:name=systemd:/\n", cgroup={})
    assert r["checks"]["cgroup"]["value"] == {"version": None, "limit": None, "usage": None}
    assert r["checks"]["cgroup"]["status"] == "info"


def test_doctor_runtime_without_devices(host):
    kw = {}
    r = doctor.diagnose(runtime=SimulatedRuntime(device_count=0), memlock=(-1, -1),
                        nvidia_version="/nonexistent", **kw)
    c = r["checks"]["devices"]
    assert c["status"] == "warn" and c["value"]["error"] == error_name(100)
    assert "SimulatedRuntime" in c["verdict"]


def test_version_text():
    assert report.version_text("cuda", 13000) == "13.0"
    assert report.version_text("cuda", 12040) == "12.4"
    assert report.version_text("rocm", 50200003) == "5.2.3"
    assert report.version_text("cuda", 0) == "none"
    assert doctor.parse_kernel("6.13.2-arch1") == (6, 13)
    assert doctor.parse_thp("always madvise [never]") == "never"


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
                            "segment_size": None, "seconds": 0.0, "attempts": []}
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


# -- on a real GPU -----------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("faults,kind", [(None, "REGISTERED"),
                                         ("register#1=invalid_value", "SEGMENTED"),
                                         ("register=invalid_value", "RUNTIME_PINNED")])
def test_probe_on_the_gpu(faults, kind):
    args = ["probe", "--require-gpu", "--size", "1GiB"] + (["--faults", faults] if faults else [])
    r = cli_json(*args)
    assert r["simulated"] is False and r["gpu"]["available"] is True
    assert r["kind"] == kind and r["copy"]["verified"] is True
    print(f"\nprobe {kind}: created in {r['create_seconds']:.3f} s, "
          f"H2D {r['copy']['h2d_gbps']:.1f} GB/s")
