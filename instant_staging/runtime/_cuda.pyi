"""The CUDA runtime behind the runtime table (see ``_table.pxd``).

Each table entry is a small ``noexcept nogil`` adapter around one CUDA
runtime call, returning the runtime's own ``cudaError_t``.  ``ctx`` is
unused: the CUDA runtime keeps its state (current device, last error per
thread) itself.

The runtime is normally linked statically (``libcudart_static.a``, symbols
kept private to this module), so this module imports on a machine without
a GPU or driver; every call then returns 35 ``cudaErrorInsufficientDriver``
(``cudaRuntimeGetVersion`` still works).  Because the runtime is private,
the last error read through this table is the one this module's calls set,
never that of another libcudart in the process (torch ships its own).
"""

from ._table import Runtime

BACKEND: str
HEADER_VERSION: int

class CudaRuntime(Runtime): ...

def runtime() -> CudaRuntime: ...
