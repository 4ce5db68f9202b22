"""_hugepages.py: when a staging buffer asks for huge pages
(``StagingBuffer(hugepages=None)``, the loader's own buffer included).

Every input is text handed in, so each decision is checked on any host."""

import pytest

import instant_staging as ist
from instant_staging import _hugepages as H
from instant_staging.loader import _staging_pool
from instant_staging.testing import SimulatedRuntime

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
    assert H.huge_pages_free(H.HUGE_PAGE + 1, thp=MADVISE, buddyinfo=BUDDY)  # rounds up
    # Under one huge page there is nothing to back with one.
    assert not H.huge_pages_free(H.HUGE_PAGE - 1, thp=MADVISE, buddyinfo=BUDDY)
    fragmented = "Node 0, zone Normal 9999 9999 9999 9999 9999 9999 9999 9999 9999 0 0\n"
    assert not H.huge_pages_free(2 << 20, thp=MADVISE, buddyinfo=fragmented)


def test_other_page_sizes_never_ask():
    assert not H.huge_pages_free(2 << 20, thp=MADVISE, buddyinfo=BUDDY, page_size=65536)


# -- the rule of hugepages=None -----------------------------------------------------

ENOUGH = "Node 0, zone Normal 0 0 0 0 0 0 0 0 0 64 0\n"      # 64 free 2 MiB blocks
SHORT = "Node 0, zone Normal 0 0 0 0 0 0 0 0 0 63 0\n"       # one short of 2 x 32
BUF = 64 << 20                                                  # 32 huge pages


@pytest.mark.parametrize("thp,mode", [("always [madvise] never\n", "madvise"),
                                      ("[always] madvise never\n", "always"),
                                      ("always madvise [never]\n", "never"),
                                      ("", None)])              # "": the file unreadable
@pytest.mark.parametrize("buddyinfo,free", [(ENOUGH, True), (SHORT, False), ("", False)])
def test_auto_rule_for_each_thp_mode_and_free_answer(thp, mode, buddyinfo, free):
    on, why = H.decide(BUF, None, env="", thp=thp, buddyinfo=buddyinfo)
    assert on is (mode in ("always", "madvise") and free)
    assert why.startswith("auto: ")
    if mode is None:
        assert "unknown" in why and H.THP_ENABLED in why
    elif mode == "never":
        assert "'never'" in why
    else:
        blocks = H.free_huge_blocks(buddyinfo)
        assert f"THP {mode}, " in why and f"{blocks} free 2 MiB blocks for the 32 needed" in why
        assert ("compact" in why) is not on
    # huge_pages_free is the same rule without the reason.
    assert H.huge_pages_free(BUF, thp=thp, buddyinfo=buddyinfo) is on


def test_auto_never_for_less_than_one_huge_page_or_other_page_sizes():
    assert H.decide(H.HUGE_PAGE - 4096, env="", thp=MADVISE, buddyinfo=ENOUGH) == (
        False, "auto: smaller than one 2 MiB page")
    assert H.decide(BUF, env="", thp=MADVISE, buddyinfo=ENOUGH, page_size=65536) == (
        False, "auto: pages of 64 KiB, not 4 KiB")


def test_argument_then_variable_then_auto():
    # An explicit argument decides, whatever the variable and the host say.
    assert H.decide(BUF, True, env="0", thp="", buddyinfo="") == (True, "hugepages=True")
    assert H.decide(BUF, False, env="1", thp=MADVISE, buddyinfo=ENOUGH) == (
        False, "hugepages=False")
    # The variable, where set, decides for None.
    assert H.decide(BUF, None, env=" on ", thp="", buddyinfo="") == (
        True, "INSTANT_STAGING_HUGEPAGES=on")
    assert H.decide(BUF, None, env="0", thp=MADVISE, buddyinfo=ENOUGH) == (
        False, "INSTANT_STAGING_HUGEPAGES=0")
    assert H.decide(BUF, None, env="", thp=MADVISE, buddyinfo=ENOUGH)[0] is True
    with pytest.raises(ValueError, match="INSTANT_STAGING_HUGEPAGES"):
        H.decide(BUF, None, env="2", thp=MADVISE, buddyinfo=ENOUGH)


@pytest.fixture
def fake_host(monkeypatch):
    """Makes the /sys and /proc reads of _hugepages return the given texts."""
    def make(thp, buddyinfo):
        files = {H.THP_ENABLED: thp, H.BUDDYINFO: buddyinfo}
        monkeypatch.setattr(H, "_read", files.get)
        monkeypatch.delenv(H.ENV, raising=False)
    return make


@pytest.mark.parametrize("thp,buddyinfo,on", [(MADVISE, ENOUGH, True), (MADVISE, SHORT, False),
                                              ("always madvise [never]\n", ENOUGH, False)])
def test_staging_buffer_default_follows_the_host_and_records_why(fake_host, thp, buddyinfo, on):
    fake_host(thp, buddyinfo)
    with ist.StagingBuffer(BUF, runtime=SimulatedRuntime(), prefault_threads=0) as buf:
        assert buf.hugepages is on
        assert buf.hugepages_reason == H.decide(BUF, env="", thp=thp, buddyinfo=buddyinfo)[1]
        assert (buf.ptr % H.HUGE_PAGE == 0) or not on
        assert [a.step for a in buf.attempts] == ["allocate", "register"]   # no new step


def test_choice_made_is_kept_and_dropped_with_the_mapping(fake_host):
    fake_host(MADVISE, ENOUGH)
    with ist.StagingBuffer(BUF, runtime=SimulatedRuntime(), prefault_threads=0,
                           hugepages=False) as buf:
        assert (buf.hugepages, buf.hugepages_reason) == (False, "hugepages=False")
    # The runtime's own allocation (the fallback) is never advised: the
    # mapping that was is gone.
    rt = SimulatedRuntime("register=invalid_value")
    with ist.StagingBuffer(BUF, runtime=rt, prefault_threads=0) as buf:
        assert buf.kind is ist.Kind.RUNTIME_PINNED and buf.hugepages is False
        assert buf.hugepages_reason.startswith("auto: THP madvise")
        assert "the runtime's own" in buf.hugepages_reason


def test_loader_own_buffer_follows_the_rule(fake_host, monkeypatch):
    # The loader's buffer, made the way a load to a GPU makes it, on the
    # simulated runtime: huge pages exactly where StagingBuffer's rule says.
    import instant_staging.runtime as runtime
    monkeypatch.setattr(runtime, "default_runtime", SimulatedRuntime)
    for thp, buddyinfo, on in ((MADVISE, ENOUGH, True), (MADVISE, SHORT, False)):
        fake_host(thp, buddyinfo)
        buf = _staging_pool._make(BUF, 16 << 20)
        try:
            assert buf.hugepages is on
        finally:
            buf.close()
    for value, on in (("1", True), ("0", False), ("off", False), (" YES ", True)):
        monkeypatch.setenv("INSTANT_STAGING_HUGEPAGES", value)
        buf = _staging_pool._make(BUF, 16 << 20)
        try:
            assert buf.hugepages is on                      # the variable decides
        finally:
            buf.close()
    monkeypatch.setenv("INSTANT_STAGING_HUGEPAGES", "2")
    with pytest.raises(ValueError, match="INSTANT_STAGING_HUGEPAGES"):
        _staging_pool._make(BUF, 16 << 20)
