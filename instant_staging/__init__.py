"""instant_staging: a large pinned host staging buffer that does not fail
where drivers refuse big registrations.

    import instant_staging as ist
    with ist.StagingBuffer(2 << 30) as buf:
        print(buf.kind, [a.step for a in buf.attempts])

See docs/design.md for the state machine and the contract.
"""

from ._build_config import BACKEND
from ._staging import StagingBuffer, auto_prefault_threads
from ._types import (
                     Attempt,
                     Kind,
                     ReleaseError,
                     RollbackError,
                     RuntimeCallError,
                     StagingError,
                     format_size,
                     parse_size,
)
from .runtime import default_runtime, real_runtime

__version__ = "0.1.0"

__all__ = ["BACKEND", "Attempt", "Kind", "ReleaseError", "RollbackError", "RuntimeCallError",
           "StagingBuffer", "StagingError", "auto_prefault_threads", "default_runtime",
           "format_size", "parse_size", "real_runtime"]
