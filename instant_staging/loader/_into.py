"""Reload in place: ``Checkpoint.load_into`` and ``load_into``.

A load whose destinations are the caller's tensors: each checkpoint
tensor is written into the tensor the caller gave for its name (its
storage and ``data_ptr`` unchanged, nothing of its size allocated), for
RL weight updates, a server's sleep and wake, crash recovery.  It is the
one load skeleton (``_run.py``) with a target (``InPlace``) whose
``allocate`` hands the readers the destination's address instead of
allocating, and never joins tensors into blocks (``views=False``); the
staging buffer is the only memory the load takes.

Everything is checked before any byte is written, each mismatch a
``TypeError`` or ``ValueError`` naming the tensor (``check_destinations``,
``match``, ``InPlace.place``; the per-tensor checks in C, one pass over
the destinations each: ``_given.pyx``):

- ``tensors`` is a mapping of names to torch tensors, dense (strided),
  contiguous, all on one device we load to (the CPU, pinned or not, or
  one GPU), no two overlapping in memory;
- every name of ``tensors`` is one the load writes: in the checkpoint and
  in ``names=``/``plan=`` where given (a missing name, whatever
  ``strict``); with ``strict`` every tensor the load selects (the whole
  checkpoint without ``names``/``plan``) has a destination (an unexpected
  name); ``strict=False`` skips those;
- each destination has its tensor's dtype (no conversion) and shape (a
  ``plan`` row slice: the rows' shape).

A failure part-way (a read or copy error, a remote object that changed,
``verify=``'s difference, Ctrl-C) raises its own error (the same type, so
that ``except LoadError`` / ``RemoteChangedError`` still catch it) with
``written``: the names whose bytes are all written, in reading order
(those the load handed out before the failure: one finished just as it
came is counted with the others), and ``unwritten``: the others, which
may hold some of the new bytes and some of the old.  A LoadError's
message says so too.  The load's teardown is any load's: readers joined,
staging buffer and files given back.

Not under a process group: every rank loads its own part itself (a row
``plan`` writes a rank's rows into its shard).

Copies: where tensors lying back to back in a file have destinations
lying back to back in one allocation (views of one flat tensor, or
parameters torch's caching allocator cut from one segment in reading
order), the chunks are cut so that such a group lies in one chunk where it
fits, and the readers copy each chunk's share of it as one copy, as a
``load_file`` copies into its blocks (``joins``): each copy has a fixed
cost, and a shard of 1 MiB experts otherwise takes twice the copies of a
``load_file``.  Never across two allocations (no valid range for the
driver) nor across two chunks.
"""

import ctypes
from collections.abc import Mapping
from typing import Any, NamedTuple

from . import _given
from ._errors import LoadError
from ._options import LoadOptions
from ._prepare import check_selection, planned, throttled
from ._run import LoadIterator
from ._target import _import_torch, _TorchTarget, parse_device

# The options a load into given tensors takes (LoadOptions' less views=,
# which is False here: a destination is one tensor).
OPTIONS = ("chunk_size", "io_depth", "threads", "staging", "verify", "progress", "backend",
           "max_bytes_per_second")


class MissingNameError(KeyError, ValueError):
    """A name of ``tensors`` the load would not write: not in the checkpoint
    (a KeyError, as the loader's unknown names are) or not selected by
    ``names=``/``plan=`` (a ValueError, as every mismatch of ``load_into``)."""

    def __str__(self):
        return str(self.args[0]) if self.args else ""


def options_of(options):
    """``LoadOptions`` of ``load_into``'s keyword arguments; a TypeError for
    one it does not take (``process_group``, ``device``, ``dtype``, ``views``:
    said why)."""
    why = {"process_group": "load_into runs in one process: under a process group, let each rank "
                            "load its own part (plan= gives a rank its rows)",
           "device": "the destinations' device is where the bytes go",
           "dtype": "a load into tensors converts nothing: the destinations have the file's dtypes",
           "views": "each destination is its own tensor"}
    for name in options:
        if name in why:
            raise TypeError(f"load_into() takes no {name}=: {why[name]}")
        if name not in OPTIONS:
            raise TypeError(f"load_into() got an unexpected keyword argument {name!r}")
    return LoadOptions.build(views=False, **options)


def check_destinations(tensors):
    """``(torch, device, {name: tensor})`` of ``tensors``, checked alone (no
    checkpoint needed): a mapping of str to dense contiguous torch tensors
    on one device this loader loads to, none overlapping another (in C:
    ``_given.check``)."""
    torch = _import_torch()
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of names to torch tensors (a state dict), "
                        f"not {type(tensors).__name__}")
    dests = dict(tensors)
    device, _ = _given.check(dests, torch.Tensor, torch.strided)
    if device is None:
        device = torch.device("cpu")
    elif device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return torch, parse_device(torch, device), dests


def match(infos, dests, names, plan, strict):
    """The load's selection for ``dests``: ``(names, plan)`` for ``select``,
    every name of ``dests`` and nothing else.  ``infos``: the checkpoint's
    ``{name: TensorInfo}``."""
    check_selection(names, plan)
    if plan is not None:
        if not isinstance(plan, dict):
            raise TypeError(f"plan must be a dict of tensor name -> None or a slice, not "
                            f"{type(plan).__name__}")
        chosen, how = list(plan), "plan="
    elif names is None:
        chosen, how = None, None
    elif callable(names):
        chosen, how = [n for n in infos if names(n)], "names="
    else:
        if isinstance(names, (str, bytes)):
            raise TypeError("names must be an iterable of tensor names or a callable, "
                            f"not a single {type(names).__name__}")
        chosen, how = list(names), "names="
    if chosen is not None:
        unknown = [n for n in chosen if n not in infos]
        if unknown:
            raise MissingNameError(f"{how} names {len(unknown)} tensor(s) the checkpoint lacks: "
                                   + _listed(unknown))
    candidates = infos if chosen is None else dict.fromkeys(chosen)
    missing = [n for n in dests if n not in candidates]
    if missing:
        lacks = [n for n in missing if n not in infos]
        if lacks:
            raise MissingNameError(f"{len(lacks)} tensor(s) of tensors are not in the checkpoint "
                                   f"(nothing written): {_listed(lacks)}")
        raise MissingNameError(f"{len(missing)} tensor(s) of tensors are not selected by {how} "
                               f"(nothing written): {_listed(missing)}")
    if strict and len(dests) < len(candidates):     # (dests: a subset of candidates here)
        unexpected = [n for n in candidates if n not in dests]
        if unexpected:
            raise ValueError(f"{len(unexpected)} tensor(s) of the checkpoint"
                             f"{' selected by ' + how if how else ''} have no destination in "
                             f"tensors (nothing written; strict=False skips them): "
                             f"{_listed(unexpected)}")
    if plan is not None:
        return None, {n: plan[n] for n in dests}
    if chosen is None and len(dests) == len(infos):
        return None, None       # (every tensor: no selection to make)
    return list(dests), None


def _listed(names, most=20):
    shown = ", ".join(repr(n) for n in sorted(names, key=str)[:most])
    return shown + (" ..." if len(names) > most else "")


# The driver's cuMemGetAddressRange / HIP's hipMemGetAddressRange (its
# address, looked up once, called in C by ``_given.Allocations``): the
# allocation holding a device pointer, whichever allocator made it (torch's
# caching allocator cuts many tensors from one).
_address_range = None


def _range_function(torch):
    """The address of the driver's function, 0 where there is none."""
    global _address_range
    if _address_range is None:
        _address_range = 0
        try:
            if getattr(torch.version, "hip", None):
                fn = ctypes.CDLL("libamdhip64.so").hipMemGetAddressRange
            else:
                fn = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2
            _address_range = ctypes.cast(fn, ctypes.c_void_p).value or 0
        except (OSError, AttributeError):
            pass
    return _address_range


class InPlace(_TorchTarget):
    """A target whose destinations are given: ``place`` checks them against
    the load's tensors and keeps their addresses, which ``placed`` hands
    the readers all at once; nothing allocated, no blocks, no reserve, no
    conversion."""

    def __init__(self, torch, device, dests):
        super().__init__(torch, device)
        self.dests = dests
        self._placed = None

    def place(self, entries, dtypes, paths, rows=False):
        """Checks the destination of each of ``entries`` (``[(file index,
        TensorEntry)]``, reading order; ``paths`` by file index) against its
        tensor: its torch dtype ``dtypes[k]`` and its shape (``rows``: a
        plan's, whose shapes are the rows'), a TypeError or ValueError
        naming the first that differs; keeps their addresses for
        ``placed``; returns ``Plan(joins=)`` (``_given.joins``: back to back
        in one file and in one allocation, the driver's on a GPU)."""
        tensors, addresses = _given.places(entries, dtypes, self.dests, paths, rows)
        self._placed = tensors, addresses
        driver = _range_function(self.torch) if self.device.type != "cpu" else 0
        return _given.joins(entries, addresses, _given.Allocations(tensors, addresses, driver))

    def placed(self):
        """``(tensors, addresses)``: each destination and its address, in
        reading order (``place``'s)."""
        if self._placed is None:
            raise RuntimeError("InPlace.placed() before place()")
        return self._placed

    def allocate(self, entry, dtype):
        t = self.dests[entry.name]
        return t, t.data_ptr()

    def joins(self, dtype, views):
        return False

    def allocate_blocks(self, run_list, entries, dtypes):
        return {}

    def reserve(self, entries):
        pass

    def result(self, handle):
        return handle

    def written(self):
        """The load wrote into the destinations (or may have, part-way):
        their autograd versions bumped (``bump_versions``)."""
        bump_versions(self.torch, list(self.dests.values()))

    # before_copies (the _TorchTarget's): on a GPU, waits for the work
    # queued on the device's current stream, which may still read the
    # destinations (a forward pass); the copies run on the readers' streams.


def prepare(infos, hold, dests, torch, device, names, plan, strict, opts):
    """The ``Prepared`` load of a checkpoint into ``dests``, every check
    passed; nothing written yet.  ``infos``: its ``{name: TensorInfo}``;
    ``hold()``: a share of its shards, held (the load's, which closes it)."""
    selected_names, selected_plan = match(infos, dests, names, plan, strict)
    shards = hold()
    try:
        if selected_plan is not None:
            shards.select_rows(selected_plan)
        else:
            shards.select(selected_names)
        throttled(shards, opts)
        target = InPlace(torch, device, dests)
        dtypes = target.dtypes(shards.entries, shards.paths)
        joins = target.place(shards.entries, dtypes, shards.paths, rows=selected_plan is not None)
        return planned(shards, target, dtypes, opts.for_checkpoint(shards), joins=joins)
    except BaseException:
        shards.close()
        raise


def write(prepared, began=None, opened=0.0):
    """Runs ``prepared`` (a load into given tensors) to its end; returns its
    ``LoadReport``.  An error part-way is raised with ``written`` and
    ``unwritten`` (names, reading order) set on it."""
    written = []
    it = LoadIterator(prepared)
    if began is not None:
        it.timed(began, opened)
    try:
        with it:
            for name, _ in it:
                written.append(name)
    except BaseException as e:
        _name_written(e, written, it.names)
        raise
    finally:
        # (a failure part-way too: an unwritten destination may hold some
        # of the new bytes)
        prepared.target.written()
    return it.report


def bump_versions(torch, tensors):
    """Bumps the autograd version counter of each of ``tensors``, as torch's
    own in-place writes do (``load_state_dict``'s ``copy_`` among them): a
    backward that saved one of them before the write then raises ("modified
    by an inplace operation") instead of mixing the activations of the old
    weights with the new ones.  One call for them all where torch takes a
    list (``torch.autograd.graph.increment_version``, whose list form came
    after torch 2.1); else one call each.  An inference tensor has no
    counter: newer torch skips it, and so does the fallback."""
    try:
        from torch.autograd.graph import increment_version
    except ImportError:         # (torch before 2.1's public name)
        increment_version = torch._C._increment_version
    try:
        increment_version(tensors)
    except TypeError:           # one tensor a call
        for t in tensors:
            if not t.is_inference():
                increment_version(t)


def _name_written(error, written, names):
    done = set(written)
    written = [n for n in names if n in done]           # (finished in any order: reading order)
    unwritten = [n for n in names if n not in done]
    try:
        error.written, error.unwritten = written, unwritten
    except AttributeError:          # (an exception type without a __dict__)
        return
    said = (f"{len(written)} of {len(names)} tensor(s) written before the failure"
            + (f" ({_listed(written, 10)})" if written else "")
            + (f"; not written, may hold part of the new bytes: {_listed(unwritten, 10)}"
               if unwritten else ""))
    if isinstance(error, LoadError) and len(error.args) == 1:
        error.args = (f"{error.args[0]} [load_into: {said}]",)
    elif hasattr(error, "add_note"):
        error.add_note(f"load_into: {said}")


class Destinations(NamedTuple):
    """What ``load_into`` takes, checked before any checkpoint is opened
    (``checked``)."""

    options: LoadOptions
    """The load's options (``options_of``: ``views=False``, no option a
    load in place does not take)."""
    torch: Any
    """The torch module."""
    device: Any
    """The one device every destination is on (``parse_device``'s)."""
    tensors: dict
    """``{name: tensor}``: the destinations, dense, contiguous, none
    sharing memory with another (``check_destinations``)."""


def checked(tensors, strict, options) -> Destinations:
    """The ``Destinations`` of ``tensors``, checked before any checkpoint is opened."""
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, not {type(strict).__name__}")
    opts = options_of(options)
    return Destinations(opts, *check_destinations(tensors))


def load_into(infos, hold, dests: Destinations, names, plan, strict, began, opened=0.0):
    """The load of a checkpoint (``infos`` and ``hold``: as ``prepare``
    takes them) into ``dests`` (``checked``'s); its ``LoadReport``."""
    prepared = prepare(infos, hold, dests.tensors, dests.torch, dests.device, names, plan, strict,
                       dests.options)
    return write(prepared, began, opened)
