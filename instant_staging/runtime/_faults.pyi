"""Types of the compiled ``_faults`` module (see ``_faults.pyx``)."""

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
