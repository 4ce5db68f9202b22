"""Types of the compiled ``_simulated`` module (public as ``instant_staging.testing``)."""

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
