"""Where the weights go (step 6 of the package's docstring): the one device
of ``device``/``device_map``, or a map transformers resolves (``Spread``),
whose resolved dict starts the read, one load per device (``groups``)."""

from __future__ import annotations

import contextlib
import os
import threading

from ...loader import default_device, import_torch, resolve_device

# transformers' device_map strategies ("auto" too) that it resolves to a dict.
SPREADING = ("balanced", "balanced_low_0", "sequential")


class Spread:
    """A ``device_map`` over several devices, offloading, or a strategy
    ("auto", "balanced", ...): handed to transformers as it is; each tensor
    is read to the device of the map transformers resolves from it
    (``reading_where_mapped``)."""

    __slots__ = ("device_map",)

    def __init__(self, device_map):
        self.device_map = device_map


def target_device(torch, device, device_map, offload_folder=None):
    """The one device of ``device``, or of ``device_map`` where given
    (neither: ``default_device``); a ``Spread`` for a map transformers
    resolves or that names several devices (or "disk").  Every device a
    dict names is checked here, before anything is read."""
    if device_map is None:
        return resolve_device(torch, device if device is not None else default_device())
    if isinstance(device_map, str) and (device_map == "auto" or device_map in SPREADING):
        mapped = Spread(device_map)
    elif isinstance(device_map, dict):
        devices = set()
        for key, d in device_map.items():
            if not isinstance(key, str):
                raise TypeError(f"device_map's keys must be module names (str), not {type(key).__name__}")
            devices.add(d if isinstance(d, str) and d == "disk" else str(resolve_device(torch, d)))
        if not devices:
            raise ValueError("device_map is empty: give it a device for '' (all) or for each module")
        if "disk" in devices and offload_folder is None:
            raise ValueError(f"device_map offloads to the disk ({device_map!r}): pass offload_folder= "
                             "(a directory transformers writes the offloaded weights to)")
        mapped = devices.pop() if len(devices) == 1 and "disk" not in devices else Spread(device_map)
    elif isinstance(device_map, (str, int, torch.device)) and not isinstance(device_map, bool):
        mapped = device_map
    else:
        raise TypeError(f"device_map must be a device, a dict, 'auto', 'balanced', 'balanced_low_0' or "
                        f"'sequential', not {type(device_map).__name__}")
    if isinstance(mapped, Spread):
        if device is not None:
            raise ValueError(f"device={device!r} and device_map={device_map!r}: the map places the model; "
                             "pass one of them")
        return mapped
    mapped = resolve_device(torch, mapped)
    if device is not None and resolve_device(torch, device) != mapped:
        raise ValueError(f"device={device!r} and device_map={device_map!r} name different devices")
    return mapped


@contextlib.contextmanager
def reading_where_mapped(transformers, load, offload_folder):
    """transformers' ``modeling_utils._get_device_map`` wrapped for this call
    (this thread's): the map it resolves (the caller's dict, or what "auto",
    "balanced", ... come to with ``max_memory`` and the model's
    ``_no_split_modules``) starts ``load``, one load per device
    (``groups``), before transformers asks for the first tensor."""
    torch = import_torch()
    modeling = transformers.modeling_utils
    original = modeling._get_device_map
    owner = threading.get_ident()

    def resolving(model, device_map, *args, **kwargs):
        resolved = original(model, device_map, *args, **kwargs)
        if threading.get_ident() != owner or load.started:
            return resolved
        if "disk" in resolved.values() and offload_folder is None:
            raise ValueError(f"device_map={device_map!r} offloads to the disk ({resolved!r}): pass "
                             "offload_folder= (a directory transformers writes the offloaded weights to)")
        load.start(groups(torch, model, resolved, list(load.layout)) or [(torch.device("cpu"), [])])
        return resolved

    modeling._get_device_map = resolving
    try:
        yield
    finally:
        modeling._get_device_map = original


def groups(torch, model, device_map, names):
    """``[(device, [name, ...]), ...]``: each checkpoint name under the device
    of the longest module name of ``device_map`` it is in (tried as it is,
    and with the model's ``base_model_prefix`` added or removed, as
    transformers matches a checkpoint to a model), else ``device_map[""]``;
    "disk" is read to the CPU (transformers writes it to the offload
    folder).  In the order each device first comes; a name transformers
    renames out of reach (``key_mapping``) lands on the default device, and
    transformers moves it: one copy more, never a wrong place."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    keys = sorted((k for k in device_map if k), key=len, reverse=True)
    default = device_map.get("", "cpu")
    devices = {}

    def device_of(value):
        if value not in devices:
            devices[value] = torch.device("cpu") if value == "disk" else resolve_device(torch, value)
        return devices[value]

    def where(name):
        if prefix and name.startswith(prefix + "."):
            candidates = (name, name[len(prefix) + 1:])
        else:
            candidates = (name, f"{prefix}.{name}") if prefix else (name,)
        for candidate in candidates:
            for k in keys:
                if candidate == k or candidate.startswith(k + "."):
                    return device_map[k]
        return default

    by_device = {}
    for name in names:
        by_device.setdefault(device_of(where(name)), []).append(name)
    return list(by_device.items())


def parallel_device(torch, device, device_map):
    """The device of this rank under transformers' tensor parallelism: its
    accelerator LOCAL_RANK where torch sees one, else the CPU (as
    transformers' ``initialize_tensor_parallelism`` places it)."""
    if device is not None or device_map is not None:
        raise ValueError("tensor parallelism (tp_plan, tp_size, device_mesh, distributed_config) places "
                         "each rank's part on the rank's own device (LOCAL_RANK): pass no device or "
                         "device_map (transformers takes no device_map with it either)")
    if torch.cuda.is_available():
        return resolve_device(torch, f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
    return torch.device("cpu")


@contextlib.contextmanager
def offloading_a_state_dict(transformers, cls, spread=True):
    """transformers 4's ``_load_pretrained_model``, for this call, given
    ``checkpoint_files=[""]`` where it gets a state dict and no files (the
    value it sets itself for a state dict): 4.57 sets it only where no
    module goes to the disk, so a state dict under a map with "disk" fails
    (``TypeError: 'NoneType' object is not iterable``).  A class attribute:
    another thread's load of ``cls`` meanwhile gets the same value, which
    its transformers would have set itself.  Nothing to do for one device,
    nor for transformers 5 (another loading)."""
    function = getattr(getattr(cls, "_load_pretrained_model", None), "__func__", None)
    if not spread or not transformers.__version__.startswith("4.") or function is None:
        yield
        return
    own = cls.__dict__.get("_load_pretrained_model")

    def loading(klass, model, state_dict, checkpoint_files, *args, **kwargs):
        if state_dict is not None and checkpoint_files is None:
            checkpoint_files = [""]
        return function(klass, model, state_dict, checkpoint_files, *args, **kwargs)

    cls._load_pretrained_model = classmethod(loading)
    try:
        yield
    finally:
        if own is None:
            del cls._load_pretrained_model
        else:
            cls._load_pretrained_model = own
