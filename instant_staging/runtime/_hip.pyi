"""Types of the compiled ``_hip`` module (built for the ROCm backend only)."""

from ._table import Runtime

BACKEND: str
HEADER_VERSION: int

class HipRuntime(Runtime): ...

def runtime() -> HipRuntime: ...
