"""Runs safetensors' own Python tests with instant_staging's reader standing
in for theirs (``tox -e upstream``; or ``python tools/upstream_safetensors.py
[pytest args]`` from a checkout whose extension is built in place).

The tests are not part of this repository: they come, at test time, from
the safetensors sdist on PyPI (``bindings/python/tests/`` is in it), of the
version installed, checked against the sha256 pinned below.  Then the
tests of ``ALSO`` run the same way, the installed safetensors writing their
files: safetensors 0.9.0rc1's prefetch tests (``safe_open(...).prefetch``,
``PrefetchLoader``), which ours offers whatever safetensors is installed.
Set ``INSTANT_STAGING_UPSTREAM_SDIST`` to a downloaded sdist of the
installed version, or to a directory holding ``safetensors-VERSION.tar.gz``
files (a version it lacks is fetched), to run offline.  Extra arguments go to each pytest.
They run in a scratch directory (they write their files into the working
directory) under ``tools/upstream_shim.py``, which swaps ``load_file``,
``load`` and ``safe_open`` for ours and reports which tests read through
them.  Exits with pytest's status.
"""

import hashlib
import importlib.metadata
import importlib.util
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import urllib.request

TOOLS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TOOLS)

# version -> (sdist URL on PyPI, its sha256); add a line to test another.
SDISTS = {
    "0.8.0": ("https://files.pythonhosted.org/packages/45/06/"
              "f955dbbb1859e3bd23c8ac6141af5106e7ad5fedec4a3a6e3d60f94b7001/safetensors-0.8.0.tar.gz",
              "fabaf3e0f18a6618d9b36560682562157f77c2b71fcffc7b432be2baed9d753d"),
    "0.9.0rc1": ("https://files.pythonhosted.org/packages/60/82/"
                 "5c68745e51b3e7432c5932c7d4f87a9b134dfe4fb81026aa70558ffeb1c1/safetensors-0.9.0rc1.tar.gz",
                 "8a70d139a45d71557e116339f5115afe88af2d80b08701c31ce0478d5bfc8d93"),
}
# (version, pytest arguments): tests of another safetensors that run too.
ALSO = [("0.9.0rc1", ["tests/test_pread_backend.py", "-k", "prefetch"])]
ENV_SDIST = "INSTANT_STAGING_UPSTREAM_SDIST"
TESTS = "bindings/python/tests/"


def sdist_bytes(version):
    if version not in SDISTS:
        sys.exit(f"no pinned sdist for safetensors {version} (installed): add its URL and sha256 "
                 f"to SDISTS in {__file__}")
    url, sha256 = SDISTS[version]
    local = os.environ.get(ENV_SDIST)
    if local and os.path.isdir(local):        # a folder of sdists: this version's, else PyPI's
        local = os.path.join(local, f"safetensors-{version}.tar.gz")
        local = local if os.path.exists(local) else None
    if local:
        with open(local, "rb") as f:
            data = f.read()
    else:
        with urllib.request.urlopen(url, timeout=120) as r:
            data = r.read()
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        sys.exit(f"safetensors-{version}.tar.gz has sha256 {got}, not the pinned {sha256}")
    return data


def extract_tests(data, version, dest):
    """Writes the sdist's bindings/python/tests/ under ``dest``; returns the
    directory the tests expect to run in (bindings/python)."""
    prefix = f"safetensors-{version}/"
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = [m for m in tar.getmembers()
                   if m.name.startswith(prefix + TESTS) and (m.isfile() or m.isdir())]
        if not any(m.name.endswith(".py") for m in members):
            sys.exit(f"the sdist of safetensors {version} holds no {TESTS}")
        for m in members:
            m.name = m.name[len(prefix):]
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(dest, members=members, **kwargs)
    run_dir = os.path.join(dest, "bindings", "python")
    os.makedirs(os.path.join(run_dir, "tests", "data"), exist_ok=True)
    return run_dir


def run_tests(version, args, env):
    """pytest of the sdist of safetensors ``version``'s tests under the shim;
    its exit status."""
    data = sdist_bytes(version)
    with tempfile.TemporaryDirectory(prefix="upstream-safetensors-") as scratch:
        run_dir = extract_tests(data, version, scratch)
        cmd = [sys.executable, "-m", "pytest", "-p", "upstream_shim", "-p", "no:cacheprovider", "-rs", *args]
        return subprocess.run(cmd, cwd=run_dir, env={**env, "UPSTREAM_TESTS_VERSION": version},
                              check=False).returncode


def main(argv):
    version = importlib.metadata.version("safetensors")
    path = [TOOLS]
    if importlib.util.find_spec("instant_staging") is None:
        path.append(ROOT)          # a checkout built in place, not installed
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(path + [env["PYTHONPATH"]] if env.get("PYTHONPATH") else path)
    status = run_tests(version, ["tests", *argv], env)
    for other, selection in ALSO:
        if other != version:
            status = max(status, run_tests(other, [*selection, *argv], env))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
