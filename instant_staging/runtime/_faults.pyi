"""Fault injection: a runtime table that fails chosen calls of another one.

``FaultyRuntime`` wraps any ``Runtime`` (CUDA, HIP, the simulated one, or
another wrapper).  Its table forwards every entry to a copy of the inner
table, except that ``host_register``, ``host_unregister``, ``host_alloc``
and ``free_host`` first ask a fault plan (``instant_staging.faults.FaultPlan``)
whether the call fails.  A failed call returns the plan's code without
reaching the inner runtime and leaves that code pending, as the real
runtime leaves its own, until ``get_last_error`` reads it.  This is how any
host plays the failing hosts of docs/design.md ("Measured") (``INSTANT_STAGING_FAULTS``).

Like the CUDA runtime, the injected pending error is per thread.  The
adapters run without the GIL and take it only to consult the plan and the
wrapper's bookkeeping; the inner call itself is made without it.
"""

from typing import TypeVar, overload

from ._table import Runtime
from .faults import FaultPlan

_R = TypeVar("_R", bound=Runtime)

class FaultyRuntime(Runtime):
    """``inner`` with the faults of ``plan``.

    ``name`` is the inner name plus ``"+faults"``; ``inner`` and ``plan``
    are what it was made from.  Sizes of ``unregister`` and ``free_host``
    calls, for ``>SIZE`` rules, are those recorded when the range was
    registered or allocated through this wrapper (0 when unknown).

    Args:
        inner: the Runtime wrapped (not None).
        plan: a ``FaultPlan`` or a spec string (docs/design.md, "Faults").

    Raises:
        TypeError: ``inner`` is not a Runtime, or ``plan`` neither a spec
            str nor a FaultPlan.
        ValueError: a malformed spec (naming the bad rule).
    """

    def __init__(self, inner: Runtime, plan: FaultPlan | str) -> None: ...
    @property
    def inner(self) -> Runtime: ...
    @property
    def plan(self) -> FaultPlan: ...

@overload
def inject_faults(runtime: _R, plan_or_spec: None) -> _R: ...
@overload
def inject_faults(runtime: Runtime, plan_or_spec: FaultPlan | str) -> Runtime: ...
