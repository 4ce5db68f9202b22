"""``save_model``: a model in shards with ``model.safetensors.index.json``,
as huggingface_hub's ``save_torch_state_dict`` writes them.

The same arguments, defaults and files as ``huggingface_hub.save_torch_state_dict``
(tests/loader/test_save_model.py compares them with its output):

- tied weights (tensors over one storage) are saved once: of each group of
  overlapping tensors, the first name in sorted order among those that
  cover their whole storage, preferring names not in
  ``shared_tensors_to_discard``; each name left out is recorded in the
  metadata as ``{left_out: kept}`` (unless the caller's metadata has it);
  a group where no tensor covers the storage is refused (RuntimeError);
  slices of one storage that do not overlap (a fused weight's q, k and v)
  are saved each with its own bytes (huggingface_hub refuses them: none
  covers the storage);
- shards are filled in the state dict's order, a new one started where the
  next tensor would take the shard past ``max_shard_size`` (a tensor
  larger than that alone in its own); sizes are the tensors' storages'
  (as huggingface_hub counts them), tensors over one storage in one shard;
- one shard: ``model.safetensors`` (``filename_pattern`` with an empty
  ``{suffix}``), its metadata ``{"format": "pt", **metadata}``, no index;
  several: ``model-00001-of-00003.safetensors``..., each with
  ``{"format": "pt"}``, and the index ``{"metadata": {"total_size": ...,
  **metadata}, "weight_map": {name: file}}`` (``json.dumps(indent=2)``).

Differences, each where huggingface_hub's way loses a reader's view of a
whole file: every shard goes through ``save_file`` (atomic: a temporary
name, then a rename; an upload completed or aborted) and the index is
written last, atomically too; files of an earlier save that match the
pattern and are not part of this one (another shard count, an index where
this save has none) are removed after the new index is in place, not
before the first shard (huggingface_hub removes them first).  A reader
opening a file sees a whole file; a reader of a directory that a save is
replacing may see shards of two saves where the shard names stay the same
(save each version to its own directory to read whole versions).  The
directory is made where missing.  ``safe_serialization=False`` (pickles)
is refused.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ._save import VERSION_KEY, _end, _pwrite_all, check_tensor_dict, make_plan, published
from ._save_file import save_file
from ._schemes import is_url, redact_url
from ._target import _import_torch
from ._typing import PathLike

if TYPE_CHECKING:

    from .._staging import StagingBuffer

# huggingface_hub's names and defaults (its constants and serialization/_base.py).
FILENAME_PATTERN = "model{suffix}.safetensors"
MAX_SHARD_SIZE = "5GB"
SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}


def save_model(model_or_state_dict, save_directory: PathLike, *,
               filename_pattern: str | None = None, force_contiguous: bool = True,
               max_shard_size: int | str = MAX_SHARD_SIZE,
               metadata: Mapping[str, str] | None = None, safe_serialization: bool = True,
               is_main_process: bool = True, shared_tensors_to_discard: list[str] | None = None,
               version: str | None = None, digests: bool = False, sync: bool = True,
               staging: StagingBuffer | None = None,
               storage_options: dict | None = None) -> dict[str, list[str]]:
    """Saves a model (or its state dict) as safetensors shards and their index.

    A drop-in for ``huggingface_hub.save_torch_state_dict`` (and
    ``save_torch_model``): the same files (the module's docstring), each
    written by ``save_file``.

    Args:
        model_or_state_dict: a ``torch.nn.Module`` (its ``state_dict()``) or
            ``{name: tensor}``.
        save_directory: a directory (made where missing) or a bucket's URL
            prefix (``s3://bucket/ckpt``).
        filename_pattern: the files' names, with ``{suffix}`` where the
            shard's ``-00001-of-00003`` goes (default
            ``"model{suffix}.safetensors"``).
        force_contiguous: save ``.contiguous()`` copies of non-contiguous
            tensors (else they are refused, as ``save_file`` refuses them).
        max_shard_size: bytes per shard, an int or ``"5GB"``-style
            (units TB, GB, MB, KB: powers of 1000).
        metadata: ``{str: str}``: in the index where there are several
            shards, else in the file.
        safe_serialization: must be True (safetensors).
        is_main_process: False: leave earlier saves' files alone (the other
            ranks of a distributed save).
        shared_tensors_to_discard: names to leave out of tied groups first.
        version, digests, sync, staging, storage_options: as ``save_file``;
            ``version`` also goes in the index's metadata.

    Returns:
        ``{file name: [tensor names]}`` of the files written.

    Raises:
        ValueError: a bad pattern or size, ``safe_serialization=False``,
            or what ``save_file`` refuses; before any file is written.
        RuntimeError: tied tensors of which none covers its storage.
    """
    torch = _import_torch()
    if not safe_serialization:
        raise ValueError("save_model writes safetensors only: saving pickles "
                         "(safe_serialization=False) is not supported")
    if isinstance(model_or_state_dict, torch.nn.Module):
        state_dict = model_or_state_dict.state_dict()
    elif isinstance(model_or_state_dict, Mapping):
        state_dict = dict(model_or_state_dict)
    else:
        raise TypeError("save_model takes a torch.nn.Module or a dict of tensors, not "
                        f"{type(model_or_state_dict).__name__}")
    pattern = FILENAME_PATTERN if filename_pattern is None else filename_pattern
    if not isinstance(pattern, str) or "{suffix}" not in pattern:
        raise ValueError(f"filename_pattern must be a str holding '{{suffix}}', not {pattern!r}")
    limit = parse_size(max_shard_size)
    meta = {} if metadata is None else dict(metadata)
    for key, value in meta.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"metadata must map str to str: {key!r}: {value!r}")
    check_tensor_dict(torch, state_dict)
    for kept, dropped in tied_names(torch, state_dict, shared_tensors_to_discard).items():
        for name in dropped:
            meta.setdefault(name, kept)
            del state_dict[name]
    if force_contiguous:
        state_dict = {k: v.contiguous() for k, v in state_dict.items()}
    files, total = split(torch, state_dict, pattern, limit)
    sharded = len(files) > 1
    directory = os.fsdecode(os.fspath(save_directory)) if not isinstance(save_directory, str) \
        else save_directory
    remote = is_url(directory)
    if not remote:
        os.makedirs(directory, exist_ok=True)
    per_file = {"format": "pt", **({} if sharded else meta)}
    for names in files.values():     # every shard checked before the first is written
        make_plan({n: state_dict[n] for n in names}, per_file, version=version)
    for filename, names in files.items():
        save_file({n: state_dict[n] for n in names}, _join(directory, filename, remote), per_file,
                  version=version, digests=digests, sync=sync, staging=staging,
                  storage_options=storage_options)
    index_name = pattern.format(suffix="") + ".index.json"
    if sharded:
        index_meta = {"total_size": total, **meta}
        if version is not None:
            index_meta[VERSION_KEY] = version
        index = {"metadata": index_meta,
                 "weight_map": {n: f for f, names in files.items() for n in names}}
        _publish_bytes(json.dumps(index, indent=2).encode(), directory, index_name, remote,
                       sync=sync, storage_options=storage_options)
    if is_main_process:
        keep = set(files) | ({index_name} if sharded else set())
        _remove_stale(directory, pattern, keep, remote, storage_options)
    return files


def parse_size(size) -> int:
    """``max_shard_size`` in bytes: an int, or digits and a unit ("5GB",
    "500MB"; TB, GB, MB, KB, powers of 1000), as huggingface_hub reads it."""
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise TypeError(f"max_shard_size must be an int or a str like '5GB', not {size!r}")
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, not {size}")
        return size
    text = size.strip()
    unit = text[-2:].upper()
    if unit not in SIZE_UNITS:
        raise ValueError(f"max_shard_size {size!r}: the unit must be one of TB, GB, MB, KB")
    try:
        value = float(text[:-2].strip())
    except ValueError:
        raise ValueError(f"max_shard_size {size!r}: no number before the unit") from None
    out = int(value * SIZE_UNITS[unit])
    if out <= 0:
        raise ValueError(f"max_shard_size must be positive, not {size!r}")
    return out


# -- tied weights and shards ------------------------------------------------------------

def _storage_id(tensor):
    if tensor.device.type == "meta":
        return None
    storage = tensor.untyped_storage()
    return tensor.device, storage.data_ptr(), storage.nbytes()


def _storage_size(tensor):
    if tensor.device.type == "meta":
        return tensor.numel() * tensor.element_size()
    return tensor.untyped_storage().nbytes()


def tied_names(torch, state_dict, discard=None) -> dict[str, list[str]]:
    """``{kept: [names left out]}`` for each group of tensors that overlap in
    one storage (the module's docstring; huggingface_hub's choice)."""
    by_storage: dict = {}
    for name, tensor in state_dict.items():
        key = _storage_id(tensor)
        if key is None or key[1] == 0 or key[2] == 0:
            continue
        by_storage.setdefault(key, set()).add(name)
    discard = set(discard or ())
    out: dict[str, list[str]] = {}
    # Groups in huggingface_hub's order (a sort of sets, which compares by
    # inclusion: disjoint groups keep the state dict's order).
    for group in sorted(by_storage.values()):
        if len(group) < 2:
            continue
        for shared in _overlapping(state_dict, group):
            if len(shared) < 2:
                continue
            complete = {n for n in shared if _covers_storage(state_dict[n])}
            if not complete:
                raise RuntimeError(f"tensors {sorted(shared)} share memory and none of them covers "
                                   "all of it: saving one would save bytes the others do not "
                                   "hold; .clone() them first")
            preferred = complete - discard
            keep = sorted(preferred or complete)[0]
            out.setdefault(keep, []).extend(n for n in sorted(shared) if n != keep)
    return out


def _overlapping(state_dict, group):
    """``group``'s names split into runs of overlapping byte ranges."""
    areas = sorted((state_dict[n].data_ptr(), _end(state_dict[n]), n) for n in group)
    runs = [{areas[0][2]}]
    last_stop = areas[0][1]
    for start, stop, name in areas[1:]:
        if start >= last_stop:
            runs.append({name})
        else:
            runs[-1].add(name)
        last_stop = stop
    return runs


def _covers_storage(tensor):
    storage = tensor.untyped_storage()
    return (tensor.data_ptr() == storage.data_ptr()
            and tensor.numel() * tensor.element_size() == storage.nbytes())


def split(torch, state_dict, pattern, limit):
    """``({file name: [tensor names]}, total bytes)``: the shards in
    huggingface_hub's order and names."""
    shards: list[dict] = []
    current: dict = {}
    size = total = 0
    same_storage: dict = {}
    for name, tensor in state_dict.items():
        key = _storage_id(tensor)
        if key is not None:
            if key in same_storage:
                same_storage[key].append(name)
                continue
            same_storage[key] = [name]
        n = _storage_size(tensor)
        if n > limit:
            total += n
            shards.append({name: None})
            continue
        if size + n > limit:
            shards.append(current)
            current, size = {}, 0
        current[name] = None
        size += n
        total += n
    if current:
        shards.append(current)
    for names in same_storage.values():
        for shard in shards:
            if names[0] in shard:
                for name in names:
                    shard[name] = None
                break
    if len(shards) == 1:
        return {pattern.format(suffix=""): list(shards[0])}, total
    count = len(shards)
    return {pattern.format(suffix=f"-{i + 1:05d}-of-{count:05d}"): list(shard)
            for i, shard in enumerate(shards)}, total


# -- the files ---------------------------------------------------------------------------

def _join(directory, name, remote):
    if remote:
        return directory.rstrip("/") + "/" + name
    return os.path.join(directory, name)


def _publish_bytes(data, directory, name, remote, *, sync, storage_options):
    """``data`` as ``directory/name``, whole or not at all."""
    if remote:
        from ._schemes import Stores, describe, load_obstore
        store, key = Stores(storage_options).split(_join(directory, name, True))
        try:
            load_obstore().put(store, key, data, use_multipart=False)
        except Exception as e:
            raise OSError(f"{redact_url(_join(directory, name, True))}: the upload failed: "
                          f"{describe(e)}") from None
        return
    with published(os.path.join(directory, name), sync=sync) as fd:
        _pwrite_all(fd, memoryview(data), 0)


def _stale_pattern(pattern):
    prefix, _, suffix = pattern.partition("{suffix}")
    return re.compile(re.escape(prefix) + r"(-\d{5}-of-\d{5})?" + re.escape(suffix)
                      + r"(\.index\.json)?")


def _remove_stale(directory, pattern, keep, remote, storage_options):
    """Removes the files of earlier saves with ``pattern`` that this save
    did not write (huggingface_hub's rule for which files are a save's)."""
    match = _stale_pattern(pattern)
    if remote:
        from ._schemes import Stores, load_obstore
        obstore = load_obstore()
        store, prefix = Stores(storage_options).split(directory.rstrip("/") + "/")
        listed = obstore.list_with_delimiter(store, prefix.strip("/") or None)
        for obj in listed["objects"]:
            name = posixpath.basename(obj["path"])
            if match.fullmatch(name) and name not in keep:
                obstore.delete(store, obj["path"])
        return
    for name in os.listdir(directory):
        if match.fullmatch(name) and name not in keep:
            try:
                os.remove(os.path.join(directory, name))
            except FileNotFoundError:
                pass
