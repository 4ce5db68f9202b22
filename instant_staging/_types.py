"""The public value types of the state machine: Kind, Attempt and the errors."""

import enum
import math
import re
from typing import NamedTuple, Optional


class Kind(enum.Enum):
    """How a StagingBuffer's memory became (or did not become) pinned."""

    REGISTERED = "registered"          # ordinary memory, one host_register
    SEGMENTED = "segmented"            # ordinary memory, one register per segment
    RUNTIME_PINNED = "runtime_pinned"  # cudaHostAlloc / hipHostMalloc
    PAGEABLE = "pageable"              # ordinary memory, not pinned (opt-in)

    @property
    def pinned(self) -> bool:
        return self is not Kind.PAGEABLE


# The steps of docs/design.md, in the order the state machine may enter them.
STEPS = ("allocate", "prefault", "register", "register_segment", "rollback",
         "runtime_alloc", "pageable")


class Attempt(NamedTuple):
    """One step or one runtime call of the state machine, as it happened.

    ``code`` and ``name`` are the runtime's own (0 and "" where the step made
    no runtime call or it succeeded); ``offset`` and ``size`` are the byte
    range of the buffer the step covered; ``seconds`` its wall time.
    """

    step: str
    ok: bool
    code: int = 0
    name: str = ""
    offset: int = 0
    size: int = 0
    seconds: float = 0.0


class StagingError(RuntimeError):
    """No staging buffer could be made.

    ``attempts`` says what was tried, ``code`` is the last runtime code (0
    where no runtime call failed).
    """

    def __init__(self, message: str, attempts: tuple[Attempt, ...] = (),
                 code: Optional[int] = None):
        super().__init__(message)
        self.attempts = tuple(attempts)
        if code is None:
            codes = [a.code for a in self.attempts if a.code]
            code = codes[-1] if codes else 0
        self.code = code

    def __reduce__(self):
        # Multi-rank loaders send errors between processes: every attribute
        # survives pickling (the default would call __init__(message) only).
        return (type(self), (str(self), self.attempts, self.code))


class _RetainedMemoryError(StagingError):
    """A StagingError after which memory is retained: ``retained_ranges``
    are the ``(ptr, size)`` ranges that may still be registered, oldest
    first (ascending address), never freed while they may be."""

    def __init__(self, message: str, attempts=(), code=None, retained_ranges=()):
        super().__init__(message, attempts, code)
        self.retained_ranges = tuple((int(p), int(n)) for p, n in retained_ranges)

    def __reduce__(self):
        return (type(self), (str(self), self.attempts, self.code, self.retained_ranges))


class RollbackError(_RetainedMemoryError):
    """A segmented registration failed and undoing it failed too.

    The memory is retained (never freed while it may still be registered);
    ``retained_ranges`` are the ranges still registered.
    """


class ReleaseError(_RetainedMemoryError):
    """Releasing a buffer failed.

    The runtime refused to unregister (or to free) its memory, which is
    leaked on purpose, never freed while it may still be registered;
    ``retained_ranges`` are the ranges left, ``code`` is the runtime's last
    code.
    """


class RuntimeCallError(RuntimeError):
    """A runtime call made from Python failed (``Runtime.check``).

    ``call`` names it, ``code`` and ``name`` are the runtime's own.  The
    pending error was cleared on the same runtime before this was raised.
    """

    def __init__(self, call: str, code: int, name: str):
        super().__init__(f"{call} failed with {name} ({code})")
        self.call, self.code, self.name = call, code, name

    def __reduce__(self):
        return (type(self), (self.call, self.code, self.name))


_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


# Every size and rate this package shows (CLI, progress, logs, errors) is in
# these binary units, the ones its sizes are given in (--chunk-size 8MiB):
# format_size and format_rate, nowhere else.


def format_size(n: int) -> str:
    """A byte count in binary units: 2147483648 -> '2 GiB'; 1536 -> '1.5 KiB'; 100 -> '100 B'.

    Args:
        n: bytes.

    Returns:
        The text: whole numbers without decimals, others with at most two.
    """
    for unit, scale in _UNITS:
        if n >= scale:
            value = n / scale
            text = f"{value:.0f}" if value == int(value) else f"{value:.2f}".rstrip("0").rstrip(".")
            return f"{text} {unit}"
    return f"{n} B"


def format_rate(bytes_per_second: float, digits: int = 1) -> str:
    """Bytes a second in format_size's units: 36.3e9 -> '33.8 GiB/s';
    5e6 -> '4.8 MiB/s'; 100 -> '100 B/s'."""
    for unit, scale in _UNITS:
        if bytes_per_second >= scale:
            return f"{bytes_per_second / scale:.{digits}f} {unit}/s"
    return f"{bytes_per_second:.0f} B/s"


def parse_size(text) -> int:
    """A size in bytes: '2GiB', '256 MiB', '4096', '1.5KiB' -> bytes.

    Args:
        text: an int (returned as it is) or a string: a number, optionally
            with a KiB, MiB, GiB or B suffix (any case, spaces ignored).

    Returns:
        The bytes, an int.

    Raises:
        TypeError: neither an int nor a string (a bool included).
        ValueError: any other string: not a number, not a whole,
            non-negative number of bytes, or beyond any number of bytes.
    """
    if isinstance(text, bool):
        raise TypeError("size must be an int or a string such as '2GiB'")
    if isinstance(text, int):
        return text
    if not isinstance(text, str):
        raise TypeError(f"size must be an int or a string such as '2GiB', not {type(text).__name__}")
    s = text.strip().replace(" ", "")
    scale = 1
    for unit, unit_scale in _UNITS + (("B", 1),):
        if s.lower().endswith(unit.lower()):
            s, scale = s[: -len(unit)], unit_scale
            break
    try:
        value = float(s) if "." in s else int(s, 10)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use bytes or a KiB/MiB/GiB suffix)") from None
    if not math.isfinite(value * scale):      # "1.e999": int() of inf would raise OverflowError
        raise ValueError(f"not a size: {text!r} (beyond any number of bytes)")
    result = int(value * scale)
    if result != value * scale or result < 0:
        raise ValueError(f"not a whole, non-negative number of bytes: {text!r}")
    return result


def read_text(path):
    """The text of a host file (``/proc``, ``/sys``), or None when it cannot
    be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


MEMINFO = "/proc/meminfo"


def parse_meminfo(text):
    """``{'MemTotal': bytes, ...}`` from the text of /proc/meminfo (values
    in kB), ``{}`` for None."""
    out = {}
    for line in (text or "").splitlines():
        match = re.match(r"(\w+):\s+(\d+)(?:\s+kB)?", line)
        if match:
            out[match.group(1)] = int(match.group(2)) * (1024 if "kB" in line else 1)
    return out
