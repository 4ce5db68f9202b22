"""README's examples, as a file that mypy checks (tests/core/test_typing.py).

Not collected by pytest (no test_ prefix) and never run: it is read by
mypy against the package's stubs (py.typed, *.pyi).
"""


import instant_staging as ist
from instant_staging.loader import iter_load, load_file
from instant_staging.testing import SimulatedRuntime


def staging_example() -> None:
    with ist.StagingBuffer(2 << 30, copy_unit=8 << 20) as buf:
        print(buf.kind, buf.pinned, [(a.step, a.ok, a.name) for a in buf.attempts])
        view = memoryview(buf)                 # writable, 1-D, format "B"
        spans: list[tuple[int, int]] = buf.spans(0, 8 << 20)
        for ptr, nbytes in spans:
            assert ptr + nbytes <= buf.ptr + buf.size
        view.release()
        print(buf.hugepages, buf.hugepages_reason.upper())
    kind: ist.Kind = buf.kind
    assert kind.pinned or kind is ist.Kind.PAGEABLE
    segments: tuple[tuple[int, int], ...] = buf.segments
    print(segments, buf.closed, ist.BACKEND, ist.__version__)


def tensor_example() -> None:
    import torch
    with ist.StagingBuffer(1 << 20, runtime=SimulatedRuntime()) as buf:
        t: torch.Tensor = buf.as_tensor()       # keeps the buffer exported
        print(t.numel())
        del t


def errors_example() -> None:
    try:
        ist.StagingBuffer(1 << 20, allow_pageable=False, runtime=SimulatedRuntime(
            "register=invalid_value;host_alloc=memory_allocation"))
    except ist.RollbackError as e:
        print(e.retained_ranges)
    except ist.StagingError as e:
        attempts: tuple[ist.Attempt, ...] = e.attempts
        print(e.code, [a.step for a in attempts])


def simulated_example() -> None:
    rt = SimulatedRuntime(faults="register#4=invalid_value", device_count=1)
    with ist.StagingBuffer(64 << 20, segment_size=16 << 20, runtime=rt) as buf:
        print(buf.kind, rt.live_registrations, rt.live_host_allocs)
    code, version = rt.runtime_version()
    print(code + version)


def loader_example(paths: list[str]) -> None:
    tensors = load_file(["model-1.safetensors", "model-2.safetensors"], "cuda:0")
    for name, tensor in iter_load("model.safetensors", "cuda:0", progress=print):
        print(name, tensor)
    buf = ist.StagingBuffer(256 * (8 << 20), copy_unit=8 << 20)   # reuse across loads
    more: dict[str, object] = load_file(paths, "cuda:1", staging=buf)
    # safetensors' keyword name for the source, as code written for it passes it
    same = load_file(filename="model.safetensors", device="cuda:0")
    print(len(tensors), len(more), len(same))


def check_example() -> None:
    rt = SimulatedRuntime()
    count: int = rt.check(*rt.device_count(), call="device_count")
    print(count, rt.backend)
