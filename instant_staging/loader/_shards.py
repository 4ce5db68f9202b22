"""The checkpoint: the shards to read, opened, with validated headers.

Every header is parsed and validated before anything is allocated.  A
``Shards`` owns its file descriptors; ``close()`` is called only by the
code that owns the load once its reader threads have stopped.

A Ctrl-C may land anywhere, so a descriptor is recorded in ``fds`` in the
same step that opens it and leaves it in the step that closes it
(``_fds.pyx``): ``close()`` always finds exactly what is still open, and
calling it again finishes a close that an interrupt cut short.  Making a
``Shards`` opens nothing: its maker holds it before ``open`` makes it
own anything, and closes it if ``open`` (or anything after) raises.
"""

import copy
import os
import stat

from ..defaults import COLD_SAMPLES
from . import _gc
from ._errors import not_found
from ._fds import close_recorded, open_recorded
from ._header import DTYPE_BITS, SafetensorsError, TensorEntry, read_header
from ._options import for_cache, is_cold
from ._pagecache import Warmer, page_cached
from ._source import file_kind

# O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer,
# forever; only a regular file is read (O_NONBLOCK, which reads of one
# ignore, is then cleared).
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


class Shards:
    """The open shards and their tensors in reading order (shard, offset)."""

    def __init__(self):
        self.paths, self.fds, self.headers = [], [], []
        # Each file's (modification time, size) as opened: ``changed()``.
        self.stamps = []
        # The Warmer reading this checkpoint into the page cache from CUDA's
        # start on (warm_if_cold), in a list that every share() has too: the
        # load's teardown joins it, and the owner's close() before it closes
        # the descriptors the Warmer reads.
        self._warming = []
        self._sample = None     # resident() as warm_if_cold found it
        # Every tensor, as open() found them (a share's select() narrows its
        # own entries, never this).
        self.all_entries = []
        # What is worked out once from the open files and asked by each
        # load (``derived``), in a dict every share() has too: a load is
        # then as long as its selection, not the checkpoint (vLLM's batches
        # are hundreds of loads of a checkpoint of up to 90,000 tensors:
        # docs/design.md, "Measured: a selection by names").
        self._derived = {}

    def open(self, paths):
        """Opens ``paths`` and parses their headers; returns self.  On any
        exception (a Ctrl-C too) what it opened is closed."""
        try:
            # (the entries' tuples too: made with the collector running,
            # each collection walked every entry made before, and a large
            # MoE checkpoint's open took twice as long: docs/design.md,
            # "Measured: the collector during a parse")
            with _gc.paused():
                self._open_all([os.fspath(path) for path in paths])
                self.entries = self.all_entries = [(i, t) for i, h in enumerate(self.headers)
                                                   for t in h.tensors]
                if len(self.headers) > 1:   # (one header's names are its own keys: unique)
                    self._check_duplicates()
            # (the tensors of a header cover its data section exactly)
            self.total_bytes = sum(h.file_size - h.data_start for h in self.headers)
        except BaseException:
            self.close()
            raise
        return self

    def _open_all(self, paths):
        for path in paths:
            self._open(path)

    def _open(self, path):
        try:
            fd = open_recorded(self.fds, path, _OPEN_FLAGS)
        except FileNotFoundError:
            raise not_found(os.fsdecode(path)) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SafetensorsError(f"is {file_kind(st.st_mode)}, not a regular file: it cannot be a "
                                   "safetensors file", os.fsdecode(path))
        os.set_blocking(fd, True)
        self.paths.append(os.fsdecode(path))     # messages and errors name a str
        self.stamps.append((st.st_mtime_ns, st.st_size))
        self.headers.append(read_header(fd, path))

    def _check_duplicates(self):
        if len({t.name for _, t in self.entries}) == len(self.entries):
            return              # (the usual case, in one set: 4,680 names in a fraction of a ms)
        seen = {}
        for i, t in self.entries:
            if t.name in seen:
                raise SafetensorsError(f"tensor name appears in two shards: "
                                       f"{self.paths[seen[t.name]]} and {self.paths[i]}",
                                       self.paths[i], t.name)
            seen[t.name] = i

    def select(self, names):
        """Keeps only the selected tensors (docs/design.md's ``names=``): None for
        all, an iterable of names (unknown ones are a KeyError listing them),
        or a predicate ``name -> bool``.  Only their bytes are read."""
        if names is None:
            return
        if callable(names):
            self.entries = [(i, t) for i, t in self.entries if names(t.name)]
        else:
            if isinstance(names, (str, bytes)):
                raise TypeError("names must be an iterable of tensor names or a callable, "
                                f"not a single {type(names).__name__}")
            keep = set(names)
            places = (self.name_places() if self.entries is self.all_entries
                      else {t.name: k for k, (_, t) in enumerate(self.entries)})
            unknown = [n for n in keep if n not in places]
            if unknown:
                raise KeyError(f"{len(unknown)} tensor name(s) not in the checkpoint: "
                               + ", ".join(repr(n) for n in sorted(unknown, key=str)[:20])
                               + (" ..." if len(unknown) > 20 else ""))
            # (the places are in reading order, as the entries are)
            self.entries = [self.entries[k] for k in sorted(places[n] for n in keep)]
        self.total_bytes = sum(t.nbytes for _, t in self.entries)

    def derived(self, key, make):
        """``make(self)``, worked out once for the checkpoint and its shares
        (the first result stored is every caller's: a share in another
        thread that worked it out meanwhile drops its own)."""
        try:
            return self._derived[key]
        except KeyError:
            return self._derived.setdefault(key, make(self))

    def name_places(self):
        """``{name: its place in all_entries}``."""
        return self.derived("places", _name_places)

    def resident(self, samples=COLD_SAMPLES):
        """The fraction of ``samples`` pages, spread evenly over the selected
        tensors' bytes, that the page cache holds; None where the kernel or
        the file system cannot tell.  Asked with cachestat(2), which starts
        no I/O (``_pagecache.pyx``); where the kernel lacks it, with a
        one-byte read that never waits for the disk (RWF_NOWAIT: on a page
        not cached it starts that page's readahead, as any read would)."""
        ranges = self._ranges()
        total = sum(n for _, _, n in ranges)
        targets = [total * (2 * k + 1) // (2 * samples) for k in range(samples)] if total else []
        points, base = [], 0
        for fd, begin, nbytes in ranges:
            while targets and targets[0] < base + nbytes:
                points.append((fd, begin + targets.pop(0) - base))
            base += nbytes
        if not points:
            return None
        try:
            hits = sum(page_cached(fd, offset) for fd, offset in points)
        except OSError:
            hits = _read_without_waiting(points)
        return None if hits is None else hits / len(points)

    def _ranges(self):
        """The selected tensors' bytes, ``(descriptor, offset, length)`` in
        reading order."""
        if len(self.entries) == sum(len(h.tensors) for h in self.headers):
            # every tensor: the data sections, which the tensors cover exactly
            return [(fd, h.data_start, h.file_size - h.data_start)
                    for fd, h in zip(self.fds, self.headers) if h.file_size > h.data_start]
        return [(self.fds[i], t.begin, t.nbytes) for i, t in self.entries if t.nbytes]

    def warm_if_cold(self, piece_bytes, threads):
        """Where the page cache mostly lacks the selected tensors (``is_cold``),
        starts reading their bytes into it, in reading order, in pieces of
        ``piece_bytes`` with ``threads`` C threads (``_pagecache.Warmer``)
        until ``stop_warming()`` or the last byte: for a load whose readers
        read behind it (after CUDA's start, in a fresh process).  Returns
        whether it started (once per checkpoint)."""
        if self._warming:
            return False
        sample = self.resident()
        if not is_cold(sample):
            return False
        self._warming.append(Warmer(self._ranges(), piece_bytes, threads))
        # The load's knobs follow this sample: one taken after the warming
        # began could find the first pages cached.
        self._sample = sample
        return True

    def stop_warming(self):
        """Stops the warming threads after their reads in flight and joins
        them; nothing where none run."""
        for warmer in self._warming:
            warmer.close()

    def share(self, release):
        """This checkpoint for one load: its own selection (``select``,
        ``plan``), the same descriptors; its ``close()`` is ``release``
        (idempotent: a load's owners may each close it; the owner closes
        the descriptors once no load holds them)."""
        view = copy.copy(self)
        token = [True]

        def close():
            # list.pop is one step: exactly one caller releases (an interrupt
            # after it can only leave the hold, never release it twice)
            try:
                token.pop()
            except IndexError:
                return
            release()
        view.close = close
        return view

    def select_rows(self, plan):
        """Keeps, of each tensor ``plan`` maps to a slice, only those rows of
        its first dimension (``Checkpoint.load``'s ``plan=``; the selection
        is then the plan's names): only their bytes are read."""
        if plan is None:
            return
        if not isinstance(plan, dict):
            raise TypeError(f"plan must be a dict of tensor name -> None or a slice, not "
                            f"{type(plan).__name__}")
        self.select(list(plan))
        self.entries = [(i, rows(t, plan[t.name], self.paths[i])) for i, t in self.entries]
        self.total_bytes = sum(t.nbytes for _, t in self.entries)

    # The reader threads pread the descriptors (a remote checkpoint's
    # readers call its fetch instead: ``_remote.py``).
    fetch = None
    # Whether the shards are a URL source's objects (fetched, or read from
    # the local cache's entries: ``_cache.py``); such have ``origin(i)``.
    from_url = False

    def default_knobs(self):
        """The knobs for this checkpoint where the caller set none: the cold
        ones where the page cache mostly lacks it (``_options.for_cache``)."""
        return for_cache(self._sample if self._sample is not None else self.resident())

    def read_bytes(self, index, offset, length):
        """``length`` bytes at ``offset`` of file ``index``, with plain reads
        (verify=: not through the staging buffer); fewer where it ended."""
        data = bytearray(length)
        got = os.preadv(self.fds[index], [data], offset)
        return data if got == length else data[:got]

    def current_size(self, index):
        return os.fstat(self.fds[index]).st_size

    def revalidating(self):
        """Starts asking the server whether what is read is still the
        source's (a URL source's hit: ``_revalidate.py``); nothing to ask
        here."""

    def revalidated(self):
        """Waits until the server vouched for what is read (a URL source's
        hit, read from the cache while its objects are asked: ``_revalidate.py``);
        raises what it answered (``RemoteChangedError``: an object changed).
        Asked before a load's first byte reaches a caller's tensor; nothing
        to wait for here."""

    def changed(self, wait=True):
        """The paths of the files written to since they were opened (another
        modification time or size now), whose bytes a load may have read
        from two versions.  A file replaced by a rename is not changed: the
        descriptors still read the one opened.  (A write within the clock
        tick of the open, at the same size, is not seen: the kernel's file
        times move a tick at a time.)  ``wait``: a cache hit still being
        revalidated waits for the server's answer (``revalidated``); False
        asks only what is known now."""
        # (the files the load's selection reads: vLLM's batches are hundreds
        # of loads of one checkpoint of many files, each of a few)
        used = sorted({i for i, _ in self.entries}) if len(self.paths) > 1 else range(len(self.paths))
        out = []
        for i in used:
            st = os.fstat(self.fds[i])
            if (st.st_mtime_ns, st.st_size) != self.stamps[i]:
                out.append(self.paths[i])
        return out

    def fetch_error(self):
        return None

    def rest(self):
        """Between reads of a handle that closed (``safe_open``'s slices): a
        URL source's request loop ends (``RemoteShards.rest``); files keep
        their descriptors."""

    def byte_sources(self):
        """``(cache_bytes, fetched_bytes)``: how many of the selected tensors'
        bytes a load reads from a URL source's local cache and fetches from
        its object store (files: neither)."""
        return 0, 0

    def close(self):
        """Closes the descriptors (idempotent; again after an interrupt,
        it closes the rest).  Only the code that joined the load's reader
        threads calls it: a descriptor number closed under a running reader
        could be reused by the next open() and the reader would copy another
        file's bytes.  (The warming threads read them too: joined first.)"""
        self.stop_warming()
        close_recorded(self.fds)


def _read_without_waiting(points):
    """How many of ``points`` (descriptor, offset) a one-byte RWF_NOWAIT read
    finds cached; None where the file system cannot say."""
    nowait = getattr(os, "RWF_NOWAIT", None)
    if nowait is None:
        return None
    byte, hits = bytearray(1), 0
    for fd, offset in points:
        try:
            hits += os.preadv(fd, [byte], offset, nowait) == 1
        except BlockingIOError:
            pass                # not resident
        except OSError:
            return None         # EOPNOTSUPP, EINVAL: this file system cannot say
    return hits


def rows(entry, part, path):
    """``entry`` narrowed to ``part``: None (whole) or a step-1 slice of its
    first dimension, bounds as Python's (clipped).  The rows must be whole
    bytes (F4 packs two values a byte: an odd row of it is not)."""
    if part is None:
        return entry
    if not isinstance(part, slice):
        raise TypeError(f"plan[{entry.name!r}] must be None or a slice of the first dimension, "
                        f"not {type(part).__name__}")
    if part.step not in (None, 1):
        raise ValueError(f"plan[{entry.name!r}]: only step-1 slices are read (a rank's rows), "
                         f"got step {part.step}")
    if not entry.shape:
        raise ValueError(f"plan[{entry.name!r}]: a scalar tensor has no rows to slice")
    lo, hi, _ = part.indices(entry.shape[0])
    hi = max(lo, hi)
    row_bits = DTYPE_BITS[entry.dtype]
    for d in entry.shape[1:]:
        row_bits *= d
    if row_bits % 8:
        raise SafetensorsError(f"a row of {entry.dtype} tensor {entry.name!r} {list(entry.shape)} "
                               f"is {row_bits} bits, not whole bytes: it cannot be sliced by rows",
                               path, entry.name)
    row = row_bits // 8
    return TensorEntry(entry.name, entry.dtype, (hi - lo,) + tuple(entry.shape[1:]),
                       entry.begin + lo * row, entry.begin + hi * row)


def _name_places(checkpoint):
    with _gc.paused():      # (one int per name)
        return {t.name: k for k, (_, t) in enumerate(checkpoint.all_entries)}
