"""The probe command, driven in subprocesses and through its Python API.

It runs on the SimulatedRuntime here (and on a GPU host with --simulate),
with faults forcing every kind the state machine can reach, both errors,
and the usage errors.
"""

import pytest

import instant_staging as ist
from instant_staging.cli import probe
from instant_staging.testing import SimulatedRuntime

from support import MiB
from support.cli import SMALL, cli, cli_json, error_name, needs_no_gpu, steps

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
    assert "host-to-device" in out and "iB/s" in out and "data verified" in out
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
    assert r["hugepages"] == {"on": True, "why": "hugepages=True"}


def test_probe_shows_the_pages_chosen_and_why():
    from instant_staging import _hugepages
    # The default: what auto says on this host, the same reading as the buffer's.
    r = cli_json("probe", "--simulate", "--size", "8MiB", "--prefault-threads", "0")
    assert r["hugepages"]["why"].startswith("auto: ")
    assert r["hugepages"]["on"] is _hugepages.huge_pages_free(8 << 20) or "refused" in \
        r["hugepages"]["why"]
    r = cli_json("probe", "--simulate", "--size", "8MiB", "--no-hugepages")
    assert r["hugepages"] == {"on": False, "why": "hugepages=False"}
    r = cli_json("probe", "--simulate", "--size", "8MiB",
                 env={"INSTANT_STAGING_HUGEPAGES": "0"})
    assert r["hugepages"] == {"on": False, "why": "INSTANT_STAGING_HUGEPAGES=0"}
    proc = cli("probe", "--simulate", "--size", "8MiB", "--no-hugepages")
    assert "SIMULATED pages: 4 KiB (hugepages=False)" in proc.stdout.splitlines()
    # A failed run has no buffer, so no pages.
    r = cli_json("probe", "--simulate", "--size", "8MiB", "--faults",
                 "register=invalid_value;host_alloc=memory_allocation", code=1)
    assert r["hugepages"] is None


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
