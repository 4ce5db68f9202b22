"""Build-time only: find the CUDA or ROCm toolchain for setup.py.

Pure Python with no imports from the package, so ``setup.py`` can load it
by path before anything is built.  ``INSTANT_STAGING_BACKEND=cuda|rocm``
overrides detection.  ``find_backend()`` returns a ``Backend`` naming the
Cython source to compile and the include dirs, library dirs, libraries and
macros to compile it with.
"""

import glob
import os
import shutil
import sys
from typing import NamedTuple, Optional


class Backend(NamedTuple):
    name: str                      # "cuda" or "rocm"
    source: str                    # the .pyx that fills the runtime table
    include_dirs: list[str]
    library_dirs: list[str]
    libraries: list[str]
    define_macros: list[tuple[str, Optional[str]]]
    extra_link_args: list[str]
    runtime_library_dirs: list[str]
    origin: str                    # where the toolchain was found, for messages


class BackendNotFound(RuntimeError):
    pass


def _cuda_homes():
    """Candidate CUDA roots, most specific first."""
    for var in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"):
        if os.environ.get(var):
            yield os.environ[var], var
    nvcc = shutil.which("nvcc")
    if nvcc:
        yield os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "nvcc"
    yield "/usr/local/cuda", "/usr/local/cuda"
    # The nvidia-cuda-runtime wheel: site-packages/nvidia/cu13 (CUDA 13 wheels,
    # include/ and lib/ with libcudart_static.a and libcudart.so.13) or
    # site-packages/nvidia/cuda_runtime (the -cu12 wheels).  Only wheels on
    # sys.path are seen: an isolated build (pip's default) sees none of the
    # target environment's, so build those with --no-build-isolation or set
    # CUDA_HOME to the wheel's nvidia/cu13 folder.
    for site in sys.path:
        if not site or not os.path.isdir(os.path.join(site, "nvidia")):
            continue
        for sub in ("nvidia/cu13", "nvidia/cuda_runtime", "nvidia/cu12"):
            yield os.path.join(site, sub), "nvidia-cuda-runtime wheel"


def _crt_include(inc: str) -> Optional[str]:
    """The include dir holding crt/host_defines.h, which cuda_runtime_api.h needs.

    The toolkit ships it beside cuda_runtime_api.h.  The CUDA 13 wheels do not:
    nvidia-cuda-runtime lacks crt/ and nvidia-cuda-crt adds it to the same
    nvidia/cu13/include; for the -cu12 wheels it lives in nvidia/cuda_nvcc.
    """
    nvidia = os.path.dirname(os.path.dirname(inc))
    for cand in (inc, *sorted(glob.glob(os.path.join(nvidia, "*", "include")))):
        if os.path.isfile(os.path.join(cand, "crt", "host_defines.h")):
            return cand
    return None


_cuda_skipped: list[str] = []     # why candidates were passed over, for the error


def _cuda_at(home: str, origin: str) -> Optional[Backend]:
    inc = os.path.join(home, "include")
    if not os.path.isfile(os.path.join(inc, "cuda_runtime_api.h")):
        return None
    crt = _crt_include(inc)
    if crt is None:
        _cuda_skipped.append(f"{home} ({origin}) has cuda_runtime_api.h but no crt/host_defines.h"
                             " (pip install nvidia-cuda-crt)")
        return None
    incs = [inc] if crt == inc else [inc, crt]
    for libdir in (os.path.join(home, "lib64"), os.path.join(home, "lib"),
                   os.path.join(home, "targets", "x86_64-linux", "lib")):
        if os.path.isfile(os.path.join(libdir, "libcudart_static.a")):
            # Static runtime: no libcudart.so needed where the module runs, the
            # module imports without a driver (errors come later), and its
            # cuda* symbols stay private, so no other libcudart in the process
            # (torch's) is called instead or shares its last error.
            return Backend("cuda", "instant_staging/_cuda.pyx", incs, [libdir],
                           ["cudart_static", "rt", "pthread", "dl"], [], [], [],
                           f"{origin}: {home}")
        shared = glob.glob(os.path.join(libdir, "libcudart.so*"))
        if shared:
            lib = "cudart"
            link = []
            if not os.path.exists(os.path.join(libdir, "libcudart.so")):
                # Wheels ship only libcudart.so.N: link it by file name.
                lib, link = None, [sorted(shared)[-1]]
            return Backend("cuda", "instant_staging/_cuda.pyx", incs, [libdir],
                           [lib] if lib else [], [], link, [libdir],
                           f"{origin}: {home}")
    _cuda_skipped.append(f"{home} ({origin}) has headers but no libcudart")
    return None


def find_cuda() -> Optional[Backend]:
    seen = set()
    for home, origin in _cuda_homes():
        key = os.path.realpath(home)
        if key in seen:
            continue
        seen.add(key)
        found = _cuda_at(home, origin)
        if found:
            return found
    return None


def _rocm_homes():
    for var in ("ROCM_PATH", "ROCM_HOME", "HIP_PATH"):
        if os.environ.get(var):
            yield os.environ[var], var
    yield "/opt/rocm", "/opt/rocm"
    yield "/usr", "system (libamdhip64-dev)"


# Directories the dynamic loader searches anyway: no rpath needed for these.
_SYSTEM_LIBDIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64")


def find_rocm() -> Optional[Backend]:
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
            libs, link = [], [sorted(glob.glob(os.path.join(libdir, "libamdhip64.so.*")))[-1]]
        system = libdir in _SYSTEM_LIBDIRS or (
            os.path.dirname(libdir) in _SYSTEM_LIBDIRS and libdir.endswith("-linux-gnu"))
        # -I/usr/include would reorder gcc's system include search: leave it out.
        incs = [] if os.path.realpath(inc) == "/usr/include" else [inc]
        return Backend("rocm", "instant_staging/_hip.pyx", incs, [libdir], libs,
                       [("__HIP_PLATFORM_AMD__", "1")], link,
                       [] if system else [libdir], f"{origin}: {home}")
    return None


def find_backend(requested: Optional[str] = None) -> Backend:
    """The backend to build: INSTANT_STAGING_BACKEND, else CUDA, else ROCm."""
    requested = (requested or os.environ.get("INSTANT_STAGING_BACKEND", "")).strip().lower()
    if requested not in ("", "cuda", "rocm"):
        raise BackendNotFound(f"INSTANT_STAGING_BACKEND must be 'cuda' or 'rocm', not {requested!r}")
    finders = {"cuda": find_cuda, "rocm": find_rocm}
    order = [requested] if requested else ["cuda", "rocm"]
    for name in order:
        found = finders[name]()
        if found:
            return found
    hint = ("install the CUDA toolkit (set CUDA_HOME) or `pip install nvidia-cuda-runtime "
            "nvidia-cuda-crt`; for ROCm set ROCM_PATH or install Debian's libamdhip64-dev")
    if _cuda_skipped and "cuda" in order:
        hint += "; passed over: " + "; ".join(_cuda_skipped)
    raise BackendNotFound(f"no {' or '.join(order).upper()} toolchain found: {hint}")


if __name__ == "__main__":
    print(find_backend())
