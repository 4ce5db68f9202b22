"""Types of the compiled ``loader._fds`` module (private to ``_checkpoint``)."""

import os

def open_recorded(fds: list[int], path: str | bytes | os.PathLike[str] | os.PathLike[bytes],
                  flags: int) -> int: ...
def close_recorded(fds: list[int]) -> None: ...
