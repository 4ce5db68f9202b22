"""Running a planned load: the one skeleton of every load (``run``), the
plan, the reader pipeline, the consumer, and the iterator every load
hands out.

A load is made ready first (``_prepare.py``: a ``Prepared``); every load
then runs here, as the generator of a ``LoadIterator(prepared)``, through
the same steps:

1. plan the reads (the bytes this process reads),
2. the staging buffer and the reader pipeline,
3. the destinations (where each byte read goes),
4. ready (a process group: every rank agrees it got this far),
5. read and copy (a group: and exchange the parts), hand the tensors out,

and one teardown, ``_LoadState.close()``.  What differs is the strategy:
``_Solo`` (a load of one process, below) or ``_distributed._Shared`` (one
rank's part of a process group's load).  Imports go one way: ``_load`` ->
``_checkpoint`` -> ``_distributed`` -> ``_run`` -> ``_prepare``.

On a GPU, tensors lying back to back in a file share one device block
and are handed out as views of it (``_blocks.pyx``; ``views=False``: each
its own allocation, as everywhere else), and reader threads
(``_pipeline.pyx``, C, no GIL) read chunks of ``chunk_size`` into the
staging buffer's slots and copy them out: to a GPU through the buffer's
runtime table on their own streams, with an event per slot so that
a slot is refilled only after its copy finished; to the CPU with memcpy.

A first load in a fresh process pays CUDA's start, its staging buffer and
its device memory: the buffer is made in a thread of its own
(``_prepare.PendingStaging``) once the headers are checked and the device is known
to be there, while this thread starts torch's CUDA, allocates the blocks
and starts the readers' plan; the readers copy only once the buffer is
made (its registration done: no copy from an unregistered range).

Who owns what, at each moment (everything a load holds is in its
``_LoadState``, and ``_LoadState.close()`` gives it back in this order):

- the checkpoint's file descriptors belong to the load from ``iter_load``
  until the generator's ``finally`` (or ``LoadIterator.close()`` for a load
  that never started) closes them, always after ``Pipeline.close()`` joined
  the readers, so no reader can ever read a reused descriptor number;
- a staging buffer being made belongs to the load's ``PendingStaging``
  (its thread, then the pending start itself) until the load takes it; a load
  that ends before that (an error, a close, Ctrl-C) waits for the making
  and gives the buffer to ``_staging_pool`` (a forked child drops its
  copy; a load dropped by the collector on the making thread leaves that
  to the thread);
- the staging buffer is held by the Pipeline from its construction until
  its threads are joined (``StagingBuffer.close()`` raises meanwhile); a
  buffer the load made itself (or took from an earlier load) then goes
  back to ``_staging_pool``, which keeps it for the next load or closes it;
- a block belongs to the load's handles from its first address given to
  the readers (the block itself until its views replace it), so it too
  is freed only after the join;
- tensors not yet yielded are freed after the join; yielded ones are the
  caller's;
- a group's load (``_distributed._Shared``) holds, besides, the works of
  the exchanges it issued (each keeps its tensors alive until it
  completes; waited for only once every rank issued every exchange), and
  leaves its keys in the group's store (never deleted: ``_Group``);
- ``LoadIterator.close()`` may come from any thread: it cancels and joins
  the pipeline first (no lock needed), then takes the iterator's lock,
  which a ``next()`` in another thread releases as soon as it sees the
  cancel, and closes the generator.
"""

import logging
import os
import threading
import time
import traceback
from typing import TYPE_CHECKING, NamedTuple, Optional

# (the fault plans imported with the loader, not by a server's first load:
# docs/design.md, "Measured: a server's first load")
from .. import faults as _faults  # noqa: F401
from ..defaults import reader_threads
from . import _entries, _gc, _pipeline, _staging_pool
from ._errors import CheckpointChangedError, LoadError, VerifyError
from ._prepare import slot_count, staging_size

if TYPE_CHECKING:
    import torch

log = logging.getLogger("instant_staging")

# The reader pipeline and the fault plans (above) are imported with the
# loader rather than where a load first uses them (the functions below
# still name them there, where tests replace them): in a server that
# imported the loader at its start, the first load paid their import
# (docs/design.md, "Measured: a server's first load").

# How often the consumer wakes to report progress while no tensor finishes.
POLL_SECONDS = 0.05
# verify=True compares in pieces of this many bytes.
_VERIFY_STEP = 64 << 20
# Tensors in the first hand-over, and in each one after it (each takes the
# pipeline's lock once).
_FIRST_BATCH = 4
_BATCH = 32


class LoadReport(NamedTuple):
    """What a finished load did.

    For the CLI (``load --json`` prints every field), the vLLM log line and
    the benchmarks to print instead of measuring again.
    """

    tensors: int
    """The tensors loaded."""
    bytes: int
    """The bytes of their data read (of a ``plan``'s slice, its rows')."""
    seconds: float
    """From the call (``load_file``, ``Checkpoint.load``) to the last tensor."""
    gbps: float
    """``bytes`` per second, in 10^9 bytes/s."""
    device: str
    """Where the tensors went ("cpu", "cuda:0")."""
    staging_kind: Optional[str]
    """The staging buffer's ``Kind`` name ("REGISTERED", ...); None for a
    load to the CPU (ordinary memory: nothing staged)."""
    threads: Optional[int]
    """The reader threads that ran (no more than the load has chunks)."""
    chunk_size: int
    """The bytes of each read."""
    phases: dict
    """``seconds`` split: ``open`` (sources resolved, headers parsed: 0 for
    a checkpoint opened before), ``prepare`` (arguments, device, plan) and
    ``load`` (bytes read and copied)."""
    cache_hit_bytes: int = 0
    """Of ``bytes``, those read from a URL source's local cache (``cache_dir=``)."""
    fetched_bytes: int = 0
    """Of ``bytes``, those fetched from a URL source's object store (the
    rest, neither this nor ``cache_hit_bytes``, from files)."""


class _LoadState:
    """What one load holds, and its one teardown (``close()``).

    Made with the load's LoadIterator, which shares it with the load's
    generator (``run``): both point here, never at each other, so dropping
    the iterator frees the load at once.  ``close()`` gives back everything,
    in the one safe order, from the generator's ``finally`` or, for a load
    whose generator never ran (or a forked child's), from
    ``LoadIterator.close()``; each step is idempotent, so a second call (or
    one after an interrupt cut the first short) finishes what is left."""

    __slots__ = (
        "blocks",
        "cancelled",
        "checkpoint",
        "device",
        "dtypes",
        "faults",
        "finished",
        "handles",
        "options",
        "own_staging",
        "pid",
        "pipe",
        "reads",
        "staging",
        "staging_kind",
        "target",
        "threads",
    )

    def __init__(self, prepared):
        from ._pipeline import DEVICE
        self.checkpoint, self.target, self.dtypes = prepared.shards, prepared.target, prepared.dtypes
        self.options, self.faults = prepared.options, prepared.faults
        target = self.target
        self.device = target.index if target.mode == DEVICE else None
        self.pid = os.getpid()
        self.reads = prepared.reads     # a solo load's ReadPlan until it takes its parts
        self.pipe = None
        self.staging = None     # the buffer the readers' slots are in
        self.own_staging = None  # ... where the load took or made it: given back by close()
        # The destinations (tensors, a block's views, the block itself) not
        # handed out yet: freed by close(), after the join.
        self.handles = []
        self.blocks = None      # blocks made before the pipeline (_Solo.while_staging)
        self.staging_kind = None
        self.threads = None
        self.finished = False   # every tensor loaded (a group: every rank agreed)
        self.cancelled = False

    def open_pipeline(self, how, plan, staging, io_depth, threads):
        """Step 2: the staging buffer (the caller's, one an earlier load
        kept, the one ``PendingStaging`` made, or a new one) and the reader
        pipeline over ``plan``, which holds the buffer until it is joined."""
        from ._pipeline import Pipeline
        threads = reader_threads(threads)
        depth = slot_count(plan, io_depth, threads)
        pending = None
        if staging is None and self.device is not None and self.reads is not None:
            pending = self.reads.staging
        how.while_staging(self, pending)
        if staging is None and self.device is not None:
            if pending is not None:
                # Given up by the start only once taken: a Ctrl-C while
                # waiting for it leaves it to close() (_abandon).
                staging = self.own_staging = pending.take()
                self.reads.staging = None
            else:
                staging = self.own_staging = _staging_pool.own(self.device, *staging_size(plan, depth))
        self.staging = staging
        # (The page cache's warming, where the load started one, goes on
        # ahead of the readers, with more reads in flight than they keep:
        # close() joins it.)
        # Holds the buffer from here until its threads are joined (pipe.close()).
        self.pipe = pipe = Pipeline(plan, threads=threads, staging=staging, depth=depth,
                                    device=self.device, fetch=self.checkpoint.fetch)
        if self.cancelled:
            # Closed from another thread while there was no pipeline to
            # cancel (the staging buffer still being made): the load's next
            # wait() reports the cancel, as close() promises.
            pipe.close()
        self.staging_kind = staging.kind if staging is not None else None
        self.threads = pipe.n_threads

    @property
    def runtime(self):
        """The staging buffer's runtime (None without one): names its errors."""
        return self.staging.runtime if self.staging is not None else None

    def close(self):
        """Gives back everything the load holds: stops and joins the
        readers first, so nothing is freed while a copy may still write it;
        closes its files last, so no reader can read a reused descriptor."""
        if self.pipe is not None:
            self.pipe.close()       # stop, join: no copy in flight into what we free next
        self.handles.clear()        # tensors not handed out (the yielded ones are the caller's)
        self.blocks = None          # blocks not handed out (a failure before the destinations)
        _abandon(self)              # a buffer still being made when the load ended
        buf, self.own_staging, self.staging = self.own_staging, None, None
        if buf is not None and os.getpid() == self.pid:
            _staging_pool.give(self.device, buf)    # kept for the next load, or closed
        # (a forked child's copy goes with the object, as PendingStaging's)
        self.checkpoint.stop_warming()      # the page cache's warming: joined, freed
        self.checkpoint.close()     # only now: no reader can use a reused fd number


class LoadIterator:
    """Yields ``(name, tensor)`` as tensors finish.

    ``close()`` (or leaving a ``with`` block, or dropping it) stops the load,
    waits for in-flight copies, joins the reader threads, frees every tensor
    not yet yielded, and only then closes the files.  It may be called from
    any thread (a watchdog's cancel): a ``next()`` running in another thread
    then raises ``LoadError`` ("cancelled"), and so does every ``next()``
    after closing an unfinished load.  In a forked child ``next()`` raises
    ``LoadError`` (the reader threads are the parent's).
    """

    def __init__(self, prepared):
        """Runs ``prepared`` (``_prepare.Prepared``) as the iterator is consumed."""
        now = time.perf_counter()
        self._times = [now, 0.0, now, None]     # began, opened (seconds), made, ended
        self._chunk_size = prepared.options.chunk_size
        self._device = str(getattr(prepared.target, "device", None))
        self._state = _LoadState(prepared)
        self._lock = threading.RLock()     # one next() or close() at a time
        self._generator = self._generate(self._state)
        self.names = _entries.names(prepared.shards.entries)
        self.total_bytes = prepared.shards.total_bytes
        self._sources = prepared.shards.byte_sources()
        # ``again()``: the same load, of its source opened again the usual
        # way, where a cache hit's object changed before any tensor went out
        # (``_revalidate.py``: the doors that open their own checkpoint set it).
        self.again = None

    def _generate(self, state):
        """The generator of the load: ``run`` with this iterator's strategy
        (a process group's iterator hands it its own)."""
        return _load(state)

    def timed(self, began, opened=0.0):
        """Counts the load's time from the call.

        Args:
            began: the call's ``time.perf_counter()``.
            opened: seconds of it that went to opening its checkpoint
                (``Checkpoint._iter_load``); default 0.0.
        """
        self._times[0], self._times[1] = began, opened

    @property
    def report(self) -> Optional["LoadReport"]:
        """The finished load's ``LoadReport`` (None until it finished)."""
        began, opened, made, ended = self._times
        if ended is None:
            return None
        seconds = ended - began
        kind = self.staging_kind
        return LoadReport(tensors=len(self.names), bytes=self.total_bytes, seconds=seconds,
                          gbps=self.total_bytes / max(seconds, 1e-9) / 1e9, device=self._device,
                          staging_kind=kind.name if kind is not None else None,
                          threads=self.threads, chunk_size=self._chunk_size,
                          phases={"open": opened, "prepare": max(made - began - opened, 0.0),
                                  "load": ended - made},
                          cache_hit_bytes=self._sources[0], fetched_bytes=self._sources[1])

    @property
    def staging_kind(self):
        """The Kind of the staging buffer in use once loading started.

        None before, and for ordinary memory when loading to the CPU.
        """
        return self._state.staging_kind

    @property
    def staging_kinds(self) -> Optional[tuple]:
        """The Kind of every process's staging buffer in this load: this
        process's alone here (``staging_kind``); a process group's iterator
        gives every rank's, in rank order (None there before loading)."""
        return (self.staging_kind,)

    @property
    def threads(self):
        """Reader threads of this load, once it started."""
        return self._state.threads

    def __iter__(self) -> "LoadIterator":
        return self

    def __next__(self) -> tuple[str, "torch.Tensor"]:
        if os.getpid() != self._state.pid:
            raise LoadError(f"this load was started by process {self._state.pid}; a forked child "
                            "cannot continue it (its reader threads exist only in the parent)")
        with self._lock:
            if self._state.cancelled:
                raise LoadError("the load was cancelled: its iterator was closed before it finished")
            # (at interpreter exit a daemon thread parks in either, never
            # left inside torch by the finalization: _pipeline.enter_load)
            _pipeline.enter_load()
            try:
                try:
                    got = next(self._generator)
                except CheckpointChangedError as e:
                    again, self.again = self.again, None
                    if again is None or not getattr(e, "before_load", False):
                        raise
                    self._take(again())     # (this load's generator ended: nothing went out)
                    got = next(self._generator)
                self.again = None           # (a tensor went out: never loaded again)
                return got
            except StopIteration:
                if self._times[3] is None and self._state.finished:
                    self._times[3] = time.perf_counter()
                raise
            finally:
                _pipeline.leave_load()

    def _take(self, other):
        """Runs ``other``'s load (a LoadIterator not started) in this
        one's place; ``other`` is left this one's ended load."""
        lock = self._lock       # (held by this next(): a close() waits on it)
        self.__dict__, other.__dict__ = other.__dict__, self.__dict__
        self._lock = lock

    def close(self):
        state = self._state
        if os.getpid() != state.pid:
            self._close_in_fork_child()
            return
        if not state.finished:
            state.cancelled = True
        pipe = state.pipe
        if pipe is not None:
            pipe.cancel()
            pipe.close()     # stop, join: from here on no reader touches anything
        with self._lock:
            if self._generator.gi_running:
                # close() from inside this load (a progress callback): the
                # generator sees the cancel and cleans up as it unwinds.
                return
            self._generator.close()      # its finally: state.close()
            state.close()                # (a generator that never ran: the files, a buffer being made)

    def _close_in_fork_child(self):
        # The parent's threads do not exist here and its locks may have been
        # copied held: take none; drop the hold and our copies of the fds.
        self._state.cancelled = True
        if self._state.pipe is not None:
            self._state.pipe.close()
        if not self._generator.gi_running:
            self._generator.close()
        self._state.close()

    def __enter__(self) -> "LoadIterator":
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _abandon(state):
    """Gives back what a load's ``ReadPlan`` still holds (nothing once taken)."""
    reads, state.reads = state.reads, None
    if reads is not None:
        reads.abandon()


def run(state, how):
    """The one skeleton of every load, the generator behind its LoadIterator.

    ``how`` is the load's strategy: ``_Solo`` for a load of one process,
    ``_distributed._Shared`` for one rank's part of a process group's.  It
    says which bytes this process reads, where they go, when the process
    may go on, and how the tensors come out; the steps, what the load holds
    (``state``) and its one teardown (``state.close()``) are the same.
    """
    try:
        error = None
        try:
            # 1. Plan the reads: the bytes this process reads (None: none).
            options = state.options
            plan = how.plan_reads(state, options.chunk_size, state.faults)
            # 2. The staging buffer and the reader pipeline.
            if plan is not None:
                state.open_pipeline(how, plan, options.staging, options.io_depth, options.threads)
            # 3. The destinations: where each byte read goes.
            how.provide_destinations(state)
        except Exception as e:
            error = e
        # 4. Ready: raises the error of steps 1-3 (a group: first agrees that
        #    every rank got this far, or raises on every rank).
        how.ready(state, error)
        # 5. Read and copy (a group: and exchange the parts), and hand out
        #    the tensors.
        yield from how.drive(state, state.options.verify, state.options.progress)
        state.finished = True
    except BaseException as e:
        # The traceback's finished frames would keep tensors alive for as
        # long as the caller keeps the exception.
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        state.close()


def _load(state):
    """The generator behind a load of one process: ``run`` with ``_Solo``."""
    return run(state, _Solo())


class _Solo:
    """A load of one process: it reads every byte it wants, into device
    blocks shared by tensors lying back to back (``_blocks.pyx``) or tensors
    of their own, given to the readers while they already read, and hands
    each tensor out as soon as it is finished."""

    def plan_reads(self, state, chunk_size, faults):
        """Step 1: the ``ReadPlan`` that preparing made (the staging buffer
        already being made beside it: ``_prepare.planned``)."""
        return state.reads.plan

    def while_staging(self, state, pending):
        """Step 2, before the load takes its staging buffer: torch's CUDA (in
        a fresh process, its start), and the blocks too where the buffer
        (``pending``) is still being made (``_allocate_blocks``)."""
        state.target.before_copies()
        if pending is not None and not pending.ready():
            state.blocks = _allocate_blocks(state.target, state.reads.runs,
                                            state.checkpoint.entries, state.dtypes)

    def provide_destinations(self, state):
        """Step 3: starts the readers and gives them every address (``_start``)."""
        _start(state.pipe, state.handles, state.target, state.checkpoint, state.dtypes,
               state.reads.runs, state.blocks)
        state.blocks = None         # handles hold the views now
        # (a cache hit: the server asked only now, where making its client,
        # which holds the GIL, no longer holds up the steps before the copies)
        state.checkpoint.revalidating()

    def ready(self, state, error):
        """Step 4: no one to agree with: the error of steps 1-3 as it is."""
        if error is not None:
            raise error

    def drive(self, state, verify, progress):
        """Step 5: each tensor as the pipeline finishes it (``_drive``)."""
        return _drive(state.pipe, state.reads.plan, state.checkpoint, state.target, state.handles,
                      verify, progress, state.runtime)


def _allocate_blocks(target, run_list, entries, dtypes):
    """``{run index: block}``: each block run's block (a block torch cannot
    allocate is left out: its tensors get their own allocations).

    All before the first copy: a cudaMalloc made while copies run cost more
    than one made before (``_target.allocate_blocks``).  Where the load's
    staging buffer is still being made (a fresh one takes milliseconds) this
    runs while the loading thread would wait for it; otherwise (a kept or
    passed buffer) just after the readers start, while they fill the first
    slots, as the copies wait for the addresses anyway (docs/design.md,
    "Measured: making a load's own staging buffer")."""
    if not any(r.block for r in run_list):
        return {}
    return target.allocate_blocks(run_list, entries, dtypes)


def _start(pipe, handles, target, checkpoint, dtypes, run_list, blocks):
    """Starts the pipeline, then hands it every tensor's address in reading
    order: given destinations' all at once (``target.placed()``: a load
    into tensors, checked and gathered before); a block's at once
    (``blocks``: ``_allocate_blocks``'s, made before, or None to make them
    now), tensors of their own as they are
    allocated, while the threads already read, in batches: a thread waits
    only for the tensors of its own chunk.  A MoE shard's tensors took a
    third as long to allocate one by one as their bytes take to load;
    before, every byte waited for the last allocation.  The threads also
    fill their slots while torch reserves those tensors' memory
    (``reserve``: one cudaMalloc of their size).  The views of a block are
    made last, once every address is given (the copies waited for them
    when they were made first).  The figures: docs/design.md, "Measured:
    addresses handed out while reading".

    (``before_copies`` ran first: allocating queues no GPU work, so every
    block handed out here was freed by work that has finished; where it
    does, torch's deterministic fill of new memory, the target waits for
    it before handing the address out: ``_target.py``'s ``_after_fill``.)"""
    entries = checkpoint.entries
    with _gc.paused():
        pipe.start([], more=True)
        placed = target.placed()
        if placed is not None:      # given destinations (a load into tensors): every address known
            handles.extend(placed[0])
            # (the readers fill their slots meanwhile; no byte reaches a
            # destination before the server vouched for a cache hit's entries)
            checkpoint.revalidated()
            pipe.provide(placed[1])
            return
        if blocks is None:
            blocks = _allocate_blocks(target, run_list, entries, dtypes)
        _reserve_own(target, run_list, blocks, entries)
        ptrs, batch = [], _FIRST_BATCH
        for r, run in enumerate(run_list):
            block = blocks.get(r)
            if block is not None:
                # The block itself until its views replace it (below): from
                # its first address given, the readers may copy into it,
                # and handles hold it until they are joined, whatever
                # happens (a Ctrl-C while the views are made).
                handles.extend([block] * (run.stop - run.first))
                ptrs.extend(target.addresses(run, block, entries))
            else:
                ptrs.extend(_allocate(handles, target, entries[k][1], dtypes[k])
                            for k in range(run.first, run.stop))
            if len(ptrs) >= batch or r == len(run_list) - 1:
                if not pipe.provide(ptrs):
                    break       # cancelled: _drive reports it
                ptrs, batch = [], _BATCH
        for r, block in blocks.items():
            run = run_list[r]
            handles[run.first:run.stop] = target.views(run, block, entries, dtypes)


def _reserve_own(target, run_list, blocks, entries):
    """``target.reserve()`` for the tensors of their own: those of the runs
    without a block in ``blocks`` (``_allocate_blocks``'s)."""
    target.reserve([entries[k][1] for r, run in enumerate(run_list) if r not in blocks
                    for k in range(run.first, run.stop)])


def _allocate(handles, target, entry, dtype):
    """Allocates one tensor into ``handles``; returns its address."""
    handle, ptr = target.allocate(entry, dtype)
    handles.append(handle)
    return ptr


def _drive(pipe, plan, checkpoint, target, handles, verify, progress, runtime):
    """Yields tensors as the pipeline finishes them; raises its first error."""
    total, reported, left = checkpoint.total_bytes, -1, len(handles)
    vouched = False     # (a cache hit's entries: the server's answer waited for, once)
    while True:
        finished, done, exited, failed = pipe.wait(POLL_SECONDS)
        if failed:
            pipe.close()
            raise load_error(pipe, plan, checkpoint, runtime)
        if progress is not None and done != reported:
            progress(done, total)
            reported = done
        if finished and not vouched:
            checkpoint.revalidated()    # (the readers go on meanwhile)
            vouched = True
        for i in finished:
            handle, handles[i] = target.tensor(handles[i]), None   # the consumer's from now on
            if verify:
                verify_tensor(checkpoint, checkpoint.entries[i], target, handle)
            left -= 1
            yield checkpoint.entries[i][1].name, target.result(handle)
        if exited:
            break
    if left:
        raise LoadError(f"the load ended with {left} tensor(s) unfinished and no error recorded")
    changed = written_while_read(checkpoint)
    if changed is not None:
        raise changed


def written_while_read(checkpoint):
    """The LoadError for files of ``checkpoint`` written to while they were
    read (``Shards.changed``), or None: the tensors read may mix two
    versions of the file (a trainer saving over the checkpoint that a
    server reloads)."""
    changed = checkpoint.changed()
    if not changed:
        return None
    return CheckpointChangedError(
        f"{changed[0]}{f' (and {len(changed) - 1} more)' if len(changed) > 1 else ''}: "
        "the file was written to while it was loaded (its modification time or size changed "
        "since it was opened), so the tensors read may mix two versions of it: reopen the "
        "checkpoint (Checkpoint.reopen(), or open the source again) once its writer has finished, "
        "and load again (a writer that saves to a new name and renames it over the old one "
        "never mixes)", changed[0])


def load_error(pipe, plan, checkpoint, runtime, entries=None):
    """The LoadError for ``pipe``'s first error; ``entries``: the plan's
    tensors where they are not ``checkpoint.entries`` (a group load's parts)."""
    from ..faults import ERROR_NAMES
    from ._pipeline import CANCELLED, END_OF_FILE, FETCH_ERROR, READ_ERROR, RUNTIME_ERROR
    kind, code, call, chunk, offset = pipe.error()
    if kind == CANCELLED:
        return LoadError("the load was cancelled (its iterator was closed from another "
                         "thread, or the interpreter is exiting)")
    entries = checkpoint.entries if entries is None else entries
    index = plan.tensor_at(chunk, offset)
    path = tensor = None
    where = ""
    if index >= 0:
        file_index, entry = entries[index]
        path, tensor = checkpoint.paths[file_index], entry.name
        where = f"{path}: tensor {tensor!r}: "
    if kind == FETCH_ERROR:
        cause = checkpoint.fetch_error()
        if isinstance(cause, LoadError):
            cause.tensor = cause.tensor or tensor
            return cause
        return LoadError(f"{where}fetching bytes at {offset} failed: {cause}", path, tensor)
    if kind == END_OF_FILE:
        size = checkpoint.current_size(file_index) if index >= 0 else "?"
        return LoadError(f"{where}the file ended at byte {offset} while loading (it is now "
                         f"{size} bytes): was it truncated?", path, tensor, 0)
    if kind == READ_ERROR:
        return LoadError(f"{where}reading at byte {offset} failed: {os.strerror(code)}",
                         path, tensor, code)
    if kind == RUNTIME_ERROR:
        if runtime is not None:
            name, text = runtime.error_name(code), f" ({runtime.error_string(code)})"
        else:
            name = ERROR_NAMES.get(code, f"error {code}")
            text = ""
        return LoadError(f"{where}{call} failed with {name}{text}", path, tensor, code)
    return LoadError(f"could not start reader threads: {os.strerror(code)}", code=code)


def verify_tensor(checkpoint, where, target, handle):
    """Compares the tensor of ``where`` (``(file index, entry)``) with its
    bytes in the file, read again without the staging buffer."""
    file_index, entry = where
    path = checkpoint.paths[file_index]
    for offset in range(0, entry.nbytes, _VERIFY_STEP):
        want = min(_VERIFY_STEP, entry.nbytes - offset)
        data = checkpoint.read_bytes(file_index, entry.begin + offset, want)
        got = len(data)
        if got != want:
            raise VerifyError(f"{path}: tensor {entry.name!r}: the file ended while verifying "
                              f"(byte {entry.begin + offset + got})", path, entry.name)
        if not target.equal(handle, offset, data):
            raise VerifyError(f"{path}: tensor {entry.name!r}: bytes [{offset}, "
                              f"{offset + len(data)}) differ from the file after loading",
                              path, entry.name)
