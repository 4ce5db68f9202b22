"""instant_staging: a large pinned host staging buffer that does not fail
where drivers refuse big registrations.

    import instant_staging as ist
    with ist.StagingBuffer(2 << 30) as buf:
        print(buf.kind, [a.step for a in buf.attempts])

See docs/design.md for the state machine and the contract.

A source checkout holds no compiled modules and no ``_build_config.py``
(the build writes them): importing it unbuilt is an ImportError that says
how to build, not a bare ``No module named 'instant_staging._build_config'``.
"""

# The package logs on the "instant_staging" logger (fallbacks, capped knobs,
# an unpinned remote load, a cache left out, an exit that did not wait for
# its cache entries) and adds no handler of its own, not even the logging
# HOWTO's NullHandler: where the program configured no logging, logging's
# last-resort handler prints WARNING and above on stderr, and on a server
# nobody watches closely those lines are often the only word that a load
# fell back.  A NullHandler would silence them there (docs/guides/loading.md).


try:
    from ._build_config import BACKEND
    from ._staging import StagingBuffer, auto_prefault_threads
    from ._types import (
        Attempt,
        Kind,
        ReleaseError,
        RollbackError,
        RuntimeCallError,
        StagingError,
        format_size,
        parse_size,
    )
    from ._version import __version__
    from .runtime import default_runtime, real_runtime
except ModuleNotFoundError as _missing:
    # What the build makes (setup.py): _build_config.py and the compiled
    # extensions, every one of them a private module of this package or of
    # one of its folders (runtime/_table, loader/_pipeline).
    _parts = (_missing.name or "").split(".")
    if _parts[0] != __name__ or not any(p.startswith("_") for p in _parts[1:]):
        raise
    raise ImportError(
        f"instant_staging is not built ({_missing.name} is missing: this looks like its "
        "source tree): build it in place with `CUDA_HOME=/usr/local/cuda python setup.py "
        "build_ext --inplace`, or install it with `pip install -e .` (docs/develop/"
        "building.md says which toolkit each build uses)", name=_missing.name) from None

__all__ = [
                     "BACKEND",
                     "Attempt",
                     "Kind",
                     "ReleaseError",
                     "RollbackError",
                     "RuntimeCallError",
                     "StagingBuffer",
                     "StagingError",
                     "__version__",
                     "auto_prefault_threads",
                     "default_runtime",
                     "format_size",
                     "parse_size",
                     "real_runtime",
]
