"""A ready transformers model, its weights read by instant_staging.

    from instant_staging.integrations.transformers import from_pretrained
    model = from_pretrained("Llama-3-8B/", device="cuda:0", dtype=torch.bfloat16)
    model = from_pretrained("meta-llama/Meta-Llama-3-8B", device_map="auto", torch_dtype="auto")

The contract: what transformers' ``from_pretrained`` returns for the same
checkpoint and arguments (class, parameters, buffers, tying, dtypes, config,
generation config, eval mode), with the safetensors bytes read by
``instant_staging.loader.Checkpoint`` straight onto the device the
``device_map`` gives each tensor (step 6), for
every transformers the package declares (4.56 and newer: ``_Arriving``
stands in for what each one's loader reads).  Only the reading is ours;
everything else is transformers' own machinery:

1. ``model_dir`` is a local directory, or a hub id resolved through
   ``huggingface_hub.snapshot_download`` (its cache; with
   ``HF_HUB_OFFLINE=1`` or ``local_files_only=True`` nothing is fetched;
   of the weights, only the files step 3 reads: ``_hub.snapshot``), and
   ``subfolder`` inside it.
2. The config is what the Auto class makes of it (``_config``):
   ``AutoConfig.from_pretrained`` with the caller's other keyword arguments,
   those that are attributes of the config overriding it
   (``num_hidden_layers=1``), the rest handed on to the model's
   ``from_pretrained`` (which gives what it does not take to the model's
   ``__init__``, as it does); or the caller's ``config=`` (an object, or a
   path).  The class is ``model_class``, else the one
   ``config.architectures`` names (remote code through transformers'
   ``get_class_from_dynamic_module``), else, for a config without
   ``architectures``, the one ``AutoModelForCausalLM`` maps its type to (as
   the Auto class does).  An Auto class as ``model_class`` is resolved the
   same way.
3. ``Checkpoint.open(weights).iter_load(device)`` (``_hub.weights``: the files
   transformers would read there, ``variant`` included; their headers parsed
   once, for the layout and the load) reads every tensor in the file's dtype
   onto the device (one read of each byte, no host copy), in a thread of
   its own (``_BackgroundLoad``), while
4. ``cls.from_pretrained(None, config=..., state_dict=..., dtype=...,
   device_map={"": device}, ...)`` runs: transformers builds the model on
   the meta device and maps the tensors in: its key renaming
   (``key_mapping`` too), the fusing of per-expert MoE tensors (its
   conversion mapping, transformers 5), ``dtype`` and
   ``_keep_in_fp32_modules``, quantizers, tied weights, non-persistent
   buffers, tensor parallelism (``tp_plan``: it shards what we read).  The
   state dict holds ``_Arriving`` values where transformers' own loading
   holds safetensors slices (``t[...]`` materialises one; transformers 4,
   given a state dict, asks ``t.to(device)`` instead): each waits for its
   tensor, so building the model on the meta device overlaps the read
   instead of following it (docs/design.md, "Measured: building the model
   while reading").  A tensor already on its device in its dtype is assigned,
   not copied (``core_model_loading._materialize_copy``: ``t[...]`` and a
   ``.to()`` that is a no-op).  Its allocator warm-up is skipped for this
   call (``_no_allocator_warmup``): every tensor gets its own allocation
   from the load, so the warm-up could only reserve a second model-sized
   block on the GPU (2x the peak memory, an OOM for a model over half the
   device).  With a quantization config the whole checkpoint is read first
   and real tensors handed over (quantizers read them in ways of their own).
5. A weight the model has and the checkpoint lacks is a ``KeyError`` naming
   it (transformers would initialise it randomly and warn), unless the
   caller asked ``output_loading_info=True``: then, as transformers, the
   model and its loading info (missing, unexpected, mismatched keys) are
   returned.  A read that fails raises its ``LoadError`` (transformers
   would log it as a conversion error and go on), nothing of the model kept.

Every keyword argument transformers' ``from_pretrained`` takes is taken,
with its meaning: the hub's (``revision``, ``cache_dir``, ``token``,
``local_files_only``, ``force_download``, ``subfolder``, ...) resolve
``model_dir`` here; ``dtype``/``torch_dtype`` and ``device_map`` (step 6)
choose the load's; the rest go to transformers (``low_cpu_mem_usage``,
``max_memory``, ``offload_folder``, ``offload_buffers``,
``output_loading_info``, ``key_mapping``, ``tp_plan``,
``attn_implementation``, ``quantization_config``, ...).  Those that ask
for weights this loader does not read (``use_safetensors=False``,
``from_tf``, ``gguf_file``, ``state_dict``, PEFT ``adapter_kwargs``) are a
``ValueError`` naming them, before anything is read.

6. ``device_map``: a device or a dict whose modules all name one device is
   the one-device load above (``{"": device}``; the CPU gets no map, as
   transformers' default).  Any other map (modules over several devices,
   "cpu"/"disk" offload, "auto", "balanced", "balanced_low_0",
   "sequential") is handed to transformers as given, and the map its
   ``modeling_utils._get_device_map`` resolves (the dict, or what a strategy
   comes to with ``max_memory`` and the model's ``_no_split_modules``: its
   own machinery, wrapped for this call, ``_reading_where_mapped``) starts
   the read once the model is built on meta, before transformers asks for
   a tensor: the checkpoint's names grouped by the device of the module
   each is in (``_groups``: "disk" ones to the CPU, where transformers
   writes them to ``offload_folder``, required then as transformers 4 and
   5 require it for a state dict), one ``iter_load(device, names=...)`` per
   device, in turn, of the one ``Checkpoint``.  accelerate then dispatches
   the model as for transformers' own (``hf_device_map``, hooks).  A dict's
   devices are checked before anything is read (an absent ``cuda:1`` is a
   ValueError naming it).

transformers is an optional dependency: ``pip install
'instant_staging[transformers]'`` (with accelerate, which transformers
needs for a GPU ``device_map``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import threading
import time
import traceback
import weakref
from typing import TYPE_CHECKING, Any, Literal, overload

from .. import _hub
from ..loader import (
    TORCH_DTYPES,
    Checkpoint,
    Device,
    DType,
    PathLike,
    default_device,
    fetch_side_files,
    is_url,
    load_file,
)
from ..loader import import_torch as _import_torch
from ..loader import resolve_device as _resolve_device
from ..loader import torch_dtype as _check_dtype

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger("instant_staging")

# The Auto class whose mapping a config without `architectures` goes through.
DEFAULT_AUTO_CLASS = "AutoModelForCausalLM"
# transformers' device_map strategies ("auto" too) that it resolves to a dict.
SPREADING = ("balanced", "balanced_low_0", "sequential")
# transformers' arguments asking for weights this loader does not read: a
# ValueError where one is given (a true or non-empty value), saying what.
NOT_READ_HERE = {
    "state_dict": "a state dict you hold (transformers' own from_pretrained(None, state_dict=...) takes it)",
    "gguf_file": "a GGUF file",
    "from_tf": "TensorFlow weights",
    "from_flax": "Flax weights",
    "adapter_kwargs": "a PEFT adapter",
}
# Hub arguments beside the named ones: used to resolve a hub id here (no
# more once it is a local directory, as for transformers).
HUB_ARGUMENTS = ("proxies", "resume_download", "use_auth_token", "_commit_hash", "code_revision")
# transformers' tensor parallelism: each rank's device is its own (LOCAL_RANK).
TENSOR_PARALLEL = ("tp_plan", "tp_size", "device_mesh", "distributed_config")
# transformers 4's quantization switches (a quantization config in 5).
QUANTIZING = ("quantization_config", "load_in_8bit", "load_in_4bit")


def _import_transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError("instant_staging.integrations.transformers needs transformers: "
                          "pip install 'instant_staging[transformers]'") from None
    return transformers


@overload
def from_pretrained(model_dir: PathLike, *, device: Device | None = ..., dtype: DType = ...,
                    model_class: type[Any] | None = ..., device_map: Any = ...,
                    torch_dtype: DType = ..., config: Any = ..., revision: str | None = ...,
                    subfolder: str = ..., variant: str | None = ..., use_safetensors: bool | None = ...,
                    trust_remote_code: bool = ..., cache_dir: PathLike | None = ...,
                    token: str | bool | None = ..., local_files_only: bool = ...,
                    force_download: bool = ..., output_loading_info: Literal[False] = ...,
                    storage_options: dict[str, Any] | None = ..., **kwargs: Any) -> PreTrainedModel: ...


@overload
def from_pretrained(model_dir: PathLike, *, device: Device | None = ..., dtype: DType = ...,
                    model_class: type[Any] | None = ..., device_map: Any = ...,
                    torch_dtype: DType = ..., config: Any = ..., revision: str | None = ...,
                    subfolder: str = ..., variant: str | None = ..., use_safetensors: bool | None = ...,
                    trust_remote_code: bool = ..., cache_dir: PathLike | None = ...,
                    token: str | bool | None = ..., local_files_only: bool = ...,
                    force_download: bool = ..., output_loading_info: Literal[True],
                    storage_options: dict[str, Any] | None = ...,
                    **kwargs: Any) -> tuple[PreTrainedModel, dict[str, Any]]: ...


def from_pretrained(model_dir: PathLike, *, device: Device | None = None, dtype: DType = None,
                    model_class: type[Any] | None = None, device_map: Any = None,
                    torch_dtype: DType = None, config: Any = None, revision: str | None = None,
                    subfolder: str = "", variant: str | None = None, use_safetensors: bool | None = None,
                    trust_remote_code: bool = False, cache_dir: PathLike | None = None,
                    token: str | bool | None = None, local_files_only: bool = False,
                    force_download: bool = False, output_loading_info: bool = False,
                    storage_options: dict[str, Any] | None = None,
                    **kwargs: Any) -> PreTrainedModel | tuple[PreTrainedModel, dict[str, Any]]:
    """A ready model (eval mode): transformers' ``from_pretrained`` with the
    weights read by instant_staging.

    The ValueError and FileNotFoundError of Raises come before anything is
    read.

    Args:
        model_dir: a local directory (config.json and safetensors weights:
            one file, shards with model.safetensors.index.json, or shards), a
            hub id (resolved through huggingface_hub's cache), or a URL
            prefix (s3://bucket/model/, gs://, az://, https://: its config
            and tokenizer files are fetched to a local cache directory, its
            weights streamed from the bucket; ``storage_options`` as
            ``load_file``'s).
        device: where the weights go: "cuda:N", "cpu", ...; None (default):
            the current CUDA device where torch sees one, else the CPU.
        dtype: None (transformers' default: 5 takes "auto", 4 float32),
            "auto" (the config's dtype, else the checkpoint's), or a floating
            torch dtype (or its name).
        model_class: a transformers model class or Auto class; None: the
            class config.json's ``architectures`` names, else
            AutoModelForCausalLM's for the config's model_type.
        device_map: as transformers': a device, {"": device}, {module: device
            or "cpu" or "disk"}, "auto", "balanced", "balanced_low_0",
            "sequential" (with ``max_memory``, ``offload_folder``,
            ``offload_buffers`` as transformers'); overrides ``device`` (a map
            over several devices with a ``device`` is an error).
        torch_dtype: an alias of ``dtype``.
        config: a config object (used as it is), or the path or hub id of
            one.
        revision, subfolder, variant, trust_remote_code, cache_dir, token,
            local_files_only, force_download, use_safetensors (None or True):
            as transformers' (the hub ones matter for a hub id).
        output_loading_info: True: ``(model, info)``, info as transformers'
            (its missing, unexpected and mismatched keys; a missing weight is
            then no error).
        storage_options: for a URL prefix, as ``load_file``'s.
        **kwargs: as transformers takes them: config attributes override the
            config's (``num_hidden_layers=1``); the rest
            (``attn_implementation``, ``quantization_config``,
            ``key_mapping``, ``tp_plan``, ``low_cpu_mem_usage``, ...) go to
            transformers' ``from_pretrained``.

    Returns:
        The model in eval mode; with ``output_loading_info``, ``(model,
        info)``.

    Raises:
        ValueError: a bad value; an argument asking for weights that are not
            safetensors ones (``use_safetensors=False``, ``from_tf``,
            ``gguf_file``, ``state_dict``); a device_map naming a device
            torch lacks; offloading to the disk without ``offload_folder``.
        FileNotFoundError: a directory without config.json or weights.
        KeyError: a weight missing from the checkpoint (naming it).
    """
    torch = _import_torch()
    transformers = _import_transformers()
    _refuse_what_is_not_read_here(kwargs, use_safetensors)
    hub = _hub_arguments(kwargs, token=token, local_files_only=local_files_only,
                         force_download=force_download)
    code_revision = kwargs.get("code_revision")
    for name in HUB_ARGUMENTS:
        kwargs.pop(name, None)
    if not isinstance(subfolder, str):
        raise TypeError(f"subfolder must be a str, not {type(subfolder).__name__}")
    if variant is not None and not isinstance(variant, str):
        raise TypeError(f"variant must be a str, not {type(variant).__name__}")
    given_config = config is not None
    given = model_dir
    weights_from = None
    if is_url(model_dir):
        if subfolder:
            model_dir = model_dir.rstrip("/") + "/" + subfolder.strip("/")
        model_dir, weights_from = _remote_dir(model_dir, cache_dir, storage_options, given_config)
    elif storage_options is not None:
        raise ValueError("storage_options apply to a URL model_dir (s3://, gs://, az://, https://)")
    else:
        model_dir = _hub.local_dir(model_dir, revision=revision, cache_dir=cache_dir, subfolder=subfolder,
                                   variant=variant, needs_config=not given_config, **hub)
    weights = _Weights(model_dir, weights_from, storage_options, variant)
    parallel = any(kwargs.get(name) is not None for name in TENSOR_PARALLEL)
    if parallel:
        device = _parallel_device(torch, device, device_map)
    else:
        device = _target_device(torch, device, device_map, kwargs.get("offload_folder"))
    dtype = _one_dtype(torch, dtype, torch_dtype)
    if model_class is not None and not isinstance(model_class, type):
        raise TypeError(f"model_class must be a class, not {type(model_class).__name__}")
    if not isinstance(trust_remote_code, bool):
        raise TypeError(f"trust_remote_code must be a bool, not {type(trust_remote_code).__name__}")

    config, kwargs = _config(transformers, config, model_dir, kwargs, dtype=dtype,
                             trust_remote_code=trust_remote_code, code_revision=code_revision,
                             revision=revision, cache_dir=cache_dir, subfolder=subfolder, hub=hub)
    cls = _model_class(transformers, config, model_class, model_dir, trust_remote_code, code_revision)
    generation = os.path.join(model_dir, "generation_config.json")
    if kwargs.get("generation_config") is None and os.path.isfile(generation):
        kwargs["generation_config"] = transformers.GenerationConfig.from_pretrained(model_dir)
    # transformers needs accelerate for any device_map; on the CPU none is
    # needed (its default places everything there, and a .to("cpu") of a CPU
    # tensor is a no-op).  Tensor parallelism places each rank's part itself.
    # A map transformers resolves is its own: where it needs accelerate (to
    # dispatch over several devices) it says so, before our read starts.
    spread = isinstance(device, _Spread)
    if spread:
        kwargs["device_map"] = device.device_map
    elif not parallel and device.type != "cpu":
        kwargs["device_map"] = {"": device}
        if not transformers.utils.is_accelerate_available():
            raise ImportError(f"loading onto {device} needs accelerate (transformers' device_map does): "
                              "pip install accelerate, or 'instant_staging[transformers]'")
    if spread and getattr(transformers.modeling_utils, "_get_device_map", None) is None:
        raise ValueError(f"device_map={device.device_map!r}: transformers {transformers.__version__} "
                         "resolves its device_map in a way this loader does not know (no "
                         "modeling_utils._get_device_map): pass one device, or load with transformers' "
                         "own from_pretrained")
    if dtype is not None:
        kwargs["dtype"] = dtype
    kwargs.update(config=config, output_loading_info=True, trust_remote_code=trust_remote_code)
    t0 = time.perf_counter()
    quantized = getattr(config, "quantization_config", None) is not None
    if quantized or any(kwargs.get(name) for name in QUANTIZING):
        # Quantizers read tensors in ways of their own: hand them real ones.
        # (over several devices: on the CPU, transformers places them)
        state = load_file(weights.source, "cpu" if spread else device,
                          storage_options=weights.storage_options)
        try:
            with _no_allocator_warmup(transformers):
                model, info = cls.from_pretrained(None, state_dict=state, **kwargs)
        finally:
            state.clear()      # the model holds what it took; nothing else outlives the call
    else:
        model, info = _assemble_while_reading(transformers, cls, weights, device, kwargs)
    t1 = time.perf_counter()
    missing = sorted(info.get("missing_keys") or ())
    if missing and not output_loading_info:
        name, model = type(model).__name__, None       # not kept alive by the traceback
        raise KeyError(f"{model_dir}: {len(missing)} weight(s) of {name} are not in the checkpoint: "
                       + ", ".join(missing[:20]) + (" ..." if len(missing) > 20 else ""))
    _set_name_or_path(model, os.fsdecode(os.fspath(given)))
    logger.info("from_pretrained %s: %s in %.3f s", model_dir, type(model).__name__, t1 - t0)
    return (model, info) if output_loading_info else model


# -- the steps ----------------------------------------------------------------------

def _assemble_while_reading(transformers, cls, weights, device, kwargs):
    """transformers' from_pretrained on a state dict whose tensors are still
    being read (``_Arriving``): it builds the model on meta while the load
    runs, and takes each tensor as it arrives.  A failed read raises its
    LoadError (transformers would log it as a conversion error and go on).
    Over several devices (``_Spread``) the load starts once transformers has
    resolved the map (``_reading_where_mapped``), one load per device."""
    spread = isinstance(device, _Spread)
    load = _BackgroundLoad(weights.source, None if spread else device, weights.storage_options)
    model = info = None
    try:
        state = {name: _Arriving(load, name, shape, dtype) for name, (shape, dtype) in load.layout.items()}
        placing = (_reading_where_mapped(transformers, load, kwargs.get("offload_folder")) if spread
                   else contextlib.nullcontext())
        with _no_allocator_warmup(transformers), placing:
            model, info = cls.from_pretrained(None, state_dict=state, **kwargs)
        state.clear()
        load.finish()
    except BaseException as e:
        failed = load.error            # the read's own failure, not the cancel that close() causes
        load.close()
        model = info = state = None
        # The traceback's frames would keep the tensors read so far alive.
        traceback.clear_frames(e.__traceback__)
        if failed is not None and e is not failed and not isinstance(e, KeyboardInterrupt):
            raise failed from None
        raise
    return model, info


class _BackgroundLoad:
    """One ``Checkpoint``'s loads, ``iter_load(device, names=...)`` for each
    group of ``start``'s in turn, consumed by a thread of its own into
    ``{name: tensor}``; ``wait(name)`` blocks until that tensor is there.
    The headers are read (and checked) in the caller's thread, at once, and
    once: the layout and the loads come from one ``Checkpoint``.  Given a
    device, the one load starts at once; else at ``start`` (a device_map
    transformers resolves first)."""

    def __init__(self, source, device=None, storage_options=None):
        self.error = None
        self._tensors = {}
        # Handed out once (wait() drops ours): where transformers converts a
        # tensor (dtype=) it keeps only its copy, and ours would otherwise
        # stay on the device beside the model until the call ends (2x an fp16
        # checkpoint loaded as bf16).  A second ask gets it while it lives.
        self._handed = {}
        self._done = False
        self._cancelled = False
        self._cond = threading.Condition()
        self._it = self._thread = None
        self._rest = []
        # (where each tensor goes is the map's, known at start())
        self.placed = device is None
        self._checkpoint = Checkpoint.open(source, storage_options=storage_options)
        try:
            self.layout = _layout(self._checkpoint)
            if device is not None:
                self.start([(device, None)])
        except BaseException:
            self._checkpoint.close()
            raise

    @property
    def started(self):
        return self._thread is not None

    def start(self, groups):
        """Loads each ``(device, names)`` of ``groups`` in turn (names None:
        all), the first one made here (its errors are the caller's)."""
        if self._thread is not None:
            raise RuntimeError("the load has started already")
        self._rest = list(groups)
        self._next_load()
        self._thread = threading.Thread(target=self._run, name="instant_staging-from_pretrained",
                                        daemon=True)
        self._thread.start()

    def _run(self):
        try:
            while True:
                for name, tensor in self._it:
                    with self._cond:
                        self._tensors[name] = tensor
                        self._cond.notify_all()
                    tensor = None
                with self._cond:
                    if self._cancelled or not self._rest:
                        break
                    self._next_load()
        except BaseException as e:
            with self._cond:
                self.error = e
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def _next_load(self):
        """Starts the load of the next group; the handle is closed with the
        last one (closing it leaves the files to the load, which holds them)."""
        device, names = self._rest.pop(0)
        try:
            self._it = self._checkpoint.iter_load(device, names=names)
        finally:
            if not self._rest:
                self._checkpoint.close()

    def wait(self, name):
        with self._cond:
            while name not in self._tensors:
                handed = self._handed.get(name)
                tensor = handed() if handed is not None else None
                if tensor is not None:
                    return tensor
                if handed is not None:
                    raise RuntimeError(f"{name} was asked for again after transformers dropped it")
                if self.error is not None:
                    raise self.error
                if self._done:
                    raise KeyError(f"{name} was not loaded")
                if self._thread is None:
                    raise RuntimeError(f"transformers asked for {name} before it resolved its device_map "
                                       "(modeling_utils._get_device_map), so this loader knows no device "
                                       "for it: pass one device")
                self._cond.wait()
            tensor = self._tensors.pop(name)
            self._handed[name] = weakref.ref(tensor)
            return tensor

    def finish(self):
        """Waits for the loads; raises their error; drops our references."""
        self._join_and_drop()
        if self.error is not None:
            raise self.error

    def close(self):
        """Cancels the load (from this thread: LoadIterator.close may come
        from any thread), joins the consumer, drops every tensor."""
        with self._cond:
            self._cancelled = True
            it = self._it
        if it is not None:
            it.close()
        self._join_and_drop()

    def _join_and_drop(self):
        if self._thread is not None:
            self._thread.join()
        self._checkpoint.close()
        with self._cond:
            self._tensors.clear()
            self._handed.clear()


class _Arriving:
    """A checkpoint tensor still being read, standing where transformers'
    own loading puts a safetensors slice (``safe_open(...).get_slice(k)``):
    ``t[...]`` is the tensor (it waits for it), a narrower index a tensor of
    its own as a slice's (a tensor-parallel rank's part does not keep the
    whole alive); ``t.to(device)``, what transformers 4 asks of a state
    dict's value, the tensor moved there (the tensor itself when it is
    there).  Shape, dtype, and what else a meta tensor tells, come from the
    header."""

    __slots__ = ("_load", "dtype", "name", "shape")

    def __init__(self, load, name, shape, dtype):
        self._load, self.name, self.shape, self.dtype = load, name, shape, dtype

    def get_shape(self):
        return list(self.shape)

    def is_floating_point(self):
        return self.dtype.is_floating_point

    # What transformers 4's tensor parallelism asks of the meta tensor it
    # takes a state dict's value for (the layout, from the header).
    def dim(self):
        return len(self.shape)

    def size(self, dim=None):
        return self.shape if dim is None else self.shape[dim]

    def stride(self, dim=None):
        strides, step = [], 1
        for n in reversed(self.shape):
            strides.append(step)
            step *= n
        strides = tuple(reversed(strides))
        return strides if dim is None else strides[dim]

    def __getitem__(self, index):
        tensor = self._load.wait(self.name)
        part = tensor[index]
        return part if part.numel() == tensor.numel() else part.clone()

    def to(self, *args, **kwargs):
        tensor = self._load.wait(self.name)
        # Under a map transformers resolved (``_BackgroundLoad.placed``),
        # transformers 4 asks a device-only .to() of every value: the map's
        # "" entry, else the CPU ("disk" where the map is {"": "disk"}),
        # where its own loading has safe_open read, before it moves the
        # tensor to its module's device.  Ours was read there already (a
        # "disk" one to the CPU): as read, not a round trip through the CPU.
        if self._load.placed and len(args) + len(kwargs) == 1 and (
                (args and _is_device(args[0])) or _is_device(kwargs.get("device"))):
            return tensor
        return tensor.to(*args, **kwargs)


def _is_device(value):
    torch = _import_torch()
    return (isinstance(value, (str, torch.device)) or
            (isinstance(value, int) and not isinstance(value, bool)))


def _layout(checkpoint):
    """{name: (torch.Size, torch dtype)} of every shard, from the headers:
    shard by shard, each one's names sorted (as safetensors lists them)."""
    torch = _import_torch()
    infos = [checkpoint.info(name) for name in checkpoint.names()]
    order = {path: i for i, path in enumerate(checkpoint.files)}
    infos.sort(key=lambda t: (order[t.file], t.name))
    return {t.name: (torch.Size(t.shape), getattr(torch, TORCH_DTYPES[t.dtype])) for t in infos}


def _refuse_what_is_not_read_here(kwargs, use_safetensors):
    """A ValueError for an argument asking for weights this loader does not
    read (``NOT_READ_HERE``, ``use_safetensors=False``); such arguments given
    as None, False or empty are dropped (transformers 5 ignores from_tf)."""
    if use_safetensors is not None and not isinstance(use_safetensors, bool):
        raise TypeError(f"use_safetensors must be None or a bool, not {type(use_safetensors).__name__}")
    if use_safetensors is False:
        raise ValueError("use_safetensors=False asks for weights that are not safetensors files "
                         "(pytorch_model.bin): this loader reads safetensors only; load those with "
                         "transformers' own from_pretrained")
    for name, what in NOT_READ_HERE.items():
        value = kwargs.pop(name, None)
        if value is None or value is False or (name == "adapter_kwargs" and not value):
            continue
        raise ValueError(f"{name}= asks for {what}: this loader reads a checkpoint's safetensors "
                         "weights only; load it with transformers' own from_pretrained")


def _hub_arguments(kwargs, *, token, local_files_only, force_download):
    """The arguments of ``snapshot_download`` for a hub id: the named ones,
    ``use_auth_token`` (transformers 4's name of ``token``) and ``proxies``
    where this huggingface_hub still takes them."""
    alias = kwargs.get("use_auth_token")
    if alias is not None:
        if token is not None:
            raise ValueError("token and use_auth_token are both given: pass token")
        token = alias
    hub = {"token": token, "local_files_only": local_files_only}
    if force_download:
        hub["force_download"] = True
    proxies = kwargs.get("proxies")
    if proxies is not None:
        from huggingface_hub import snapshot_download
        if "proxies" in inspect.signature(snapshot_download).parameters:
            hub["proxies"] = proxies
        else:
            logger.warning("proxies= is not taken by this huggingface_hub (1.0 and newer): set "
                           "HTTPS_PROXY instead")
    return hub


class _Weights:
    """Where the weights of a model come from: ``_hub.weights(model_dir)`` for a
    local one; for a URL one the same rule over the names its prefix holds
    (``fetch_side_files`` fetched the index and config beside them)."""

    def __init__(self, model_dir, remote, storage_options, variant=None):
        self.storage_options = storage_options
        if remote is None:
            self.source = _hub.weights(model_dir, variant)
            return
        url, names = remote
        self.source = url
        for name in _hub.weight_names(variant):
            if name in names:
                self.source = url + name
                break
        else:
            if variant is not None:
                raise FileNotFoundError(f"{url} has no {' or '.join(_hub.weight_names(variant))} "
                                        f"(variant={variant!r})")


def _remote_dir(url, cache_dir, storage_options, given_config=False):
    """``(local directory, (URL prefix, its object names))`` of a URL model: its
    config and tokenizer files fetched to ``cache_dir`` (default
    ~/.cache/instant_staging/remote), under a name of the URL's own."""
    import hashlib
    url = url.rstrip("/") + "/"
    root = os.fspath(cache_dir) if cache_dir is not None else os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "instant_staging", "remote")
    local = os.path.join(root, hashlib.sha256(url.encode()).hexdigest()[:24])
    names = fetch_side_files(url, local, storage_options)
    if "config.json" not in names and not given_config:
        raise FileNotFoundError(f"{url} has no config.json")
    return local, (url, set(names))


class _Spread:
    """A ``device_map`` over several devices, offloading, or a strategy
    ("auto", "balanced", ...): handed to transformers as it is; each tensor
    is read to the device of the map transformers resolves from it
    (``_reading_where_mapped``)."""

    __slots__ = ("device_map",)

    def __init__(self, device_map):
        self.device_map = device_map


def _target_device(torch, device, device_map, offload_folder=None):
    """The one device of ``device``, or of ``device_map`` where given
    (neither: ``default_device``); a ``_Spread`` for a map transformers
    resolves or that names several devices (or "disk").  Every device a
    dict names is checked here, before anything is read."""
    if device_map is None:
        return _resolve_device(torch, device if device is not None else default_device())
    if isinstance(device_map, str) and (device_map == "auto" or device_map in SPREADING):
        mapped = _Spread(device_map)
    elif isinstance(device_map, dict):
        devices = set()
        for key, d in device_map.items():
            if not isinstance(key, str):
                raise TypeError(f"device_map's keys must be module names (str), not {type(key).__name__}")
            devices.add(d if isinstance(d, str) and d == "disk" else str(_resolve_device(torch, d)))
        if not devices:
            raise ValueError("device_map is empty: give it a device for '' (all) or for each module")
        if "disk" in devices and offload_folder is None:
            raise ValueError(f"device_map offloads to the disk ({device_map!r}): pass offload_folder= "
                             "(a directory transformers writes the offloaded weights to)")
        mapped = devices.pop() if len(devices) == 1 and "disk" not in devices else _Spread(device_map)
    elif isinstance(device_map, (str, int, torch.device)) and not isinstance(device_map, bool):
        mapped = device_map
    else:
        raise TypeError(f"device_map must be a device, a dict, 'auto', 'balanced', 'balanced_low_0' or "
                        f"'sequential', not {type(device_map).__name__}")
    if isinstance(mapped, _Spread):
        if device is not None:
            raise ValueError(f"device={device!r} and device_map={device_map!r}: the map places the model; "
                             "pass one of them")
        return mapped
    mapped = _resolve_device(torch, mapped)
    if device is not None and _resolve_device(torch, device) != mapped:
        raise ValueError(f"device={device!r} and device_map={device_map!r} name different devices")
    return mapped


@contextlib.contextmanager
def _reading_where_mapped(transformers, load, offload_folder):
    """transformers' ``modeling_utils._get_device_map`` wrapped for this call
    (this thread's): the map it resolves (the caller's dict, or what "auto",
    "balanced", ... come to with ``max_memory`` and the model's
    ``_no_split_modules``) starts ``load``, one load per device
    (``_groups``), before transformers asks for the first tensor."""
    torch = _import_torch()
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
        load.start(_groups(torch, model, resolved, list(load.layout)) or [(torch.device("cpu"), [])])
        return resolved

    modeling._get_device_map = resolving
    try:
        yield
    finally:
        modeling._get_device_map = original


def _groups(torch, model, device_map, names):
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
            devices[value] = torch.device("cpu") if value == "disk" else _resolve_device(torch, value)
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

    groups = {}
    for name in names:
        groups.setdefault(device_of(where(name)), []).append(name)
    return list(groups.items())


def _parallel_device(torch, device, device_map):
    """The device of this rank under transformers' tensor parallelism: its
    accelerator LOCAL_RANK where torch sees one, else the CPU (as
    transformers' ``initialize_tensor_parallelism`` places it)."""
    if device is not None or device_map is not None:
        raise ValueError("tensor parallelism (tp_plan, tp_size, device_mesh, distributed_config) places "
                         "each rank's part on the rank's own device (LOCAL_RANK): pass no device or "
                         "device_map (transformers takes no device_map with it either)")
    if torch.cuda.is_available():
        return _resolve_device(torch, f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
    return torch.device("cpu")


def _one_dtype(torch, dtype, alias):
    """``dtype`` or its alias ``torch_dtype`` (not both, unless equal): a
    torch dtype, "auto", or None where neither is given (transformers'
    default then: "auto" in 5, float32 in 4)."""
    values = []
    for name, value in (("dtype", dtype), ("torch_dtype", alias)):
        if value is None:
            continue
        values.append((name, "auto" if isinstance(value, str) and value == "auto"
                       else _check_dtype(torch, value)))
    if len({v for _, v in values}) > 1:
        raise ValueError(f"dtype={dtype!r} and torch_dtype={alias!r} differ: pass one of them")
    return values[0][1] if values else None


def _config(transformers, config, model_dir, kwargs, *, dtype, trust_remote_code, code_revision,
            revision, cache_dir, subfolder, hub):
    """``(config, the keyword arguments left for the model's from_pretrained)``:
    the Auto class's step.  A config object is used as it is (transformers
    copies it), every argument going on; else ``AutoConfig.from_pretrained``
    of ``config`` (a path or hub id) or of ``model_dir`` takes those that are
    attributes of the config (overrides: ``num_hidden_layers=1``) and
    leaves the others, the quantization config and the dtype going on
    beside them, as the Auto class passes them."""
    kwargs = dict(kwargs)
    if isinstance(config, transformers.PretrainedConfig):
        return config, kwargs
    if config is not None and not isinstance(config, (str, os.PathLike)):
        raise TypeError(f"config must be a transformers config, or the path or hub id of one, "
                        f"not {type(config).__name__}")
    quantization = kwargs.pop("quantization_config", None)
    if dtype is not None and dtype != "auto":
        kwargs["dtype"] = dtype
    if code_revision is not None:
        kwargs["code_revision"] = code_revision
    if config is None:
        source = model_dir
    else:
        source = os.fspath(config)
        where = {"revision": revision, "cache_dir": cache_dir, "subfolder": subfolder or None,
                 **{k: v for k, v in hub.items() if k != "proxies"}}
        kwargs.update({k: v for k, v in where.items() if v is not None})
    config, rest = transformers.AutoConfig.from_pretrained(source, return_unused_kwargs=True,
                                                           trust_remote_code=trust_remote_code, **kwargs)
    for name in ("dtype", "torch_dtype"):
        rest.pop(name, None)            # from_pretrained's own, given beside them
    if quantization is not None:
        rest["quantization_config"] = quantization
    return config, rest


def _model_class(transformers, config, model_class, model_dir, trust_remote_code, code_revision=None):
    if model_class is None:
        names = getattr(config, "architectures", None) or []
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            # (a string's first letter would be taken for a class name)
            bad = names if not isinstance(names, list) else next(n for n in names if not isinstance(n, str))
            raise ValueError(f"{model_dir}/config.json's architectures must be a list of class names, "
                             f"not {'one holding ' if isinstance(names, list) else ''}"
                             f"{_a(type(bad).__name__)} ({bad!r}): fix it, or pass model_class=")
        if not names:
            model_class = getattr(transformers, DEFAULT_AUTO_CLASS)
        else:
            model_class = getattr(transformers, names[0], None)
            if model_class is None:
                return _remote_class(transformers, config, names[0], model_dir, trust_remote_code,
                                     code_revision)
    if getattr(model_class, "_model_mapping", None) is None:
        return model_class
    # An Auto class: remote code where the config maps this Auto class to
    # some, else its mapping, as the Auto class's from_pretrained does.
    auto_map = getattr(config, "auto_map", None) or {}
    if model_class.__name__ in auto_map:
        return _remote_class(transformers, config, model_class.__name__, model_dir, trust_remote_code,
                             code_revision)
    try:
        return model_class._model_mapping[type(config)]
    except KeyError:
        raise ValueError(f"{model_class.__name__} has no model for {type(config).__name__} "
                         f"({model_dir}/config.json, model_type {getattr(config, 'model_type', None)!r}): "
                         "pass model_class=") from None


def _a(noun):
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _remote_class(transformers, config, name, model_dir, trust_remote_code, code_revision=None):
    auto_map = getattr(config, "auto_map", None) or {}
    ref = auto_map.get(name) or next((v for k, v in auto_map.items()
                                      if isinstance(v, str) and v.endswith("." + name)), None)
    if ref is None:
        raise ValueError(f"transformers {transformers.__version__} has no class {name!r} "
                         f"(config.json's architectures) and config.json's auto_map names none: "
                         "pass model_class=")
    if not trust_remote_code:
        raise ValueError(f"{model_dir} needs its own code for {name} ({ref}): pass trust_remote_code=True "
                         "to run it")
    from transformers.dynamic_module_utils import get_class_from_dynamic_module
    if isinstance(ref, (list, tuple)):
        ref = ref[0]
    return get_class_from_dynamic_module(ref, model_dir, code_revision=code_revision)


@contextlib.contextmanager
def _no_allocator_warmup(transformers):
    """transformers' caching_allocator_warmup off for one call (see the module
    docstring, step 4).  A module attribute: another thread's from_pretrained
    meanwhile would skip its warm-up too (slower, never wrong)."""
    modeling = getattr(transformers, "modeling_utils", None)
    original = getattr(modeling, "caching_allocator_warmup", None)
    if original is None:
        yield
        return
    modeling.caching_allocator_warmup = lambda *args, **kwargs: None
    try:
        yield
    finally:
        modeling.caching_allocator_warmup = original


def _set_name_or_path(model, model_dir):
    # transformers' from_pretrained(None, ...) records None; its own records
    # what it was given (the path, or the hub id).
    model.config.name_or_path = model_dir
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and config is not model.config and getattr(config, "name_or_path", "") is None:
            config.name_or_path = model_dir


__all__ = ["from_pretrained"]
