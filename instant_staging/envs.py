"""Every environment variable the package reads, in one table.

The contract:

- ``VARIABLES`` lists every ``INSTANT_STAGING_*`` variable, each once:
  its name, its type (a short text), its default and where it applies
  (the docs' texts), and ``parse``, the one parser of its value.
- Every run-time reader reads through ``get(name)`` (the parsed value) or
  ``raw(name)`` (the text); a name that is not in the table is a KeyError,
  so nothing reads a variable the table does not list.  The build-time
  variables (``parse`` None: read by ``setup.py`` and ``backends.py``,
  which must load without the package) keep their own reads, of the
  table's names (tests/core/test_envs.py checks every ``INSTANT_STAGING_*``
  text of the package, ``setup.py`` and ``_build_backend/``).
- Unset, empty and only whitespace all mean None: the reader's default
  applies.  A value is read when asked, never cached.
- ``parse`` takes the variable's text (stripped, never empty) and returns
  the value, or raises a ValueError naming the variable (the CLI makes it
  a usage error, exit 2); readers call it before anything is allocated.
- The documentation's "Environment variables" page is ``markdown_table()``'s
  output, written when the site is built (docs/_hooks.py): edit the table
  here, nowhere else.

Modelled on vLLM's ``envs.py``.  Light (the standard library and
``defaults``/``_types``), so any module may import it at import time; the
fault grammar is imported only when a spec is parsed.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

from ._types import format_size, parse_size
from .defaults import (
    CACHE_KEEP_FREE,
    CACHE_MAX_BYTES,
    CHUNK_SIZE,
    COLD_CHUNK_SIZE,
    COLD_THREADS,
    DISTRIBUTED_TIMEOUT,
    MAX_PREFAULT_THREADS,
    MAX_THREADS,
    SLOTS_PER_THREAD,
)

__all__ = ["VARIABLES", "Variable", "get", "markdown_table", "parse_text", "raw", "variable"]


@dataclass(frozen=True)
class Variable:
    """One row of the table.  ``parse``: text -> value (ValueError naming
    the variable), None for a variable read only at build time."""

    name: str
    type: str
    default: str
    applies: str
    parse: Callable[[str], Any] | None


# -- the parsers: (name, text) -> value, bound to their row's name below ------------

def _count(name: str, text: str, parse: Callable[[str], int], what: str) -> int:
    try:
        value = parse(text)
    except (TypeError, ValueError):
        value = None
    if value is None or value < 1:
        raise ValueError(f"{name}={text!r}: must be {what}")
    return value


def _size(name: str, text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError as e:         # its reason: not a number, an unknown suffix, a fraction
        raise ValueError(f"{name}={text!r}: {e}") from None
    if value < 1:
        raise ValueError(f"{name}={text!r}: must be a size of at least 1 byte (e.g. 8MiB)")
    return value


def _int_at_least_1(name: str, text: str) -> int:
    return _count(name, text, lambda s: int(s, 10), "an integer >= 1")


def _keep_or_release(name: str, text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError(f"{name}={text!r}: must be 1 (keep) or 0 (release after each load)")
    return text == "1"


_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def _on_off(name: str, text: str) -> bool:
    text = text.strip().lower()
    if text in _ON:
        return True
    if text in _OFF:
        return False
    raise ValueError(f"{name} must be 1/true/yes/on or 0/false/no/off, got {text!r}")


def _prefault_threads(name: str, text: str) -> int:
    try:
        threads = int(text)
    except ValueError:
        threads = -1
    if not 0 <= threads <= MAX_PREFAULT_THREADS:
        raise ValueError(f"{name} must be an int in [0, {MAX_PREFAULT_THREADS}], got {text!r}")
    return threads


# The longest wait a ``seconds`` variable takes: a week.  torch's and
# Python's timeouts overflow long before ``inf`` or ``1e15``, deep inside
# the call that uses them.
MAX_SECONDS = 7 * 24 * 3600


def _seconds(name: str, text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, not {text!r}") from None
    if not 0 < seconds <= MAX_SECONDS:     # (nan and inf too)
        raise ValueError(f"{name} must be > 0 and at most {MAX_SECONDS} (a week), got {text!r}")
    return seconds


def _directory(name: str, text: str) -> str:
    if "://" in text:
        raise ValueError(f"{name}={text!r}: must be a local directory, not a URL")
    return os.path.expanduser(text)


def _fault_plan(name: str, text: str):
    from .faults import FaultPlan  # imports the compiled runtime table: only when set
    try:
        return FaultPlan.parse(text)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def _row(name: str, type: str, default: str, applies: str,
         parse: Callable[[str, str], Any] | None = None) -> Variable:
    return Variable(name, type, default, applies,
                    None if parse is None else functools.partial(parse, name))


# -- the table (the docs' order) ----------------------------------------------------

VARIABLES: tuple[Variable, ...] = (
    _row("INSTANT_STAGING_BACKEND", "cuda|rocm (build)",
         "detected: CUDA where a toolkit is found, else ROCm where HIP is, else CUDA 12 from PyPI",
         "the build (`pip install`, `setup.py`): `cuda` or `rocm`; at import, a build of the "
         "other backend warns and `doctor` reports it"),
    _row("INSTANT_STAGING_CUDA", "12|13 (build)",
         "the found toolkit's major version, else 12",
         "the build: `12` or `13`"),
    _row("INSTANT_STAGING_SANITIZE", "address (build)",
         "no sanitizer",
         "the build: `address` compiles with AddressSanitizer (`tox -e asan`, docs/ASAN.md)"),
    _row("INSTANT_STAGING_FAULTS", "fault spec",
         "no faults",
         "a fault spec (docs/design.md, \"Faults\") wrapping the real runtime of every "
         "`StagingBuffer(runtime=None)`, and the loader's reads and copies; `probe --faults` "
         "replaces it",
         _fault_plan),
    _row("INSTANT_STAGING_HUGEPAGES", "bool 1/0 (true/false, yes/no, on/off)",
         "auto: huge pages where THP allows them and their 2 MiB blocks are free",
         "`StagingBuffer(hugepages=None)`: the loader's own buffer, `probe` without "
         "`--[no-]hugepages`; `1`/`true`/`yes`/`on` or `0`/`false`/`no`/`off`",
         _on_off),
    _row("INSTANT_STAGING_PREFAULT_THREADS", f"int in [0, {MAX_PREFAULT_THREADS}]",
         "one thread per 32 MiB, at most 16 and the usable CPUs, none where that is under 2 "
         "(the loader's own buffer: one per 4 MiB, at most its reader threads)",
         "`StagingBuffer(prefault_threads=None)`: the loader's own buffer, `probe` without "
         f"`--prefault-threads`; an int in [0, {MAX_PREFAULT_THREADS}], `0` turns prefaulting off",
         _prefault_threads),
    _row("INSTANT_STAGING_CHUNK_SIZE", "size",
         f"{format_size(CHUNK_SIZE)} ({format_size(COLD_CHUNK_SIZE)} for a checkpoint the page cache "
         "lacks)",
         "`chunk_size=None` of `load_file`, `iter_load`, `safe_open`, `from_pretrained`, and "
         "`load` without `--chunk-size`; a size such as `8MiB`",
         _size),
    _row("INSTANT_STAGING_IO_DEPTH", "int >= 1",
         f"{SLOTS_PER_THREAD} slots per reader thread",
         "`io_depth=None` of the same, and `load` without `--io-depth`; an int >= 1 "
         "(`load --help` shows this host's figure)",
         _int_at_least_1),
    _row("INSTANT_STAGING_THREADS", "int >= 1",
         f"one reader thread per usable CPU, at most {MAX_THREADS} ({COLD_THREADS} for a checkpoint "
         "the page cache lacks)",
         "`threads=None` of the same, and `load` without `--threads`; an int >= 1",
         _int_at_least_1),
    _row("INSTANT_STAGING_KEEP_STAGING", "bool 1/0",
         "`1`: a load keeps the staging buffer it made for the next load to the same device",
         "the loader's own staging buffer; `0` releases it when each load ends",
         _keep_or_release),
    _row("INSTANT_STAGING_CACHE_DIR", "directory",
         "no cache",
         "`cache_dir=None` of `load_file`, `iter_load`, `safe_open`, `Checkpoint.open`, and "
         "`load` without `--cache-dir`: a local cache of URL sources' objects, filled as they "
         "load (docs/design.md, \"Object storage\"); files are never cached",
         _directory),
    _row("INSTANT_STAGING_CACHE_MAX_BYTES", "size",
         format_size(CACHE_MAX_BYTES),
         "the cache's bound: the least recently used entries are removed to keep its files "
         f"under it (and {format_size(CACHE_KEEP_FREE)} of its disk free); a size such as `100GiB`",
         _size),
    _row("INSTANT_STAGING_OFFLINE", "bool 1/0 (true/false, yes/no, on/off)",
         "`HF_HUB_OFFLINE` as huggingface_hub reads it, else off",
         "URL sources: `1` serves each object from its cache entry without asking the server "
         "(no request at all; a directory or index by the objects it named when last loaded "
         "online), and an object the cache lacks is a `FileNotFoundError` naming it; `0` keeps "
         "the loader online whatever `HF_HUB_OFFLINE` says",
         _on_off),
    _row("INSTANT_STAGING_MAX_BYTES_PER_SECOND", "size",
         "no cap",
         "`max_bytes_per_second=None` of `load_file`, `iter_load`, `Checkpoint.load`: the most "
         "bytes a load fetches from object storage per second; a size such as `200MiB`",
         _size),
    _row("INSTANT_STAGING_DIST_TIMEOUT", "seconds in (0, 604800]",
         f"{DISTRIBUTED_TIMEOUT:g} (seconds)",
         "`process_group=` loads: how long a rank waits for the others at each agreement before "
         "naming the ranks that never came",
         _seconds),
)

_BY_NAME = {v.name: v for v in VARIABLES}
assert len(_BY_NAME) == len(VARIABLES), "a variable listed twice"


def variable(name: str) -> Variable:
    """The table's row of ``name``; KeyError for a name it does not list."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name!r} is not in instant_staging/envs.py's table") from None


def raw(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The variable's text, stripped; None where unset or empty.
    ``environ``: where to read it (None: ``os.environ``)."""
    variable(name)
    text = (os.environ if environ is None else environ).get(name, "").strip()
    return text or None


def parse_text(name: str, text: str | None) -> Any:
    """``text`` as the variable's value: its parser's result, None for
    None or an empty text, the stripped text itself for a build-time
    variable.  A bad value is a ValueError naming the variable."""
    row = variable(name)
    text = (text or "").strip()
    if not text:
        return None
    return text if row.parse is None else row.parse(text)


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The variable's parsed value; None where unset or empty."""
    return parse_text(name, raw(name, environ))


def markdown_table() -> str:
    """The docs' "Environment variables" table (no final newline)."""
    def cell(text):
        return text.replace("|", "\\|")
    lines = ["| variable | default | where it applies |", "| --- | --- | --- |"]
    lines += [f"| `{v.name}` | {cell(v.default)} | {cell(v.applies)} |" for v in VARIABLES]
    return "\n".join(lines)
