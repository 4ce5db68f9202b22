"""Types of the compiled ``loader._pipeline`` module.

Private to the loader: ``load_file``, ``iter_load`` and ``safe_open`` are
its public face (typed in Python).  Checked against the compiled module by
stubtest (tests/core/test_typing.py): a name added, renamed or dropped there
fails that test until this file follows.
"""

from collections.abc import Callable, Sequence

from .._staging import StagingBuffer
from ..faults import FaultPlan

HOST: int
DEVICE: int
SKIP_READ: int
SKIP_COPY: int
MAX_SLOTS_PER_THREAD: int
READ_ERROR: int
END_OF_FILE: int
RUNTIME_ERROR: int
CANCELLED: int
FETCH_ERROR: int
CALLS: tuple[str, ...]

def enter_load() -> None: ...
def leave_load() -> None: ...

class Plan:
    """Chunks and pieces of a load over ``(fd, begin, end)`` file ranges."""

    def __init__(
        self, tensors: Sequence[tuple[int, int, int]], chunk_size: int, *, faults: FaultPlan | None = None,
        packed: bool = False, joins: Sequence[bool] | None = None,
    ) -> None: ...
    @property
    def n_chunks(self) -> int: ...
    @property
    def n_pieces(self) -> int: ...
    @property
    def n_tensors(self) -> int: ...
    @property
    def max_chunk(self) -> int: ...
    @property
    def total_bytes(self) -> int: ...
    def tensor_at(self, chunk: int, offset: int) -> int: ...
    def chunk(self, chunk: int) -> tuple[int, int, int]: ...

class Pipeline:
    """Runs a Plan once: reader threads copy its tensors out of slots."""

    def __init__(
        self,
        plan: Plan,
        *,
        threads: int,
        staging: StagingBuffer | None = None,
        depth: int | None = None,
        device: int | None = None,
        skip: int = 0,
        fetch: Callable[[int, int, int], object] | None = None,
    ) -> None: ...
    @property
    def n_chunks(self) -> int: ...
    @property
    def n_threads(self) -> int: ...
    @property
    def slots(self) -> int: ...
    @property
    def slot_bytes(self) -> int: ...
    @property
    def fetch(self) -> Callable[[int, int, int], object] | None: ...
    def start(self, dsts: Sequence[int], *, more: bool = False) -> None: ...
    def provide(self, dsts: Sequence[int]) -> bool: ...
    def wait(self, timeout: float) -> tuple[list[int], int, bool, bool]: ...
    def cancel(self) -> None: ...
    def close(self) -> None: ...
    def error(self) -> tuple[int, int, str, int, int] | None: ...
