"""_hugepages.py: when the loader's own staging buffer asks for huge pages.

Every input is text handed in, so each decision is checked on any host."""

import pytest

from instant_staging import _hugepages as H
from instant_staging.loader import _load

# A real /proc/buddyinfo (the CI machine's, 2026-11-30): Normal holds 41
# blocks of order 9, 171 of order 10; DMA32 2 and 752; DMA is not counted.
BUDDY = """\
Node 0, zone      DMA      0      0      0      0      0      0      0      0      1      1      3
Node 0, zone    DMA32      1      1      4      2      5      4      3      3      4      2    752
Node 0, zone   Normal   4596   4766   1667   1028    620   3384   3095   1224    171     41    171
"""
FREE = 41 + 2 * 171 + 2 + 2 * 752      # in 2 MiB blocks
MADVISE = "always [madvise] never\n"


def test_free_blocks_counted_in_2mib_units_without_dma():
    assert H.free_huge_blocks(BUDDY) == FREE
    assert H.free_huge_blocks("") == 0 and H.free_huge_blocks(None) == 0
    assert H.free_huge_blocks("garbage\nNode x, zone\n") == 0
    two_nodes = BUDDY + BUDDY.replace("Node 0", "Node 1")
    assert H.free_huge_blocks(two_nodes) == 2 * FREE
    # Fewer orders (a kernel with MAX_ORDER 9): only order 9 counts.
    assert H.free_huge_blocks("Node 0, zone Normal 1 2 3 4 5 6 7 8 9 10\n") == 10


@pytest.mark.parametrize("mode,expected", [("always [madvise] never", True),
                                           ("[always] madvise never", True),
                                           ("always madvise [never]", False),
                                           ("", False), (None, False)])
def test_thp_mode_decides_first(mode, expected, monkeypatch):
    monkeypatch.setattr(H, "_read", lambda path: None)   # None: the file cannot be read
    assert H.huge_pages_free(128 << 20, thp=mode if mode is not None else None,
                             buddyinfo=BUDDY) is expected


def test_margin_of_free_blocks():
    need = FREE // H.FREE_MARGIN                     # huge pages the free blocks can back
    assert H.huge_pages_free(need * H.HUGE_PAGE, thp=MADVISE, buddyinfo=BUDDY)
    assert not H.huge_pages_free((need + 1) * H.HUGE_PAGE, thp=MADVISE, buddyinfo=BUDDY)
    assert H.huge_pages_free(1, thp=MADVISE, buddyinfo=BUDDY)   # rounds up to one page
    fragmented = "Node 0, zone Normal 9999 9999 9999 9999 9999 9999 9999 9999 9999 0 0\n"
    assert not H.huge_pages_free(2 << 20, thp=MADVISE, buddyinfo=fragmented)


def test_other_page_sizes_never_ask():
    assert not H.huge_pages_free(2 << 20, thp=MADVISE, buddyinfo=BUDDY, page_size=65536)


def test_loader_own_buffer_follows_the_variable_where_set(monkeypatch):
    import instant_staging._hugepages as hp
    monkeypatch.setattr(hp, "huge_pages_free", lambda n: "probed")
    monkeypatch.delenv("INSTANT_STAGING_HUGEPAGES", raising=False)
    assert _load._hugepages(1 << 20) == "probed"
    for value, on in (("1", True), ("0", False), ("off", False), (" YES ", True)):
        monkeypatch.setenv("INSTANT_STAGING_HUGEPAGES", value)
        assert _load._hugepages(1 << 20) is on          # the variable decides
    monkeypatch.setenv("INSTANT_STAGING_HUGEPAGES", "2")
    with pytest.raises(ValueError, match="INSTANT_STAGING_HUGEPAGES"):
        _load._hugepages(1 << 20)
