"""The in-tree PEP 517 backend: setuptools' ``build_meta`` plus, only when
the build will be CUDA and no toolkit is found, PyPI's CUDA runtime wheels
as build requirements.

pip builds in an isolated environment that sees none of the target
environment's packages, so a no-toolkit CUDA build needs its headers and
``libcudart_static.a`` in that environment: ``get_requires_for_build_*``
asks for them (``backends.py`` beside this file, ``build_requirements()``),
pip installs them there, and ``setup.py`` finds them on ``sys.path``.  On
a host with a toolkit, or for ROCm, nothing is added.  Building an sdist
compiles nothing, so it needs no runtime.
"""

import importlib.util
import os

from setuptools import build_meta as _setuptools
from setuptools.build_meta import (
    build_editable,
    build_sdist,
    build_wheel,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

__all__ = [
    "build_editable",
    "build_sdist",
    "build_wheel",
    "get_requires_for_build_editable",
    "get_requires_for_build_sdist",
    "get_requires_for_build_wheel",
    "load_backends",
    "prepare_metadata_for_build_editable",
    "prepare_metadata_for_build_wheel",
]

_HERE = os.path.dirname(os.path.abspath(__file__))


def load_backends():
    """backends.py beside this file, loaded by path (a plain ``import
    backends`` could meet another module of that name); setup.py uses this
    too.  Build time only: the installed package holds no copy of it."""
    path = os.path.join(_HERE, "backends.py")
    spec = importlib.util.spec_from_file_location("_instant_staging_backends", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _runtime_wheels():
    extra = load_backends().build_requirements()
    if extra:
        print("instant_staging: no CUDA toolkit found: adding PyPI's CUDA runtime to the "
              "build requirements: " + " ".join(extra), flush=True)
    return extra


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + _runtime_wheels()


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + _runtime_wheels()


def get_requires_for_build_sdist(config_settings=None):
    # An sdist holds sources only (no generated C): no runtime needed.
    return _setuptools.get_requires_for_build_sdist(config_settings)
