"""A load made ready, as a value: ``Prepared``.

Every load passes here between its door and its run.  At the door
(``load_file``, ``iter_load``, ``Checkpoint``, ``safe_open``) its device
and dtype are parsed once into a ``Parsed`` value (``parse_target``: no
CUDA asked, so a bad one is named before any file is opened), and its
options into a ``LoadOptions``.  Preparing then:

1. finds the device usable (``usable_target``: in a fresh process, CUDA's
   start, while a cold checkpoint's selection is read into the page cache),
2. keeps the load's share of the checkpoint (``select``: ``names=`` or the
   rows of ``plan=``),
3. gives each tensor its dtype on the target,
4. for a load of one process (``prepare_solo``): plans its chunks
   (``plan_chunks``) and starts making its own staging buffer
   (``PendingStaging``) while the load goes on; for one rank of a process
   group (``prepare_share``): samples the page cache, and leaves the plan
   to the group, which the ranks agree on (``_distributed.py``).

The result is a ``Prepared``, which ``LoadIterator(prepared)`` runs
(``_run.py``); a group entry hands ``iter_load_group`` a ``Prepared`` or
the exception that preparing raised, so that every rank learns of it at
the ranks' first agreement instead of waiting for the timeout.

Who owns what: the ``Prepared``'s shards are the load's held share (closed
by the load's teardown, or by the preparer if preparing fails); its
``ReadPlan``'s staging buffer being made belongs to the ``PendingStaging``
until the load takes it, and ``ReadPlan.abandon()`` gives it back to
``_staging_pool`` where the load never does.
"""

import dataclasses
import logging
import os
import sys
import threading
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Union

from ..defaults import (
    COLD_CHUNK_SIZE,
    KEEP_STAGING_MAX,
    WARM_THREADS,
    io_depth_for,
    reader_threads,
    staging_segment_size,
)
from . import _blocks, _entries, _gc, _staging_pool
from ._errors import CheckpointChangedError, LoadError
from ._options import LoadOptions, torch_dtype
from ._target import _import_torch, _TorchTarget, parse_device
from ._throttle import Throttle

if TYPE_CHECKING:
    import torch

    from ..faults import FaultPlan
    from ._shards import Shards


# -- the target: parsed at the door, found usable when preparing ----------------------

class Parsed(NamedTuple):
    """A load's device and dtype, parsed at the door (``parse_target``)."""

    torch: Any
    device: "torch.device"
    """The device, of a kind this loader loads to; whether this host has it
    is asked once, by ``usable_target``."""
    dtype: Optional["torch.dtype"]
    """The dtype floating tensors are converted to; None keeps the file's."""


def parse_target(device, dtype) -> Parsed:
    """``device`` and ``dtype`` checked for form, without asking CUDA (a bad
    one is named before any file is opened)."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors data is little-endian; this loader needs a little-endian host")
    torch = _import_torch()
    return Parsed(torch, parse_device(torch, device), torch_dtype(torch, dtype))


def usable_target(parsed: Parsed, shards=None, tuned=False) -> _TorchTarget:
    """The load's target: the device of ``parsed`` found usable (in a fresh
    process, CUDA's start), before anything is allocated.

    A load to a GPU with the knobs left to the loader (``tuned``) has its
    selection of ``shards`` read into the page cache from here on where the
    page cache lacks it (``Shards.warm_if_cold``: this is the disk's head
    start, which reads ahead of the load's readers with more reads in
    flight than they keep, until the load ends): in a fresh process while
    CUDA starts, in a server's beside its readers.  A device that turns out
    unusable stops and joins those reads before its error is raised."""
    torch, device, dtype = parsed
    warming = (shards is not None and tuned and device.type != "cpu"
               and shards.warm_if_cold(COLD_CHUNK_SIZE, WARM_THREADS))
    try:
        return _TorchTarget(torch, device, dtype)
    except BaseException:
        if warming:
            shards.stop_warming()
        raise


def checked_target(device, dtype) -> _TorchTarget:
    """The load's target: ``device`` and ``dtype`` checked (and the device
    found usable: in a fresh process, CUDA's start) before anything is read."""
    return usable_target(parse_target(device, dtype))


def check_selection(names, plan):
    """A load selects by ``names=`` or by ``plan=``, never both."""
    if names is not None and plan is not None:
        raise ValueError("pass names= or plan= (whose keys are the names), not both")


def select(shards, names, plan):
    """Keeps ``plan``'s (or ``names``') tensors of ``shards``, a load's share."""
    check_selection(names, plan)
    with _gc.paused():      # thousands of entries' objects, no cycles
        if plan is not None:
            shards.select_rows(plan)
        else:
            shards.select(names)


def check_unchanged(shards, wait=True):
    """Raises ``CheckpointChangedError`` where a file the load of ``shards``
    (its selection) reads was written to since it was opened
    (``Shards.changed``): its bytes are no longer at the offsets of the
    header parsed then, and the load would write them into its
    destinations (a trainer copying its next step over the file a server
    keeps open).  Asked at the start of every load, before any byte is
    read; a change during the load is ``_run.written_while_read``'s.
    ``wait=False``: a cache hit still being revalidated is not waited for
    (a load of one process waits before its first tensor goes out:
    ``Shards.revalidated``)."""
    changed = shards.changed(wait)
    if changed:
        more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
        raise CheckpointChangedError(
            f"{changed[0]}{more}: the file was written to since the checkpoint was opened (its "
            "modification time or size changed), so its tensors are no longer where its header "
            "said: nothing was read; reopen the checkpoint (Checkpoint.reopen(), or open the "
            "source again) to load the file as it is now", changed[0])


def throttled(shards, options: LoadOptions):
    """Gives this load's share of a URL source its bandwidth cap (``_throttle.py``)."""
    if options.max_bytes_per_second is not None:
        shards.throttle = Throttle(options.max_bytes_per_second)


# -- the staging buffer, started while the load goes on -----------------------------

class PendingStaging:
    """A load's own staging buffer, made by a thread of its own
    (``_staging_pool.own``) while the load goes on: prefaulting and
    registering 128 MiB takes milliseconds (docs/design.md, "Measured:
    making a load's own staging buffer"), and in a fresh process their
    registration waits for CUDA's context as torch's start does.  (One
    that an earlier load kept is taken at once, without the thread.)

    ``take()`` waits for it and hands it over (or raises its error);
    ``abandon()``, for a load that ends before taking it, waits for it and
    gives it to ``_staging_pool``.  Exactly one of the two is called.

    They wait on an event the thread sets, never with ``Thread.join()``: a
    Ctrl-C that interrupts a join makes CPython 3.11 mark the thread stopped
    while it runs (bpo-45274's handling), and the exit then no longer waits
    for it, finalizing the interpreter inside its registration."""

    def __init__(self, device, size, slot_bytes, early=False):
        self._device, self._pid = device, os.getpid()
        self.size, self.segment_size = size, staging_segment_size(slot_bytes)
        self._error = None
        self._abandoned = False
        self._made = threading.Event()
        # An early one's log records, held until a load takes it (``_Held``).
        self._records = [] if early else None
        # A buffer an earlier load kept is taken here, with no thread: starting
        # one and setting its device cost about a percent of a MoE load, for
        # a take of microseconds (docs/design.md, "Measured: making a load's
        # own staging buffer").
        self._buf = _staging_pool.take_kept(device, size, slot_bytes)
        if self._buf is not None:
            self._thread = None
            self._made.set()
            return
        # Not a daemon: an exit waits for the (bounded) making, and the
        # staging module's exit hook then releases the buffer; a daemon
        # would be dropped inside the runtime's calls.
        self._thread = threading.Thread(target=self._run, args=(device, size, slot_bytes),
                                        name="instant_staging-staging")
        # Set as the thread's steps without the GIL begin (``_staging.beside``)
        # or as it ends.
        self._entered = threading.Event()
        try:
            self._thread.start()
        except RuntimeError:            # no thread to be had: make it here
            self._thread = None
            if early:                   # (at the door, nothing: the load makes its own)
                self.size = 0
                self._made.set()
                return
            self._make(device, size, slot_bytes)
            self._made.set()
            error = self._error
            if error is not None and not isinstance(error, Exception):
                self._error = None
                raise error from None   # a Ctrl-C in the caller's own thread is its own
            return
        # The caller waits while the thread runs its Python (its device, the
        # buffer's checks; a few hundred microseconds): else the GIL, which
        # the caller's own Python holds from here on, let the thread reach
        # its steps only once the caller waited for the buffer, which was
        # then made in full on a server's first load (docs/design.md,
        # "Measured: a server's first load").  At most one switch interval:
        # a thread held up longer (a device's context still being made)
        # would have had the GIL by then anyway.
        self._entered.wait(sys.getswitchinterval())

    def _run(self, device, size, slot_bytes):
        from .. import _staging
        _staging.beside.entering = self._entered
        try:
            _use_device(device)         # this thread's own: no caller's device changes
            self._make(device, size, slot_bytes)
        finally:
            _staging.beside.entering = None
            self._made.set()
            self._entered.set()
            if self._abandoned:
                self._give_back()

    def _make(self, device, size, slot_bytes):
        held = _Held(threading.get_ident()) if self._records is not None else None
        if held is not None:
            _log.addFilter(held)
        try:
            self._buf = _staging_pool.own(device, size, slot_bytes)
        except BaseException as e:      # raised by take(), in the load's thread
            self._error = e
        finally:
            if held is not None:
                _log.removeFilter(held)
                self._records = held.records

    def _wait(self):
        # In a forked child the thread is not there (and the event may never
        # be set): nothing to wait for.
        if os.getpid() == self._pid:
            self._made.wait()

    def ready(self):
        """Whether ``take()`` would return at once."""
        return self._made.is_set() or os.getpid() != self._pid

    def fits(self, device, size, slot_bytes):
        """Whether this one (begun at the door, ``early_staging``) serves a
        load to ``device`` whose own buffer would be ``staging_size``'s
        ``(size, slot_bytes)``: as many bytes and registrations of at least
        its segment, as a kept buffer must (``_staging_pool``); and, while
        it is still being made, at most twice what that load needs (a small
        checkpoint's few slots are made sooner than the default buffer).
        One that failed fits only a load that asks exactly its size."""
        segment = staging_segment_size(slot_bytes)
        if self.ready() and self._error is not None:
            # Its error is the load's only where the load would ask the same;
            # else the load makes its own (and this one's warnings are dropped).
            return device == self._device and (size, segment) == (self.size, self.segment_size)
        return (device == self._device and self.size >= size and self.segment_size >= segment
                and (self.ready() or self.size <= 2 * size))

    def take(self):
        self._wait()
        buf, error, self._buf, self._error = self._buf, self._error, None, None
        records, self._records = self._records, None
        for record in records or ():
            _log.handle(record)     # an early one's warnings, now that a load uses it
        if error is not None:
            raise error
        if buf is None:
            raise LoadError("the staging buffer's thread ended without a buffer or an error")
        return buf

    def abandon(self):
        if self._thread is threading.current_thread():
            # The garbage collector ran a dropped load's close on this very
            # thread (a thread cannot wait for itself): inside the making,
            # the end of _run gives the buffer back; after it, here.
            if self._made.is_set():
                self._give_back()
            else:
                self._abandoned = True
            return
        self._wait()
        self._give_back()

    def discard(self):
        """For a load that failed before it was prepared (at its door): waits
        for the making and closes the buffer, so that the failed call leaves
        nothing pinned; its log records go with it."""
        self._wait()
        buf, self._buf, self._error, self._records = self._buf, None, None, None
        if buf is not None and os.getpid() == self._pid:
            _staging_pool.discard(buf)

    def _give_back(self):
        buf, self._buf, self._error, self._records = self._buf, None, None, None
        if buf is not None and os.getpid() == self._pid:
            _staging_pool.give(self._device, buf)
        # (a forked child's copy goes with the object: StagingBuffer's
        # release in a child only drops the child's mapping)


def _use_device(device):
    """Makes ``device`` this thread's current device (the staging thread's
    own, so no caller's current device changes).  A registration belongs to
    the context of the thread's current device, and a new thread's is device
    0: without this a load to cuda:1 created device 0's context in a process
    that may never use it (a vLLM worker of rank 1 sees every GPU and sets
    its own), which costs that GPU hundreds of MiB and the load the time to
    create it.  The memory is pinned for every device either way (on a UVA
    host cudaHostRegisterDefault is portable).  A failure is left to the
    registration, which reports its own."""
    from ..runtime import default_runtime
    try:
        default_runtime().set_device(device)
    except Exception:           # no runtime to be had: making the buffer says why
        pass


_log = logging.getLogger("instant_staging")


class _Held(logging.Filter):
    """Holds back the records one thread logs on the ``instant_staging``
    logger (an early staging buffer's fallback warnings): logged when a load
    takes that buffer, dropped where none does, so that a buffer begun at
    the door and not used never adds a warning to those of the buffer the
    load makes instead."""

    def __init__(self, ident):
        super().__init__()
        self.ident, self.records = ident, []

    def filter(self, record):
        if record.thread != self.ident:
            return True
        self.records.append(record)
        return False


def early_staging(parsed: Parsed, options: LoadOptions, remote=False) -> Optional[PendingStaging]:
    """The staging buffer of a server's first load, begun at its door.

    A load to a GPU that was given no staging buffer and finds none kept
    (``_staging_pool``) makes its own, and waited for it (docs/design.md,
    "Measured: a server's first load"); begun here, before its checkpoint
    is opened and planned, the making runs beside that.  Only where the
    device's CUDA is started already (a server: no context is created
    beside torch's start, and the device's index is known), for local
    files (a URL's load chooses larger chunks), and the size the load would
    ask with these options (``begin_staging``) where it stays keepable
    (``KEEP_STAGING_MAX``).  ``begin_staging`` uses it where it fits the
    plan; else the load keeps it aside (``ReadPlan.spare``) and gives it to
    the pool at its end.  A door whose load fails before it is prepared
    calls ``discard()``.  Called once the arguments are checked."""
    torch, device, _ = parsed
    if options.staging is not None or device.type == "cpu" or remote or not _started(torch):
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _staging_pool.kept():
        return None         # (begin_staging takes it at once, where it fits)
    slot = options.chunk_size
    size = io_depth_for(options.io_depth, reader_threads(options.threads)) * slot
    if size > KEEP_STAGING_MAX:
        return None
    pending = PendingStaging(index, size, slot, early=True)
    return pending if pending.size else None


def _started(torch):
    """Whether torch's CUDA is started in this process (a server's)."""
    return torch.cuda.is_initialized()


def fault_plan(staging):
    """The plan whose ``read`` and ``copy`` rules this load obeys: that of the
    staging buffer's runtime if it has one, else INSTANT_STAGING_FAULTS."""
    from .. import envs
    plan = getattr(staging.runtime, "plan", None) if staging is not None else None
    return plan if plan is not None else envs.get("INSTANT_STAGING_FAULTS")


class ReadPlan:
    """A solo load's reads, planned: the chunks (``plan``, the pipeline's
    ``Plan``), which tensors share a device block (``runs``, ``_blocks.pyx``)
    and its own staging buffer being made (``staging``: a ``PendingStaging``,
    or None).  The load takes the buffer from it (``_run``), or ``abandon()``
    gives it back."""

    __slots__ = ("plan", "runs", "spare", "staging")

    def __init__(self, plan, run_list):
        self.plan, self.runs, self.staging = plan, run_list, None
        self.spare = None   # one begun at the door that did not fit: given back at the end

    def abandon(self):
        """Gives back the staging buffer being made, if the load has not
        taken it, and the spare one."""
        staging, self.staging = self.staging, None
        try:
            if staging is not None:
                staging.abandon()
        finally:
            spare, self.spare = self.spare, None
            if spare is not None:
                spare.abandon()


def plan_chunks(checkpoint, target, dtypes, chunk_size, faults, views, joins=None):
    """The load's ``ReadPlan``: which tensors share a block, and the chunks.
    ``joins``: ``Plan(joins=)`` where the destinations are given (a load
    into tensors: ``_into.InPlace.place``'s); None: the blocks'."""
    from ._pipeline import Plan
    entries = checkpoint.entries
    if target.placed() is not None:
        # Given destinations (``_into.InPlace``): no blocks, nothing to allocate.
        run_list, packed = [], False
    else:
        # (the rule asked once per dtype: per tensor it showed in a MoE shard's
        # setup; docs/design.md, "Measured: the view rule per dtype")
        viewable = {d: target.joins(d, views) for d in set(dtypes)}
        run_list = _blocks.runs(entries, [viewable[d] for d in dtypes])
        packed = _blocks.packed(run_list)
    plan = Plan(_entries.ranges(entries, checkpoint.fds), chunk_size, faults=faults,
                packed=packed, joins=_blocks.joined(run_list) if joins is None else joins)
    return ReadPlan(plan, run_list)


def slot_count(plan, io_depth, threads):
    """A load's slots: ``io_depth`` (``defaults.io_depth_for``), never more
    than its chunks (io_depth=10**11 is fine)."""
    return min(io_depth_for(io_depth, threads), max(plan.n_chunks, 1))


def staging_size(plan, depth):
    """``(bytes, slot bytes)`` of a load's own staging buffer: ``depth`` slots
    as long as the plan's longest chunk."""
    slot = max(plan.max_chunk, 1)
    return depth * slot, slot


def begin_staging(target, plan, options, early=None):
    """Starts making the load's own staging buffer (a GPU load given none):
    a ``PendingStaging``, or None.  ``early``: one begun at the door
    (``early_staging``), returned where it fits."""
    from ._pipeline import DEVICE
    if options.staging is not None or target.mode != DEVICE:
        return None
    depth = slot_count(plan, options.io_depth, reader_threads(options.threads))
    size, slot = staging_size(plan, depth)
    if early is not None and early.fits(target.index, size, slot):
        return early
    return PendingStaging(target.index, size, slot)


# -- the prepared load ----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Prepared:
    """A load made ready: what ``LoadIterator`` runs.  Made by
    ``prepare_solo``, ``prepare_share`` or ``planned``; immutable (the load's
    own state is ``_run._LoadState``)."""

    shards: "Shards"
    """The load's share of the checkpoint, held: narrowed to its selection
    (``entries``), its files open until the load's teardown closes it."""
    target: Any
    """Where the tensors go (``_TorchTarget``; tests' targets alike): the
    device found usable, the dtype they are converted to."""
    dtypes: list
    """The torch dtype of each of ``shards.entries`` on the target, in
    reading order."""
    options: LoadOptions
    """How the load runs: the caller's knobs, or where the caller left them
    to the loader, the checkpoint's (cold, remote: ``prepare_solo``) or the
    ranks' agreed ones (a group: ``_distributed``)."""
    faults: Optional["FaultPlan"]
    """The ``read`` and ``copy`` rules the readers obey (``fault_plan``)."""
    reads: Optional[ReadPlan] = None
    """A solo load's planned reads, its staging buffer being made beside
    them; None for a rank of a process group, whose reads the group plans."""
    resident: Union[float, bool, None] = False
    """A group rank's sample of the page cache (``Shards.resident()``: the
    fraction of its pages cached, None where unknown) where its caller left
    the knobs to the loader; False where the caller set one (the ranks
    then keep theirs)."""

    def abandon(self):
        """Gives back the staging buffer being made, where no load took it."""
        if self.reads is not None:
            self.reads.abandon()


def planned(shards, target, dtypes, options: LoadOptions, faults=None, joins=None,
            early=None) -> Prepared:
    """A solo load of ``shards`` as they are (selected, dtypes known): its
    chunks planned (``joins``: ``plan_chunks``'s) and its own staging buffer
    started (``early``, begun at the door, where it fits; else kept aside
    until the load ends).  On any exception the buffer being made is given
    back (``early`` stays the door's to discard)."""
    check_unchanged(shards, wait=False)
    if faults is None:
        faults = fault_plan(options.staging)
    reads = plan_chunks(shards, target, dtypes, options.chunk_size, faults, options.views, joins)
    if getattr(shards, "fills_cache", False):
        reads.plan.interleave_files()   # (its objects' partial files written side by side)
    try:
        reads.staging = begin_staging(target, reads.plan, options, early)
        if early is not None and reads.staging is not early:
            reads.spare = early
        prefetch = getattr(shards, "prefetch", None)
        if prefetch is not None:    # a URL source: its readers' chunks, from now on (the buffer is made)
            prefetch(reads.plan, reader_threads(options.threads))
        return Prepared(shards, target, dtypes, options, faults, reads)
    except BaseException:
        reads.abandon()
        raise


def prepare_solo(shards, target, options: LoadOptions, names=None, plan=None,
                 early=None) -> Prepared:
    """Prepares a load of one process of ``shards`` (a held share: this
    load's, closed here if this raises): its selection, the checkpoint's
    own knobs for those the caller left unset, its dtypes, its reads
    planned and its staging buffer started (``early``: as ``planned``'s)."""
    try:
        select(shards, names, plan)
        throttled(shards, options)
        with _gc.paused():
            options = options.for_checkpoint(shards)
            dtypes = target.dtypes(shards.entries, shards.paths)
            return planned(shards, target, dtypes, options, early=early)
    except BaseException:
        shards.close()
        raise


def prepare_share(shards, target, options: LoadOptions, names=None, plan=None) -> Prepared:
    """Prepares one rank's part of a process group's load of ``shards`` (a
    held share, closed here if this raises): its selection, its dtypes and,
    where its knobs are left to the loader, its sample of the page cache,
    which the ranks agree on; the reads are the group's."""
    try:
        select(shards, names, plan)
        check_unchanged(shards)
        throttled(shards, options)
        with _gc.paused():
            resident = shards.resident() if options.tuned else False
            dtypes = target.dtypes(shards.entries, shards.paths)
        return Prepared(shards, target, dtypes, options, fault_plan(options.staging),
                        resident=resident)
    except BaseException:
        shards.close()
        raise


def prepared_or_error(prepare):
    """``prepare()``, or the Exception it raised: what a group entry hands
    ``iter_load_group``, which raises it on every rank at the first
    agreement (a Ctrl-C is this process's own and propagates)."""
    try:
        return prepare()
    except Exception as e:
        return e
