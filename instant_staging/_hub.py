"""A model by directory or Hugging Face hub id, and the weights transformers reads in it.

One path for every caller that takes a hub id: ``integrations.transformers.
from_pretrained``, the CLI's ``load``, and every door of the loader
(``loader/_open.open_shards``: ``Checkpoint.open``, ``load_file``,
``iter_load``, ``load_into``, ``safe_open``).

``files(source, ...)`` is the loader's: a Hub id (``org/name``) or an
``hf://`` URL (huggingface_hub's HF URI, ``parse_hf_url``) to the local
files of its weights in huggingface_hub's cache, fetched there first
unless they are there or the Hub is off (``HF_HUB_OFFLINE``): the cache
transformers and vLLM share, read at local speed (docs/guides/hub.md says
why a Hub source is not streamed from its resolve URLs).

``local_dir(model_dir, ...)`` is the local directory of a model: itself,
or, for a hub id, its snapshot in huggingface_hub's cache (fetched as
transformers would, unless offline or ``local_files_only``; of the
weights, only the files ``weights`` reads there: ``snapshot``).
``weights(directory, variant)`` names those files: model.safetensors,
else the index, else (beyond transformers) every *.safetensors.
huggingface_hub is imported only for a hub id.
"""

import fnmatch
import json
import os
import re
from typing import NamedTuple
from urllib.parse import unquote

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


def snapshot(repo, *, subfolder="", variant=None, also=HUB_PATTERNS, **kwargs):
    """The snapshot of ``repo`` holding what ``weights`` reads (in
    ``subfolder``), and only that: ``also`` (the configs and code) with
    model.safetensors (and its index, where ``also`` does not name it);
    where the repo has none, the shards its index lists;
    where it has no index either, every *.safetensors.  (One pattern for
    every *.safetensors fetched a repo's variants too, model.fp16.safetensors
    beside model.safetensors, and both a one-file and a sharded copy where a
    repo keeps both.)"""
    from huggingface_hub import snapshot_download
    prefix = subfolder.strip("/") + "/" if subfolder else ""
    one_file, index_name = weight_names(variant)
    first = [*also, prefix + one_file]
    if not any(fnmatch.fnmatch(prefix + index_name, p) for p in first):
        first.append(prefix + index_name)
    root = snapshot_download(repo, allow_patterns=first, **kwargs)
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


# -- a Hub source of the loader ----------------------------------------------------

HF_SCHEME = "hf://"

# huggingface_hub's HF URI type prefixes that name a repo the loader reads
# (a bucket has no revisions nor snapshot; a kernel holds no checkpoint).
_REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}

# The revisions that hold a '/' unencoded (a pull request's, a conversion's).
_SPECIAL_REF = re.compile(r"refs/(?:convert/[\w.-]+|pr/\d+)")


class HubSource(NamedTuple):
    """A Hub source: its repo, revision (None: main) and the path in it ("": its root)."""

    repo_id: str
    revision: str | None = None
    path: str = ""
    repo_type: str = "model"

    def __str__(self):
        prefix = "" if self.repo_type == "model" else f"{self.repo_type}s/"
        at = "" if self.revision is None else f"@{self.revision}"
        return f"{HF_SCHEME}{prefix}{self.repo_id}{at}" + (f"/{self.path}" if self.path else "")


def parse_hf_url(url):
    """``hf://[<type>s/]<org>/<name>[@<revision>][/<path>]``, huggingface_hub's
    HF URI (``HfFileSystem``'s paths, ``parse_hf_uri``): a model repo
    unless ``datasets/`` or ``spaces/`` leads; the revision a branch, tag or
    commit, percent-encoded where it holds a '/' (``refs/pr/N`` and
    ``refs/convert/NAME`` as they are); the path a file or folder in it.
    ValueError (one line, naming the form) for any other."""
    body = url[len(HF_SCHEME):].strip("/") if url.lower().startswith(HF_SCHEME) else None
    repo_type = "model"
    if body:
        first, _, rest = body.partition("/")
        if first in _REPO_TYPES and rest:
            repo_type, body = _REPO_TYPES[first], rest
        elif first in ("buckets", "kernels"):
            body = None
    at = body.find("@") if body else -1
    if body and (at == -1 or body[:at].count("/") > 1):
        parts = body.split("/", 2)
        repo_id, revision, path = "/".join(parts[:2]), None, "/".join(parts[2:])
    elif body:
        repo_id, rest = body[:at], body[at + 1:]
        special = _SPECIAL_REF.match(rest)
        cut = special.end() if special else (rest.find("/") if "/" in rest else len(rest))
        revision, path = unquote(rest[:cut]), rest[cut:].lstrip("/")
    if (not body or repo_id.count("/") != 1 or not all(repo_id.split("/"))
            or (revision is not None and not revision) or "//" in path
            or any(part in (".", "..") for part in path.split("/"))):
        raise ValueError(f"{url}: not a Hub URL of the form hf://org/name[@revision][/path] "
                         "(or hf://datasets/org/name...; a bucket is not read)")
    return HubSource(repo_id, revision, path, repo_type)


def is_hf_url(source):
    """Whether ``source`` is an ``hf://`` URL."""
    return isinstance(source, str) and source[:len(HF_SCHEME)].lower() == HF_SCHEME


def hub_source(source, revision=None):
    """``source`` as a ``HubSource`` where it names one: an ``hf://`` URL, or
    a Hub id (``org/name``: exactly one '/', not absolute, not relative to
    "." or "..") that is no local path (a local file or directory of that
    name always wins); else None.  ``revision`` is given to a Hub id, and
    to an ``hf://`` URL that names none (a ValueError where it names
    another).  A ValueError for ``revision`` given with any other source."""
    if revision is not None and not isinstance(revision, str):
        raise TypeError(f"revision must be a str, not {type(revision).__name__}")
    found = None
    if is_hf_url(source) and not os.path.exists(source):
        found = parse_hf_url(source)
        if revision is not None:
            if found.revision not in (None, revision):
                raise ValueError(f"{source} names revision {found.revision!r}, and revision={revision!r} "
                                 "is another: give one")
            found = found._replace(revision=revision)
    elif (isinstance(source, str) and source.count("/") == 1 and may_be_hub_id(source)
          and "://" not in source and not os.path.exists(source)):
        found = HubSource(source, revision)
    if found is None and revision is not None:
        raise ValueError("revision applies to a Hub source (org/name, or hf://org/name), "
                         f"not to {source!r}")
    return found


def files(hub, *, cache_dir=None, token=None, endpoint=None, given=None):
    """The local source of ``hub`` (a ``HubSource``; ``given``: the source as
    the caller wrote it, for messages): its weights in huggingface_hub's
    cache (``cache_dir``, else ``HF_HUB_CACHE``), fetched there first where
    they are not (``snapshot_download``, only the files read: a path's
    .safetensors file; an index and the shards it lists; a repo's or
    folder's weights as ``weights`` reads them).  Nothing is fetched with
    ``HF_HUB_OFFLINE=1``.  Returns a file, an index or a directory, as
    ``load_file`` takes it.  FileNotFoundError (one line) for a repo,
    revision or file that is not there (nor in the cache, offline);
    ImportError without huggingface_hub."""
    name = given or str(hub)
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            EntryNotFoundError,
            HFValidationError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        raise ImportError(f"{name}: a Hub source needs huggingface_hub: "
                          "pip install huggingface_hub") from None
    kwargs = {k: v for k, v in (("repo_type", hub.repo_type), ("revision", hub.revision),
                                ("cache_dir", cache_dir), ("token", token), ("endpoint", endpoint))
              if v is not None and not (k == "repo_type" and v == "model")}
    at = f"revision {hub.revision or 'main'}"
    # (a Hub id is tried on the Hub only where no local path has its name)
    where = "not a local path, nor" if given and "://" not in given else "not"
    path = hub.path
    try:
        if path.endswith((".safetensors", ".json")):
            local = os.path.join(snapshot_download(hub.repo_id, allow_patterns=[path], **kwargs), path)
            shards = _index_shards(local) if path.endswith(".json") and os.path.isfile(local) else []
            if shards:
                folder = os.path.dirname(path)
                snapshot_download(hub.repo_id, allow_patterns=[
                    f"{folder}/{s}" if folder else s for s in shards], **kwargs)
        else:
            root = snapshot(hub.repo_id, subfolder=path, also=(), **kwargs)
            local = os.path.join(root, path) if path else root
            if os.path.isdir(local):
                local = weights(local)
    except HFValidationError as e:
        raise ValueError(f"{name}: {where} a valid Hub repo id ({_first(e)})") from None
    except LocalEntryNotFoundError as e:
        raise FileNotFoundError(f"{name} ({at}): {where} in huggingface_hub's cache, and the Hub "
                                f"was not asked (HF_HUB_OFFLINE=1) or did not answer: {_first(e)}") from None
    except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError) as e:
        raise FileNotFoundError(f"{name} ({at}): {where} a repo, revision or file on the Hub "
                                f"(a private or gated repo needs HF_TOKEN): {_first(e)}") from None
    if not os.path.exists(local):
        raise FileNotFoundError(f"{name} ({at}): the repo holds no {path or 'safetensors weights'}")
    return local


def _first(error):
    """huggingface_hub's message up to its advice (its first two lines, one line)."""
    return _line(" ".join(str(error).strip().split("\n\n", 1)[-1].splitlines()[:1]) or str(error))


def _index_shards(index):
    """The shard names of an index file; [] where it cannot be read (the
    load says what is wrong with it)."""
    try:
        with open(index, encoding="utf-8") as f:
            return sorted({str(v) for v in json.load(f)["weight_map"].values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
