"""Progress reporting for a load: ``progress=`` of ``load_file``/``iter_load``.

``progress`` is None (silent), a callable ``progress(done_bytes,
total_bytes)`` called from the consuming thread, or True: a tqdm bar on
standard error where tqdm is installed (``pip install
'instant_staging[tqdm]'``) and standard error is a terminal, else a plain
line per tenth (``Progress(bar=False)``).  ``Progress`` is also the CLI's
``load`` progress: one implementation.
"""

import sys
import threading
import time

from .._types import format_size


def resolve(progress):
    """The callable a load reports to, or None (see the module docstring)."""
    if progress is None or progress is False:
        return None
    if progress is True:
        return _default(sys.stderr)
    if not callable(progress):
        raise TypeError(f"progress must be None, True or a callable (done_bytes, total_bytes), "
                        f"not {type(progress).__name__}")
    return progress


def _default(stream):
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return Progress(stream, bar=False)
    isatty = getattr(stream, "isatty", None)
    if isatty is None or not isatty():
        return Progress(stream, bar=False)
    return TqdmProgress(stream)


class TqdmProgress:
    """A tqdm bar in bytes, made on the first call, closed when the load is done."""

    def __init__(self, stream):
        self._stream = stream
        self._bar = None

    def __call__(self, done, total):
        if self._bar is None:
            from tqdm import tqdm
            self._bar = tqdm(total=total, unit="B", unit_scale=True, desc="loading",
                             file=self._stream, leave=True)
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

    ``bar=True`` redraws one line in place (a terminal); otherwise a plain
    line is written at each tenth, and nothing when ``quiet``.
    """

    WIDTH = 30

    def __init__(self, stream, *, bar, quiet=False, interval=0.1):
        self._stream = stream
        self._bar = bar
        self._quiet = quiet and not bar
        self._interval = interval
        self._lock = threading.Lock()
        self._start = time.perf_counter()
        self._last_draw = 0.0
        self._last_tenth = 0
        self._drawn = False

    def __call__(self, done, total):
        if self._quiet:
            return
        with self._lock:
            if self._bar:
                self._draw_bar(done, total)
            else:
                self._plain(done, total)

    def _rate(self, done):
        return done / max(time.perf_counter() - self._start, 1e-9) / 1e9

    def _draw_bar(self, done, total):
        now = time.perf_counter()
        if done < total and now - self._last_draw < self._interval:
            return  # redraw at most every `interval` seconds
        self._last_draw = now
        frac = done / total if total else 1.0
        filled = int(frac * self.WIDTH)
        self._stream.write(f"\r[{'#' * filled}{' ' * (self.WIDTH - filled)}] {frac:4.0%} "
                           f"{format_size(done)} / {format_size(total)} "
                           f"{self._rate(done):.1f} GB/s ")
        self._stream.flush()
        self._drawn = True

    def _plain(self, done, total):
        tenth = int(10 * done / total) if total else 10
        if tenth <= self._last_tenth:
            return
        self._last_tenth = tenth
        self._stream.write(f"loaded {tenth * 10}%: {format_size(done)} of "
                           f"{format_size(total)}, {self._rate(done):.1f} GB/s\n")
        self._stream.flush()

    def close(self):
        """Ends the bar's line."""
        with self._lock:
            if self._drawn:
                self._stream.write("\n")
                self._stream.flush()
                self._drawn = False
