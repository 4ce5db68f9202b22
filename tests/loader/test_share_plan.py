"""The share plan of a process group's load (loader/_share_plan.py), alone:
pure functions, no group, no torch: every wanted byte read exactly once,
by a rank that wants it; shares balanced; one issue order; rows of one
tensor wanted by different ranks cut into segments."""

import pytest

from instant_staging.loader import _share_plan as P


def check_plan(sizes, wanted, world, unit):
    reads, exchanges = P.share_reads(sizes, wanted, world, unit)
    got = {}
    for r, units in enumerate(reads):
        for item, u in enumerate(units):
            assert u.item == item and u.src == r and r in wanted[u.entry]
            assert set(u.dsts) == set(wanted[u.entry]) - {r}
            assert 0 < u.end - u.begin <= (unit if u.dsts else sizes[u.entry])
            got.setdefault(u.entry, []).append((u.begin, u.end))
        assert [(u.entry, u.begin) for u in units] == sorted((u.entry, u.begin) for u in units)
    for i, n in enumerate(sizes):        # each wanted byte exactly once
        ranges = sorted(got.get(i, []))
        if not wanted[i] or n == 0:
            assert not ranges
            continue
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert exchanges == sorted(exchanges, key=lambda u: u.key)
    assert {id(u) for u in exchanges} == {id(u) for units in reads for u in units if u.dsts}
    return [sum(u.end - u.begin for u in units) for units in reads]


def test_plan_replicated_balanced():
    sizes = [1 << 30] + [112 << 20] * 96 + [8192] * 65 + [1 << 30]
    loads = check_plan(sizes, [range(2)] * len(sizes), 2, 64 << 20)
    assert abs(loads[0] - loads[1]) <= max(sizes) / 64 * 2
    loads = check_plan(sizes, [range(3)] * len(sizes), 3, 64 << 20)
    assert max(loads) - min(loads) <= sum(sizes) / 3 / 64 * 2 + 4096


def test_plan_contiguous_in_file_order():
    sizes = [1000] * 30
    reads, _ = P.share_reads(sizes, [range(3)] * 30, 3, 1 << 20)
    firsts = [(units[0].entry, units[-1].entry) for units in reads]
    assert firsts[0][0] == 0 and firsts[-1][1] == 29
    assert firsts[0][1] <= firsts[1][0] and firsts[1][1] <= firsts[2][0]


def test_plan_private_tensors_stay_home_and_shares_even_out():
    # rank 0 alone wants a big tensor; the shared ones go mostly to rank 1
    sizes = [600, 100, 100, 100, 100]
    wanted = [[0], [0, 1], [0, 1], [0, 1], [0, 1]]
    reads, exchanges = P.share_reads(sizes, wanted, 2, 1 << 20)
    assert [(u.entry, u.begin, u.end) for u in reads[0]] == [(0, 0, 600)]
    assert all(u.src == 1 and u.dsts == (0,) for u in exchanges)
    check_plan(sizes, wanted, 2, 1 << 20)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_plan_many_shapes(world):
    import random
    rng = random.Random(world)
    for _ in range(50):
        n = rng.randint(1, 40)
        sizes = [rng.choice([0, 1, 3, 4096, 10000, 1 << 20]) for _ in range(n)]
        wanted = [rng.sample(range(world), rng.randint(0, world)) for _ in range(n)]
        check_plan(sizes, wanted, world, rng.choice([4096, 1 << 20]))


def test_more_ranks_than_bytes():
    loads = check_plan([3], [range(4)], 4, 1 << 20)
    assert sorted(loads) == [0, 0, 0, 3]


def test_cut_inside_a_tensor_is_aligned():
    reads, _ = P.share_reads([1 << 24], [range(2)], 2, 1 << 30)
    assert [(u.begin, u.end) for u in reads[0]] == [(0, 1 << 23)]
    reads, _ = P.share_reads([(1 << 24) + 5], [range(3)], 3, 1 << 30)
    assert all(u.begin % P.CUT_ALIGN == 0 for units in reads for u in units)


def test_water_fill_levels_the_lowest_first():
    assert P.water_fill([0, 0], 10) == [5.0, 5.0]
    assert P.water_fill([6, 0], 10) == [2.0, 8.0]
    assert P.water_fill([6, 0], 4) == [0.0, 4.0]
    assert P.water_fill([6, 0, 2], 10) == pytest.approx([0.0, 6.0, 4.0])
    assert P.water_fill([3, 3], 0) == [0.0, 0.0]


def test_segments_cut_where_any_ranks_rows_begin_or_end():
    # place 0: rank 0 wants it whole, rank 1 bytes [40, 100); place 1: both whole;
    # place 2: only rank 1, rows [0, 8).
    wanted = [P.Wanted([0, 1], {}), P.Wanted([0, 1, 2], {0: (40, 100), 2: (0, 8)})]
    got = P.cut_segments([0, 1, 2], [100, 30, 16], wanted)
    assert got == [P.Segment(0, 0, 40, [0]), P.Segment(0, 40, 100, [0, 1]),
                   P.Segment(1, 0, 30, [0, 1]), P.Segment(2, 0, 8, [1])]


def check_buckets(sizes, wanted, world, unit, bucket):
    reads, _ = P.share_reads(sizes, wanted, world, unit)
    buckets = P.bucket_exchanges(reads, bucket)
    sent = {}
    for k in buckets:
        assert 0 < k.nbytes <= bucket
        offset = 0
        for u, b, e, at in k.pieces:
            assert u.src == k.src and set(u.dsts) <= set(k.dsts) and at == offset
            assert u.begin <= b < e <= u.end
            sent.setdefault(id(u), []).append((b, e))
            offset += e - b
        assert offset == k.nbytes
    # every byte with a receiver sent exactly once, by its reader
    for units in reads:
        for u in units:
            if u.dsts:
                spans = sorted(sent.pop(id(u)))
                assert spans[0][0] == u.begin and spans[-1][1] == u.end
                assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert not sent
    assert [k.key for k in buckets] == sorted(k.key for k in buckets)
    outgoing = [sum(u.end - u.begin for u in units if u.dsts) for units in reads]
    assert len(buckets) == sum(-(-n // bucket) for n in outgoing)
    assert len(buckets) <= -(-sum(outgoing) // bucket) + world
    return buckets


def test_buckets_follow_the_bytes_not_the_tensors():
    # The same 4 MiB as 4 tensors or 4,096: the same number of exchanges.
    for world in (2, 3, 4):
        few = check_buckets([1 << 20] * 4, [range(world)] * 4, world, 1 << 20, 1 << 20)
        many = check_buckets([1 << 10] * 4096, [range(world)] * 4096, world, 1 << 20, 1 << 20)
        assert len(few) == len(many) <= 4 + world


@pytest.mark.parametrize("world", [2, 3, 5])
def test_buckets_of_many_shapes(world):
    import random
    rng = random.Random(100 + world)
    for _ in range(50):
        n = rng.randint(1, 40)
        sizes = [rng.choice([0, 1, 3, 4096, 10000, 1 << 20]) for _ in range(n)]
        wanted = [rng.sample(range(world), rng.randint(0, world)) for _ in range(n)]
        check_buckets(sizes, wanted, world, rng.choice([4096, 1 << 20]),
                      rng.choice([4096, 5000, 1 << 22]))


def test_a_bucket_goes_to_the_union_of_its_units_receivers():
    # rank 0 reads both; one tensor for rank 1, one for rank 2: one bucket to both.
    reads = [[P.Unit(0, 0, 10, 0, (1,)), P.Unit(1, 0, 10, 0, (2,))], [], []]
    for item, u in enumerate(reads[0]):
        u.item, u.key = item, (10 * (item + 1), 0)
    (k,) = P.bucket_exchanges(reads, 1 << 20)
    assert k.src == 0 and k.dsts == (1, 2) and k.nbytes == 20
    with pytest.raises(ValueError, match="bucket_bytes"):
        P.bucket_exchanges(reads, 0)


def test_segments_of_every_rank_wanting_everything_whole():
    wanted = [P.Wanted([3, 5], {}), P.Wanted([3, 5], {})]
    assert P.cut_segments([3, 5], [10, 0], wanted) == [P.Segment(0, 0, 10, [0, 1]),
                                                      P.Segment(1, 0, 0, [0, 1])]
    # one rank's rows of one tensor: no longer the usual
    wanted[1] = P.Wanted([3, 5], {5: (0, 4)})
    assert P.cut_segments([3, 5], [10, 8], wanted) == [P.Segment(0, 0, 10, [0, 1]),
                                                      P.Segment(1, 0, 4, [0, 1]),
                                                      P.Segment(1, 4, 8, [0])]


class _CountedSizes(list):
    """A list of sizes that counts its reads."""

    reads = 0

    def __getitem__(self, i):
        type(self).reads += 1
        return super().__getitem__(i)


@pytest.mark.parametrize("world", [2, 8])
def test_plan_reads_each_size_a_bounded_number_of_times(world):
    # Sharing n tensors among the ranks is linear in n whatever the rank
    # count: each part and each cut looks only at its own tensors (a walk
    # of every tensor per part and per cut made a fine-grained checkpoint's
    # plan grow with tensors x ranks).
    n = 4000
    sizes = _CountedSizes([1 << 16] * n)
    _CountedSizes.reads = 0
    loads = check_plan(sizes, [range(world)] * n, world, 1 << 20)
    assert sum(loads) == n << 16
    assert _CountedSizes.reads <= 8 * n


def test_a_bucket_is_issued_when_its_last_unit_is_read():
    # Rank 0's one bucket holds bytes 0-10 and 10-100 of its share, rank 1's
    # bytes 0-50 of its own: rank 1's is read whole first, so issued first
    # (ordered by the first unit, rank 0's would wait for bytes not read yet).
    reads = [[P.Unit(0, 0, 10, 0, (1,)), P.Unit(1, 0, 90, 0, (1,))], [P.Unit(2, 0, 50, 1, (0,))]]
    for r, units in enumerate(reads):
        position = 0
        for item, u in enumerate(units):
            position += u.end - u.begin
            u.item, u.key = item, (position, r)
    buckets = P.bucket_exchanges(reads, 1 << 20)
    assert [(b.src, b.nbytes, b.key[0]) for b in buckets] == [(1, 50, 50), (0, 100, 100)]


def test_segments_when_a_rank_wants_fewer_tensors():
    # No rank wants rows only, but rank 1 wants one tensor of two: not the
    # every-rank-wants-everything path (whose segments would send rank 1 a
    # tensor it never asked for, and wait for it forever).
    wanted = [P.Wanted([3, 5], {}), P.Wanted([3], {})]
    assert P.cut_segments([3, 5], [10, 8], wanted) == [P.Segment(0, 0, 10, [0, 1]),
                                                      P.Segment(1, 0, 8, [0])]
    wanted = [P.Wanted([5], {}), P.Wanted([3, 5], {})]
    assert P.cut_segments([3, 5], [10, 8], wanted) == [P.Segment(0, 0, 10, [1]),
                                                      P.Segment(1, 0, 8, [0, 1])]
