"""Every default of instant_staging, defined once, with the reason for it.

The state machine, the loader, the CLI and the benchmarks import these;
none of them writes the numbers again.  The measurements behind them are
in docs/design.md, "Why the defaults are what they are".
"""

import mmap
import os

# A typical tensor-parallel rank's staging buffer (the change request's
# InstantTensor default at TP2).
STAGING_SIZE = 2 << 30

# Step 4's segment size: the change request's retry size; a refused 2 GiB
# registration becomes eight of these.
SEGMENT_SIZE = 256 << 20

# Bytes per read and per host-to-device copy.  What counts is the bytes in
# flight (IO_DEPTH of these): a chunk a reader thread just wrote is copied
# to the device best while the host's cache still holds it, and a smaller
# staging footprint loaded every layout faster on an H100 host (64 MiB:
# 1.12-1.18x the 128 MiB of 4 MiB chunks) at a small cost on the H200 host
# (0.96x); 1 MiB chunks were slower again (per-copy costs) (docs/design.md,
# "Measured: the chunk size").  It is the copy unit too: copies of four
# chunks read one at a time were slower on every layout (docs/design.md,
# "Measured: the copy unit").
CHUNK_SIZE = 2 << 20

# Slots per reader thread: two let a thread read its next chunk while the
# previous one is still being copied (one slot serialised them); more were
# slower at any chunk size: slots a thread refills rarely only add bytes in
# flight (docs/design.md, "Measured: slots per reader thread").
SLOTS_PER_THREAD = 2

# Slots one reader thread cycles through at most: a thread waits only for
# its oldest copy, so a few in flight keep the link busy; the bound keeps a
# tiny chunk_size over a large reused buffer from planning millions of slots
# as Python ints, seconds and gigabytes of them (docs/design.md, "Measured:
# the bound on a thread's slots").
MAX_SLOTS_PER_THREAD = 64

# Reader threads: more stopped paying off, 32 loading slower than 16
# (docs/design.md, "Measured: reader threads").
MAX_THREADS = 16

# Chunks in flight when the reader threads are MAX_THREADS: the staging
# buffer of a load holds io_depth * chunk_size (64 MiB).  load_file's
# io_depth=None is SLOTS_PER_THREAD per thread of the load.
IO_DEPTH = SLOTS_PER_THREAD * MAX_THREADS

# A checkpoint not in the page cache is read from disk (load_file and
# iter_load with every knob left unset, loader/_shards.py's resident()):
# in larger reads by fewer threads, in a staging buffer of 128 MiB:
# from a disk, 16 MiB reads were the fastest tried, and 4 threads of them
# as fast as 16.  Hot, 16 threads of 2 MiB stay the defaults above
# (docs/design.md, "Measured: cold reads").
COLD_CHUNK_SIZE = 16 << 20
COLD_THREADS = 4
# The disk's head start (loader/_pagecache.pyx's Warmer) reads ahead of
# those readers with more reads in flight: it holds one piece of memory
# whatever its thread count, and on the H200 host's disk 32 buffered reads
# of 16 MiB in flight were the fastest of the sweep (docs/design.md,
# "Measured: cold reads").
WARM_THREADS = 32
# Pages sampled (one byte each, without waiting for the disk) to tell a
# cold checkpoint: cold when fewer than half are resident.
COLD_SAMPLES = 8

# A load that made its own staging buffer keeps it for the next load to the
# same device (loader/_staging_pool.py): making and releasing 128 MiB is a
# fixed cost of every load that makes its own, a fifth of a MoE shard's
# load (docs/design.md, "Measured: the kept staging buffer").
# INSTANT_STAGING_KEEP_STAGING=0 turns it off; empty_cache() releases what
# is kept.
KEEP_STAGING = True

# The largest buffer kept: twice a default load's (IO_DEPTH * CHUNK_SIZE),
# so an unusual chunk_size does not leave gigabytes pinned after its load.
KEEP_STAGING_MAX = 2 * IO_DEPTH * CHUNK_SIZE

# A load under a process group: how long a rank waits for the others at
# each agreement before it names the ranks that never came (hung or died).
# Generous: the ranks' shares are balanced, so a healthy rank is late by
# seconds, but a cold read of a large checkpoint takes minutes.
DISTRIBUTED_TIMEOUT = 600.0

# A load under a process group exchanges the bytes each rank read packed
# into buckets of at most this size, one collective each, so the number of
# collectives follows the bytes, not the tensors (a fine-grained MoE
# checkpoint holds tens of thousands; on NCCL each collective costs a
# launch and a round trip whatever its size).  Large enough that a
# bucket's transfer hides that cost, small enough that its slots (below)
# stay far from the model's own memory.
GROUP_BUCKET_BYTES = 256 << 20

# The same for a load to the CPU (gloo, buckets in host memory): smaller,
# since host memory this large is mapped fresh by each allocation and
# faulted in page by page on every load (torch's CPU allocator keeps
# nothing), where a few MiB are reused from the heap; a gloo collective
# on the CPU costs far less than an NCCL launch, so the count matters less
# (docs/design.md, "Measured: a group load's buckets").
GROUP_HOST_BUCKET_BYTES = 16 << 20

# Buckets a rank holds at once (sending or receiving): one is filled or
# drained while the other moves.  Device memory beyond the model is this
# times GROUP_BUCKET_BYTES (512 MiB).
GROUP_BUCKET_SLOTS = 2

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
# every host measured lost, the 2-CPU one without a GPU and the 16-CPU one
# with (MAX_THREADS above).  Unbounded, a huge thread count started one
# thread per chunk (docs/design.md, "Measured: threads per CPU").
THREADS_PER_CPU = 2


def max_reader_threads() -> int:
    """The cap on a load's reader threads: THREADS_PER_CPU per usable CPU."""
    return THREADS_PER_CPU * usable_cpus()


def max_io_depth(threads=None) -> int:
    """The cap on a load's slots (io_depth): MAX_SLOTS_PER_THREAD for each of
    its reader threads, the most the pipeline ever cycles through.  A load
    also never uses more slots than it has chunks; its own staging buffer
    holds io_depth * chunk_size (the cap: MAX_THREADS x MAX_SLOTS_PER_THREAD x CHUNK_SIZE)."""
    return MAX_SLOTS_PER_THREAD * reader_threads(threads)


def default_threads(threads: int) -> int:
    """A default thread count (``COLD_THREADS``, ``REMOTE_THREADS``,
    ``PREFETCH_THREADS``) as this host runs it: at most
    ``max_reader_threads()``, silently.  The cap's warning is for a value
    the user set; a default never warns, and the CLI, which passes the
    default on as a value, gets the same figure as the API."""
    return min(threads, max_reader_threads())


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
# the client's own ceiling where 8 MiB fell short of it on the dense layout
# (benchmarks/RESULTS.md, "Object storage"); 16 requests in
# flight.  Host memory: the staging buffer plus the client's buffers of the
# chunks in flight and being copied (at most 2 x threads x chunk: the
# next GETs start while the readers copy), whatever the checkpoint's size.
REMOTE_CHUNK_SIZE = 16 << 20
REMOTE_THREADS = 16
# A checkpoint's requests run on asyncio loops of its own (loader/_remote.py,
# ``_Requests``: a cancel ends every wait at once), each a thread, the
# requests dealt to them in turn.  Each request is a few Python steps on
# its loop (begun, its headers, its body), which wait for the GIL beside
# the reader threads.  One: four were no faster against S3, GCS or Azure
# on the GPU host (docs/develop/remote-timeline.md, "what the requests'
# mechanism and the copies are worth").
REMOTE_REQUEST_LOOPS = 1

# safe_open's prefetch(threads=None): safetensors 0.9's default.
PREFETCH_THREADS = 8

# The local cache of URL sources (``cache_dir=``, loader/_cache.py): its
# entries take at most this many bytes, the least recently used evicted
# first (INSTANT_STAGING_CACHE_MAX_BYTES chooses otherwise); a fill also
# leaves CACHE_KEEP_FREE of its file system free for everything else there.
CACHE_MAX_BYTES = 512 << 30
CACHE_KEEP_FREE = 1 << 30

# A fill's writes (each fetched range's CRC-32 and its pwrite into the
# partial file) are made by up to CACHE_WRITE_THREADS threads of the
# checkpoint's cache beside the load, not by its reader threads: a reader
# hands its range on and fetches the next.  The ranges handed on and not
# yet written (the client's buffers, kept alive until written) hold at most
# CACHE_WRITE_QUEUE bytes of host memory; a reader waits only where the
# disk falls that far behind.  Threads: one file per object, and a file
# system serialises the buffered writes of one file (ext4, xfs: its inode's
# lock), so a few writers spread over the objects the load reads at once.
CACHE_WRITE_THREADS = 4
CACHE_WRITE_QUEUE = 512 << 20

# A fill's entries are flushed (fsync) and named by a thread of the process
# after its load returned; the interpreter's exit waits for them at most
# this many seconds.  Enough for what is left to flush at a local disk's
# rate (the kernel keeps at most vm.dirty_ratio of memory dirty: tens of
# GB on a large host, tens of seconds at 1-2 GB/s); bounded, so that a disk
# that stopped answering (a hung network file system) cannot hold the exit
# forever.  A fill not finished by then stays a partial file, never trusted.
CACHE_FINISH_AT_EXIT = 120.0

# A cache entry is checked in full once (after its fill, else by the first
# open that finds no stamp fitting it), and the check recorded: its bytes
# read back in pieces of CACHE_CHECK_PIECE and compared with the CRC-32s
# its fill made of the fetched ranges, by up to CACHE_CHECK_THREADS threads
# (the reads and zlib's crc32 release the GIL; one core does a few GB/s).
CACHE_CHECK_PIECE = 8 << 20
CACHE_CHECK_THREADS = 8

# A load whose tensors average fewer bytes than this is handed over whole,
# once every tensor of it is read; one of larger tensors, as each tensor
# finishes (integrations/_whole.py, the rule both integrations apply: a
# vLLM batch, transformers' background load).  The consumer (vLLM's copy of
# each tensor into its parameter, transformers' conversions) calls into
# the device once a tensor; made while the reader threads copy, those calls
# cost it several times what they cost alone and slow the readers too: on
# small tensors streaming loses to loading first; on large ones it wins,
# the consumer's work overlapping the load (docs/design.md, "Measured: the
# vLLM path's batches, streamed or whole").
WHOLE_BATCH_MEAN_BYTES = 4 << 20

# Saving (loader/_save.py).  Bytes per write and per device-to-host copy:
# larger than a load's reads, since each write also allocates and maps
# file pages, a cost per call; 16 slots of them (128 MiB, what the kept
# staging buffer of a load may hold: KEEP_STAGING_MAX) let a save reuse a
# load's kept buffer and keep every writer thread two writes deep.  Writer
# threads as PREFETCH_THREADS: a file system takes parallel writes to one
# file from a few threads.  Not yet measured on a GPU host:
# benchmarks/bench_save.py sweeps them against the host's write ceiling.
SAVE_CHUNK_SIZE = 8 << 20
SAVE_SLOTS = 16
SAVE_THREADS = 8

# A tensor's digest (instant_staging.loader.tensor_digest, the metadata of
# save_file(..., digests=True)) is the sha256 of the sha256 of each block of
# this many of its bytes: blocks hash in any order, on any writer thread.
# A save's chunks are whole blocks (SAVE_CHUNK_SIZE is a multiple of it).
DIGEST_BLOCK = 1 << 20

# device_digest (loader/_digest.py): a tensor's words are hashed in chunks
# of this many 4-byte words, each chunk's terms summed on the tensor's own
# device; the table of powers it multiplies by (8 bytes a word, one table
# per lane and device, kept) and each chunk's temporaries are of this
# length, so the device memory a digest takes beyond the tensor is bounded
# by it, whatever the tensor's size.  Smaller tensors are stacked as the
# rows of batches of at most this many words (their temporaries bounded
# alike): a batch's few kernels cover many tensors.  On a CPU, which
# launches no kernels, a batch is of at most DEVICE_DIGEST_BATCH_CPU words,
# so that its temporaries (about 7 bytes a byte) stay in cache.
DEVICE_DIGEST_WORDS = 1 << 22
DEVICE_DIGEST_BATCH_CPU = 1 << 18

# save_delta: the base is brought to the tensors' device (read, for a base
# given as a checkpoint) in batches of at most this many bytes per device,
# compared, and dropped: device memory beyond the model stays within it
# (plus DELTA_MASK and the delta's own tensors).
DELTA_BASE_BATCH = 1 << 30

# save_delta compares runs of tensors whose elements fit one mask of this
# many (a byte each; a bigger tensor alone) at once: their changed counts,
# then the positions of those stored sparse, each read back in one
# transfer, so that many small tensors on a GPU wait for it twice a run,
# not twice a tensor.  On a CPU, which waits for nothing, the mask is
# DELTA_MASK_CPU: small enough to stay in cache between the comparison and
# the two passes that read it again.
DELTA_MASK = 1 << 27
DELTA_MASK_CPU = 1 << 22

# Applying a delta: the sparse patches of one device and element size are
# checked, kept (a rollback's old values) and scattered together, in
# batches of at most this many positions (a batch's temporaries take about
# 16 bytes a position).  One batch is a few kernels and one device sync,
# however many tensors it holds: what a per-tensor path costs in launches
# and syncs on a model of thousands of small tensors is the reason.  A
# patch of at least 1/16 of it is a batch of its own, read and scattered
# where it lies: beside its bytes its own few syncs are nothing, and
# joining it to others would only copy it.
DELTA_PATCH_BATCH = 1 << 24

# save_file to a bucket (loader/_upload.py): parts of SAVE_CHUNK_SIZE (a
# multiple of it for an object that would need more than UPLOAD_MAX_PARTS,
# S3's and GCS's limit), this many in flight (obstore's own default).
UPLOAD_CONCURRENCY = 12
UPLOAD_MAX_PARTS = 10_000
