"""dtype=, names=, the environment knobs and progress= of load_file/iter_load."""

import io
import os
import re
import select

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

from instant_staging.loader import _progress, _run, iter_load, load_file
from instant_staging.loader._options import knobs


@pytest.fixture
def path(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(64, 33, generator=g),
        "f16": torch.randn(5, 7, generator=g).half(),
        "bf16": torch.randn(3, generator=g).bfloat16(),
        "f64": torch.randn(4, 4, generator=g).double(),
        "i64": torch.arange(10),
        "i8": torch.arange(-5, 5, dtype=torch.int8),
        "mask": torch.rand(6, generator=g) > 0.5,
    }
    p = tmp_path / "m.safetensors"
    st.save_file(tensors, p)
    return p, tensors


# -- dtype -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64,
                                   "bfloat16", "bf16", "fp16", "float32"])
def test_dtype_converts_floats_keeps_ints_and_bools(path, dtype):
    p, tensors = path
    want = dtype if isinstance(dtype, torch.dtype) else {
        "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "fp16": torch.float16,
        "float32": torch.float32}[dtype]
    got = load_file(p, dtype=dtype)
    for name, ref in tensors.items():
        if ref.is_floating_point():
            assert got[name].dtype == want
            assert torch.equal(got[name], ref.to(want)), name      # as transformers' .to()
        else:
            assert got[name].dtype == ref.dtype and torch.equal(got[name], ref), name


def test_dtype_none_keeps_file_dtypes(path):
    p, tensors = path
    got = load_file(p, dtype=None)
    assert {n: t.dtype for n, t in got.items()} == {n: t.dtype for n, t in tensors.items()}


@pytest.mark.parametrize("dtype, error, match", [
    (torch.int32, ValueError, "floating-point"), (torch.bool, ValueError, "floating-point"),
    ("int8", ValueError, "floating-point"), ("nonsense", ValueError, "not a torch dtype"),
    (3, TypeError, "torch.dtype"), (float, TypeError, "torch.dtype"),
])
def test_bad_dtype_before_allocation(path, dtype, error, match, monkeypatch):
    p, _ = path
    monkeypatch.setattr(_run, "_load", lambda *a, **k: pytest.fail("allocated"))
    with pytest.raises(error, match=match):
        load_file(p, dtype=dtype)


# -- names (names= itself is on main; these pin its contract) ---------------------

def test_names_iterable_and_predicate(path):
    p, tensors = path
    got = load_file(p, names=["i64", "f16"])
    assert list(got) == [n for n in iter_load(p).names if n in ("i64", "f16")]
    assert torch.equal(got["i64"], tensors["i64"]) and torch.equal(got["f16"], tensors["f16"])
    got = load_file(p, names=lambda n: n.startswith("f"))
    assert set(got) == {"f32", "f16", "f64"}
    assert load_file(p, names=()) == {}
    assert set(load_file(p, names=iter(["mask"]))) == {"mask"}


def test_names_reads_only_selected_bytes(path):
    p, _tensors = path
    it = iter_load(p, names=["f16", "i8"])
    assert it.total_bytes == 5 * 7 * 2 + 10
    assert set(it.names) == {"f16", "i8"}
    it.close()


def test_unknown_names_keyerror_before_allocation(path, monkeypatch):
    p, _ = path
    monkeypatch.setattr(_run, "_load", lambda *a, **k: pytest.fail("allocated"))
    with pytest.raises(KeyError, match=r"2 tensor name.*'ghost'.*'nope'"):
        load_file(p, names=["f32", "nope", "ghost"])
    with pytest.raises(TypeError, match="single str"):
        load_file(p, names="f32")


# -- environment knobs -------------------------------------------------------------

ENV = ("INSTANT_STAGING_CHUNK_SIZE", "INSTANT_STAGING_IO_DEPTH", "INSTANT_STAGING_THREADS")


@pytest.fixture
def clean_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_knobs_from_environment(clean_env):
    from instant_staging import defaults
    # io_depth stays None: the load gives each reader thread
    # defaults.SLOTS_PER_THREAD slots (defaults.IO_DEPTH with 16 threads).
    assert knobs(None, None, None) == (defaults.CHUNK_SIZE, None, None)
    clean_env.setenv("INSTANT_STAGING_CHUNK_SIZE", "64KiB")
    clean_env.setenv("INSTANT_STAGING_IO_DEPTH", "3")
    clean_env.setenv("INSTANT_STAGING_THREADS", "2")
    assert knobs(None, None, None) == (64 << 10, 3, 2)
    assert knobs(4096, 5, 1) == (4096, 5, 1)            # arguments win
    clean_env.setenv("INSTANT_STAGING_CHUNK_SIZE", "8192")
    clean_env.setenv("INSTANT_STAGING_THREADS", "")      # empty: unset
    assert knobs(None, None, None) == (8192, 3, None)


def test_environment_reaches_the_load(path, clean_env, monkeypatch):
    p, tensors = path
    seen = {}
    real = _run._load

    def spy(state):
        options = state.options
        seen.update(chunk_size=options.chunk_size, io_depth=options.io_depth, threads=options.threads)
        return real(state)
    monkeypatch.setattr(_run, "_load", spy)
    clean_env.setenv("INSTANT_STAGING_CHUNK_SIZE", "4KiB")
    clean_env.setenv("INSTANT_STAGING_IO_DEPTH", "2")
    clean_env.setenv("INSTANT_STAGING_THREADS", "3")
    got = load_file(p)
    assert seen == {"chunk_size": 4096, "io_depth": 2, "threads": 3}
    for name, ref in tensors.items():
        assert torch.equal(got[name], ref)


@pytest.mark.parametrize("name, value", [
    ("INSTANT_STAGING_CHUNK_SIZE", "0"), ("INSTANT_STAGING_CHUNK_SIZE", "lots"),
    ("INSTANT_STAGING_CHUNK_SIZE", "-1MiB"), ("INSTANT_STAGING_IO_DEPTH", "0"),
    ("INSTANT_STAGING_IO_DEPTH", "2.5"), ("INSTANT_STAGING_IO_DEPTH", "x"),
    ("INSTANT_STAGING_THREADS", "-3"), ("INSTANT_STAGING_THREADS", "four"),
])
def test_bad_environment_value_names_the_variable(path, clean_env, name, value, monkeypatch):
    p, _ = path
    clean_env.setenv(name, value)
    monkeypatch.setattr(_run, "_load", lambda *a, **k: pytest.fail("allocated"))
    with pytest.raises(ValueError, match=name):
        load_file(p)


def test_bad_arguments_still_rejected(path, clean_env):
    p, _ = path
    with pytest.raises(ValueError, match="chunk_size"):
        load_file(p, chunk_size=0)
    with pytest.raises(TypeError, match="io_depth"):
        load_file(p, io_depth="2")


# -- progress ----------------------------------------------------------------------

def test_progress_callable_sees_total(path):
    p, tensors = path
    calls = []
    load_file(p, progress=lambda done, total: calls.append((done, total)))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert calls and calls[-1] == (total, total)
    assert all(t == total for _, t in calls) and [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_progress_true_without_tty_is_plain_lines(path, monkeypatch, capsys):
    p, _ = path
    got = load_file(p, progress=True)
    assert got
    err = capsys.readouterr().err
    assert "loaded 100%" in err and "\r" not in err


def test_progress_true_on_a_tty_is_tqdm(monkeypatch):
    pytest.importorskip("tqdm")

    class Tty(io.StringIO):
        def isatty(self):
            return True
    stream = Tty()
    bar = _progress._default(stream)
    assert isinstance(bar, _progress.TqdmProgress)
    bar(50, 100)
    bar(100, 100)
    # sizes in the package's binary units (format_size), not tqdm's own
    assert "100 B / 100 B" in stream.getvalue()


def _unsized_terminal():
    """A pseudo-terminal that says it has 0 columns and 0 rows (one nobody
    sized, as some CI consoles are): (its master fd, a text stream on it)."""
    import fcntl
    import pty
    import struct
    import termios
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
    return master, os.fdopen(slave, "w")


def _drain(fd):
    out = b""
    while select.select([fd], [], [], 0.2)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        out += chunk
    return out.decode()


@pytest.mark.parametrize("tqdm", [True, False], ids=["tqdm", "built-in"])
def test_progress_bar_on_a_terminal_of_unknown_size(monkeypatch, tqdm):
    """tqdm told a width of 0 drew nothing at all: the bar is drawn 80 wide."""
    if tqdm:
        pytest.importorskip("tqdm")
    monkeypatch.delenv("COLUMNS", raising=False)
    master, stream = _unsized_terminal()
    try:
        assert stream.isatty() and os.get_terminal_size(stream.fileno()).columns == 0
        bar = _progress.TqdmProgress(stream) if tqdm else _progress.Progress(stream, bar=True, interval=0)
        for done in (0, 1 << 29, 1 << 30):
            bar(done, 1 << 30)
        bar.close()
        stream.flush()
        text = _drain(master)
    finally:
        stream.close()
        os.close(master)
    last = [line for line in re.split(r"[\r\n]", text) if line.strip()][-1]
    assert re.match(r"loading: 100%\|#+\| 1 GiB / 1 GiB", last), repr(text)
    if tqdm:                       # (the built-in bar is 30 characters, whatever the width)
        assert len(last.rstrip()) <= _progress.FALLBACK_COLUMNS, repr(last)


def test_progress_bar_width_from_columns(monkeypatch):
    stream = io.StringIO()         # no terminal: $COLUMNS, else the fallback
    monkeypatch.setenv("COLUMNS", "120")
    assert _progress.columns(stream) == 120
    for value in ("", "0", "wide"):
        monkeypatch.setenv("COLUMNS", value)
        assert _progress.columns(stream) == _progress.FALLBACK_COLUMNS


def test_progress_without_tqdm_is_plain(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_tqdm(name, *args, **kwargs):
        if name == "tqdm":
            raise ImportError("no tqdm")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_tqdm)

    class Tty(io.StringIO):
        def isatty(self):
            return True
    assert isinstance(_progress._default(Tty()), _progress.Progress)


def test_bad_progress(path):
    p, _ = path
    with pytest.raises(TypeError, match="progress"):
        load_file(p, progress="yes")
    assert load_file(p, progress=False)
