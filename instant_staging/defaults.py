"""Every default of instant_staging, defined once, with the reason for it.

The state machine, the loader, the CLI and the benchmarks import these;
none of them writes the numbers again.  Measurements are from the H200 host
described in docs/design.md ("Measured").
"""

import os

# A typical tensor-parallel rank's staging buffer (the change request's
# InstantTensor default at TP2).
STAGING_SIZE = 2 << 30

# Step 4's segment size: the change request's retry size; a refused 2 GiB
# registration becomes eight of these.
SEGMENT_SIZE = 256 << 20

# Bytes per read and per host-to-device copy: 8 MiB copies already move
# 54.5 GB/s of the link's ~55 (docs/design.md, "Measured").
CHUNK_SIZE = 8 << 20

# Chunks in flight: the staging buffer of a load holds io_depth * chunk_size.
IO_DEPTH = 16

# Slots one reader thread cycles through at most: a thread waits only for
# its oldest copy, so a few in flight keep the link busy; the bound keeps a
# tiny chunk_size over a large reused buffer from planning millions of slots
# (16 MiB with chunk_size=1 built 16 Mi Python ints: 3 s, 1.4 GB).
MAX_SLOTS_PER_THREAD = 64

# Reader threads: more stopped paying off on the H200 host (16 threads
# 41 GB/s, 32 threads 39 GB/s).
MAX_THREADS = 16

# A load under a process group: how long a rank waits for the others at
# each agreement before it names the ranks that never came (hung or died).
# Generous: the ranks' shares are balanced, so a healthy rank is late by
# seconds, but a cold read of a large checkpoint takes minutes.
DISTRIBUTED_TIMEOUT = 600.0

# Step 2: at most this many prefault threads (a sanity bound on the knob).
MAX_PREFAULT_THREADS = 1024


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
