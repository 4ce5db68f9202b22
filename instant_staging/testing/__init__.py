"""Test doubles: run instant_staging without a GPU, or make any host fail.

``SimulatedRuntime`` is a host-only runtime with the semantics measured on
the real driver (overlapping registration 712, interior unregister 1,
unknown unregister 713, a copy spanning two registrations 1, a pending last
error until read); it counts live registrations and allocations and logs
calls, so tests can assert that nothing leaked::

    from instant_staging.testing import SimulatedRuntime
    rt = SimulatedRuntime(faults="register>2GiB=invalid_value")
    buf = StagingBuffer(4 << 30, runtime=rt)
    assert rt.live_registrations == len(buf.segments)

``FaultPlan`` (from ``instant_staging.faults``) parses the fault spec of
``INSTANT_STAGING_FAULTS``; ``inject_faults(runtime, spec)`` wraps any
runtime (the real one too) in a ``FaultyRuntime`` that fails the calls the
plan names.  Nothing outside this package imports it.
"""

from instant_staging.faults import FaultPlan, FaultRule, as_plan
from instant_staging.runtime._faults import FaultyRuntime, inject_faults
from instant_staging.runtime._simulated import SimulatedRuntime

__all__ = ["FaultPlan", "FaultRule", "FaultyRuntime", "SimulatedRuntime", "as_plan",
           "inject_faults"]
