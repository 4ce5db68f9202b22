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
(DESIGN.md, "The loader"): ``source`` is a file, a list of files, a
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
"""

from ..defaults import CHUNK_SIZE as DEFAULT_CHUNK_SIZE
from ..defaults import IO_DEPTH as DEFAULT_IO_DEPTH
from ._bytes import load
from ._distributed import DistributedLoadError
from ._errors import LoadError, VerifyError
from ._header import SafetensorsError
from ._load import iter_load, load_file
from ._run import LoadIterator
from ._safe_open import safe_open
from ._staging_pool import empty_cache

__all__ = [
           "DEFAULT_CHUNK_SIZE",
           "DEFAULT_IO_DEPTH",
           "DistributedLoadError",
           "LoadError",
           "LoadIterator",
           "SafetensorsError",
           "VerifyError",
           "empty_cache",
           "iter_load",
           "load",
           "load_file",
           "safe_open",
]
