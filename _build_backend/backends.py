"""Build-time only: find the CUDA or ROCm toolchain for setup.py.

Pure Python with no imports from the package, beside the in-tree build
backend (``instant_staging_build.py``), which loads it by path for itself
and for ``setup.py`` before anything is built; it is not part of the
installed package.  ``find_backend()`` returns a ``Backend`` naming the
Cython source to compile and the include dirs, library dirs, libraries and
macros to compile it with; ``build_requirements()`` is what the build
backend adds to pip's build environment.

The rule (docs/develop/building.md):

- ``INSTANT_STAGING_BACKEND=cuda|rocm`` picks the backend; unset, CUDA
  when a CUDA toolkit is found, else ROCm when HIP is found, else CUDA
  from PyPI's CUDA 12 runtime wheels (the build fetches them itself).
- ``INSTANT_STAGING_CUDA=12|13`` picks the CUDA major version; unset, the
  toolkit's own version (CUDA_HOME, CUDA_PATH, CUDA_ROOT, nvcc on PATH,
  /usr/local/cuda), else 12.  A toolkit of another major version is
  passed over and the runtime wheels of the asked one are used instead.
- CUDA is always linked statically (``libcudart_static.a``): no libcudart
  is NEEDED.  The CUDA 12 runtime runs on drivers R525 and newer (R580
  included); CUDA 13's needs R580+.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import sys
from typing import NamedTuple

BACKEND_VAR = "INSTANT_STAGING_BACKEND"
CUDA_VAR = "INSTANT_STAGING_CUDA"

# PyPI's CUDA runtime wheels, by major version: the headers and
# libcudart_static.a, plus what supplies crt/host_defines.h (which
# cuda_runtime_api.h includes): for 12 the nvcc wheel (nvidia/cuda_nvcc/
# include/crt), for 13 nvidia-cuda-crt (into nvidia/cu13/include).  Pinned
# so that a build is reproducible and the two header sets match.
CUDA_WHEELS: dict[int, tuple[str, ...]] = {
    12: ("nvidia-cuda-runtime-cu12==12.9.79", "nvidia-cuda-nvcc-cu12==12.9.86"),
    13: ("nvidia-cuda-runtime==13.0.96", "nvidia-cuda-crt==13.0.88"),
}
# Where each major version's wheels unpack under site-packages.
_WHEEL_DIRS = {12: "nvidia/cuda_runtime", 13: "nvidia/cu13"}
# The oldest driver branch each CUDA major version's runtime runs on
# (minor version compatibility within a major version); the run-time copy,
# for doctor and probe, is instant_staging/cli/report.py's (a test compares).
MIN_DRIVER = {11: "R450", 12: "R525", 13: "R580"}


class Backend(NamedTuple):
    name: str                      # "cuda" or "rocm"
    source: str                    # the .pyx that fills the runtime table
    include_dirs: list[str]
    library_dirs: list[str]
    libraries: list[str]
    define_macros: list[tuple[str, str | None]]
    extra_link_args: list[str]
    runtime_library_dirs: list[str]
    origin: str                    # where the toolchain was found (a path: build output only)
    version: int                   # CUDART_VERSION (12090) or HIP_VERSION of the headers
    toolchain: str                 # what was used, without paths: "CUDA 12.9 (PyPI wheels)"


class BackendNotFound(RuntimeError):
    pass


def _note(message: str) -> None:
    print(f"instant_staging: {message}", file=sys.stderr, flush=True)


def requested_backend() -> str:
    value = os.environ.get(BACKEND_VAR, "").strip().lower()
    if value not in ("", "cuda", "rocm"):
        raise BackendNotFound(f"{BACKEND_VAR} must be 'cuda' or 'rocm', not {value!r}")
    return value


def requested_cuda_major() -> int | None:
    value = os.environ.get(CUDA_VAR, "").strip().lower().lstrip("cu")
    if value == "":
        return None
    if value not in ("12", "13"):
        raise BackendNotFound(f"{CUDA_VAR} must be 12 or 13, not {os.environ[CUDA_VAR]!r}")
    return int(value)


def cuda_version_text(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


def _header_version(header: str, macro: str) -> int:
    try:
        with open(header, encoding="utf-8", errors="replace") as f:
            match = re.search(rf"#define\s+{macro}\s+(\d+)", f.read())
    except OSError:
        return 0
    return int(match.group(1)) if match else 0


# -- CUDA ----------------------------------------------------------------------

def _toolkit_homes():
    """Candidate CUDA toolkit roots, most specific first."""
    for var in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"):
        if os.environ.get(var):
            yield os.environ[var], var
    nvcc = shutil.which("nvcc")
    if nvcc:
        yield os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "nvcc on PATH"
    yield "/usr/local/cuda", "/usr/local/cuda"


def _wheel_homes(major: int | None = None):
    """PyPI runtime wheels importable from this interpreter (sys.path).

    In pip's isolated build environment these are the ones the build
    backend asked for; with --no-build-isolation, those installed beside
    the build's Python (or on PYTHONPATH).
    """
    for site in sys.path:
        if not site or not os.path.isdir(os.path.join(site, "nvidia")):
            continue
        for wheel_major, sub in sorted(_WHEEL_DIRS.items()):
            if major in (None, wheel_major):
                yield os.path.join(site, sub), f"nvidia CUDA {wheel_major} runtime wheels"


def _crt_include(inc: str) -> str | None:
    """The include dir holding crt/host_defines.h, which cuda_runtime_api.h needs.

    A toolkit ships it beside cuda_runtime_api.h, and so does the CUDA 13
    runtime wheel once nvidia-cuda-crt is installed; for the CUDA 12 wheels
    it is in the nvcc wheel (nvidia/cuda_nvcc/include).
    """
    nvidia = os.path.dirname(os.path.dirname(inc))
    for cand in (inc, *sorted(glob.glob(os.path.join(nvidia, "*", "include")))):
        if os.path.isfile(os.path.join(cand, "crt", "host_defines.h")):
            return cand
    return None


_cuda_skipped: list[str] = []     # why candidates were passed over, for the error


def _cuda_at(home: str, origin: str, major: int | None) -> Backend | None:
    inc = os.path.join(home, "include")
    header = os.path.join(inc, "cuda_runtime_api.h")
    if not os.path.isfile(header):
        return None
    version = _header_version(header, "CUDART_VERSION")
    if major is not None and version // 1000 != major:
        _cuda_skipped.append(f"{home} ({origin}) is CUDA {cuda_version_text(version)}, "
                             f"not {major} ({CUDA_VAR}={major})")
        return None
    crt = _crt_include(inc)
    if crt is None:
        _cuda_skipped.append(f"{home} ({origin}) has cuda_runtime_api.h but no "
                             "crt/host_defines.h")
        return None
    incs = [inc] if crt == inc else [inc, crt]
    for libdir in (os.path.join(home, "lib64"), os.path.join(home, "lib"),
                   os.path.join(home, "targets", "x86_64-linux", "lib")):
        if os.path.isfile(os.path.join(libdir, "libcudart_static.a")):
            # Static runtime: no libcudart.so needed where the module runs, the
            # module imports without a GPU or driver (errors come later), and
            # its cuda* symbols stay private, so no other libcudart in the
            # process (torch's) is called instead or shares its last error.
            wheel = origin.startswith("nvidia CUDA")
            toolchain = f"CUDA {cuda_version_text(version)} ({'PyPI wheels' if wheel else 'toolkit'})"
            return Backend("cuda", "instant_staging/runtime/_cuda.pyx", incs, [libdir],
                           ["cudart_static", "rt", "pthread", "dl"], [], [], [],
                           f"{origin}: {home}", version, toolchain)
    _cuda_skipped.append(f"{home} ({origin}) has headers but no libcudart_static.a")
    return None


def _first_cuda(homes, major: int | None) -> Backend | None:
    seen = set()
    for home, origin in homes:
        key = os.path.realpath(home)
        if key in seen:
            continue
        seen.add(key)
        found = _cuda_at(home, origin, major)
        if found:
            return found
    return None


def find_cuda_toolkit(major: int | None = None) -> Backend | None:
    """A CUDA toolkit (of ``major``, when given)."""
    return _first_cuda(_toolkit_homes(), major)


def find_cuda(major: int | None = None) -> Backend | None:
    """The toolkit (its own version unless INSTANT_STAGING_CUDA says), else the wheels."""
    if major is None:
        major = requested_cuda_major()
    found = find_cuda_toolkit(major)
    if found:
        return found
    return _first_cuda(_wheel_homes(major or 12), major or 12)


# -- ROCm ----------------------------------------------------------------------

def _rocm_homes():
    for var in ("ROCM_PATH", "ROCM_HOME", "HIP_PATH"):
        if os.environ.get(var):
            yield os.environ[var], var
    yield "/opt/rocm", "/opt/rocm"
    yield "/usr", "system (libamdhip64-dev)"


# Directories the dynamic loader searches anyway: no rpath needed for these.
_SYSTEM_LIBDIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64")


def find_rocm() -> Backend | None:
    for home, origin in _rocm_homes():
        inc = os.path.join(home, "include")
        if not os.path.isfile(os.path.join(inc, "hip", "hip_runtime_api.h")):
            continue
        libdirs = [d for d in (os.path.join(home, "lib"), os.path.join(home, "lib64"),
                               *sorted(glob.glob(os.path.join(home, "lib", "*-linux-gnu"))))
                   if glob.glob(os.path.join(d, "libamdhip64.so*"))]
        if not libdirs:
            continue
        libdir = libdirs[0]
        libs, link = ["amdhip64"], []
        if not os.path.exists(os.path.join(libdir, "libamdhip64.so")):
            # Only the runtime package's libamdhip64.so.N: link it by file name.
            libs, link = [], [max(glob.glob(os.path.join(libdir, "libamdhip64.so.*")))]
        system = libdir in _SYSTEM_LIBDIRS or (
            os.path.dirname(libdir) in _SYSTEM_LIBDIRS and libdir.endswith("-linux-gnu"))
        # -I/usr/include would reorder gcc's system include search: leave it out.
        incs = [] if os.path.realpath(inc) == "/usr/include" else [inc]
        hip_version = os.path.join(inc, "hip", "hip_version.h")
        version = _header_version(hip_version, "HIP_VERSION") or (
            _header_version(hip_version, "HIP_VERSION_MAJOR") * 10**7
            + _header_version(hip_version, "HIP_VERSION_MINOR") * 10**5
            + _header_version(hip_version, "HIP_VERSION_PATCH"))
        text = (f"{version // 10**7}.{version // 10**5 % 100}.{version % 10**5}"
                if version else "(version unknown)")
        toolchain = f"HIP {text} ({'system package' if system else 'ROCm install'})"
        return Backend("rocm", "instant_staging/runtime/_hip.pyx", incs, [libdir], libs,
                       [("__HIP_PLATFORM_AMD__", "1")], link,
                       [] if system else [libdir], f"{origin}: {home}", version, toolchain)
    return None


# -- the choice ------------------------------------------------------------------

_HOW_TO_SWITCH = ("choose with INSTANT_STAGING_BACKEND=cuda|rocm (and INSTANT_STAGING_CUDA=12|13); "
                  "pip reuses a wheel it built before, so add --no-cache-dir --force-reinstall")


def find_backend(requested: str | None = None) -> Backend:
    """The backend to build (see the module docstring for the rule)."""
    requested = (requested or requested_backend()).strip().lower()
    if requested not in ("", "cuda", "rocm"):
        raise BackendNotFound(f"{BACKEND_VAR} must be 'cuda' or 'rocm', not {requested!r}")
    major = requested_cuda_major()
    if requested == "rocm":
        found = find_rocm()
    elif requested == "cuda":
        found = find_cuda(major)
    else:
        found = find_cuda_toolkit(major)
        if found is None:
            found = find_rocm()
            if found is not None:
                _note(f"no CUDA toolkit found: building the ROCm backend ({found.toolchain}); "
                      f"for CUDA set {BACKEND_VAR}=cuda (PyPI's CUDA 12 runtime is fetched "
                      "when there is no toolkit)")
        if found is None:
            found = find_cuda(major)
    if found is not None:
        return found
    order = [requested] if requested else ["cuda", "rocm"]
    if "cuda" in order:
        wheels = " ".join(CUDA_WHEELS[major or 12])
        hint = (f"no CUDA toolkit and no CUDA {major or 12} runtime wheels on sys.path. "
                f"`pip install .` fetches them itself; with --no-build-isolation first "
                f"`pip install {wheels}`, or set CUDA_HOME to a toolkit")
    else:
        hint = ""
    if "rocm" in order:
        hint += ("; " if hint else "") + "for ROCm set ROCM_PATH or install Debian's libamdhip64-dev"
    if _cuda_skipped and "cuda" in order:
        hint += "; passed over: " + "; ".join(_cuda_skipped)
    raise BackendNotFound(f"no {' or '.join(order).upper()} toolchain found: {hint}")


def build_requirements() -> list[str]:
    """What the PEP 517 backend adds to the build environment: PyPI's CUDA
    runtime wheels when the build will be CUDA and no toolkit (of the asked
    major version) is found, else nothing."""
    requested = requested_backend()
    major = requested_cuda_major()
    if requested == "rocm":
        return []
    if find_cuda_toolkit(major) is not None:
        return []
    if requested == "" and find_rocm() is not None:
        return []       # find_backend() says so when it builds
    return list(CUDA_WHEELS[major or 12])


def describe(backend: Backend) -> str:
    """One line for the build log: what was chosen, from where, and how to switch."""
    line = f"building the {backend.name} backend: {backend.toolchain} from {backend.origin}"
    if backend.name == "cuda":
        major = backend.version // 1000
        line += (f"; linked statically, needs an NVIDIA driver {MIN_DRIVER.get(major, '?')}+")
        if major >= 13:
            line += f" (for R525+ drivers build with {CUDA_VAR}=12)"
    return line + f"; {_HOW_TO_SWITCH}"


if __name__ == "__main__":
    found = find_backend()
    print(describe(found))
    print("build requirements:", build_requirements() or "none")
