"""The collector paused while a load builds many Python objects at once.

Parsing a 1,188-tensor header makes ~12,000 objects and allocating its
tensors ~5,000 more; each 700 allocations start a collection, and now and
then a full one, whose cost grows with every object the process holds:
in a process that had imported transformers an occasional parse took
forty times as long, never with the collector paused (docs/design.md,
"Measured: the collector during a parse").  These
stretches free no cycles, so the collector is paused over them only (a few
milliseconds, never across a yield to the caller) and runs as usual after.
"""

import contextlib
import gc


@contextlib.contextmanager
def paused():
    """Pauses the cyclic collector inside the block, if it was running.

    The switch is process-wide: another thread that pauses and resumes it
    meanwhile only lets a collection run earlier (never a wrong result)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
