"""The HIP (ROCm) runtime behind the runtime table (see ``_table.pxd``).

Each table entry is a small ``noexcept nogil`` adapter around one HIP
runtime call, returning the runtime's own ``hipError_t`` (HIP uses CUDA's
numbers for the codes the state machine cares about).  ``ctx`` is unused:
HIP keeps its state (current device, last error per thread) itself.

Compiled as C with ``-D__HIP_PLATFORM_AMD__`` against ``libamdhip64``.
Without a GPU the module still imports; Debian's HIP 5.2 then returns
101 ``hipErrorInvalidDevice`` from ``hipHostRegister`` and ``hipHostMalloc``.
"""

from ._table import Runtime

BACKEND: str
HEADER_VERSION: int

class HipRuntime(Runtime): ...

def runtime() -> HipRuntime: ...
