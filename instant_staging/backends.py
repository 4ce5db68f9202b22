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
from typing import List, NamedTuple, Optional, Tuple


class Backend(NamedTuple):
    name: str                      # "cuda" or "rocm"
    source: str                    # the .pyx that fills the runtime table
    include_dirs: List[str]
    library_dirs: List[str]
    libraries: List[str]
    define_macros: List[Tuple[str, Optional[str]]]
    extra_link_args: List[str]
    runtime_library_dirs: List[str]
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
    # The nvidia-cuda-runtime wheel: site-packages/nvidia/cuda_runtime or
    # (CUDA 13 wheels) site-packages/nvidia/cu13.
    for site in sys.path:
        for sub in ("nvidia/cuda_runtime", "nvidia/cu13", "nvidia/cu12"):
            yield os.path.join(site, sub), "nvidia-cuda-runtime wheel"


def find_cuda() -> Optional[Backend]:
    for home, origin in _cuda_homes():
        inc = os.path.join(home, "include")
        if not os.path.isfile(os.path.join(inc, "cuda_runtime_api.h")):
            continue
        for libdir in (os.path.join(home, "lib64"), os.path.join(home, "lib"),
                       os.path.join(home, "targets", "x86_64-linux", "lib")):
            if os.path.isfile(os.path.join(libdir, "libcudart_static.a")):
                # Static runtime: no libcudart.so needed where the module runs,
                # and the module imports without a driver (errors come later).
                return Backend("cuda", "instant_staging/_cuda.pyx", [inc], [libdir],
                               ["cudart_static", "rt", "pthread", "dl"], [], [], [],
                               f"{origin}: {home}")
            shared = glob.glob(os.path.join(libdir, "libcudart.so*"))
            if shared:
                lib = "cudart"
                link = []
                if not os.path.exists(os.path.join(libdir, "libcudart.so")):
                    # Wheels ship only libcudart.so.N: link it by file name.
                    lib, link = None, [sorted(shared)[-1]]
                return Backend("cuda", "instant_staging/_cuda.pyx", [inc], [libdir],
                               [lib] if lib else [], [], link, [libdir],
                               f"{origin}: {home}")
    return None


def _rocm_homes():
    for var in ("ROCM_PATH", "ROCM_HOME", "HIP_PATH"):
        if os.environ.get(var):
            yield os.environ[var], var
    yield "/opt/rocm", "/opt/rocm"
    yield "/usr", "system (libamdhip64-dev)"


def find_rocm() -> Optional[Backend]:
    for home, origin in _rocm_homes():
        inc = os.path.join(home, "include")
        if not os.path.isfile(os.path.join(inc, "hip", "hip_runtime_api.h")):
            continue
        libdirs = [d for d in (os.path.join(home, "lib"), os.path.join(home, "lib64"),
                               *glob.glob(os.path.join(home, "lib", "*-linux-gnu")))
                   if glob.glob(os.path.join(d, "libamdhip64.so*"))]
        if not libdirs:
            continue
        return Backend("rocm", "instant_staging/_hip.pyx", [inc], libdirs[:1],
                       ["amdhip64"], [("__HIP_PLATFORM_AMD__", "1")], [],
                       libdirs[:1], f"{origin}: {home}")
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
    hint = ("install the CUDA toolkit (set CUDA_HOME) or `pip install nvidia-cuda-runtime`; "
            "for ROCm set ROCM_PATH or install Debian's libamdhip64-dev")
    raise BackendNotFound(f"no {' or '.join(order).upper()} toolchain found: {hint}")


if __name__ == "__main__":
    print(find_backend())
