"""The state machine on the real runtime of this build.

Without a GPU (CI) every runtime call fails: this is the fallback-failure
path on the real driver library, with the runtime's own error names.  With
a GPU these tests skip; tests/core/test_gpu.py covers that side.
"""

import pytest

import instant_staging as ist

from support import gpu_count, rss

pytestmark = pytest.mark.skipif(gpu_count() > 0, reason="a GPU is present: pinning succeeds")

SIZE = 64 << 20
SEG = 16 << 20


def test_whole_chain_fails_cleanly_with_the_runtimes_names():
    rt = ist.real_runtime()
    before = rss()
    with pytest.raises(ist.StagingError) as info:
        # Prefaulted, so a leaked mapping would show in the resident size.
        ist.StagingBuffer(SIZE, segment_size=SEG, prefault_threads=2)
    err = info.value
    assert [a.step for a in err.attempts] == ["allocate", "prefault", "register",
                                              "register_segment", "runtime_alloc"]
    failed = [a for a in err.attempts if not a.ok]
    assert len(failed) == 3 and all(a.code == err.code != 0 for a in failed)
    prefix = "hipError" if ist.BACKEND == "rocm" else "cudaError"
    assert all(a.name == rt.error_name(err.code) and a.name.startswith(prefix) for a in failed)
    assert failed[0].name in str(err) and "allow_pageable" in str(err)
    assert rss() - before < SIZE // 4          # the ordinary memory was freed


def test_allow_pageable_still_returns_a_usable_buffer():
    with ist.StagingBuffer(SIZE, segment_size=SEG, allow_pageable=True) as buf:
        assert buf.kind is ist.Kind.PAGEABLE and not buf.pinned
        view = memoryview(buf)
        view[::4096] = b"\x01" * (SIZE // 4096)
        assert sum(view[::4096]) == SIZE // 4096
        assert buf.spans() == [(buf.ptr, SIZE)]
        view.release()
    assert buf.closed and buf.ptr == 0


def test_faults_env_wraps_the_real_runtime(monkeypatch):
    monkeypatch.setenv("INSTANT_STAGING_FAULTS", "register=not_supported")
    rt = ist.default_runtime()
    assert rt is not ist.real_runtime() and rt.name.endswith("+faults")
    with pytest.raises(ist.StagingError) as info:
        ist.StagingBuffer(SIZE, segment_size=SEG, prefault_threads=0)
    assert info.value.attempts[1].code == 801       # the injected one, not the driver's
    monkeypatch.setenv("INSTANT_STAGING_FAULTS", "register=bogus")
    with pytest.raises(ValueError, match="register=bogus"):
        ist.StagingBuffer(SIZE)
