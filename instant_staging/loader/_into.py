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
``match``, ``check_entries``):

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

from ._errors import LoadError
from ._header import torch_shape
from ._options import LoadOptions
from ._prepare import check_selection, planned
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


def _describe(t):
    return f"{tuple(t.shape)} {t.dtype} on {t.device}"


def check_destinations(tensors):
    """``(torch, device, {name: tensor})`` of ``tensors``, checked alone (no
    checkpoint needed): a mapping of str to dense contiguous torch tensors
    on one device this loader loads to, none overlapping another."""
    torch = _import_torch()
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of names to torch tensors (a state dict), "
                        f"not {type(tensors).__name__}")
    dests = dict(tensors)
    device = None
    first = None
    strided = torch.strided
    for name, t in dests.items():
        if not isinstance(name, str):
            raise TypeError(f"tensors: names must be str, not {type(name).__name__} {name!r}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{name!r}] must be a torch.Tensor, not {type(t).__name__}")
        # (Each attribute read once: these checks run per tensor before the
        # load starts, thousands of them for a fine-grained MoE.)
        at = t.device
        if at != device:
            if device is not None:
                raise ValueError(f"tensors[{name!r}] is on {at}, tensors[{first!r}] on {device}: "
                                 "one load writes to one device (a load per device for the others)")
            if at.type not in ("cpu", "cuda"):
                raise ValueError(f"tensors[{name!r}] is on {at}: the loader writes to the CPU or "
                                 "a CUDA/ROCm device")
            device, first = at, name
        if t.layout != strided:
            raise ValueError(f"tensors[{name!r}] is a {t.layout} tensor: only dense (strided) "
                             "tensors are written in place")
        if not t.is_contiguous():
            raise ValueError(f"tensors[{name!r}] ({_describe(t)}, strides {t.stride()}) is not "
                             "contiguous: its bytes could not be written as the file lays them out")
        if t.is_conj() or t.is_neg():
            raise ValueError(f"tensors[{name!r}] has its conjugate or negative bit set: its memory "
                             "is not what it shows")
    _check_overlaps(dests)
    if device is None:
        device = torch.device("cpu")
    elif device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return torch, parse_device(torch, device), dests


def _check_overlaps(dests):
    spans = []
    for name, t in dests.items():
        n = t.nbytes
        if n:
            begin = t.data_ptr()
            spans.append((begin, begin + n, name))
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise ValueError(f"tensors[{a!r}] and tensors[{b!r}] share memory: each byte is "
                             "written once (pass one name of tied weights)")


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
    if strict:
        unexpected = [n for n in candidates if n not in dests]
        if unexpected:
            raise ValueError(f"{len(unexpected)} tensor(s) of the checkpoint"
                             f"{' selected by ' + how if how else ''} have no destination in "
                             f"tensors (nothing written; strict=False skips them): "
                             f"{_listed(unexpected)}")
    if plan is not None:
        return None, {n: plan[n] for n in dests}
    return list(dests), None


def _listed(names, most=20):
    shown = ", ".join(repr(n) for n in sorted(names, key=str)[:most])
    return shown + (" ..." if len(names) > most else "")


def check_entries(shards, dtypes, dests, rows=False):
    """Each selected tensor's destination has its torch dtype and shape
    (``rows``: a plan's, whose shapes are the rows')."""
    for (i, entry), dtype in zip(shards.entries, dtypes):
        t = dests[entry.name]
        shape = tuple(torch_shape(entry))
        if t.dtype != dtype:
            raise TypeError(f"tensors[{entry.name!r}] is {t.dtype}, the checkpoint's tensor is "
                            f"{entry.dtype} ({dtype}): a load into tensors converts nothing "
                            f"({shards.paths[i]})")
        if tuple(t.shape) != shape:
            raise ValueError(f"tensors[{entry.name!r}] has shape {tuple(t.shape)}, the checkpoint's "
                             f"{'rows the plan selects' if rows else 'tensor'} {shape} "
                             f"({shards.paths[i]})")


def joins(entries, address, allocation):
    """``Plan(joins=)`` of a load into given destinations: per entry of
    ``entries`` (``[(file index, TensorEntry), ...]``, reading order),
    whether its destination continues the one before's, so that a chunk
    holding both copies them as one: their bytes back to back in one file,
    their destinations back to back (``address(name)``) inside one
    allocation (``allocation(name)``: ``(base, size)`` of one holding the
    destination, None where unknown: then no join)."""
    out = [False] * len(entries)
    file = end = dst = before = None
    span = None         # (base, end) of an allocation holding the destination before
    for k, (i, entry) in enumerate(entries):
        n = entry.nbytes
        if not n:
            file = span = None
            continue
        ptr = address(entry.name)
        if file == i and entry.begin == end and ptr == dst:
            if span is None:
                found = allocation(before)
                span = (found[0], found[0] + found[1]) if found is not None else None
            if span is not None and span[0] <= ptr and ptr + n <= span[1]:
                out[k] = True
            else:
                span = None
        else:
            span = None
        file, end, dst, before = i, entry.end, ptr + n, entry.name
    return out


# The driver's cuMemGetAddressRange / HIP's hipMemGetAddressRange (ctypes,
# looked up once): the allocation holding a device pointer, whichever
# allocator made it (torch's caching allocator cuts many tensors from one).
_address_range = None


def _range_function(torch):
    global _address_range
    if _address_range is None:
        _address_range = False
        try:
            if getattr(torch.version, "hip", None):
                fn = ctypes.CDLL("libamdhip64.so").hipMemGetAddressRange
                base = ctypes.c_void_p
            else:
                fn = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2
                base = ctypes.c_uint64
            fn.argtypes = [ctypes.POINTER(base), ctypes.POINTER(ctypes.c_size_t), base]
            fn.restype = ctypes.c_int
            _address_range = fn, base
        except (OSError, AttributeError):
            pass
    return _address_range


def device_allocation(torch, ptr):
    """``(base, size)`` of the device allocation holding ``ptr``, from the
    driver; None where it cannot say."""
    found = _range_function(torch)
    if not found:
        return None
    fn, base = found[0], found[1]()
    size = ctypes.c_size_t()
    if fn(ctypes.byref(base), ctypes.byref(size), ptr) != 0:
        return None
    return base.value or 0, size.value


class InPlace(_TorchTarget):
    """A target whose destinations are given: ``allocate`` hands the
    readers the address of ``dests[name]`` and allocates nothing; no
    blocks, no reserve, no conversion."""

    def __init__(self, torch, device, dests):
        super().__init__(torch, device)
        self.dests = dests
        self._driver = self.device.type != "cpu"    # until it fails to answer

    def address(self, name):
        return self.dests[name].data_ptr()

    def allocation(self, name):
        """``(base, size)`` of an allocation holding ``dests[name]``: on a GPU
        the driver's (one segment of torch's caching allocator holds many
        tensors); else, or where the driver cannot say, its storage's."""
        t = self.dests[name]
        if self._driver:
            found = device_allocation(self.torch, t.data_ptr())
            if found is not None:
                return found
            self._driver = False        # (no context on this thread, no driver library)
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()

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

    # before_copies (the _TorchTarget's): on a GPU, waits for the work
    # queued on the device's current stream, which may still read the
    # destinations (a forward pass); the copies run on the readers' streams.


def prepare(checkpoint, dests, torch, device, names, plan, strict, opts):
    """The ``Prepared`` load of ``checkpoint`` (a ``Checkpoint``) into
    ``dests``, every check passed; nothing written yet."""
    selected_names, selected_plan = match(checkpoint._infos, dests, names, plan, strict)
    shards = checkpoint._hold()
    try:
        if selected_plan is not None:
            shards.select_rows(selected_plan)
        else:
            shards.select(selected_names)
        target = InPlace(torch, device, dests)
        dtypes = target.dtypes(shards.entries, shards.paths)
        check_entries(shards, dtypes, dests, rows=selected_plan is not None)
        return planned(shards, target, dtypes, opts.for_checkpoint(shards),
                       joins=joins(shards.entries, target.address, target.allocation))
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
    return it.report


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


def checked(tensors, strict, options):
    """``(LoadOptions, torch, device, {name: tensor})``: what ``load_into``
    takes, checked before any checkpoint is opened."""
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, not {type(strict).__name__}")
    opts = options_of(options)
    return (opts, *check_destinations(tensors))


def load_into(checkpoint, args, names, plan, strict, began, opened=0.0):
    """The load of ``checkpoint`` (open, a ``Checkpoint``) into the
    destinations of ``args`` (``checked``'s); its ``LoadReport``."""
    opts, torch, device, dests = args
    prepared = prepare(checkpoint, dests, torch, device, names, plan, strict, opts)
    return write(prepared, began, opened)
