"""A load into given tensors (``_into.py``): its destinations checked and
their addresses gathered in C, one pass each over them.

Every check runs before any byte is written, and a fine-grained MoE
checkpoint has thousands of destinations: checked tensor by tensor in
Python (each attribute asked in a loop of its own: device, contiguity,
overlap, then dtype, shape, then each address for the copies' joins and
again for the readers), they were most of what a load into tensors spent
before its first copy beyond what ``load_file`` spends (docs/design.md,
"Measured: a load into tensors, per tensor").  Here each pass reads each
tensor's attributes once through the Python API, without the
interpreter's loop, and keeps them in arrays:

- ``check`` (at the door, no checkpoint needed): every destination a
  dense, contiguous torch tensor on the one device, none overlapping
  another;
- ``places`` (the checkpoint opened, its selection known): in reading
  order, each destination's dtype and shape against its tensor's, and its
  address;
- ``joins``: which copies continue the one before (``Plan(joins=)``),
  the allocation holding each destination asked of the driver in C
  (``Allocations``).

Each error is the one ``_into.py`` documents, its wording here.
"""

from collections.abc import Callable
from typing import Any

from ._header import TensorEntry

_Entries = list[tuple[int, TensorEntry]]

def check(dests: dict[Any, Any], tensor: type, strided: Any) -> tuple[Any, str | None]: ...
def places(entries: _Entries, dtypes: list[Any], dests: dict[str, Any], paths: list[str],
           rows: bool = False) -> tuple[list[Any], list[int]]: ...

class Allocations:
    def __init__(self, tensors: list[Any], addresses: list[int], driver: int = 0) -> None: ...
    def __call__(self, k: int) -> tuple[int, int]: ...

def joins(entries: _Entries, addresses: list[int],
          allocation: Callable[[int], tuple[int, int] | None]) -> list[bool]: ...
