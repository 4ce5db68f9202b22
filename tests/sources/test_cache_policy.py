"""The cache's policy, apart from its mechanism: ``evictions`` decides which
entries go, without a directory or a server (loader/_cache.py)."""

import os

import pytest

from instant_staging.loader._cache import Cache, Listed, evictions

MiB = 1 << 20
ROOMY = 1 << 50         # a file system with room to spare


def listed(*entries):
    """``Listed`` entries of ``(name, MiB, used_ns)``."""
    return [Listed(name, n * MiB, used) for name, n, used in entries]


def test_nothing_goes_where_the_object_fits():
    entries = listed(("a", 10, 1), ("b", 10, 2))
    assert evictions(entries, 5 * MiB, used=20 * MiB, bound=100 * MiB, free=ROOMY,
                     keep_free=0) == ([], True)


def test_the_least_recently_used_go_first_until_it_fits():
    entries = listed(("new", 10, 30), ("old", 10, 10), ("mid", 10, 20))
    # 30 used, bound 35: 10 more need 5 freed: the oldest alone
    assert evictions(entries, 10 * MiB, used=30 * MiB, bound=35 * MiB, free=ROOMY,
                     keep_free=0) == (["old"], True)
    # 20 more: two go, oldest first
    assert evictions(entries, 20 * MiB, used=30 * MiB, bound=35 * MiB, free=ROOMY,
                     keep_free=0) == (["old", "mid"], True)


def test_a_tie_in_time_is_broken_by_the_path():
    entries = listed(("b", 10, 5), ("a", 10, 5))
    assert evictions(entries, 10 * MiB, used=20 * MiB, bound=25 * MiB, free=ROOMY,
                     keep_free=0) == (["a"], True)


def test_the_file_system_keeps_its_free_space():
    entries = listed(("old", 10, 1), ("new", 10, 2))
    # far under the bound, but the disk would keep only 5 of the 8 MiB it must
    gone, fits = evictions(entries, 10 * MiB, used=20 * MiB, bound=ROOMY, free=15 * MiB,
                           keep_free=8 * MiB)
    assert (gone, fits) == (["old"], True)


def test_an_object_larger_than_the_bound_removes_nothing():
    entries = listed(("a", 10, 1))
    assert evictions(entries, 101 * MiB, used=10 * MiB, bound=100 * MiB, free=ROOMY,
                     keep_free=0) == ([], False)


def test_where_no_removal_makes_room_it_does_not_fit():
    # partial files of other fillers take the room: entries go, in vain
    entries = listed(("a", 10, 1), ("b", 10, 2))
    gone, fits = evictions(entries, 40 * MiB, used=90 * MiB, bound=100 * MiB, free=ROOMY,
                           keep_free=0)
    assert gone == ["a", "b"] and fits is False


def test_an_entry_at_exactly_the_bound_fits():
    entries = listed(("a", 10, 1))
    assert evictions(entries, 10 * MiB, used=90 * MiB, bound=100 * MiB, free=10 * MiB,
                     keep_free=0) == ([], True)


@pytest.mark.parametrize("bound", [25, 35])
def test_cache_removes_what_the_policy_names(tmp_path, bound, monkeypatch):
    """``Cache`` lists the directory and removes exactly what ``evictions``
    names (its mechanism), oldest first."""
    import instant_staging.loader._cache as cache_module
    monkeypatch.setattr(cache_module, "CACHE_KEEP_FREE", 0)
    names = []
    for i, used in enumerate((3, 1, 2)):
        name = f"{i:064x}.{i:016x}.safetensors"
        path = tmp_path / name
        path.write_bytes(b"\0" * (10 * MiB))
        os.utime(path, ns=(used * 10**9, used * 10**9))
        names.append(name)
    cache = Cache(str(tmp_path), bound=bound * MiB)
    assert cache._room(10 * MiB, str(tmp_path / "own.partial"))
    left = sorted(os.listdir(tmp_path))
    # 30 MiB held: a bound of 35 lets one go (the oldest), 25 two
    expect = [names[0]] if bound == 25 else [names[0], names[2]]
    assert left == sorted(expect)
