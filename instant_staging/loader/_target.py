"""Where tensors go: torch tensors on the CPU or one GPU.

torch is imported only when a load starts: ``import instant_staging``
works without it.
"""

import logging
import os

from . import _entries
from ._header import TORCH_DTYPES, SafetensorsError, torch_shape
from ._options import converts

# torch's caching allocator (c10/cuda/CUDACachingAllocator.cpp): requests of
# at most 1 MiB come from its small pool; larger ones are rounded up to
# 512 bytes and may be cut out of any larger free block it holds.
_SMALL_POOL_MAX = 1 << 20
_BLOCK_ROUND = 512

log = logging.getLogger("instant_staging")


def _import_torch():
    """torch, imported.

    Returns:
        The torch module.

    Raises:
        ImportError: torch is not installed (naming the extra to install).
    """
    try:
        import torch
    except ImportError:
        raise ImportError("instant_staging.loader needs torch: "
                          "pip install 'instant_staging[torch]'") from None
    return torch


class _TorchTarget:
    """Allocates one torch tensor per file tensor on ``device`` (a
    torch.device, parsed at the door: ``_prepare.parse_target``)."""

    def __init__(self, torch, device, dtype=None):
        from ._pipeline import DEVICE, HOST
        self.torch = torch
        self.device = on_host(torch, device)
        # dtype=: floating tensors are converted on the device once loaded
        # (as transformers does); integer and bool tensors keep theirs.
        self.dtype = dtype
        self.mode = HOST if self.device.type == "cpu" else DEVICE
        self.index = self.device.index or 0
        self._checked = {}      # file dtype -> torch dtype, once check() passed it

    def check(self, entry, path):
        """The torch dtype of ``entry``; SafetensorsError if torch lacks it
        or cannot give it its shape."""
        dtype = self._checked.get(entry.dtype) if entry.nbytes else None
        if dtype is None:
            dtype = self._check(entry, path)
            self._checked[entry.dtype] = dtype
        return dtype

    def dtypes(self, entries, paths):
        """``check()`` of each of ``entries`` (``[(file index, entry)]``,
        ``paths`` by file index), asked once per file dtype (and for each
        tensor without bytes, whose shape torch must take): asked per
        tensor, the calls were a noticeable part of a fine-grained MoE
        load's preparation (docs/design.md, "Measured: the header table")."""
        def miss(k):
            i, entry = entries[k]
            return self.check(entry, paths[i])
        return _entries.dtypes(entries, self._checked, miss)

    def _check(self, entry, path):
        dtype = getattr(self.torch, TORCH_DTYPES[entry.dtype], None)
        if dtype is None:
            raise SafetensorsError(f"dtype {entry.dtype} is not supported by torch "
                                   f"{self.torch.__version__}", path, entry.name)
        if (self.dtype is not None and dtype.is_floating_point and dtype != self.dtype
                and not converts(self.torch, dtype, self.dtype)):
            raise ValueError(f"{path or '<safetensors>'}: tensor {entry.name!r}: dtype {entry.dtype} "
                             f"({dtype}) cannot be converted to {self.dtype} by torch: load it "
                             "without dtype= (or leave it out with names=)")
        if not entry.nbytes:
            try:
                self._empty(entry, dtype, "cpu")      # no memory: zero elements
            except (RuntimeError, TypeError, OverflowError) as e:
                raise SafetensorsError(f"torch cannot make a tensor of shape {list(entry.shape)}: "
                                       f"{e}", path, entry.name) from None
        return dtype

    def _empty(self, entry, dtype, device):
        # As safetensors makes a zero-element tensor (an empty one viewed
        # with the shape): the same strides, the same shapes refused.
        return self.torch.empty(0, dtype=dtype, device=device).view(torch_shape(entry))

    def allocate(self, entry, dtype):
        if not entry.nbytes:
            t = self._empty(entry, dtype, self.device)
        else:
            t = self.torch.empty(torch_shape(entry), dtype=dtype, device=self.device)
            self._after_fill()
        return t, t.data_ptr()

    def _after_fill(self):
        # Under torch.use_deterministic_algorithms(True) torch.empty fills new
        # memory (NaN, or the dtype's largest value) with a kernel queued on
        # the current stream; our copies run on other streams and would race
        # it (a loaded byte overwritten after its copy).  So wait for it.
        torch = self.torch
        if (self.device.type != "cpu" and torch.are_deterministic_algorithms_enabled()
                and torch.utils.deterministic.fill_uninitialized_memory):
            torch.cuda.current_stream(self.device).synchronize()

    def placed(self):
        """``(handles, addresses)`` of every tensor, in reading order, where
        the destinations are given before the load (``_into.InPlace``);
        None: the load allocates them (``allocate``, ``allocate_blocks``)."""
        return None

    def joins(self, dtype, views):
        """Whether a tensor of ``dtype`` may be a view into a block
        (``_blocks.pyx``, where a tensor without bytes never is one): views
        asked for, a GPU target, and no conversion after loading."""
        return (views and self.device.type != "cpu"
                and not (self.dtype is not None and dtype.is_floating_point and dtype != self.dtype))

    def allocate_blocks(self, run_list, entries, dtypes):
        """One allocation per block run (``_blocks.Run``), all before the
        first copy (a cudaMalloc made while copies run cost more than one
        made before: benchmarks/RESULTS.md, the withdrawn reserve blocks).
        Returns ``{run index: block}``; a block torch cannot allocate in
        one piece is left out, and its tensors get their own allocations."""
        blocks = {}
        for r, run in enumerate(run_list):
            if run.block:
                try:
                    blocks[r] = self.torch.empty(run.nbytes, dtype=self.torch.uint8, device=self.device)
                except self.torch.cuda.OutOfMemoryError:
                    pass
        if blocks:
            self._after_fill()
        return blocks

    def addresses(self, run, block, entries):
        """The device address of each tensor of ``run`` in ``block``."""
        base = block.data_ptr() - run.begin
        return [base + entries[k][1].begin for k in range(run.first, run.stop)]

    def views(self, run, block, entries, dtypes):
        """The handles of ``run``'s tensors in ``block``: views, made when
        ``tensor()`` is asked for, as each finishes (tensors of their own
        are ``allocate()``'s)."""
        return [_View(block, entries[k][1].begin - run.begin, entries[k][1], dtypes[k])
                for k in range(run.first, run.stop)]

    def tensor(self, handle):
        """The tensor of a handle of ``allocate()`` or ``views()``."""
        if type(handle) is not _View:
            return handle
        dtype = handle.dtype
        # set_ rather than block[a:b].view(dtype).view(shape): one call, and
        # the tensor is no autograd view of the block (no ._base).
        return self.torch.empty(0, dtype=dtype, device=self.device).set_(
            handle.block.untyped_storage(), handle.offset // dtype.itemsize, torch_shape(handle.entry))

    def place(self, handle):
        """``(bytes, offset)``: the flat uint8 tensor that the bytes of a
        handle of ``allocate()`` or ``views()`` lie in (its block, or the
        tensor itself), and where they begin there."""
        if type(handle) is _View:
            return handle.block, handle.offset
        return handle.reshape(-1).view(self.torch.uint8), 0

    def reserve(self, entries):
        """Makes torch's caching allocator hold one free block as large as
        the load's large tensors together, so that allocating them cuts
        that block instead of calling cudaMalloc per tensor (or per 20 MiB
        segment) while the reader threads issue their copies.

        A block freed at once, on the current stream, with no work queued:
        the tensors allocated next take it.  Nothing happens where torch
        does not cache (PYTORCH_NO_CUDA_MEMORY_CACHING, another allocator
        backend) or the block does not fit (the tensors may still fit in
        blocks torch already holds)."""
        if self.device.type == "cpu" or not _caching(self.torch):
            return
        total = sum(-(-e.nbytes // _BLOCK_ROUND) * _BLOCK_ROUND
                    for e in entries if e.nbytes > _SMALL_POOL_MAX)
        if not total:
            return
        try:
            block = self.torch.empty(total, dtype=self.torch.uint8, device=self.device)
        except self.torch.cuda.OutOfMemoryError:
            return
        del block

    def before_copies(self):
        # A block torch hands out may still be read by kernels queued on
        # its current stream; our copies run on other streams.
        if self.device.type != "cpu":
            self.torch.cuda.current_stream(self.device).synchronize()

    def result(self, handle):
        if self.dtype is not None and handle.is_floating_point() and handle.dtype != self.dtype:
            return handle.to(self.dtype)
        return handle

    def equal(self, handle, offset, data):
        """Whether the bytes of ``handle`` at ``offset`` are ``data``."""
        torch = self.torch
        flat = handle.reshape(-1).view(torch.uint8)
        expected = torch.frombuffer(data, dtype=torch.uint8).to(self.device)
        return torch.equal(flat[offset:offset + len(data)], expected)


class _View:
    """A tensor of a block, made when it is handed out."""

    __slots__ = ("block", "dtype", "entry", "offset")

    def __init__(self, block, offset, entry, dtype):
        self.block, self.offset, self.entry, self.dtype = block, offset, entry, dtype


def _caching(torch):
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "") not in ("", "0"):
        return False
    backend = getattr(torch.cuda.memory, "get_allocator_backend", None)
    return backend is None or backend() == "native"


def _resolve_device(torch, device):
    """The torch.device of ``device``, with its index, once CUDA says it is there.

    Args:
        torch: the torch module.
        device: "cpu", "cuda:N", an int or a torch.device.

    Returns:
        The torch.device.

    Raises:
        TypeError: another type.
        ValueError: naming it, for anything torch cannot parse, this loader
            cannot load to, or this host does not have.
    """
    return on_host(torch, parse_device(torch, device))


def on_host(torch, device):
    """``device``, a torch.device ``parse_device`` gave, found on this host
    (with its index: the current GPU's where it named none); a ValueError
    naming it where this host lacks it.  The device is parsed once, at the
    door; this only asks the host."""
    if device.type == "cpu":
        return device
    # Checked here, before anything is allocated: without a GPU the first
    # failure would otherwise come from pinning the staging buffer.
    if not torch.cuda.is_available():
        raise ValueError(f"device {device} is not available: this torch sees no GPU "
                         "(torch.cuda.is_available() is False); load to 'cpu' instead")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.index >= torch.cuda.device_count():
        raise ValueError(f"device {device} is not available: this torch sees "
                         f"{torch.cuda.device_count()} GPU(s)")
    return device


def parse_device(torch, device):
    """The torch.device ``device`` names, whether or not this host has it.

    ``_resolve_device``'s rules for the name alone (the CLI's usage check).

    Args:
        torch: the torch module.
        device: "cpu", "cuda:N", a GPU index or a torch.device.

    Returns:
        The torch.device, of a kind this loader loads to (the CPU, a CUDA
        or ROCm GPU).

    Raises:
        TypeError: another type.
        ValueError: a name torch cannot parse, or a device of another kind.
    """
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"device must be 'cpu', 'cuda:N', a GPU index or a torch.device, "
                        f"not {type(device).__name__} {device!r}")
    given = device
    try:
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, ValueError, OverflowError) as e:
        # torch's RuntimeError ("Device string must not be empty") names nothing
        raise ValueError(f"device {given!r} is not a device: {e}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or a CUDA/ROCm device ('cuda:N'), not {given!r}")
    return device


def default_device():
    """Where a load given no device goes (``from_pretrained``, the CLI's ``load``).

    The choice is said on the ``instant_staging`` logger at INFO.

    Returns:
        The current CUDA device ("cuda:N") where torch sees one, else "cpu".

    Raises:
        ImportError: torch is not installed.
    """
    torch = _import_torch()
    chosen = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    log.info("no device given: loading onto %s (%s)", chosen,
             "the current CUDA device" if chosen != "cpu" else "torch sees no GPU")
    return chosen
