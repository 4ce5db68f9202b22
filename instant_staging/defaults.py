"""Every default of instant_staging, defined once, with the reason for it.

The state machine, the loader, the CLI and the benchmarks import these;
none of them writes the numbers again.  Measurements are from the H200 host
described in docs/design.md ("Measured").
"""

import mmap
import os

# A typical tensor-parallel rank's staging buffer (the change request's
# InstantTensor default at TP2).
STAGING_SIZE = 2 << 30

# Step 4's segment size: the change request's retry size; a refused 2 GiB
# registration becomes eight of these.
SEGMENT_SIZE = 256 << 20

# Bytes per read and per host-to-device copy.  4 MiB copies still move
# the link's ~55 GB/s, and with two slots per thread (below) the H200 host
# loaded fastest at 4 MiB on both realistic layouts (benchmarks/
# profile_load.py, 2026-11-30, page cache hot, GB/s with 16 threads, chunk /
# slots: Llama-3-8B 4 MiB/32 52.1, 8 MiB/16 50.4, 2 MiB/32 50.2, 8 MiB/32
# 37.4; MoE shard of 1,188 tensors 48.0, 46.0, 46.5, 36.1).
CHUNK_SIZE = 4 << 20

# Slots per reader thread: two let a thread read its next chunk while the
# previous one is still being copied (one slot serialised them: 8 MiB/16
# slots/16 threads 50.4 GB/s vs 4 MiB/32/16 52.1); more were slower at any
# chunk size (4 MiB with 8 threads: 2 slots 47.6, 4 slots 36.5, 8 slots
# 26.8 GB/s): slots a thread refills rarely only add bytes in flight.
SLOTS_PER_THREAD = 2

# Slots one reader thread cycles through at most: a thread waits only for
# its oldest copy, so a few in flight keep the link busy; the bound keeps a
# tiny chunk_size over a large reused buffer from planning millions of slots
# (16 MiB with chunk_size=1 built 16 Mi Python ints: 3 s, 1.4 GB).
MAX_SLOTS_PER_THREAD = 64

# Reader threads: more stopped paying off on the H200 host (16 threads
# 41 GB/s, 32 threads 39 GB/s).
MAX_THREADS = 16

# Chunks in flight when the reader threads are MAX_THREADS: the staging
# buffer of a load holds io_depth * chunk_size (128 MiB).  load_file's
# io_depth=None is SLOTS_PER_THREAD per thread of the load.
IO_DEPTH = SLOTS_PER_THREAD * MAX_THREADS

# A checkpoint not in the page cache is read from disk (load_file and
# iter_load with every knob left unset, loader/_checkpoint.py's resident()):
# in larger reads by fewer threads, in a staging buffer of the same 128 MiB.
# Cold MoE shard on the H200 host's virtio disk, GB/s (two rounds): 16
# threads x 4 MiB 1.36 / 1.60, x 8 MiB 1.43 / 1.58, x 16 MiB 2.08 / 2.01;
# 4 threads x 16 MiB 1.92 / 2.02; one thread of 64 MiB reads 1.87 / 1.71;
# an mmap read in order (safetensors' way) 2.02 / 1.86.  Hot, 16 threads
# of 4 MiB stay the defaults above.
COLD_CHUNK_SIZE = 16 << 20
COLD_THREADS = 4
# Pages sampled (one byte each, without waiting for the disk) to tell a
# cold checkpoint: cold when fewer than half are resident.
COLD_SAMPLES = 8

# A load that made its own staging buffer keeps it for the next load to the
# same device (loader/_staging_pool.py): making and releasing 128 MiB cost
# 21-28 ms a load on the H200 host.  INSTANT_STAGING_KEEP_STAGING=0 turns
# it off; empty_cache() releases what is kept.
KEEP_STAGING = True

# The largest buffer kept: twice a default load's (IO_DEPTH * CHUNK_SIZE),
# so an unusual chunk_size does not leave gigabytes pinned after its load.
KEEP_STAGING_MAX = 2 * IO_DEPTH * CHUNK_SIZE

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


# The most reader threads a load starts, whatever it is asked (argument,
# INSTANT_STAGING_THREADS, --threads): twice the usable CPUs, beyond which
# every host measured lost.  256 MiB hot to the CPU on the 2-CPU CI host,
# 4 MiB chunks, median of 5: 2 threads 4.05 GB/s, 4 3.78, 8 3.55, 16
# 2.40, 64 3.15, 256 2.40; on the 16-CPU H200 host 32 threads 39 GB/s
# against 16's 41 (MAX_THREADS above).  Unbounded, threads=10**11 started
# one thread per chunk (400 for 400 MiB of 1 MiB chunks).
THREADS_PER_CPU = 2


def max_reader_threads() -> int:
    """The cap on a load's reader threads: THREADS_PER_CPU per usable CPU."""
    return THREADS_PER_CPU * usable_cpus()


def max_io_depth(threads=None) -> int:
    """The cap on a load's slots (io_depth): MAX_SLOTS_PER_THREAD for each of
    its reader threads, the most the pipeline ever cycles through.  A load
    also never uses more slots than it has chunks; its own staging buffer
    holds io_depth * chunk_size (the cap: 16 threads x 64 x 4 MiB = 4 GiB)."""
    return MAX_SLOTS_PER_THREAD * reader_threads(threads)


def reader_threads(threads=None) -> int:
    """A load's reader threads: ``threads``, else one per usable CPU, at
    most MAX_THREADS."""
    return threads or max(1, min(MAX_THREADS, usable_cpus()))


def io_depth_for(io_depth, threads) -> int:
    """A load's slots: ``io_depth``, else SLOTS_PER_THREAD per reader thread."""
    return io_depth if io_depth is not None else SLOTS_PER_THREAD * reader_threads(threads)


def staging_segment_size(slot_bytes) -> int:
    """The segment size of a load's own staging buffer: SEGMENT_SIZE, or one
    slot rounded up to the page where a slot is larger, so that every
    registration holds at least one whole slot (the loader cuts slots
    inside registrations, never across them)."""
    page = mmap.PAGESIZE
    return max(SEGMENT_SIZE, -(-slot_bytes // page) * page)

# An object-storage source (loader/_remote.py): one ranged GET per chunk.
# Larger ranges than a disk's amortise each request's cost: 16 MiB reached
# the client's own ceiling on the H200 host where 8 MiB fell short of it on
# the dense layout (benchmarks/RESULTS.md, "Object storage"); 16 requests in
# flight.  Host memory: the staging buffer plus the client's buffers of the
# chunks in flight (threads x chunk), whatever the checkpoint's size.
REMOTE_CHUNK_SIZE = 16 << 20
REMOTE_THREADS = 16
