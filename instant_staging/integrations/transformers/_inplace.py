"""Step 4 in place: transformers builds the model and the checkpoint's bytes
are written straight into its parameters, where that is provably what its
own conversion of the state dict would make.

transformers 5's ``from_pretrained(None, state_dict=...)`` hands the state
dict to ``core_model_loading.convert_and_load_state_dict_in_model`` once
the model is built on the meta device (its allocator warm-up done).  For
one call (``writing_in_place``: the state dict's identity picks the call;
any other call, in any thread, goes to transformers' function as it is),
that function is ours: ``plan`` maps every checkpoint name as transformers
does (its renamings and converters, the caller's ``key_mapping``, the base
model prefix, the dtype each parameter gets, the device the map gives it),
and where the result is provably the same it makes each parameter and
buffer an empty tensor of that dtype, shape and device, sets it on the
model through transformers' own ``set_param_for_module`` (Parameter or
buffer, ``requires_grad``, the ``_is_hf_initialized`` flag that spares it
the random init), and ``Checkpoint.load_into`` writes every byte into it:
an expert's matrix into its part of the fused parameter
(``_reload._converted_part``), no stacking, no per-tensor call of
transformers.  The loading info and ``_weight_conversions`` are what
transformers' own function makes of them (it is called with no tensors,
once the names were renamed through its transforms); everything after
(moving non-persistent buffers off meta, initialising what is not loaded,
tying, the report) is transformers' own.

Where it is not provably the same, transformers' own function runs on the
state dict of ``Arriving`` tensors, its load started then
(``BackgroundLoad(..., deferred=True)``): a quantizer, a device map over
several devices or the disk, tensor or pipeline parallelism, a checkpoint
name the model lacks (unexpected: its report), a parameter or buffer the
checkpoint lacks other than a tied weight (random init and its report), a
dtype that differs from the parameter's (a cast), a shape that differs (a
mismatch), a conversion other than renaming and fusing experts (a
transpose, a split), experts that are not each there once, in order.  The
model is never left with a weight that is neither read nor transformers'
own.
"""

from __future__ import annotations

import contextlib
import threading

from ._reload import _converted_part, _expert_index

# Off: every call hands transformers the state dict (the route before this
# one; benchmarks/bench_transformers.py times both).
IN_PLACE = True

_lock = threading.Lock()
_calls: dict = {}             # id(state dict) -> the call's handler
_installed: list = []         # [(modeling_utils, transformers' function)] while any call runs


def available(transformers):
    """Whether the route is on (``IN_PLACE``) and this transformers has the
    function it answers and those its plan uses (5.x)."""
    modeling = getattr(transformers, "modeling_utils", None)
    core = getattr(transformers, "core_model_loading", None)
    if core is None:
        try:
            from transformers import core_model_loading as core
        except ImportError:
            return False
    return (IN_PLACE and callable(getattr(modeling, "convert_and_load_state_dict_in_model", None))
            and all(callable(getattr(core, name, None)) for name in
                    ("rename_source_key", "set_param_for_module", "dot_natural_key", "build_glob_alternation",
                     "get_device")))


def may_apply(torch, dtype, layout):
    """False where the headers tell already that ``plan`` will say no (so
    the read need not wait for the model): a floating ``dtype`` that no
    floating tensor of the checkpoint has (every weight a cast)."""
    if not isinstance(dtype, torch.dtype):
        return True            # None, "auto": the config's or the checkpoint's own
    floating = {d for _, d in layout.values() if d.is_floating_point}
    return not floating or dtype in floating


@contextlib.contextmanager
def writing_in_place(transformers, state, handler):
    """``handler(original, model, state_dict, load_config, disk_offload_index)``
    answers transformers' ``convert_and_load_state_dict_in_model`` for the
    call whose state dict is ``state``, while the block runs.  The function
    is replaced while any such block runs, and given back by the last one."""
    modeling = transformers.modeling_utils
    with _lock:
        if not _installed:
            original = modeling.convert_and_load_state_dict_in_model
            _installed.append((modeling, original))

            def dispatch(model, state_dict, load_config, disk_offload_index=None, *args, **kwargs):
                ours = _calls.get(id(state_dict))
                if ours is None or args or kwargs:
                    return original(model, state_dict, load_config, disk_offload_index, *args, **kwargs)
                return ours(original, model, state_dict, load_config, disk_offload_index)
            modeling.convert_and_load_state_dict_in_model = dispatch
        _calls[id(state)] = handler
    try:
        yield
    finally:
        with _lock:
            del _calls[id(state)]
            if not _calls:
                module, original = _installed.pop()
                module.convert_and_load_state_dict_in_model = original


def plan(torch, core, model, layout, load_config):
    """``{checkpoint name: (model key, view or None)}`` and ``{model key:
    (shape, dtype, device)}`` of the parameters and buffers to make, where
    writing the checkpoint into them is what transformers' conversion of the
    same state dict makes; else None (see the module docstring)."""
    if getattr(load_config, "hf_quantizer", None) is not None:
        return None
    if getattr(model, "_pp_stage", None) is not None:
        return None
    device_map = load_config.device_map or {"": "cpu"}
    devices = {str(d) for d in device_map.values()}
    if len(devices) != 1 or "disk" in devices:
        return None
    meta = model.state_dict()
    suffix = torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX
    if any(k.endswith(suffix) or type(t) not in (torch.Tensor, torch.nn.Parameter) for k, t in meta.items()):
        return None                # extra state, a DTensor or another tensor subclass
    transforms = load_config.weight_mapping or []
    renamings = [t for t in transforms if isinstance(t, core.WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, core.WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = model.base_model_prefix
    dtype_plan = load_config.dtype_plan or {}
    if dtype_plan:
        alternation, by_group, _ = core.build_glob_alternation(list(dtype_plan.keys()))
    names, made, fused = {}, {}, {}
    # In transformers' order (its converters stack experts in it).
    for name in sorted(layout, key=core.dot_natural_key):
        shape, dtype = layout[name]
        key, pattern = core.rename_source_key(name, renamings, converters, prefix, meta)
        if key not in meta and name in meta:
            key, pattern = core.rename_source_key(name, [], [], prefix, meta)
        if key not in meta:
            return None            # unexpected
        empty = meta[key]
        target = load_config.dtype   # the dtype transformers casts it to
        found = alternation.search(key) if dtype_plan else None
        if found is not None:
            target = dtype_plan[by_group[found.lastgroup]]
        elif empty.dtype != target:
            target = empty.dtype
        if dtype != target:
            return None            # a cast
        if pattern is None:
            if key in made or tuple(shape) != tuple(empty.shape):
                return None        # two tensors for one parameter; a mismatch
            names[name] = (key, None)
        else:
            converter = by_pattern[pattern]
            if getattr(converter, "quantization_operation", None) is not None:
                return None
            try:
                index = _expert_index(name, pattern)
                view = _converted_part(name, pattern, converter, core, index)
                part_shape = tuple(view(empty).shape)
            except (NotImplementedError, IndexError, RuntimeError):
                return None
            if part_shape != tuple(shape) or (key in made and key not in fused):
                return None
            parts = len(converter.source_patterns) if len(converter.operations) == 2 else 1
            if parts > 1 and empty.shape[1] % parts:
                return None
            part = converter.source_patterns.index(pattern) if parts > 1 else 0
            fused.setdefault(key, (parts, {}))[1].setdefault(part, []).append(index)
            names[name] = (key, view)
        if key not in made:
            device = core.get_device(device_map, key, valid_torch_device=True)
            made[key] = (tuple(empty.shape), target, device)
    for key, (parts, orders) in fused.items():
        # transformers stacks a part's tensors in the order it collected them
        # (the names' natural order): each expert once, in order, is the
        # fused parameter whole, expert e at e.
        experts = list(range(meta[key].shape[0]))
        if sorted(orders) != list(range(parts)) or any(order != experts for order in orders.values()):
            return None
    tied = set(getattr(model, "all_tied_weights_keys", None) or ())
    if set(meta) - set(made) - tied:
        return None                # a weight the checkpoint lacks (transformers initialises it)
    if len({d for _, _, d in made.values()}) > 1:
        return None
    return names, made


def write(torch, core, original, model, load, load_config, disk_offload_index, planned):
    """Makes each parameter and buffer of ``planned`` on its device, sets it
    on the model as transformers' own conversion does, and writes the
    checkpoint into them (``load.load_into``)."""
    names, made = planned
    # transformers' loading info and _weight_conversions: its function given
    # no tensors, once plan() renamed the names through its transforms (which
    # records the ones used).
    info, disk_offload_index = original(model, {}, load_config, disk_offload_index)
    values = {}
    for key, (shape, dtype, device) in made.items():
        values[key] = torch.empty(shape, dtype=dtype, device=device)
        core.set_param_for_module(model, key, values[key], info, None)
    destinations = {}
    for name, (key, view) in names.items():
        destinations[name] = values[key] if view is None else view(values[key])
    values = None
    load.load_into(destinations)
    return info, disk_offload_index
