"""The public loading functions: ``load_file`` and ``iter_load``.

``iter_load`` checks every argument and header, and plans the load,
before anything is allocated; the load then runs as a ``LoadIterator``
(``_run.py``), or under a process group (``_distributed.py``), which the
plan is handed to.  Imports go one way: ``_load`` -> ``_distributed`` ->
``_run``.
"""

import sys
from typing import TYPE_CHECKING, Optional

from . import _progress
from ._checkpoint import _Checkpoint
from ._options import check_backend, for_cache, knobs, left_unset, torch_dtype
from ._run import LoadIterator, _begin_staging, _plan, fault_plan
from ._source import resolve
from ._target import _import_torch, _TorchTarget
from ._typing import Device, DType, Names, ProgressArg, Source

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

    from .._staging import StagingBuffer

# -- arguments -------------------------------------------------------------------

def _for_cache(checkpoint):
    """The knobs for ``checkpoint`` where the page cache mostly lacks it
    (``_options.for_cache``), else {}."""
    return for_cache(checkpoint.resident())


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


# -- the public functions ------------------------------------------------------

def iter_load(source: Source, device: Device = "cpu", *, dtype: DType = None, names: Names = None,
              process_group: Optional["ProcessGroup"] = None, chunk_size: Optional[int] = None,
              io_depth: Optional[int] = None, threads: Optional[int] = None,
              staging: Optional["StagingBuffer"] = None, verify: bool = False,
              progress: ProgressArg = None, views: bool = True,
              backend: str = "mmap") -> "LoadIterator":
    """Loads safetensors file(s), yielding ``(name, tensor)`` as each finishes.

    Headers are parsed and validated when this is called; the load runs
    while the iterator is consumed.  Arguments are those of ``load_file``.
    """
    if not isinstance(views, bool):
        raise TypeError(f"views must be a bool, not {type(views).__name__}")

    def prepare(single=False):
        check_backend(backend)
        knobs_ = knobs(chunk_size, io_depth, threads)
        _check_args(*knobs_)
        if staging is not None:
            _check_staging(staging)
        options = dict(zip(("chunk_size", "io_depth", "threads"), knobs_), staging=staging,
                       verify=verify, progress=_progress.resolve(progress))
        if sys.byteorder != "little":
            raise RuntimeError("safetensors data is little-endian; this loader needs a little-endian host")
        torch = _import_torch()
        # device and dtype first: a bad one is named before any file is opened
        # (in a fresh process, asking CUDA whether the device is there is
        # its start: 0.2 s on the H200 host, before the staging buffer)
        target = _TorchTarget(torch, device, torch_dtype(torch, dtype))
        src = resolve(source)
        checkpoint = _Checkpoint(src.paths)
        start = None
        try:
            src.check(checkpoint)
            checkpoint.select(names)
            if left_unset(chunk_size, io_depth, threads):
                if single:
                    options.update(_for_cache(checkpoint))
                else:           # the ranks agree on it (_distributed.py)
                    options["resident"] = checkpoint.resident()
            dtypes = [target.check(t, checkpoint.paths[i]) for i, t in checkpoint.entries]
            options["faults"] = fault_plan(staging)
            if single:
                start = options["start"] = _plan(checkpoint, target, dtypes, options["chunk_size"],
                                                 options["faults"], views)
            if start is not None:
                start.staging = _begin_staging(target, start.plan, options)
        except BaseException:
            if start is not None:
                start.abandon()     # a staging buffer being made goes to the pool
            checkpoint.close()
            raise
        return checkpoint, target, dtypes, options

    if process_group is not None:
        from ._distributed import iter_load_group
        return iter_load_group(prepare, process_group)
    checkpoint, target, dtypes, options = prepare(single=True)
    return LoadIterator(checkpoint, target, dtypes, **options)


def load_file(source: Source, device: Device = "cpu", *, dtype: DType = None, names: Names = None,
              process_group: Optional["ProcessGroup"] = None, chunk_size: Optional[int] = None,
              io_depth: Optional[int] = None, threads: Optional[int] = None,
              staging: Optional["StagingBuffer"] = None, verify: bool = False,
              progress: ProgressArg = None, views: bool = True,
              backend: str = "mmap") -> dict[str, "torch.Tensor"]:
    """Loads safetensors file(s) into ``{name: tensor}`` on ``device``.

    source      a .safetensors path; a list of them (a name in two shards is an
                error); a directory (the shards its model.safetensors.index.json
                lists, else every *.safetensors in it, sorted); or an
                *.safetensors.index.json path
    device      "cpu" (as safetensors), "cuda:N", a torch.device or an int
    dtype       None keeps the file's dtypes; a floating torch dtype (or its name)
                converts floating tensors on the device after the copy, as
                transformers does; integer and bool tensors are kept
    names       None for all; an iterable of tensor names (unknown ones are a
                KeyError, raised before anything is allocated); or a callable
                name -> bool.  Only the selected tensors' bytes are read.
    process_group  a torch.distributed group whose every rank makes this call
                with the same checkpoint: each rank reads about 1/N of the bytes
                and the ranks exchange them over the group, so each byte is read
                from the host once (loader/_distributed.py); names= may differ
                per rank.  A failure on one rank raises on every rank.
    chunk_size  bytes per read and per copy (None: $INSTANT_STAGING_CHUNK_SIZE,
                e.g. 8MiB, else 4 MiB)
    io_depth    chunks in flight, i.e. slots (None: $INSTANT_STAGING_IO_DEPTH, else
                2 per reader thread: 32 with 16 threads); the load's own staging
                buffer holds io_depth * chunk_size; capped at 64 per reader thread
    threads     reader threads (None: $INSTANT_STAGING_THREADS, else one per CPU,
                at most 16; never more than slots); capped at twice the usable
                CPUs (a warning says so)
    staging     a StagingBuffer to reuse instead of making one per load; up to
                io_depth whole chunks inside its registrations are the slots (one
                load at a time per buffer)
    verify      after each tensor is copied, re-read its bytes from the file with
                plain reads (not through the staging buffer) and compare them with
                the tensor's memory on the device; a difference raises VerifyError.
                It checks the copy path (slot reuse, spans, copies), not that the
                file is the one intended: safetensors carries no checksum.
    progress    progress(done_bytes, total_bytes), called from this thread; or
                True: a tqdm bar (a plain line per 10% without tqdm or a terminal)
    views       on a GPU, tensors that lie back to back in a file share one
                device block and are views of it (one copy per chunk however
                many tensors it holds); a view keeps its whole block alive.
                False: each tensor owns its memory, as on the CPU, for tensors
                that dtype= converts, and under a process group (loader/_blocks.py)
    backend     "mmap" or "pread", accepted as safetensors' load_file accepts them;
                either way the bytes are read with pread into the staging slots

    Tensors have the file's shape (and dtype, unless ``dtype``).  A read or
    copy that fails raises LoadError after waiting for the copies in flight
    and freeing every tensor of the load; the staging buffer stays reusable.
    """
    with iter_load(source, device, dtype=dtype, names=names, process_group=process_group,
                   chunk_size=chunk_size, io_depth=io_depth, threads=threads, staging=staging,
                   verify=verify, progress=progress, views=views, backend=backend) as it:
        loaded = dict(it)
        return {name: loaded[name] for name in it.names}


