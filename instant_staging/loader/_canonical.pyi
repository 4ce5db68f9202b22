"""Types of the compiled ``loader._canonical`` module (private to ``_header``)."""

from typing import TypeVar

_Entry = tuple[str, str, tuple[int, ...], int, int]

def read(raw: bytes, dtypes: dict[bytes, str]) -> tuple[dict[str, str] | None, list[_Entry]] | None: ...

_T = TypeVar("_T")

def checked(tensors: list[_Entry], data_start: int, bits: dict[str, int],
            entry: type[_T]) -> tuple[list[_T], int] | None: ...

def table(raw: bytes, dtypes: dict[bytes, str], bits: dict[str, int],
          entry: type[_T]) -> tuple[dict[str, str] | None, list[_T], int] | None: ...
