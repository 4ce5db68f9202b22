"""from_pretrained's arguments, as transformers takes them: the refusals
(weights this loader does not read), the hub's (a hub id resolved here),
the dtype, the config (the Auto class's step) and the model class (steps 1
and 2 of the package's docstring)."""

from __future__ import annotations

import inspect
import logging
import os

from ... import _hub
from ...loader import fetch_side_files, torch_dtype

logger = logging.getLogger("instant_staging")


# The Auto class whose mapping a config without `architectures` goes through.
DEFAULT_AUTO_CLASS = "AutoModelForCausalLM"
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


def import_transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError("instant_staging.integrations.transformers needs transformers: "
                          "pip install 'instant_staging[transformers]'") from None
    return transformers


def refuse_what_is_not_read_here(kwargs, use_safetensors):
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


def hub_arguments(kwargs, *, token, local_files_only, force_download):
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


class Weights:
    """Where the weights of a model come from: ``_hub.weights(model_dir)`` for a
    local one; for a URL one the same rule over the names its prefix holds
    (``fetch_side_files`` fetched the index and config beside them)."""

    def __init__(self, model_dir, remote, storage_options, variant=None, cache_dir=None):
        self.storage_options = storage_options
        self.cache_dir = cache_dir      # a URL's weights: the loader's cache (its objects)
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


def remote_dir(url, cache_dir, storage_options, given_config=False):
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


def one_dtype(torch, dtype, alias):
    """``dtype`` or its alias ``torch_dtype`` (not both, unless equal): a
    torch dtype, "auto", or None where neither is given (transformers'
    default then: "auto" in 5, float32 in 4)."""
    values = []
    for name, value in (("dtype", dtype), ("torch_dtype", alias)):
        if value is None:
            continue
        values.append((name, "auto" if isinstance(value, str) and value == "auto"
                       else torch_dtype(torch, value)))
    if len({v for _, v in values}) > 1:
        raise ValueError(f"dtype={dtype!r} and torch_dtype={alias!r} differ: pass one of them")
    return values[0][1] if values else None


def make_config(transformers, config, model_dir, kwargs, *, dtype, trust_remote_code, code_revision,
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


def model_class_of(transformers, config, model_class, model_dir, trust_remote_code, code_revision=None):
    if model_class is None:
        names = getattr(config, "architectures", None) or []
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            # (a string's first letter would be taken for a class name)
            bad = names if not isinstance(names, list) else next(n for n in names if not isinstance(n, str))
            raise ValueError(f"{model_dir}/config.json's architectures must be a list of class names, "
                             f"not {'one holding ' if isinstance(names, list) else ''}"
                             f"{with_article(type(bad).__name__)} ({bad!r}): fix it, or pass model_class=")
        if not names:
            model_class = getattr(transformers, DEFAULT_AUTO_CLASS)
        else:
            model_class = getattr(transformers, names[0], None)
            if model_class is None:
                return remote_class(transformers, config, names[0], model_dir, trust_remote_code,
                                     code_revision)
    if getattr(model_class, "_model_mapping", None) is None:
        return model_class
    # An Auto class: remote code where the config maps this Auto class to
    # some, else its mapping, as the Auto class's from_pretrained does.
    auto_map = getattr(config, "auto_map", None) or {}
    if model_class.__name__ in auto_map:
        return remote_class(transformers, config, model_class.__name__, model_dir, trust_remote_code,
                             code_revision)
    try:
        return model_class._model_mapping[type(config)]
    except KeyError:
        raise ValueError(f"{model_class.__name__} has no model for {type(config).__name__} "
                         f"({model_dir}/config.json, model_type {getattr(config, 'model_type', None)!r}): "
                         "pass model_class=") from None


def with_article(noun):
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def remote_class(transformers, config, name, model_dir, trust_remote_code, code_revision=None):
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


def saved_generation_config(transformers, model_dir):
    """The generation config transformers' own ``from_pretrained`` gives a
    model whose directory has a ``generation_config.json``:
    ``GenerationConfig.from_pretrained`` of it, set on the model as it is
    (not handed to ``from_pretrained(generation_config=)``, which copies it
    through a dict without the hash it recorded at loading: transformers
    4.56-4.57's ``generate()`` asks for that hash where the file says
    ``"_from_model_config": true``, as ``save_pretrained`` writes it).
    None without the file: the model keeps the one transformers makes from
    its config."""
    if not os.path.isfile(os.path.join(model_dir, "generation_config.json")):
        return None
    return transformers.GenerationConfig.from_pretrained(model_dir)
