"""The command in a subprocess: ``python -m instant_staging`` run so that it
imports the instant_staging these tests imported (the source tree when
built in place, site-packages under tox), and what its reports hold."""

import json
import subprocess
import sys

import pytest

from instant_staging.testing import SimulatedRuntime

from support import PACKAGE_PARENT, child_env, gpu_count

# Small and quick: three segments of 16 MiB, 16 MiB, 8 MiB.
SMALL = ["--size", "40MiB", "--segment-size", "16MiB", "--chunk-size", "4MiB",
         "--prefault-threads", "0"]

needs_no_gpu = pytest.mark.skipif(gpu_count() > 0, reason="this host has a GPU")


def error_name(code):
    return SimulatedRuntime().error_name(code)


def cli(*args, env=None, timeout=300):
    """Runs ``python -m instant_staging ARGS`` in the package's parent (never
    the unbuilt sources of the checkout); the CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "instant_staging", *args], cwd=PACKAGE_PARENT,
                          env=child_env(env), capture_output=True, text=True, timeout=timeout)


def cli_json(*args, env=None, code=0):
    proc = cli(*args, "--json", env=env)
    assert proc.returncode == code, proc.stdout + proc.stderr
    return json.loads(proc.stdout)  # one object, nothing else on stdout


def steps(result):
    return [(a["step"], a["ok"]) for a in result["attempts"]]
