"""Build instant_staging against CUDA or ROCm (chosen by _build_backend/backends.py).

The backend is found when extensions are built, not when setup.py is
loaded, so an sdist (and pip's metadata step) needs no toolkit.  Cython
writes its C into the build tree, never beside the sources, so neither
the sdist nor the wheel carries generated C.  ``_build_config.py`` records
what the build used, without any path of the build machine.

    CUDA_HOME=/usr/local/cuda python3 setup.py build_ext --inplace   # developers
    pip install .                                                      # users
"""

import hashlib
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext as _build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


# One loader of backends.py, shared with the in-tree build backend.
sys.path.insert(0, os.path.join(HERE, "_build_backend"))
from instant_staging_build import load_backends  # noqa: E402

backends = load_backends()
try:
    BACKEND = backends.find_backend()
    BACKEND_ERROR = None
except backends.BackendNotFound as e:
    # An sdist, or pip's metadata step in an environment still without the
    # runtime wheels, needs none: build_ext raises this if it is reached.
    BACKEND, BACKEND_ERROR = None, e

# ASan builds (tox -e asan): INSTANT_STAGING_SANITIZE=address.
sanitize = os.environ.get("INSTANT_STAGING_SANITIZE")
san_args = [f"-fsanitize={sanitize}", "-fno-omit-frame-pointer", "-g"] if sanitize else []
common = {"extra_compile_args": ["-O2"] + san_args, "extra_link_args": list(san_args)}

# binding: functions and methods carry real signatures (inspect.signature);
# embedsignature in the clinic format gives each class and builtin a
# __text_signature__, which is how inspect.signature(StagingBuffer) and
# help() read a cdef class's constructor.
CYTHON_DIRECTIVES = {"binding": True, "embedsignature": True,
                     "embedsignature.format": "clinic"}


def ext(name, sources, **kw):
    args = dict(common)
    for key, value in kw.items():
        args[key] = args.get(key, []) + list(value) if key in args else value
    return Extension(name, sources, **args)


# Every backend's modules; build_ext adds the one that fills the runtime table.
extensions = [
    ext("instant_staging.runtime._table", ["instant_staging/runtime/_table.pyx"]),
    ext("instant_staging._staging", ["instant_staging/_staging.pyx"], libraries=["pthread"]),
    ext("instant_staging.loader._pipeline", ["instant_staging/loader/_pipeline.pyx"], libraries=["pthread"]),
    ext("instant_staging.loader._canonical", ["instant_staging/loader/_canonical.pyx"]),
    ext("instant_staging.loader._blocks", ["instant_staging/loader/_blocks.pyx"]),
    ext("instant_staging.loader._entries", ["instant_staging/loader/_entries.pyx"]),
    ext("instant_staging.loader._given", ["instant_staging/loader/_given.pyx"]),
    ext("instant_staging.loader._fds", ["instant_staging/loader/_fds.pyx"]),
    ext("instant_staging.loader._pagecache", ["instant_staging/loader/_pagecache.pyx"],
        libraries=["pthread"]),
    ext("instant_staging.runtime._faults", ["instant_staging/runtime/_faults.pyx"]),
    ext("instant_staging.runtime._simulated", ["instant_staging/runtime/_simulated.pyx"]),
]


def backend_extension(backend):
    return ext(f"instant_staging.runtime._{'cuda' if backend.name == 'cuda' else 'hip'}", [backend.source],
               include_dirs=backend.include_dirs, library_dirs=backend.library_dirs,
               libraries=backend.libraries, define_macros=backend.define_macros,
               extra_link_args=backend.extra_link_args,
               runtime_library_dirs=backend.runtime_library_dirs)


def build_config_text(backend):
    """``instant_staging/_build_config.py``: names and versions, no paths."""
    return ('"""Written by setup.py: what this build was compiled against (no paths)."""\n'
            f"BACKEND = {backend.name!r}\n"
            f"# CUDART_VERSION (12090 is 12.9) or HIP_VERSION of the headers compiled against\n"
            f"RUNTIME_VERSION = {backend.version!r}\n"
            f"TOOLCHAIN = {backend.toolchain!r}\n"
            f"STATIC_RUNTIME = {backend.name == 'cuda'!r}\n")


# One build tree per backend, toolchain, compiler and flags (not per path of
# pip's temporary build environment): a shared build/lib would
# carry the other backend's module into this wheel, and objects compiled
# with another toolkit's headers or other flags would be reused
# (setuptools compares only source times).
_key = hashlib.sha1(repr((
    BACKEND and (BACKEND.name, BACKEND.version, BACKEND.toolchain, BACKEND.define_macros,
                 BACKEND.libraries, BACKEND.include_dirs if "toolkit" in BACKEND.toolchain else None),
    san_args, os.environ.get("CC"), os.environ.get("CFLAGS"))).encode()).hexdigest()[:8]
BUILD_BASE = os.path.join("build", f"{BACKEND.name if BACKEND else 'none'}-{_key}")


class build_ext(_build_ext):
    """Finds the backend, cythonizes into the build tree, writes _build_config.py."""

    def finalize_options(self):
        # The backend's module joins before setuptools finalizes the list
        # (an sdist, which finalizes this command too, needs no backend).
        names = {e.name for e in self.distribution.ext_modules}
        adapters = {"instant_staging.runtime._cuda", "instant_staging.runtime._hip"}
        if BACKEND is not None and not names & adapters:
            self.distribution.ext_modules.append(backend_extension(BACKEND))
        super().finalize_options()

    def _cythonize(self):
        from Cython.Build import cythonize
        if BACKEND is None:
            raise BACKEND_ERROR
        backends._note(backends.describe(BACKEND))
        pyx = [e for e in self.extensions if any(s.endswith(".pyx") for s in e.sources)]
        done = cythonize(pyx, language_level=3, include_path=["instant_staging"],
                         build_dir=os.path.join(BUILD_BASE, "cython"),
                         compiler_directives=CYTHON_DIRECTIVES, quiet=True)
        sources = {e.name: e.sources for e in done}
        for e in pyx:
            e.sources = sources[e.name]

    def run(self):
        self._cythonize()
        inplace = self.inplace
        super().run()
        text = build_config_text(BACKEND)
        targets = [os.path.join(self.build_lib, "instant_staging", "_build_config.py")]
        if inplace:
            package_dir = self.get_finalized_command("build_py").get_package_dir("instant_staging")
            targets.append(os.path.join(package_dir, "_build_config.py"))
        for target in targets:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "w") as f:
                f.write(text)

    def get_outputs(self):
        return super().get_outputs() + [
            os.path.join(self.build_lib, "instant_staging", "_build_config.py")]


setup(
    options={"build": {"build_base": BUILD_BASE}},
    ext_modules=extensions,
    cmdclass={"build_ext": build_ext},
    package_data={"instant_staging": ["*.pxd", "*.pyx", "*.pxi", "*.pyi", "py.typed"],
                  "instant_staging.loader": ["*.pxd", "*.pyx", "*.pyi"],
                  "instant_staging.runtime": ["*.pxd", "*.pyx", "*.pxi", "*.pyi"]},
    exclude_package_data={"": ["*.c", "*.so", "*.html"]},
)
