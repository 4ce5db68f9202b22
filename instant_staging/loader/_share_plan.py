"""The share plan of a process group's load: which rank reads which bytes.

Pure and side-effect free (no torch, no group, no file): every rank runs it
on the same inputs (every rank's selection, the tensors' sizes) and gets
the same answer; ``_distributed.py`` is the protocol around it (agreements,
reads, the exchange).  Run:ai Model Streamer keeps its partition the same
way (``distributed_streamer/partition.py``).

- ``Wanted``: one rank's selection, as it travels to the others;
- ``cut_segments()``: a tensor is one segment, unless ranks want different
  rows of it, when it is cut where any rank's rows begin or end, each piece
  wanted by the ranks whose rows hold it;
- ``share_reads()``: who reads each segment's bytes, cut into units (each
  one pipeline item of its reader), and the global order of the units the
  others receive: ``_distributed.py``'s module docstring says how;
- ``water_fill()``: the shares that level the ranks' reads.
"""

from bisect import bisect_right
from itertools import repeat
from operator import attrgetter
from typing import NamedTuple

# Largest unit of exchange: a unit is sent once its reader has it, so the
# exchange of the last unit is what stays exposed after the reads (a
# fraction of a millisecond over NVLink; docs/design.md, "Measured: reading
# and exchanging across GPUs").
UNIT_BYTES = 64 << 20
# Cuts inside a tensor fall on this boundary (relative to the tensor).
CUT_ALIGN = 4096
# A cut moves to the nearest tensor boundary when that unbalances the
# ranks by less than this fraction of one rank's share.
SNAP_FRACTION = 1 / 64


class Wanted(NamedTuple):
    """One rank's selection: the places of its tensors in ``all_entries``,
    in order, and the bytes it wants of those it wants only rows of."""

    places: list
    rows: dict

    def span(self, place, nbytes):
        """The bytes ``[begin, end)`` of the tensor at ``place`` it wants."""
        return self.rows.get(place, (0, nbytes))



class Unit:
    """Bytes ``[begin, end)`` of tensor ``entry``, read by ``src`` and sent
    to ``dsts`` (ranks of the group; empty for a tensor only src wants)."""

    __slots__ = ("begin", "dsts", "end", "entry", "item", "key", "src")

    def __init__(self, entry, begin, end, src, dsts):
        self.entry, self.begin, self.end, self.src, self.dsts = entry, begin, end, src, dsts
        self.item = -1      # index among src's read items
        self.key = None     # position in the global issue order

    def __repr__(self):
        return f"Unit({self.entry}, {self.begin}, {self.end}, src={self.src}, dsts={self.dsts})"


def share_reads(sizes, wanted, world, unit_bytes=UNIT_BYTES):
    """Who reads what, and the exchanges, the same on every rank.

    ``sizes[i]``: bytes of tensor i (tensors in reading order); ``wanted[i]``:
    the ranks that want it.  Returns ``(reads, exchanges)``: ``reads[r]`` the
    units rank r reads, in file order (unit.item is the index there), and
    ``exchanges`` the units with receivers, in the global issue order.
    """
    loads = [0] * world
    reads = [[] for _ in range(world)]
    groups = {}
    # (the planned tensors of a load that every rank wants whole share one
    # list of ranks: sorted once, not once per tensor; a fine-grained
    # checkpoint holds tens of thousands)
    last = key = None
    for i, (n, ranks) in enumerate(zip(sizes, wanted)):
        if ranks is not last:
            last, key = ranks, tuple(sorted(set(ranks)))
        if n == 0 or not key:
            continue
        if len(key) == 1:
            reads[key[0]].append(Unit(i, 0, n, key[0], ()))
            loads[key[0]] += n
        else:
            groups.setdefault(key, []).append(i)
    for members, entries in groups.items():
        shares = water_fill([loads[r] for r in members], sum(sizes[i] for i in entries))
        parts = _cut(entries, sizes, shares)
        for r, part in zip(members, parts):
            dsts = tuple(m for m in members if m != r)
            mine = reads[r]
            for i, b, e in part:
                if e - b <= unit_bytes:
                    mine.append(Unit(i, b, e, r, dsts))
                else:
                    for ub in range(b, e, unit_bytes):
                        mine.append(Unit(i, ub, min(e, ub + unit_bytes), r, dsts))
                loads[r] += e - b
    exchanges = []
    for r in range(world):
        reads[r].sort(key=_unit_order)
        position = 0
        for item, u in enumerate(reads[r]):
            u.item = item
            position += u.end - u.begin
            u.key = (position, r)
            if u.dsts:
                exchanges.append(u)
    exchanges.sort(key=_issue_order)
    return reads, exchanges


_unit_order = attrgetter("entry", "begin")
_issue_order = attrgetter("key")


class Segment(NamedTuple):
    """Bytes ``[begin, end)`` of the planned tensor ``index`` that the same
    ``ranks`` want: a tensor is one segment, unless some rank wants only
    rows of it (``plan=``), when it is cut where any rank's rows begin or
    end."""

    index: int
    begin: int
    end: int
    ranks: list


def cut_segments(places, sizes, wanted):
    """The segments ``share_reads()`` shares out (its "tensors"), in reading
    order: ``places`` the places (in ``all_entries``) of the tensors some
    rank wants, in reading order, ``sizes`` their bytes, ``wanted`` every
    rank's ``Wanted``."""
    wanted_sets = [set(w.places) for w in wanted]
    everyone = list(range(len(wanted)))
    # (the usual, without a walk of the ranks per tensor: every rank wants
    # every tensor whole; a fine-grained checkpoint holds tens of thousands)
    if all(not w.rows for w in wanted) and all(len(m) == len(places) for m in wanted_sets):
        return list(map(Segment, range(len(sizes)), repeat(0), sizes, repeat(everyone)))
    out = []
    for k, (p, nbytes) in enumerate(zip(places, sizes)):
        spans = {r: w.span(p, nbytes) for r, (w, mine) in enumerate(zip(wanted, wanted_sets))
                 if p in mine}
        if len(set(spans.values())) == 1:      # (the usual: every rank the same bytes)
            b, e = next(iter(spans.values()))
            out.append(Segment(k, b, e, sorted(spans)))
            continue
        cuts = sorted({x for span in spans.values() for x in span})
        for b, e in zip(cuts, cuts[1:]):
            ranks = [r for r, (lo, hi) in spans.items() if lo <= b and e <= hi]
            if ranks:
                out.append(Segment(k, b, e, ranks))
    return out


def water_fill(loads, total):
    """Shares of ``total`` that bring ``loads`` as close to level as possible."""
    order = sorted(range(len(loads)), key=lambda k: loads[k])
    level, left = 0, total
    for j, k in enumerate(order):       # raise the lowest j+1 together
        nxt = loads[order[j + 1]] if j + 1 < len(order) else None
        width = j + 1
        if nxt is None or (nxt - loads[k]) * width >= left:
            level = loads[k] + left / width
            break
        left -= (nxt - loads[k]) * width
    return [max(0.0, level - x) for x in loads]


def _cut(entries, sizes, shares):
    """Cuts the byte stream of ``entries`` into contiguous parts of about
    ``shares`` bytes: a list of ``(entry, begin, end)`` per part."""
    starts, pos = [], 0
    for i in entries:
        starts.append(pos)
        pos += sizes[i]
    total = pos
    tolerance = max(CUT_ALIGN, int(total / max(1, len(shares)) * SNAP_FRACTION))
    bounds, acc = [0], 0.0
    for s in shares[:-1]:
        acc += s
        bounds.append(max(bounds[-1], _snap(round(acc), entries, sizes, starts, tolerance)))
    bounds.append(total)
    # (each part walks only its own entries, found by bisection: a walk of
    # every entry per part, and per cut, was quadratic in the ranks)
    parts = []
    for lo, hi in zip(bounds, bounds[1:]):
        first, stop = max(0, bisect_right(starts, lo) - 1), bisect_right(starts, hi - 1)
        part = []
        for j in range(first, stop):
            i, start = entries[j], starts[j]
            b, e = max(lo, start), min(hi, start + sizes[i])
            if b < e:
                part.append((i, b - start, e - start))
        parts.append(part)
    return parts


def _snap(p, entries, sizes, starts, tolerance):
    """Where the cut at ``p`` falls (the entries' sizes are > 0, so one
    entry at most holds ``p``)."""
    j = bisect_right(starts, p) - 1
    if j >= 0:
        start = starts[j]
        end = start + sizes[entries[j]]
        if p < end:
            if p - start <= tolerance or end - p <= tolerance:
                return start if p - start <= end - p else end
            inside = (p - start) // CUT_ALIGN * CUT_ALIGN
            return start + inside if inside > 0 else end
    return p


class Bucket(NamedTuple):
    """One exchange: ``nbytes`` bytes that ``src`` read, packed back to back
    and sent to ``dsts`` (the union of its units' receivers; a receiver
    keeps only the pieces it wants).  ``pieces``: ``(unit, begin, end,
    offset)``, the bytes ``[begin, end)`` of ``unit`` (in the unit's
    coordinates, ``unit.begin <= begin < end <= unit.end``) at ``offset``
    in the bucket.  ``key``: its place in the global issue order."""

    src: int
    dsts: tuple
    nbytes: int
    pieces: list
    key: tuple


def bucket_exchanges(reads, bucket_bytes):
    """The exchanges of ``share_reads()``'s ``reads``, packed: each rank's
    units with receivers, in its reading order, as one byte stream cut
    every ``bucket_bytes`` (a unit may straddle two buckets), so a load
    makes at most ``ceil(bytes / bucket_bytes) + world`` exchanges however
    many tensors it holds.  Returned in the global issue order: by how far
    into its reader's share each bucket's last unit ends (a rank issues its
    own bucket once its pipeline has read it, the others' are queued
    behind), the same on every rank."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, not {bucket_bytes}")
    out = []
    for r, units in enumerate(reads):
        streams, filled = [], bucket_bytes     # each bucket's pieces, and its receivers
        for u in units:
            if not u.dsts:
                continue
            b, end = u.begin, u.end
            while b < end:
                if filled == bucket_bytes:
                    pieces, dsts, last = [], set(), None
                    streams.append((pieces, dsts))
                    filled = 0
                if u.dsts is not last:          # (units of one part share their receivers)
                    last = u.dsts
                    dsts.update(last)
                n = min(end - b, bucket_bytes - filled)
                pieces.append((u, b, b + n, filled))
                filled += n
                b += n
        for pieces, dsts in streams:
            out.append(Bucket(r, tuple(sorted(dsts)), pieces[-1][3] + pieces[-1][2] - pieces[-1][1],
                              pieces, (pieces[-1][0].key[0], r, len(out))))
    out.sort(key=lambda k: k.key)
    return out
