"""The loader's public face: ``Checkpoint``, opened once from any source
(files, a directory, an index, a URL: ``_source.py``, ``_remote.py``), its
shards (``_shards.py``) resolved and every header parsed and validated,
before anything is allocated.  It answers what is in it without reading
data (``TensorInfo``), and loads from it as often as asked; each load is
prepared (``_prepare.py``) before anything is allocated, then runs as a
``LoadIterator`` (``_run.py``), or under a process group
(``_distributed.py``).
"""

import functools
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple, Optional

from . import _entries, _gc
from ._open import open_shards
from ._options import LoadOptions
from ._prepare import (
    check_selection,
    early_staging,
    parse_target,
    prepare_share,
    prepare_solo,
    prepared_or_error,
    select,
    usable_target,
)
from ._remote import RemoteShards
from ._run import LoadIterator, LoadReport
from ._shards import Shards
from ._typing import CacheDir, Device, DType, Names, Source

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup


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
        self._opened_as = None      # Checkpoint.open's arguments: reopen()

    @property
    def _infos(self):
        if self._info_table is None:
            shards = self._shards
            with _gc.paused():      # (one object per tensor, in no cycle)
                self._info_table = _entries.infos(shards.entries, shards.paths, TensorInfo)
        return self._info_table

    @classmethod
    def open(cls, source: Source, *, storage_options: Optional[Mapping] = None,
             cache_dir: CacheDir = None, max_bytes_per_second: Optional[int] = None,
             revision: Optional[str] = None) -> "Checkpoint":
        """Opens ``source``: resolves its shards and parses every header.

        A URL's objects are resolved through the object store; a Hub
        source's files fetched into huggingface_hub's cache, where they are not.

        Args:
            source: as ``load_file``'s.
            storage_options: for a URL source, passed to the object store
                (as ``load_file``'s); default None.
            cache_dir: for a URL source, the local cache (as ``load_file``'s);
                its loads read the objects it holds and fill it with the rest.
                For a Hub source, huggingface_hub's cache.
            max_bytes_per_second: for a URL source, the most bytes per second
                the open fetches (each object's first GET, of up to a MiB,
                whose bytes past the header the first load reads instead of
                fetching them again); None: as ``load_file``'s.  A load
                takes its own (``load``'s option).
            revision: for a Hub source, as ``load_file``'s.

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
        # (the Checkpoint made by open_shards: once made, it closes the
        # shards when it is collected, so a Ctrl-C never finds them unowned)
        def own(shards):
            checkpoint = cls(shards, time.perf_counter() - t0)
            checkpoint._opened_as = (_kept(source), storage_options, cache_dir,   # reopen()
                                     max_bytes_per_second, revision)
            return checkpoint
        return open_shards(source, storage_options=storage_options, cache_dir=cache_dir,
                           max_bytes_per_second=max_bytes_per_second, revision=revision, own=own)

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

    def reopen(self) -> "Checkpoint":
        """Opens this checkpoint's source again, as it is now, and closes this one.

        For a checkpoint whose files changed since it was opened (a trainer
        copying its next step over them; an object replaced): its loads
        raise ``CheckpointChangedError`` before reading anything, and do so
        until it is reopened.  The new checkpoint is a new value (its own
        names, headers and files); this one is closed only once the new one
        is open, so a reopen that fails leaves it as it was, and its loads
        still running keep their files until they end (a closed one may be
        reopened too).

            try:
                ck.load_into(state_dict)
            except CheckpointChangedError:
                ck = ck.reopen()
                ck.load_into(state_dict)

        Returns:
            The new open ``Checkpoint``, of the same source, storage_options,
            cache_dir, max_bytes_per_second and revision (a Hub source's
            branch asked again: its newest commit).

        Raises:
            ValueError: this checkpoint was not made by ``open``.
            as ``Checkpoint.open``.
        """
        opened_as = self._opened_as
        if opened_as is None:
            raise ValueError("this checkpoint was not made by Checkpoint.open: open its source again")
        source, storage_options, cache_dir, cap, revision = opened_as
        new = type(self).open(source, storage_options=storage_options, cache_dir=cache_dir,
                              max_bytes_per_second=cap, revision=revision)
        self.close()
        return new

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
                ``verify``, ``progress``, ``views``, ``backend``,
                ``max_bytes_per_second`` (``LoadOptions``).

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
        if process_group is not None:
            def parts():
                options_ = LoadOptions.build(**options)
                target = usable_target(parse_target(device, dtype))
                return options_, target, self._hold()
            return load_shared(parts, names, plan, process_group, began)
        opts = LoadOptions.build(**options)
        parsed = parse_target(device, dtype)
        check_selection(names, plan)
        # (its staging buffer begun now, beside the selection and the plan)
        early = None if self._closed else early_staging(parsed, opts, self._remote)
        return self._iter_load(parsed, opts, names, plan, began, early=early)

    @property
    def _remote(self):
        return isinstance(self._shards, RemoteShards)

    def _iter_load(self, parsed, opts, names, plan, began, opened=0.0, early=None):
        """The load of one process of ``names`` or ``plan`` to ``parsed``
        (``parse_target``'s): the device is found usable here.  ``early``:
        its staging buffer begun at the door (``early_staging``), which the
        load owns from here, discarded here if preparing it fails."""
        try:
            check_selection(names, plan)
            shards = self._hold()
            try:
                # The selection before the device check, so that a cold
                # selection's bytes are read while CUDA starts; an unusable
                # device is still the first error.
                try:
                    select(shards, names, plan)
                except Exception:
                    usable_target(parsed)
                    raise
                target = usable_target(parsed, shards, opts.tuned)
                it = LoadIterator(prepare_solo(shards, target, opts, early=early))
            except BaseException:
                shards.close()
                raise
        except BaseException:
            if early is not None:
                early.discard()     # (a no-op where the load gave it back already)
            raise
        it.timed(began, opened)
        return it

    def load_into(self, tensors: Mapping[str, "torch.Tensor"], *, names: Names = None,
                  plan: Optional[dict] = None, strict: bool = True, **options) -> LoadReport:
        """Writes the checkpoint's tensors into ``tensors``, in place.

        Each tensor's bytes go straight into the destination given for its
        name: its storage and ``data_ptr`` stay, nothing of its size is
        allocated (the staging buffer is the load's only memory).

        Args:
            tensors: ``{name: tensor}``: dense contiguous tensors, all on
                one device (the CPU, pinned or not, or one GPU), of the
                checkpoint's dtypes and shapes, none sharing memory.
            names: None (the whole checkpoint), an iterable of names or a
                callable ``name -> bool``: the tensors to write.
            plan: as ``load``'s (``names`` must then be None): a slice
                writes those rows into a destination of the rows' shape.
            strict: True (default): every tensor selected has a destination;
                False: those without one are skipped.  A name of
                ``tensors`` the load does not write is an error either way.
            **options: ``chunk_size``, ``io_depth``, ``threads``, ``staging``,
                ``verify``, ``progress``, ``backend``, ``max_bytes_per_second``
                (as ``load_file``'s).

        Returns:
            The load's ``LoadReport`` (also ``self.last_report``).

        Raises:
            TypeError, ValueError: naming the tensor, before any byte is
                written: a missing or (with ``strict``) unexpected name, a
                dtype or shape that differs, a destination that is not
                contiguous, on another device than the others, or sharing
                memory with another; an option ``load_into`` does not take
                (``process_group``, ``dtype``, ...).
            LoadError, VerifyError, RemoteChangedError, KeyboardInterrupt:
                a failure part-way, with ``written`` (the names fully
                written) and ``unwritten`` (the others, which may hold part
                of the new bytes) set on it.
        """
        from ._into import checked
        began = time.perf_counter()
        return write_into(self, checked(tensors, strict, options), names, plan, strict, began)

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


def _kept(source):
    """``source`` as ``reopen`` opens it again: a list of shards copied (the
    caller's list may change after the open)."""
    return list(source) if isinstance(source, (list, tuple)) else source


# -- the doors' use of a Checkpoint (_load: load_file, iter_load, load_into) --------

def held(checkpoint: Checkpoint) -> Shards:
    """A share of ``checkpoint``'s shards, held until the load given it
    closes it (a ValueError where the checkpoint is closed)."""
    return checkpoint._hold()


def run_solo(checkpoint: Checkpoint, parsed, opts, names, plan, began, opened=0.0,
             early=None) -> LoadIterator:
    """The load of one process of ``checkpoint`` (``Checkpoint.iter_load``
    without a group, past its door's checks): ``parsed`` is
    ``parse_target``'s, ``early`` the staging buffer begun at the door."""
    return checkpoint._iter_load(parsed, opts, names, plan, began, opened, early=early)


def write_into(checkpoint: Checkpoint, dests, names, plan, strict, began,
               opened=0.0) -> LoadReport:
    """``Checkpoint.load_into`` of destinations already checked (``dests``:
    ``_into.checked``'s); the report is also ``checkpoint.last_report``."""
    from ._into import load_into
    report = load_into(checkpoint._infos, checkpoint._hold, dests, names, plan, strict, began,
                       opened)
    checkpoint.last_report = report
    return report


def load_shared(parts, names, plan, process_group, began):
    """A load under ``process_group``, prepared inside the ranks' first
    agreement: ``parts()`` returns the load's ``(LoadOptions, target, held
    shards)`` and ``prepare_share`` makes it a ``Prepared``; whatever either
    raises (bad options, an unusable device, a bad file) reaches every rank
    at that agreement, instead of leaving the others waiting for the
    timeout (``_distributed.iter_load_group``)."""
    from ._distributed import iter_load_group

    def prepare():
        options, target, shards = parts()
        return prepare_share(shards, target, options, names, plan)
    prepared = prepared_or_error(prepare)
    try:
        it = iter_load_group(prepared, process_group)
    except BaseException:
        # (a group refused before any agreement: not a group, this process
        # not a member; or a failure every rank was told of)
        if not isinstance(prepared, BaseException):
            prepared.shards.close()
        raise
    it.timed(began)
    return it
