"""A load's cap on the bytes it fetches from object storage per second.

``max_bytes_per_second=`` (a load option; ``INSTANT_STAGING_MAX_BYTES_PER_SECOND``
where left unset): for users whose storage throttles, or whose link is
shared.  One ``Throttle`` per load, shared by its reader threads: each
range is paid for before it is asked (its caller waits until the moment
the range's bytes fit the rate after every range asked before it), so no
interval of the load fetches faster than the cap, and a load of N bytes
takes at least N / cap seconds.  Time not used (a slow consumer) is not
saved up: there is no burst after a pause.  Every byte fetched is
counted: each try of a range (a retry fetches its bytes again), ``verify=``'s
reads, and an open's first GET of each object (``Checkpoint.open``'s
``max_bytes_per_second=``), which pays for the most it asks and is given
back what the object did not have (``give_back``).
"""

from __future__ import annotations

import threading
import time


class Throttle:
    """A token bucket of ``rate`` bytes per second and no burst."""

    __slots__ = ("_lock", "_next", "rate")

    def __init__(self, rate: int):
        self.rate = rate
        self._lock = threading.Lock()
        self._next = 0.0        # when the bytes asked so far are paid for

    def take(self, n: int) -> float:
        """Seconds the caller waits before it fetches ``n`` bytes."""
        with self._lock:
            now = time.monotonic()
            self._next = max(self._next, now) + n / self.rate
            return self._next - now

    def give_back(self, n: int) -> None:
        """Returns ``n`` bytes paid for and not fetched (a range asked past
        the object's end): the next ranges wait that much less."""
        with self._lock:
            self._next = max(self._next - n / self.rate, time.monotonic())
