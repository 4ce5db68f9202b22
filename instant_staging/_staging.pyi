"""StagingBuffer: the allocation state machine.

A large pinned host buffer that survives drivers refusing big
registrations.  The steps are those of docs/design.md, one method each, entered
only after the previous one failed:

    1. allocate          page-aligned ordinary memory (mmap), exactly `size`
    2. prefault          fault the pages in with threads (an optimisation)
    3. register          one host_register of the whole range -> REGISTERED
    4. register_segment  adjacent `segment_size` ranges       -> SEGMENTED
    5. rollback          undo the segments if one failed
    6. runtime_alloc     cudaHostAlloc / hipHostMalloc         -> RUNTIME_PINNED
    7. pageable          ordinary memory, opt-in               -> PAGEABLE

The runtime is reached only through its table (``_table.pxd``), so the
same code runs against CUDA, HIP, the simulated runtime, or any of them
wrapped in faults.  Every runtime call is made with the GIL released, and
after every failed call the pending runtime error is cleared so that it
cannot surface later in an unrelated call of the caller's.
"""

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
    """A pinned host staging buffer that falls back instead of failing.

    ``kind`` says which path worked, ``attempts`` what every step did.
    ``spans()`` splits a byte range at registration boundaries: on a real
    driver one copy may not cross two registrations.  Release happens once,
    from ``close()``, the context manager, or garbage collection.

    Args:
        size: bytes, an int >= 1.
        alignment: the mapping's alignment, a power of two >= the page size;
            None (the default): the page size.  With huge pages it is at
            least 2 MiB.
        segment_size: bytes per registration when the whole range cannot
            be registered at once (step 4), a positive multiple of the page
            size; default DEFAULT_SEGMENT_SIZE.
        copy_unit: None, or the size of the chunks copied out of the buffer:
            segment_size is then rounded down to a multiple of it (and of the
            page), so that copy_unit-aligned chunks never straddle two
            registrations.
        register_flags: flags of the runtime's register call; default 0.
        alloc_flags: flags of the runtime's own pinned allocation (step 6);
            default 0.
        prefault_threads: threads that fault the pages in before
            registration (0 disables); None (the default):
            ``auto_prefault_threads(size)``.
        hugepages: advise MADV_HUGEPAGE; None (the default):
            INSTANT_STAGING_HUGEPAGES where set, else huge pages where THP
            allows them and their 2 MiB blocks are free
            (``hugepages_reason`` says which).
        allow_pageable: True: fall back to ordinary, not pinned memory
            (step 7) when nothing could be pinned; default False (that is
            then an error).
        runtime: an instant_staging Runtime; None (the default):
            ``default_runtime()``.

    Raises:
        TypeError, ValueError: an argument of the wrong type or out of range
            (checked before the first allocation).
        StagingError: no memory of an accepted kind could be had
            (``attempts`` says what every step did); RollbackError when
            undoing the registered segments failed too (the memory is then
            retained, still registered).
    """

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
