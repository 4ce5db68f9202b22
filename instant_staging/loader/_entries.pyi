"""A load's columns of its checkpoint's entries, walked in C.

A checkpoint's ``entries`` is a list of ``(file index, TensorEntry)``
pairs, one per tensor, in reading order.  Each load asks it for a few
columns: the names it hands out, the file ranges the plan cuts, the torch
dtype of each tensor.  A loop in Python per column was most of a load's
preparation past the headers once checkpoints hold tens of thousands of
tensors (docs/design.md, "Measured: the start per tensor"); these walk the
list in C.  Each returns a new list whose item k is entry k's.

The entries are the header's ``TensorEntry`` tuples: name, dtype, shape,
begin, end, in that order (``_header.py``).
"""

from typing import Callable, TypeVar

from ._header import TensorEntry

_Entries = list[tuple[int, TensorEntry]]

def names(entries: _Entries) -> list[str]: ...
def ranges(entries: _Entries, fds: list[int]) -> list[tuple[int, int, int]]: ...
def dtypes(entries: _Entries, known: dict[str, object],
           miss: Callable[[int], object]) -> list[object]: ...

_T = TypeVar("_T")

def infos(entries: _Entries, paths: list[str], kind: type[_T]) -> dict[str, _T]: ...
