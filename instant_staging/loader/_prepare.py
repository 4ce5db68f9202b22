"""A load's preparation: its target (device and dtype) checked, its share
of the checkpoint selected, its reads planned and its staging buffer
started, before anything is read.  ``Checkpoint`` and ``iter_load`` prepare
here; the load then runs in ``_run.py`` (or ``_distributed.py``).
"""

import sys

from ..defaults import COLD_CHUNK_SIZE, WARM_THREADS
from . import _gc
from ._options import torch_dtype
from ._run import _begin_staging, _plan, fault_plan
from ._target import _import_torch, _TorchTarget, parse_device


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
    (``Shards.warm_if_cold``: this is the disk's head start, which
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
