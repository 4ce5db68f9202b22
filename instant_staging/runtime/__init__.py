"""The runtimes: which one a StagingBuffer uses when none is given, and
the compiled modules behind them.

``real_runtime()`` is the runtime this build was compiled against (CUDA
or HIP), one instance per process.  ``default_runtime()`` is that runtime
wrapped in the faults of ``INSTANT_STAGING_FAULTS`` when the variable is
set, so any GPU host can play a failing one; the plan is parsed once per
distinct value, so ``#N`` counts calls across the whole process.

``backend_mismatch()`` says when ``INSTANT_STAGING_BACKEND`` (a build-time
choice) names another backend than this build's: pip reuses a wheel it
built earlier from the same sdist whatever the variable says, so a
switched install can silently keep the old backend.  Importing the package
warns about it; ``doctor`` reports it.

This folder holds every runtime the state machine can call:

- ``_table.pxd``/``_table.pyx``: the runtime table (a struct of nogil
  function pointers, the one seam) and its Python face, ``Runtime``;
  ``_fill.pxi``, the list of its entries that every runtime below fills;
- ``_cuda.pyx``, ``_hip.pyx``: the CUDA and HIP adapters (only the backend
  chosen at build time is compiled);
- ``_simulated.pyx``: the simulated runtime (public through ``testing``);
- ``_faults.pyx``: the fault-injecting wrapper around any of them (the
  fault grammar is ``instant_staging.faults``).
"""

import importlib
import threading
import warnings
from typing import TYPE_CHECKING

from .. import envs
from .._build_config import BACKEND

if TYPE_CHECKING:                 # typed for callers (mypy --strict on README's examples)
    from ._table import Runtime

# The runtime's own names of the calls the state machine makes (for
# messages), and the compiled module of each backend: defined here once.
_BACKENDS = {
    "cuda": ("instant_staging.runtime._cuda", {"register": "cudaHostRegister", "alloc": "cudaHostAlloc"}),
    "rocm": ("instant_staging.runtime._hip", {"register": "hipHostRegister", "alloc": "hipHostMalloc"}),
}
API_NAMES = _BACKENDS[BACKEND][1]

_SWITCH = ("reinstall with the variable set and pip's wheel cache bypassed: "
           "INSTANT_STAGING_BACKEND={want} pip install --no-cache-dir --force-reinstall "
           "--no-binary instant_staging instant_staging")


def backend_mismatch():
    """A one-line message when INSTANT_STAGING_BACKEND names another backend
    than this build's, else None."""
    want = (envs.raw("INSTANT_STAGING_BACKEND") or "").lower()
    if want in ("cuda", "rocm") and want != BACKEND:
        return (f"INSTANT_STAGING_BACKEND={want}, but this instant_staging was built for "
                f"{BACKEND} (a wheel built earlier was reused?): " + _SWITCH.format(want=want))
    return None


_mismatch = backend_mismatch()
if _mismatch:
    warnings.warn(_mismatch, RuntimeWarning, stacklevel=2)

_lock = threading.Lock()
_wrapped = {}


def backend_module():
    """The compiled module that fills the runtime table for this build."""
    return importlib.import_module(_BACKENDS[BACKEND][0])


def real_runtime() -> "Runtime":
    """The process-wide runtime of this build (no faults).

    Returns:
        The build's ``Runtime`` (CUDA or HIP).
    """
    return backend_module().runtime()


def default_runtime() -> "Runtime":
    """The real runtime, wrapped in INSTANT_STAGING_FAULTS when it is set.

    Returns:
        ``real_runtime()``, or, where INSTANT_STAGING_FAULTS is set, a
        ``FaultyRuntime`` around it (one per spec).

    Raises:
        ValueError: a malformed spec (naming the variable and the bad rule).
    """
    spec = envs.raw("INSTANT_STAGING_FAULTS")
    if spec is None:
        return real_runtime()
    with _lock:
        if spec not in _wrapped:
            from ._faults import inject_faults
            _wrapped[spec] = inject_faults(real_runtime(), envs.parse_text("INSTANT_STAGING_FAULTS", spec))
        return _wrapped[spec]
