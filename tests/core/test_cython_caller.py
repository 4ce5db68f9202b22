"""Another extension cimports StagingBuffer (``from instant_staging cimport``)
and reads its pointer, size and registrations without Python calls or the GIL."""

import os
import sys
import textwrap

import pytest

import instant_staging as ist
from instant_staging.testing import SimulatedRuntime

from support import KIND_FAULTS, SEG, SIZE, make

CALLER = textwrap.dedent("""
    # cython: language_level=3
    from instant_staging cimport StagingBuffer

    def ranges(StagingBuffer buf):
        # The registrations as read without the GIL, one (offset, size) each.
        cdef size_t n, i, offset = 0, size = 0
        cdef size_t offsets[64]
        cdef size_t sizes[64]
        cdef int past_end
        with nogil:
            n = buf.n_registrations()
            for i in range(n if n < 64 else 64):
                buf.registration(i, &offsets[i], &sizes[i])
            past_end = buf.registration(n, &offset, &size)
        assert past_end == -1 and offset == 0 and size == 0
        return [(offsets[i], sizes[i]) for i in range(n)]

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
        assert ist_caller.ranges(buf) == [(0, buf.size)]
    assert ist_caller.address(buf) == 0
    assert ist_caller.ranges(buf) == []          # nothing to copy from once released
    for faults in KIND_FAULTS.values():
        rt, buf = make(faults, allow_pageable=True)
        with buf:
            assert ist_caller.ranges(buf) == list(buf.segments)
            if buf.kind is ist.Kind.SEGMENTED:
                assert len(buf.segments) == 3 and buf.segments[-1][1] == SIZE - 2 * SEG
    sys.modules.pop("ist_caller", None)
