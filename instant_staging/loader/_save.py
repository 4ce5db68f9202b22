"""``save_file`` and ``save``: safetensors' own files, written at the disk's speed.

A drop-in for ``safetensors.torch.save_file`` and ``safetensors.torch.save``
(docs/guides/saving.md).  The file is equal byte for byte to the one
safetensors writes for the same tensors (``tests/loader/test_save.py``
compares them for every dtype), by safetensors' own rules:

- the header is compact JSON (no spaces; names in UTF-8, control
  characters, ``"`` and ``\\`` escaped as serde_json escapes them), padded
  with spaces to a multiple of 8 bytes, after its 8-byte little-endian
  length;
- ``__metadata__`` comes first where ``metadata`` is not None (even empty);
  then the tensors, ordered by their dtype's alignment, largest first, in
  safetensors' dtype order (``SAVE_ORDER``), then by name; their data in
  the same order, back to back;
- F4 (``float4_e2m1fn_x2``, two values a byte) is written with its last
  dimension doubled; a 0-d one is an error, as in safetensors.

safetensors keeps ``metadata`` in a hash map, so the order of two or more
keys in its header changes from one process to the next; here they keep
the dict's order.  Bad input is refused as safetensors refuses it, before
the file is opened: not a dict (ValueError), a value that is not a tensor
(ValueError), a sparse tensor (ValueError), tensors sharing memory
(RuntimeError: ``save_model`` is the way), a non-contiguous tensor
(ValueError), a name or metadata that is not a str (TypeError); and,
where safetensors fails less clearly or writes a file nobody can read: a
dtype safetensors has no name for, a tensor on the meta device, a tensor
named ``__metadata__`` (ValueError each).  A tensor with torch's lazy
conjugate or negative bit is written with its values (safetensors writes
the memory under them).

Where the bytes go: a CPU tensor is written straight from its memory; a
device tensor is copied in chunks into a pinned staging buffer (the one a
load to that device kept, ``_staging_pool.py``, else a new one kept in its
turn) on a stream of the save's own that first waits for the device's
current stream (the trainer's last kernels), and each chunk is written by
one of the writer threads while the next ones are copied; a slot is
copied into again only after its write returned.  Host memory beyond the
model: that buffer, never a host copy of the model.

Publishing (``save_file``): the file is written under a temporary name
beside the target (``.<name>.<random>.tmp``, created with O_EXCL, never
followed through a link), synced, renamed over the target and its
directory synced (``sync=False`` leaves out both syncs: then only a
crash of the machine, not of the process, may lose the new file).  A
reader opening the target sees the old file or the new one whole; a save
that fails removes its temporary file; a save killed by a signal leaves
the old file and its temporary file, whose name no later save uses.

To a bucket (``save_file("s3://...")``, ``_save_file.py``): the same bytes as one multipart
upload, ``_upload.py``.

Our own metadata, only when asked for: ``version=`` writes
``instant_staging.version``; ``digests=True`` writes
``instant_staging.digests``, a JSON object ``{"algorithm": DIGEST_ALGORITHM,
"tensors": {name: hex}}`` of every tensor's ``tensor_digest``, computed
from the bytes as they are written.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import queue
import secrets
import struct
import sys
import threading
import traceback
from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

from ..defaults import DIGEST_BLOCK, SAVE_CHUNK_SIZE, SAVE_SLOTS, SAVE_THREADS, default_threads
from ._header import MAX_HEADER_BYTES, TORCH_DTYPES, SafetensorsError
from ._schemes import is_url
from ._target import _import_torch

if TYPE_CHECKING:
    import torch


# safetensors' dtypes in the order a file holds them: by alignment, largest
# first, ties in the order of safetensors' Dtype enum, reversed (its
# ``prepare`` sorts by dtype, descending, then by name).
SAVE_ORDER = ("U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16",
              "F8_E5M2FNUZ", "F8_E4M3FNUZ", "F8_E8M0", "F8_E4M3", "F8_E5M2", "I8", "U8", "F4",
              "BOOL")
_RANK = {name: i for i, name in enumerate(SAVE_ORDER)}

# Our metadata keys (docs/guides/saving.md): written only when asked for.
VERSION_KEY = "instant_staging.version"
DIGESTS_KEY = "instant_staging.digests"
DIGEST_ALGORITHM = f"sha256-of-sha256-blocks-{DIGEST_BLOCK}"
_DIGEST_HEX = 64


class Entry(NamedTuple):
    """One tensor of a file being written; ``begin`` counts from the data section."""

    name: str
    dtype: str
    shape: tuple
    tensor: object      # a 1-D uint8 view of the tensor's bytes (None when empty)
    begin: int
    nbytes: int


class Plan(NamedTuple):
    """What a save writes: the header (with placeholders where digests go)
    and the tensors in file order."""

    entries: list
    metadata: dict | None
    digests: bool
    header: bytes

    @property
    def data_start(self) -> int:
        return 8 + len(self.header)

    @property
    def size(self) -> int:
        return self.data_start + sum(e.nbytes for e in self.entries)

    def final_header(self, digests: dict | None) -> bytes:
        """The header with the digests filled in (the same length)."""
        if not self.digests:
            return self.header
        header = _header(_with_digests(self.metadata, digests), self.entries)
        assert len(header) == len(self.header)
        return header


def save(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None, *,
         version: str | None = None, digests: bool = False) -> bytes:
    """The bytes of the safetensors file of ``tensors``.

    A drop-in for ``safetensors.torch.save``: the same bytes.  Arguments as
    ``save_file``'s.
    """
    torch = _import_torch()
    plan = make_plan(tensors, metadata, version=version, digests=digests)
    out = bytearray(plan.size)
    start = plan.data_start
    if plan.size > start:
        dest = torch.frombuffer(out, dtype=torch.uint8)
        for e in plan.entries:
            if e.nbytes:
                dest[start + e.begin:start + e.begin + e.nbytes].copy_(e.tensor)
    found = None
    if plan.digests:
        view = memoryview(out)
        found = {e.name: _digest_of(view[start + e.begin:start + e.begin + e.nbytes])
                 for e in plan.entries}
    header = plan.final_header(found)
    out[:8] = struct.pack("<Q", len(header))
    out[8:start] = header
    return bytes(out)


def tensor_digest(tensor: torch.Tensor) -> str:
    """The digest of a tensor's bytes, as ``save_file(..., digests=True)``
    writes it: hex of the sha256 of the concatenated sha256 digests of its
    bytes in blocks of ``DIGEST_BLOCK`` (1 MiB; the last one shorter; none
    for an empty tensor).  Equal for equal bytes on any device."""
    torch = _import_torch()
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor_digest takes a torch.Tensor, not {type(tensor).__name__}")
    flat = _bytes_view(torch, tensor.detach().contiguous().resolve_conj().resolve_neg())
    if flat is None:
        return hashlib.sha256().hexdigest()
    outer = hashlib.sha256()
    for begin in range(0, flat.numel(), DIGEST_BLOCK):
        block = flat[begin:begin + DIGEST_BLOCK].cpu()
        outer.update(hashlib.sha256(_host_view(block, block.numel())).digest())
    return outer.hexdigest()


# -- the plan -------------------------------------------------------------------------

def make_plan(tensors, metadata, *, version=None, digests=False, allow_shared=False) -> Plan:
    """Checks ``tensors`` and ``metadata`` as safetensors does and lays the
    file out; nothing is written.  ``allow_shared``: tensors sharing memory
    are written each with its bytes (the DCP writer's tied names)."""
    torch = _import_torch()
    check_tensor_dict(torch, tensors)
    sparse = [name for name, tensor in tensors.items() if tensor.layout != torch.strided]
    if sparse:
        raise ValueError(f"You are trying to save sparse tensors: `{sparse}`, which safetensors "
                         "does not hold: make them dense with `.to_dense()` first")
    shared = None if allow_shared else _shared(torch, tensors)
    if shared:
        raise RuntimeError(f"Some tensors share memory: {shared}; a file would hold those bytes "
                           "twice and load them back apart.  Save one name of each group (or "
                           "save_model, which keeps one of tied weights) or .clone() the others")
    names = {}
    for name, tensor in tensors.items():
        if not tensor.is_contiguous():
            raise ValueError(f"You are trying to save a non contiguous tensor: `{name}`, which is "
                             "not allowed: save the whole tensor and slice it after loading, or "
                             "call `.contiguous()` on it first")
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, not {type(name).__name__} ({name!r})")
        if name == "__metadata__":
            raise ValueError("a tensor may not be named '__metadata__': the header keeps the "
                             "metadata under that name")
        names[name] = _dtype_name(torch, name, tensor)
    meta = _checked_metadata(metadata)
    if version is not None:
        if not isinstance(version, str):
            raise TypeError(f"version must be a str, not {type(version).__name__}")
        meta = _merged(meta, VERSION_KEY, version)
    if digests:
        meta = _merged(meta, DIGESTS_KEY, "")     # its value is filled in below
    order = sorted(names, key=lambda n: (_RANK[names[n]], n))
    entries = []
    offset = 0
    for name in order:
        tensor = tensors[name].detach().resolve_conj().resolve_neg()
        dtype = names[name]
        shape = tuple(tensor.shape)
        if dtype == "F4":
            if not shape:
                raise SafetensorsError("a 0-d F4 tensor holds two 4-bit values in one byte; "
                                       "safetensors has no shape for it", tensor=name)
            shape = shape[:-1] + (shape[-1] * 2,)
        nbytes = tensor.numel() * tensor.element_size()
        entries.append(Entry(name, dtype, shape, _bytes_view(torch, tensor), offset, nbytes))
        offset += nbytes
    if digests:
        meta = _with_digests(meta, {e.name: "0" * _DIGEST_HEX for e in entries})
    header = _header(meta, entries)
    if len(header) > MAX_HEADER_BYTES:
        raise ValueError(f"the header would take {len(header)} bytes, more than safetensors "
                         f"reads ({MAX_HEADER_BYTES})")
    return Plan(entries, meta, digests, header)


def check_tensor_dict(torch, tensors):
    """Raises safetensors' ValueError where ``tensors`` is not a mapping or
    one of its values is not a torch.Tensor (the names are checked later)."""
    if not isinstance(tensors, Mapping):
        raise ValueError(f"Expected a dict of [str, torch.Tensor] but received {type(tensors)}")
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"Key `{name}` is invalid, expected torch.Tensor but received "
                             f"{type(tensor)}")


def _checked_metadata(metadata):
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a dict of str to str, not {type(metadata).__name__}")
    out = {}
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            bad = key if not isinstance(key, str) else value
            raise TypeError(f"metadata must map str to str: {key!r}: {value!r} holds a "
                            f"{type(bad).__name__}")
        out[key] = value
    return out


def _merged(meta, key, value):
    meta = dict(meta or {})
    if key in meta and meta[key] != value and value:
        raise ValueError(f"metadata already holds {key!r} ({meta[key]!r}): pass it once")
    meta[key] = value
    return meta


def _with_digests(meta, digests):
    meta = dict(meta)
    meta[DIGESTS_KEY] = json.dumps({"algorithm": DIGEST_ALGORITHM, "tensors": digests},
                                   ensure_ascii=False, separators=(",", ":"))
    return meta


def _header(meta, entries) -> bytes:
    obj = {}
    if meta is not None:
        obj["__metadata__"] = meta
    for e in entries:
        obj[e.name] = {"dtype": e.dtype, "shape": list(e.shape),
                       "data_offsets": [e.begin, e.begin + e.nbytes]}
    # serde_json's compact form: Python's json escapes what it escapes, the
    # same way (control characters as \u00xx, lower case), and no more with
    # ensure_ascii=False.  A lone surrogate cannot be encoded (safetensors'
    # UnicodeEncodeError too).
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return text + b" " * (-len(text) % 8)


def _dtype_name(torch, name, tensor):
    names = _torch_names(torch)
    found = names.get(tensor.dtype)
    if found is None:
        raise ValueError(f"tensor {name!r}: safetensors has no dtype for {tensor.dtype} (it holds "
                         f"{', '.join(sorted(names.values()))})")
    if tensor.device.type == "meta":
        raise ValueError(f"tensor {name!r} is on the meta device: it has no data to save")
    return found


_NAMES: dict = {}


def _torch_names(torch):
    if not _NAMES:
        for name, attribute in TORCH_DTYPES.items():
            dtype = getattr(torch, attribute, None)
            if dtype is not None:
                _NAMES[dtype] = name
    return _NAMES


def _shared(torch, tensors):
    """safetensors' rule for tensors that may not be saved together: those
    whose storages are one (same device, address and size) and whose byte
    ranges overlap, taken in address order, each range compared with the one
    before it.  Tensors without storage (meta, empty) share nothing."""
    groups = {}
    for name, tensor in tensors.items():
        if tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() == 0 or storage.nbytes() == 0:
            continue
        groups.setdefault((tensor.device, storage.data_ptr(), storage.nbytes()), []).append(name)
    failing = []
    for names in groups.values():
        if len(names) < 2:
            continue
        areas = sorted((tensors[n].data_ptr(), _end(tensors[n]), n) for n in names)
        current, last_stop = {areas[0][2]}, areas[0][1]
        for start, stop, name in areas[1:]:
            if start >= last_stop:
                if len(current) > 1:
                    failing.append(current)
                current = {name}
            else:
                current.add(name)
            last_stop = stop
        if len(current) > 1:
            failing.append(current)
    return failing


def _end(tensor):
    if tensor.numel() == 0:
        return tensor.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return tensor.data_ptr() + (last + 1) * tensor.element_size()


def _bytes_view(torch, tensor):
    """A 1-D uint8 view of a contiguous tensor's bytes, or None when it has none."""
    if tensor.numel() == 0:
        return None
    return tensor.reshape(-1).view(torch.uint8)


def _host_view(flat, nbytes):
    """A writable memoryview of a CPU uint8 tensor's ``nbytes`` bytes (the
    caller keeps the tensor alive)."""
    return memoryview((ctypes.c_char * nbytes).from_address(flat.data_ptr())).cast("B")


def _digest_of(view):
    outer = hashlib.sha256()
    for begin in range(0, len(view), DIGEST_BLOCK):
        outer.update(hashlib.sha256(view[begin:begin + DIGEST_BLOCK]).digest())
    return outer.hexdigest()


# -- publishing -------------------------------------------------------------------------

def _target_path(filename):
    if isinstance(filename, (str, bytes)) or hasattr(filename, "__fspath__"):
        path = os.fsdecode(os.fspath(filename))
    else:
        raise TypeError(f"filename must be a str or os.PathLike, not {type(filename).__name__}")
    if is_url(path):
        return path
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
    return path


def publish(plan: Plan, path: str, *, sync=True, staging=None, chunk=SAVE_CHUNK_SIZE,
            threads=None, stage_cpu=False) -> None:
    """Writes ``plan`` under a temporary name beside ``path``, then renames it
    there (the module's docstring).  ``stage_cpu`` sends CPU tensors through
    the staging buffer too (the tests' way to run the staged path without a
    GPU); ``chunk`` is a multiple of DIGEST_BLOCK where digests are asked."""
    with published(path, sync=sync) as fd:
        os.ftruncate(fd, plan.size)
        if not plan.digests:
            _pwrite_all(fd, memoryview(struct.pack("<Q", len(plan.header)) + plan.header), 0)
        found = write_entries(fd, plan, chunk=chunk, threads=threads, staging=staging,
                              stage_cpu=stage_cpu)
        if plan.digests:
            header = plan.final_header(found)
            _pwrite_all(fd, memoryview(struct.pack("<Q", len(header)) + header), 0)


@contextlib.contextmanager
def published(path, *, sync=True):
    """Yields a descriptor open for writing on a new file beside ``path``
    (``.<name>.<random>.tmp``, created with O_EXCL, never followed through a
    link); once the block returns, the file is synced, closed, renamed over
    ``path`` and its directory synced (``sync=False`` leaves out both
    syncs).  A block that raises leaves ``path`` as it was and the
    temporary file removed."""
    directory, base = os.path.split(os.path.abspath(path))
    temp = os.path.join(directory, f".{base[:200]}.{secrets.token_hex(8)}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
    done = False
    try:
        try:
            yield fd
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temp, path)
        done = True
    finally:
        if not done:
            try:
                os.unlink(temp)
            except OSError:
                pass
    if sync:
        _sync_dir(directory)


def _sync_dir(directory):
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return      # a directory we may not open: the rename itself stands
    try:
        os.fsync(dfd)
    except OSError:
        pass        # some file systems refuse fsync of a directory (EINVAL)
    finally:
        os.close(dfd)


def _pwrite_all(fd, view, offset):
    while len(view):
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, f"write returned {n} with {len(view)} bytes left")
        view = view[n:]
        offset += n


# -- the writers ----------------------------------------------------------------------

class _Slot(NamedTuple):
    offset: int
    size: int


def write_entries(fd, plan, *, chunk=SAVE_CHUNK_SIZE, threads=None, staging=None,
                  stage_cpu=False):
    """Writes every tensor's bytes at its place in ``fd`` with writer threads;
    returns ``{name: digest}`` where the plan asks for digests, else None."""
    torch = _import_torch()
    if plan.digests and chunk % DIGEST_BLOCK:
        raise ValueError(f"chunk ({chunk}) must be a multiple of DIGEST_BLOCK ({DIGEST_BLOCK})")
    start = plan.data_start
    blocks = {e.name: [None] * (-(-e.nbytes // DIGEST_BLOCK)) for e in plan.entries} \
        if plan.digests else None
    direct, staged = [], {}
    for piece in pieces(plan.entries, chunk, whole=plan.digests, stage_cpu=stage_cpu):
        if piece.device is None:
            direct.append(piece)
        else:
            staged.setdefault(piece.device, []).append(piece)
    nthreads = threads or default_threads(SAVE_THREADS)
    work = queue.SimpleQueue()
    failed = []
    stop = threading.Event()

    def record(view, piece):
        if blocks is None:
            return
        e, begin, _ = piece.parts[0]      # a piece of one tensor where digests are asked
        first = begin // DIGEST_BLOCK
        for i, b in enumerate(range(0, len(view), DIGEST_BLOCK)):
            blocks[e.name][first + i] = hashlib.sha256(view[b:b + DIGEST_BLOCK]).digest()

    def writer():
        while True:
            item = work.get()
            if item is None:
                return
            views, piece, event, release = item
            del item        # a slot's view must not outlive its write
            try:
                if not stop.is_set():
                    if event is not None:
                        event.synchronize()
                    _pwritev_all(fd, views, start + piece.begin)
                    record(views[0], piece)
            except BaseException as exc:
                # Its frames hold the slot's view: cleared, or the buffer could
                # never be closed while the caller keeps the error.
                traceback.clear_frames(exc.__traceback__)
                failed.append(exc)
                stop.set()
            finally:
                del views
                if release is not None:
                    release()

    workers = [threading.Thread(target=writer, name=f"instant_staging-save-{i}", daemon=True)
               for i in range(nthreads)]
    for w in workers:
        w.start()
    try:
        for piece in direct:
            work.put(([_host_view(e.tensor, e.nbytes)[begin:begin + n]
                       for e, begin, n in piece.parts], piece, None, None))
        for device, group in staged.items():
            if stop.is_set():
                break
            _write_staged(torch, device, group, work, stop, chunk, nthreads, staging)
    except BaseException:
        stop.set()
        raise
    finally:
        for _ in workers:
            work.put(None)
        for w in workers:
            w.join()
    if failed:
        raise failed[0]
    if blocks is None:
        return None
    return {name: hashlib.sha256(b"".join(parts)).hexdigest() for name, parts in blocks.items()}


# One pwritev takes at most this many buffers (EINVAL beyond).
try:
    _MAX_PARTS = max(1, os.sysconf("SC_IOV_MAX"))
except (ValueError, OSError):
    _MAX_PARTS = 1024


class Piece(NamedTuple):
    """One write: ``size`` bytes at ``begin`` of the data section, made of
    ``parts`` ``(entry, offset in the tensor, bytes)`` back to back, all of
    tensors on ``device`` (None: CPU tensors written from their memory)."""

    device: object
    begin: int
    size: int
    parts: tuple


def pieces(entries, chunk, *, whole=False, stage_cpu=False):
    """The writes of ``entries`` (in file order): at most ``chunk`` bytes,
    tensors of one device packed together (a fine-grained checkpoint's
    small tensors take one write per chunk, not one each); with ``whole``,
    each piece of one tensor, starting at a multiple of ``chunk`` of it
    (its digest's blocks are whole in one piece)."""
    out = []
    parts, device, begin, size = [], None, 0, 0
    for e in entries:
        if not e.nbytes:
            continue
        where = None if e.tensor.device.type == "cpu" and not stage_cpu else e.tensor.device
        if parts and (where != device or whole or len(parts) == _MAX_PARTS):
            out.append(Piece(device, begin, size, tuple(parts)))
            parts, size = [], 0
        device = where
        offset = 0
        while offset < e.nbytes:
            if not parts:
                begin = e.begin + offset
            n = min(e.nbytes - offset, chunk - size)
            parts.append((e, offset, n))
            size += n
            offset += n
            if size == chunk:
                out.append(Piece(device, begin, size, tuple(parts)))
                parts, size = [], 0
    if parts:
        out.append(Piece(device, begin, size, tuple(parts)))
    return out


def _pwritev_all(fd, views, offset):
    if len(views) == 1:
        _pwrite_all(fd, views[0], offset)
        return
    total = sum(len(v) for v in views)
    n = os.pwritev(fd, views, offset)
    if n == total:
        return
    for v in views:     # a short write: the rest one buffer at a time
        if n >= len(v):
            n -= len(v)
            offset += len(v)
            continue
        _pwrite_all(fd, v[n:], offset + n)
        offset += len(v)
        n = 0


def _write_staged(torch, device, group, work, stop, chunk, nthreads, staging):
    """Copies the pieces of ``group`` (of tensors on ``device``) into the
    slots of a staging buffer and hands each to the writers; returns once
    every slot is back (written) and the buffer is given back."""
    from . import _staging_pool

    cuda = device.type == "cuda"
    index = device.index if cuda else None
    if cuda and index is None:
        index = torch.cuda.current_device()
    want = chunk * min(SAVE_SLOTS, max(2, 2 * nthreads))
    own = staging is None
    if own and not cuda:
        raise ValueError(f"staging through the host needs a staging buffer for {device}")
    buf = _staging_pool.own(index, want, chunk) if own else staging
    free = queue.SimpleQueue()
    slots = _slots(buf, chunk)
    if not slots:
        raise ValueError(f"the staging buffer ({buf.size} bytes in registrations of "
                         f"{buf.segment_size}) holds no slot of {chunk} bytes")
    for s in slots:
        free.put(s)
    host = buf.as_tensor()
    memory = memoryview(buf)
    stream = None
    if cuda:
        stream = torch.cuda.Stream(device=device)
        # The tensors' last writers are kernels on the device's current stream.
        stream.wait_stream(torch.cuda.current_stream(device))
    slot = None         # a slot taken and not yet handed to a writer
    try:
        for piece in group:
            if stop.is_set():
                return
            slot = free.get()
            event = copy_piece(torch, piece, host, slot.offset, stream)

            def release(slot=slot):
                free.put(slot)
            work.put(([memory[slot.offset:slot.offset + piece.size]], piece, event, release))
            slot = None
    finally:
        if slot is not None:
            free.put(slot)      # (one returned twice only makes the wait below shorter)
        # Every slot back: no copy lands in, and no write reads from, the
        # buffer once it is given back (an interrupted save included).
        if stream is not None:
            stream.synchronize()
        for _ in slots:
            free.get()
        del host, memory
        if own:
            _staging_pool.give(index, buf)


def copy_piece(torch, piece, host, at, stream):
    """Copies ``piece``'s parts back to back into ``host`` (a byte tensor of
    pinned memory) from byte ``at``: on ``stream`` (a device's), returning
    an event recorded after the copies, or at once (``stream`` None: CPU
    tensors), returning None."""
    if stream is None:
        for e, begin, n in piece.parts:
            host[at:at + n].copy_(e.tensor[begin:begin + n])
            at += n
        return None
    with torch.cuda.stream(stream):
        for e, begin, n in piece.parts:
            host[at:at + n].copy_(e.tensor[begin:begin + n], non_blocking=True)
            at += n
        event = torch.cuda.Event()
        event.record(stream)
    return event


def _slots(buf, chunk):
    """Whole slots of ``chunk`` bytes inside each registration of ``buf``
    (a copy may not cross two), at most SAVE_SLOTS."""
    out = []
    for begin, size in buf.segments or ((0, buf.size),):
        for offset in range(begin, begin + size - chunk + 1, chunk):
            out.append(_Slot(offset, chunk))
            if len(out) == SAVE_SLOTS:
                return out
    return out


if sys.byteorder != "little":   # pragma: no cover - no such host runs CUDA
    raise ImportError("safetensors data is little-endian; saving needs a little-endian host")
