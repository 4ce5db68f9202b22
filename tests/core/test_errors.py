"""Every exception of the package pickles with all its attributes (multi-rank
loaders send them between processes), retained_ranges has one order
(ascending) in RollbackError and ReleaseError, and the runtime's Python
face has one check/raise idiom and no constructible base."""

import pickle

import pytest

import instant_staging as ist
from instant_staging.loader import LoadError, SafetensorsError, VerifyError
from instant_staging.runtime._table import Runtime
from instant_staging.testing import SimulatedRuntime

from support import SEG, SIZE, make

ATTEMPTS = (ist.Attempt("allocate", True, 0, "", 0, 4096, 0.001),
            ist.Attempt("register", False, 1, "cudaErrorInvalidValue", 0, 4096, 0.002))
RANGES = ((0x1000, 4096), (0x3000, 8192))

ERRORS = [
    ist.StagingError("no buffer", ATTEMPTS),
    ist.StagingError("no buffer", ATTEMPTS, code=35),
    ist.RollbackError("rollback failed", ATTEMPTS, retained_ranges=RANGES),
    ist.ReleaseError("release failed", code=713, retained_ranges=RANGES),
    ist.RuntimeCallError("device_count", 100, "cudaErrorNoDevice"),
    SafetensorsError("header too short", path="/tmp/x.safetensors", tensor="w"),
    SafetensorsError("bad json"),
    LoadError("read failed", path="/tmp/x.safetensors", tensor="w", code=5),
    VerifyError("differs", path="/tmp/x.safetensors", tensor="w"),
]


def attributes(e):
    return {k: v for k, v in vars(e).items()}


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_exceptions_pickle_round_trip_with_every_attribute(error):
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(error, protocol))
        assert type(back) is type(error)
        assert str(back) == str(error)             # no double prefix (SafetensorsError)
        assert back.args == error.args
        assert attributes(back) == attributes(error)


def test_retained_ranges_are_ascending_in_rollback_and_release_errors():
    rt = SimulatedRuntime(faults="register#1=invalid_value;register#4=invalid_value;"
                                 "unregister#1=invalid_value;unregister#2=invalid_value")
    with pytest.raises(ist.RollbackError) as info:
        ist.StagingBuffer(SIZE, segment_size=SEG, prefault_threads=0, runtime=rt)
    ranges = info.value.retained_ranges
    assert len(ranges) == 2 and list(ranges) == sorted(ranges)
    assert ranges[1][0] - ranges[0][0] == SEG               # segments 1 and 2, in order

    rt, buf = make("register#1=invalid_value;unregister=not_registered")
    base = buf.ptr
    with pytest.raises(ist.ReleaseError) as info:
        buf.close()
    assert isinstance(info.value, ist.StagingError) and info.value.code == 713
    assert info.value.retained_ranges == tuple((base + o, n) for o, n in buf.segments)
    assert ist.ReleaseError in (getattr(ist, n) for n in ist.__all__)


def test_base_runtime_cannot_be_made_from_python():
    with pytest.raises(TypeError, match="cannot be instantiated"):
        Runtime()

    class Empty(Runtime):
        pass
    with pytest.raises(TypeError, match="cannot be instantiated"):
        Empty()
    with pytest.raises(TypeError):
        ist.StagingBuffer(4096, runtime=Runtime())


def test_check_clears_the_pending_error_and_raises_with_code_and_name():
    rt = SimulatedRuntime(device_count=0)
    assert rt.check(0, 7, call="x") == 7
    code, count = rt.device_count()
    assert code == 100 and rt.peek_last_error() == 100
    with pytest.raises(ist.RuntimeCallError) as info:
        rt.check(code, count, call="device_count")
    e = info.value
    assert (e.call, e.code, e.name) == ("device_count", 100, rt.error_name(100))
    assert str(e) == f"device_count failed with {rt.error_name(100)} (100)"
    assert rt.peek_last_error() == 0           # cleared on the same runtime
