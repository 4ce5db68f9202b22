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
below 2**53: int64 arithmetic is exact everywhere.  Chunks of near
lengths (a tensor of one chunk or less is one) are summed together as the
rows of a batch, padded with zero words (which add nothing), so that a
model of many small tensors costs a few torch operations a batch, not
several a tensor.  Chunks are combined on the host (``B**(chunk start)``
in Python integers), one transfer of the chunks' sums per device and
call.

It detects accidents (a stale tensor, a torn or misplaced copy, a wrong
shard, a flipped bit), not an adversary: a forged tensor can be made to
match it.  Where the bytes must be proven, compare ``tensor_digest``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..defaults import DEVICE_DIGEST_BATCH_CPU, DEVICE_DIGEST_WORDS
from ._target import _import_torch

if TYPE_CHECKING:
    import torch

DEVICE_DIGEST_ALGORITHM = "poly-mod-p31-x2-le32-v1"

# (prime, base) of each lane: primes below 2**31 so that a word (< 2**32)
# times a power (< 2**31) stays below 2**63.
_LANES = ((2147483647, 1103515245 % 2147483647), (2147483629, 1664525 * 1013904223 % 2147483629))
_MASK = 0xFFFFFFFF

_tables: dict = {}      # {device: (int64 [2, n] of B_k**(j+1) mod P_k, int64 [2, 1] of P_k)}


def _power_table(torch, device, need):
    """``(table, primes)`` on ``device``: ``table[k, j] = B_k**(j+1) mod
    P_k`` for ``j < need`` (a view of a table kept per device, grown by
    doubling as longer rows come), ``primes[k, 0] = P_k``."""
    key = str(device)
    have = _tables.get(key)
    if have is None or have[0].shape[1] < need:
        size = need if have is None else max(need, min(2 * have[0].shape[1], DEVICE_DIGEST_WORDS))
        primes = torch.tensor([[p] for p, _ in _LANES], dtype=torch.int64, device=device)
        table = torch.empty(2, size, dtype=torch.int64, device=device)
        table[:, 0] = torch.tensor([b for _, b in _LANES], dtype=torch.int64, device=device)
        n = 1
        while n < size:
            m = min(n, size - n)
            step = torch.tensor([[pow(b, n, p)] for p, b in _LANES], dtype=torch.int64,
                                device=device)
            table[:, n:n + m] = table[:, :m] * step % primes
            n += m
        have = _tables[key] = (table, primes)
    return have[0][:, :need], have[1]


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


def _row_length(n, words):
    """The row length (in words) a piece of ``n <= words`` words is padded
    to: ``n`` rounded up to one of 8 steps an octave (at most 1/8 of zero
    words added), at most ``words``, so pieces of near lengths share a
    batch."""
    grain = 1 << max(0, n.bit_length() - 4)
    return max(n, min(-(-n // grain) * grain, words))


def _rows(torch, pieces, length):
    """``pieces`` (1-D uint8, each at most ``4 * length`` bytes) as the
    rows of an ``[n, length]`` int32 tensor, each padded with zero bytes
    (zero words add nothing to a sum: the padding is the algorithm's)."""
    row = 4 * length
    first = pieces[0]
    if len(pieces) == 1 and first.numel() == row and first.storage_offset() % 4 == 0 \
            and first.data_ptr() % 4 == 0:
        return first.view(torch.int32).view(1, length)
    parts = []
    zeros = None
    for piece in pieces:
        parts.append(piece)
        if piece.numel() < row:
            if zeros is None:
                zeros = torch.zeros(row, dtype=torch.uint8, device=first.device)
            parts.append(zeros[:row - piece.numel()])
    return torch.cat(parts).view(torch.int32).view(len(pieces), length)


def _row_sums(torch, rows):
    """Both lanes' sums of each row of ``rows`` (``[n, L]`` int32, the words
    of a piece at word offset 0 of itself): an int64 ``[n, 2]`` tensor on
    their device, nothing synchronised."""
    table, primes = _power_table(torch, rows.device, rows.shape[1])
    words = rows.to(torch.int64)
    words &= _MASK
    terms = words.unsqueeze(1) * table           # [n, 2, L]: every product below 2**63
    del words
    terms.remainder_(primes)
    return terms.sum(dim=2)


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

    A tensor is cut in chunks of ``words`` words; chunks of near lengths
    (every tensor of ``words`` words or fewer is one chunk) are stacked,
    padded with zero words, as the rows of batches of at most ``words``
    words, each batch's sums taken by a few torch operations: a model of
    many small tensors costs a few operations a batch, not a tensor.

    Args:
        tensors: ``{name: tensor}``, any devices, any dtypes (dense).
        words: the chunk length in 4-byte words (``DEVICE_DIGEST_WORDS``),
            and the most words a batch stacks (on a CPU, at most
            ``DEVICE_DIGEST_BATCH_CPU``): bounds the device memory a digest
            takes; it does not change the digest.

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
    # {device: {row length: [(name, word offset, piece), ...]}}
    by_device: dict = {}
    step = 4 * words
    for name, flat in flats.items():
        if flat is None:
            continue
        lengths = by_device.setdefault(flat.device, {})
        for begin in range(0, flat.numel(), step):
            piece = flat[begin:begin + step]
            length = _row_length(-(-piece.numel() // 4), words)
            lengths.setdefault(length, []).append((name, begin // 4, piece))
    chunks: dict = {name: [] for name in flats}
    for device, lengths in by_device.items():
        batch_words = min(words, DEVICE_DIGEST_BATCH_CPU) if device.type == "cpu" else words
        sums: list = []
        owners: list = []
        for length, group in lengths.items():
            per = max(1, batch_words // length)
            for i in range(0, len(group), per):
                batch = group[i:i + per]
                sums.append(_row_sums(torch, _rows(torch, [p for _, _, p in batch], length)))
                owners.extend((name, offset) for name, offset, _ in batch)
        # one transfer per device of every chunk's sums
        for (name, offset), pair in zip(owners, torch.cat(sums).cpu().tolist()):
            chunks[name].append((offset, pair))
    return {name: _combine(0 if flat is None else flat.numel(), chunks[name])
            for name, flat in flats.items()}


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
    _tables.clear()
