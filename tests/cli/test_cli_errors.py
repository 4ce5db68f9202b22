"""The CLI never shows a traceback (issue 10): a user error is one line and
exit 2, a failed run exit 1 with its report (JSON with --json)."""

import json

import pytest

from support.cli import cli

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")


def no_traceback(proc):
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("m") / "m.safetensors")
    st.save_file({f"t{i}": torch.full((4096,), i, dtype=torch.int32) for i in range(8)}, path)
    return path


def test_release_failure_prints_its_report():
    # README's own example: the whole registration succeeds, the release fails.
    spec = "register#4=invalid_value;unregister#1=invalid_value"
    proc = cli("probe", "--simulate", "--size", "64MiB", "--faults", spec)
    no_traceback(proc)
    assert proc.returncode == 1
    assert "release FAILED" in proc.stdout and "leaked on purpose" in proc.stdout
    assert "register" in proc.stdout        # the attempts are there
    proc = cli("probe", "--simulate", "--size", "64MiB", "--faults", spec, "--json")
    no_traceback(proc)
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert report["ok"] is False and report["kind"] == "REGISTERED"
    assert report["release"]["ok"] is False and report["error"]["type"] == "ReleaseError"
    assert report["error"]["retained_ranges"] and report["attempts"]


@pytest.mark.parametrize("args", [
    ["--threads", "99999999999"], ["--chunk-size", "99999GiB"], ["--io-depth", "99999999999"],
    ["--chunk-size", "10000000"], ["--chunk-size", "1"],
])
def test_huge_or_odd_knobs_load(model, args):
    proc = cli("load", "--device", "cpu", model, *args, "--json")
    no_traceback(proc)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] and report["tensors"] == 8
    assert report["staging"]["size"] <= 8 * 4096 * 4 * 2


@pytest.mark.parametrize("args, words", [
    (["--threads", "0"], "--threads"), (["--chunk-size", "12XB"], "not a size"),
    (["--io-depth", "-3"], "--io-depth"), (["--threads", "1e3"], "not an integer"),
])
def test_user_errors_are_one_line_exit_2(model, args, words):
    proc = cli("load", "--device", "cpu", model, *args)
    no_traceback(proc)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and words in proc.stderr


@pytest.mark.parametrize("args, words", [
    (["--chunk-size", "1.e999"], "not a size"), (["--staging-size", "1.e999"], "not a size"),
    (["--device", "foo"], "--device"), (["--device", "mps"], "--device"),
    (["--device", "cuda:x"], "--device"),
])
def test_sizes_beyond_any_number_and_unknown_devices_are_one_line_exit_2(model, args, words):
    # "1.e999" is a float infinity (int() of it raised OverflowError, a
    # traceback); a device of no kind we load to was found only after the
    # staging buffer was made.
    proc = cli("load", model, *args)
    no_traceback(proc)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and words in proc.stderr, proc.stderr


def test_a_fifo_and_a_bad_fault_spec_are_one_line_exit_2(model, tmp_path):
    import os
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    proc = cli("load", "--device", "cpu", str(fifo))
    no_traceback(proc)
    assert proc.returncode == 2 and "not a regular file" in proc.stderr, proc.stderr
    proc = cli("load", "--device", "cpu", model, env={"INSTANT_STAGING_FAULTS": "garbage"})
    no_traceback(proc)
    assert proc.returncode == 2 and "INSTANT_STAGING_FAULTS" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_missing_file_and_bad_command_are_one_line_exit_2(tmp_path):
    for args in (["load", str(tmp_path / "nope.safetensors")], ["frobnicate"],
                 ["probe", "--faults", "read=EBOGUS"]):
        proc = cli(*args)
        no_traceback(proc)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("spec, words", [("read#2=EIO", "Input/output error"),
                                         ("read#1=short", "truncated"),
                                         ("copy#3=invalid_value", "invalid_value")])
def test_failed_load_is_exit_1_with_its_report(model, spec, words):
    proc = cli("load", "--device", "cpu", "--chunk-size", "4096", model,
               env={"INSTANT_STAGING_FAULTS": spec})
    no_traceback(proc)
    assert proc.returncode == 1 and words in proc.stderr
    proc = cli("load", "--device", "cpu", "--chunk-size", "4KiB", model, "--json",
               env={"INSTANT_STAGING_FAULTS": spec})
    no_traceback(proc)
    report = json.loads(proc.stdout)
    assert proc.returncode == 1 and report["ok"] is False and report["error"]["type"] == "LoadError"


def test_invalid_file_is_exit_1_one_line(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00[]")
    proc = cli("load", "--device", "cpu", str(bad))
    no_traceback(proc)
    assert proc.returncode == 1 and "SafetensorsError" in proc.stderr


def test_load_to_a_missing_gpu_is_a_report_not_a_traceback(model):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = cli("load", model, "--device", "cuda:0")
    no_traceback(proc)
    assert proc.returncode == 1 and "allow_pageable" not in proc.stderr
    assert "cuda:0" in proc.stderr


# Every command, its report to a stdout that fails: /dev/full (ENOSPC on the
# write) or a closed descriptor (Python then has no sys.stdout at all).
COMMANDS = {"probe": ["probe", "--simulate", "--size", "1MiB", "--segment-size", "1MiB",
                      "--prefault-threads", "0"],
            "doctor": ["doctor"],
            "load": ["load", "--device", "cpu"]}


def cli_with_stdout(how, *args):
    import os
    import subprocess
    import sys

    from support import PACKAGE_PARENT, child_env
    command = [sys.executable, "-m", "instant_staging", *args]
    if how == "closed":
        command = ["sh", "-c", 'exec "$@" >&-', "sh", *command]
    with open(os.devnull if how == "closed" else "/dev/full", "w") as out:
        proc = subprocess.run(command, cwd=PACKAGE_PARENT, env=child_env(), stdout=out,
                              stderr=subprocess.PIPE, text=True, timeout=300)
    proc.stdout = ""            # (it went to the failing stdout)
    return proc


@pytest.mark.parametrize("how", ["full", "closed"])
@pytest.mark.parametrize("as_json", [False, True])
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_report_that_cannot_be_written_is_one_line_and_a_failure(model, command, as_json, how):
    args = COMMANDS[command] + ([model] if command == "load" else []) + (["--json"] if as_json else [])
    proc = cli_with_stdout(how, *args)
    no_traceback(proc)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("loaded ")]  # progress
    assert len(lines) == 1 and "stdout" in lines[0], proc.stderr
