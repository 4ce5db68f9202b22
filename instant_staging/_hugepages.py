"""Transparent huge pages: which mode the host is in, and whether it holds
enough free 2 MiB blocks to back a buffer with huge pages right now.

``StagingBuffer(hugepages=...)`` stays opt-in: faulting a MADV_HUGEPAGE
range on fragmented memory compacts it first, and that stalled pinning for
minutes on hosts in the field (docs/design.md, "Known failing hosts").  A
range whose every 2 MiB page the buddy allocator already holds free needs
no compaction, so the loader asks for huge pages for its own staging buffer
only when ``huge_pages_free()`` says so (MoE shard on the H200 host: 45.8
against 42.8 GB/s with 4 KiB pages, the buffer made in 5 ms instead of 14).
Every input is a parameter, so each decision is testable on any host.
"""

import mmap
import os
import re

from ._types import read_text as _read

THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
BUDDYINFO = "/proc/buddyinfo"

HUGE_PAGE = 2 << 20
# The buddy order of a 2 MiB block with 4 KiB pages.
_HUGE_ORDER = 9
# Free 2 MiB blocks wanted per huge page asked for: other processes fault
# too, and a huge page found taken costs a compaction.  (The H200 host,
# its page cache holding the checkpoints, had 117 such blocks free in its
# Normal zone: a 128 MiB buffer needs 64.)
FREE_MARGIN = 2


ENV = "INSTANT_STAGING_HUGEPAGES"


def env_setting():
    """INSTANT_STAGING_HUGEPAGES as a bool, None where unset or empty; a
    value that is neither is a ValueError.  Where set it decides, for
    ``StagingBuffer(hugepages=None)`` and for the loader's own buffer."""
    raw = os.environ.get(ENV, "").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    if not raw:
        return None
    raise ValueError(f"{ENV} must be 1/true/yes/on or 0/false/no/off, got {raw!r}")


def parse_thp(text):
    """'always [madvise] never' -> 'madvise'; None when unreadable."""
    match = re.search(r"\[(\w+)\]", text or "")
    return match.group(1) if match else None


def free_huge_blocks(buddyinfo):
    """Free blocks of 2 MiB or more in ``/proc/buddyinfo`` text, counted in
    2 MiB blocks, over every zone but DMA (which user memory never uses)."""
    total = 0
    for line in (buddyinfo or "").splitlines():
        match = re.match(r"Node\s+\d+,\s+zone\s+(\S+)\s+([\d\s]+)$", line.strip())
        if not match or match.group(1) == "DMA":
            continue
        counts = [int(n) for n in match.group(2).split()]
        total += sum(n << (order - _HUGE_ORDER) for order, n in enumerate(counts)
                     if order >= _HUGE_ORDER)
    return total


def huge_pages_free(nbytes, *, thp=None, buddyinfo=None, page_size=mmap.PAGESIZE):
    """Whether ``nbytes`` can be backed by huge pages now without compaction:
    THP is 'always' or 'madvise', pages are 4 KiB, and FREE_MARGIN free
    2 MiB blocks wait per huge page needed.  ``thp`` and ``buddyinfo`` are
    the files' texts (None: read them here)."""
    if page_size != 4096:
        return False
    mode = parse_thp(_read(THP_ENABLED) if thp is None else thp)
    if mode not in ("always", "madvise"):
        return False
    need = -(-nbytes // HUGE_PAGE)
    return free_huge_blocks(_read(BUDDYINFO) if buddyinfo is None else buddyinfo) >= FREE_MARGIN * need
