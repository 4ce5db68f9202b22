"""Servers that misbehave (issue 40): one that ignores ``If-Match`` while the
object is replaced mid-load, one that gives no ETag, one that stalls
mid-body, and a percent-encoded URL, against a plain ranged-GET HTTP
server on 127.0.0.1 (``support/remote_servers.RangeHTTPServer``)."""

import logging
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("obstore")
safetensors_torch = pytest.importorskip("safetensors.torch")

from instant_staging.loader import Checkpoint, RemoteChangedError, load_file

from support.remote_servers import range_http_server_fixture  # noqa: F401

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
