"""The loader's front door: ``Checkpoint``, and ``load_file`` and
``iter_load`` as thin uses of it.

A ``Checkpoint`` is opened once from any source (files, a directory, an
index, a URL: ``_source.py``, ``_remote.py``): its shards resolved and
every header parsed and validated, before anything is allocated.  It
answers what is in it without reading data, and loads from it as often
as asked; each load checks its arguments and plans before anything is
allocated, then runs as a ``LoadIterator`` (``_run.py``), or under a
process group (``_distributed.py``), which the plan is handed to.
Imports go one way: ``_load`` -> ``_distributed`` -> ``_run``.
"""

import dataclasses
import functools
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional

from ..defaults import COLD_CHUNK_SIZE, WARM_THREADS
from . import _entries, _gc, _progress
from ._checkpoint import _Checkpoint
from ._options import check_backend, knobs, left_unset, torch_dtype
from ._remote import _RemoteCheckpoint, _Stores, is_url
from ._remote import resolve as resolve_url
from ._run import LoadIterator, _begin_staging, _plan, fault_plan
from ._source import resolve
from ._target import _import_torch, _TorchTarget, parse_device
from ._typing import Device, DType, Names, ProgressArg, Source

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

    from .._staging import StagingBuffer

# -- arguments -------------------------------------------------------------------

def _check_staging(staging):
    from .._staging import StagingBuffer
    if not isinstance(staging, StagingBuffer):
        raise TypeError(f"staging must be an instant_staging.StagingBuffer, not {type(staging).__name__}")
    if staging.closed:
        raise ValueError("staging buffer is closed")


def _check_args(chunk_size, io_depth, threads):
    # io_depth and threads may stay None (defaults.io_depth_for, reader_threads).
    for name, value, optional in (("chunk_size", chunk_size, False), ("io_depth", io_depth, True),
                                  ("threads", threads, True)):
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int{' or None' if optional else ''}, "
                            f"not {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")



@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """How one load runs.

    Built once from the arguments, the environment (``_options.py``'s
    variables) and the defaults, and checked there, before anything is
    opened or allocated.  ``chunk_size``, ``io_depth``
    and ``threads`` are the resolved knobs; ``tuned`` says whether the
    caller left all three to the loader (which then picks them for the
    checkpoint: cold, remote)."""

    chunk_size: int
    io_depth: Optional[int]
    threads: Optional[int]
    tuned: bool
    staging: Optional["StagingBuffer"] = None
    verify: bool = False
    progress: Optional[Callable[[int, int], object]] = None
    views: bool = True

    @classmethod
    def build(cls, *, chunk_size=None, io_depth=None, threads=None, staging=None, verify=False,
              progress=None, views=True, backend="mmap") -> "LoadOptions":
        if not isinstance(views, bool):
            raise TypeError(f"views must be a bool, not {type(views).__name__}")
        check_backend(backend)
        resolved = knobs(chunk_size, io_depth, threads)
        _check_args(*resolved)
        if staging is not None:
            _check_staging(staging)
        return cls(*resolved, tuned=left_unset(chunk_size, io_depth, threads), staging=staging,
                   verify=verify, progress=_progress.resolve(progress), views=views)

    def for_checkpoint(self, checkpoint) -> "LoadOptions":
        """These options with the checkpoint's own knobs where the caller set none."""
        if not self.tuned:
            return self
        return dataclasses.replace(self, **checkpoint.default_knobs())

    def run_kwargs(self, faults) -> dict:
        """The keyword arguments of a LoadIterator's load."""
        return {"chunk_size": self.chunk_size, "io_depth": self.io_depth, "threads": self.threads,
                "staging": self.staging, "verify": self.verify, "progress": self.progress,
                "faults": faults}


class TensorInfo(NamedTuple):
    """What a checkpoint says of one tensor, read from its header."""

    name: str
    dtype: str          # safetensors' name: "BF16", "F8_E4M3", ...
    shape: tuple[int, ...]
    nbytes: int
    file: str           # the shard's path or URL


class Checkpoint:
    """A checkpoint opened once, loaded from as often as asked.

    Opening resolves its shards and parses and validates every header.

        with Checkpoint.open("model_dir") as ck:      # or s3://bucket/model/
            ck.names(); ck.info("lm_head.weight").shape; ck.nbytes
            tensors = ck.load("cuda:0", plan={"lm_head.weight": slice(0, 4096)})

    It holds its files (descriptors) from ``open`` until ``close()`` (or
    the end of the ``with`` block) and no load of it holds them any more:
    a load that is still running when the checkpoint is closed keeps them
    until its reader threads are joined.
    """

    def __init__(self, shards, opened_seconds):
        """Use ``Checkpoint.open``."""
        self._shards = shards
        self._lock = threading.Lock()
        self._holds = set()
        self._closed = False
        self.open_seconds = opened_seconds
        self._info_table = None     # made when first asked: a load needs none

    @property
    def _infos(self):
        if self._info_table is None:
            shards = self._shards
            with _gc.paused():      # (one object per tensor, in no cycle)
                self._info_table = _entries.infos(shards.entries, shards.paths, TensorInfo)
        return self._info_table

    @classmethod
    def open(cls, source: Source, *, storage_options: Optional[Mapping] = None) -> "Checkpoint":
        """Opens ``source``: resolves its shards and parses every header.

        A URL's objects are resolved through the object store.

        Args:
            source: as ``load_file``'s.
            storage_options: for a URL source, passed to the object store
                (as ``load_file``'s); default None.

        Returns:
            The open ``Checkpoint`` (a context manager).

        Raises:
            TypeError, ValueError: a source of the wrong form.
            FileNotFoundError: a file, a shard or an object that is not there.
            PermissionError: an object the credentials may not read.
            SafetensorsError: a file safetensors would refuse, a bad index.
            ImportError: a URL without the ``remote`` extra installed.
        """
        t0 = time.perf_counter()
        try:
            shards, src = _shards(source, storage_options)     # nothing opened yet
            try:
                shards.open(src.paths)
                src.check(shards)
                # Made here, not by the caller: a Ctrl-C as a call returns
                # would drop the open shards out of anyone's reach.  Once
                # made, the Checkpoint closes them when it is collected.
                return cls(shards, time.perf_counter() - t0)
            except BaseException:
                shards.close()      # (idempotent: a Checkpoint made above closes nothing twice)
                raise
        except BaseException as e:
            # The error's frames would keep the object stores (their
            # connections) alive for as long as the caller keeps the error.
            traceback.clear_frames(e.__traceback__)
            raise

    # -- what is in it, no data read ---------------------------------------------

    @property
    def files(self) -> list[str]:
        """The shards' paths (or URLs), in reading order."""
        return list(self._shards.paths)

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor's data."""
        return self._shards.total_bytes

    def names(self) -> list[str]:
        """The tensor names, in reading order (shard, offset)."""
        return list(self._infos)

    def info(self, name: str) -> TensorInfo:
        """``name``'s dtype, shape, bytes and shard.

        Args:
            name: a tensor name.

        Returns:
            Its ``TensorInfo``.

        Raises:
            KeyError: the checkpoint has no tensor ``name``.
        """
        try:
            return self._infos[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in the checkpoint") from None

    def metadata(self) -> Optional[dict[str, str]]:
        """The first shard's ``__metadata__``, as safetensors'
        ``safe_open(...).metadata()`` gives it (None without one)."""
        meta = self._shards.headers[0].metadata
        return None if meta is None else dict(meta)

    def default_knobs(self) -> dict:
        """The ``chunk_size``, ``io_depth`` and ``threads`` a load of this
        checkpoint chooses where the caller sets none.

        Returns:
            {} where it keeps the defaults; the cold ones for files the page
            cache mostly lacks (one sample of it, taken now), the remote ones
            for a URL.
        """
        return self._shards.default_knobs()

    @property
    def closed(self) -> bool:
        return self._closed

    # -- loading -------------------------------------------------------------------

    def load(self, device: Device = "cpu", *, names: Names = None, plan: Optional[dict] = None,
             dtype: DType = None, process_group: Optional["ProcessGroup"] = None,
             **options) -> dict[str, "torch.Tensor"]:
        """Loads into ``{name: tensor}`` on ``device``, in reading order.

        Args:
            device, dtype, names, process_group: as ``load_file``'s.
            plan: ``{name: None | slice}``: the tensors to load (``names``
                must then be None), each whole (None) or only the rows of a
                step-1 slice of its first dimension (a tensor-parallel
                rank's share); only those bytes are read and copied.
            **options: ``chunk_size``, ``io_depth``, ``threads``, ``staging``,
                ``verify``, ``progress``, ``views``, ``backend`` (``LoadOptions``).

        Returns:
            The tensors; the load's ``LoadReport`` is ``self.last_report``.

        Raises:
            ValueError: both ``names`` and ``plan``; the checkpoint is closed;
                a bad device, dtype or option.
            KeyError: a name the checkpoint lacks.
            LoadError, VerifyError, DistributedLoadError: as ``load_file``.
        """
        with self.iter_load(device, names=names, plan=plan, dtype=dtype,
                            process_group=process_group, **options) as it:
            loaded = dict(it)
        self.last_report = it.report
        return {name: loaded[name] for name in it.names}

    def iter_load(self, device: Device = "cpu", *, names: Names = None, plan: Optional[dict] = None,
                  dtype: DType = None, process_group: Optional["ProcessGroup"] = None,
                  **options) -> LoadIterator:
        """As ``load``, yielding ``(name, tensor)`` as each finishes.

        Args:
            as ``load``'s.

        Returns:
            A ``LoadIterator``; its ``report`` is the load's once it finished.

        Raises:
            as ``load``.
        """
        began = time.perf_counter()
        opts = LoadOptions.build(**options)
        return self._iter_load(_parse_target(device, dtype), opts, names, plan, process_group,
                               began)

    def _iter_load(self, parsed, opts, names, plan, process_group, began, opened=0.0):
        """The load of ``names`` or ``plan`` to ``parsed`` (``_parse_target``'s):
        the device is found usable here (``_usable_target``)."""
        if names is not None and plan is not None:
            raise ValueError("pass names= or plan= (whose keys are the names), not both")
        shards = self._hold()
        try:
            if process_group is not None:
                from ._distributed import iter_load_group
                prepare = functools.partial(_prepare, shards, _usable_target(parsed), opts,
                                            names, plan)
                it = iter_load_group(prepare, process_group)
            else:
                # The selection before the device check, so that a cold
                # selection's bytes are read while CUDA starts; an unusable
                # device is still the first error.
                try:
                    _select(shards, names, plan)
                except Exception:
                    _usable_target(parsed)
                    raise
                target = _usable_target(parsed, shards, opts.tuned)
                held, target, dtypes, kwargs = _prepare(shards, target, opts, None, None,
                                                        single=True)
                it = LoadIterator(held, target, dtypes, **kwargs)
        except BaseException:
            shards.close()
            raise
        it.timed(began, opened)
        return it

    # A hold is a token in ``_holds``, released once (the load's owners may
    # each release it, and one whose release a Ctrl-C cut short may release
    # it again); the files close once the checkpoint is closed and no token
    # is left.  close() and a release close them every time they find that
    # so (closing twice closes nothing twice: _checkpoint.py), so a close
    # that an interrupt cut short is finished by the next, or by __del__.

    def _hold(self):
        token = object()
        with self._lock:
            if self._closed:
                raise ValueError("the checkpoint is closed")
            self._holds.add(token)
        return self._shards.share(functools.partial(self._release, token))

    def _release(self, token):
        with self._lock:
            self._holds.discard(token)
            last = self._closed and not self._holds
        if last:
            self._shards.close()

    def close(self) -> None:
        """Closes the checkpoint: its files once no load holds them (idempotent)."""
        with self._lock:
            self._closed = True
            last = not self._holds
        if last:
            self._shards.close()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        state = "closed" if self._closed else f"{len(self._infos)} tensors, {self.nbytes} bytes"
        return f"<instant_staging Checkpoint of {len(self._shards.paths)} file(s), {state}>"


def _shards(source, storage_options):
    """``(shards, Source)``: the files, or objects, of ``source``, resolved;
    none opened yet (``_Checkpoint.open``)."""
    if is_url(source):
        src, objects = resolve_url(source, _Stores(storage_options))
        return _RemoteCheckpoint(objects), src
    if storage_options is not None:
        raise ValueError("storage_options apply to a URL source (s3://, gs://, az://, "
                         "https://), not to files")
    return _Checkpoint(), resolve(source)


def _parse_target(device, dtype):
    """``(torch, device, dtype)``: ``device`` and ``dtype`` checked for form,
    without asking CUDA (a bad one is named before any file is opened)."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors data is little-endian; this loader needs a little-endian host")
    torch = _import_torch()
    return torch, parse_device(torch, device), torch_dtype(torch, dtype)


def _usable_target(parsed, shards=None, tuned=False):
    """The load's target: the device of ``parsed`` found usable (in a fresh
    process, CUDA's start), before anything is allocated.

    A load that waits for that start (to a GPU, CUDA not started, the knobs
    left to the loader: ``tuned``) has its selection of ``shards`` read into
    the page cache meanwhile where the page cache lacks it
    (``_Checkpoint.warm_if_cold``: this is the disk's head start, which
    then reads ahead of the load's readers until the load ends); a device
    that turns out unusable stops and joins those reads before its error is
    raised."""
    torch, device, dtype = parsed
    warming = (shards is not None and tuned and device.type != "cpu"
               and not torch.cuda.is_initialized()
               and shards.warm_if_cold(COLD_CHUNK_SIZE, WARM_THREADS))
    try:
        return _TorchTarget(torch, device, dtype)
    except BaseException:
        if warming:
            shards.stop_warming()
        raise


def _target(device, dtype):
    """The load's target: ``device`` and ``dtype`` checked (and the device
    found usable: in a fresh process, CUDA's start) before anything is read."""
    return _usable_target(_parse_target(device, dtype))


def _select(shards, names, plan):
    """Keeps ``plan``'s (or ``names``') tensors of ``shards``, a load's share."""
    with _gc.paused():      # thousands of entries' objects, no cycles
        if plan is not None:
            shards.plan(plan)
        else:
            shards.select(names)


def _prepare(shards, target, opts, names, plan, single=False):
    """Selects, plans and starts the staging buffer of one load of ``shards``
    (a held share: this load's); returns a LoadIterator's arguments.  For a
    process group (``single=False``) the plan is the group's to make."""
    start = None
    try:
        _select(shards, names, plan)
        with _gc.paused():
            extra = {}
            if single:
                opts = opts.for_checkpoint(shards)
            elif opts.tuned:            # the ranks agree on it (_distributed.py)
                extra["resident"] = shards.resident()
            dtypes = target.dtypes(shards.entries, shards.paths)
            kwargs = opts.run_kwargs(fault_plan(opts.staging))
            if single:
                start = kwargs["start"] = _plan(shards, target, dtypes, opts.chunk_size,
                                                kwargs["faults"], opts.views)
                start.staging = _begin_staging(target, start.plan, kwargs)
    except BaseException:
        if start is not None:
            start.abandon()     # a staging buffer being made goes to the pool
        raise
    kwargs.update(extra)
    return shards, target, dtypes, kwargs


# -- the public functions ------------------------------------------------------

def iter_load(source: Source, device: Device = "cpu", *, dtype: DType = None, names: Names = None,
              process_group: Optional["ProcessGroup"] = None, chunk_size: Optional[int] = None,
              io_depth: Optional[int] = None, threads: Optional[int] = None,
              staging: Optional["StagingBuffer"] = None, verify: bool = False,
              progress: ProgressArg = None, views: bool = True,
              backend: str = "mmap", storage_options: Optional[Mapping] = None) -> "LoadIterator":
    """Loads safetensors file(s), yielding ``(name, tensor)`` as each finishes.

    Headers are parsed and validated when this is called; the load runs
    while the iterator is consumed.

    Args:
        as ``load_file``'s.

    Returns:
        A ``LoadIterator`` of ``(name, tensor)``; its ``report`` is the
        load's once it finished.

    Raises:
        as ``load_file``: the source's, device's, dtype's and names' errors
        when this is called, the load's (LoadError, ...) while it is consumed.
    """
    began = time.perf_counter()
    build = functools.partial(LoadOptions.build, chunk_size=chunk_size, io_depth=io_depth,
                              threads=threads, staging=staging, verify=verify, progress=progress,
                              views=views, backend=backend)
    if process_group is not None:
        # Every step, opening included, inside the group's first agreement:
        # a rank whose file is bad (or device unusable) tells the others.
        def prepare(single=False):
            opts = build()
            target = _target(device, dtype)
            with Checkpoint.open(source, storage_options=storage_options) as checkpoint:
                shards = checkpoint._hold()
            try:
                return _prepare(shards, target, opts, names, None, single)
            except BaseException:
                shards.close()
                raise
        from ._distributed import iter_load_group
        it = iter_load_group(prepare, process_group)
        it.timed(began)
        return it
    opts = build()
    # device and dtype first: a bad one is named before any file is opened.
    # Whether the device is there is asked once the checkpoint is open (in a
    # fresh process that is CUDA's start: a cold checkpoint's reads begin
    # beside it), and an unusable one is still the first error.
    parsed = _parse_target(device, dtype)
    try:
        checkpoint = Checkpoint.open(source, storage_options=storage_options)
    except Exception:
        _usable_target(parsed)
        raise
    with checkpoint:
        # (closing the handle here leaves the files to the load, which holds them)
        return checkpoint._iter_load(parsed, opts, names, None, process_group, began,
                                     checkpoint.open_seconds)


def load_file(source: Source, device: Device = "cpu", *, dtype: DType = None, names: Names = None,
              process_group: Optional["ProcessGroup"] = None, chunk_size: Optional[int] = None,
              io_depth: Optional[int] = None, threads: Optional[int] = None,
              staging: Optional["StagingBuffer"] = None, verify: bool = False,
              progress: ProgressArg = None, views: bool = True,
              backend: str = "mmap", storage_options: Optional[Mapping] = None
              ) -> dict[str, "torch.Tensor"]:
    """Loads safetensors file(s) into ``{name: tensor}`` on ``device``.

    Tensors have the file's shape (and dtype, unless ``dtype``).  A read or
    copy that fails raises LoadError after waiting for the copies in flight
    and freeing every tensor of the load; the staging buffer stays reusable.

    Args:
        source: a .safetensors path; a list of them (a name in two shards is
            an error); a directory (the shards its model.safetensors.index.json
            lists, else every *.safetensors in it, sorted); or an
            *.safetensors.index.json path.  Or a URL of the same forms:
            s3://bucket/prefix/ (a "directory"), s3://bucket/key.safetensors,
            a list of object URLs, gs://..., az://..., https://... (the
            ``remote`` extra; loader/_remote.py).
        device: "cpu" (as safetensors), "cuda:N", a torch.device or an int.
        dtype: None keeps the file's dtypes; a floating torch dtype (or its
            name) converts floating tensors on the device after the copy, as
            transformers does; integer and bool tensors are kept.
        names: None for all; an iterable of tensor names (unknown ones are a
            KeyError, raised before anything is allocated); or a callable
            name -> bool.  Only the selected tensors' bytes are read.
        process_group: a torch.distributed group whose every rank makes this
            call with the same checkpoint: each rank reads about 1/N of the
            bytes and the ranks exchange them over the group, so each byte is
            read from the host once (loader/_distributed.py); names= may
            differ per rank.  A failure on one rank raises on every rank.
        chunk_size: bytes per read and per copy (None:
            $INSTANT_STAGING_CHUNK_SIZE, e.g. 8MiB, else 4 MiB).
        io_depth: chunks in flight, i.e. slots (None:
            $INSTANT_STAGING_IO_DEPTH, else 2 per reader thread: 32 with 16
            threads); the load's own staging buffer holds io_depth *
            chunk_size; capped at 64 per reader thread.
        threads: reader threads (None: $INSTANT_STAGING_THREADS, else one per
            CPU, at most 16; never more than slots); capped at twice the
            usable CPUs (a warning says so).
        staging: a StagingBuffer to reuse instead of making one per load; up
            to io_depth whole chunks inside its registrations are the slots
            (one load at a time per buffer).
        verify: after each tensor is copied, re-read its bytes from the file
            with plain reads (not through the staging buffer) and compare
            them with the tensor's memory on the device; a difference raises
            VerifyError.  It checks the copy path (slot reuse, spans, copies),
            not that the file is the one intended: safetensors carries no
            checksum.  Default False.
        progress: progress(done_bytes, total_bytes), called from this thread;
            or True: a tqdm bar (a plain line per 10% without tqdm or a
            terminal).  Default None: no progress.
        views: on a GPU, tensors that lie back to back in a file share one
            device block and are views of it (one copy per chunk however many
            tensors it holds); a view keeps its whole block alive.  False:
            each tensor owns its memory, as on the CPU, for tensors that
            dtype= converts, and under a process group (loader/_blocks.pyx).
            Default True.
        backend: "mmap" (the default) or "pread", accepted as safetensors'
            load_file accepts them; either way the bytes are read with pread
            into the staging slots.
        storage_options: for a URL source: passed to the object store's
            config (keys client_options and retry_config: to those);
            credentials and endpoints otherwise come from the client's
            standard chain.

    Returns:
        ``{name: tensor}`` on ``device``, in reading order.

    Raises:
        TypeError, ValueError: a source, device, dtype or option of the wrong
            form.
        FileNotFoundError, PermissionError, SafetensorsError, ImportError:
            as ``Checkpoint.open`` raises them (ImportError also without
            torch).
        KeyError: a name in ``names`` that the checkpoint lacks.
        LoadError: a read or copy that failed (every tensor of the load freed).
        VerifyError: with ``verify``, a tensor that differs from its file.
        DistributedLoadError: with ``process_group``, a failure on any rank.
    """
    with iter_load(source, device, dtype=dtype, names=names, process_group=process_group,
                   chunk_size=chunk_size, io_depth=io_depth, threads=threads, staging=staging,
                   verify=verify, progress=progress, views=views, backend=backend,
                   storage_options=storage_options) as it:
        # No caller code runs between the tensors here (iter_load's caller
        # does): the collector stays paused over the whole loop.
        with _gc.paused():
            loaded = dict(it)
        return {name: loaded[name] for name in it.names}


