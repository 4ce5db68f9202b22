"""The loader's copy pipeline: reader threads in C, without the GIL.

A loader moves thousands of chunks a second (docs/design.md, "Measured:
chunks a second"); Python threads would hold the GIL for every read, copy
and event call.  Here the
whole per-chunk path runs in plain C threads:

    claim the next chunk -> wait for the slot's previous copy (its event)
    -> pread the chunk into the slot -> copy each piece to its tensor
       (the pieces of one device block's tensors as one copy)
    -> record the slot's event

(A remote chunk bound for CPU tensors skips the slot: its pieces are
copied from the client's buffer, ``_fetch_to_host``.)

A *chunk* is a contiguous file range of at most ``chunk_size`` bytes; a
*piece* is the part of one tensor inside one chunk, so small tensors share
a chunk and large ones span several.  A ``Plan`` cuts the tensors into
chunks and pieces; a ``Pipeline`` runs one plan once.  Each thread owns its
own slots (as in the C program of docs/design.md ("Measured") that came
closest to the host's ceiling), so no thread waits on another.  Device
copies go through the staging buffer's runtime table on the thread's own
stream (after ``set_device``: the current device is per thread); in host
mode a piece is a ``memcpy`` into CPU memory.

Slots are whole chunks inside each registration of the staging buffer
(``StagingBuffer.segments``), so no copy ever spans two registrations,
whatever the chunk size and whatever kind the buffer reached; a slot is as
long as the plan's longest chunk.  The slot count is bounded by what the
load can use: at most one per chunk, and at most ``MAX_SLOTS_PER_THREAD``
per thread.

Lifetimes.  A Pipeline *holds* its staging buffer from construction until
its threads are joined (``StagingBuffer.close()`` raises meanwhile, and
the buffer's atexit release skips it), and nothing here closes file
descriptors: the caller closes them after ``close()`` returned.
``cancel()`` and ``close()`` may be called from any thread, concurrently
with ``wait()`` in another; ``close()`` stops the threads, waits for every
in-flight copy, joins them and only then drops the hold.  A tensor is
reported done only once every copy into it has finished.  The first error
stops every thread; each thread then waits for its in-flight copies before
it exits.  In a fork child (where the reader threads do not exist)
``wait()`` raises instead of waiting forever, and ``close()`` neither locks
nor joins.  At interpreter exit every running pipeline is cancelled and
joined before the staging buffers' own atexit release runs, and a
consumer thread inside a load (``enter_load``/``leave_load``) parks where
it is, never to return into torch or its caller's loop while the
interpreter finalizes.

Faults (docs/design.md "Faults"): the ``read`` and ``copy`` rules of a
``FaultPlan`` are resolved when the plan is made, by position, not by
time: ``read#N`` is the N-th chunk of this plan and ``copy#N`` its N-th
piece, in reading order (file, then offset), 1-based, whichever thread
ends up doing it; ``>SIZE``/``>=SIZE`` compare the chunk's or the piece's
length.  So a rule fails the same chunk in every run, with any number of
threads.  ``read=EIO`` (an errno) fails that chunk's read with the errno;
``read=short`` makes the file end where the chunk begins; ``copy=CODE``
fails that piece's copy with the runtime code, in host mode too.
"""

from collections.abc import Callable, Sequence

from .._staging import StagingBuffer
from ..faults import FaultPlan

HOST: int
DEVICE: int
SKIP_READ: int
SKIP_COPY: int
MAX_SLOTS_PER_THREAD: int
READ_ERROR: int
END_OF_FILE: int
RUNTIME_ERROR: int
CANCELLED: int
FETCH_ERROR: int
CALLS: tuple[str, ...]

def enter_load() -> None: ...
def leave_load() -> None: ...

class Plan:
    """Plan(tensors, chunk_size, *, faults=None, packed=False, joins=None):
    chunks and pieces of a load.

    ``tensors`` is a sequence of ``(fd, begin, end)`` file ranges, in
    reading order (file, then offset); tensor i is the i-th of them.
    ``packed``: the tensors with bytes are views of device blocks (see
    ``joins``), so a chunk is one copy per block however many tensors it
    holds, and chunks are cut every ``chunk_size`` bytes; otherwise a
    tensor that fits in one chunk starts a new chunk rather than being
    split (one copy per tensor).
    ``joins[i]`` (None: none): tensor i's destination continues tensor
    i - 1's, in one allocation (a view of the same block; in a load into
    given tensors, ``_into.joins``: destinations back to back in one
    allocation), so a chunk holding both copies them as one (and, not
    packed, such a group that fits in one chunk is cut into one); pieces
    of other tensors are copied one by one, wherever their destinations
    lie.
    ``faults`` is a ``FaultPlan`` (or None) whose ``read`` and ``copy``
    rules are resolved here, by position (see the module docstring).
    Allocates nothing but its own tables; no file is read.
    """

    def __init__(
        self, tensors: Sequence[tuple[int, int, int]], chunk_size: int, *, faults: FaultPlan | None = None,
        packed: bool = False, joins: Sequence[bool] | None = None,
    ) -> None: ...
    @property
    def n_chunks(self) -> int: ...
    @property
    def n_pieces(self) -> int: ...
    @property
    def n_tensors(self) -> int: ...
    @property
    def max_chunk(self) -> int: ...
    @property
    def total_bytes(self) -> int: ...
    def tensor_at(self, chunk: int, offset: int) -> int: ...
    def chunk(self, chunk: int) -> tuple[int, int, int]: ...
    def interleave_files(self) -> None: ...

class Pipeline:
    """Runs a Plan once: reader threads copy its tensors out of slots.

    Pipeline(plan, *, threads, staging=None, depth=None, device=None, skip=0, fetch=None)

    staging  a StagingBuffer whose registrations give the slots (whole
             slots inside each registration); held until the threads are
             joined.  Required with ``device``.
    depth    without ``staging`` (host mode only): this many slots of
             ordinary memory owned by the pipeline; with it, at most this
             many of its slots (None: all, up to MAX_SLOTS_PER_THREAD per
             thread).
    device   None: pieces are memcpy'd to host addresses; an int: copied to
             that device through ``staging.runtime``.
    threads  reader threads wanted (fewer when there are fewer slots or
             chunks).
    skip     benchmarks only: SKIP_READ and/or SKIP_COPY leave that side out.
    fetch    None: chunks are pread from the plan's descriptors; else a
             callable ``fetch(file, offset, length) -> buffer`` (a remote
             source, ``_remote.py``; the plan's "descriptors" are then file
             indexes), called by the reader threads with the GIL; its
             ``cancel()``, where it has one, is called by ``cancel()`` and
             ``close()``.

    ``start(dsts)`` launches the threads (``dsts[i]``: where tensor i goes;
    with ``more=True`` only the first tensors' destinations, the rest
    following through ``provide(dsts)`` while the threads already read);
    ``wait()`` reports progress; ``cancel()`` asks them to stop; ``close()``
    stops, joins and releases the staging buffer (idempotent, any thread).
    """

    def __init__(
        self,
        plan: Plan,
        *,
        threads: int,
        staging: StagingBuffer | None = None,
        depth: int | None = None,
        device: int | None = None,
        skip: int = 0,
        fetch: Callable[[int, int, int], object] | None = None,
    ) -> None: ...
    @property
    def n_chunks(self) -> int: ...
    @property
    def n_threads(self) -> int: ...
    @property
    def slots(self) -> int: ...
    @property
    def slot_bytes(self) -> int: ...
    @property
    def fetch(self) -> Callable[[int, int, int], object] | None: ...
    def start(self, dsts: Sequence[int], *, more: bool = False) -> None: ...
    def provide(self, dsts: Sequence[int]) -> bool: ...
    def wait(self, timeout: float) -> tuple[list[int], int, bool, bool]: ...
    def cancel(self) -> None: ...
    def close(self) -> None: ...
    def error(self) -> tuple[int, int, str, int, int] | None: ...
