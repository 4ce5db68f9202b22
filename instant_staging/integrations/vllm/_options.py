"""The ``--model-loader-extra-config`` keys of load format ``instant_staging``.

    vllm serve MODEL --load-format instant_staging \\
        --model-loader-extra-config '{"chunk_size": "8MiB", "threads": 8}'

``parse(extra)`` checks the JSON object vLLM passes (a dict) and returns an
``Options``; an unknown key, or a value of the wrong type, is a ValueError
naming it and what is accepted, in one line.  ``check_load_config`` runs it
where vLLM makes its engine arguments' ``LoadConfig``
(``EngineArgs.create_load_config``, hooked by ``register``): a typo stops
``vllm serve`` at start-up, in the process that read the command line,
rather than in each worker once the engine core is up; the loader parses
the config again when vLLM makes it (before any model is built or any
byte read).  A key left out is None: the loader's
own knob then comes from its environment variable (``INSTANT_STAGING_CHUNK_SIZE``,
``INSTANT_STAGING_IO_DEPTH``, ``INSTANT_STAGING_THREADS``), else its measured
default, exactly as for ``load_file``.  Needs no vLLM.
"""

from __future__ import annotations

import difflib
from typing import Any, NamedTuple

from ..._types import parse_size

# Bytes of checkpoint tensors on the device at once (besides the model's own
# parameters): vLLM copies each yielded tensor into its parameter (or its
# tensor-parallel slice of it) and drops it, but a load allocates all of
# its tensors up front, so an unbounded one would hold a second copy of the
# whole checkpoint on every GPU (a TP=8 rank would hold 8x its share).
# 1 GiB: the bound decided for the device memory a load adds beyond the
# model (issue 28); each batch is one load, so smaller batches cost more
# start-ups (docs/design.md, "Measured: the vLLM path's batches").  A tensor
# larger than this is a batch of its own.
BATCH_BYTES = 1 << 30


class Options(NamedTuple):
    """The validated extra config (None: the loader's default)."""

    chunk_size: int | None = None
    io_depth: int | None = None
    threads: int | None = None
    progress: bool | None = None       # None: vLLM's use_tqdm_on_load, on rank 0
    verify: bool = False
    batch_bytes: int = BATCH_BYTES
    shared_read: bool | None = None       # process_group= over vLLM's world group (None: one node)
    enable_weights_track: bool | None = None   # vLLM's DefaultModelLoader key, passed on
    weights: str | None = None            # a URL the weights come from (config files local)
    cache_dir: str | None = None          # a local cache of a URL source's objects (None: the variable's)
    max_bytes_per_second: int | None = None   # a URL source's fetches, at most (None: the variable's)


# key: (what it is, in the error message)
KEYS = {
    "chunk_size": "bytes per read and copy: an int or a size such as \"8MiB\"",
    "io_depth": "chunks in flight: an int >= 1",
    "threads": "reader threads: an int >= 1",
    "progress": "a progress bar on rank 0: true or false",
    "verify": "re-read every tensor and compare: true or false",
    "batch_bytes": "the most bytes of checkpoint tensors on the device at once: an int or a size",
    "shared_read": "each rank reads 1/N of the bytes and the ranks exchange them: true or false",
    "enable_weights_track": "vLLM's check that every parameter was loaded: true or false",
    "weights": "where the weights are, config files local: a URL such as \"s3://bucket/model/\"",
    "cache_dir": "a local cache of a URL source's objects, filled as they load: a directory",
    "max_bytes_per_second": "the most bytes a URL source is fetched at per second: an int or a size",
}


def parse(extra: Any) -> Options:
    """``Options`` from vLLM's ``model_loader_extra_config`` (a dict, maybe empty)."""
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise ValueError(f"--model-loader-extra-config for load format instant_staging must be a JSON "
                         f"object, not {type(extra).__name__}")
    unknown = sorted(k for k in extra if k not in KEYS)
    if unknown:
        close = [m[0] for k in unknown for m in [difflib.get_close_matches(str(k), KEYS, n=1)] if m]
        guess = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
        raise ValueError("unknown --model-loader-extra-config key(s) for load format instant_staging: "
                         + ", ".join(map(repr, unknown)) + guess + "; accepted: " + ", ".join(KEYS))
    values = {}
    for key, value in extra.items():
        if value is None:
            continue
        if key in ("chunk_size", "batch_bytes", "max_bytes_per_second"):
            values[key] = _size(key, value)
        elif key in ("io_depth", "threads"):
            values[key] = _count(key, value)
        elif key == "weights":
            values[key] = _url(key, value)
        elif key == "cache_dir":
            if not isinstance(value, str) or not value:
                raise _bad(key, value)
            values[key] = value
        else:
            values[key] = _flag(key, value)
    return Options(**values)


def check_load_config(load_config: Any) -> None:
    """Checks the extra config of a vLLM ``LoadConfig`` whose load format is
    ``instant_staging`` (any other is left to its own loader): the
    ValueError of ``parse``, at start-up."""
    from . import LOAD_FORMAT
    load_format = getattr(load_config, "load_format", None)
    load_format = getattr(load_format, "value", load_format)    # an older vLLM's LoadFormat enum
    if isinstance(load_format, str) and load_format.lower() == LOAD_FORMAT:
        parse(getattr(load_config, "model_loader_extra_config", None))


def _bad(key, value):
    return ValueError(f"--model-loader-extra-config {key}={value!r}: must be {KEYS[key].split(': ', 1)[-1]} "
                      f"({KEYS[key].split(': ', 1)[0]})")


def _url(key, value):
    from ...loader import is_url
    if not isinstance(value, str) or not is_url(value):
        raise _bad(key, value)
    return value


def _size(key, value):
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise _bad(key, value)
    try:
        size = parse_size(value)
    except (TypeError, ValueError):
        raise _bad(key, value) from None
    if size < 1:
        raise _bad(key, value)
    return size


def _count(key, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(key, value)
    return value


def _flag(key, value):
    if not isinstance(value, bool):
        raise _bad(key, value)
    return value


def shared_default(option: bool | None, one_node: bool) -> bool:
    """Whether a tensor-parallel load's batches are collective loads
    (``process_group=``): the extra config's ``shared_read`` where it is
    given; unset, where every rank runs on this node.  There each byte is
    read from the host once and the ranks exchange the rest over their GPU
    links, which measured faster than every rank reading everything
    (benchmarks/RESULTS.md, "tp2 with a process group"); vLLM's built-in
    instanttensor format loads collectively by default too.  Across nodes
    the exchange would cross the network that each node's own disk or page
    cache may beat, unmeasured: each rank reads everything."""
    return one_node if option is None else option
