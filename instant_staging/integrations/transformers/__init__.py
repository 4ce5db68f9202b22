"""A ready transformers model, its weights read by instant_staging.

    from instant_staging.integrations.transformers import from_pretrained
    model = from_pretrained("Llama-3-8B/", device="cuda:0", dtype=torch.bfloat16)
    model = from_pretrained("meta-llama/Meta-Llama-3-8B", device_map="auto", torch_dtype="auto")

The contract: what transformers' ``from_pretrained`` returns for the same
checkpoint and arguments (class, parameters, buffers, tying, dtypes, config,
generation config, eval mode), with the safetensors bytes read by
``instant_staging.loader.Checkpoint`` straight onto the device the
``device_map`` gives each tensor (step 6), for
every transformers the package declares (4.56 and newer: ``_background.Arriving``
stands in for what each one's loader reads).  Only the reading is ours;
everything else is transformers' own machinery:

1. ``model_dir`` is a local directory, or a hub id resolved through
   ``huggingface_hub.snapshot_download`` (its cache; with
   ``HF_HUB_OFFLINE=1`` or ``local_files_only=True`` nothing is fetched;
   of the weights, only the files step 3 reads: ``_hub.snapshot``), and
   ``subfolder`` inside it.
2. The config is what the Auto class makes of it (``_arguments.make_config``):
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
   same way.  A ``generation_config.json`` beside it is read as
   transformers' own reads it, and set on the model once it is built
   (``_arguments.saved_generation_config``).
3. ``Checkpoint.open(weights).iter_load(device)`` (``_hub.weights``: the files
   transformers would read there, ``variant`` included; their headers parsed
   once, for the layout and the load) reads every tensor in the file's dtype
   onto the device (one read of each byte, no host copy), in a thread of
   its own (``_background.BackgroundLoad``), while
4. ``cls.from_pretrained(None, config=..., state_dict=..., dtype=...,
   device_map={"": device}, ...)`` runs: transformers builds the model on
   the meta device and maps the tensors in: its key renaming
   (``key_mapping`` too), the fusing of per-expert MoE tensors (its
   conversion mapping, transformers 5), ``dtype`` and
   ``_keep_in_fp32_modules``, quantizers, tied weights, non-persistent
   buffers, tensor parallelism (``tp_plan``: it shards what we read).  The
   state dict holds ``Arriving`` values where transformers' own loading
   holds safetensors slices (``t[...]`` materialises one; transformers 4,
   given a state dict, asks ``t.to(device)`` instead): each waits for its
   tensor, so building the model on the meta device overlaps the read
   instead of following it (docs/design.md, "Measured: building the model
   while reading").  A load of small tensors (a fine-grained MoE's expert
   matrices) is handed over whole, once all of it is read, so transformers'
   per-tensor calls into the device do not run while the readers copy
   (``_background.BackgroundLoad``, the vLLM path's rule, design.md
   "Measured: transformers on fine-grained MoE").  A tensor already on its device in its dtype is assigned,
   not copied (``core_model_loading._materialize_copy``: ``t[...]`` and a
   ``.to()`` that is a no-op).  Its allocator warm-up is skipped for this
   call (``_background.no_allocator_warmup``): every tensor gets its own allocation
   from the load, so the warm-up could only reserve a second model-sized
   block on the GPU (2x the peak memory, an OOM for a model over half the
   device).  With a quantization config the whole checkpoint is read first
   and real tensors handed over (quantizers read them in ways of their own).

   In place (transformers 5, one device, no tensor parallelism:
   ``_inplace.py``): the read waits for the model instead, and where
   ``_inplace.plan`` proves the result the same as transformers' conversion
   of the state dict (every weight of the model read, in the dtype it
   would be cast to, experts fused only by stacking), transformers'
   per-tensor conversion is replaced for this call by one
   ``Checkpoint.load_into`` into the parameters made on the device, each
   expert's matrix into its part of the fused one.  Else transformers
   takes the state dict as above, its read started then.  The read
   starting after transformers' allocator warm-up, the warm-up is left on:
   its block is what the parameters (or the read tensors) are made of.
   The log line says which route a call took.
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
   own machinery, wrapped for this call, ``_placement.reading_where_mapped``) starts
   the read once the model is built on meta, before transformers asks for
   a tensor: the checkpoint's names grouped by the device of the module
   each is in (``_placement.groups``: "disk" ones to the CPU, where transformers
   writes them to ``offload_folder``, required then as transformers 4 and
   5 require it for a state dict), one ``iter_load(device, names=...)`` per
   device, in turn, of the one ``Checkpoint``.  accelerate then dispatches
   the model as for transformers' own (``hf_device_map``, hooks).  A dict's
   devices are checked before anything is read (an absent ``cuda:1`` is a
   ValueError naming it).

``reload_weights(model, source)`` (``_reload.py``) writes a checkpoint of
the same architecture into an existing model in place (``Checkpoint.load_into``),
its names mapped by transformers' own renaming.

transformers is an optional dependency: ``pip install
'instant_staging[transformers]'`` (with accelerate, which transformers
needs for a GPU ``device_map``).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any, Literal, overload

from ... import _hub
from ...loader import Device, DType, PathLike, import_torch, is_url, load_file, schemes_text
from . import _inplace
from ._arguments import (
    HUB_ARGUMENTS,
    QUANTIZING,
    TENSOR_PARALLEL,
    Weights,
    hub_arguments,
    import_transformers,
    make_config,
    model_class_of,
    one_dtype,
    refuse_what_is_not_read_here,
    remote_dir,
    saved_generation_config,
)
from ._background import assemble_while_reading, no_allocator_warmup, no_progress_bar
from ._placement import Spread, offloading_a_state_dict, parallel_device, target_device
from ._reload import reload_weights

if TYPE_CHECKING:
    from transformers import GenerationMixin, PreTrainedModel

    class PreTrainedModelWithGenerate(PreTrainedModel, GenerationMixin):
        """What ``from_pretrained`` is typed as: transformers' model with
        ``generate()``, as transformers types its ``AutoModelForCausalLM.
        from_pretrained`` (its ``PreTrainedModel`` has no ``generate``: mypy
        takes ``model.generate`` for torch's ``Module.__getattr__``, a
        ``Tensor | Module``)."""

logger = logging.getLogger("instant_staging")


@overload
def from_pretrained(model_dir: PathLike | None = ..., *,
                    pretrained_model_name_or_path: PathLike | None = ...,
                    device: Device | None = ..., dtype: DType = ...,
                    model_class: type[Any] | None = ..., device_map: Any = ...,
                    torch_dtype: DType = ..., config: Any = ..., revision: str | None = ...,
                    subfolder: str = ..., variant: str | None = ..., use_safetensors: bool | None = ...,
                    trust_remote_code: bool = ..., cache_dir: PathLike | None = ...,
                    token: str | bool | None = ..., local_files_only: bool = ...,
                    force_download: bool = ..., output_loading_info: Literal[False] = ...,
                    storage_options: dict[str, Any] | None = ...,
                    **kwargs: Any) -> PreTrainedModelWithGenerate: ...
@overload
def from_pretrained(model_dir: PathLike | None = ..., *,
                    pretrained_model_name_or_path: PathLike | None = ...,
                    device: Device | None = ..., dtype: DType = ...,
                    model_class: type[Any] | None = ..., device_map: Any = ...,
                    torch_dtype: DType = ..., config: Any = ..., revision: str | None = ...,
                    subfolder: str = ..., variant: str | None = ..., use_safetensors: bool | None = ...,
                    trust_remote_code: bool = ..., cache_dir: PathLike | None = ...,
                    token: str | bool | None = ..., local_files_only: bool = ...,
                    force_download: bool = ..., output_loading_info: Literal[True],
                    storage_options: dict[str, Any] | None = ...,
                    **kwargs: Any) -> tuple[PreTrainedModelWithGenerate, dict[str, Any]]: ...


def from_pretrained(model_dir: PathLike | None = None, *,
                    pretrained_model_name_or_path: PathLike | None = None,
                    device: Device | None = None, dtype: DType = None,
                    model_class: type[Any] | None = None, device_map: Any = None,
                    torch_dtype: DType = None, config: Any = None, revision: str | None = None,
                    subfolder: str = "", variant: str | None = None, use_safetensors: bool | None = None,
                    trust_remote_code: bool = False, cache_dir: PathLike | None = None,
                    token: str | bool | None = None, local_files_only: bool = False,
                    force_download: bool = False, output_loading_info: bool = False,
                    storage_options: dict[str, Any] | None = None,
                    **kwargs: Any,
                    ) -> PreTrainedModelWithGenerate | tuple[PreTrainedModelWithGenerate, dict[str, Any]]:
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
        pretrained_model_name_or_path: ``model_dir`` by transformers' name
            for it, so that a call written for transformers runs as it is;
            give one of the two.
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
            as transformers' (the hub ones matter for a hub id).  For a URL
            prefix, ``cache_dir`` holds its config files and is the
            loader's cache of its weights (``load_file``'s ``cache_dir``:
            a later call reads them from there); None: the config files
            under ~/.cache/instant_staging/remote, the weights cached only
            where ``INSTANT_STAGING_CACHE_DIR`` is set.
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
    if (model_dir is None) == (pretrained_model_name_or_path is None):
        raise TypeError("from_pretrained() takes one model_dir: the first argument or "
                        "pretrained_model_name_or_path= (transformers' name for it), "
                        + ("not both" if model_dir is not None else "none given"))
    if model_dir is None:
        model_dir = pretrained_model_name_or_path
    torch = import_torch()
    transformers = import_transformers()
    refuse_what_is_not_read_here(kwargs, use_safetensors)
    hub = hub_arguments(kwargs, token=token, local_files_only=local_files_only,
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
        model_dir, weights_from = remote_dir(model_dir, cache_dir, storage_options, given_config)
    elif storage_options is not None:
        raise ValueError(f"storage_options apply to a URL model_dir ({schemes_text()})")
    else:
        model_dir = _hub.local_dir(model_dir, revision=revision, cache_dir=cache_dir, subfolder=subfolder,
                                   variant=variant, needs_config=not given_config, **hub)
    weights = Weights(model_dir, weights_from, storage_options, variant,
                      cache_dir=cache_dir if weights_from is not None else None)
    parallel = any(kwargs.get(name) is not None for name in TENSOR_PARALLEL)
    if parallel:
        device = parallel_device(torch, device, device_map)
    else:
        device = target_device(torch, device, device_map, kwargs.get("offload_folder"))
    dtype = one_dtype(torch, dtype, torch_dtype)
    if model_class is not None and not isinstance(model_class, type):
        raise TypeError(f"model_class must be a class, not {type(model_class).__name__}")
    if not isinstance(trust_remote_code, bool):
        raise TypeError(f"trust_remote_code must be a bool, not {type(trust_remote_code).__name__}")

    config, kwargs = make_config(transformers, config, model_dir, kwargs, dtype=dtype,
                             trust_remote_code=trust_remote_code, code_revision=code_revision,
                             revision=revision, cache_dir=cache_dir, subfolder=subfolder, hub=hub)
    cls = model_class_of(transformers, config, model_class, model_dir, trust_remote_code, code_revision)
    # (read before the weights: a bad file is an error before anything is read)
    generation = None if kwargs.get("generation_config") is not None else saved_generation_config(
        transformers, model_dir)
    # transformers needs accelerate for any device_map; on the CPU none is
    # needed (its default places everything there, and a .to("cpu") of a CPU
    # tensor is a no-op).  Tensor parallelism places each rank's part itself.
    # A map transformers resolves is its own: where it needs accelerate (to
    # dispatch over several devices) it says so, before our read starts.
    spread = isinstance(device, Spread)
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
    with no_progress_bar(transformers):
        if quantized or any(kwargs.get(name) for name in QUANTIZING):
            # Quantizers read tensors in ways of their own: hand them real ones.
            # (over several devices: on the CPU, transformers places them)
            state = load_file(weights.source, "cpu" if spread else device,
                              storage_options=weights.storage_options, cache_dir=weights.cache_dir)
            try:
                with no_allocator_warmup(transformers), offloading_a_state_dict(transformers, cls, spread):
                    model, info = cls.from_pretrained(None, state_dict=state, **kwargs)
            finally:
                state.clear()      # the model holds what it took; nothing else outlives the call
            route = "state dict"
        else:
            in_place = not parallel and _inplace.available(transformers)
            model, info, route = assemble_while_reading(transformers, cls, weights, device, kwargs, in_place)
    t1 = time.perf_counter()
    missing = sorted(info.get("missing_keys") or ())
    if missing and not output_loading_info:
        name, model = type(model).__name__, None       # not kept alive by the traceback
        raise KeyError(f"{model_dir}: {len(missing)} weight(s) of {name} are not in the checkpoint: "
                       + ", ".join(missing[:20]) + (" ..." if len(missing) > 20 else ""))
    if generation is not None and model.can_generate():
        model.generation_config = generation
    _set_name_or_path(model, os.fsdecode(os.fspath(given)))
    logger.info("from_pretrained %s: %s in %.3f s, weights %s", model_dir, type(model).__name__, t1 - t0,
                "written in place" if route == "in place" else "handed over in a state dict")
    return (model, info) if output_loading_info else model


def _set_name_or_path(model, model_dir):
    # transformers' from_pretrained(None, ...) records None; its own records
    # what it was given (the path, or the hub id).
    model.config.name_or_path = model_dir
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and config is not model.config and getattr(config, "name_or_path", "") is None:
            config.name_or_path = model_dir


__all__ = ["from_pretrained", "reload_weights"]
