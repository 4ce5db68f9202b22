"""Build instant_staging against CUDA or ROCm (chosen by instant_staging/backends.py)."""

import hashlib
import importlib.util
import os

from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _load_backends():
    # Loaded by path: the package itself cannot be imported before it is built.
    path = os.path.join(HERE, "instant_staging", "backends.py")
    spec = importlib.util.spec_from_file_location("_ist_backends", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


backend = _load_backends().find_backend()
print(f"instant_staging: building the {backend.name} backend ({backend.origin})")
with open(os.path.join(HERE, "instant_staging", "_build_config.py"), "w") as f:
    f.write('"""Written by setup.py: what this build was compiled against."""\n'
            f"BACKEND = {backend.name!r}\nTOOLCHAIN = {backend.origin!r}\n")

# ASan builds (tox -e asan): INSTANT_STAGING_SANITIZE=address.
sanitize = os.environ.get("INSTANT_STAGING_SANITIZE")
san_args = [f"-fsanitize={sanitize}", "-fno-omit-frame-pointer", "-g"] if sanitize else []
# Names this build's tree (below): the toolchain and the flags that change objects.
_toolchain_key = hashlib.sha1(repr((backend, san_args)).encode()).hexdigest()[:8]

common = dict(extra_compile_args=["-O2"] + san_args, extra_link_args=list(san_args))


def ext(name, sources, **kw):
    args = dict(common)
    for key, value in kw.items():
        args[key] = args.get(key, []) + list(value) if key in args else value
    return Extension(name, sources, **args)


extensions = [
    ext("instant_staging._runtime", ["instant_staging/_runtime.pyx"]),
    ext("instant_staging._staging", ["instant_staging/_staging.pyx"], libraries=["pthread"]),
    ext("instant_staging.loader._pipeline", ["instant_staging/loader/_pipeline.pyx"], libraries=["pthread"]),
    ext("instant_staging._faults", ["instant_staging/_faults.pyx"]),
    ext("instant_staging._simulated", ["instant_staging/_simulated.pyx"]),
    ext(f"instant_staging._{'cuda' if backend.name == 'cuda' else 'hip'}", [backend.source],
        include_dirs=backend.include_dirs, library_dirs=backend.library_dirs,
        libraries=backend.libraries, define_macros=backend.define_macros,
        extra_link_args=backend.extra_link_args,
        runtime_library_dirs=backend.runtime_library_dirs),
]

setup(
    # One build tree per backend and toolchain: a shared build/lib would carry
    # the other backend's module into this wheel, and objects compiled with
    # another toolkit's headers or other flags would be reused (setuptools
    # compares only source times).
    options={"build": {"build_base": os.path.join("build", f"{backend.name}-{_toolchain_key}")}},
    ext_modules=cythonize(extensions, language_level=3, include_path=["instant_staging"],
                          compiler_directives={"embedsignature": True}),
    package_data={"instant_staging": ["*.pxd", "*.pyx", "*.pxi"], "instant_staging.loader": ["*.pyx"]},
)
