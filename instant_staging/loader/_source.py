"""What ``source`` names: the shard files of a load, in reading order.

``source`` (docs/design.md, "The loader") is one of

- a ``.safetensors`` path;
- a list of them (read in the order given);
- a directory: the shards its ``model.safetensors.index.json`` lists (each
  once, sorted by file name), else every ``*.safetensors`` in it, sorted;
- an ``*.safetensors.index.json`` path: the shards it lists, beside it.

An index must be a JSON object whose ``weight_map`` maps tensor names to
shard file names (what transformers' ``save_pretrained`` writes); anything
else, JSON nested beyond the parser's depth included, is a
``SafetensorsError`` naming the index.  A shard name must be a relative
name inside the index's directory: not absolute, no ``..`` component, no
NUL, else a ``SafetensorsError`` naming the index and the entry, raised
before any shard is looked at, so that an index cannot make a load open a
file elsewhere (``../x``, ``/etc/...``).  The rule is on the names, not on
where they resolve: a shard may be a symbolic link anywhere (the hub
cache's snapshot folders link every shard to ``../../blobs/...``).  A shard
it lists that does not exist is a ``FileNotFoundError`` naming the index and
the shard, one that is there but is not a regular file (a FIFO, a device, a
directory) a ``SafetensorsError`` saying what it is (looked at with stat(),
never opened: opening a FIFO for reading waits for a writer; the index
itself is opened without waiting, and refused unless regular); after the
headers are read, ``Source.check`` makes a tensor the
index promises but no shard holds a ``SafetensorsError``, so an index that
does not describe its shards fails before anything is allocated.  A JSON file
passed where a shard belongs is reported as what it is.

Nothing here opens a shard: ``Shards`` does.
"""

from __future__ import annotations

import json
import os
import re
import stat

from ._header import SafetensorsError
from ._schemes import redact_url, schemes_text

INDEX_NAME = "model.safetensors.index.json"
INDEX_SUFFIX = ".safetensors.index.json"
SHARD_SUFFIX = ".safetensors"


class Source:
    """The shards of one load.

    ``paths`` are the shard files; ``index`` and ``weight_map`` (tensor
    name -> shard path) where an index named them.
    """

    # What a URL source's directory or index named (``_remote``): its
    # shards' names, or its index's name and weight map, relative to it;
    # the cache keeps it for offline mode (``_cache.remember``).  None otherwise.
    named: dict | None = None

    def __init__(self, paths: list[str], index: str | None = None,
                 weight_map: dict[str, str] | None = None):
        self.paths = paths
        self.index = index
        self.weight_map = weight_map

    def check(self, checkpoint) -> None:
        """Every tensor the index lists is in the shard it names."""
        if self.weight_map is None:
            return
        where = {t.name: checkpoint.paths[i] for i, t in checkpoint.entries}
        missing = [(name, shard) for name, shard in self.weight_map.items() if where.get(name) != shard]
        if missing:
            shown = ", ".join(f"{name!r} (listed in {os.path.basename(shard)}, "
                              + (f"found in {os.path.basename(where[name])})" if name in where
                                 else "in no shard)")
                              for name, shard in missing[:10])
            raise SafetensorsError(f"{len(missing)} tensor(s) of the index are not in the shard it "
                                   f"names: {shown}{' ...' if len(missing) > 10 else ''}", self.index)


def _is_path(p) -> bool:
    return isinstance(p, (str, bytes, os.PathLike))


def _text(p) -> str:
    p = os.fspath(p)
    return os.fsdecode(p) if isinstance(p, bytes) else p


# A URL's scheme (RFC 3986): what a path that is meant as a URL starts with.
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def refuse_other_url(path: str) -> None:
    """A ValueError for ``path`` where it is a URL of a scheme not read here
    (``ftp://``, ``hf://``, ...) and no file of that name exists: said as
    such, where opening it would say only that no such file exists."""
    found = _SCHEME.match(path)
    if found and not os.path.exists(path):
        raise ValueError(f"{redact_url(path)}: a URL of scheme {found.group(1)!r} is not read here "
                         f"(the URL sources: {schemes_text()}; "
                         "a file path has no '://')")


def resolve(source) -> Source:
    """The shards ``source`` names (see the module docstring).

    Checked before anything is opened or allocated.

    Args:
        source: a local source as ``load_file`` takes it: a path, a list of
            paths, a directory or an index.json.

    Returns:
        Its ``Source``: the shard files (``.paths``), and ``index`` and
        ``weight_map`` where an index named them.

    Raises:
        TypeError: something that is not a path or a list of paths.
        ValueError: an empty list, a bad index, a directory without shards.
        FileNotFoundError: a path or a listed shard that does not exist.
    """
    if _is_path(source):
        path = _text(source)
        refuse_other_url(path)
        if os.path.isdir(path):
            return _directory(path)
        if path.endswith(".json"):
            return _index(path)
        return Source([path])
    if isinstance(source, dict):
        raise TypeError("source must be a path, a directory or a list of paths, not a dict")
    try:
        items = list(source)
    except TypeError:
        raise TypeError("source must be a path (a .safetensors file, a directory or an index.json) "
                        f"or a list of paths, not {type(source).__name__}") from None
    if not items:
        raise ValueError("no safetensors file given (source is an empty list)")
    paths = []
    for p in items:
        if not _is_path(p):
            raise TypeError(f"source must be a list of paths, got {type(p).__name__} in the list")
        p = _text(p)
        refuse_other_url(p)
        if os.path.isdir(p):
            raise ValueError(f"{p} is a directory: pass a directory alone, not in a list of shards")
        if p.endswith(".json"):
            raise ValueError(f"{p} is a JSON file (a safetensors index?), not a shard: pass an "
                             "index alone (or its directory), not in a list of shards")
        paths.append(p)
    return Source(paths)


def _directory(path: str) -> Source:
    index = os.path.join(path, INDEX_NAME)
    if os.path.exists(index):       # (one that is no regular file is refused, not skipped)
        return _index(index)
    shards = sorted(name for name in os.listdir(path)
                    if name.endswith(SHARD_SUFFIX) and os.path.isfile(os.path.join(path, name)))
    if not shards:
        raise FileNotFoundError(f"no {INDEX_NAME} and no *{SHARD_SUFFIX} file in directory {path}")
    return Source([os.path.join(path, name) for name in shards])


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, in words ("a FIFO")."""
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"


def _without_waiting(path, flags):
    # (an opener of open(): O_NONBLOCK, or a FIFO would wait for a writer)
    return os.open(path, flags | os.O_NONBLOCK)


def _index(path: str) -> Source:
    try:
        with open(path, "rb", opener=_without_waiting) as f:
            mode = os.fstat(f.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise SafetensorsError(f"the index is {file_kind(mode)}, not a regular file", path)
            os.set_blocking(f.fileno(), True)
            raw = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"no such index file: {path}") from None
    weight_map = parse_index(raw, path)
    base = os.path.dirname(path)
    shards = sorted(set(weight_map.values()))
    paths = [os.path.join(base, s) for s in shards]
    missing, odd = [], []
    for s, p in zip(shards, paths):
        try:
            mode = os.stat(p).st_mode
        except (FileNotFoundError, NotADirectoryError):
            missing.append(s)
            continue
        if not stat.S_ISREG(mode):
            odd.append(f"{s} is {file_kind(mode)}, not a regular file")
    if missing:
        raise FileNotFoundError(f"{path}: {len(missing)} shard(s) it lists do not exist in "
                                f"{base or '.'}: {', '.join(missing[:10])}"
                                + (" ..." if len(missing) > 10 else ""))
    if odd:
        raise SafetensorsError(f"{len(odd)} shard(s) it lists cannot be safetensors files: "
                               + ", ".join(odd[:10]) + (" ..." if len(odd) > 10 else ""), path)
    return Source(paths, path, {name: os.path.join(base, s) for name, s in weight_map.items()})


def parse_index(raw: bytes, path: str) -> dict[str, str]:
    """The ``weight_map`` of the index whose bytes are ``raw`` (a file's or
    an object's, named ``path``), checked: a JSON object mapping tensor
    names to shard names, each a plain name inside the index's directory."""
    try:
        obj = json.loads(raw)
    except UnicodeDecodeError as e:     # its str() would print the byte
        raise SafetensorsError(f"safetensors index is not UTF-8 ({e.reason} at byte {e.start})",
                               path) from None
    except ValueError as e:
        raise SafetensorsError(f"safetensors index is not valid JSON: {e}", path) from None
    except RecursionError:
        raise SafetensorsError("safetensors index nests deeper than Python's JSON parser "
                               "goes (the recursion limit)", path) from None
    weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
    if (not isinstance(weight_map, dict) or not weight_map
            or not all(isinstance(k, str) and isinstance(v, str) and v for k, v in weight_map.items())):
        raise SafetensorsError("a safetensors index must be a JSON object whose \"weight_map\" maps "
                               "tensor names to shard file names", path)
    for name, shard in weight_map.items():
        _check_shard_name(shard, name, path)
    return weight_map


def _check_shard_name(shard: str, name: str, index: str) -> None:
    """A shard name of ``index`` names a file inside its directory (see the
    module docstring); ``name`` is the tensor whose entry it is."""
    parts = shard.replace(os.sep, "/").replace(os.altsep or "/", "/").split("/")
    if "\0" in shard:
        why = "holds a NUL character"
    elif os.path.isabs(shard) or shard.startswith("/"):
        why = "is an absolute path"
    elif ".." in parts:
        why = "has a '..' component"
    else:
        return
    raise SafetensorsError(f"the index names shard {shard!r}, which {why}: a shard must be named "
                           "by a relative name inside the index's directory", index, name)
