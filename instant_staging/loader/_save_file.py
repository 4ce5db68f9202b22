"""save_file: the door of a save, to a file or to a bucket.

A file is written and published by ``_save.publish`` (a temporary name
beside the target, synced, renamed); a bucket's URL is one multipart
upload (``_upload.upload``).  Both take the same plan (``_save.make_plan``:
safetensors' header and order, every check made before anything is
written).  The door sits above both so that the upload, which streams the
plan's pieces (``_save.pieces``), and the file writer stay one way down.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from . import _upload
from ._save import _target_path, make_plan, publish
from ._schemes import is_url
from ._typing import PathLike

if TYPE_CHECKING:
    import torch

    from .._staging import StagingBuffer


def save_file(tensors: Mapping[str, torch.Tensor], filename: PathLike,
              metadata: Mapping[str, str] | None = None, *, version: str | None = None,
              digests: bool = False, sync: bool = True,
              staging: StagingBuffer | None = None, storage_options: dict | None = None) -> None:
    """Writes ``tensors`` to ``filename`` in safetensors format, atomically.

    A drop-in for ``safetensors.torch.save_file``: the same file, byte for
    byte.  Device tensors are copied through a pinned staging buffer in
    chunks while writer threads write the chunks already copied.

    Args:
        tensors: ``{name: tensor}``, contiguous and dense, on the CPU or a
            GPU (any mix).
        filename: where the file goes (str or os.PathLike), or a bucket's
            URL (s3://, gs://, az://, ...: one multipart upload).  It
            appears there whole or not at all: written under a temporary
            name in the same directory, then renamed (an upload: completed,
            or aborted).
        metadata: ``{str: str}`` kept in the header, as safetensors keeps it.
        version: a version id written as ``instant_staging.version``.
        digests: write every tensor's ``tensor_digest`` as
            ``instant_staging.digests``.
        sync: fsync the file before the rename and its directory after it
            (default True).
        staging: a ``StagingBuffer`` to copy device tensors through; None:
            the one a load to that device kept, else a new one.
        storage_options: for a URL, the object store's options, as a
            load takes them (credentials, endpoint, ``client_options``,
            ``retry_config``); else unused.

    Raises:
        ValueError, RuntimeError, TypeError: as ``safetensors.torch.save_file``
            for the same input (the module's docstring lists them), before
            the file is opened.
        OSError: the file could not be written (nothing is left of it), or
            the upload failed (nothing was published; the old object stays).
    """
    path = _target_path(filename)
    if is_url(path):
        _upload.check_url(path)
        plan = make_plan(tensors, metadata, version=version, digests=digests)
        _upload.upload(plan, path, storage_options=storage_options, staging=staging)
        return
    plan = make_plan(tensors, metadata, version=version, digests=digests)
    publish(plan, path, sync=sync, staging=staging)
