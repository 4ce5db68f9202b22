"""A digest of a tensor's bytes computed where the tensor is: ``device_digest``.

``tensor_digest`` (``_save.py``, sha256, what ``save_file(...,
digests=True)`` writes) hashes on the host: a model on a GPU would have
to be copied back to be checked.  ``device_digest`` is computed with torch
integer operations on the tensor's own device, so a server can return a
digest of every tensor it installed and the trainer can compute the same
digest of what it sent (on its GPU or its CPU) and compare, with no copy
of the model crossing the bus: the same bytes give the same digest on
any device.

The algorithm (``DEVICE_DIGEST_ALGORITHM``), integers only, so that no
reduction order or rounding can make two devices disagree:

- the tensor's bytes (row-major, as ``tensor.view(-1)`` lays them out)
  are read as ``W = ceil(nbytes / 4)`` little-endian unsigned 32-bit words
  ``w_0 .. w_{W-1}``, the last one padded with zero bytes;
- for each lane ``k`` (two), with a prime ``P_k`` below 2**31 and a base
  ``B_k``: ``h_k = sum(w_i * B_k**(i + 1) for i < W) mod P_k`` (a
  polynomial hash: a change of any words is missed by a lane only where
  ``B_k`` is a root of the difference polynomial mod ``P_k``; a change of
  one word is never missed);
- the digest is ``f"{nbytes:x}:{h_1:08x}{h_2:08x}"``.

Every product ``w_i * (B**(i+1) mod P)`` is below 2**63 and reduced mod
``P`` before it is summed; a chunk of ``DEVICE_DIGEST_WORDS`` terms sums
below 2**53: int64 arithmetic is exact everywhere.  Chunks are combined
on the host (``B**(chunk start)`` in Python integers), one transfer of
the chunks' sums per call.

It detects accidents (a stale tensor, a torn or misplaced copy, a wrong
shard, a flipped bit), not an adversary: a forged tensor can be made to
match it.  Where the bytes must be proven, compare ``tensor_digest``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..defaults import DEVICE_DIGEST_WORDS
from ._target import _import_torch

if TYPE_CHECKING:
    import torch

DEVICE_DIGEST_ALGORITHM = "poly-mod-p31-x2-le32-v1"

# (prime, base) of each lane: primes below 2**31 so that a word (< 2**32)
# times a power (< 2**31) stays below 2**63.
_LANES = ((2147483647, 1103515245 % 2147483647), (2147483629, 1664525 * 1013904223 % 2147483629))
_MASK = 0xFFFFFFFF

_powers: dict = {}      # {(device, lane): int64 tensor of B**(j+1) mod P, at most DEVICE_DIGEST_WORDS}


def _power_table(torch, device, lane, need):
    """``B**(j+1) mod P`` for ``j < need`` on ``device`` (a view of a table
    kept per device and lane, grown by doubling as longer chunks come)."""
    key = (str(device), lane)
    table = _powers.get(key)
    if table is None or table.numel() < need:
        prime, base = _LANES[lane]
        size = max(need, min(2 * table.numel(), DEVICE_DIGEST_WORDS)) if table is not None else need
        table = torch.empty(size, dtype=torch.int64, device=device)
        table[0] = base
        n = 1
        while n < size:
            m = min(n, size - n)
            table[n:n + m] = table[:m] * pow(base, n, prime) % prime
            n += m
        _powers[key] = table
    return table[:need]


def _flat_bytes(torch, tensor):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"device_digest takes a torch.Tensor, not {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"device_digest takes a dense (strided) tensor, not a {tensor.layout} one")
    t = tensor.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return None
    return t.reshape(-1).view(torch.uint8)


def _words(torch, piece):
    """``piece`` (1-D uint8) as int64 words in [0, 2**32), padded with zero
    bytes to a multiple of 4."""
    n = piece.numel()
    aligned = n % 4 == 0 and piece.data_ptr() % 4 == 0
    if not aligned:
        padded = torch.zeros(-(-n // 4) * 4, dtype=torch.uint8, device=piece.device)
        padded[:n] = piece
        piece = padded
    return piece.view(torch.int32).to(torch.int64) & _MASK


def _chunk_sums(torch, flat, words):
    """``[(word offset, lane sums tensor of 2), ...]`` of ``flat``'s chunks,
    on its device, nothing synchronised."""
    out = []
    step = 4 * words
    for begin in range(0, flat.numel(), step):
        w = _words(torch, flat[begin:begin + step])
        sums = []
        for lane, (prime, _) in enumerate(_LANES):
            table = _power_table(torch, flat.device, lane, w.numel())
            sums.append(((w * table) % prime).sum())
        out.append((begin // 4, torch.stack(sums)))
    return out


def _combine(nbytes, chunks):
    """The digest of ``nbytes`` bytes from its chunks' ``(word offset, (s_1, s_2))``
    on the host."""
    lanes = []
    for lane, (prime, base) in enumerate(_LANES):
        h = 0
        for offset, sums in chunks:
            h = (h + int(sums[lane]) % prime * pow(base, offset, prime)) % prime
        lanes.append(h)
    return f"{nbytes:x}:{lanes[0]:08x}{lanes[1]:08x}"


def device_digests(tensors: Mapping[str, torch.Tensor], *,
                   words: int = DEVICE_DIGEST_WORDS) -> dict[str, str]:
    """``{name: device_digest(tensor)}`` of ``tensors``, computed on each
    tensor's device with one transfer of the partial sums per device.

    Args:
        tensors: ``{name: tensor}``, any devices, any dtypes (dense).
        words: the chunk length in 4-byte words (``DEVICE_DIGEST_WORDS``):
            bounds the device memory a digest takes; it does not change the
            digest.

    Returns:
        ``{name: digest}`` in ``tensors``' order.

    Raises:
        TypeError, ValueError: a value that is not a dense torch tensor.
    """
    torch = _import_torch()
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of names to tensors, not "
                        f"{type(tensors).__name__}")
    if type(words) is not int or words <= 0:
        raise ValueError(f"words must be an int > 0, not {words!r}")
    flats = {name: _flat_bytes(torch, t) for name, t in tensors.items()}
    pending: dict = {}
    for name, flat in flats.items():
        if flat is not None:
            pending[name] = _chunk_sums(torch, flat, words)
    # one transfer per device of every chunk's sums
    by_device: dict = {}
    for name, chunks in pending.items():
        by_device.setdefault(chunks[0][1].device, []).append(name)
    host: dict = {}
    for names in by_device.values():
        stacked = torch.stack([s for n in names for _, s in pending[n]]).cpu().tolist()
        i = 0
        for n in names:
            k = len(pending[n])
            host[n] = [(offset, stacked[i + j]) for j, (offset, _) in enumerate(pending[n])]
            i += k
    out = {}
    for name, flat in flats.items():
        out[name] = _combine(0, []) if flat is None else _combine(flat.numel(), host[name])
    return out


def device_digest(tensor: torch.Tensor) -> str:
    """The digest of ``tensor``'s bytes, computed on its own device with
    integer operations (the module's docstring): equal for equal bytes on
    any device, CPU or GPU; a non-contiguous tensor is digested as
    ``tensor.contiguous()``'s bytes.

    Raises:
        TypeError: not a torch tensor.
        ValueError: a sparse tensor.
    """
    return device_digests({"": tensor})[""]


def clear_digest_tables() -> None:
    """Drops the power tables kept per device (``DEVICE_DIGEST_WORDS`` int64
    words per lane and device)."""
    _powers.clear()
