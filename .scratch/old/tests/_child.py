"""Run a Python snippet in a fresh interpreter that imports the same
instant_staging as the tests (the built tree or the installed wheel).

The child runs in an empty directory, with the package's parent first on
PYTHONPATH: from the repository root a bare ``import instant_staging``
would otherwise find the unbuilt sources when the tests run against an
installed wheel (tox).  That directory is also its TMPDIR, so whatever the
child makes with ``tempfile`` (checkpoints of up to 64 MiB) goes with it:
left in /tmp, they had filled this host's disk over many runs (61 GB).
"""

import os
import subprocess
import sys
import tempfile
import textwrap

import instant_staging

PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(instant_staging.__file__)))


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
