"""Which runtime a StagingBuffer uses when none is given.

``real_runtime()`` is the runtime this build was compiled against (CUDA
or HIP), one instance per process.  ``default_runtime()`` is that runtime
wrapped in the faults of ``INSTANT_STAGING_FAULTS`` when the variable is
set, so any GPU host can play a failing one; the plan is parsed once per
distinct value, so ``#N`` counts calls across the whole process.
"""

import importlib
import os
import threading

from ._build_config import BACKEND

# The runtime's own names of the calls the state machine makes (for
# messages), and the compiled module of each backend: defined here once.
_BACKENDS = {
    "cuda": ("instant_staging._cuda", {"register": "cudaHostRegister", "alloc": "cudaHostAlloc"}),
    "rocm": ("instant_staging._hip", {"register": "hipHostRegister", "alloc": "hipHostMalloc"}),
}
API_NAMES = _BACKENDS[BACKEND][1]

_lock = threading.Lock()
_wrapped = {}


def backend_module():
    """The compiled module that fills the runtime table for this build."""
    return importlib.import_module(_BACKENDS[BACKEND][0])


def real_runtime():
    """The process-wide runtime of this build (no faults)."""
    return backend_module().runtime()


def default_runtime():
    """The real runtime, wrapped in INSTANT_STAGING_FAULTS when it is set.

    A malformed spec raises ValueError naming the bad rule.
    """
    spec = os.environ.get("INSTANT_STAGING_FAULTS", "").strip()
    if not spec:
        return real_runtime()
    with _lock:
        if spec not in _wrapped:
            from ._faults import inject_faults
            from .faults import FaultPlan
            _wrapped[spec] = inject_faults(real_runtime(), FaultPlan.parse(spec))
        return _wrapped[spec]
