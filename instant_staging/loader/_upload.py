"""``save_file`` to a bucket: one multipart upload that appears whole or not at all.

``save_file(tensors, "s3://bucket/key")`` (and every other scheme the
loader reads from a bucket: ``_schemes.SCHEMES``' s3, gcs and azure rows)
sends the bytes ``save`` would return as one multipart upload through
obstore (``obstore.put(..., use_multipart=True)``): parts of
``part_size`` bytes, ``concurrency`` of them in flight; an object of one
part or less goes as one PUT (atomic too, two requests fewer).  The store is made
as a load makes it (``_schemes.Stores``: the same ``storage_options=``,
environment and credentials).

Atomic publishing comes from the service: the object exists only once the
upload is completed, after its last part, and a completed upload replaces
the old object in one step (S3's CompleteMultipartUpload, GCS's XML API
equivalent, Azure's Put Block List).  A failure part-way (a part the
server refuses after the client's retries, an error here while the bytes
are produced) makes obstore abort the upload: no object, or the old one
unchanged, and no parts left behind where the service can abort.

Where the bytes come from, without a host copy of the model: the header,
then the tensors' bytes in file order (``_save.pieces``).  A CPU tensor's
bytes are handed to the client as they lie (it keeps the view until the
part holding it is sent).  A device tensor is copied, one part-sized piece
at a time, into a slot of a pinned staging buffer (the one a load to that
device kept, or ``staging=``), on a stream of the save's own that first
waits for the device's current stream; the slot is handed to the client
and taken again only once the client dropped its view of it (the view's
finalizer gives it back), so the copies of the next pieces overlap the
sends of the earlier ones.  The client keeps at most ``concurrency`` parts
in flight and one being filled, each across at most two pieces: with
``concurrency + 3`` slots one is always free or about to be.

``digests=True`` needs every digest in the header, which goes first: they
are computed from the tensors before the upload (``tensor_digest``, one
more pass over the bytes).
"""

from __future__ import annotations

import hashlib
import queue
import struct
import weakref

from ..defaults import SAVE_CHUNK_SIZE, SAVE_SLOTS, UPLOAD_CONCURRENCY, UPLOAD_MAX_PARTS
from ._save import Plan, _host_view, copy_piece, pieces, tensor_digest
from ._schemes import (
    SCHEMES,
    ClientPanic,
    Stores,
    describe,
    load_obstore,
    no_credentials,
    no_panic,
    redact_url,
    scheme_of,
)
from ._target import _import_torch

# A slot the client may still read is waited for this long after the
# upload returned (success or failure) before the buffer is given up
# (not given back to the pool: memory that might still be read is never reused).
_RELEASE_WAIT = 30.0


# The stores read but never written here: a web server's, the Hub's (its
# uploads are huggingface_hub's own: upload_folder).
_READ_ONLY = ("http", "hub")


def saveable_schemes() -> str:
    """The schemes ``save_file`` uploads to, as messages list them."""
    return ", ".join(f"{name}://" for name, row in SCHEMES.items() if row.store not in _READ_ONLY)


def check_url(url: str) -> None:
    """A ValueError where ``url`` is not one ``save_file`` can upload to."""
    row = scheme_of(url)
    if row is None or row.store in _READ_ONLY:
        raise ValueError(f"{redact_url(url)}: saving goes to a local file or a bucket "
                         f"({saveable_schemes()}); a URL of this scheme is read-only here")


def part_size(size: int, chunk: int = SAVE_CHUNK_SIZE) -> int:
    """Bytes per part for an object of ``size`` bytes: ``chunk``, or a
    multiple of it where ``size`` would need more than UPLOAD_MAX_PARTS."""
    per = -(-size // UPLOAD_MAX_PARTS)
    return max(1, -(-per // chunk)) * chunk


def upload(plan: Plan, url: str, *, storage_options=None, staging=None, part=None,
           concurrency=None, stage_cpu=False) -> None:
    """Sends ``plan``'s file to ``url`` as one multipart upload (the module's
    docstring).  ``part``: bytes per part (None: ``part_size``; S3 asks at
    least 5 MiB of every part but the last); ``stage_cpu`` sends CPU tensors
    through the staging buffer too (the tests' way to run the staged path
    without a GPU)."""
    check_url(url)
    stores = Stores(storage_options)
    store, key = stores.split(url)
    if not key or key.endswith("/"):
        raise ValueError(f"{redact_url(url)}: no object name after the bucket")
    obstore = load_obstore()
    header = plan.header
    if plan.digests:
        header = plan.final_header({e.name: tensor_digest(e.tensor) if e.tensor is not None
                                    else hashlib.sha256().hexdigest() for e in plan.entries})
    part = part or part_size(plan.size)
    concurrency = concurrency or UPLOAD_CONCURRENCY
    stream = _Stream(plan, header, part, concurrency, staging, stage_cpu)
    try:
        with no_panic(url):
            obstore.put(store, key, stream.source, use_multipart=plan.size > part,
                        chunk_size=part, max_concurrency=stream.concurrency)
    except ClientPanic:
        raise
    except Exception as e:
        if stream.error is not None:
            raise stream.error from None    # ours, raised inside the client's loop
        missing = no_credentials(e, redact_url(url), "uploading")
        if missing is not None:
            raise missing from None
        raise OSError(f"{redact_url(url)}: the upload failed, nothing was published: "
                      f"{describe(e)}") from None
    finally:
        stream.close()


class _Stream:
    """The file's bytes as an iterator of buffers, for ``obstore.put``."""

    def __init__(self, plan, header, part, concurrency, staging, stage_cpu):
        self.plan = plan
        self.header = struct.pack("<Q", len(header)) + header
        self.part = part
        self.groups = pieces(plan.entries, part, stage_cpu=stage_cpu)
        self.staging = staging
        self.error = None
        self.concurrency = concurrency
        self._buf = None
        self._own = False
        self._index = None
        self._free = None
        self._slots = ()
        if any(p.device is not None for p in self.groups):
            self._take_buffer(concurrency)
        # What the client iterates over (a generator: closed early by close()).
        self.source = self._produce()

    def _take_buffer(self, concurrency):
        from . import _staging_pool
        torch = _import_torch()
        devices = {p.device for p in self.groups if p.device is not None}
        device = next(iter(devices))
        cuda = device.type == "cuda"
        # Kept within a load's staging buffer where the part size allows.
        fits = max(1, (SAVE_SLOTS * SAVE_CHUNK_SIZE) // self.part - 3)
        self.concurrency = min(concurrency, fits)
        want = (self.concurrency + 3) * self.part
        if self.staging is None:
            if not cuda:
                raise ValueError(f"staging through the host needs a staging buffer for {device}")
            self._index = device.index if device.index is not None else torch.cuda.current_device()
            self._buf = _staging_pool.own(self._index, want, self.part)
            self._own = True
        else:
            self._buf = self.staging
        slots = []
        for begin, size in self._buf.segments or ((0, self._buf.size),):
            slots.extend(range(begin, begin + size - self.part + 1, self.part))
        need = 4 if self.staging is not None else self.concurrency + 3
        if len(slots) < need:
            buf, self._buf = self._buf, None
            if self._own:
                _staging_pool.give(self._index, buf)
            raise ValueError(f"the staging buffer ({self._buf.size} bytes) holds {len(slots)} "
                             f"slots of {self.part} bytes; an upload needs {need}")
        # The client keeps at most concurrency parts in flight and one being
        # filled: with that many slots and three more, one is always coming back.
        self.concurrency = min(self.concurrency, len(slots) - 3)
        self._slots = slots
        self._free = queue.SimpleQueue()
        for s in slots:
            self._free.put(s)

    def _produce(self):
        try:
            yield self.header
            yield from self._bytes()
        except Exception as exc:
            # The client reports it as its own error (after aborting the
            # upload); kept here so that save_file raises it as it was.
            self.error = exc
            raise

    def _bytes(self):
        torch = _import_torch()
        memory = memoryview(self._buf) if self._buf is not None else None
        host = self._buf.as_tensor() if self._buf is not None else None
        streams = {}
        taken = None        # a slot taken and not handed over (its copy may run)
        pending = None      # (view, slot, event): copied, not yet handed over
        try:
            for piece in self.groups:
                if piece.device is None:
                    if pending is not None:
                        handed, pending = self._hand(*pending), None
                        yield handed
                        del handed
                    for e, begin, n in piece.parts:
                        view = _host_view(e.tensor, e.nbytes)[begin:begin + n]
                        yield view
                        del view
                    continue
                taken = self._free.get()
                stream = None
                if piece.device.type == "cuda":
                    stream = streams.get(piece.device)
                    if stream is None:
                        stream = streams[piece.device] = torch.cuda.Stream(device=piece.device)
                        # The tensors' last writers are kernels on the current stream.
                        stream.wait_stream(torch.cuda.current_stream(piece.device))
                event = copy_piece(torch, piece, host, taken, stream)
                # This piece's copy runs while the one before it is sent.
                before, pending = pending, (taken, piece.size, event)
                taken = None
                if before is not None:
                    handed = self._hand(*before)
                    yield handed
                    del handed
            if pending is not None:
                handed, pending = self._hand(*pending), None
                yield handed
                del handed
        finally:
            # Stopped early (the client gave up, or an error here): the
            # slots never handed over come back now, once no copy lands.
            for s in streams.values():
                s.synchronize()
            if taken is not None:
                self._free.put(taken)
            if pending is not None:
                self._free.put(pending[0])
            del host, memory

    def _hand(self, slot, size, event):
        """The slot's bytes as a view the client keeps; the slot comes back
        when the client drops it."""
        if event is not None:
            event.synchronize()
        view = memoryview(self._buf)[slot:slot + size]
        weakref.finalize(view, self._free.put, slot)
        return view

    def close(self):
        """Stops the producer, waits for every slot to come back and gives
        the buffer back."""
        self.source.close()
        if self._buf is None:
            return
        from . import _staging_pool
        back = 0
        try:
            for _ in self._slots:
                self._free.get(timeout=_RELEASE_WAIT)
                back += 1
        except queue.Empty:
            pass
        buf, self._buf = self._buf, None
        if self._own and back == len(self._slots):
            _staging_pool.give(self._index, buf)
