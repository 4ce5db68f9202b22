"""Another extension cimports StagingBuffer and reads ptr/size without Python calls."""

import os
import sys
import textwrap

import pytest

import instant_staging as ist
from instant_staging.testing import SimulatedRuntime

CALLER = textwrap.dedent("""
    # cython: language_level=3
    from instant_staging._staging cimport StagingBuffer

    def fill(StagingBuffer buf, unsigned char value):
        cdef char* p = buf.data()
        cdef size_t n = buf.nbytes()
        cdef size_t i
        with nogil:
            for i in range(n):
                p[i] = value
        return n

    def address(StagingBuffer buf):
        return <size_t>buf.data()
""")


def test_cython_extension_cimports_staging_buffer(tmp_path, monkeypatch):
    pytest.importorskip("Cython")
    from Cython.Build import cythonize
    from setuptools import Distribution, Extension

    (tmp_path / "ist_caller.pyx").write_text(CALLER)
    package_root = os.path.dirname(os.path.dirname(ist.__file__))
    ext = Extension("ist_caller", [str(tmp_path / "ist_caller.pyx")])
    dist = Distribution({"ext_modules": cythonize([ext], include_path=[package_root],
                                                  quiet=True,
                                                  build_dir=str(tmp_path / "c"))})
    cmd = dist.get_command_obj("build_ext")
    cmd.build_lib = str(tmp_path)
    cmd.build_temp = str(tmp_path / "tmp")
    cmd.ensure_finalized()
    cmd.run()
    monkeypatch.syspath_prepend(str(tmp_path))
    import ist_caller

    rt = SimulatedRuntime()
    with ist.StagingBuffer(3 * 4096 + 5, runtime=rt, prefault_threads=0) as buf:
        assert ist_caller.address(buf) == buf.ptr
        assert ist_caller.fill(buf, 0xAB) == buf.size
        assert bytes(memoryview(buf)) == b"\xab" * buf.size
    assert ist_caller.address(buf) == 0
    sys.modules.pop("ist_caller", None)
