"""``reload_weights(model, source)``: a checkpoint of the same architecture
written into an existing model in place (``Checkpoint.load_into``): each
parameter and buffer keeps its storage and ``data_ptr``, nothing of its
size is allocated, for RL weight updates and reloads after a crash.

Names are mapped as transformers' ``from_pretrained`` maps them, by its own
functions where it has them:

- transformers 5: the model's conversion mapping
  (``conversion_mapping.get_model_conversion_mapping``: its renamings, the
  caller's ``key_mapping``) and ``core_model_loading.rename_source_key``
  (which adds or strips ``base_model_prefix``).  A key a converter takes is
  written into its part of the converted parameter where that part is one
  contiguous piece of it: the fusing of per-expert MoE tensors
  (``MergeModulelist(dim=0)``, then ``Concatenate(dim=1)`` of gate and up)
  writes expert ``e``'s tensor into ``param[e]`` (and gate/up into its
  first/second half).  Any other conversion (a transpose, a split, a
  quantizer's) is a ``NotImplementedError`` naming the key: it cannot be
  written in place.
- transformers 4.56-4.57: the model's ``_get_key_renaming_mapping`` (its
  legacy renames, ``key_mapping`` or the class's
  ``_checkpoint_conversion_mapping``, the base model prefix).

Tied weights are written once (two checkpoint names of one storage: the
first in reading order).  Buffers are written where the checkpoint has
them.  A parameter the checkpoint lacks, or a checkpoint tensor the model
lacks, is an error before anything is written (``strict=False``: both
skipped; the class's ``_keys_to_ignore_on_load_*`` patterns are ignored,
as ``from_pretrained`` ignores them).  A
model spread over several devices (``device_map``) gets one load per
device, of the one open checkpoint.
"""

from __future__ import annotations

import re
from typing import Any

from ...loader import Checkpoint, LoadReport, import_torch


def reload_weights(model: Any, source: Any, *, strict: bool = True, key_mapping: dict | None = None,
                   storage_options: dict | None = None, **options: Any) -> list[LoadReport]:
    """Writes the checkpoint at ``source`` into ``model``'s parameters and
    buffers, in place.

    Args:
        model: a transformers ``PreTrainedModel`` (of the checkpoint's
            architecture and dtypes), on any devices.
        source: as ``load_file``'s (a directory, files, an index, a URL).
        strict: True (default): every parameter written, every checkpoint
            tensor used; False: those without a counterpart are skipped.
        key_mapping: as transformers' ``from_pretrained`` takes it.
        storage_options: for a URL source, as ``load_file``'s.
        **options: ``chunk_size``, ``io_depth``, ``threads``, ``staging``,
            ``verify``, ``progress`` (as ``load_file``'s).

    Returns:
        The ``LoadReport`` of each device's load.

    Raises:
        ValueError, TypeError: a name, dtype or shape that does not match
            (naming it), before anything is written; a parameter on the meta
            device (offloaded to disk).
        NotImplementedError: a checkpoint key whose conversion cannot be
            written in place.
        LoadError: a failure part-way (``written``: the names written).
    """
    torch = import_torch()
    with Checkpoint.open(source, storage_options=storage_options) as checkpoint:
        plan = destinations(torch, model, checkpoint, key_mapping, strict)
        reports = []
        for dests in plan.values():        # one load per device
            reports.append(checkpoint.load_into(dests, strict=False, **options))
        return reports


def destinations(torch, model, checkpoint, key_mapping=None, strict=True):
    """``{device: {checkpoint name: destination tensor}}`` for ``model``."""
    names = checkpoint.names()
    state = model.state_dict(keep_vars=True)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    mapped = _mapping(model, names, state, key_mapping)
    by_device: dict = {}
    storages: dict = {}         # (device, data_ptr) of a storage written -> checkpoint name
    used = set()
    unexpected = []
    for name in names:
        target = mapped.get(name)
        if target is None:
            unexpected.append(name)
            continue
        key, view = target
        tensor = state[key]
        data = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
        if data.device.type == "meta":
            raise ValueError(f"{key} is on the meta device (offloaded to disk?): reload_weights "
                             "writes into memory the model holds")
        dest = view(data) if view is not None else data
        at = (dest.device, dest.data_ptr(), dest.numel() * dest.element_size())
        if at in storages and dest.numel():
            used.add(key)
            continue            # a tied weight: written once, under its first name
        storages[at] = name
        used.add(key)
        by_device.setdefault(dest.device, {})[name] = dest
    if strict:
        # (the class's own patterns, as from_pretrained ignores them: an old
        # checkpoint's rotary inv_freq, a head the class does not have)
        unexpected = _not_ignored(unexpected, getattr(model, "_keys_to_ignore_on_load_unexpected", None))
        if unexpected:
            raise ValueError(f"{len(unexpected)} checkpoint tensor(s) have no counterpart in "
                             f"{type(model).__name__} (nothing written; strict=False skips them): "
                             + _listed(unexpected))
        shared = _aliases(state)
        missing = [k for k in state if k in params and k not in used
                   and not (shared.get(k, set()) & used)]
        missing = _not_ignored(missing, getattr(model, "_keys_to_ignore_on_load_missing", None))
        if missing:
            raise ValueError(f"{len(missing)} parameter(s) of {type(model).__name__} are not in "
                             f"the checkpoint (nothing written; strict=False leaves them): "
                             + _listed(missing))
    return by_device


def _not_ignored(names, patterns):
    if not patterns:
        return names
    return [n for n in names if not any(re.search(p, n) for p in patterns)]


def _aliases(state):
    """``{key: other keys of the same memory}`` (tied weights)."""
    at: dict = {}
    for key, t in state.items():
        if t.numel():
            at.setdefault((t.device, t.data_ptr()), set()).add(key)
    return {k: keys - {k} for keys in at.values() for k in keys}


def _listed(names, most=20):
    return ", ".join(sorted(names)[:most]) + (" ..." if len(names) > most else "")


def _mapping(model, names, state, key_mapping):
    """``{checkpoint name: (model key, view or None)}`` of the names the model has."""
    try:
        from transformers import conversion_mapping, core_model_loading
    except ImportError:
        return _mapping_4(model, names, state, key_mapping)
    return _mapping_5(model, names, state, key_mapping, conversion_mapping, core_model_loading)


def _mapping_5(model, names, state, key_mapping, conversion_mapping, core):
    transforms = conversion_mapping.get_model_conversion_mapping(
        model, key_mapping, getattr(model, "hf_quantizer", None))
    renamings = [t for t in transforms if isinstance(t, core.WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, core.WeightConverter)]
    prefix = getattr(model, "base_model_prefix", None) or None
    out = {}
    for name in names:
        key, pattern = core.rename_source_key(name, renamings, converters, prefix, state)
        if key not in state:
            continue
        if pattern is None:
            out[name] = (key, None)
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        out[name] = (key, _converted_part(name, pattern, converter, core))
    return out


def _converted_part(name, pattern, converter, core, index=None):
    """The view of the converted parameter that checkpoint tensor ``name``
    (matched by ``pattern`` of ``converter``; its expert ``index``, None:
    read from the name) becomes, where it is one contiguous piece of it;
    else NotImplementedError."""
    ops = list(converter.operations)
    kinds = [type(op).__name__ for op in ops]
    fused = (kinds and isinstance(ops[0], core.MergeModulelist) and ops[0].dim == 0
             and (len(ops) == 1 or (len(ops) == 2 and isinstance(ops[1], core.Concatenate)
                                    and ops[1].dim == 1)))
    if not fused or getattr(converter, "quantization_operation", None) is not None:
        raise NotImplementedError(
            f"checkpoint tensor {name!r} is converted by transformers ({' then '.join(kinds)}): "
            "reload_weights writes only renamed tensors and fused experts in place")
    if index is None:
        index = _expert_index(name, pattern)
    sources = list(converter.source_patterns)
    part, parts = sources.index(pattern), len(sources)

    def view(param):
        expert = param[index]
        if len(ops) == 1:
            return expert
        rows = expert.shape[0] // parts
        return expert.narrow(0, part * rows, rows)
    return view


def _expert_index(name, pattern):
    regex = re.escape(pattern).replace(r"\*", r"(\d+)")
    found = re.search(regex, name)
    if found is None or not found.groups():
        raise NotImplementedError(f"checkpoint tensor {name!r}: no expert index in it for the "
                                  f"pattern {pattern!r}")
    return int(found.group(1))


def _mapping_4(model, names, state, key_mapping):
    """transformers 4.56-4.57: its ``_get_key_renaming_mapping`` (legacy
    renames, key_mapping or ``_checkpoint_conversion_mapping``, prefix)."""
    # (as its _load_pretrained_model works them out)
    prefix = getattr(model, "base_model_prefix", "")
    has_prefix = bool(prefix) and any(n.startswith(prefix) for n in names)
    expects_prefix = bool(prefix) and hasattr(model, prefix)
    loading_base = not expects_prefix and has_prefix
    loading_task = expects_prefix and not has_prefix
    if key_mapping is None:
        key_mapping = getattr(model, "_checkpoint_conversion_mapping", None) or None
    rename = getattr(model, "_get_key_renaming_mapping", None)
    if rename is not None:
        renamed = rename(list(names), key_mapping, loading_base_model_from_task_state_dict=loading_base,
                         loading_task_model_from_base_state_dict=loading_task)
    else:
        renamed = {n: n for n in names}
    return {n: (k, None) for n, k in renamed.items() if k in state}
