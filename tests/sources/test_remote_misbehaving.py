"""Servers that misbehave (issue 40): one that ignores ``If-Match`` while the
object is replaced mid-load, one that gives no ETag, one that stalls
mid-body, and a percent-encoded URL, against a plain ranged-GET HTTP
server on 127.0.0.1 (``support/remote_servers.RangeHTTPServer``)."""

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("obstore")
safetensors_torch = pytest.importorskip("safetensors.torch")

from instant_staging.loader import Checkpoint, LoadError, RemoteChangedError, iter_load, load_file

from support import child_env
from support.remote_servers import range_http_server_fixture  # noqa: F401


def _settled(before, timeout=5.0):
    """No thread is left of those started since ``before`` (the client's
    dropped pool closes on its own threads a moment later)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if {t.ident for t in threading.enumerate()} <= before:
            return True
        time.sleep(0.05)
    return False

TENSORS = 8
ELEMENTS = 16 * 1024          # 64 KiB of float32 each
CHUNK = 64 * 1024


def _model(value):
    return {f"t{i}": torch.full((ELEMENTS,), float(value * 100 + i)) for i in range(TENSORS)}


def _write(path, value, mtime_ns=None):
    safetensors_torch.save_file(_model(value), path)
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))


def _replace_after(server, path, data_gets):
    """Replaces the file with version B (same size, other values, another
    ETag and Last-Modified) when the ``data_gets``-th ranged GET after the
    header's arrives."""
    seen = []
    later = os.stat(path).st_mtime_ns + 5 * 10**9

    def hook(request):
        if request.method == "GET" and request.range and not request.range.startswith("bytes=0-"):
            seen.append(request)
            if len(seen) == data_gets:
                _write(path, 2, later)
    server.on_request = hook


@pytest.mark.parametrize("etag", [True, False], ids=["etag", "no-etag"])
def test_a_server_that_ignores_if_match_never_gives_two_versions(range_http_server, etag, caplog):
    server = range_http_server
    path = os.path.join(server.root, "model.safetensors")
    _write(path, 1)
    server.ignore_if_match = True
    server.send_etag = etag
    _replace_after(server, path, 3)
    caplog.set_level(logging.WARNING, logger="instant_staging")
    with pytest.raises(RemoteChangedError, match="changed while it was loaded") as e:
        load_file(server.url_for("model.safetensors"), "cpu", chunk_size=CHUNK, threads=1)
    assert ("ETag" in str(e.value)) == etag, str(e.value)
    assert e.value.path == server.url_for("model.safetensors")
    # Without an ETag the load says once that it is pinned by size and
    # Last-Modified only.
    said = [r.getMessage() for r in caplog.records if "no ETag" in r.getMessage()]
    assert len(said) == (0 if etag else 1), said


def test_an_unchanged_object_without_an_etag_loads(range_http_server):
    server = range_http_server
    path = os.path.join(server.root, "model.safetensors")
    _write(path, 1)
    server.send_etag = False
    got = load_file(server.url_for("model.safetensors"), "cpu", chunk_size=CHUNK, threads=2)
    assert all(torch.equal(got[n], t) for n, t in _model(1).items())


def test_a_percent_encoded_url_is_sent_as_given(range_http_server):
    server = range_http_server
    os.mkdir(os.path.join(server.root, "my model"))
    _write(os.path.join(server.root, "my model", "model 1.safetensors"), 1)
    url = f"{server.url}/my%20model/model%201.safetensors"
    got = load_file(url, "cpu")
    assert all(torch.equal(got[n], t) for n, t in _model(1).items())
    sent = {r.path for r in server.requests}
    assert sent == {"/my%20model/model%201.safetensors"}, sent
    with Checkpoint.open(url) as ck:
        assert ck.files == [url]


# -- a server that stalls mid-body (item 4) ------------------------------------------

def _stall_data(server, after=1000):
    """From the first ranged GET past the header's on, each body stops
    after ``after`` bytes until ``server.release`` is set."""
    stalled = threading.Event()

    def hook(request):
        if request.method == "GET" and request.range and not request.range.startswith("bytes=0-"):
            server.stall_after = after
            stalled.set()
    server.on_request = hook
    return stalled


def _big(server):
    # 3 chunks of 64 KiB per tensor's worth: data GETs after the header's
    path = os.path.join(server.root, "model.safetensors")
    _write(path, 1)
    return server.url_for("model.safetensors")


def _in_thread(fn):
    box = {}

    def run():
        t0 = time.monotonic()
        try:
            box["result"] = fn()
        except BaseException as e:     # (the test looks at it)
            box["error"] = e
        box["seconds"] = time.monotonic() - t0
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def test_a_stalled_body_fails_within_the_budget(range_http_server, monkeypatch):
    from instant_staging.loader import _remote
    monkeypatch.setattr(_remote, "RETRY_SECONDS", 2.0)
    url = _big(range_http_server)
    _stall_data(range_http_server)
    threads = {t.ident for t in threading.enumerate()}
    thread, box = _in_thread(lambda: load_file(url, "cpu", chunk_size=CHUNK, threads=2))
    thread.join(20)
    try:
        assert not thread.is_alive(), "a stalled body held the load past the budget"
        assert isinstance(box.get("error"), LoadError), box
        assert "no answer within 2 s" in str(box["error"]) and url in str(box["error"])
        assert box["seconds"] < 2.0 + 3.0, box["seconds"]
        assert range_http_server.wait_connections(0, timeout=3.0) == 0   # the request dropped
        assert _settled(threads)
    finally:
        range_http_server.release.set()


def test_close_ends_a_load_whose_server_stalls(range_http_server):
    # RETRY_SECONDS as it is (60 s): close() must not wait for it.
    url = _big(range_http_server)
    stalled = _stall_data(range_http_server)
    threads = {t.ident for t in threading.enumerate()}
    it = iter_load(url, "cpu", chunk_size=CHUNK, threads=2)
    thread, box = _in_thread(lambda it=it: [name for name, _ in it])
    try:
        assert stalled.wait(20)
        time.sleep(0.2)                 # (the body's first bytes sent: the reader waits mid-body)
        t0 = time.monotonic()
        it.close()
        assert time.monotonic() - t0 < 3.0
        thread.join(5)
        assert not thread.is_alive() and isinstance(box.get("error"), LoadError), box
        assert "cancelled" in str(box["error"])
        assert range_http_server.wait_connections(0, timeout=3.0) == 0
        del it
        assert _settled(threads)
    finally:
        range_http_server.release.set()


def test_ctrl_c_ends_a_load_whose_server_stalls(range_http_server, tmp_path):
    # The SIGINT is sent once the server holds a body mid-way (a known
    # point, whatever the timing); the child must end within seconds, not
    # RETRY_SECONDS.
    url = _big(range_http_server)
    stalled = _stall_data(range_http_server)
    code = f"""
import signal, sys, threading
signal.signal(signal.SIGINT, signal.default_int_handler)
from instant_staging.loader import load_file
try:
    load_file({url!r}, "cpu", chunk_size={CHUNK}, threads=2)
    print("not interrupted")
except KeyboardInterrupt:
    left = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    print("interrupted", left)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=child_env())
    try:
        assert stalled.wait(60), "the load never reached the stall"
        time.sleep(0.2)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
        assert time.monotonic() - t0 < 5.0
        assert proc.returncode == 0, err
        assert out.strip() == "interrupted []", out + err
    finally:
        range_http_server.release.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- the loader's own range retries (a stand-in client) -------------------------------

def _flaky_client(monkeypatch, failures):
    """The data GETs fail ``failures`` times in all (a connection reset,
    then a body cut short, in turn), then answer as the server does."""
    from instant_staging.loader import _remote
    real, calls = _remote._get_async, []

    async def flaky(obstore, obj, options):
        calls.append(options["range"])
        if len(calls) <= failures:
            if len(calls) % 2:
                raise RuntimeError("connection reset by peer")
            meta, data = await real(obstore, obj, options)
            return meta, bytes(data)[:-1]
        return await real(obstore, obj, options)
    monkeypatch.setattr(_remote, "_get_async", flaky)
    monkeypatch.setattr(_remote, "_BACKOFF", 0.001)
    return calls


def test_the_range_retry_loop_recovers_within_its_tries(range_http_server, monkeypatch):
    from instant_staging.loader import _remote
    url = _big(range_http_server)
    with Checkpoint.open(url) as ck:            # the header read before the client misbehaves
        calls = _flaky_client(monkeypatch, _remote.RETRIES)
        got = ck.load("cpu", chunk_size=1 << 20, threads=1)
    assert all(torch.equal(got[n], t) for n, t in _model(1).items())
    assert len(calls) == _remote.RETRIES + 1 and len(set(calls)) == 1     # one range, tried again


def test_the_range_retry_loop_gives_up_naming_the_range_and_the_tries(range_http_server,
                                                                        monkeypatch):
    from instant_staging.loader import _remote
    url = _big(range_http_server)
    with Checkpoint.open(url) as ck:
        calls = _flaky_client(monkeypatch, _remote.RETRIES + 1)
        with pytest.raises(LoadError) as e:
            ck.load("cpu", chunk_size=1 << 20, threads=1)
    start, end = calls[0]
    assert f"gave up after {_remote.RETRIES + 1} tries of bytes [{start}, {end})" in str(e.value)
    assert url in str(e.value)
