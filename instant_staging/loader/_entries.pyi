"""Types of the compiled ``loader._entries`` module."""

from typing import Callable, TypeVar

from ._header import TensorEntry

_Entries = list[tuple[int, TensorEntry]]

def names(entries: _Entries) -> list[str]: ...
def ranges(entries: _Entries, fds: list[int]) -> list[tuple[int, int, int]]: ...
def dtypes(entries: _Entries, known: dict[str, object],
           miss: Callable[[int], object]) -> list[object]: ...

_T = TypeVar("_T")

def infos(entries: _Entries, paths: list[str], kind: type[_T]) -> dict[str, _T]: ...
