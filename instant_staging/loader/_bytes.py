"""``load(data, device="cpu")``: ``safetensors.torch.load`` of a file held in memory.

``data`` is the whole content of a safetensors file: ``bytes``, or any
contiguous buffer (bytearray, memoryview, mmap).  It is valid exactly when
a file of those bytes is (``_header.py``: the same parser, the same rules,
the same ``SafetensorsError``), checked before any tensor is allocated, and
so is ``device`` (``_target.py``).  Where safetensors.torch.load fails on
bytes its own validation accepted (F4 and F8_E8M0 are missing from its
dtype table: KeyError; a zero-element tensor whose contiguous strides
overflow: torch's RuntimeError), the result is what its ``load_file``
returns for them.  The result is what
``safetensors.torch.load(data)`` returns, bit for bit, on ``device``, the
names in the order of their data, as ``load_file`` (safetensors' own order
here is its hash map's, different in each process); each tensor owns its memory (``data`` may be
freed or changed afterwards).  There is nothing to stage: the bytes are
already in memory, so each tensor is one copy out of ``data``.
"""

from __future__ import annotations

import sys
import warnings
from typing import TYPE_CHECKING

from ._header import header_length, parse_header
from ._target import _import_torch, _TorchTarget, parse_device
from ._typing import Device

if TYPE_CHECKING:
    import torch


def load(data: bytes, device: Device = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file whose content is ``data``.

    A drop-in for ``safetensors.torch.load``.

    Args:
        data: the bytes of a safetensors file (bytes or any contiguous
            buffer; not a str).
        device: where the tensors go: "cpu" (the default), "cuda:N", a
            torch.device or an int.

    Returns:
        ``{name: tensor}`` on ``device``.

    Raises:
        TypeError: ``data`` is a str or not a buffer.
        ValueError: ``data`` is not a contiguous buffer, or a bad device.
        SafetensorsError: content safetensors would refuse.
    """
    if isinstance(data, str):
        raise TypeError("data must be the bytes of a safetensors file, not a str "
                        "(to read a file, use load_file(path))")
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(f"data must be the bytes of a safetensors file, not {type(data).__name__}") from None
    if not view.c_contiguous:
        raise ValueError("data must be a contiguous buffer")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if sys.byteorder != "little":
        raise RuntimeError("safetensors data is little-endian; this loader needs a little-endian host")
    torch = _import_torch()
    target = _TorchTarget(torch, parse_device(torch, device))      # a bad device is named first
    size = len(view)
    length = header_length(bytes(view[:8]), size, None)
    header = parse_header(bytes(view[8:8 + length]), None, size)
    entries = header.tensors
    dtypes = [target.check(t, None) for t in entries]
    out = {}
    with warnings.catch_warnings():
        # frombuffer of read-only bytes warns that writing would be undefined;
        # they are only read, into tensors of our own.
        warnings.simplefilter("ignore", UserWarning)
        for entry, dtype in zip(entries, dtypes):
            tensor, _ = target.allocate(entry, dtype)
            if entry.nbytes:
                src = torch.frombuffer(view, dtype=torch.uint8, count=entry.nbytes, offset=entry.begin)
                tensor.reshape(-1).view(torch.uint8).copy_(src)
            out[entry.name] = tensor
    return out
