"""A buffered safetensors loader that stages file chunks through a StagingBuffer.

    from instant_staging.loader import load, load_file, iter_load, safe_open
    tensors = load_file("model_dir", "cuda:0", dtype=torch.bfloat16)
    tensors = load(data, "cuda:0")    # the bytes of a file, as safetensors.torch.load
    for name, tensor in iter_load("model.safetensors", "cuda:0"):
        ...
    with safe_open("model.safetensors", framework="pt", device="cuda:0") as f:
        shard = f.get_slice("lm_head.weight")[: vocab // 2]

A drop-in for ``safetensors.torch.load_file``, ``safetensors.torch.load``
(``_bytes.py``) and ``safetensors.safe_open``
(docs/design.md, "The loader"): ``source`` is a file, a list of files, a
directory or an index.json (``_source.py``); ``dtype``, ``names``, the
environment knobs (``_options.py``) and ``progress`` (``_progress.py``) as
documented on ``load_file``.

Every header is parsed and validated first (``SafetensorsError``, a
``ValueError``, naming the file and the tensor), before anything is
allocated.  Then each tensor gets its own allocation of the file's dtype
and shape, and reader threads (``_pipeline.pyx``, C, no GIL) read chunks
of ``chunk_size`` into the staging buffer's slots and copy them out: to a
GPU through the buffer's runtime table on their own streams, with an event
per slot so that a slot is refilled only after its copy finished; to the
CPU with memcpy.  The staging buffer holds ``io_depth`` chunks; its slots
are whole chunks inside each registration, so no chunk straddles two
registrations whatever kind the buffer reached and whatever the chunk size;
or pass one with ``staging=`` to reuse it across loads (its depth is then
what fits in it).  A load that made its own buffer keeps it for the next
load to the same device (``_staging_pool.py``; ``empty_cache()`` releases
it, ``INSTANT_STAGING_KEEP_STAGING=0`` turns keeping off).  A load holds
its staging buffer and its files until its reader threads are joined
(``_run.py``, ``_pipeline.pyx``).

torch is imported only when a load starts: ``import instant_staging``
works without it.

The loader's face for its neighbours (the CLI, the integrations, the
benchmarks), who import nothing from an underscored module of it
(tests/loader/test_public_face.py):

- ``Checkpoint`` (opened once, headers parsed once), ``LoadOptions``,
  ``TensorInfo``, ``LoadIterator`` and its ``LoadReport``;
- ``load_file``, ``iter_load``, ``load``, ``safe_open``, ``empty_cache``;
  ``wait_for_cache_fills`` (the entries of ``cache_dir=`` loads are made
  after the load returns: waits for them, ``_cache.py``);
  ``load_into`` (and ``Checkpoint.load_into``: a reload in place, ``_into.py``);
- saving: ``save_file``, ``save`` (safetensors' files byte for byte, published
  atomically; to a file or, as one multipart upload, to a bucket:
  ``_upload.py``), ``tensor_digest`` (``_save.py``); ``save_model`` (shards
  and ``model.safetensors.index.json`` as huggingface_hub writes them:
  ``_save_model.py``); deltas: ``save_delta``,
  ``apply_delta``, ``read_delta``, ``parse_delta``, ``DeltaInfo``,
  ``DeltaError`` (the format, defined once for both sides: ``_delta.py``);
- weight updates (RL): ``apply_update``, ``VersionedWeights`` (the version
  held), ``UpdateReport``, ``UpdateState``, ``UpdateRefused`` (nothing
  written), ``UpdateFailed`` (after the first write: ``_update.py``);
  ``device_digest``, ``device_digests``, ``DEVICE_DIGEST_ALGORITHM`` (a
  digest computed on the tensor's device, the same on any device:
  ``_digest.py``); ``layer_order``, ``layer_key`` (names grouped by layer
  in the model's order: ``_weight_order.py``);
- ``SafetensorsStorageWriter``: torch.distributed.checkpoint's Hugging Face
  writer, its files written as ``save_file`` writes them (``_dcp.py``;
  imported when first asked for, with torch.distributed.checkpoint);
- the errors: ``SafetensorsError``, ``LoadError``, ``VerifyError``,
  ``DistributedLoadError``, ``CheckpointChangedError`` (and its
  ``RemoteChangedError``), ``MissingNameError``;
- ``DEFAULT_CHUNK_SIZE``, ``DEFAULT_IO_DEPTH``; the variables' names
  ``ENV_CHUNK_SIZE``, ``ENV_IO_DEPTH``, ``ENV_THREADS``, ``ENV_KEEP_STAGING``;
- ``redact_url(url)``, ``redact_text(text)``: a URL (every URL in a text)
  as it may be shown, its password and signature parameters ``***``;
  ``is_url(source)`` (a URL of a scheme read here) and ``schemes_text()``
  (those schemes, as every message lists them: ``_schemes.py``);
- ``resolve_source(source)``: the shard files (``.paths``) a local source
  names, nothing opened (``Checkpoint.open`` does this itself);
- devices: ``parse_device(torch, device)`` (the name's syntax alone),
  ``resolve_device(torch, device)`` (also: this host has it);
  ``import_torch()`` (torch, or an ImportError naming the extra);
- dtypes: ``torch_dtype(torch, dtype)`` (None or a floating torch dtype,
  checked), ``DTYPE_ALIASES`` ("bf16" -> "bfloat16", ...), ``TORCH_DTYPES``
  (safetensors' dtype name -> torch's attribute name), ``DTYPE_BITS``
  (safetensors' dtype name -> bits per element);
- progress: ``resolve_progress(progress)`` (``progress=``'s value as a load
  uses it: None, a callable, or a printer for True), ``Progress`` (the
  printer: a bar or a line per tenth, in the units of
  ``instant_staging.format_size``);
- type aliases for annotations: ``Source``, ``PathLike``, ``Device``,
  ``DType``, ``Names``, ``ProgressArg``.
"""

from typing import TYPE_CHECKING

from ..defaults import CHUNK_SIZE as DEFAULT_CHUNK_SIZE
from ..defaults import IO_DEPTH as DEFAULT_IO_DEPTH
from ._bytes import load
from ._cache import wait_for_cache_fills
from ._checkpoint import Checkpoint, TensorInfo
from ._delta import DeltaError, DeltaInfo, apply_delta, parse_delta, read_delta, save_delta
from ._digest import DEVICE_DIGEST_ALGORITHM, device_digest, device_digests
from ._distributed import DistributedLoadError
from ._errors import CheckpointChangedError, LoadError, VerifyError
from ._header import DTYPE_BITS, TORCH_DTYPES, SafetensorsError
from ._into import MissingNameError
from ._load import iter_load, load_file, load_into
from ._options import (
    DTYPE_ALIASES,
    ENV_CHUNK_SIZE,
    ENV_IO_DEPTH,
    ENV_KEEP_STAGING,
    ENV_THREADS,
    LoadOptions,
    torch_dtype,
)
from ._progress import Progress
from ._progress import resolve as resolve_progress
from ._remote import RemoteChangedError, fetch_side_files
from ._run import LoadIterator, LoadReport
from ._safe_open import PrefetchLoader, safe_open
from ._save import save, tensor_digest
from ._save_file import save_file
from ._save_model import save_model
from ._schemes import is_url, redact_text, redact_url, schemes_text
from ._source import resolve as resolve_source
from ._staging_pool import empty_cache
from ._target import _import_torch as import_torch
from ._target import _resolve_device as resolve_device
from ._target import default_device, parse_device
from ._typing import Device, DType, Names, PathLike, ProgressArg, Source
from ._update import (
    UpdateFailed,
    UpdateRefused,
    UpdateReport,
    UpdateState,
    VersionedWeights,
    apply_update,
)
from ._weight_order import layer_key, layer_order

if TYPE_CHECKING:
    from ._dcp import SafetensorsStorageWriter

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_IO_DEPTH",
    "DEVICE_DIGEST_ALGORITHM",
    "DTYPE_ALIASES",
    "DTYPE_BITS",
    "ENV_CHUNK_SIZE",
    "ENV_IO_DEPTH",
    "ENV_KEEP_STAGING",
    "ENV_THREADS",
    "TORCH_DTYPES",
    "Checkpoint",
    "CheckpointChangedError",
    "DType",
    "DeltaError",
    "DeltaInfo",
    "Device",
    "DistributedLoadError",
    "LoadError",
    "LoadIterator",
    "LoadOptions",
    "LoadReport",
    "MissingNameError",
    "Names",
    "PathLike",
    "PrefetchLoader",
    "Progress",
    "ProgressArg",
    "RemoteChangedError",
    "SafetensorsError",
    "SafetensorsStorageWriter",
    "Source",
    "TensorInfo",
    "UpdateFailed",
    "UpdateRefused",
    "UpdateReport",
    "UpdateState",
    "VerifyError",
    "VersionedWeights",
    "apply_delta",
    "apply_update",
    "default_device",
    "device_digest",
    "device_digests",
    "empty_cache",
    "fetch_side_files",
    "import_torch",
    "is_url",
    "iter_load",
    "layer_key",
    "layer_order",
    "load",
    "load_file",
    "load_into",
    "parse_delta",
    "parse_device",
    "read_delta",
    "redact_text",
    "redact_url",
    "resolve_device",
    "resolve_progress",
    "resolve_source",
    "safe_open",
    "save",
    "save_delta",
    "save_file",
    "save_model",
    "schemes_text",
    "tensor_digest",
    "torch_dtype",
    "wait_for_cache_fills",
]


def __getattr__(name):
    # torch.distributed.checkpoint is imported only for the one name that needs it.
    if name == "SafetensorsStorageWriter":
        from ._dcp import SafetensorsStorageWriter
        return SafetensorsStorageWriter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
