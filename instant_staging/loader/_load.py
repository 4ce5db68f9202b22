"""``load_file`` and ``iter_load``: thin uses of ``Checkpoint``
(``_checkpoint.py``).  Imports go one way: ``_load`` -> ``_checkpoint`` ->
``_distributed`` -> ``_run``.
"""

import functools
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Optional

from . import _gc
from ._checkpoint import Checkpoint, held, load_shared, run_solo, write_into
from ._errors import CheckpointChangedError
from ._options import LoadOptions
from ._prepare import checked_target, early_staging, parse_target, usable_target
from ._revalidate import usual_way
from ._run import LoadIterator, LoadReport
from ._schemes import is_url
from ._typing import CacheDir, Device, DType, Names, ProgressArg, Source

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

    from .._staging import StagingBuffer


# -- the public functions ------------------------------------------------------

def iter_load(source: Source, device: Device = "cpu", *, dtype: DType = None, names: Names = None,
              process_group: Optional["ProcessGroup"] = None, chunk_size: Optional[int] = None,
              io_depth: Optional[int] = None, threads: Optional[int] = None,
              staging: Optional["StagingBuffer"] = None, verify: bool = False,
              progress: ProgressArg = None, views: bool = True,
              backend: str = "mmap", storage_options: Optional[Mapping] = None,
              cache_dir: CacheDir = None,
              max_bytes_per_second: Optional[int] = None,
              revision: Optional[str] = None) -> "LoadIterator":
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
                              views=views, backend=backend,
                              max_bytes_per_second=max_bytes_per_second)
    if process_group is not None:
        # Every step, opening included, inside the group's first agreement:
        # a rank whose file is bad (or device unusable) tells the others.
        def parts():
            options = build()
            target = checked_target(device, dtype)
            with Checkpoint.open(source, storage_options=storage_options, cache_dir=cache_dir,
                                 max_bytes_per_second=options.max_bytes_per_second,
                                 revision=revision) as checkpoint:
                return options, target, held(checkpoint)
        return load_shared(parts, names, None, process_group, began)
    opts = build()
    # device and dtype first: a bad one is named before any file is opened.
    # Whether the device is there is asked once the checkpoint is open (in a
    # fresh process that is CUDA's start: a cold checkpoint's reads begin
    # beside it), and an unusable one is still the first error.
    parsed = parse_target(device, dtype)
    # A server's first load begins its staging buffer now, beside opening
    # the checkpoint and planning the load (``early_staging``); the load
    # owns it from _iter_load on, this door until then.
    early = early_staging(parsed, opts, is_url(source))
    try:
        try:
            checkpoint = Checkpoint.open(source, storage_options=storage_options, cache_dir=cache_dir,
                                         max_bytes_per_second=opts.max_bytes_per_second,
                                         revision=revision)
        except Exception:
            usable_target(parsed)
            raise
        with checkpoint:
            # (closing the handle here leaves the files to the load, which holds them)
            it = run_solo(checkpoint, parsed, opts, names, None, began, checkpoint.open_seconds,
                          early=early)

        def again():
            # (a cache hit whose object changed: the source opened the usual way)
            with usual_way():
                checkpoint = Checkpoint.open(source, storage_options=storage_options,
                                             cache_dir=cache_dir,
                                             max_bytes_per_second=opts.max_bytes_per_second,
                                             revision=revision)
            with checkpoint:
                return run_solo(checkpoint, parsed, opts, names, None, began,
                                checkpoint.open_seconds)
        it.again = again
        return it
    except BaseException:
        if early is not None:
            early.discard()     # (a no-op where the load gave it back already)
        raise


def load_file(source: Optional[Source] = None, device: Device = "cpu", *,
              filename: Optional[Source] = None, dtype: DType = None, names: Names = None,
              process_group: Optional["ProcessGroup"] = None, chunk_size: Optional[int] = None,
              io_depth: Optional[int] = None, threads: Optional[int] = None,
              staging: Optional["StagingBuffer"] = None, verify: bool = False,
              progress: ProgressArg = None, views: bool = True,
              backend: str = "mmap", storage_options: Optional[Mapping] = None,
              cache_dir: CacheDir = None, max_bytes_per_second: Optional[int] = None,
              revision: Optional[str] = None) -> dict[str, "torch.Tensor"]:
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
            ``remote`` extra: the object-storage guide).  Or a Hugging Face Hub
            source: a repo id ``org/name`` (where no local path of that name
            exists), or ``hf://org/name[@revision][/path]`` (a file, an
            index or a folder in it; hf://datasets/... too), read from
            huggingface_hub's cache, its weights fetched there first where
            they are not (``HF_HUB_CACHE``, ``HF_TOKEN``, ``HF_ENDPOINT``,
            ``HF_HUB_OFFLINE`` as huggingface_hub reads them; docs/guides/hub.md).
        device: "cpu" (as safetensors), "cuda:N", a torch.device or an int.
        filename: ``source`` by safetensors' name for it, so that
            ``load_file(filename=..., device=...)`` written for safetensors
            runs as it is; give one of the two.
        dtype: None keeps the file's dtypes; a floating torch dtype (or its
            name) converts floating tensors on the device after the copy, as
            transformers does; integer and bool tensors are kept.
        names: None for all; an iterable of tensor names (unknown ones are a
            KeyError, raised before anything is allocated); or a callable
            name -> bool.  Only the selected tensors' bytes are read.
        process_group: a torch.distributed group whose every rank makes this
            call with the same checkpoint: each rank reads about 1/N of the
            bytes and the ranks exchange them over the group, so each byte is
            read from the host once (the multi-GPU guide); names= may
            differ per rank.  A failure on one rank raises on every rank.
        chunk_size: bytes per read and per copy (None:
            $INSTANT_STAGING_CHUNK_SIZE, e.g. 8MiB, else
            ``defaults.CHUNK_SIZE`` (2 MiB; ``defaults.COLD_CHUNK_SIZE``,
            16 MiB, for a checkpoint the page cache lacks)).
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
            dtype= converts, and under a process group.
            Default True.
        backend: "mmap" (the default) or "pread", accepted as safetensors'
            load_file accepts them; either way the bytes are read with pread
            into the staging slots.
        storage_options: for a URL source: passed to the object store's
            config (keys client_options and retry_config: to those);
            credentials and endpoints otherwise come from the client's
            standard chain.
        cache_dir: for a URL source: a local directory that caches its
            objects (the object-storage guide's cache): a load fills it in
            the same pass that streams the objects to the device, and a
            later load of the same objects (same ETag and size) reads them
            from it as local files.  None: $INSTANT_STAGING_CACHE_DIR, else
            no cache; False: no cache.  A cache that cannot be written is left out with one
            warning, never a failed load.  The report's cache_hit_bytes and
            fetched_bytes say which bytes came from where.  For a Hub
            source: huggingface_hub's cache (None: ``HF_HUB_CACHE``).
        max_bytes_per_second: for a URL source: the most bytes per second
            its data is fetched at (None: $INSTANT_STAGING_MAX_BYTES_PER_SECOND,
            else no cap).
        revision: for a Hub source: its branch, tag or commit (None: the
            one an hf:// URL names, else main); a ValueError for any other
            source.

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
    source = _one_source(source, filename)
    with iter_load(source, device, dtype=dtype, names=names, process_group=process_group,
                   chunk_size=chunk_size, io_depth=io_depth, threads=threads, staging=staging,
                   verify=verify, progress=progress, views=views, backend=backend,
                   storage_options=storage_options, cache_dir=cache_dir,
                   max_bytes_per_second=max_bytes_per_second, revision=revision) as it:
        # No caller code runs between the tensors here (iter_load's caller
        # does): the collector stays paused over the whole loop.
        with _gc.paused():
            loaded = dict(it)
        return {name: loaded[name] for name in it.names}


def _one_source(source, filename):
    # safetensors' load_file names its first parameter ``filename``; ours
    # is ``source`` (it takes more than a file): either name, not both.
    if filename is None:
        if source is None:
            raise TypeError("load_file() missing its source: load_file(source, device) "
                            "(or filename=, as safetensors names it)")
        return source
    if source is not None:
        raise TypeError("load_file() got both a source and filename= (safetensors' name for the "
                        "source): give one")
    return filename


def load_into(source: Source, tensors: Mapping[str, "torch.Tensor"], *, names: Names = None,
              plan: Optional[dict] = None, strict: bool = True,
              storage_options: Optional[Mapping] = None, cache_dir: CacheDir = None,
              revision: Optional[str] = None, **options) -> "LoadReport":
    """Writes the tensors of ``source`` into ``tensors``, in place.

    ``Checkpoint.open(source).load_into(tensors, ...)``, the destinations
    checked before the checkpoint is opened.

    Args:
        source, storage_options, cache_dir, revision: as ``load_file``'s.
        tensors, names, plan, strict, **options: as ``Checkpoint.load_into``'s.

    Returns:
        The load's ``LoadReport``.

    Raises:
        as ``Checkpoint.open`` and ``Checkpoint.load_into``.
    """
    from ._into import checked
    began = time.perf_counter()
    dests = checked(tensors, strict, options)
    opened = functools.partial(Checkpoint.open, source, storage_options=storage_options,
                               cache_dir=cache_dir,
                               max_bytes_per_second=dests.options.max_bytes_per_second,
                               revision=revision)
    try:
        with opened() as checkpoint:
            return write_into(checkpoint, dests, names, plan, strict, began,
                              checkpoint.open_seconds)
    except CheckpointChangedError as e:
        if not getattr(e, "before_load", False):
            raise
    # A cache hit whose object changed (no byte written): the source opened the usual way.
    with usual_way():
        checkpoint = opened()
    with checkpoint:
        return write_into(checkpoint, dests, names, plan, strict, began, checkpoint.open_seconds)
