"""Weight updates (RL): a versioned update, verified, then written in place.

    weights = VersionedWeights(dict(model.named_parameters()), version="step-0")
    report = weights.update("/ckpt/step-1", version="step-1")        # a full checkpoint
    report = weights.update("s3://b/delta-2.safetensors", version="step-2")   # a delta
    weights.state        # "version step-2", or "mixed: ..." after a failure part-way

``apply_update`` (the function) and ``VersionedWeights`` (a holder that
knows which version its tensors hold) take an update: a source (a full
checkpoint or a delta, ``_delta.py``'s format, from files, a URL or the
cache, or an open ``Checkpoint``) and the version id it installs.  The
contract (docs/guides/rl-updates.md):

Verify before apply.  Everything below is checked before the first byte
of any destination is written; a failure raises ``UpdateRefused`` (a
ValueError) and leaves every destination bit-identical:

- the source's own version (``instant_staging.version`` in its metadata,
  where ``save_file(version=)`` wrote it) is the update's ``version``;
- a delta's base version is the version the tensors hold (``base_version``;
  a holder's own); a full checkpoint needs none;
- every name (after ``name_map``) has a destination, every destination
  (of a full update) is written, each of the tensor's dtype and shape (a
  ``plan`` row slice: the rows'), contiguous, none overlapping another;
- every file is as it was when opened (the pins: modification time and
  size of a file; an object's ETag is compared with every range answer);
- the update's ``digests`` (``{name: tensor_digest}``, what the trainer
  saved) are the ones the files' headers record (``save_file(...,
  digests=True)``), so a file that is not the one the trainer wrote is
  refused from its header, before its data is read; a name the headers
  record no digest for is refused too (nothing unverifiable is written);
- a delta's positions are in range and strictly increasing (its patches
  are read before any write).

A failure after the first write (a read error, a remote object replaced
mid-read, Ctrl-C) is never silent: it raises ``UpdateFailed`` (the cause
chained, a KeyboardInterrupt re-raised as itself with the state attached)
naming what was written.  With ``rollback`` the destinations' old bytes
were kept before the first write and are written back: the tensors hold
the version before again (``rolled_back``).  Without, they are "mixed": a
holder then reports ``mixed``, its ``version`` is None, and it accepts
only a full update (which rewrites every tensor) until one succeeds.

Rollback (``rollback=None``: on for a delta, off for a full update): a
copy of what an update overwrites.  For a delta it is the delta's own
size (the old values at the sparse positions, kept on the device, and the
whole tensors it replaces, on the host): small beside the update, and a
delta's failure would otherwise leave a chain of deltas unusable.  For a
full update it is the model's size in host memory and a device-to-host
copy of every byte before the load starts, about doubling the update's
time; a failed full update is repaired by the next full one (every RL
step's checkpoint is full or has a full base), so it is off unless asked
for.  benchmarks/bench_update.py measures both.

``return_digests=True``: the report carries ``device_digest`` of every
tensor written, computed on its device, so a trainer can check what was
installed against the same function on its own copy, with no copy of
the model back.

Every write bumps its destination's autograd version, as torch's
in-place writes do (``load_into``, the scatter, the rollback's copies).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from ._delta import DELTA_KEY, DeltaError, DeltaInfo, check_delta, load_groups, scatter_target, write_delta
from ._digest import device_digests
from ._save import DIGEST_ALGORITHM, DIGESTS_KEY, VERSION_KEY, _torch_names
from ._target import _import_torch

if TYPE_CHECKING:
    import torch

# The options of the loads an update runs (load_into's).
LOAD_OPTIONS = ("chunk_size", "io_depth", "threads", "staging", "verify", "progress", "backend",
                "max_bytes_per_second")


class UpdateRefused(ValueError):
    """An update refused before anything was written: the destinations are
    bit-identical to what they were.  ``reason`` says why."""


class UpdateFailed(RuntimeError):
    """An update that failed after its first write.

    ``written``: the destinations' names whose bytes were all written;
    ``rolled_back``: whether the old bytes were written back (the tensors
    then hold ``base_version`` again); ``version`` / ``base_version``: the
    update's and the one before.  The cause is ``__cause__``."""

    def __init__(self, message, *, written=(), rolled_back=False, version=None,
                 base_version=None):
        super().__init__(message)
        self.written = tuple(written)
        self.rolled_back = rolled_back
        self.version = version
        self.base_version = base_version


class UpdateReport(NamedTuple):
    """What an update installed."""

    version: str
    base_version: str | None
    delta: bool
    """Whether the source was a delta."""
    written: tuple[str, ...]
    """The destinations written (their names in ``tensors``)."""
    nbytes: int
    """Bytes written into the destinations."""
    seconds: float
    """From the call to the last write (digests included)."""
    digests: dict[str, str] | None
    """``{destination name: device_digest}`` with ``return_digests``, else None."""


class UpdateState(NamedTuple):
    """What a ``VersionedWeights`` holds."""

    version: str | None
    """The version the tensors hold, or None (unknown, or mixed)."""
    mixed: bool
    """A failure part-way left some tensors of ``target`` over ``version_before``."""
    target: str | None = None
    """While mixed: the version the failed update was installing."""
    version_before: str | None = None
    """While mixed: the version the tensors held before it."""
    written: tuple[str, ...] = ()
    """While mixed: the names written (the others may hold part of the new bytes)."""

    def __str__(self):
        if self.mixed:
            shown = ", ".join(self.written[:10]) + (" ..." if len(self.written) > 10 else "")
            return (f"mixed: {len(self.written)} tensor(s) of version {self.target!r} written over "
                    f"version {self.version_before!r}" + (f" ({shown})" if shown else "")
                    + "; a full update installs a version again")
        return "unknown version" if self.version is None else f"version {self.version}"


def _check_version(label, value, allow_none=False):
    if value is None and allow_none:
        return
    if not isinstance(value, str) or not value:
        raise TypeError(f"{label} must be a non-empty str, not {value!r}")


def _mapped(tensors, names, name_map, skip_missing=False):
    """``{checkpoint name: destination}`` for ``names``, and ``{checkpoint
    name: destination name}``; ``name_map(name)`` gives a destination's
    name (None: this update does not write ``name`` here); ``skip_missing``:
    a name without a destination is skipped, not refused."""
    dests, keys = {}, {}
    taken: dict = {}
    for name in names:
        key = name if name_map is None else name_map(name)
        if key is None:
            continue
        if not isinstance(key, str):
            raise TypeError(f"name_map({name!r}) must return a str or None, not {key!r}")
        if key not in tensors:
            if skip_missing:
                continue
            raise UpdateRefused(f"the update holds {name!r}, which has no destination "
                                f"{'(' + repr(key) + ') ' if key != name else ''}(a full update's "
                                "strict=False skips it): nothing was written")
        if key in taken:
            raise UpdateRefused(f"{taken[key]!r} and {name!r} both map to destination {key!r}: "
                                "nothing was written")
        taken[key] = name
        dests[name] = tensors[key]
        keys[name] = key
    return dests, keys


def _file_digests(ck):
    """``{name: digest}`` the headers record (``save_file(digests=True)``)."""
    out = {}
    for header in ck._shards.headers:
        raw = (header.metadata or {}).get(DIGESTS_KEY)
        if not raw:
            continue
        try:
            parsed = json.loads(raw)
            algorithm, found = parsed["algorithm"], parsed["tensors"]
        except (ValueError, KeyError, TypeError):
            raise UpdateRefused(f"the file's {DIGESTS_KEY!r} is not what save_file writes: "
                                "nothing was written") from None
        if algorithm != DIGEST_ALGORITHM:
            raise UpdateRefused(f"the file's digests are {algorithm!r}, this version reads "
                                f"{DIGEST_ALGORITHM!r}: nothing was written")
        out.update(found)
    return out


def _check_digests(ck, digests):
    if digests is None:
        return
    if not isinstance(digests, Mapping):
        raise TypeError(f"digests must be a mapping of tensor names to tensor_digest hex, "
                        f"not {type(digests).__name__}")
    recorded = _file_digests(ck)
    for name, want in digests.items():
        got = recorded.get(name)
        if got is None:
            raise UpdateRefused(f"the update carries a digest of {name!r}, the file records none "
                                "(save it with digests=True): nothing was written")
        if got != want:
            raise UpdateRefused(f"tensor {name!r}: the file records digest {got[:16]}..., the "
                                f"update carries {str(want)[:16]}...: the file is not the one the "
                                "trainer wrote; nothing was written")


def _check_pins(ck):
    from ._errors import CheckpointChangedError
    try:
        changed = ck._shards.changed()
    except CheckpointChangedError as e:     # (a cache hit whose object changed: _revalidate.py)
        raise UpdateRefused(f"{e}; nothing was written") from None
    if changed:
        raise UpdateRefused(f"{changed[0]}: the file was written to since it was opened (its "
                            "modification time or size changed): nothing was written")


def _check_full(ck, dests, plan, tensors, keys, options):
    """The checks of a full update: every destination written, each of its
    tensor's dtype and shape, contiguous, on a device, none overlapping;
    returns ``{device: Destinations}`` (``load_groups`` writes them without
    checking them again)."""
    torch = _import_torch()
    from ._into import checked
    targets = set(keys.values())
    missing = [k for k in tensors if k not in targets]
    if missing:
        raise UpdateRefused(f"{len(missing)} destination(s) the update does not write (a full "
                            f"update writes every one; a delta writes some): "
                            f"{', '.join(map(repr, sorted(missing)[:20]))}: nothing was written")
    names = _torch_names(torch)
    info = ck.info
    f4 = getattr(torch, "float4_e2m1fn_x2", None)
    for name, dest in dests.items():
        entry = info(name)
        shape = entry.shape
        rows = None if plan is None else plan.get(name)
        if rows is not None:
            if not isinstance(rows, slice) or not shape or rows.indices(shape[0])[2] != 1:
                raise UpdateRefused(f"tensor {name!r}: a plan's entry is None or a step-1 slice "
                                    f"of the first dimension, not {rows!r}")
            start, stop, _ = rows.indices(shape[0])
            shape = (max(stop - start, 0), *shape[1:])
        have = dest.shape       # (a torch.Size: a tuple)
        dtype = dest.dtype
        if dtype is f4 and have:
            have = (*have[:-1], have[-1] * 2)
        if names.get(dtype) != entry.dtype or tuple(have) != tuple(shape):
            raise UpdateRefused(f"tensor {name!r}: the checkpoint holds {entry.dtype} "
                                f"{list(shape)}"
                                f"{' (the rows of its plan)' if rows is not None else ''}, the "
                                f"destination is {dest.dtype} {list(dest.shape)}: nothing was "
                                "written")
    groups: dict = {}
    for name, dest in dests.items():
        groups.setdefault(dest.device, {})[name] = dest
    # (every device's checked before the first write: load_into's own check
    # of a second device would come after the first one's writes, and read
    # as a failure part-way)
    out = {}
    for device, group in groups.items():
        try:
            out[device] = checked(group, True, options)
        except (TypeError, ValueError) as e:
            raise UpdateRefused(f"{e}: nothing was written") from None
    return out


class _Saved:
    """The old bytes of what an update overwrites (its rollback)."""

    def __init__(self, torch):
        self.torch = torch
        self.whole: dict = {}           # {name: (destination, host copy)}
        self.sparse: list = []          # [(batch, old values)] (write_delta's Patches)

    def keep_whole(self, name, dest):
        torch = self.torch
        pin = dest.device.type == "cuda"
        copy = torch.empty(dest.shape, dtype=dest.dtype, device="cpu", pin_memory=pin)
        copy.copy_(dest.detach())
        self.whole[name] = (dest, copy)

    def keep_sparse(self, dests, batch):
        # (the index a batch of several names is scattered through is made
        # again to restore: kept, it would double the batch's memory)
        view, index = scatter_target(self.torch, dests, batch)
        self.sparse.append((dests, batch, view[index].clone()))

    def restore(self):
        torch = self.torch
        with torch.no_grad():
            for dest, copy in self.whole.values():
                dest.copy_(copy)
            for dests, batch, old in self.sparse:
                view, index = scatter_target(torch, dests, batch)
                view[index] = old
            if torch.cuda.is_available():
                torch.cuda.synchronize()


def apply_update(tensors: Mapping[str, torch.Tensor], source: Any, *, version: str,
                 base_version: str | None = None, digests: Mapping[str, str] | None = None,
                 name_map: Callable[[str], str | None] | None = None,
                 plan: Mapping[str, slice | None] | None = None, strict: bool = True,
                 rollback: bool | None = None, return_digests: bool = False,
                 storage_options: Mapping | None = None, cache_dir: Any = None,
                 **options) -> UpdateReport:
    """Installs version ``version`` from ``source`` into ``tensors``, in place,
    every check passed first (the module's docstring).

    Args:
        tensors: ``{name: tensor}``: the destinations (a model's parameters).
        source: a full checkpoint or a delta (as ``load_file``'s source), or
            an open ``Checkpoint`` (its pins are those of its open).
        version: the version id the tensors hold once installed.
        base_version: the version id the tensors hold now (a delta's base
            must be it; None: unknown, and a delta is refused).
        digests: ``{checkpoint name: tensor_digest}`` the trainer saved: the
            files' recorded digests must be these.
        name_map: ``checkpoint name -> destination name`` (None: skip it);
            default: the same name.
        plan: ``{checkpoint name: None | slice}``: a destination holds those
            rows of its tensor (a tensor-parallel shard).
        strict: a full update: every checkpoint tensor (not skipped by
            ``name_map``) has a destination.
        rollback: keep the old bytes and write them back on a failure after
            the first write; None: for a delta only.
        return_digests: compute ``device_digest`` of every tensor written.
        storage_options, cache_dir: as ``load_file``'s.
        **options: the loads' (``chunk_size``, ``io_depth``, ``threads``,
            ``staging``, ``verify``, ``progress``, ``backend``,
            ``max_bytes_per_second``).

    Returns:
        The ``UpdateReport``.

    Raises:
        TypeError: an argument of the wrong type (nothing written).
        UpdateRefused: a check failed; nothing was written.
        UpdateFailed: a failure after the first write (its cause chained).
        KeyboardInterrupt: as itself, with ``update_failed`` (an
            ``UpdateFailed``) set on it.
    """
    return _apply(tensors, source, version, base_version, digests, name_map, plan, strict,
                  rollback, return_digests, storage_options, cache_dir, options, None)


def _apply(tensors, source, version, base_version, digests, name_map, plan, strict, rollback,
           return_digests, storage_options, cache_dir, options, on_first_write):
    began = time.perf_counter()
    torch = _import_torch()
    _check_version("version", version)
    _check_version("base_version", base_version, allow_none=True)
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of names to torch tensors, not "
                        f"{type(tensors).__name__}")
    if rollback is not None and not isinstance(rollback, bool):
        raise TypeError(f"rollback must be None or a bool, not {rollback!r}")
    if name_map is not None and not callable(name_map):
        raise TypeError(f"name_map must be a callable name -> name or None, not "
                        f"{type(name_map).__name__}")
    if plan is not None and not isinstance(plan, Mapping):
        raise TypeError(f"plan must be a dict of name -> None or a slice, not "
                        f"{type(plan).__name__}")
    for key in options:
        if key not in LOAD_OPTIONS:
            raise TypeError(f"apply_update() got an unexpected keyword argument {key!r}")
    from ._checkpoint import Checkpoint
    if isinstance(source, Checkpoint):
        ck, owned = source, False
    else:
        ck, owned = Checkpoint.open(source, storage_options=storage_options,
                                    cache_dir=cache_dir), True
    try:
        return _apply_open(torch, ck, tensors, version, base_version, digests, name_map, plan,
                           strict, rollback, return_digests, options, began, on_first_write)
    finally:
        if owned:
            ck.close()


def _apply_open(torch, ck, tensors, version, base_version, digests, name_map, plan, strict,
                rollback, return_digests, options, began, on_first_write):
    metadata = ck.metadata() or {}
    is_delta = DELTA_KEY in metadata
    said = metadata.get(VERSION_KEY)
    if said is not None and said != version:
        raise UpdateRefused(f"the source holds version {said!r} (its metadata), the update says "
                            f"{version!r}: nothing was written")
    if is_delta:
        try:
            info = _delta_info(ck)
        except DeltaError as e:
            raise UpdateRefused(str(e)) from None
        if base_version is None:
            raise UpdateRefused(f"a delta over version {info.base_version!r}, and the version the "
                                "tensors hold is unknown: nothing was written")
        if info.base_version != base_version:
            raise UpdateRefused(f"the delta applies to version {info.base_version!r}; the tensors "
                                f"hold {base_version!r}: nothing was written")
        dests, keys = _mapped(tensors, (*info.full, *info.sparse), name_map)
        info = info._replace(full=tuple(n for n in info.full if n in dests),
                             sparse={n: s for n, s in info.sparse.items() if n in dests})
        try:
            checked = check_delta(ck, dests, base_version, plan, info)
        except DeltaError as e:
            raise UpdateRefused(str(e)) from None
        groups = None
    else:
        dests, keys = _mapped(tensors, ck.names(), name_map, skip_missing=not strict)
        groups = _check_full(ck, dests, plan, tensors, keys, options)
    _check_digests(ck, digests)
    keep = is_delta if rollback is None else rollback
    saved = _Saved(torch) if keep else None
    if saved is not None:
        if is_delta:
            for name in checked.info.full:
                saved.keep_whole(name, dests[name])
            for batch in checked.patches:
                saved.keep_sparse(dests, batch)
        else:
            for name, dest in dests.items():
                saved.keep_whole(name, dest)
    _check_pins(ck)         # (last: the files as they are now, just before the first write)
    written: list = []
    if on_first_write is not None:
        on_first_write()
    try:
        if is_delta:
            write_delta(ck, checked, written=written, **options)
        else:
            assert groups is not None
            load_groups(ck, groups, plan, written)
    except BaseException as e:
        failure = _failed(e, written, saved, keys, version, base_version)
        if isinstance(e, KeyboardInterrupt):
            e.update_failed = failure       # type: ignore[attr-defined]
            raise
        raise failure from e
    found = None
    if return_digests:
        found = {keys[n]: d for n, d in device_digests({n: dests[n] for n in written}).items()}
    counts = checked.counts() if is_delta else {}
    nbytes = sum(dests[n].element_size() * counts[n] if n in counts else dests[n].nbytes
                 for n in written)
    return UpdateReport(version, base_version, is_delta, tuple(keys[n] for n in written), nbytes,
                        time.perf_counter() - began, found)


def _delta_info(ck):
    from ._delta import _info_of
    return _info_of(ck)


def _failed(error, written, saved, keys, version, base_version):
    """The ``UpdateFailed`` of ``error`` raised after the first write: the
    old bytes written back where they were kept."""
    names = [keys[n] for n in dict.fromkeys([*written, *(getattr(error, "written", ()) or ())])
             if n in keys]
    rolled_back = False
    note = ""
    if saved is not None:
        try:
            saved.restore()
            rolled_back = True
        except BaseException as again:     # (the state is then mixed: said, not hidden)
            note = f"; writing the old bytes back failed too ({type(again).__name__}: {again})"
    if rolled_back:
        message = (f"the update to version {version!r} failed after its first write and was "
                   f"rolled back: the tensors hold {base_version!r} again ({type(error).__name__}: "
                   f"{error})")
    else:
        message = (f"the update to version {version!r} failed after its first write: "
                   f"{len(names)} tensor(s) written, the tensors hold a mix of {version!r} and "
                   f"{base_version!r}{note} ({type(error).__name__}: {error})")
    return UpdateFailed(message, written=names, rolled_back=rolled_back, version=version,
                        base_version=base_version)


class VersionedWeights:
    """Tensors (a model's parameters) and the version they hold, updated in
    place by ``update``: a version is reported only once an update that
    installs it has succeeded (the module's docstring).

        weights = VersionedWeights(dict(model.named_parameters()), version="step-0")
        weights.update("/ckpt/step-1", version="step-1")
        str(weights.state)   # "version step-1"

    One update at a time (a lock); reading ``state`` never waits.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], version: str | None = None, *,
                 name_map: Callable[[str], str | None] | None = None,
                 plan: Mapping[str, slice | None] | None = None):
        """
        Args:
            tensors: ``{name: tensor}``, kept (not copied): every full update
                writes each of them.
            version: the version they hold now (None: unknown; a delta is then
                refused until a full update installs one).
            name_map, plan: as ``apply_update``'s, for every update.
        """
        _check_version("version", version, allow_none=True)
        if not isinstance(tensors, Mapping):
            raise TypeError(f"tensors must be a mapping of names to torch tensors, not "
                            f"{type(tensors).__name__}")
        self.tensors = dict(tensors)
        self.name_map = name_map
        self.plan = None if plan is None else dict(plan)
        self._state = UpdateState(version, False)
        self._lock = threading.Lock()

    @property
    def state(self) -> UpdateState:
        """What the tensors hold (``str()`` says it in words)."""
        return self._state

    @property
    def version(self) -> str | None:
        """The version the tensors hold; None while mixed or unknown."""
        return self._state.version

    def update(self, source: Any, *, version: str, digests: Mapping[str, str] | None = None,
               rollback: bool | None = None, return_digests: bool = False,
               strict: bool = True, storage_options: Mapping | None = None,
               cache_dir: Any = None, **options) -> UpdateReport:
        """Installs ``version`` from ``source`` (``apply_update``'s, over the
        version held); the state says ``version`` once it succeeded.

        Raises:
            UpdateRefused: nothing written; the state is unchanged.
            UpdateFailed: part written; the state is "mixed" (or unchanged
                where the update was rolled back).
            RuntimeError: another update of these tensors is running.
        """
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("another update of these tensors is running")
        try:
            before = self._state
            current = before.version
            if before.mixed:
                current = None      # a delta needs a version; a full update rewrites every tensor

            def entering():
                # From the first write on, the state is not the version before.
                self._state = UpdateState(None, True, version, before.version_before
                                          if before.mixed else before.version, before.written)
            try:
                report = _apply(self.tensors, source, version, current, digests, self.name_map,
                                self.plan, strict, rollback, return_digests, storage_options,
                                cache_dir, options, entering)
            except UpdateFailed as e:
                self._after_failure(before, e)
                raise
            except KeyboardInterrupt as e:
                failure = getattr(e, "update_failed", None)
                if failure is not None:
                    self._after_failure(before, failure)
                raise
            except BaseException:
                self._state = before    # refused (or failed before the first write)
                raise
            if report.delta or not before.mixed or set(report.written) >= set(self.tensors):
                self._state = UpdateState(version, False)
            return report
        finally:
            self._lock.release()

    def _after_failure(self, before, failure):
        if failure.rolled_back and not before.mixed:
            self._state = before
            return
        written = tuple(dict.fromkeys((*before.written, *failure.written))) if before.mixed \
            else failure.written
        self._state = UpdateState(None, True, failure.version,
                                  before.version_before if before.mixed else before.version,
                                  written)

    @contextlib.contextmanager
    def written_elsewhere(self, version: str):
        """For an update that another writer applies (vLLM's
        ``load_weights``): "mixed" from the start of the block, ``version``
        once it ends without an exception; still "mixed" after one.  One
        update at a time, as ``update``."""
        _check_version("version", version)
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("another update of these tensors is running")
        try:
            before = self._state
            self._state = UpdateState(None, True, version, before.version_before if before.mixed
                                      else before.version, before.written)
            yield
            self._state = UpdateState(version, False)
        finally:
            self._lock.release()

    def digests(self, names: Any = None) -> dict[str, str]:
        """``device_digest`` of the held tensors (``names``: those only),
        computed on their devices."""
        chosen = self.tensors if names is None else {n: self.tensors[n] for n in names}
        return device_digests(chosen)

    def __repr__(self):
        return f"<VersionedWeights of {len(self.tensors)} tensor(s), {self._state}>"


__all__ = ["DeltaInfo", "UpdateFailed", "UpdateRefused", "UpdateReport", "UpdateState",
           "VersionedWeights", "apply_update"]
