"""Type aliases of the loader's public signatures (for annotations only)."""

import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Callable, Union

if TYPE_CHECKING:
    import torch

PathLike = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]
# A file, a directory, an index.json, or a list of files.
Source = Union[PathLike, Sequence[PathLike]]
Device = Union[str, int, "torch.device"]
DType = Union[None, str, "torch.dtype"]
Names = Union[None, Iterable[str], Callable[[str], bool]]
ProgressArg = Union[None, bool, Callable[[int, int], object]]
# cache_dir=: a directory, None (the environment's, else none) or False (none).
CacheDir = Union[None, bool, PathLike]
