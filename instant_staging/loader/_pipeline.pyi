"""Types of the compiled ``loader._pipeline`` module.

Private to the loader: ``load_file``, ``iter_load`` and ``safe_open`` are
its public face (typed in Python).  Its classes are typed loosely here so
that the stub never claims a signature the module no longer has.
"""

from typing import Any

CALLS: tuple[str, ...]

class Plan:
    def __init__(self, *args: Any, **kwargs: Any) -> None: ...
    def __getattr__(self, name: str) -> Any: ...

class Pipeline:
    def __init__(self, *args: Any, **kwargs: Any) -> None: ...
    def __getattr__(self, name: str) -> Any: ...

def __getattr__(name: str) -> Any: ...
