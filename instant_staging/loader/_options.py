"""How a load runs: ``LoadOptions``, and its knobs: arguments, else the
environment, else the defaults.

``chunk_size``, ``io_depth`` and ``threads`` left at None come from
``INSTANT_STAGING_CHUNK_SIZE`` (bytes, or a size such as ``8MiB``),
``INSTANT_STAGING_IO_DEPTH`` and ``INSTANT_STAGING_THREADS`` (integers >= 1)
where set, else from ``instant_staging/defaults.py`` (threads: one per
usable CPU, at most ``MAX_THREADS``).  Whichever way they come (argument,
variable, the CLI's flags, which read the same path), ``threads`` above
``defaults.max_reader_threads()`` (twice the usable CPUs) and ``io_depth``
above ``defaults.max_io_depth(threads)`` (64 slots per reader thread) are
capped there, with a warning on the ``instant_staging`` logger (once per
value).  Where all three are left unset, a
load whose checkpoint is not in the page cache uses the cold defaults
(``COLD_CHUNK_SIZE``, ``COLD_THREADS``) instead.  A variable's value is checked as the
argument would be; a bad one is a ValueError naming the variable, raised
before anything is allocated.  An empty variable counts as unset.  The
variables' parsers (and README's rows) are ``instant_staging/envs.py``'s.

``INSTANT_STAGING_KEEP_STAGING=0`` releases a load's own staging buffer
when the load ends instead of keeping it for the next (``_staging_pool.py``).

``dtype`` is None (the file's dtype) or a floating torch dtype (or its
name: ``"bfloat16"``, ``"bf16"``, ...); anything else is an error before
anything is allocated.
"""

import dataclasses
import logging
from typing import TYPE_CHECKING, Callable, Optional

from .. import envs
from .._types import format_size
from ..defaults import (
    CHUNK_SIZE,
    COLD_CHUNK_SIZE,
    COLD_THREADS,
    KEEP_STAGING,
    MAX_SLOTS_PER_THREAD,
    THREADS_PER_CPU,
    default_threads,
    max_io_depth,
    max_reader_threads,
    reader_threads,
    usable_cpus,
)

if TYPE_CHECKING:
    from .._staging import StagingBuffer

log = logging.getLogger("instant_staging")

ENV_CHUNK_SIZE = "INSTANT_STAGING_CHUNK_SIZE"
ENV_IO_DEPTH = "INSTANT_STAGING_IO_DEPTH"
ENV_THREADS = "INSTANT_STAGING_THREADS"
ENV_KEEP_STAGING = "INSTANT_STAGING_KEEP_STAGING"
ENV_MAX_BYTES_PER_SECOND = "INSTANT_STAGING_MAX_BYTES_PER_SECOND"

# Short names people type for the common floating dtypes (CLI --dtype too).
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "f16": "float16", "half": "float16",
                 "fp32": "float32", "f32": "float32", "float": "float32",
                 "fp64": "float64", "f64": "float64", "double": "float64"}


def knobs(chunk_size, io_depth, threads):
    """``(chunk_size, io_depth, threads)`` with None filled from the
    environment, then the defaults (threads may stay None: the loader's own),
    threads and io_depth capped to what the host can use."""
    names = {"io_depth": "io_depth" if io_depth is not None else ENV_IO_DEPTH,
             "threads": "threads" if threads is not None else ENV_THREADS}
    if chunk_size is None:
        chunk_size = envs.get(ENV_CHUNK_SIZE) or CHUNK_SIZE
    if io_depth is None:
        # None stays None: the loader gives each reader thread
        # defaults.SLOTS_PER_THREAD slots (IO_DEPTH with 16 threads).
        io_depth = envs.get(ENV_IO_DEPTH)
    if threads is None:
        threads = envs.get(ENV_THREADS)
    keep_staging()      # a bad value fails here, before anything is allocated
    threads = _capped(names["threads"], threads, max_reader_threads(),
                      f"{THREADS_PER_CPU} per usable CPU, {usable_cpus()} here")
    if threads is None or _is_count(threads):
        io_depth = _capped(names["io_depth"], io_depth, max_io_depth(threads),
                           f"{MAX_SLOTS_PER_THREAD} slots per reader thread, "
                           f"{reader_threads(threads)} threads")
    return chunk_size, io_depth, threads


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


_warned: set = set()


def _capped(name, value, cap, why):
    """``value`` at most ``cap``, saying so once per value; anything but a
    count is left for the argument checks to refuse."""
    if not _is_count(value) or value <= cap:
        return value
    if (name, value, cap) not in _warned:
        _warned.add((name, value, cap))
        log.warning("%s=%d is more than this host can use: capped at %d (%s)", name, value, cap, why)
    return cap


# The knobs a checkpoint may choose (``default_knobs()``), with the
# variable that sets each.
_KNOB_VARIABLES = {"chunk_size": ENV_CHUNK_SIZE, "io_depth": ENV_IO_DEPTH, "threads": ENV_THREADS}
KNOBS = frozenset(_KNOB_VARIABLES)


def knobs_left(chunk_size, io_depth, threads) -> frozenset:
    """The knobs the caller left to the loader (no argument and no
    variable), which the checkpoint then chooses, each on its own (a URL's
    16 MiB ranges stay where only ``threads=`` is given)."""
    given = {"chunk_size": chunk_size, "io_depth": io_depth, "threads": threads}
    return frozenset(name for name, variable in _KNOB_VARIABLES.items()
                     if given[name] is None and not envs.raw(variable))


def chosen_knobs(checkpoint, left) -> dict:
    """``checkpoint.default_knobs()`` for the knobs in ``left`` (nothing
    asked where none is left)."""
    if not left:
        return {}
    return {name: value for name, value in checkpoint.default_knobs().items() if name in left}


def is_cold(resident) -> bool:
    """Whether a checkpoint of which ``resident`` (a fraction of the sampled
    pages, ``Shards.resident()``) is in the page cache is read from
    disk: below half; never where that cannot be told (None)."""
    return resident is not None and resident < 0.5


def for_cache(resident) -> dict:
    """The knobs for a checkpoint of which ``resident`` (as ``is_cold``'s)
    is in the page cache: the cold defaults (read from disk: larger reads,
    fewer threads; ``defaults.COLD_CHUNK_SIZE``) where it is cold, none
    otherwise.  Each applies where its knob is left (``knobs_left``)."""
    if not is_cold(resident):
        return {}
    threads = default_threads(COLD_THREADS)
    log.info("%.0f%% of the sampled pages of the checkpoint are in the page cache: reading it "
             "from disk in %s pieces with %d threads (chunk_size=, io_depth=, threads= or "
             "INSTANT_STAGING_* choose otherwise)", 100 * resident, format_size(COLD_CHUNK_SIZE),
             threads)
    return {"chunk_size": COLD_CHUNK_SIZE, "io_depth": None, "threads": threads}


def bandwidth_cap(value):
    """A load's ``max_bytes_per_second``: ``value`` (an int >= 1) where given,
    else ``INSTANT_STAGING_MAX_BYTES_PER_SECOND`` (a size, per second), else
    None (no cap).  Only a URL source's fetches are capped (``_throttle.py``)."""
    if value is None:
        return envs.get(ENV_MAX_BYTES_PER_SECOND)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"max_bytes_per_second must be an int or None, not {type(value).__name__}")
    if value < 1:
        raise ValueError(f"max_bytes_per_second must be >= 1, got {value}")
    return value


def keep_staging() -> bool:
    """Whether a load keeps the staging buffer it made for the next load:
    ``INSTANT_STAGING_KEEP_STAGING`` (1 or 0) where set, else KEEP_STAGING."""
    keep = envs.get(ENV_KEEP_STAGING)
    return KEEP_STAGING if keep is None else keep


def torch_dtype(torch, dtype):
    """None, or the floating torch dtype ``dtype`` names.

    Args:
        torch: the torch module.
        dtype: None, a torch.dtype, or its name (or an alias of
            ``DTYPE_ALIASES``, any case).

    Returns:
        None for None, else the torch.dtype.

    Raises:
        TypeError: neither None, a str nor a torch.dtype.
        ValueError: a name of no torch dtype, a dtype that is not floating,
            or one that torch cannot convert floating tensors to.
    """
    if dtype is None:
        return None
    if isinstance(dtype, str):
        name = DTYPE_ALIASES.get(dtype.lower(), dtype)
        value = getattr(torch, name, None)
        if not isinstance(value, torch.dtype):
            raise ValueError(  # a str, the right type, naming no dtype
                f"dtype {dtype!r} is not a torch dtype (e.g. torch.bfloat16 or 'bfloat16')")
        dtype = value
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be None or a torch.dtype, not {type(dtype).__name__}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype (floating tensors are converted to it, "
                         f"integer and bool tensors are kept), not {dtype}")
    if not converts(torch, torch.float32, dtype):
        # float4_e2m1fn_x2: two values packed in a byte, which .to() cannot make
        raise ValueError(f"dtype {dtype} cannot be a conversion target: torch cannot convert "
                         "floating tensors to it")
    return dtype


_converts: dict = {}


def converts(torch, src, dst) -> bool:
    """Whether torch converts ``src`` tensors to ``dst`` (``Tensor.to``),
    tried once per pair on a one-element CPU tensor: torch 2.13 has no
    conversion from or to float4_e2m1fn_x2 (NotImplementedError), and one
    found only after a load read its bytes named neither file nor tensor."""
    key = (src, dst)
    if key not in _converts:
        try:
            torch.zeros(src.itemsize, dtype=torch.uint8).view(src).to(dst)
            _converts[key] = True
        except (NotImplementedError, RuntimeError, TypeError):
            _converts[key] = False
    return _converts[key]


# safetensors 0.8's storage backends (safe_open/load_file ``backend=``): it
# serves bytes from an mmap or with pread(2).  Ours reads with pread into the
# staging slots whichever is named; the name is still checked, as there.
BACKENDS = ("mmap", "pread")


def check_backend(backend) -> None:
    if not isinstance(backend, str):
        raise TypeError(f"backend must be 'mmap' or 'pread', not {type(backend).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(map(repr, BACKENDS))}")


# -- LoadOptions ---------------------------------------------------------------------

def _check_staging(staging):
    from .._staging import StagingBuffer
    if not isinstance(staging, StagingBuffer):
        raise TypeError(f"staging must be an instant_staging.StagingBuffer, not {type(staging).__name__}")
    if staging.closed:
        raise ValueError("staging buffer is closed")


def _check_args(chunk_size, io_depth, threads):
    # io_depth and threads may stay None (defaults.io_depth_for, reader_threads).
    for name, value, optional in (("chunk_size", chunk_size, False), ("io_depth", io_depth, True),
                                  ("threads", threads, True)):
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int{' or None' if optional else ''}, "
                            f"not {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """How one load runs.

    Built once from the arguments, the environment (the variables the
    environment guide lists) and the defaults, and checked there, before
    anything is opened or allocated (``build``)."""

    chunk_size: int
    """The bytes of each read: ``chunk_size=``, else
    ``INSTANT_STAGING_CHUNK_SIZE``, else ``defaults.CHUNK_SIZE``."""
    io_depth: Optional[int]
    """The staging slots (chunks in flight): ``io_depth=``, else
    ``INSTANT_STAGING_IO_DEPTH``; None: as many as the threads need
    (``defaults.io_depth_for``)."""
    threads: Optional[int]
    """The reader threads: ``threads=``, else ``INSTANT_STAGING_THREADS``;
    None: the default for this host (``defaults.reader_threads``)."""
    staging: Optional["StagingBuffer"] = None
    """The caller's staging buffer (``staging=``); None: the load's own,
    kept for the next load (``INSTANT_STAGING_KEEP_STAGING``)."""
    verify: bool = False
    """Whether the bytes are read again and compared once loaded (``verify=``)."""
    progress: Optional[Callable[[int, int], object]] = None
    """Called with ``(bytes done, bytes in all)`` as the load goes
    (``progress=``, resolved: a callable, a printer for True, or None)."""
    views: bool = True
    """Whether tensors lying back to back may share one device block
    (``views=``); False: each its own allocation (``load_into``'s)."""
    max_bytes_per_second: Optional[int] = None
    """The most bytes per second a URL source's data is fetched at
    (``max_bytes_per_second=``, else ``INSTANT_STAGING_MAX_BYTES_PER_SECOND``);
    None: no cap."""
    left: frozenset = frozenset()
    """The knobs the caller left to the loader (``knobs_left``: no argument,
    no variable), which ``for_checkpoint`` takes from the checkpoint (cold
    files, a URL), each on its own."""

    @property
    def tuned(self) -> bool:
        """Whether the caller left all three knobs to the loader (a GPU load
        of cold files then also reads them ahead into the page cache)."""
        return self.left == KNOBS

    @classmethod
    def build(cls, *, chunk_size=None, io_depth=None, threads=None, staging=None, verify=False,
              progress=None, views=True, backend="mmap",
              max_bytes_per_second=None) -> "LoadOptions":
        if not isinstance(views, bool):
            raise TypeError(f"views must be a bool, not {type(views).__name__}")
        check_backend(backend)
        resolved = knobs(chunk_size, io_depth, threads)
        _check_args(*resolved)
        if staging is not None:
            _check_staging(staging)
        cap = bandwidth_cap(max_bytes_per_second)
        left = knobs_left(chunk_size, io_depth, threads)
        return cls(*resolved, staging=staging, verify=verify, progress=_progress_callback(progress),
                   views=views, max_bytes_per_second=cap, left=left)

    def for_checkpoint(self, checkpoint) -> "LoadOptions":
        """These options with the checkpoint's own knobs in place of those
        the caller left to the loader."""
        chosen = chosen_knobs(checkpoint, self.left)
        return dataclasses.replace(self, **chosen) if chosen else self



def _progress_callback(progress):
    from ._progress import resolve  # (the progress bars import tqdm where asked)
    return resolve(progress)
