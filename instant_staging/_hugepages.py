"""Transparent huge pages: which mode the host is in, whether it holds
enough free 2 MiB blocks to back a buffer with huge pages right now, and
so what ``StagingBuffer(hugepages=None)`` chooses.

The rule (``decide``; docs/design.md, "The allocation state machine"):
``hugepages=True``/``False`` decide; else ``INSTANT_STAGING_HUGEPAGES``
where set; else auto: MADV_HUGEPAGE exactly when THP is ``always`` or
``madvise``, pages are 4 KiB, the buffer holds at least one 2 MiB page and
``huge_pages_free()`` finds the 2 MiB blocks free in the buddy allocator.
Huge pages halve the pinning, but faulting a MADV_HUGEPAGE range on
fragmented memory compacts it first, and that stalled pinning for minutes
on hosts in the field (docs/design.md, "Known failing hosts"); a range
whose every 2 MiB page the buddy allocator already holds free needs no
compaction, so auto asks only then (a MoE load a little faster, the
loader's buffer made in a third of the time; docs/design.md, "Measured:
huge pages").  Every input is a parameter (the files' texts, the
variable's value), so each decision is testable on any host; ``decide``
returns the reason with the choice, which the buffer keeps
(``StagingBuffer.hugepages_reason``) and ``probe`` and ``doctor`` show.
"""

import mmap
import re

from . import envs
from ._types import read_text as _read

THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
BUDDYINFO = "/proc/buddyinfo"

HUGE_PAGE = 2 << 20
# The buddy order of a 2 MiB block with 4 KiB pages.
_HUGE_ORDER = 9
# Free 2 MiB blocks wanted per huge page asked for: other processes fault
# too, and a huge page found taken costs a compaction.  A host whose page
# cache held the checkpoints still had almost twice the free blocks a
# loader's buffer needs (docs/design.md, "Measured: huge pages").
FREE_MARGIN = 2


ENV = "INSTANT_STAGING_HUGEPAGES"


def env_setting(value=None):
    """INSTANT_STAGING_HUGEPAGES as a bool, None where unset or empty; a
    value that is neither is a ValueError (``envs``' parser).  ``value``:
    the variable's text (None: read the environment).  Where set it decides
    for ``StagingBuffer(hugepages=None)``, the loader's own buffer included."""
    return envs.get(ENV) if value is None else envs.parse_text(ENV, value)


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


def auto(nbytes, *, thp=None, buddyinfo=None, page_size=mmap.PAGESIZE):
    """``(on, why)``: what ``hugepages=None`` chooses for ``nbytes`` where
    the variable is unset (the module docstring's rule).  ``thp`` and
    ``buddyinfo`` are the files' texts (None: read them here; "" for a file
    that cannot be read)."""
    if page_size != 4096:
        return False, f"auto: pages of {page_size // 1024} KiB, not 4 KiB"
    mode = parse_thp(_read(THP_ENABLED) if thp is None else thp)
    if mode is None:
        return False, f"auto: THP mode unknown ({THP_ENABLED} unreadable)"
    if mode not in ("always", "madvise"):
        return False, f"auto: THP is {mode!r}"
    if nbytes < HUGE_PAGE:
        return False, "auto: smaller than one 2 MiB page"
    need = -(-nbytes // HUGE_PAGE)
    free = free_huge_blocks(_read(BUDDYINFO) if buddyinfo is None else buddyinfo)
    if free >= FREE_MARGIN * need:
        return True, (f"auto: THP {mode}, {free} free 2 MiB blocks for the "
                      f"{need} needed (at least {FREE_MARGIN}x)")
    return False, (f"auto: THP {mode}, but {free} free 2 MiB blocks for the {need} "
                   f"needed (under {FREE_MARGIN}x: faulting them would compact memory)")


def huge_pages_free(nbytes, *, thp=None, buddyinfo=None, page_size=mmap.PAGESIZE):
    """Whether ``nbytes`` can be backed by huge pages now without compaction:
    ``auto()``'s answer without its reason."""
    return auto(nbytes, thp=thp, buddyinfo=buddyinfo, page_size=page_size)[0]


def decide(nbytes, hugepages=None, *, env=None, thp=None, buddyinfo=None,
           page_size=mmap.PAGESIZE):
    """``(on, why)`` for ``StagingBuffer(nbytes, hugepages=hugepages)``:
    an explicit bool decides, else the variable (``env``: its text, None
    reads the environment), else ``auto()``.  A malformed variable is a
    ValueError (raised before anything is allocated)."""
    if hugepages is not None:
        return bool(hugepages), f"hugepages={bool(hugepages)}"
    text = envs.raw(ENV) if env is None else env.strip()
    setting = envs.parse_text(ENV, text)
    if setting is not None:
        return setting, f"{ENV}={text}"
    return auto(nbytes, thp=thp, buddyinfo=buddyinfo, page_size=page_size)
