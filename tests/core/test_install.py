"""Build and install: the backend rule, the build requirements the in-tree
PEP 517 backend adds, what a build records, and the driver diagnosis.

The builds themselves (no toolkit, sdist, wheel) run in CI through
``tox -e wheel`` (tools/test_wheel.sh); these tests check the decisions
behind them on fake toolkits and wheels.
"""

import os
import re
import sys

import pytest

import instant_staging as ist
from instant_staging.cli import doctor, probe
from instant_staging.cli.main import main, version_line
from instant_staging.cli.report import driver_problem
from instant_staging.testing import SimulatedRuntime

from support import ROOT, build_backends, run_child

backends = build_backends()


def _fake_cuda(root, version, crt_beside=True, static=True):
    """A CUDA tree: include/cuda_runtime_api.h (CUDART_VERSION), crt, lib."""
    inc = root / "include"
    (inc / "crt").mkdir(parents=True)
    (inc / "cuda_runtime_api.h").write_text(f"#define CUDART_VERSION {version}\n")
    if crt_beside:
        (inc / "crt" / "host_defines.h").write_text("\n")
    lib = root / "lib64"
    lib.mkdir()
    if static:
        (lib / "libcudart_static.a").write_bytes(b"!<arch>\n")
    return root


@pytest.fixture
def env(monkeypatch):
    """No toolkit, no ROCm, no wheels on sys.path, no variables: tests add them."""
    for var in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT", "ROCM_PATH", "ROCM_HOME", "HIP_PATH",
                backends.BACKEND_VAR, backends.CUDA_VAR):
        monkeypatch.delenv(var, raising=False)
    toolkits, rocm = [], []
    monkeypatch.setattr(backends, "_toolkit_homes", lambda: iter(toolkits))
    monkeypatch.setattr(backends, "find_rocm", lambda: rocm[0] if rocm else None)
    monkeypatch.setattr(sys, "path", [p for p in sys.path
                                      if not os.path.isdir(os.path.join(p or ".", "nvidia"))])
    monkeypatch.setattr(backends, "_cuda_skipped", [])

    class Env:
        def toolkit(self, root):
            toolkits.append((str(root), "CUDA_HOME"))

        def rocm(self):
            rocm.append(backends.Backend("rocm", "instant_staging/runtime/_hip.pyx", [], ["/usr/lib"],
                                         ["amdhip64"], [], [], [], "system: /usr", 50200003,
                                         "HIP 5.2.3 (system package)"))

        def wheels(self, root, major=12):
            site = root / "site"
            if major == 12:
                _fake_cuda(site / "nvidia" / "cuda_runtime", 12090, crt_beside=False)
                (site / "nvidia" / "cuda_nvcc" / "include" / "crt").mkdir(parents=True)
                (site / "nvidia" / "cuda_nvcc" / "include" / "crt" / "host_defines.h").write_text("")
                os.rename(site / "nvidia" / "cuda_runtime" / "lib64",
                          site / "nvidia" / "cuda_runtime" / "lib")
            else:
                _fake_cuda(site / "nvidia" / "cu13", 13000)
            sys.path.append(str(site))

        def set(self, var, value):
            monkeypatch.setenv(var, value)
    return Env()


def test_no_toolkit_no_rocm_asks_for_the_cuda12_wheels(env):
    assert backends.build_requirements() == list(backends.CUDA_WHEELS[12])
    assert all("cu12" in r and "==" in r for r in backends.CUDA_WHEELS[12])
    with pytest.raises(backends.BackendNotFound, match="fetches them itself"):
        backends.find_backend()


def test_the_cuda12_wheels_are_found_and_linked_statically(env, tmp_path):
    env.wheels(tmp_path, 12)
    found = backends.find_backend()
    assert found.name == "cuda" and found.version == 12090
    assert found.toolchain == "CUDA 12.9 (PyPI wheels)"
    assert "cudart_static" in found.libraries and not found.runtime_library_dirs
    assert any(d.endswith(os.path.join("cuda_nvcc", "include")) for d in found.include_dirs)
    assert backends.build_requirements() == list(backends.CUDA_WHEELS[12])  # isolation sees none


def test_a_toolkit_is_used_as_it_is_and_needs_no_wheels(env, tmp_path):
    env.toolkit(_fake_cuda(tmp_path / "cuda", 13000))
    assert backends.build_requirements() == []
    found = backends.find_backend()
    assert (found.name, found.version, found.toolchain) == ("cuda", 13000, "CUDA 13.0 (toolkit)")
    assert "R580" in backends.describe(found) and "INSTANT_STAGING_CUDA=12" in backends.describe(found)


def test_cuda12_asked_passes_a_cuda13_toolkit_over(env, tmp_path):
    env.toolkit(_fake_cuda(tmp_path / "cuda", 13000))
    env.set(backends.CUDA_VAR, "12")
    assert backends.build_requirements() == list(backends.CUDA_WHEELS[12])
    env.wheels(tmp_path, 12)
    assert backends.find_backend().toolchain == "CUDA 12.9 (PyPI wheels)"
    env.set(backends.CUDA_VAR, "13")
    assert backends.find_backend().toolchain == "CUDA 13.0 (toolkit)"
    env.set(backends.CUDA_VAR, "11")
    with pytest.raises(backends.BackendNotFound, match="12 or 13"):
        backends.find_backend()


def test_a_cross_build_takes_the_targets_wheels_never_a_toolkit_here(env, tmp_path, monkeypatch):
    """tools/build_wheel.sh's aarch64 wheel on x86_64 (_PYTHON_HOST_PLATFORM,
    as CPython's cross builds name the target): a toolkit of this machine
    holds a library for this machine's architecture."""
    import platform
    env.toolkit(_fake_cuda(tmp_path / "cuda", 12040))
    env.wheels(tmp_path, 12)
    other = "x86_64" if platform.machine() == "aarch64" else "aarch64"
    monkeypatch.setenv("_PYTHON_HOST_PLATFORM", f"linux-{other}")
    assert backends.cross_target() == other
    assert backends.find_backend().toolchain == "CUDA 12.9 (PyPI wheels)"
    monkeypatch.setenv("_PYTHON_HOST_PLATFORM", f"linux-{platform.machine()}")
    assert backends.cross_target() is None
    assert backends.find_backend().toolchain == "CUDA 12.4 (toolkit)"


def test_toolkit_without_static_runtime_is_passed_over(env, tmp_path):
    env.toolkit(_fake_cuda(tmp_path / "cuda", 12040, static=False))
    with pytest.raises(backends.BackendNotFound, match=r"no libcudart_static\.a"):
        backends.find_backend()


def test_rocm_found_cuda_not_builds_rocm_and_says_how_to_switch(env, capsys):
    env.rocm()
    assert backends.build_requirements() == []
    assert backends.find_backend().name == "rocm"
    err = capsys.readouterr().err
    assert "building the ROCm backend" in err and "INSTANT_STAGING_BACKEND=cuda" in err
    env.set(backends.BACKEND_VAR, "cuda")          # the other one: the wheels
    assert backends.build_requirements() == list(backends.CUDA_WHEELS[12])


def test_rocm_asked_needs_no_wheels(env):
    env.set(backends.BACKEND_VAR, "rocm")
    assert backends.build_requirements() == []
    env.set(backends.BACKEND_VAR, "metal")
    with pytest.raises(backends.BackendNotFound, match="'cuda' or 'rocm'"):
        backends.build_requirements()


def test_build_config_names_no_path():
    from instant_staging import _build_config as config
    with open(config.__file__) as f:
        text = f.read()
    assert config.BACKEND == ist.BACKEND
    assert not re.search(r"['\"]/", text), text
    assert config.RUNTIME_VERSION > 0
    if config.BACKEND == "cuda":
        assert config.STATIC_RUNTIME is True


def test_cuda_module_needs_no_libcudart():
    if ist.BACKEND != "cuda":
        pytest.skip("ROCm build")
    from instant_staging.runtime import _cuda
    with open(_cuda.__file__, "rb") as f:
        data = f.read()
    assert b"libcudart.so" not in data
    code, version = ist.real_runtime().runtime_version()
    from instant_staging import _build_config
    assert code == 0 and version // 1000 == _build_config.RUNTIME_VERSION // 1000


def test_version_option(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out == version_line() and out.startswith(f"instant-staging {ist.__version__} ({ist.BACKEND}")


def test_the_run_time_driver_table_is_the_builds():
    # doctor and probe carry their own copy: backends.py is build time only,
    # and the installed package holds none of it.
    from instant_staging.cli.report import MIN_DRIVER
    assert MIN_DRIVER == backends.MIN_DRIVER
    assert not os.path.exists(os.path.join(os.path.dirname(ist.__file__), "backends.py"))


@pytest.mark.parametrize("runtime, driver, verdict", [
    (12090, 12020, None),              # minor version compatibility: R535 runs 12.9
    (12090, 12000, None),
    (12090, 13000, None),
    (12090, 11040, "R525"),
    (13000, 12080, "INSTANT_STAGING_CUDA=12"),
    (12090, 0, "no NVIDIA driver"),
])
def test_driver_problem(runtime, driver, verdict):
    problem = driver_problem("cuda", runtime, driver)
    if verdict is None:
        assert problem is None
    else:
        assert verdict in problem and "\n" not in problem
    assert driver_problem("rocm", 50200003, 0) is None


class OldDriver(SimulatedRuntime):
    """A host whose driver supports CUDA 11.4 only: every device call fails with 35."""

    def runtime_version(self):
        return (0, 12090)

    def driver_version(self):
        return (0, 11040)

    def device_count(self):
        return (35, 0)


def test_doctor_says_the_driver_is_too_old():
    rt, drv = doctor.check_versions(OldDriver(backend="cuda"), "cuda")
    assert rt["summary"].startswith("12.9") and "R525" in rt["summary"]
    assert drv["status"] == "error" and "too old" in drv["verdict"] and "R525" in drv["verdict"]


def test_probe_says_the_driver_is_too_old():
    runtime, info = probe.select_runtime(require_gpu=True,
                                         real_runtime=lambda: OldDriver(backend="cuda"))
    assert runtime is None
    if ist.BACKEND == "cuda":
        assert "too old" in info["gpu"]["reason"] and "CUDA 11.4" in info["gpu"]["reason"]
    assert info["versions"] == {"runtime_version": 12090, "driver_version": 11040}


def test_import_warns_when_the_asked_backend_is_not_this_build():
    other = "rocm" if ist.BACKEND == "cuda" else "cuda"
    child = run_child("import instant_staging", env={"INSTANT_STAGING_BACKEND": other})
    assert child.returncode == 0, child.stderr
    assert "RuntimeWarning" in child.stderr and f"built for {ist.BACKEND}" in child.stderr
    assert "--no-cache-dir" in child.stderr
    same = run_child("import instant_staging", env={"INSTANT_STAGING_BACKEND": ist.BACKEND})
    assert same.returncode == 0 and "RuntimeWarning" not in same.stderr


def test_every_package_is_listed_for_the_wheel():
    """pyproject's explicit package list names every package of the tree
    (a package left out would be missing from wheels and sdists)."""
    pyproject = os.path.join(ROOT, "pyproject.toml")
    tomllib = pytest.importorskip("tomllib")
    if not os.path.isfile(pyproject):
        pytest.skip("no source tree")
    with open(pyproject, "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = {os.path.relpath(d, ROOT).replace(os.sep, ".")
             for d, _, files in os.walk(os.path.join(ROOT, "instant_staging"))
             if "__init__.py" in files}
    assert listed == found
