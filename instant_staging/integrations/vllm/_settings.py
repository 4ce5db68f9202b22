"""vLLM's own load settings, as load format ``instant_staging`` takes them.
Needs no vLLM: ``settings(load_config, ...)`` reads the attributes of vLLM's
``LoadConfig`` that a vLLM version has (``getattr``).

vLLM's safetensors iterator (``safetensors_weights_iterator``) and what each
setting means here:

- ``--safetensors-load-strategy`` (``safetensors_load_strategy``):

  - None (the default): vLLM reads the files through mmap and, where they
    are on NFS or Lustre and fit in 90% of the available memory, first
    reads them into the page cache in the background (each rank its share
    of the files).  The same here: the same rule, the same prefetch, before
    the loader's own reads (which then find the pages in the cache).
  - ``"lazy"``: mmap, never a prefetch.  Here: the loader's reads, never a
    prefetch.
  - ``"eager"``: each file read whole into memory before its tensors are
    handed out, against the small random reads of mmap on network storage.
    The loader never reads through mmap: it always reads every tensor's
    bytes in ``chunk_size`` pieces, in file order, so eager asks for what
    it does anyway; one INFO line says so.
  - ``"prefetch"``: the page-cache prefetch, whatever the file system (a
    warning where the files do not fit in 90% of the available memory, as
    vLLM's).  The same here.
  - ``"torchao"``: a ValueError (``_loader``): no tensor subclasses here.

- ``safetensors_prefetch_num_threads``, ``safetensors_prefetch_block_size``:
  the prefetch's threads (one file each at a time) and read size, as vLLM's.
- ``shuffle_safetensors_files`` (vLLM 0.34): each rank reads the files in
  an order shuffled by its rank, as vLLM's; with ``shared_read`` every rank
  must read the same batches in the same order, so it is ignored there,
  with a warning, once per process.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from typing import Any, NamedTuple

from ..._types import MEMINFO, parse_meminfo, read_text

logger = logging.getLogger("vllm.instant_staging")

# vLLM's own defaults (vllm/config/load.py), for a vLLM without the fields.
PREFETCH_THREADS = 8
PREFETCH_BLOCK_SIZE = 16 << 20
NETWORK_FILE_SYSTEMS = ("nfs", "nfs4", "lustre")
FITS_IN_RAM = 0.9               # of MemAvailable, vLLM's threshold

_said: set[str] = set()


def once(level: int, key: str, message: str, *args: Any) -> None:
    """Logs ``message`` once per process for ``key`` (vLLM makes a loader
    per model, several per process with a draft model or an encoder)."""
    if key not in _said:
        _said.add(key)
        logger.log(level, message, *args)


class Settings(NamedTuple):
    """What this load does with vLLM's settings."""

    prefetch: bool                  # read this rank's share of the files into the page cache first
    prefetch_threads: int
    prefetch_block_size: int
    shuffle_seed: int | None        # the rank, where the files are read in vLLM's shuffled order


def settings(load_config: Any, files: list[str], *, rank: int, shared_read: bool) -> Settings:
    """The ``Settings`` of one load of ``files`` by ``rank`` (see the module
    docstring); logs what a setting changes, or why it changes nothing."""
    strategy = getattr(load_config, "safetensors_load_strategy", None)
    threads = getattr(load_config, "safetensors_prefetch_num_threads", PREFETCH_THREADS)
    block = getattr(load_config, "safetensors_prefetch_block_size", PREFETCH_BLOCK_SIZE)
    prefetch = False
    if strategy in (None, "prefetch"):
        fs = file_system(files)
        total = sum(os.path.getsize(f) for f in files)
        available = available_memory()
        fits = available is None or total <= FITS_IN_RAM * available
        if strategy == "prefetch":
            prefetch = True
            if not fits:
                once(logging.WARNING, "prefetch-ram",
                     "safetensors_load_strategy='prefetch': the checkpoint (%.2f GiB) exceeds %d%% of the "
                     "available memory (%.2f GiB); the page cache cannot hold it all",
                     total / 2**30, FITS_IN_RAM * 100, (available or 0) / 2**30)
        else:
            prefetch = fs in NETWORK_FILE_SYSTEMS and fits
    elif strategy == "eager":
        once(logging.INFO, "eager",
             "safetensors_load_strategy='eager': load format instant_staging always reads whole tensors "
             "in chunk_size pieces in file order (never mmap's random reads); nothing to change")
    shuffle_seed = None
    if getattr(load_config, "shuffle_safetensors_files", False):
        if shared_read:
            once(logging.WARNING, "shuffle-shared",
                 "shuffle_safetensors_files is ignored with shared_read: every rank reads the same batches "
                 "in the same order")
        else:
            shuffle_seed = rank
    return Settings(prefetch, threads, block, shuffle_seed)


def file_system(files: list[str]) -> str:
    """The file system type of the first file (the mount point that is the
    longest prefix of its real path, in /proc/mounts), "" where unknown."""
    if not files:
        return ""
    path = os.path.realpath(files[0])
    best, kind = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                if (path == mount or path.startswith(os.path.join(mount, ""))) and len(mount) > len(best):
                    best, kind = mount, parts[2]
    except OSError:
        return ""
    return kind


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes, None where unknown."""
    return parse_meminfo(read_text(MEMINFO)).get("MemAvailable")


def prefetch(files: list[str], *, rank: int, world: int, threads: int, block_size: int) -> threading.Thread:
    """Reads this rank's share of ``files`` (every ``world``-th, from
    ``rank``) into the page cache in a background daemon thread, ``threads``
    files at a time in ``block_size`` reads, as vLLM's prefetch; a file that
    fails is a warning.  Returns the thread (started)."""
    mine = files[rank::world]

    def read(path):
        buf = bytearray(block_size)
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    def run():
        with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
            for path, future in [(p, pool.submit(read, p)) for p in mine]:
                try:
                    future.result()
                except OSError as e:
                    logger.warning("instant_staging: prefetching %s into the page cache failed: %s", path, e)

    logger.info("instant_staging: prefetching %d of %d checkpoint file(s) into the page cache "
                "(rank %d of %d, %d threads, %d-byte reads)", len(mine), len(files), rank, world,
                threads, block_size)
    thread = threading.Thread(target=run, name="instant_staging-prefetch", daemon=True)
    thread.start()
    return thread
