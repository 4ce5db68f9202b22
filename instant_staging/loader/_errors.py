"""The loader's errors, and the safetensors classes they also belong to.

Where the safetensors package is importable, ``SafetensorsError`` (an
invalid file, a ``safe_open`` used after close) is also a
``safetensors.SafetensorError`` and a missing tensor of a ``safe_open`` is
also one (as well as a ``KeyError``), so that code written against
safetensors (``except SafetensorError``) catches ours; without safetensors
they are a ``ValueError`` and a ``KeyError`` only.  A file that does not
exist is a ``FileNotFoundError`` whose message is safetensors' ("No such
file or directory: PATH"), its ``errno`` ENOENT.

Importing safetensors here costs about a millisecond, a small part of
``import instant_staging.loader`` and paid once (docs/design.md,
"Measured: importing safetensors"); ``import instant_staging`` does not
import the loader.  A server that loads models has usually imported it
already (transformers does).
"""

import errno

try:
    from safetensors import SafetensorError as UpstreamError
except ImportError:          # safetensors is optional
    class UpstreamError(Exception):  # type: ignore[no-redef]
        """Without safetensors: what its SafetensorError would be (an empty
        base, never raised by itself)."""


class LoadError(RuntimeError):
    """Loading failed after the headers were validated.

    A read, a copy, a file that shrank.  ``path`` and ``tensor`` say where,
    where known; ``code`` is the errno or the runtime's error code.
    """

    def __init__(self, message, path=None, tensor=None, code=0):
        super().__init__(message)
        self.path = path
        self.tensor = tensor
        self.code = code

    def __reduce__(self):
        # Every attribute survives pickling (multi-rank loads send errors).
        return (type(self), (str(self), self.path, self.tensor, self.code))


class VerifyError(LoadError):
    """verify=True found a tensor whose memory differs from its file bytes."""


class CheckpointChangedError(LoadError):
    """A file (or object) of an open checkpoint is not the one it was opened
    at: a load of it would read the new bytes at the old header's offsets.
    Raised before any byte of the load is read where the change is seen
    then; ``Checkpoint.reopen()`` opens the source again, as it is now."""


class MissingTensorError(KeyError, UpstreamError):
    """``safe_open`` has no tensor of that name (safetensors raises its
    SafetensorError, torch code expects a KeyError: both catch it)."""


def not_found(path: str) -> FileNotFoundError:
    """safetensors' FileNotFoundError for ``path`` (its message exactly)."""
    e = FileNotFoundError(f"No such file or directory: {path}")
    e.errno = errno.ENOENT        # filename stays None: it would change str(e)
    return e
