"""A ready transformers model, its weights loaded by instant_staging.

    from instant_staging.integrations.transformers import from_pretrained
    model = from_pretrained("Llama-3-8B/", device="cuda:0", dtype=torch.bfloat16)

What transformers' ``from_pretrained(model_dir, dtype=..., device_map=device)``
does for a local safetensors checkpoint, with the weights read by
``instant_staging.loader.iter_load`` straight onto the device:

1. ``model_dir/config.json`` gives the config; the class is ``model_class``
   or the one ``config.architectures`` names (an Auto class is resolved
   through its mapping, as transformers does).
2. The dtype: ``dtype``, or (None or "auto", transformers' default) the
   config's ``dtype``, else the checkpoint's first floating dtype; set as
   torch's default dtype while the model is built, and on the config.
3. The model is built with its parameters on the meta device (nothing is
   allocated or initialised for them) and its buffers made by its own
   ``__init__`` on the CPU: so non-persistent buffers (rotary ``inv_freq``,
   causal masks) hold exactly the values the model computes for itself,
   which is what transformers' own loading re-computes into them.  This
   swaps ``torch.nn.Module.register_parameter`` for the duration of the
   constructor (as accelerate's ``init_empty_weights``): modules built by
   other threads meanwhile would get meta parameters too.
4. Checkpoint names are matched to the model's state-dict keys (adding or
   removing the ``base_model_prefix`` as transformers does).  Before any
   byte is read: a parameter neither in the checkpoint nor tied to one that
   is is a ``KeyError`` naming it; a shape that differs a ``ValueError``;
   checkpoint tensors the model does not have are not read and are logged
   (transformers ignores them too).
5. Each tensor is loaded onto the device and cast there to the dtype
   transformers gives that key (the dtype the model built it with; fp32
   for ``_keep_in_fp32_modules(_strict)``), then assigned to the model
   (``load_state_dict(assign=True)``: no second copy).  ``tie_weights()``
   ties what the config ties; buffers move to the device; ``eval()``.

transformers is an optional dependency: ``pip install
'instant_staging[transformers]'``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
from typing import TYPE_CHECKING, Any

from ..loader._checkpoint import _Checkpoint
from ..loader._load import iter_load
from ..loader._options import torch_dtype
from ..loader._source import resolve
from ..loader._target import _TORCH_DTYPES, _import_torch, _resolve_device
from ..loader._typing import Device, DType, PathLike

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("instant_staging")


def _import_transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError("instant_staging.integrations.transformers needs transformers: "
                          "pip install 'instant_staging[transformers]'") from None
    return transformers


def from_pretrained(model_dir: PathLike, *, device: Device = "cuda:0", dtype: DType = None,
                    model_class: type[Any] | None = None) -> torch.nn.Module:
    """A ready model (eval mode) from the local checkpoint directory ``model_dir``.

    model_dir    a directory with config.json and safetensors weights (one
                 file, shards with model.safetensors.index.json, or shards)
    device       where the weights go: "cuda:N" (default "cuda:0"), "cpu", ...
    dtype        None or "auto" (transformers' default: the config's dtype, else
                 the checkpoint's), or a floating torch dtype (or its name)
    model_class  a transformers model class (or Auto class); None: the class
                 config.json's ``architectures`` names

    Parameters equal those of transformers' own ``from_pretrained`` bit for
    bit.  Errors (before anything is read): KeyError for a missing weight,
    ValueError for a shape mismatch or a bad argument, FileNotFoundError for
    a directory without config.json or weights.
    """
    torch = _import_torch()
    transformers = _import_transformers()
    if not isinstance(model_dir, (str, bytes, os.PathLike)):
        raise TypeError(f"model_dir must be a path, not {type(model_dir).__name__}")
    model_dir = os.fsdecode(os.fspath(model_dir))
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"no such model directory: {model_dir}")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"{model_dir} has no config.json")
    device = _resolve_device(torch, device)
    auto = dtype is None or (isinstance(dtype, str) and dtype == "auto")
    dtype = None if auto else torch_dtype(torch, dtype)
    if model_class is not None and not isinstance(model_class, type):
        raise TypeError(f"model_class must be a class, not {type(model_class).__name__}")

    config = transformers.AutoConfig.from_pretrained(model_dir)
    cls = _model_class(transformers, config, model_class, model_dir)
    source = resolve(model_dir)
    entries = _checkpoint_entries(source.paths)
    if dtype is None:
        dtype = _auto_dtype(torch, config, entries)
    _set_config_dtype(config, dtype)
    config.name_or_path = model_dir

    with _default_dtype(torch, dtype), _parameters_on_meta(torch):
        model = cls(config)
    model.tie_weights()            # on meta: which parameters are one
    expected = model.state_dict(keep_vars=True)
    rename = _match_names(model, expected, entries)
    _check_complete(model, expected, rename, entries, model_dir)
    wanted = _target_dtypes(torch, model, expected, dtype)

    state, tensor = {}, None
    try:
        # model_dir, not the shard list: an index is also checked against its shards
        with iter_load(model_dir, device, names=set(rename)) as it:
            for name, tensor in it:
                key = rename[name]
                if tensor.dtype != wanted[key]:
                    tensor = tensor.to(wanted[key])
                state[key] = tensor
        model.load_state_dict(state, strict=False, assign=True)
        state.clear()
        _tie(model, set(expected) - set(rename.values()))
        still = [n for n, p in model.named_parameters() if p.device.type == "meta"]
        if still:
            raise KeyError(f"{model_dir}: weight(s) missing after loading and tying: "
                           + ", ".join(still[:20]))
    except BaseException:
        # Nothing of a failed load outlives it (a traceback keeps this frame).
        state.clear()
        model = expected = tensor = None
        raise
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)
    model.eval()
    _generation_config(transformers, model, model_dir)
    return model


# -- the steps ----------------------------------------------------------------------

def _model_class(transformers, config, model_class, model_dir):
    if model_class is None:
        names = getattr(config, "architectures", None) or []
        if not names:
            raise ValueError(f"{model_dir}/config.json names no architectures: pass model_class=")
        model_class = getattr(transformers, names[0], None)
        if model_class is None:
            raise ValueError(f"transformers {transformers.__version__} has no class {names[0]!r} "
                             f"(config.json's architectures): pass model_class=")
    mapping = getattr(model_class, "_model_mapping", None)
    if mapping is not None:                      # an Auto class
        try:
            model_class = mapping[type(config)]
        except KeyError:
            raise ValueError(f"{model_class.__name__} has no model for {type(config).__name__}") from None
    return model_class


def _checkpoint_entries(paths):
    """{name: TensorEntry} of every shard, from the headers only."""
    checkpoint = _Checkpoint(paths)
    try:
        return {t.name: t for _, t in checkpoint.entries}
    finally:
        checkpoint.close()


def _auto_dtype(torch, config, entries):
    """transformers' dtype="auto": the config's dtype, else the checkpoint's
    first floating tensor's, else torch's default."""
    for attr in ("dtype", "torch_dtype"):
        value = getattr(config, attr, None)
        if isinstance(value, str) and value != "auto":
            value = getattr(torch, value, None)
        if isinstance(value, torch.dtype):
            return value
    for name in sorted(entries):
        t = getattr(torch, _TORCH_DTYPES[entries[name].dtype], None)
        if t is not None and t.is_floating_point:
            return t
    return torch.get_default_dtype()


def _set_config_dtype(config, dtype):
    # As transformers' from_pretrained: on the config and its sub-configs.
    configs = [config] + [getattr(config, k, None) for k in getattr(config, "sub_configs", {}) or {}]
    for c in configs:
        if c is None:
            continue
        try:
            c.dtype = dtype
        except AttributeError:
            c.torch_dtype = dtype


@contextlib.contextmanager
def _default_dtype(torch, dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@contextlib.contextmanager
def _parameters_on_meta(torch):
    """Every parameter registered meanwhile is moved to the meta device;
    buffers stay real (their values are the model's own)."""
    module_cls = torch.nn.Module
    original = module_cls.register_parameter

    def register_parameter(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            param = module._parameters[name]
            kwargs = dict(param.__dict__)
            kwargs["requires_grad"] = param.requires_grad
            module._parameters[name] = type(param)(param.to("meta"), **kwargs)

    module_cls.register_parameter = register_parameter
    try:
        yield
    finally:
        module_cls.register_parameter = original


def _match_names(model, expected, entries):
    """{checkpoint name: state-dict key} for the names the model takes."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    rename = {}
    for name in entries:
        if name in expected:
            rename[name] = name
        elif prefix and f"{prefix}.{name}" in expected:
            rename[name] = f"{prefix}.{name}"
        elif prefix and name.startswith(prefix + ".") and name[len(prefix) + 1:] in expected:
            rename[name] = name[len(prefix) + 1:]
    unexpected = [n for n in entries if n not in rename]
    ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    unexpected = [n for n in unexpected if not any(p.search(n) for p in ignore)]
    if unexpected:
        logger.warning("%d checkpoint tensor(s) are not used by %s and were not read: %s",
                       len(unexpected), type(model).__name__,
                       ", ".join(unexpected[:20]) + (" ..." if len(unexpected) > 20 else ""))
    return rename


def _check_complete(model, expected, rename, entries, model_dir):
    """Every parameter loaded or tied to a loaded one; shapes equal."""
    loaded = set(rename.values())
    groups = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    missing = [n for names in groups.values() if not loaded.intersection(names) for n in names]
    if missing:
        raise KeyError(f"{model_dir}: {len(missing)} weight(s) of {type(model).__name__} are not in "
                       f"the checkpoint: " + ", ".join(missing[:20]) + (" ..." if len(missing) > 20 else ""))
    wrong = [f"{key} (checkpoint {list(entries[name].shape)}, model {list(expected[key].shape)})"
             for name, key in rename.items() if tuple(entries[name].shape) != tuple(expected[key].shape)]
    if wrong:
        raise ValueError(f"{model_dir}: shape mismatch for " + ", ".join(wrong[:20]))


def _target_dtypes(torch, model, expected, dtype):
    """The dtype transformers gives each key: the one the model built it
    with, or fp32 for the modules it keeps in fp32 at this dtype."""
    keep = set()
    if dtype == torch.float16:
        keep.update(getattr(model, "_keep_in_fp32_modules", None) or [])
    if dtype in (torch.float16, torch.bfloat16):
        keep.update(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    patterns = [re.compile(rf"(^|\.){re.escape(m)}(\.|$)") for m in keep]
    return {key: torch.float32 if t.is_floating_point() and any(p.search(key) for p in patterns)
            else t.dtype for key, t in expected.items()}


def _tie(model, missing):
    """transformers' tying; told which keys the checkpoint lacked where it
    takes them (transformers 5 ties symmetrically then)."""
    if "missing_keys" in inspect.signature(model.tie_weights).parameters:
        model.tie_weights(missing_keys=set(missing))
    else:                                        # transformers 4
        model.tie_weights()


def _generation_config(transformers, model, model_dir):
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path) and getattr(model, "generation_config", None) is not None:
        model.generation_config = transformers.GenerationConfig.from_pretrained(model_dir)


__all__ = ["from_pretrained"]
