"""A model by directory or Hugging Face hub id, and the weights transformers reads in it.

One path for every caller that takes a hub id: ``integrations.transformers.
from_pretrained`` and the CLI's ``load``.

``local_dir(model_dir, ...)`` is the local directory of a model: itself,
or, for a hub id, its snapshot in huggingface_hub's cache (fetched as
transformers would, unless offline or ``local_files_only``; of the
weights, only the files ``weights`` reads there: ``snapshot``).
``weights(directory, variant)`` names those files: model.safetensors,
else the index, else (beyond transformers) every *.safetensors.
huggingface_hub is imported only for a hub id.
"""

import json
import os

# What a hub snapshot holds beside the weights: the configs, the shards'
# index, and the code of a trust_remote_code model.
HUB_PATTERNS = ("*.json", "*.py")


def weight_names(variant=None):
    """transformers' one-file and index names, of ``variant`` where given
    (its ``_add_variant``: model.fp16.safetensors, model.safetensors.index.fp16.json)."""
    if variant is None:
        return ("model.safetensors", "model.safetensors.index.json")
    return (f"model.{variant}.safetensors", f"model.safetensors.index.{variant}.json")


def weights(model_dir, variant=None):
    """The weights transformers' from_pretrained reads in ``model_dir``:
    model.safetensors where it is a file, else the shards
    model.safetensors.index.json lists, else (beyond transformers) every
    *.safetensors there; of a ``variant``, its own two names only.
    transformers' own saves leave both behind (a one-file save over a
    sharded one keeps the index, and the other way round the old file), and
    a hub repo may hold a variant (model.fp16.safetensors) beside them:
    loading the directory as ``load_file`` does read the other set, or both."""
    names = weight_names(variant)
    for name in names:
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            return path
    if variant is not None:
        raise FileNotFoundError(f"{model_dir} has no {' or '.join(names)} (variant={variant!r})")
    return model_dir


def _hub_shaped(path):
    """"org/name" or "name": not absolute, not relative to "." or "..", at
    most one "/" (what transformers tries on the hub)."""
    return bool(path) and not (os.path.isabs(path) or path.startswith(".") or path.count("/") > 1)


def may_be_hub_id(path):
    """Whether ``path``, which is no local file or directory, may name a
    hub repo: hub-shaped, and not a file name of the kinds the CLI's
    SOURCE takes (a missing model.safetensors stays a missing file)."""
    return _hub_shaped(path) and not path.endswith((".safetensors", ".json"))


def local_dir(model_dir, *, revision=None, cache_dir=None, subfolder="", variant=None,
              needs_config=True, **hub):
    """The local directory of ``model_dir`` (``subfolder`` inside it): itself,
    or the snapshot of a hub id in huggingface_hub's cache.  It must hold
    config.json where ``needs_config``.  ``hub``: snapshot_download's other
    arguments (token, local_files_only, force_download, ...).  Raises
    FileNotFoundError (one line) for what is neither, TypeError for a
    model_dir or revision of the wrong type."""
    if not isinstance(model_dir, (str, bytes, os.PathLike)):
        raise TypeError(f"model_dir must be a path or a hub id, not {type(model_dir).__name__}")
    path = os.fsdecode(os.fspath(model_dir))
    if os.path.isdir(path):
        local = os.path.join(path, subfolder) if subfolder else path
        if not os.path.isdir(local):
            raise FileNotFoundError(f"{path} has no subfolder {subfolder}")
        if needs_config and not os.path.isfile(os.path.join(local, "config.json")):
            raise FileNotFoundError(f"{local} has no config.json")
        return local
    if revision is not None and not isinstance(revision, str):
        raise TypeError(f"revision must be a str, not {type(revision).__name__}")
    if not _hub_shaped(path):
        raise FileNotFoundError(f"no such model directory: {path}")
    try:
        from huggingface_hub.errors import (
            HFValidationError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        raise FileNotFoundError(f"no such model directory: {path} (a hub id needs huggingface_hub: "
                                "pip install huggingface_hub)") from None
    try:
        root = snapshot(path, revision=revision, cache_dir=cache_dir, subfolder=subfolder,
                        variant=variant, **hub)
    except HFValidationError:
        raise FileNotFoundError(f"no such model directory: {path} (nor a valid hub id)") from None
    except LocalEntryNotFoundError as e:
        raise FileNotFoundError(f"{path}: neither a local directory nor in huggingface_hub's cache "
                                f"(offline, or local_files_only=True): {_line(e)}") from None
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise FileNotFoundError(f"{path}: neither a local directory nor a model on the hub "
                                f"(revision {revision or 'main'}): {_line(e)}") from None
    local = os.path.join(root, subfolder) if subfolder else root
    if needs_config and not os.path.isfile(os.path.join(local, "config.json")):
        where = f"{path}/{subfolder}" if subfolder else path
        raise FileNotFoundError(f"{where} (revision {revision or 'main'}) has no config.json")
    return local


def _line(error):
    return " ".join(str(error).split())


def snapshot(repo, *, subfolder="", variant=None, **kwargs):
    """The snapshot of ``repo`` holding what ``weights`` reads (in
    ``subfolder``), and only that: the configs and code with
    model.safetensors; where the repo has none, the shards its index lists;
    where it has no index either, every *.safetensors.  (One pattern for
    every *.safetensors fetched a repo's variants too, model.fp16.safetensors
    beside model.safetensors, and both a one-file and a sharded copy where a
    repo keeps both.)"""
    from huggingface_hub import snapshot_download
    prefix = subfolder.strip("/") + "/" if subfolder else ""
    one_file, index_name = weight_names(variant)
    root = snapshot_download(repo, allow_patterns=[*HUB_PATTERNS, prefix + one_file], **kwargs)
    if os.path.isfile(os.path.join(root, prefix, one_file)):
        return root
    index = os.path.join(root, prefix, index_name)
    if not os.path.isfile(index):
        if variant is not None:
            return root             # weights() names what is missing
        return snapshot_download(repo, allow_patterns=[prefix + "*.safetensors"], **kwargs)
    try:
        with open(index, encoding="utf-8") as f:
            shards = sorted({str(v) for v in json.load(f)["weight_map"].values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return root                 # the load reports what is wrong with the index
    if not shards:
        return root
    return snapshot_download(repo, allow_patterns=[prefix + s for s in shards], **kwargs)
