"""Types of the compiled ``_staging`` module (see ``_staging.pyx``)."""

from types import TracebackType

import torch
from typing_extensions import Self

from ._types import Attempt, Kind
from .runtime._table import Runtime

# Imported there from defaults.py and runtime/ (defined once, there).
API_NAMES: dict[str, str]
DEFAULT_SEGMENT_SIZE: int
MAX_PREFAULT_THREADS: int

def auto_prefault_threads(size: int, *, bytes_per_thread: int = ..., max_threads: int = ...) -> int: ...

class StagingBuffer:
    """A pinned host staging buffer that falls back instead of failing."""

    def __init__(
        self,
        size: int,
        *,
        alignment: int | None = None,
        segment_size: int = ...,
        copy_unit: int | None = None,
        register_flags: int = 0,
        alloc_flags: int = 0,
        prefault_threads: int | None = None,
        hugepages: bool | None = None,
        allow_pageable: bool = False,
        runtime: Runtime | None = None,
    ) -> None: ...
    @property
    def kind(self) -> Kind: ...
    @property
    def pinned(self) -> bool: ...
    @property
    def ptr(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    @property
    def segment_size(self) -> int: ...
    @property
    def segments(self) -> tuple[tuple[int, int], ...]: ...
    @property
    def attempts(self) -> tuple[Attempt, ...]: ...
    @property
    def hugepages(self) -> bool: ...
    @property
    def hugepages_reason(self) -> str: ...
    @property
    def runtime(self) -> Runtime: ...
    def spans(self, offset: int = 0, nbytes: int | None = None) -> list[tuple[int, int]]: ...
    def as_tensor(self) -> torch.Tensor: ...
    def close(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...
    def __len__(self) -> int: ...
    # The buffer protocol (memoryview(buf)): Python 3.12+ shows these
    # slots as methods, older ones only to C (stubtest's allowlist says so).
    def __buffer__(self, flags: int) -> memoryview: ...
    def __release_buffer__(self, view: memoryview) -> None: ...
