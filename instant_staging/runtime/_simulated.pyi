"""SimulatedRuntime: a host-only runtime table with the real driver's semantics.

What docs/design.md ("Measured") records on an H200 host, reproduced without a GPU so
that CI runs every success path of the state machine and the loader:

- ``host_register`` of NULL or of 0 bytes is 1 (invalid value); a range
  overlapping a registration (or a runtime allocation) is 712 (already
  registered).
- ``host_unregister`` of a registration's start succeeds, of an interior
  pointer is 1, of anything else 713 (not registered).
- ``host_alloc`` returns page-aligned real memory; ``free_host`` of a
  pointer it did not return is 1.
- ``memcpy_async`` copies synchronously, and a host range that overlaps a
  registration or runtime allocation without lying inside exactly one is
  1 and copies nothing (a copy spanning two segments fails on the driver).
  The device side is host memory; device ranges must lie in one allocation.
- Every failure leaves its code pending until ``get_last_error`` reads it
  (one pending error per runtime, not per thread).

Every table entry is a ``noexcept nogil`` adapter that takes the GIL for
the bookkeeping (Python dicts and lists), which also serialises threads;
only the copy itself runs without it.  Calls are logged for tests.  With
``faults=`` the table is wrapped by ``FaultyRuntime`` while the counters
and the log stay here.
"""

from typing import Any

from ._table import Runtime
from .faults import FaultPlan

BACKEND: str  # this build's (imported from _build_config)
DEVICE_NAME: str

def error_text(backend: str, code: int) -> tuple[str, str]: ...

class SimulatedRuntime(Runtime):
    """A runtime without a GPU, behaving like the CUDA driver measured in
    docs/design.md (see the module docstring).

    Leftover allocations are freed when the runtime is collected.

    Args:
        faults: None (the default), or a spec string or ``FaultPlan`` that
            wraps its own table in ``FaultyRuntime``: calls the plan fails
            never reach the simulation, so they are neither counted nor
            logged here.
        device_count: devices, in [0, 1024]; default 1.  0 plays a host
            without a device: device calls fail with no_device (100), host
            calls still work.
        log_limit: bounds ``calls`` (None: unbounded, 0: no log); default
            10000.
        backend: "cuda" or "rocm": picks the error names; None (the
            default): those of the built backend.

    Raises:
        TypeError, ValueError: an argument of the wrong type or out of
            range; a malformed fault spec (ValueError naming the bad rule).
    """

    def __init__(
        self,
        faults: FaultPlan | str | None = None,
        *,
        device_count: int = 1,
        log_limit: int | None = 10000,
        backend: str | None = None,
    ) -> None: ...
    @property
    def backend(self) -> str: ...
    @property
    def plan(self) -> FaultPlan | None: ...
    @property
    def live_registrations(self) -> int: ...
    @property
    def live_host_allocs(self) -> int: ...
    @property
    def live_device_allocs(self) -> int: ...
    def registered_ranges(self) -> list[tuple[int, int]]: ...
    def host_allocations(self) -> list[tuple[int, int]]: ...
    def device_allocations(self) -> list[tuple[int, int]]: ...
    @property
    def pending_error(self) -> int: ...
    @property
    def calls(self) -> list[tuple[Any, ...]]: ...
    def clear_log(self) -> None: ...
    def covers(self, ptr: int, size: int) -> bool: ...
