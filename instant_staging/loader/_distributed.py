"""Loading on every rank of a torch.distributed group: each byte read once.

    load_file(paths, "cuda:0", process_group=pg)     # on every rank of pg

Every rank of ``pg`` calls the loader with the same checkpoint (its own
``device``; ``names=`` and ``plan=`` may differ per rank: a rank may load
only rows of a tensor, a tensor-parallel rank's share).  The ranks agree
on a plan:
each byte that some rank wants is read from the host by exactly one rank
that wants it, through that rank's own staging buffer into its own
device; the parts are then exchanged with torch.distributed collectives
only (NCCL between GPUs, gloo on the CPU), so every rank ends with every
tensor it asked for, bit-exact, as a solo load gives them (on a GPU views
of a few device blocks, ``views=False`` a tensor per allocation).

The share plan (``_share_plan.py``'s ``share_reads()``, pure and the same
on every rank), over segments (``cut_segments()``): a tensor is one,
unless ranks want different rows of it, when it is cut where any rank's
rows begin or end, each piece wanted by the ranks whose rows hold it:

- a segment wanted by one rank is read by that rank, whole, and never sent;
- the segments wanted by the same set of ranks form one byte stream in file
  order, cut into contiguous parts, one per member, sized so that the
  members' total reads come out even (water filling over what each already
  reads); a cut snaps to the nearest tensor boundary when that costs less
  than 1/64 of a rank's share, else it falls on a 4 KiB boundary inside
  the tensor;
- each part is cut again into units of at most ``UNIT_BYTES``: a unit is
  one pipeline item of its reader;
- the bytes each rank reads for others, in its reading order, are cut into
  buckets of at most ``BUCKET_BYTES`` (``HOST_BUCKET_BYTES`` for a load
  to the CPU; ``bucket_exchanges()``; a unit may
  straddle two): a bucket is one exchange, a ``broadcast`` from its reader
  (the ranks that want none of its bytes drop them), so a load makes at
  most ``ceil(bytes / BUCKET_BYTES) + world`` collectives however many
  tensors it holds (one per tensor made a fine-grained MoE checkpoint's
  exchange a launch and a round trip per tensor on NCCL);
- every rank issues the buckets in one global order, sorted by how far
  into its reader's share each bucket's last unit ends, so a rank issues
  its own bucket as soon as its pipeline finished it, and the others'
  are already queued (asynchronously) behind: the exchange runs while the
  ranks still read (NCCL and gloo both queue asynchronous work in issue
  order);
- a bucket passes through one of a rank's ``BUCKET_SLOTS`` buffers on its
  device (``_Ring``): its reader packs its bytes there from its tensors, a
  receiver copies out the bytes it wants into its own; a rank reuses the
  oldest slot once its exchange finished, so the exchange holds at most
  ``BUCKET_SLOTS * BUCKET_BYTES`` of device memory beyond the tensors.
  On gloo finishing means waiting on the host, and meanwhile watching the
  store: a rank that stopped exchanging (it posted its failure at
  agreement 3 without issuing every bucket) is an error on the others at
  once; on NCCL it only orders the device stream.

Failure on one rank is an error on every rank, never a hang: the ranks
agree three times through the group's key-value store (the one
``init_process_group`` made), each rank posting ``(ok, message, ...)`` and
waiting for the others' posts with a timeout (``timeout``, default
``defaults.DISTRIBUTED_TIMEOUT``; ``INSTANT_STAGING_DIST_TIMEOUT``
overrides) that names the ranks that never posted:

1. when ``iter_load`` is called: arguments, headers and ``names=`` checked
   on every rank, and every rank loading the same checkpoint: the same
   layout, the same dtype=, and each file the same content (``_contents``:
   compared by content, never by path, which may differ between ranks);
   the knobs too: where no rank set one, every rank's sample of the page cache
   travels with it, and a checkpoint the ranks find cold on average is
   read with the cold defaults on every rank (``_for_cache``);
2. before the first read: staging buffer made and tensors allocated (the
   staging kinds of all ranks travel with it: ``staging_kinds``);
3. after the exchange: every rank's reads and copies succeeded.  A rank
   whose read or copy failed still issues every remaining exchange (with
   the garbage its tensors hold), so nobody waits on it; the agreement
   then raises everywhere.  Tensors are handed out only after it.

The rank that failed raises its own error (``LoadError``,
``SafetensorsError``, ``KeyError``...); the others raise
``DistributedLoadError`` (a ``LoadError``) naming it in ``.ranks``.

Agreement 1 is ``iter_load_group``'s, before the iterator exists; the
load itself is ``_run.run``, the one skeleton of every load, with
``_Shared`` as its strategy: agreement 2 is its step 4 (ready), the reads,
the exchange and agreement 3 its step 5, and its teardown is the single
load's (``_run._LoadState.close()``).

Reading is the shared bottleneck (two ranks each reading everything at
once take nearly twice as long as each reading half), the GPUs' link
nearly free (exchanging costs a tenth of reading): docs/design.md,
"Measured: reading and exchanging across GPUs".
"""

import dataclasses
import datetime
import hashlib
import logging
import os
import pickle
import time
import traceback

from .. import envs
from ..defaults import DISTRIBUTED_TIMEOUT, GROUP_BUCKET_BYTES, GROUP_BUCKET_SLOTS, GROUP_HOST_BUCKET_BYTES
from . import _blocks, _gc, _progress, _run
from ._errors import LoadError
from ._options import for_cache
from ._run import LoadIterator
from ._share_plan import Wanted, bucket_exchanges, cut_segments, share_reads

log = logging.getLogger("instant_staging")

# A file's identity samples this many pages of its data (_contents).
IDENTITY_PAGES = 8
_PAGE = 4096
# The buckets of the exchange (defaults.py says why); a test sets smaller ones.
BUCKET_BYTES = GROUP_BUCKET_BYTES
HOST_BUCKET_BYTES = GROUP_HOST_BUCKET_BYTES      # a load to the CPU
BUCKET_SLOTS = GROUP_BUCKET_SLOTS
# While a gloo exchange waits, the store is asked this often whether a rank
# stopped exchanging.
_STORE_POLL_SECONDS = 0.05


class DistributedLoadError(LoadError):
    """Another rank of the group failed (or never answered).

    ``ranks`` maps each failed rank of the group to its message.
    """

    def __init__(self, message, ranks=None):
        super().__init__(message)
        self.ranks = dict(ranks or {})

    def __reduce__(self):
        return (type(self), (str(self), self.ranks))


class DistributedLoadIterator(LoadIterator):
    """The LoadIterator of a load under a process group: it yields only
    after every rank agreed that the whole load succeeded.  Every rank must
    consume (or close) its iterator: a rank that drops it unstarted never
    reaches the agreements, and the others then name it after the timeout."""

    def __init__(self, group, wanted, prepared):
        self._shared = _Shared(group, wanted)
        super().__init__(prepared)

    def _generate(self, state):
        return _run.run(state, self._shared)

    def close(self):
        # Closed before loading (never iterated, or dropped): the others
        # would wait for this rank at the next agreement until the timeout;
        # tell them now.
        shared = self._shared
        if not shared.started and os.getpid() == self._state.pid:
            shared.started = True
            try:
                shared.group.post("ready", (False, f"rank {shared.group.rank} closed its iterator "
                                                   "before loading", None))
            except Exception:  # a store gone at exit: nobody is waiting
                pass
        super().close()

    @property
    def staging_kinds(self):
        """The Kind of every rank's staging buffer, in group rank order
        (None for a rank that loads to the CPU through ordinary memory or
        has nothing to read), once loading started; None before."""
        return self._shared.kinds

    @property
    def read_bytes(self):
        """Bytes this rank reads from the host (its share), once planned."""
        return self._shared.read_bytes


# -- agreement through the store ----------------------------------------------

_sequence = {}


class _Group:
    """The process group, its ranks, and agreement through its store."""

    def __init__(self, dist, pg, timeout):
        self.dist, self.pg = dist, pg
        self.rank = dist.get_rank(pg)
        self.size = dist.get_world_size(pg)
        if self.rank < 0:
            raise ValueError("this process is not a member of process_group")
        self.globals = dist.get_process_group_ranks(pg)
        self.backend = str(dist.get_backend(pg)).lower()
        self.timeout = timeout
        ident = (getattr(pg, "group_name", None) or "") + "/" + ",".join(map(str, self.globals))
        seq = _sequence.get(ident, 0)
        _sequence[ident] = seq + 1
        # Keys are never deleted: no rank can tell when the others have read
        # them without one more round, and a load leaves three small ones.
        self.prefix = f"instant_staging/load/{ident}/{seq}/"
        self.store = dist.distributed_c10d._get_default_store()
        self.posted = set()

    def post(self, phase, value):
        """Posts this rank's ``value`` for ``phase`` (once; later posts of the
        same phase are ignored)."""
        if phase not in self.posted:
            self.posted.add(phase)
            self.store.set(self.prefix + f"{phase}/{self.rank}", pickle.dumps(value))

    def agree(self, phase, value):
        """Posts ``value`` for ``phase`` and returns every rank's, in rank
        order; a rank that does not post within the timeout is an error
        naming it."""
        self.post(phase, value)
        keys = [self.prefix + f"{phase}/{r}" for r in range(self.size)]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.timeout))
        except Exception as e:   # the store's timeout, or a rank (the store's host) gone
            missing = [r for r, k in enumerate(keys) if not _check(self.store, k)]
            if not missing:
                raise
            names = ", ".join(f"rank {r} (global rank {self.globals[r]})" for r in missing)
            raise DistributedLoadError(
                f"{names} of the process group did not reach the load's {phase!r} step "
                f"within {self.timeout:g} s (hung or died; INSTANT_STAGING_DIST_TIMEOUT "
                f"sets this timeout)", {r: "no answer" for r in missing}) from e
        return [pickle.loads(self.store.get(k)) for k in keys]

    def global_rank(self, r):
        return self.globals[r]

    def stopped(self, phase):
        """{rank: message} of the other ranks that posted failure at
        ``phase`` without issuing every exchange (agreement 3's posts)."""
        out = {}
        for r in range(self.size):
            key = self.prefix + f"{phase}/{r}"
            if r != self.rank and _check(self.store, key):
                ok, message, issued_all = pickle.loads(self.store.get(key))
                if not ok and not issued_all:
                    out[r] = message
        return out


def _check(store, key):
    try:
        return store.check([key])
    except Exception:
        return False


def _failed(values):
    """{rank: message} of the posts that say failure."""
    return {r: v[1] for r, v in enumerate(values) if not v[0]}


def _raise_others(group, failed, local, step):
    """Raises the local error, or a DistributedLoadError naming the others."""
    if local is not None:
        raise local
    text = "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items()))
    raise DistributedLoadError(f"the load failed on another rank of the process group "
                               f"({step}): {text}", failed)


def _describe(exc):
    return f"{type(exc).__name__}: {exc}"


# -- the entry point ---------------------------------------------------------

def timeout_from_env():
    """INSTANT_STAGING_DIST_TIMEOUT in seconds (> 0), else DISTRIBUTED_TIMEOUT."""
    seconds = envs.get("INSTANT_STAGING_DIST_TIMEOUT")
    return DISTRIBUTED_TIMEOUT if seconds is None else seconds


def _check_group(process_group):
    from ._target import _import_torch
    _import_torch()
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("process_group given but torch.distributed is not initialized "
                           "(call torch.distributed.init_process_group first)")
    if process_group is getattr(dist.GroupMember, "NON_GROUP_MEMBER", object()):
        raise ValueError("this process is not a member of process_group (new_group gave "
                         "it GroupMember.NON_GROUP_MEMBER): only the group's ranks load through it")
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed ProcessGroup, "
                        f"not {type(process_group).__name__}")
    return dist


def iter_load_group(prepared, process_group):
    """``iter_load`` under a process group.

    ``prepared`` is this rank's ``_prepare.Prepared`` (``prepare_share``),
    or the Exception that preparing it raised: that error reaches every
    rank at the ranks' first agreement, here.
    """
    dist = _check_group(process_group)
    group = _Group(dist, process_group, timeout_from_env())
    checkpoint = local = None
    try:
        if isinstance(prepared, BaseException):
            raise prepared
        checkpoint, target = prepared.shards, prepared.target
        if target.device.type == "cpu" and group.backend == "nccl":
            raise ValueError("an NCCL process group exchanges GPU tensors: load to this rank's "
                             "GPU, or use a gloo group for device='cpu'")
        post = (True, "", checkpoint.derived("layout", _layout), _wanted(checkpoint),
                prepared.resident, checkpoint.derived("contents", _contents),
                str(target.dtype))
    except Exception as e:
        local = e
        post = (False, _describe(e), None, None, None, None, None)
    try:
        values = group.agree("plan", post)
        failed = _failed(values)
        if failed:
            _raise_others(group, failed, local, "checking the checkpoint")
        differ = [r for r, v in enumerate(values) if v[2] != values[0][2]]
        if differ:
            raise DistributedLoadError(
                f"the ranks see different checkpoints: rank(s) {differ} differ from rank 0 "
                f"in tensor names, dtypes, shapes or offsets", {r: "different layout" for r in differ})
        differ = _differences([v[5] for v in values], [v[6] for v in values])
        if differ:
            raise DistributedLoadError(
                "the ranks load different checkpoints (compared by content, not by path): "
                + "; ".join(f"rank {r}: {m}" for r, m in differ.items()), differ)
    except BaseException:
        if checkpoint is not None:
            checkpoint.close()
        raise
    wanted = [Wanted(_places(v[3][0]), v[3][1]) for v in values]
    knobs = _for_cache([v[4] for v in values])
    if knobs:
        prepared = dataclasses.replace(prepared, options=dataclasses.replace(prepared.options, **knobs))
    return DistributedLoadIterator(group, wanted, prepared)


def _for_cache(residents):
    """The knobs every rank loads with, from every rank's sample of the
    page cache (``_options.for_cache``): the cold defaults only where no
    rank set a knob (False) and the ranks' samples average under half; the
    same answer on every rank, since every rank sees every post."""
    if any(r is False for r in residents):
        return {}
    known = [r for r in residents if r is not None]
    return for_cache(sum(known) / len(known) if known else None)


# A checkpoint's layout and its files' identity are worked out once
# (``Shards.derived``), however many group loads it makes: each was a
# walk of every tensor, or reads of every file, per load (docs/design.md,
# "Measured: a selection by names").

def _layout(checkpoint):
    """A digest of every tensor's name, dtype, shape and place: equal on
    every rank exactly when they read the same layout."""
    # (one repr of them all: an update per tensor cost a fine-grained
    # checkpoint's group load a call per tensor for no better digest)
    return hashlib.sha256(repr([(i, t.name, t.dtype, t.shape, t.begin, t.end)
                                for i, t in checkpoint.all_entries]).encode()).hexdigest()


def _contents(checkpoint):
    """Each file's identity, to compare with the other ranks' copies (whose
    paths may differ): ``(name, size, sha256 of its header, sha256 of
    IDENTITY_PAGES pages of its data)``, the pages spread evenly from the
    first to the last (the same offsets wherever the size is the same; the
    whole data section where it is no longer).  Read with pread, a few
    milliseconds for hundreds of shards.  It cannot see a change between
    the sampled pages (one byte elsewhere): ``verify=True`` checks every
    tensor against its file, and fails on the rank whose tensor came from
    the other copy.  A URL's objects are not fetched again for the pages
    (one ranged GET for the header each); each is named instead by
    ``(url, ETag, version)`` as it was opened, a fifth item (None for a
    file): ranks that opened the same URL at another ETag or version saw
    two versions of it (replaced between their opens; on a versioned
    bucket each rank's GETs would get its own)."""
    out = []
    for i, h in enumerate(checkpoint.headers):
        header = hashlib.sha256(checkpoint.read_bytes(i, 0, h.data_start)).hexdigest()
        pages = origin = None
        if checkpoint.from_url:             # (fetched, or read from the local cache: the same)
            origin = checkpoint.origin(i)
        else:                               # files
            data = h.file_size - h.data_start
            if data <= IDENTITY_PAGES * _PAGE:
                spans = [(h.data_start, data)]
            else:
                last = data - _PAGE
                spans = [(h.data_start + last * k // (IDENTITY_PAGES - 1), _PAGE)
                         for k in range(IDENTITY_PAGES)]
            digest = hashlib.sha256()
            for offset, length in spans:
                digest.update(checkpoint.read_bytes(i, offset, length))
            pages = digest.hexdigest()
        out.append((os.path.basename(checkpoint.paths[i]), h.file_size, header, pages, origin))
    return out


def _differences(contents, dtypes):
    """{rank: how its call or files differ from rank 0's} (none when the
    ranks load the same): every rank finds the same, from every rank's post."""
    out = {}
    for r in range(1, len(contents)):
        what = []
        if dtypes[r] != dtypes[0]:
            what.append(f"dtype={dtypes[r]} where rank 0 has dtype={dtypes[0]}")
        if len(contents[r]) != len(contents[0]):    # (zip below would stop at the shorter)
            what.append(f"{len(contents[r])} file(s) where rank 0 has {len(contents[0])}")
        for mine, first in zip(contents[r], contents[0]):
            parts = [part for part, a, b in (("size", mine[1], first[1]), ("header", mine[2], first[2]),
                                             ("sampled data pages", mine[3], first[3])) if a != b]
            if mine[4] and first[4] and mine[4][0] == first[4][0] and mine[4][1:] != first[4][1:]:
                parts.append(f"ETag or version ({mine[4][1]}, {mine[4][2]} where rank 0 opened "
                             f"{first[4][1]}, {first[4][2]}: the object was replaced between the opens)")
            if parts:
                what.append(f"{mine[0]} differs from rank 0's {first[0]} in its {' and '.join(parts)}")
        if what:
            out[r] = "; ".join(what)
    return out


def _wanted(checkpoint):
    """What this rank loads, as it travels to the others, in one pass over
    its selection: ``(mask, rows)``, the mask a bit per tensor of the
    checkpoint (bit k: its place k in ``all_entries``; ``_places`` reads it
    back), and ``{place: (begin, end)}`` for each tensor of which it loads
    only rows (``plan=``), bytes from the tensor's start."""
    n, rows = len(checkpoint.all_entries), {}
    if checkpoint.entries is checkpoint.all_entries:
        bits = bytearray(b"\xff" * (n // 8) + (bytes([(1 << n % 8) - 1]) if n % 8 else b""))
    else:
        bits = bytearray((n + 7) // 8)
        everything, places = checkpoint.all_entries, checkpoint.name_places()
        for _, t in checkpoint.entries:
            k = places[t.name]
            bits[k // 8] |= 1 << (k % 8)
            whole = everything[k][1]
            if (t.begin, t.end) != (whole.begin, whole.end):
                rows[k] = (t.begin - whole.begin, t.end - whole.begin)
    return bytes(bits), rows


def _places(mask):
    """The places a mask of ``_wanted`` sets, in order."""
    return [8 * i + b for i, byte in enumerate(mask) if byte for b in range(8) if byte >> b & 1]


# -- the load ------------------------------------------------------------------

class _Shared:
    """One rank's part of a process group's load: the strategy ``_run.run``
    runs it with (``_run._Solo`` is a load of one process's).  It reads its
    share of the bytes (``share_reads``) into tensors of their own, agrees with the
    other ranks that every rank is ready, exchanges the parts as its reads
    finish, agrees that every rank succeeded, and only then hands out its
    tensors."""

    def __init__(self, group, wanted):
        self.group, self.wanted = group, wanted
        self.started = False        # the plan is made: closing no longer tells the others
        self.kinds = None           # every rank's staging Kind, once all are ready
        self.read_bytes = None      # this rank's share, once planned
        self.whole = 0
        self.everything = self.mine = self.items = self.buckets = self.read_plan = None
        self.union = self.segments = self.shift = None
        self.order = None           # the places of this rank's tensors, in reading order
        self.runs = None            # their device blocks (``_blocks.runs``)
        self.slots = []             # this rank's bucket buffers (BUCKET_SLOTS at most)

    def plan_reads(self, state, chunk_size, faults):
        """Step 1: every rank's share of the bytes (``share_reads``, the same on
        every rank), and the Plan of this rank's (None: it reads nothing).
        The tensors planned (``everything``) are those some rank wants, in
        reading order: a load as long as the ranks' selections."""
        with _gc.paused():          # a unit, a segment per tensor, no cycles
            return self._plan_reads(state, chunk_size, faults)

    def _plan_reads(self, state, chunk_size, faults):
        from ._pipeline import Plan
        group, checkpoint = self.group, state.checkpoint
        union = self.union = sorted(set().union(*(w.places for w in self.wanted)))
        everything = self.everything = [checkpoint.all_entries[k] for k in union]
        places = checkpoint.name_places()
        # This rank's own entries (rows where plan= asked for rows), by
        # place, with their dtypes.
        self.mine = {places[t.name]: (i, t, dtype)
                     for (i, t), dtype in zip(checkpoint.entries, state.dtypes)}
        sizes = [t.nbytes for _, t in everything]
        segments = self.segments = cut_segments(union, sizes, self.wanted)
        # Where each segment's bytes lie in this rank's tensor (its place in
        # the tensor, less where the bytes this rank wants begin): worked out
        # once per segment, not once per piece of every bucket.
        if any(w.rows for w in self.wanted):
            me = self.wanted[group.rank]
            self.shift = [g.begin - me.span(union[g.index], sizes[g.index])[0] for g in segments]
        else:                       # (the usual: a segment is a whole tensor)
            self.shift = [0] * len(segments)
        reads, _ = share_reads([g.end - g.begin for g in segments], [g.ranks for g in segments],
                               group.size)
        self.buckets = bucket_exchanges(reads, HOST_BUCKET_BYTES if state.target.device.type == "cpu"
                                        else BUCKET_BYTES)
        self.started = True
        items = self.items = reads[group.rank]
        self.read_bytes = sum(u.end - u.begin for u in items)
        self.whole = sum(u.end - u.begin for r in reads for u in r)
        # This rank's tensors in device blocks where they lie back to back
        # (as a solo load's, ``_blocks.pyx``): a bucket's pieces of one block
        # are then one copy, not one per tensor.
        mine, rows = self.mine, self.wanted[group.rank].rows
        order = self.order = [p for p in union if p in mine]
        viewable = {d: state.target.joins(d, state.options.views) for d in set(state.dtypes)}
        self.runs = _blocks.runs([mine[p][:2] for p in order],
                                 [viewable[mine[p][2]] and p not in rows for p in order])
        block_of = {}
        for r, run in enumerate(self.runs):
            if run.block:
                for k in range(run.first, run.stop):
                    block_of[order[k]] = r
        ranges, joins = [], []
        fds, last = checkpoint.fds, (None, None)
        for u in items:
            g = segments[u.entry]
            i, t = everything[g.index]
            at = t.begin + g.begin
            here = (block_of.get(union[g.index]), fds[i])
            # (a block mirrors its file's bytes: contiguous in the file and in
            # one block is contiguous on the device)
            joins.append(here[0] is not None and here == last and ranges[-1][2] == at + u.begin)
            ranges.append((fds[i], at + u.begin, at + u.end))
            last = here
        self.read_plan = Plan(ranges, chunk_size, faults=faults, joins=joins)
        return self.read_plan if self.read_plan.n_chunks else None

    def while_staging(self, state, pending):
        pass                        # its buffer is made at once; torch's CUDA waits for step 5

    def provide_destinations(self, state):
        """Step 3: this rank's tensors, all before any read: views of one
        device block per run of them lying back to back (``self.runs``),
        the others each its own allocation; and the buffers its buckets
        pass through (at most ``BUCKET_SLOTS`` of at most ``BUCKET_BYTES``,
        on its device)."""
        target, mine, union, run_list = state.target, self.mine, self.union, self.runs
        entries, dtypes = [mine[p][:2] for p in self.order], [mine[p][2] for p in self.order]
        blocks = _run._allocate_blocks(target, run_list, entries, dtypes)
        _run._reserve_own(target, run_list, blocks, entries)
        handles = []
        with _gc.paused():          # a handle per tensor, no cycles
            for r, run in enumerate(run_list):
                block = blocks.get(r)
                if block is not None:
                    handles.extend(target.views(run, block, entries, dtypes))
                else:
                    handles.extend(target.allocate(entries[k][1], dtypes[k])[0]
                                   for k in range(run.first, run.stop))
            mine_handles = iter(handles)
            state.handles[:] = [next(mine_handles) if p in mine else None for p in union]
        if self.buckets:
            size = max(k.nbytes for k in self.buckets)
            self.slots = [target.torch.empty(size, dtype=target.torch.uint8, device=target.device)
                          for _ in range(min(BUCKET_SLOTS, len(self.buckets)))]

    def ready(self, state, error):
        """Step 4, the second agreement: every rank made its staging buffer
        and its tensors (their staging kinds travel with it)."""
        if error is not None:
            traceback.clear_frames(error.__traceback__)
            post = (False, _describe(error), None)
        else:
            kind = state.staging_kind
            post = (True, "", kind.name if kind is not None else None)
        values = self.group.agree("ready", post)
        failed = _failed(values)
        if failed:
            self.slots = []
            _raise_others(self.group, failed, error, "making the staging buffer and the tensors")
        from .._types import Kind
        self.kinds = tuple(Kind[v[2]] if v[2] is not None else None for v in values)
        _report_kinds([v[2] for v in values])

    def drive(self, state, verify, progress):
        """Step 5: the reads, the exchanges as the reads finish, the third
        agreement (every rank's reads and copies succeeded), then the
        tensors."""
        group, target, checkpoint, pipe = self.group, state.target, state.checkpoint, state.pipe
        me, items, everything, handles = group.rank, self.items, self.everything, state.handles
        runtime = state.runtime
        # Each rank reports its own share; our printers say so, and the whole.
        progress = _progress.for_rank(progress, me, group.size, self.whole)
        target.before_copies()
        # Where each segment's bytes lie on this rank: the bytes of its
        # tensor's block (or of the tensor itself) and the offset there.
        shift, segments = self.shift, self.segments
        with _gc.paused():          # a view per tensor of its own, no cycles
            places = [target.place(h) if h is not None else (None, 0) for h in handles]
            bases = [places[g.index][0] for g in segments]
            at = [places[g.index][1] + d for g, d in zip(segments, shift)]
        if pipe is not None:
            ptrs = {}
            for u in items:
                base = bases[u.entry]
                if id(base) not in ptrs:
                    ptrs[id(base)] = base.data_ptr()
            pipe.start([ptrs[id(bases[u.entry])] + at[u.entry] + u.begin for u in items])
        # The tensors of views are made while this rank waits (for its
        # reads, for a bucket), not all after the last agreement.
        idle = _Views(target, handles).some
        ring, issued_all, error = _Ring(group, self.slots, self._pieces(bases, at), idle), False, None
        waiter = _Waiter(pipe, len(items), self.read_bytes, progress, idle)
        try:
            for k in self.buckets:
                slot = ring.take()
                view = slot[:k.nbytes]
                if k.src == me:
                    waiter.until_each(u.item for u, *_ in k.pieces)
                    ring.pack(k, view)
                ring.issue(k, slot, view, _exchange(group, k, view))
            issued_all = True
            waiter.until_all()
            # Read before close(): closing a pipeline cancels it, and reports so.
            error = pipe.error() if pipe is not None else None
        except BaseException as e:
            # Interrupted here (Ctrl-C, a cancel, a broken group): tell the
            # others at once instead of letting them wait for the timeout.
            # Stopped by another rank that stopped (``_Ring``): that one's
            # post names it; this rank's says only that it issued no more.
            if isinstance(e, DistributedLoadError) and e.ranks:
                group.post("done", (True, "", False))
            else:
                group.post("done", (False, f"interrupted while exchanging: {_describe(e)}", False))
            ring.drop()
            raise
        finally:
            if pipe is not None:
                pipe.close()       # joined: nothing writes into the tensors any more
        local = None
        if error is not None or waiter.left:
            local = (_run.load_error(pipe, self.read_plan, checkpoint, runtime,
                                     [everything[segments[u.entry].index] for u in items])
                     if error is not None else
                     LoadError(f"the load ended with {waiter.left} part(s) unread and no error recorded"))
        else:
            # (this rank's files, before every rank agrees: each rank raises)
            local = _run.written_while_read(checkpoint)
        post = (False, str(local), issued_all) if local is not None else (True, "", issued_all)
        values = group.agree("done", post)
        failed = _failed(values)
        if all(v[2] for v in values):
            ring.finish()              # every rank issued every exchange: they all finish
        ring.drop()
        self.slots = []
        if failed:
            _raise_others(group, failed, local, "reading and exchanging")
        if target.device.type != "cpu":
            target.torch.cuda.current_stream(target.device).synchronize()
        if progress is not None:
            progress(self.read_bytes, self.read_bytes)
        # Finished once every rank agreed, before the first tensor goes out:
        # closing the iterator after it takes some is no cancel.
        state.finished = True
        for k, p in enumerate(self.union):
            handle = handles[k]
            if handle is not None:
                handles[k] = None
                i, t, _ = self.mine[p]
                tensor = target.tensor(handle)
                if verify:
                    _run.verify_tensor(checkpoint, (i, t), target, tensor)
                yield t.name, target.result(tensor)

    def _pieces(self, bases, at):
        """``pieces(bucket, view=None)``: the bytes of ``bucket`` this rank
        holds (its reader) or wants (a receiver), as two lists: slices of
        the bytes they go to (``bases``: each segment's block or tensor, as
        bytes, the segment at ``at`` there) and, where ``view`` (the
        bucket's buffer) is given, the slices of ``view`` they come from.
        Pieces back to back in the bucket and in one block are one slice
        (a bucket of a fine-grained checkpoint holds hundreds of tensors: a
        view and a copy per tensor was most of a group load's cost per
        tensor).  A function: each bucket's slices are made as it comes."""
        me = self.group.rank

        def pieces(bucket, view=None):
            mine = bucket.src == me
            runs, run = [], None        # [base, begin, end, offset in the bucket]
            for u, b, e, offset in bucket.pieces:
                if not (mine or me in u.dsts):
                    run = None
                    continue
                base, where = bases[u.entry], at[u.entry] + b
                if run is not None and run[0] is base and run[2] == where:
                    run[2] += e - b
                else:
                    run = [base, where, where + e - b, offset]
                    runs.append(run)
            tensors = [base if b == 0 and e == base.numel() else base[b:e] for base, b, e, _ in runs]
            if view is None or not runs:
                return tensors, []
            # The bucket's side in one split (a piece not wanted here is a gap).
            sizes, pick, end = [], [], 0
            for _, b, e, offset in runs:
                if offset > end:
                    sizes.append(offset - end)
                pick.append(len(sizes))
                sizes.append(e - b)
                end = offset + e - b
            if end < view.numel():
                sizes.append(view.numel() - end)
            split = view.split(sizes)
            return tensors, [split[k] for k in pick]
        return pieces


class _Views:
    """Makes the tensors of a rank's views (``_target.views()``'s handles)
    a few at a time, while the rank waits: a fine-grained checkpoint's
    thousands took tens of milliseconds after the last agreement, where
    nothing else ran (docs/design.md, "Measured: a group load's buckets").
    A view is only metadata: made before its bytes arrive, handed out
    after."""

    def __init__(self, target, handles):
        self.target, self.handles, self.next = target, handles, 0

    def some(self, n=64):
        """Makes up to ``n`` more; False once none is left."""
        handles, tensor = self.handles, self.target.tensor
        end = min(self.next + n, len(handles))
        for k in range(self.next, end):
            if handles[k] is not None:
                handles[k] = tensor(handles[k])
        self.next = end
        return end < len(handles)


class _Waiter:
    """Waits for this rank's pipeline items; never blocks once it failed.
    ``idle()`` (it returns False once it has nothing left to do) runs
    between its polls."""

    def __init__(self, pipe, n, total, progress, idle=lambda: False):
        self.pipe, self.done, self.total, self.progress = pipe, [False] * n, total, progress
        self.left, self.stopped, self.reported = n, False, -1
        self.idle = idle

    def _poll(self, timeout):
        if self.pipe is None:          # nothing to read on this rank
            self.stopped = True
            return
        finished, nbytes, exited, failed = self.pipe.wait(timeout)
        for i in finished:
            if not self.done[i]:
                self.done[i] = True
                self.left -= 1
        if self.progress is not None and nbytes != self.reported:
            self.progress(nbytes, self.total)
            self.reported = nbytes
        if failed or exited:
            self.stopped = True

    def until_each(self, items):
        """``until(item)`` for each of ``items`` not done yet."""
        done = self.done
        for item in items:
            if not done[item]:
                self.until(item)

    def until(self, item):
        while not self.done[item] and not self.stopped:
            self._poll(0 if self.idle() else _run.POLL_SECONDS)
        if not self.done[item] and not self.stopped:
            self._poll(0)

    def until_all(self):
        while self.left and not self.stopped:
            self._poll(0 if self.idle() else _run.POLL_SECONDS)


def _exchange(group, bucket, view):
    """Issues the exchange of one bucket (asynchronously); returns its work:
    a ``broadcast`` from its reader to the whole group, also where only some
    ranks want its bytes (the others drop them): a gloo ``isend``/``irecv``
    cannot be polled (its work says it completed only once waited for, and
    a wait that timed out cannot be waited for again), so a rank waiting
    for one could not watch the store for a rank that stopped."""
    return group.dist.broadcast(view, src=group.global_rank(bucket.src), group=group.pg,
                                async_op=True)


class _Ring:
    """This rank's bucket buffers (``slots``), each sending or receiving one
    bucket at a time: a bucket takes a free one, or the oldest in flight
    once that one finished (a received bucket is then copied out into its
    tensors).  On NCCL, finishing orders the device stream (``wait()``
    blocks no host thread); on gloo it waits for the transfer, watching the
    store meanwhile: a rank that stopped exchanging (it posted its failure
    at agreement 3 without issuing every exchange) is an error here at
    once, not a wait for the group's timeout."""

    def __init__(self, group, slots, pieces, idle=lambda: False):
        self.group, self.pieces, self.idle = group, pieces, idle
        self.free = list(slots)
        self.flying = []            # (work, slot, bucket received or None, view), oldest first

    def take(self):
        """A free slot (the oldest in flight retired first, where none is)."""
        if not self.free:
            self._retire(self.flying.pop(0))
        return self.free.pop()

    def pack(self, bucket, view):
        """Copies this rank's bytes of ``bucket`` into ``view`` (its pieces
        lie back to back there: one ``cat`` of a slice per block)."""
        import torch
        torch.cat(self.pieces(bucket)[0], out=view)

    def issue(self, bucket, slot, view, work):
        """Keeps ``slot`` busy until ``work`` (``bucket``'s exchange through
        ``view``) finished."""
        received = bucket if bucket.src != self.group.rank else None
        self.flying.append((work, slot, received, view))

    def finish(self):
        while self.flying:
            self._retire(self.flying.pop(0))

    def drop(self):
        """Forgets what is in flight (the load failed): nothing is copied out."""
        self.flying.clear()
        self.free.clear()

    def _retire(self, flight):
        work, slot, received, view = flight
        if self.group.backend != "nccl":
            self._settle(work)
        work.wait()
        if received is not None:
            _copy(*self.pieces(received, view))
        self.free.append(slot)

    def _settle(self, work):
        """Waits until ``work`` completed, or raises when a rank it may wait
        for gave up exchanging, or after the group's timeout."""
        group, pause = self.group, 1e-4
        began = check = time.monotonic()
        while not work.is_completed():
            if not self.idle():
                time.sleep(pause)
            pause = min(pause * 2, 2e-3)
            now = time.monotonic()
            if now - check >= _STORE_POLL_SECONDS:
                check = now
                gone = group.stopped("done")
                if gone:
                    text = "; ".join(f"rank {r}: {m}" for r, m in sorted(gone.items()))
                    raise DistributedLoadError(f"the load failed on another rank of the process "
                                               f"group (reading and exchanging): {text}", gone)
                if now - began > group.timeout:
                    raise DistributedLoadError(
                        f"an exchange of the load did not finish within {group.timeout:g} s "
                        f"(INSTANT_STAGING_DIST_TIMEOUT sets this timeout)")


def _copy(dsts, srcs):
    """Copies each of ``srcs`` into the tensor of ``dsts`` at its place: on
    a GPU in as few launches as torch batches them into (a launch per piece
    would cost a fine-grained checkpoint milliseconds); on the CPU one by
    one (``_foreach_copy_`` there copied several times slower than a loop)."""
    if not dsts:
        return
    if dsts[0].is_cuda:
        import torch
        torch._foreach_copy_(dsts, srcs)
    else:
        for d, s in zip(dsts, srcs):
            d.copy_(s)


def _report_kinds(kinds):
    """A WARNING when some rank's staging buffer fell back from REGISTERED."""
    fell = {r: k for r, k in enumerate(kinds) if k is not None and k != "REGISTERED"}
    if fell:
        log.warning("staging kinds of the process group's ranks: %s (rank(s) %s fell back from "
                    "REGISTERED; see that rank's staging warning for the reason)",
                    ", ".join(f"rank {r} {k}" for r, k in enumerate(kinds)),
                    ", ".join(map(str, sorted(fell))))
