"""Types of the compiled ``loader._blocks`` module."""

from typing import NamedTuple

ALIGN: int

class Run(NamedTuple):
    first: int
    stop: int
    begin: int
    nbytes: int
    block: bool

def runs(entries: list[tuple[int, tuple[object, ...]]], joins: list[bool]) -> list[Run]: ...
def joined(run_list: list[Run]) -> list[bool]: ...
def packed(run_list: list[Run]) -> bool: ...
