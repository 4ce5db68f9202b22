"""File descriptors recorded in the same step that opens or closes them.

Python runs a signal handler (Ctrl-C's KeyboardInterrupt) between two
bytecodes of the main thread, and as a call returns: a descriptor that
``os.open`` returned and Python code then appends to a list is lost if the
interrupt lands in between (a leak for the life of the process), and one
closed and then removed from the list is closed a second time by the next
``close()``, when its number may already be another file's (worse than a
leak).  Here each step is one call in C during which no Python code runs
(no bytecode, so no handler, and the GIL held, so no other thread): a
descriptor is in the list exactly while it is open.
"""

import os

def open_recorded(fds: list[int], path: str | bytes | os.PathLike[str] | os.PathLike[bytes],
                  flags: int) -> int: ...
def close_recorded(fds: list[int]) -> None: ...
