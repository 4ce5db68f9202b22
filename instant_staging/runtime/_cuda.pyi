"""Types of the compiled ``_cuda`` module (built for the CUDA backend only)."""

from ._table import Runtime

BACKEND: str
HEADER_VERSION: int

class CudaRuntime(Runtime): ...

def runtime() -> CudaRuntime: ...
