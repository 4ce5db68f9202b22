"""doctor: what on this host decides whether pinning a staging buffer works.

``diagnose()`` gathers the build, the runtime and driver versions, the
devices, the NVIDIA kernel module (open or proprietary), the kernel, WSL2,
RLIMIT_MEMLOCK, transparent huge pages (and what ``StagingBuffer``'s
``hugepages=None`` would choose here, and why), memory and the cgroup
limit, and gives each a one-line verdict where a known failing condition of
docs/design.md ("Measured") applies.  Every file it reads and the one
variable it looks at are parameters, so tests feed it fake /proc and /sys
content.  It returns a plain dict (what ``--json`` prints);
``format_text()`` renders it and ``exit_code()`` gives the command's status:
1 when a check found a problem (any warning or error), else 0.  Nothing
here prints.
"""

import os
import re
import resource

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
}



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
             hugepages_env=None):
    """Every check as ``{name: {status, value, summary, verdict}}`` plus the
    list of problems.  ``runtime`` defaults to the real one (no faults);
    ``hugepages_env`` is INSTANT_STAGING_HUGEPAGES's text (None: the
    environment's)."""
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
    # A warning or an error is a problem, its verdict the line to act on (an
    # error without one, a runtime that answers nothing, still counts).
    problems = [f"{name}: {c['verdict'] or c['summary']}" for name, c in checks.items()
                if c["status"] in ("warn", "error")]
    return {"command": "doctor", "backend": BACKEND, "checks": checks, "problems": problems}


_LABELS = {"build": "build", "runtime": "runtime", "driver": "driver", "devices": "devices",
           "nvidia_module": "nvidia module", "kernel": "kernel", "wsl": "WSL2",
           "memlock": "RLIMIT_MEMLOCK", "transparent_hugepages": "transparent hugepages",
           "hugepages": "huge pages",
           "memory": "memory", "cgroup": "cgroup memory"}


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
