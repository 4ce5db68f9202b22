"""``safe_open``: safetensors' lazy reader, through the staging pipeline.

    with safe_open("model.safetensors", framework="pt", device="cuda:0") as f:
        f.keys(); f.metadata(); f.get_tensor(name)
        s = f.get_slice(name); s.get_shape(); s.get_dtype(); s[0:128, :]

Returns what ``safetensors.safe_open(..., framework="pt")`` returns for the
same calls: ``keys()`` sorted, ``offset_keys()`` in file order,
``metadata()`` the header's ``__metadata__`` (None without one), tensors
equal bit for bit with the same shape, dtype, device and strides (a slice
on the CPU is a view, as safetensors' view of its mmap; on a GPU it is what
``.to(device)`` of that view gives).  An index is checked as torch checks it
(the same IndexError/ValueError/TypeError), on a meta tensor, before
anything is read.

Only what is asked is read, through the same reader threads and staging
slots as ``load_file``: ``get_tensor`` that tensor's bytes; ``slice[...]``
only the rows of dimension 0 the index needs (an int or a slice, any
positive step, on dimension 0); the index is then applied on the device to
those rows, so a slice of a later dimension reads the rows it covers and
narrows there.  Other index forms (lists, tensors, masks, a leading
Ellipsis) read the whole tensor and index it on the device.

``filename`` may be the URL of one object (``s3://bucket/key.safetensors``,
``gs://``, ``az://``, ``https://``; ``storage_options`` as ``load_file``'s):
its header is fetched at once, each read fetches only its ranges.

The file stays open (one descriptor) until ``close()`` or the end of the
``with`` block, and after it for as long as a slice of it is alive (a slice
stays usable after its handle closed, as safetensors'; the last one dropped
closes the file); a GPU handle keeps one pinned staging buffer for its
reads, made at the first read and given back at close (a slice read after
close takes one for that read).  Reads through one handle are
serialised (one staging buffer); use one handle per thread for parallel
reads.  A missing name is a KeyError, a use after close a ``SafetensorsError``
("File is closed"), both also safetensors' SafetensorError (``_errors.py``).
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ..defaults import PREFETCH_THREADS, default_threads, io_depth_for
from . import _staging_pool
from ._errors import MissingTensorError
from ._header import DTYPE_BITS, SafetensorsError, TensorEntry
from ._open import open_shards
from ._options import LoadOptions, _check_args, check_backend, chosen_knobs, knobs, knobs_left
from ._prepare import checked_target, fault_plan, planned, prepare_solo
from ._run import LoadIterator
from ._shards import Shards
from ._target import _import_torch, _TorchTarget, parse_device
from ._typing import CacheDir, Device, PathLike

if TYPE_CHECKING:
    import torch
    from typing_extensions import Self

# safetensors' names for torch (safetensors accepts the same three).
FRAMEWORKS = ("pt", "torch", "pytorch")
_PAGE = 4096


class _View:
    """The part of a safe_open checkpoint one read loads; the load closes
    its checkpoint when done, and this one owns nothing (the descriptors
    are the safe_open's, closed by ``safe_open.close()``)."""

    def __init__(self, checkpoint, entries):
        self.paths, self.fds = checkpoint.paths, checkpoint.fds
        self.entries = [(0, e) for e in sorted(entries, key=lambda e: (e.begin, e.end))]
        self.total_bytes = sum(e.nbytes for e in entries)
        # a remote read's own fetch: its cancel and its error are this read's
        read = checkpoint.share(lambda: None)
        self.fetch, self.fetch_error = read.fetch, read.fetch_error
        self.read_bytes, self.current_size = checkpoint.read_bytes, checkpoint.current_size
        self.changed = checkpoint.changed      # (the file written to since the handle opened it)
        self.revalidating = checkpoint.revalidating     # (a cache hit: asked at the handle's open)
        self.revalidated = checkpoint.revalidated   # (a cache hit: the server's answer)
        read.entries, read.total_bytes = self.entries, self.total_bytes
        self._sources = read.byte_sources()

    def byte_sources(self):
        return self._sources

    def stop_warming(self):
        pass        # (a read of a safe_open's is never warmed: _prepare.usable_target)

    def close(self):
        pass


class _File:
    """A safe_open's file and what its reads need, shared by the handle and
    every slice it gave out.  The descriptor is closed once the handle is
    closed and no slice holds it (a slice outlives its handle, as
    safetensors' does: its mmap lives as long as any view of it).  The
    handle's staging buffer (GPU) goes back to the pool at the handle's
    close; a slice read after that takes one from the pool for that read."""

    def __init__(self, checkpoint, torch, target, chunk_size, io_depth, threads):
        self.checkpoint: Shards = checkpoint
        checkpoint.revalidating()       # (a cache hit: asked now, answered while the caller goes on)
        self.released = False           # every holder let go: the file is closed
        self.path = checkpoint.paths[0]
        self.torch, self.target = torch, target
        self.chunk_size, self.io_depth, self.threads = chunk_size, io_depth, threads
        # One read at a time (one staging buffer).  Reentrant: a collection
        # inside a read may finalize a dropped slice or handle, which
        # releases its hold from this same thread.
        self.lock = threading.RLock()
        self.staging = None             # the handle's, made at its first GPU read
        self.handle_open = True
        self.reading = False
        self.holders = 1                # the handle, and each slice alive
        self.loaders = 0                # prefetch loaders not closed (among the holders)

    def closed_error(self):
        # safetensors' words and class (a ValueError as well)
        return SafetensorsError("File is closed (safe_open used after close() or its with block)",
                                self.path)

    def hold(self):
        with self.lock:
            if not self.handle_open:
                raise self.closed_error()
            self.holders += 1

    def release(self):
        with self.lock:
            self.holders -= 1
            if self.holders:
                return
            self.released = True
        self.checkpoint.close()

    def __del__(self):
        # Nothing reads through it any more (a read holds it): a close that
        # a Ctrl-C cut short, or a holder that never released, ends here
        # (closing again closes nothing twice).
        checkpoint = getattr(self, "checkpoint", None)
        if checkpoint is not None:
            checkpoint.close()

    def close_handle(self):
        with self.lock:
            if not self.handle_open:
                return
            self.handle_open = False
            # A read in progress (a slice's, while the handle is collected)
            # still uses the buffer: it gives it back when done.
            staging = None if self.reading else self.staging
            if staging is not None:
                self.staging = None
        if staging is not None:
            _staging_pool.give(self.target.index, staging)   # kept for a later load, or closed
        self.release()
        self._rest()

    def _rest(self):
        """Once the handle closed, between the reads of the slices that
        outlive it: nothing of the file runs (a URL's request loop ends; a
        slice's next read starts it again), so the end of the ``with``
        block leaves no thread, and the exit nothing to stop."""
        with self.lock:
            idle = not (self.handle_open or self.released or self.reading or self.loaders)
        if idle:
            self.checkpoint.rest()

    def hold_loader(self):
        """A prefetch loader's hold (``release_loader`` ends it)."""
        self.hold()
        with self.lock:
            self.loaders += 1

    def release_loader(self):
        with self.lock:
            self.loaders -= 1
        self.release()
        self._rest()

    def read(self, entries):
        """Loads ``entries`` (TensorEntry, possibly row ranges of one) onto
        the device; returns their tensors in the order given."""
        target = self.target
        with self.lock:
            if self.released:
                raise self.closed_error()
            dtypes = {e: target.check(e, self.path) for e in entries}
            if len(entries) == 1:
                got = self._read_here(entries[0], dtypes[entries[0]])
                if got is not None:
                    self.checkpoint.revalidated()   # (read beside the server's answer)
                    return [got]
            view = _View(self.checkpoint, entries)
            chunk_size = self.chunk_size
            io_depth = io_depth_for(self.io_depth, self.threads)
            staging = own = None
            if target.mode == _host_mode():
                # The pipeline's own slots per read, no larger than the read needs.
                chunk_size = max(_PAGE, min(chunk_size, -(-view.total_bytes // _PAGE) * _PAGE))
                io_depth = max(1, min(io_depth, -(-view.total_bytes // chunk_size)))
            elif self.handle_open:
                if self.staging is None:
                    self.staging = _staging_pool.own(target.index, io_depth * chunk_size, chunk_size)
                staging = self.staging
            else:
                staging = own = _staging_pool.own(target.index, io_depth * chunk_size, chunk_size)
            self.reading = True
            try:
                options = LoadOptions(chunk_size, io_depth, self.threads,
                                      staging=staging, views=False)
                with LoadIterator(planned(view, target, [dtypes[e] for _, e in view.entries],
                                          options)) as it:
                    # Yielded in completion order; one read holds each name once.
                    loaded = dict(it)
            finally:
                self.reading = False
                if own is None and staging is not None and not self.handle_open:
                    own, self.staging = staging, None    # the handle closed meanwhile
                if own is not None:
                    _staging_pool.give(target.index, own)
        self._rest()
        return [loaded[e.name] for e in entries]

    def _read_here(self, entry, dtype):
        """One tensor of at most a chunk, to the CPU from a file, read in this
        thread (``get_tensor``'s usual call: the pipeline made and joined a
        reader thread for it, and a file's tensors read one by one took
        about 13 times safetensors' time; docs/design.md, "Measured: one
        tensor at a time").  None where it does not apply (a GPU, an
        object's URL, fault rules set, a larger tensor) or the read came
        short or failed: the pipeline then reads it and words the error as
        every load does."""
        target = self.target
        if (target.mode != _host_mode() or entry.nbytes > self.chunk_size
                or self.checkpoint.fetch is not None or fault_plan(None) is not None):
            return None
        tensor, ptr = target.allocate(entry, dtype)
        if entry.nbytes:
            try:
                got = os.preadv(self.checkpoint.fds[0],
                                [(ctypes.c_char * entry.nbytes).from_address(ptr)], entry.begin)
            except OSError:
                return None
            if got != entry.nbytes:
                return None
        return target.result(tensor)


class safe_open:
    """``safetensors.safe_open(filename, framework="pt", device=...)``, read
    through instant_staging.

    See the module docstring.  A context manager; ``close()`` ends it.

    Args:
        filename: a .safetensors path, or one object's URL
            (s3://bucket/key.safetensors, https://...), or one file on the
            Hub (hf://org/name/model.safetensors; a repo, ``org/name``, whose
            weights are one model.safetensors).
        framework: "pt" (the default): the only one; torch tensors.
        device: where tensors go: "cpu" (the default), "cuda:N", a
            torch.device or an int.
        backend: "mmap" (the default) or "pread", as ``load_file``'s.
        storage_options: for a URL only, as ``load_file``'s; default None.
        cache_dir: for a URL only, as ``load_file``'s (the object's bytes
            are read from the cache where it holds them, else fill it once
            every byte was read through this handle); default None.
        revision: for a Hub source, as ``load_file``'s.

    Raises:
        TypeError, ValueError: a framework other than "pt", a bad backend or
            device, ``storage_options`` for a file.
        FileNotFoundError, PermissionError, SafetensorsError, ImportError:
            as ``Checkpoint.open`` raises them (ImportError also without
            torch).
    """

    def __init__(self, filename: PathLike, framework: str = "pt", device: Device = "cpu", *,
                 backend: str = "mmap", storage_options: Mapping[str, Any] | None = None,
                 cache_dir: CacheDir = None, revision: str | None = None):
        check_backend(backend)
        if not isinstance(framework, str):
            raise TypeError(f"framework must be a string such as 'pt', not {type(framework).__name__}")
        if framework.lower() not in FRAMEWORKS:
            raise ValueError(f"framework {framework!r} is not supported: instant_staging.loader.safe_open "
                             "returns torch tensors (framework='pt'); use safetensors.safe_open for others")
        torch = _import_torch()
        target = _TorchTarget(torch, parse_device(torch, device))
        chunk_size, io_depth, threads = knobs(None, None, None)
        _check_args(chunk_size, io_depth, threads)

        def own(checkpoint):
            # (made inside open_shards, which closes the file on any
            # exception until the _File holds it: a Ctrl-C too)
            # load_file's rule: a file the page cache lacks, a URL, for the
            # knobs no variable sets
            knobs_ = {"chunk_size": chunk_size, "io_depth": io_depth, "threads": threads}
            knobs_.update(chosen_knobs(checkpoint, knobs_left(None, None, None)))
            return _File(checkpoint, torch, target, **knobs_)
        # one file or object (s3://bucket/key.safetensors, https://...)
        self._file = open_shards(filename, storage_options=storage_options, cache_dir=cache_dir,
                                 one_file=True, revision=revision, own=own)
        checkpoint = self._file.checkpoint
        header = checkpoint.headers[0]
        self._entries = {t.name: t for t in header.tensors}
        self._order = [t.name for t in header.tensors]
        self._metadata = header.metadata
        self._path = checkpoint.paths[0]

    # -- what safetensors' handle offers ---------------------------------------

    def keys(self) -> list[str]:
        """The tensor names, sorted (as safetensors)."""
        self._check_open()
        return sorted(self._entries)

    def offset_keys(self) -> list[str]:
        """The tensor names in the order of their data in the file."""
        self._check_open()
        return list(self._order)

    def metadata(self) -> dict[str, str] | None:
        """The header's ``__metadata__`` (None when the file has none)."""
        self._check_open()
        return None if self._metadata is None else dict(self._metadata)

    def get_tensor(self, name: str) -> torch.Tensor:
        """The whole tensor, reading only its bytes.

        Args:
            name: a tensor name.

        Returns:
            The tensor on the handle's device.

        Raises:
            KeyError: the file has no tensor ``name``.
            LoadError: a read or copy that failed.
        """
        entry = self._entry(name)
        return self._read([entry])[0]

    def get_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor, keyed by name in file order, in one pass over the file."""
        self._check_open()
        entries = [self._entries[n] for n in self._order]
        return dict(zip(self._order, self._read(entries)))

    def get_slice(self, name: str) -> _Slice:
        """A lazy view: ``get_shape()``, ``get_dtype()``, and indexing reads.

        It stays usable after the handle is closed (it holds the file until
        it is dropped).

        Args:
            name: a tensor name.

        Returns:
            The slice object.

        Raises:
            KeyError: the file has no tensor ``name``.
        """
        return _Slice(self._file, self._entry(name))

    def prefetch(self, plan: dict[str, slice | None] | None = None, *, device: Device | None = None,
                 threads: int | None = None) -> PrefetchLoader:
        """safetensors 0.9's ``prefetch``: starts loading the file's tensors
        in the background.

        The load runs through the loader's own pipeline.  The handle keeps
        working; the file stays open while a loader of it is open.

        Args:
            plan: ``{name: None | step-1 slice of the first dimension}``;
                None (the default) for every tensor whole.
            device: where the tensors go; default None: the handle's (any
                device, the CPU too).
            threads: reader threads, an int >= 1; default None:
                safetensors' 8, at most what this host can use
                (``defaults.default_threads``: a default never warns).

        Returns:
            A ``PrefetchLoader`` that hands each tensor out once.

        Raises (as safetensors 0.9, checked in this order, before anything
        is read):
            KeyError: a planned name the file does not hold.
            ValueError, TypeError: an empty plan, a value neither None nor
                a slice, a slice of another step, a 0-d tensor sliced, rows
                out of range (a plan is explicit: never clipped); then a bad
                thread count or device.
        """
        self._check_open()
        plan = _prefetch_plan(plan, self._entries, self._order, self._path)
        if threads is None:
            threads = default_threads(PREFETCH_THREADS)
        elif isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        file = self._file
        target = file.target if device is None else checked_target(device, None)
        opts = LoadOptions.build(chunk_size=file.chunk_size, io_depth=file.io_depth, threads=threads)
        file.hold_loader()
        shards = file.checkpoint.share(file.release_loader)
        return PrefetchLoader(LoadIterator(prepare_solo(shards, target, opts, plan=dict(plan))))

    def close(self) -> None:
        """Closes the handle: the file once no slice of it is left, and gives
        back the staging buffer (kept for a later load, as load_file's);
        idempotent."""
        file = getattr(self, "_file", None)
        if file is not None:
            file.close_handle()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # a finaliser never raises
            pass

    def __repr__(self):
        state = "closed" if not self._file.handle_open else f"{len(self._entries)} tensors"
        return f"<instant_staging safe_open {self._path!r} on {self._file.target.device}, {state}>"

    # -- reading ---------------------------------------------------------------

    def _check_open(self):
        file = getattr(self, "_file", None)
        if file is None or not file.handle_open:
            raise (file.closed_error() if file is not None
                   else SafetensorsError("File is closed", getattr(self, "_path", None)))

    def _entry(self, name):
        self._check_open()
        if not isinstance(name, str):
            raise TypeError(f"tensor name must be a str, not {type(name).__name__}")
        try:
            return self._entries[name]
        except KeyError:
            raise MissingTensorError(f"{self._path} does not contain tensor {name!r}") from None

    def _read(self, entries):
        self._check_open()
        return self._file.read(entries)


def _prefetch_plan(plan, entries, order, path):
    """safetensors 0.9's prefetch plan, checked as it checks it (its words
    in each message): ``{name: None | slice}`` with every slice a step-1
    range of rows inside the first dimension (negative bounds count from
    the end, as Python's), None for every tensor whole.  Returns the plan
    with each slice's bounds explicit."""
    if plan is None:
        return {name: None for name in order}
    if not isinstance(plan, Mapping):
        raise TypeError(f"the prefetch plan must be a dict {{name: None or a slice}} or None, "
                        f"not {type(plan).__name__}")
    if not plan:
        raise ValueError("the prefetch plan selects no tensors")
    unknown = [name for name in plan if name not in entries]
    if unknown:
        raise MissingTensorError(f"{path} does not contain tensor(s) {', '.join(map(repr, unknown))}")
    checked = {}
    for name, part in plan.items():
        if part is None:
            checked[name] = None
            continue
        if not isinstance(part, slice):
            raise TypeError(f"plan[{name!r}] must be None or a slice of the first dimension, "
                            f"not {type(part).__name__}")
        if part.step == 0:
            raise ValueError(f"invalid prefetch plan slice for {name!r}: step 0")
        if part.step not in (None, 1):
            raise ValueError(f"plan[{name!r}]: a prefetch plan slice must have step 1 (a rank's rows), "
                             f"got step {part.step}")
        shape = entries[name].shape
        if not shape:
            raise ValueError(f"plan[{name!r}]: a 0-d tensor has no rows to slice")
        n = shape[0]
        start = 0 if part.start is None else part.start + n * (part.start < 0)
        stop = n if part.stop is None else part.stop + n * (part.stop < 0)
        if not 0 <= start <= stop <= n:
            raise ValueError(f"plan[{name!r}]: rows {part.start}:{part.stop} out of range for "
                             f"{n} rows")
        checked[name] = slice(start, stop)
    return checked


class PrefetchLoader:
    """The tensors of one ``safe_open.prefetch``, loading in the background.

    The reader threads run once the first tensor is asked for, which
    ``prefetch`` does at once.  Each tensor is handed out once, by
    ``take(name)`` or by iterating (readiness order, taken ones skipped);
    ``close()`` stops the load and frees every tensor not taken.  One
    consumer at a time (a lock)."""

    def __init__(self, it: LoadIterator):
        self._it = it
        self._names = list(it.names)
        self._planned = frozenset(self._names)   # take() asks once per tensor
        self._ready: dict[str, torch.Tensor] = {}
        self._taken: set[str] = set()
        self._lock = threading.Lock()
        self._done = False
        try:
            self._pull()                # starts the reader threads
        except BaseException:
            it.close()
            raise

    def _pull(self) -> bool:
        """Receives the next finished tensor; False once every one is in."""
        if self._done:
            return False
        try:
            name, tensor = next(self._it)
        except StopIteration:
            self._done = True
            return False
        self._ready[name] = tensor
        return True

    def names(self) -> list[str]:
        """The names this loader hands out, in file order."""
        return list(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def take(self, name: str) -> torch.Tensor:
        """``name``'s tensor, waiting for its bytes; each is handed out once.

        Args:
            name: a planned tensor's name.

        Returns:
            The tensor.

        Raises:
            KeyError: ``name`` is not in this prefetch, was taken already
                (asked again), or the load ended without it.
        """
        with self._lock:
            if name in self._taken:
                raise MissingTensorError(f"{name!r} was taken already: a prefetch hands each "
                                         "tensor out once")
            if name not in self._planned:
                raise MissingTensorError(f"{name!r} is not in this prefetch")
            while name not in self._ready:
                if not self._pull():
                    raise MissingTensorError(f"the load ended without {name!r}")
            self._taken.add(name)
            return self._ready.pop(name)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while True:
            with self._lock:
                if not self._ready and not self._pull():
                    return
                name, tensor = self._ready.popitem()
                self._taken.add(name)
            yield name, tensor

    def close(self) -> None:
        """Stops the load; the tensors not taken are freed (idempotent)."""
        self._it.close()
        self._ready.clear()

    def __enter__(self) -> PrefetchLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _host_mode():
    from ._pipeline import HOST
    return HOST


class _Slice:
    """``safe_open.get_slice(name)``: shape and dtype now, bytes when indexed.
    It holds the handle's file (``_File``) until it is dropped."""

    def __init__(self, file: _File, entry: TensorEntry):
        file.hold()
        self._file = file
        self._entry = entry
        weakref.finalize(self, file.release)

    def get_shape(self) -> list[int]:
        return list(self._entry.shape)

    def get_dtype(self) -> str:
        return self._entry.dtype

    def __getitem__(self, index) -> torch.Tensor:
        file, entry = self._file, self._entry
        torch = file.torch
        dtype = file.target.check(entry, file.path)
        packed = DTYPE_BITS[entry.dtype] < 8
        # torch's own checks and errors, in the file's shape, before anything
        # is read (a packed dtype's are checked as bytes of that shape).
        torch.empty(entry.shape, dtype=torch.uint8 if packed else dtype, device="meta")[index]
        if packed:
            _check_packed_index(index, entry, file.path)
        rows = None if packed and len(entry.shape) == 1 else _rows(index, entry.shape)
        if rows is None:
            part, shifted = entry, index
        else:
            lo, hi, shifted = rows
            row_bits = DTYPE_BITS[entry.dtype]
            for d in entry.shape[1:]:
                row_bits *= d
            row_bytes = row_bits // 8       # whole: F4's last dimension is even
            part = TensorEntry(entry.name, entry.dtype, (hi - lo,) + tuple(entry.shape[1:]),
                               entry.begin + lo * row_bytes, entry.begin + hi * row_bytes)
        covering = file.read([part])[0]
        try:
            return _like_safetensors(torch, covering[shifted], covering, file.target.device)
        except BaseException:
            # e.g. a tensor index out of bounds (the meta check cannot see
            # its values): the rows read do not outlive the error
            covering = None
            raise


def _check_packed_index(index, entry, path):
    """F4 packs two values of the last dimension in a byte (torch's
    float4_e2m1fn_x2, whose last dimension is half the file's): a slice of it
    may index the other dimensions (ints, slices, None, Ellipsis) and must
    take the last one whole; the result is packed as ``get_tensor``'s.
    safetensors' own slices of F4 fail (its view has the file's shape over
    half the bytes)."""
    items = index if isinstance(index, tuple) else (index,)
    basic = all(i is None or i is Ellipsis or isinstance(i, slice)
                or (isinstance(i, int) and not isinstance(i, bool)) for i in items)
    last = None
    if basic:
        consuming = [i for i in items if i is not None]
        if Ellipsis in consuming:
            after = consuming[consuming.index(Ellipsis) + 1:]
            last = after[-1] if after else None
        elif len(consuming) == len(entry.shape):
            last = consuming[-1]
    n = entry.shape[-1]
    if basic and (last is None or (isinstance(last, slice) and last.indices(n) == (0, n, 1))):
        return
    raise SafetensorsError(
        f"dtype {entry.dtype} packs two values of the last dimension in each byte (torch's "
        f"float4_e2m1fn_x2): a slice must take that dimension whole ({n} values) and index the "
        f"others with ints, slices, None or Ellipsis only, not {index!r}", path, entry.name)


def _rows(index, shape):
    """``(lo, hi, shifted)``: the rows [lo, hi) of dimension 0 that ``index``
    reads and the index rewritten for a tensor of just those rows; None
    where the whole tensor is read (an index form other than an int or a
    slice on dimension 0)."""
    if not shape:
        return None
    items = index if isinstance(index, tuple) else (index,)
    k = next((i for i, item in enumerate(items) if item is not None), None)
    if k is None:
        return None
    item = items[k]
    n = shape[0]
    if isinstance(item, bool) or not isinstance(item, (int, slice)):
        return None
    if isinstance(item, int):
        row = item + n if item < 0 else item      # in bounds: the meta check passed
        lo, hi, new = row, row + 1, 0
    else:
        start, stop, step = item.indices(n)       # step > 0: the meta check passed
        picked = range(start, stop, step)
        if len(picked) == 0:
            lo = hi = 0
            new = slice(0, 0, 1)
        else:
            lo, hi = picked[0], picked[-1] + 1
            new = slice(0, hi - lo, step)
    return lo, hi, items[:k] + (new,) + items[k + 1:]


def _like_safetensors(torch, result, base, device):
    """What safetensors returns for ``result``, a view of the rows read:
    on the CPU that view; on a GPU, ``.to(device)`` of a CPU view (the same
    strides where it is dense, else contiguous), which owns its memory."""
    if device.type == "cpu":
        return result
    if result.numel() == base.numel() and result.data_ptr() == base.data_ptr() \
            and result.is_contiguous() and result.shape == base.shape:
        return base
    return result.clone(memory_format=torch.preserve_format)
