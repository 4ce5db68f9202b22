"""Deltas: what changed since a base version, saved and applied in place.

The format, defined here once for the trainer's side (``save_delta``) and
the servers' side (``read_delta``, ``apply_delta``; docs/guides/saving.md,
"The delta format"):

A delta is a safetensors file (written by ``save_file``, so published
atomically) whose ``__metadata__`` holds

- ``instant_staging.delta``: ``"1"``, the format's version (a file without
  it is not a delta);
- ``instant_staging.base_version``: the version id the delta applies to;
- ``instant_staging.version``: the version id a model holds once applied;
- ``instant_staging.sparse``: a JSON object ``{name: shape}`` of the
  tensors stored sparse, each with its full shape (a list of ints);
- where asked for, ``instant_staging.digests`` (``save_file``'s, of the
  file's own tensors).

and whose tensors are

- a tensor stored whole: under its own name, of its own dtype and shape;
  it replaces the destination's bytes;
- a tensor stored sparse: two tensors, ``<name>.idx``, 1-D I32 (I64 for a
  tensor of 2**31 elements or more), the flat positions (row-major, as in
  ``tensor.view(-1)``) that changed, strictly increasing, each in
  ``[0, numel)``; and ``<name>.val``, 1-D of the tensor's dtype, the NEW
  values at those positions (not differences: applying a chain of deltas
  cannot drift).  Key names and "raw" flat positions as TRL's sparse
  patches (``trl/experimental/async_grpo``: ``{name}.idx``,
  ``{name}.val``); unlike those, the base version is named, the layout is
  in the metadata, not guessed from the names, and I64 positions are
  allowed.  F4 tensors (two values a byte) and empty ones are always
  stored whole.

Applying (``apply_delta``) checks everything that can be checked before
the first byte reaches a destination: the file is a delta of a known
format; its base version is the one the caller holds; every name has a
destination of its dtype and shape, contiguous; every position list is
strictly increasing and in range (read first: positions and values are
the small part of a delta).  Then whole tensors are written in place by
``load_into`` (the reads, which may fail), and sparse ones scattered on
their destination's device from memory (``check_delta``, ``write_delta``).
"""

from __future__ import annotations

import ctypes
import itertools
import json
import math
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from ..defaults import DELTA_BASE_BATCH, DELTA_MASK, DELTA_MASK_CPU, DELTA_PATCH_BATCH
from ._into import bump_versions
from ._save import VERSION_KEY, _torch_names, check_tensor_dict
from ._save_file import save_file
from ._target import _import_torch
from ._typing import PathLike, Source

if TYPE_CHECKING:
    import torch

    from .._staging import StagingBuffer

DELTA_KEY = "instant_staging.delta"
DELTA_FORMAT = "1"
BASE_VERSION_KEY = "instant_staging.base_version"
SPARSE_KEY = "instant_staging.sparse"
INDICES_SUFFIX = ".idx"
VALUES_SUFFIX = ".val"
_INT32_LIMIT = 1 << 31


class DeltaError(ValueError):
    """A delta that cannot be applied: not a delta, another base version, a
    malformed layout, or a destination that does not match.  Raised before
    anything is written."""


class DeltaInfo(NamedTuple):
    """What a delta holds (its header alone)."""

    version: str
    """The version a model holds once the delta is applied."""
    base_version: str
    """The version the delta applies to."""
    full: tuple[str, ...]
    """Names stored whole."""
    sparse: dict[str, tuple[int, ...]]
    """Names stored sparse, with their full shapes."""


def indices_key(name: str) -> str:
    """The key of a sparse tensor's positions."""
    return name + INDICES_SUFFIX


def values_key(name: str) -> str:
    """The key of a sparse tensor's new values."""
    return name + VALUES_SUFFIX


def parse_delta(metadata: Mapping[str, str] | None,
                entries: Mapping[str, tuple[str, tuple[int, ...]]]) -> DeltaInfo:
    """The ``DeltaInfo`` of a file with this ``__metadata__`` and these
    ``{key: (dtype, shape)}`` (safetensors' dtype names), checked.

    Raises:
        DeltaError: not a delta, or a layout that breaks the format.
    """
    if not metadata or DELTA_KEY not in metadata:
        raise DeltaError(f"not a delta: its metadata has no {DELTA_KEY!r} (a full checkpoint "
                         "is loaded with load_into)")
    if metadata[DELTA_KEY] != DELTA_FORMAT:
        raise DeltaError(f"a delta of format {metadata[DELTA_KEY]!r}; this version of "
                         f"instant_staging reads format {DELTA_FORMAT!r}")
    for key in (BASE_VERSION_KEY, VERSION_KEY):
        if key not in metadata:
            raise DeltaError(f"a delta without {key!r} in its metadata")
    try:
        sparse_raw = json.loads(metadata.get(SPARSE_KEY, "{}"))
    except ValueError:
        raise DeltaError(f"{SPARSE_KEY!r} is not JSON") from None
    if not isinstance(sparse_raw, dict):
        raise DeltaError(f"{SPARSE_KEY!r} must be a JSON object of name: shape")
    sparse = {}
    taken: set = set()
    for name, shape in sparse_raw.items():
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise DeltaError(f"sparse tensor {name!r}: its shape must be a list of ints >= 0, "
                             f"not {shape!r}")
        ikey, vkey = indices_key(name), values_key(name)
        for key in (ikey, vkey):
            if key not in entries:
                raise DeltaError(f"sparse tensor {name!r}: the file has no {key!r}")
        (idtype, ishape), (_, vshape) = entries[ikey], entries[vkey]
        if idtype not in ("I32", "I64") or len(ishape) != 1:
            raise DeltaError(f"sparse tensor {name!r}: {ikey!r} must be 1-D I32 or I64, not "
                             f"{idtype} {list(ishape)}")
        if len(vshape) != 1 or vshape != ishape:
            raise DeltaError(f"sparse tensor {name!r}: {vkey!r} must be 1-D, as long as "
                             f"{ikey!r} ({list(vshape)} for {list(ishape)})")
        if name in entries:
            raise DeltaError(f"tensor {name!r} is both whole and sparse in the delta")
        sparse[name] = tuple(shape)
        taken.update((ikey, vkey))
    full = tuple(k for k in entries if k not in taken)
    return DeltaInfo(metadata[VERSION_KEY], metadata[BASE_VERSION_KEY], full, sparse)


def read_delta(source: Source, *, storage_options: Mapping | None = None) -> DeltaInfo:
    """The ``DeltaInfo`` of a delta file (its header only; no data read).

    Args:
        source: as ``load_file``'s (a delta is usually one file).
        storage_options: as ``load_file``'s.

    Raises:
        DeltaError: the source is not a delta, or breaks the format.
    """
    from ._checkpoint import Checkpoint
    with Checkpoint.open(source, storage_options=storage_options) as ck:
        return _info_of(ck)


def _info_of(ck):
    entries = {n: (ck.info(n).dtype, tuple(ck.info(n).shape)) for n in ck.names()}
    return parse_delta(ck.metadata(), entries)


# -- the trainer's side ------------------------------------------------------------------

def save_delta(tensors: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor] | Source,
               filename: PathLike, *, base_version: str, version: str,
               metadata: Mapping[str, str] | None = None, digests: bool = False,
               sync: bool = True, staging: StagingBuffer | None = None) -> DeltaInfo:
    """Writes what changed in ``tensors`` since ``base`` as a delta file.

    Each tensor whose bytes differ from the base's is stored sparse (its
    changed positions and their new values) where that takes fewer bytes
    than the whole tensor, else whole; unchanged tensors are left out.
    Bytes are compared, not values (a NaN that stayed is unchanged, a zero
    that changed sign is changed).  The file is written by ``save_file``
    (atomically; ``digests``, ``sync``, ``staging`` as there).

    Args:
        tensors: ``{name: tensor}`` now (any devices).
        base: the base version: ``{name: tensor}`` or a checkpoint source,
            brought to each tensor's device in batches of at most
            ``DELTA_BASE_BATCH`` bytes (read, for a source), compared (runs
            of tensors of up to ``DELTA_MASK`` elements at once: two
            transfers from the device a run) and dropped.  It holds every
            name of ``tensors`` with the same dtype and shape.
        filename: where the delta goes.
        base_version: the version id of ``base``.
        version: the version id of ``tensors``.
        metadata: more ``{str: str}`` for the header.

    Returns:
        The delta's ``DeltaInfo``.

    Raises:
        ValueError: a name missing from the base, or of another dtype or
            shape there; a version id that is not a non-empty str.
    """
    torch = _import_torch()
    for label, value in (("base_version", base_version), ("version", version)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{label} must be a non-empty str, not {value!r}")
    check_tensor_dict(torch, tensors)
    out: dict = {}
    sparse: dict = {}
    for batch in _pairs(torch, tensors, base):
        _compare(torch, batch, tensors, out, sparse)
    meta = dict(metadata or {})
    meta.update({DELTA_KEY: DELTA_FORMAT, BASE_VERSION_KEY: base_version,
                 SPARSE_KEY: json.dumps({n: list(s) for n, s in sparse.items()},
                                        ensure_ascii=False, separators=(",", ":"))})
    save_file(out, filename, meta, version=version, digests=digests, sync=sync, staging=staging)
    full = tuple(n for n in out if n not in sparse and not _is_sparse_key(n, sparse))
    return DeltaInfo(version, base_version, full, sparse)


def _is_sparse_key(key, sparse):
    for suffix in (INDICES_SUFFIX, VALUES_SUFFIX):
        if key.endswith(suffix) and key[:-len(suffix)] in sparse:
            return True
    return False


def _pairs(torch, tensors, base):
    """Batches of ``(name, tensor, base tensor on the tensor's device)``,
    every name once: each batch of one device, at most ``DELTA_BASE_BATCH``
    bytes (or one tensor)."""
    if isinstance(base, Mapping):
        missing = [n for n in tensors if n not in base]
        if missing:
            raise ValueError(f"the base has no tensor {missing[0]!r}"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        for name, tensor in tensors.items():
            _same_kind(name, tensor, base[name].dtype, tuple(base[name].shape))
        batch, size = [], 0
        for name, tensor in tensors.items():
            nbytes = tensor.numel() * tensor.element_size()
            if batch and (tensor.device != batch[0][1].device or size + nbytes > DELTA_BASE_BATCH):
                yield batch
                batch, size = [], 0
            batch.append((name, tensor, base[name].detach().to(tensor.device)))
            size += nbytes
        if batch:
            yield batch
        return
    from ._checkpoint import Checkpoint
    names = _torch_names(torch)
    with Checkpoint.open(base) as ck:
        have = set(ck.names())
        missing = [n for n in tensors if n not in have]
        if missing:
            raise ValueError(f"the base checkpoint has no tensor {missing[0]!r}"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        for name, tensor in tensors.items():
            info = ck.info(name)
            want = names.get(tensor.dtype)
            shape = tuple(info.shape)
            if info.dtype == "F4" and shape:
                shape = shape[:-1] + (shape[-1] // 2,)
            if want != info.dtype or shape != tuple(tensor.shape):
                raise ValueError(f"tensor {name!r}: {tensor.dtype} {list(tensor.shape)} here, "
                                 f"{info.dtype} {list(info.shape)} in the base")
        batches: dict = {}
        for name, tensor in tensors.items():
            batches.setdefault(tensor.device, []).append(name)
        for device, group in batches.items():
            batch, size = [], 0
            for name in group + [None]:
                nbytes = 0 if name is None else ck.info(name).nbytes
                if batch and (name is None or size + nbytes > DELTA_BASE_BATCH):
                    loaded = ck.load(device, names=batch)
                    yield [(n, tensors[n], loaded.pop(n)) for n in batch]
                    del loaded
                    batch, size = [], 0
                if name is not None:
                    batch.append(name)
                    size += nbytes


def _same_kind(name, tensor, dtype, shape):
    if tensor.dtype != dtype or tuple(tensor.shape) != shape:
        raise ValueError(f"tensor {name!r}: {tensor.dtype} {list(tensor.shape)} here, "
                         f"{dtype} {list(shape)} in the base")


_INT_OF_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _as_int(torch, tensor):
    """The tensor's elements as integers of their size (compared and moved as bits)."""
    return tensor.reshape(-1).view(getattr(torch, _INT_OF_SIZE[tensor.element_size()]))


def _compare(torch, batch, tensors, out, sparse):
    """Puts what changed of ``batch`` (``_pairs``'s, one device) in ``out``
    (whole, or ``.idx`` and ``.val``, in the batch's order) and ``sparse``,
    comparing runs of its tensors whose elements fit one mask of
    ``DELTA_MASK`` (on a CPU ``DELTA_MASK_CPU``) elements at once."""
    kept = [(name, tensor.detach(), old) for name, tensor, old in batch if tensor.numel()]
    if not kept:
        return
    bound = DELTA_MASK_CPU if kept[0][1].device.type == "cpu" else DELTA_MASK
    run, size = [], 0
    for item in kept + [None]:
        numel = 0 if item is None else item[1].numel()
        if run and (item is None or size + numel > bound):
            _compare_run(torch, run, tensors, out, sparse)
            run, size = [], 0
        if item is not None:
            run.append(item)
            size += numel


def _compare_run(torch, kept, tensors, out, sparse):
    """``_compare`` of a run of non-empty tensors of one device, with two
    transfers whatever its number of tensors: every tensor's count of
    changed elements, then the changed positions of those stored sparse,
    found at once in one mask of the run."""
    device = kept[0][1].device
    starts, total = [], 0
    for _, tensor, _ in kept:
        starts.append(total)
        total += tensor.numel()
    f4 = getattr(torch, "float4_e2m1fn_x2", None)
    mask = torch.empty(total, dtype=torch.bool, device=device)
    news = []
    for (_, tensor, old), start in zip(kept, starts):
        if tensor.dtype == f4:       # two values a byte: compared as bytes, stored whole
            tensor, old = tensor.view(torch.uint8), old.view(torch.uint8)
        new_bits, old_bits = _as_int(torch, tensor.contiguous()), _as_int(torch, old.contiguous())
        torch.ne(new_bits, old_bits, out=mask[start:start + new_bits.numel()])
        news.append(new_bits)
    # the counts: one sum over each group of tensors of one size (a model's repeated shapes)
    sums = []
    i = 0
    while i < len(kept):
        numel = kept[i][1].numel()
        j = i + 1
        while j < len(kept) and kept[j][1].numel() == numel:
            j += 1
        rows = mask[starts[i]:starts[i] + (j - i) * numel].view(torch.uint8).view(j - i, numel)
        # int32 sums where they cannot overflow (on a CPU, several times faster than int64)
        sums.append(rows.sum(dim=1, dtype=torch.int32 if numel < _INT32_LIMIT else torch.int64))
        i = j
    counts = torch.cat(sums).tolist()
    stored: list = []      # (name, tensor, None: whole | (start, count, new bits))
    whole = []
    for (name, tensor, _), start, count, new_bits in zip(kept, starts, counts, news):
        if count == 0:
            continue
        numel = tensor.numel()
        index_size = 4 if numel < _INT32_LIMIT else 8
        size = tensor.element_size()
        if tensor.dtype == f4 or count * (index_size + size) >= numel * size \
                or indices_key(name) in tensors or values_key(name) in tensors:
            whole.append((start, numel))
            stored.append((name, tensor, None))
        else:
            stored.append((name, tensor, (start, count, new_bits)))
    positions = None
    if len(whole) < len(stored):
        for start, numel in whole:       # their positions are not wanted
            mask[start:start + numel].zero_()
        positions = mask.nonzero().reshape(-1)       # increasing: each tensor's together
    taken = 0
    for name, tensor, how in stored:
        if how is None:
            out[name] = tensor
            continue
        start, count, new_bits = how
        mine = positions[taken:taken + count] - start
        taken += count
        index_dtype = torch.int32 if tensor.numel() < _INT32_LIMIT else torch.int64
        out[indices_key(name)] = mine.to(index_dtype)
        out[values_key(name)] = new_bits[mine].view(tensor.dtype)
        sparse[name] = tuple(tensor.shape)


# -- the servers' side -------------------------------------------------------------------

def apply_delta(tensors: Mapping[str, torch.Tensor], delta: Source, *, version: str,
                storage_options: Mapping | None = None) -> DeltaInfo:
    """Applies a delta file to ``tensors`` in place.

    Everything is checked before the first byte is written (the module's
    docstring): then each whole tensor is written in place by ``load_into``
    and each sparse one scattered into its destination on the
    destination's device (``view(-1)[positions] = values``); every
    destination keeps its storage and ``data_ptr``, and its autograd
    version is bumped as torch's in-place writes bump it.  (``apply_update``
    applies a delta too, with the sources' pins, digests, a rollback and a
    version holder: ``VersionedWeights``.)

    Args:
        tensors: ``{name: tensor}`` holding version ``version``: every name
            of the delta has one (others are left alone).
        delta: the delta's source (as ``load_file``'s).
        version: the version ``tensors`` hold now; the delta's base version
            must be it.
        storage_options: as ``load_file``'s.

    Returns:
        The delta's ``DeltaInfo`` (``.version``: what ``tensors`` hold now).

    Raises:
        DeltaError: not a delta, another base version, a missing
            destination or one of another dtype or shape, a position out of
            range or out of order; before anything is written.
        LoadError and others after the first write, with ``written`` (the
            names written) set on the error where it can hold it.
    """
    from ._checkpoint import Checkpoint
    with Checkpoint.open(delta, storage_options=storage_options) as ck:
        checked = check_delta(ck, tensors, version)
        write_delta(ck, checked)
    return checked.info


class Patches(NamedTuple):
    """The sparse patches of some destinations of one device and element
    size, concatenated: checked, kept and scattered as one (``write_delta``:
    a few kernels however many tensors, not a few per tensor)."""

    names: tuple[str, ...]
    lengths: tuple[int, ...]
    """How many positions each name has, in ``names``' order."""
    positions: Any
    """Every name's positions (int64, relative to its destination's first
    element: to the shard's under a plan), one after the other."""
    values: Any
    """The new values at them, as integers of the element size."""


class CheckedDelta(NamedTuple):
    """A delta checked against its destinations, its patches read: what
    ``write_delta`` writes.  Nothing of the destinations written yet."""

    info: DeltaInfo
    dests: dict
    """``{name: destination}`` of every name the delta writes."""
    plan: dict | None
    """``{name: None | slice}`` of rows (a tensor-parallel shard), or None."""
    patches: tuple[Patches, ...]
    """The sparse names' patches on their destinations' devices, positions
    checked, in batches (``Patches``)."""

    def counts(self) -> dict[str, int]:
        """``{sparse name: how many positions it writes}``."""
        return {n: k for b in self.patches for n, k in zip(b.names, b.lengths)}



def check_delta(ck, tensors: Mapping, version: str | None, plan: Mapping | None = None,
                info: DeltaInfo | None = None) -> CheckedDelta:
    """Checks the delta open as ``ck`` against ``tensors`` (``{name:
    destination}``) holding ``version``, and reads its patches to their
    destinations' devices; nothing is written.  ``plan``: ``{name: None |
    slice}``: a destination holds only those rows of its tensor (a step-1
    slice of the first dimension): its shape is the rows', and only the
    positions inside them are kept.  ``info``: the names to write (the
    delta's ``DeltaInfo`` narrowed), default all of the delta's.

    Raises:
        DeltaError: as ``apply_delta``'s, before anything is written.
    """
    torch = _import_torch()
    if info is None:
        info = _info_of(ck)
    if info.base_version != version:
        raise DeltaError(f"the delta applies to version {info.base_version!r}; the tensors "
                         f"hold {version!r}: nothing was written")
    names = _torch_names(torch)
    rows = {}
    for name in (*info.full, *info.sparse):
        dest = _destination(tensors, name)
        full_shape = info.sparse[name] if name in info.sparse else tuple(ck.info(name).shape)
        dtype = ck.info(values_key(name)).dtype if name in info.sparse else ck.info(name).dtype
        want = _rows_shape(name, full_shape, None if plan is None else plan.get(name))
        rows[name] = want[1]
        shape = tuple(dest.shape)
        if dtype == "F4" and shape:
            shape = shape[:-1] + (shape[-1] * 2,)
        if names.get(dest.dtype) != dtype or shape != want[0]:
            raise DeltaError(f"tensor {name!r}: the delta holds {dtype} {list(want[0])}"
                             f"{' (the rows of its plan)' if want[1] is not None else ''}, the "
                             f"destination is {dest.dtype} {list(dest.shape)}: nothing was written")
    dests = {n: tensors[n] for n in (*info.full, *info.sparse)}
    patches = _load_patches(torch, ck, dests, info, rows)
    return CheckedDelta(info, dests, None if plan is None else dict(plan), patches)


def _rows_shape(name, shape, rows):
    """``(shape of the destination, (first element, end element) or None)``
    of a tensor of ``shape`` of which a destination holds ``rows`` (a
    slice, or None: all)."""
    if rows is None:
        return tuple(shape), None
    if not isinstance(rows, slice) or not shape:
        raise DeltaError(f"tensor {name!r}: a plan's entry is None or a slice of the first "
                         f"dimension, not {rows!r}")
    start, stop, step = rows.indices(shape[0])
    if step != 1:
        raise DeltaError(f"tensor {name!r}: a plan's slice has step 1, not {rows.step}")
    stop = max(stop, start)
    per_row = 1
    for d in shape[1:]:
        per_row *= d
    return (stop - start, *shape[1:]), (start * per_row, stop * per_row)


def load_groups(ck, groups, plan, done):
    """Loads each of ``groups`` (``{device: Destinations}``, ``_into.checked``'s)
    by ``ck.load_into``'s path: the rows ``plan`` gives (None: whole), each
    group's names put in ``done`` once it is written."""
    from ._checkpoint import write_into
    for dests in groups.values():
        names = list(dests.tensors)
        if plan is None:
            write_into(ck, dests, names, None, True, time.perf_counter())
        else:
            write_into(ck, dests, None, {n: plan.get(n) for n in names}, True,
                       time.perf_counter())
        done.extend(names)


def write_delta(ck, checked: CheckedDelta, *, written: list | None = None, **options) -> None:
    """Writes ``checked`` (``check_delta``'s) into its destinations: whole
    tensors first (reads, which may fail), by ``load_into``, then the
    sparse patches (on the device, from memory).  ``written`` (a list)
    collects the names whose bytes are all written, as they are.
    ``options``: ``load_into``'s (``chunk_size``, ...).

    Raises:
        whatever a write raises, with ``written`` set on it where it can
        hold it.
    """
    torch = _import_torch()
    done: list = [] if written is None else written
    info, plan = checked.info, checked.plan
    try:
        from ._into import checked as checked_group
        groups: dict = {}
        for name in info.full:
            groups.setdefault(checked.dests[name].device, {})[name] = checked.dests[name]
        load_groups(ck, {device: checked_group(group, True, options)
                         for device, group in groups.items()}, plan, done)
        with torch.no_grad():
            for batch in checked.patches:
                view, index = scatter_target(torch, checked.dests, batch)
                view[index] = batch.values
                bump_versions(torch, [checked.dests[n] for n in batch.names])
                done.extend(batch.names)
    except BaseException as e:
        try:
            before = tuple(getattr(e, "written", ()) or ())
            e.written = tuple(done) + tuple(n for n in before if n not in done)  # type: ignore[attr-defined]
        except AttributeError:
            pass
        raise


def _destination(tensors, name):
    dest = tensors.get(name)
    if dest is None:
        raise DeltaError(f"the delta writes tensor {name!r}, which has no destination: nothing "
                         "was written")
    if not dest.is_contiguous():
        raise DeltaError(f"the destination of {name!r} is not contiguous: nothing was written")
    return dest


def _load_patches(torch, ck, tensors, info, rows=None):
    """Every sparse tensor's patch, read to its destination's device and
    checked, in ``Patches`` batches (``rows``: ``{name: (first element,
    end element) or None}``: only positions inside are kept, made relative
    to the first)."""
    groups: dict = {}
    for name in info.sparse:
        dest = tensors[name]
        groups.setdefault((dest.device, dest.element_size()), []).append(name)
    out = []
    for (device, _), group in groups.items():
        keys = [k for n in group for k in (indices_key(n), values_key(n))]
        loaded = ck.load(device, names=keys)
        alone = DELTA_PATCH_BATCH // 16
        batch: list = []
        count = 0
        for name in group + [None]:
            k = 0 if name is None else math.prod(ck.info(indices_key(name)).shape)
            if name is not None and k >= alone:
                out.append(_checked_batch(torch, [name], loaded, info, rows))
                continue
            if batch and (name is None or count + k > DELTA_PATCH_BATCH):
                out.append(_checked_batch(torch, batch, loaded, info, rows))
                batch, count = [], 0
            if name is not None:
                batch.append(name)
                count += k
    return tuple(out)


def _checked_batch(torch, names, loaded, info, rows):
    """The ``Patches`` of ``names`` (their keys popped from ``loaded``), the
    positions checked with one device sync: strictly increasing within each
    name, the first >= 0 and the last below the name's element count."""
    lengths = [loaded[indices_key(n)].numel() for n in names]
    if len(names) == 1:         # (read where it lies: no copy into a batch)
        positions = loaded.pop(indices_key(names[0])).reshape(-1).to(torch.int64)
        values = _as_int(torch, loaded.pop(values_key(names[0])))
    else:
        positions = torch.cat([loaded.pop(indices_key(n)).reshape(-1) for n in names]
                              ).to(torch.int64)
        values = torch.cat([_as_int(torch, loaded.pop(values_key(n))) for n in names])
    device = positions.device
    numels = [math.prod(info.sparse[n]) for n in names]
    ends = list(itertools.accumulate(lengths))
    starts = [e - k for e, k in zip(ends, lengths)]
    some = [i for i, k in enumerate(lengths) if k]
    if some:
        firsts = torch.tensor([starts[i] for i in some], device=device)
        lasts = torch.tensor([ends[i] - 1 for i in some], device=device)
        limits = torch.tensor([numels[i] for i in some], device=device)
        bad = (positions[firsts] < 0).any() | (positions[lasts] >= limits).any()
        if positions.numel() > 1:
            backwards = positions[1:] <= positions[:-1]
            joins = torch.tensor([s - 1 for s in starts if s], dtype=torch.int64, device=device)
            backwards[joins] = False        # (one name's last against the next one's first)
            bad = bad | backwards.any()
        if bool(bad):
            for name, s, e, numel in zip(names, starts, ends, numels):
                p = positions[s:e]
                if p.numel() and (bool((p[1:] <= p[:-1]).any()) or int(p[0]) < 0
                                  or int(p[-1]) >= numel):
                    raise DeltaError(f"sparse tensor {name!r}: its positions must be strictly "
                                     f"increasing and in [0, {numel}): nothing was written")
    spans = [None if rows is None else rows.get(n) for n in names]
    if any(span is not None for span in spans):
        lo = torch.tensor([0 if s is None else s[0] for s in spans], device=device)
        hi = torch.tensor([n if s is None else s[1] for s, n in zip(spans, numels)], device=device)
        which = torch.repeat_interleave(torch.arange(len(names), device=device),
                                        torch.tensor(lengths, device=device),
                                        output_size=positions.numel())
        inside = (positions >= lo[which]) & (positions < hi[which])
        lengths = torch.zeros(len(names), dtype=torch.int64, device=device).index_add_(
            0, which, inside.to(torch.int64)).tolist()
        positions = positions[inside] - lo[which[inside]]
        values = values[inside]
    return Patches(tuple(names), tuple(lengths), positions, values)


def scatter_target(torch, dests, batch):
    """``(view, index)``: ``view[index]`` are the elements of ``batch``'s
    destinations (``dests``) at its positions, as integers of their size.

    One name: its destination's own integer view.  Several: one integer
    view over the addresses the destinations span, from the lowest to the
    end of the highest, each position moved by its destination's distance
    from the lowest, so that one gather or scatter serves them all.  The
    view covers memory between the destinations that is not theirs; only
    ``index`` is ever touched through it, and every index lies inside a
    destination (each position checked against its destination's element
    count).  It lives no longer than the call that made it, while
    ``dests`` hold every byte it reaches.
    """
    if len(batch.names) == 1:
        return _as_int(torch, dests[batch.names[0]]), batch.positions
    size = batch.values.element_size()
    ptrs = [dests[n].data_ptr() for n in batch.names]
    low = min(ptrs)
    device = batch.positions.device
    if any((p - low) % size for p in ptrs):     # (a dtype's tensors are aligned to it: not seen)
        return _Split(torch, [_as_int(torch, dests[n]) for n in batch.names], batch.lengths), \
            batch.positions
    end = max(p + dests[n].numel() * size for n, p in zip(batch.names, ptrs))
    moved = torch.tensor([(p - low) // size for p in ptrs], dtype=torch.int64, device=device)
    index = batch.positions + torch.repeat_interleave(
        moved, torch.tensor(batch.lengths, device=device), output_size=batch.positions.numel())
    return _span_view(torch, device, low, (end - low) // size, batch.values.dtype, size), index


class _Split:
    """``scatter_target``'s view where one span cannot serve: the same
    ``view[index]`` reads and writes, destination by destination."""

    def __init__(self, torch, ints, lengths):
        self.torch, self.ints, self.lengths = torch, ints, list(lengths)

    def __getitem__(self, index):
        parts = self.torch.split(index, self.lengths)
        return self.torch.cat([ints[p] for ints, p in zip(self.ints, parts)])

    def __setitem__(self, index, values):
        parts = zip(self.torch.split(index, self.lengths), self.torch.split(values, self.lengths))
        for ints, (p, v) in zip(self.ints, parts):
            ints[p] = v


_TYPESTR = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}


class _Interface:
    """A span of device memory as ``__cuda_array_interface__``: torch wraps
    it without a copy and without taking ownership."""

    def __init__(self, address, count, size):
        self.__cuda_array_interface__ = {"shape": (count,), "typestr": _TYPESTR[size],
                                         "data": (address, False), "version": 2}


def _span_view(torch, device, address, count, dtype, size):
    """``count`` elements of ``dtype`` (``size`` bytes each) from ``address``
    on ``device``, as a tensor that borrows them (``scatter_target``)."""
    if device.type == "cpu":
        return torch.frombuffer((ctypes.c_char * (count * size)).from_address(address),
                                dtype=dtype)
    with torch.cuda.device(device):
        return torch.as_tensor(_Interface(address, count, size), device=device)
