"""Progress reporting for a load: ``progress=`` of ``load_file``/``iter_load``.

``progress`` is None (silent), a callable ``progress(done_bytes,
total_bytes)`` called from the consuming thread, or True: a bar on
standard error where it is a terminal (tqdm's where tqdm is installed,
``pip install 'instant_staging[tqdm]'``, else the built-in one, with the
same fields and look), else a plain line per tenth (``Progress(bar=False)``).
The CLI's ``load`` shows the same printer (``resolve(True)``): one
implementation, one look::

    loading:  40%|############                  | 1.6 GiB / 4 GiB, 33.8 GiB/s [00:00<00:00]

The rate shown is the bytes moved over the time of moving them: the clock
starts at the first report of the load, not when the callable was made
(the CLI makes it before torch is imported and the staging buffer made,
and a rate counted from there said a thirtieth or less of the rate at
which the load finished; docs/design.md, "Measured: the rate's clock").
Sizes and rates are in the package's one unit system, binary (GiB and
GiB/s: ``_types.format_size`` and ``format_rate``, as the CLI's other
lines and the sizes it takes), the tqdm bar's included.

Under a process group each rank reads its own share of the load and
reports that (a callable gets ``(done, share)`` on every rank); the
printers made for ``progress=True`` then name the rank and the whole on
every line (``for_rank``), so that N ranks never print N unlabelled
"100%" lines each claiming the whole load.
"""

import os
import sys
import threading
import time

from .._types import format_rate, format_size

# The bar's characters, tqdm's and ours: empty, then full (tqdm's ``ascii``).
BAR_CHARS = " #"


def _rate(start, done, now):
    """', 33.8 GiB/s': the bytes since ``start`` (the first report's time and
    bytes) over the time since; '' until there is such an interval."""
    t0, done0 = start
    if now <= t0 or done <= done0:
        return ""
    return f", {format_rate((done - done0) / (now - t0))}"


def _desc(label):
    """The bar's head: 'loading', or 'rank 1 of 2: loading'."""
    return "loading" if label is None else f"{label[0]}: loading"


def _sizes(done, total, label, start, now):
    """The bar's tail, the same for both bars: '1.6 GiB / 4 GiB (its share
    of 8 GiB), 33.8 GiB/s'."""
    share = "" if label is None else f" (its share of {format_size(label[1])})"
    return f"{format_size(done)} / {format_size(total)}{share}{_rate(start, done, now)}"


def _interval(seconds):
    """'01:05', '1:02:03': tqdm's way of writing elapsed and remaining time."""
    minutes, s = divmod(int(seconds), 60)
    h, m = divmod(minutes, 60)
    return f"{h:d}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


# The width a bar is drawn to on a terminal that does not say its own (a
# pseudo-terminal nobody sized, as some CI consoles and containers give):
# tqdm, told 0 columns, draws nothing at all.
FALLBACK_COLUMNS = 80


def columns(stream):
    """The width to draw a bar on ``stream`` to: $COLUMNS where it is a
    positive number (the user's say, as ``shutil.get_terminal_size``
    takes it), else the terminal's, else ``FALLBACK_COLUMNS``."""
    try:
        width = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        width = 0
    if width <= 0:
        try:
            width = os.get_terminal_size(stream.fileno()).columns
        except (AttributeError, OSError, ValueError):     # no fileno, not a terminal, closed
            width = 0
    return width if width > 0 else FALLBACK_COLUMNS


def resolve(progress):
    """The callable a load reports to, or None (see the module docstring).

    Args:
        progress: None or False (silent), True (a printer), or a callable
            ``progress(done_bytes, total_bytes)``.

    Returns:
        None, the callable, or for True the printer.

    Raises:
        TypeError: anything else.
    """
    if progress is None or progress is False:
        return None
    if progress is True:
        return _default(sys.stderr)
    if not callable(progress):
        raise TypeError(f"progress must be None, True or a callable (done_bytes, total_bytes), "
                        f"not {type(progress).__name__}")
    return progress


def for_rank(progress, rank, world, whole):
    """``progress`` for rank ``rank`` of ``world`` reading its share of a
    load of ``whole`` bytes: the printers of ``progress=True`` label their
    lines with both; a caller's own callable is returned as it is (it gets
    this rank's share)."""
    if world > 1 and isinstance(progress, (Progress, TqdmProgress)):
        progress.label = (f"rank {rank} of {world}", whole)
    return progress


def _default(stream):
    """The printer of ``progress=True`` on ``stream``: on a terminal tqdm's
    bar, else (no tqdm) the built-in one; plain lines elsewhere."""
    isatty = getattr(stream, "isatty", None)
    if isatty is None or not isatty():
        return Progress(stream, bar=False)
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return Progress(stream, bar=True)
    return TqdmProgress(stream)


def _tqdm_class():
    from tqdm import tqdm

    class _Bar(tqdm):
        """tqdm, with our tail (``sizes``) as a field of its format: its
        ``postfix`` would come with a ', ' of its own in front."""

        def __init__(self, *args, sizes, **kwargs):
            self.sizes = sizes      # before tqdm's first draw, in its __init__
            super().__init__(*args, **kwargs)

        @property
        def format_dict(self):
            d = super().format_dict
            d["sizes"] = self.sizes
            return d

    return _Bar


class TqdmProgress:
    """A tqdm bar in bytes, made on the first call, closed when the load is
    done; its sizes and rate are ours (tqdm's own would be kB and MB/s),
    its fields and characters those of the built-in bar (``Progress``)."""

    FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {sizes} [{elapsed}<{remaining}]"

    def __init__(self, stream, clock=time.perf_counter):
        self._stream = stream
        self._clock = clock
        self._bar = None
        self._start = None
        self.label = None             # (rank text, whole bytes): for_rank()

    def __call__(self, done, total):
        now = self._clock()
        if self._bar is None:
            self._start = (now, done)
        sizes = _sizes(done, total, self.label, self._start, now)
        if self._bar is None:
            self._bar = _tqdm_class()(total=total, desc=_desc(self.label), file=self._stream,
                                      ncols=columns(self._stream), leave=True, ascii=BAR_CHARS,
                                      bar_format=self.FORMAT, sizes=sizes)
        self._bar.sizes = sizes
        self._bar.update(done - self._bar.n)
        if done >= total:
            self.close()

    def close(self):
        bar, self._bar = self._bar, None
        if bar is not None:
            bar.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # a finaliser never raises
            pass


class Progress:
    """``progress(done_bytes, total_bytes)`` for the loader; thread-safe.

    ``bar=True`` redraws one line in place (a terminal without tqdm), with
    the fields and look of the tqdm bar (``TqdmProgress``); otherwise a
    plain line is written at each tenth, and nothing when ``quiet``.

    Args:
        stream: where the lines go (a text stream).
        bar: True: one line redrawn in place; False: a line per tenth.
        quiet: without ``bar``, write nothing; default False.
        interval: seconds between redraws of the bar at most; default 0.1.
        clock: the clock, in seconds; default ``time.perf_counter``.
    """

    WIDTH = 30

    def __init__(self, stream, *, bar, quiet=False, interval=0.1, clock=time.perf_counter):
        self._stream = stream
        self._bar = bar
        self._quiet = quiet and not bar
        self._interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._start = None            # (time, bytes) of the first report
        self.label = None             # (rank text, whole bytes): for_rank()
        self._last_draw = 0.0
        self._last_tenth = 0
        self._drawn = False
        self._drawn_len = 0

    def __call__(self, done, total):
        if self._quiet:
            return
        with self._lock:
            now = self._clock()
            if self._start is None:
                self._start = (now, done)
            if self._bar:
                self._draw_bar(done, total, now)
            else:
                self._plain(done, total, now)

    def _head(self):
        return "" if self.label is None else f"{self.label[0]}: "

    def _share(self):
        return "" if self.label is None else f" (its share of {format_size(self.label[1])})"

    def _draw_bar(self, done, total, now):
        if done < total and now - self._last_draw < self._interval:
            return  # redraw at most every `interval` seconds
        self._last_draw = now
        frac = done / total if total else 1.0
        filled = int(frac * self.WIDTH)
        empty, full = BAR_CHARS
        elapsed = now - self._start[0]
        moved = done - self._start[1]
        if done >= total:
            remaining = _interval(0)
        elif moved > 0 and elapsed > 0:
            remaining = _interval(elapsed * (total - done) / moved)
        else:
            remaining = "?"
        line = (f"{_desc(self.label)}: {frac * 100:3.0f}%|"
                f"{full * filled}{empty * (self.WIDTH - filled)}| "
                f"{_sizes(done, total, self.label, self._start, now)} "
                f"[{_interval(elapsed)}<{remaining}]")
        # spaces over what a longer line before left (no terminal escapes)
        self._stream.write("\r" + line + " " * max(self._drawn_len - len(line), 0))
        self._drawn_len = len(line)
        self._stream.flush()
        self._drawn = True

    def _plain(self, done, total, now):
        tenth = int(10 * done / total) if total else 10
        if tenth <= self._last_tenth:
            return
        self._last_tenth = tenth
        self._stream.write(f"{self._head()}loaded {tenth * 10}%: {format_size(done)} of "
                           f"{format_size(total)}{self._share()}{_rate(self._start, done, now)}\n")
        self._stream.flush()

    def close(self):
        """Ends the bar's line."""
        with self._lock:
            if self._drawn:
                self._stream.write("\n")
                self._stream.flush()
                self._drawn = False
