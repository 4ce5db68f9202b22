"""Types of the compiled ``_faults`` module (see ``_faults.pyx``)."""

from typing import TypeVar, overload

from ._table import Runtime
from .faults import FaultPlan

_R = TypeVar("_R", bound=Runtime)

class FaultyRuntime(Runtime):
    """``inner`` with the faults of ``plan`` (a FaultPlan or a spec string)."""

    def __init__(self, inner: Runtime, plan: FaultPlan | str) -> None: ...
    @property
    def inner(self) -> Runtime: ...
    @property
    def plan(self) -> FaultPlan: ...

@overload
def inject_faults(runtime: _R, plan_or_spec: None) -> _R: ...
@overload
def inject_faults(runtime: Runtime, plan_or_spec: FaultPlan | str) -> Runtime: ...
