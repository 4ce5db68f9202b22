"""The remote-source test servers themselves (tests/support/remote_servers.py),
seen through obstore as the loader will see them: moto's S3 server in its
child process, the FaultProxy's faults, and the RangeHTTPServer.

Each fault test asserts what obstore 0.12 does with it (retries or not,
how many requests, which exception and message); docs/REMOTE_NOTES.md
sums these up.  The stores use remote_servers.fast_retry_config() (3
retries, 10 ms first backoff) unless a test says otherwise.
"""

import gc
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

obstore = pytest.importorskip("obstore")
from obstore import exceptions as obx
from obstore.store import HTTPStore

from support import TESTS, remote_servers
from support.remote_servers import (  # noqa: F401 (the *_fixture: fixtures, found by their names)
    FaultProxy,
    S3Server,
    S3ServerError,
    Seen,
    fast_retry_config,
    fault_proxy_fixture,
    range_http_server_fixture,
    require_s3,
    s3_bucket_fixture,
    s3_server_fixture,
)

DATA = bytes(range(256)) * 4096         # 1 MiB, every offset's byte known
KEY = "dir/model.safetensors"


@pytest.fixture
def obj(s3_server, s3_bucket):
    """(bucket, ETag) of DATA at KEY in a new bucket."""
    return s3_bucket, s3_server.put(s3_bucket, KEY, DATA)


@pytest.fixture
def store(s3_server, fault_proxy, obj):
    """An S3Store on obj's bucket through fault_proxy, fast retries."""
    return s3_server.store(obj[0], fault_proxy.url)


def get_range(store, start, end, **options):
    return bytes(obstore.get(store, KEY, options={"range": (start, end), **options}).bytes())


def gone(pid):
    """The process has exited (a zombie left to init counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


# -- moto's server ----------------------------------------------------------

def test_s3_server_roundtrip(s3_server, s3_bucket):
    assert s3_server.running and s3_server.url.startswith("http://127.0.0.1:")
    etag = s3_server.put(s3_bucket, "a/b", b"hello world")
    assert s3_server.head(s3_bucket, "a/b")["ETag"] == etag
    direct = s3_server.store(s3_bucket)
    assert bytes(obstore.get(direct, "a/b").bytes()) == b"hello world"
    assert bytes(obstore.get_range(direct, "a/b", start=6, end=11)) == b"world"
    s3_server.delete(s3_bucket, "a/b")
    with pytest.raises(FileNotFoundError):
        obstore.head(direct, "a/b")


def test_s3_server_stop_reaps_child():
    require_s3()
    server = S3Server().start()
    pid = server.pid
    assert not gone(pid)
    server.stop()
    assert gone(pid)
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)         # reaped by stop(): no zombie
    server.stop()                           # twice is fine


def test_s3_server_child_exits_with_its_parent(tmp_path):
    """The moto child exits when the process that started it is killed
    (its stdin ends), not only on stop()."""
    require_s3()
    script = ("import os, sys; sys.path.insert(0, sys.argv[1]); import support.remote_servers as r; "
              "s = r.S3Server().start(); print(s.pid, flush=True); os.kill(os.getpid(), 9)")
    out = subprocess.run([sys.executable, "-c", script, TESTS],
                         capture_output=True, text=True, timeout=60)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(pid)


def test_s3_server_start_failure_shows_stderr(monkeypatch):
    child = "import sys; sys.stderr.write('boom here'); sys.exit(3)"
    monkeypatch.setattr(remote_servers, "_MOTO_CHILD", child)
    with pytest.raises(S3ServerError, match=r"(?s)status 3.*boom here"):
        S3Server(start_timeout=10).start()


def test_moto_if_match_on_ranged_get(s3_server, obj):
    """moto answers a ranged GetObject whose If-Match differs 412, and
    HeadObject gives the ETag that PutObject returned."""
    bucket, etag = obj
    c = s3_server.client
    assert c.head_object(Bucket=bucket, Key=KEY)["ETag"] == etag
    got = c.get_object(Bucket=bucket, Key=KEY, Range="bytes=10-19", IfMatch=etag)
    assert got["Body"].read() == DATA[10:20] and got["ContentRange"] == f"bytes 10-19/{len(DATA)}"
    with pytest.raises(c.exceptions.ClientError) as e:
        c.get_object(Bucket=bucket, Key=KEY, Range="bytes=10-19", IfMatch='"0123"')
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert e.value.response["Error"]["Code"] == "PreconditionFailed"


def test_obstore_head_and_if_match(s3_server, obj):
    bucket, etag = obj
    direct = s3_server.store(bucket)
    meta = obstore.head(direct, KEY)
    assert meta["e_tag"] == etag and meta["size"] == len(DATA) and meta["version"] is None
    result = obstore.get(direct, KEY, options={"if_match": etag, "range": (100, 200)})
    assert result.range == (100, 200) and result.meta["e_tag"] == etag and result.meta["size"] == len(DATA)
    assert bytes(result.bytes()) == DATA[100:200]
    with pytest.raises(obx.PreconditionError, match="412 Precondition Failed"):
        obstore.get(direct, KEY, options={"if_match": '"0123"', "range": (100, 200)})
    with pytest.raises(obx.NotModifiedError, match="304 Not Modified"):
        obstore.get(direct, KEY, options={"if_none_match": etag})


def test_obstore_head_gives_version_on_versioned_bucket(s3_server, s3_bucket):
    s3_server.client.put_bucket_versioning(Bucket=s3_bucket, VersioningConfiguration={"Status": "Enabled"})
    s3_server.put(s3_bucket, "v", b"one")
    s3_server.put(s3_bucket, "v", b"two!")
    direct = s3_server.store(s3_bucket)
    meta = obstore.head(direct, "v")
    assert meta["size"] == 4 and meta["version"]
    versions = s3_server.client.list_object_versions(Bucket=s3_bucket, Prefix="v")["Versions"]
    old = next(v["VersionId"] for v in versions if not v["IsLatest"])
    assert bytes(obstore.get(direct, "v", options={"version": old}).bytes()) == b"one"


# -- the proxy: forwarding and matching ----------------------------------------

def test_proxy_forwards_and_records(fault_proxy, store, obj):
    assert get_range(store, 5, 1000) == DATA[5:1000]
    assert obstore.head(store, KEY)["e_tag"] == obj[1]
    assert fault_proxy.requests == [("GET", f"/{obj[0]}/{KEY}", "bytes=5-999"),
                                    Seen("HEAD", f"/{obj[0]}/{KEY}", None)]
    assert fault_proxy.request_headers[0]["range"] == "bytes=5-999"
    assert "authorization" in fault_proxy.request_headers[0]      # signed as sent to the proxy
    fault_proxy.reset_counts()
    assert fault_proxy.requests == []


def test_store_from_url_and_environment(monkeypatch, fault_proxy, obj):
    """s3_env(): obstore.store.from_url("s3://...") with no options goes
    through the proxy (AWS_ENDPOINT_URL or AWS_ENDPOINT, AWS_ALLOW_HTTP)."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    for name, value in remote_servers.s3_env(fault_proxy.url).items():
        monkeypatch.setenv(name, value)
    store = obstore.store.from_url(f"s3://{obj[0]}/dir")
    assert bytes(obstore.get_range(store, "model.safetensors", start=0, end=8)) == DATA[:8]
    assert fault_proxy.requests == [("GET", f"/{obj[0]}/{KEY}", "bytes=0-7")]


def test_proxy_put_and_list_pass_through(s3_server, fault_proxy, obj):
    through = s3_server.store(obj[0], fault_proxy.url)
    obstore.put(through, "new/obj", b"x" * 300_000)
    assert s3_server.client.get_object(Bucket=obj[0], Key="new/obj")["Body"].read() == b"x" * 300_000
    listed = sorted(m["path"] for batch in obstore.list(through) for m in batch)
    assert listed == [KEY, "new/obj"]


def test_fault_matching(fault_proxy, store):
    ranged = fault_proxy.fail(404, n=1, method="GET", ranged=True)
    other_path = fault_proxy.fail(403, n=1, path="/elsewhere")
    assert obstore.head(store, KEY)["size"] == len(DATA)               # HEAD: no match
    assert bytes(obstore.get(store, KEY).bytes()) == DATA              # not ranged: no match
    with pytest.raises(FileNotFoundError):
        get_range(store, 0, 10)
    assert get_range(store, 0, 10) == DATA[:10]                        # n=1: spent
    assert (ranged.fired, ranged.remaining, other_path.fired) == (1, 0, 0)
    assert ranged.hits[0].range == "bytes=0-9"


# -- faults as obstore sees them -------------------------------------------------

def test_503_is_retried(fault_proxy, store):
    fault = fault_proxy.fail(503, n=2)
    assert get_range(store, 0, 4096) == DATA[:4096]
    assert fault.fired == 2 and len(fault_proxy.requests) == 3


@pytest.mark.parametrize("status", [500, 502, 429])
def test_other_retried_statuses(fault_proxy, store, status):
    fault_proxy.fail(status, n=1)
    assert get_range(store, 0, 10) == DATA[:10]
    assert len(fault_proxy.requests) == 2


def test_503_exhausts_retries(fault_proxy, store):
    fault_proxy.fail(503, n=10)
    with pytest.raises(obx.GenericError) as e:
        get_range(store, 0, 10)
    msg = str(e.value)
    assert msg.startswith("Generic S3 error: Error performing GET http://127.0.0.1:")
    assert "after 3 retries, max_retries: 3" in msg and "503 Service Unavailable" in msg
    assert "<Code>SlowDown</Code>" in msg
    assert len(fault_proxy.requests) == 4            # 1 + max_retries


def test_default_retry_config_backs_off(s3_server, fault_proxy, obj):
    """obstore's defaults (100 ms first backoff, doubling) make two 503s
    cost about 0.3 s; fast_retry_config() makes them cost milliseconds."""
    fault_proxy.fail(503, n=2)
    start = time.monotonic()
    get_range(s3_server.store(obj[0], fault_proxy.url, retry_config={}), 0, 10)
    slow = time.monotonic() - start
    fault_proxy.fail(503, n=2)
    start = time.monotonic()
    get_range(s3_server.store(obj[0], fault_proxy.url), 0, 10)
    fast = time.monotonic() - start
    assert slow > 0.1 and fast < slow


@pytest.mark.parametrize("status, exc, text", [
    (403, obx.PermissionDeniedError, "The operation lacked the necessary privileges to complete for path"),
    (401, obx.UnauthenticatedError, "The operation lacked valid authentication credentials for path"),
    (404, FileNotFoundError, "Object at location dir/model.safetensors not found"),
    (412, obx.PreconditionError, "Request precondition failure for path"),
    (416, obx.GenericError, "Generic S3 error"),
])
def test_client_errors_are_not_retried(fault_proxy, store, status, exc, text):
    fault_proxy.fail(status, n=5)
    with pytest.raises(exc, match=text) as e:
        get_range(store, 0, 10)
    assert f"{status} " in str(e.value)
    assert len(fault_proxy.requests) == 1
    if status == 404:        # builtins.FileNotFoundError, not obstore's (deprecated) NotFoundError
        assert not isinstance(e.value, obx.BaseError)


def test_head_errors(fault_proxy, store):
    fault_proxy.fail(404, n=1, method="HEAD")
    with pytest.raises(FileNotFoundError):
        obstore.head(store, KEY)
    fault_proxy.fail(403, n=1, method="HEAD")
    with pytest.raises(obx.PermissionDeniedError):
        obstore.head(store, KEY)
    fault_proxy.fail(503, n=1, method="HEAD")
    assert obstore.head(store, KEY)["size"] == len(DATA)


@pytest.mark.parametrize("fault", ["reset", "truncate"])
def test_mid_body_failure_is_resumed(fault_proxy, store, fault):
    """obstore resumes a body cut mid-way by itself: a new GET of the rest
    (Range from where it got to), which counts as one of its retries."""
    getattr(fault_proxy, fault)(1, after_bytes=4096)
    assert get_range(store, 100, 200_000) == DATA[100:200_000]
    assert [s.range for s in fault_proxy.requests] == ["bytes=100-199999", "bytes=4196-199999"]


def test_reset_before_any_body_is_retried(fault_proxy, store):
    fault_proxy.reset(1, after_bytes=0)
    assert get_range(store, 100, 200_000) == DATA[100:200_000]
    assert [s.range for s in fault_proxy.requests] == ["bytes=100-199999"] * 2


def test_unranged_get_resumes_with_a_range(fault_proxy, store):
    fault_proxy.reset(1, after_bytes=50_000)
    chunks = [bytes(c) for c in obstore.get(store, KEY).stream(min_chunk_size=10_000)]
    assert b"".join(chunks) == DATA
    assert [s.range for s in fault_proxy.requests] == [None, f"bytes=50000-{len(DATA) - 1}"]


@pytest.mark.parametrize("fault, error", [("reset", "ConnectionReset"), ("truncate", "IncompleteBody")])
def test_mid_body_failures_exhaust_retries(fault_proxy, store, fault, error):
    getattr(fault_proxy, fault)(10, after_bytes=4096)
    with pytest.raises(obx.GenericError) as e:
        get_range(store, 100, 200_000)
    msg = str(e.value)
    assert msg.startswith("Generic S3 error: HTTP error: request or response body error")
    assert error in msg
    assert len(fault_proxy.requests) == 4            # 1 + max_retries


def test_no_retries_no_resume(s3_server, fault_proxy, obj):
    store = s3_server.store(obj[0], fault_proxy.url, retry_config={"max_retries": 0})
    fault_proxy.reset(1, after_bytes=100)
    with pytest.raises(obx.GenericError, match="request or response body error"):
        get_range(store, 0, 100_000)
    fault_proxy.fail(503, 1)
    with pytest.raises(obx.GenericError, match="503 Service Unavailable"):
        get_range(store, 0, 10)
    assert len(fault_proxy.requests) == 2


def _replace_during_resume(s3_server, fault_proxy, bucket):
    """Resets the first GET after 4 KiB and replaces the object before the
    resumed GET goes on to the server."""
    fault_proxy.reset(1, after_bytes=4096, method="GET")
    fault_proxy.hook(lambda seen: s3_server.put(bucket, KEY, b"B" * len(DATA)), 1, method="GET")


def test_resume_after_replacement_fails_not_mixes(s3_server, fault_proxy, store, obj):
    """The resumed GET sends no If-Match, but obstore checks the new
    answer's ETag and fails with the body error rather than mix versions."""
    _replace_during_resume(s3_server, fault_proxy, obj[0])
    with pytest.raises(obx.GenericError, match=r"(?s)request or response body error.*ConnectionReset"):
        get_range(store, 0, 100_000)
    assert [h.get("if-match") for h in fault_proxy.request_headers] == [None, None]


def test_resume_with_if_match_gives_412(s3_server, fault_proxy, store, obj):
    """With if_match, the resumed GET carries it; the 412 then comes as a
    GenericError (wrapping Precondition), not a PreconditionError."""
    _replace_during_resume(s3_server, fault_proxy, obj[0])
    with pytest.raises(obx.GenericError, match=r"(?s)Request precondition failure.*412") as e:
        get_range(store, 0, 100_000, if_match=obj[1])
    assert not isinstance(e.value, obx.PreconditionError)
    assert [h.get("if-match") for h in fault_proxy.request_headers] == [obj[1], obj[1]]


def test_delay(fault_proxy, store):
    fault_proxy.delay(0.3, 1)
    start = time.monotonic()
    assert get_range(store, 0, 10) == DATA[:10]
    assert time.monotonic() - start >= 0.3


def test_timeouts(s3_server, fault_proxy, obj):
    """Past client_options' timeout: retried; when all time out, a
    GenericError (before the headers: 'error sending request'; mid-body:
    'request or response body error')."""
    store = s3_server.store(obj[0], fault_proxy.url, client_options={"timeout": timedelta(seconds=0.4)},
                            retry_config=fast_retry_config(max_retries=1))
    fault_proxy.delay(1.0, 1)
    assert get_range(store, 0, 10) == DATA[:10]
    assert len(fault_proxy.requests) == 2
    fault_proxy.delay(1.0, 2)
    with pytest.raises(obx.GenericError, match=r"after 1 retries.*HTTP error: error sending request"):
        get_range(store, 0, 10)
    fault_proxy.delay(1.0, 2, after_bytes=1000)
    with pytest.raises(obx.GenericError, match=r"(?s)request or response body error.*TimedOut"):
        get_range(store, 0, 100_000)


def test_open_connections(s3_server, fault_proxy, obj):
    pooled = s3_server.store(obj[0], fault_proxy.url)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(get_range, [pooled] * 16, range(16), range(10, 26)))
    assert fault_proxy.open_connections() >= 1               # obstore's pool keeps them alive
    del pooled
    gc.collect()
    assert fault_proxy.wait_connections(0) == 0                 # dropped with the store
    short = s3_server.store(obj[0], fault_proxy.url, client_options={"pool_idle_timeout": "50ms"})
    get_range(short, 0, 10)
    assert fault_proxy.wait_connections(0) == 0


def test_proxy_in_front_of_a_dead_upstream():
    with FaultProxy("http://127.0.0.1:9") as proxy:   # discard port: nothing listens
        store = remote_servers.s3_store("bucket", proxy.url, retry_config={"max_retries": 0})
        with pytest.raises(obx.GenericError, match="502 Bad Gateway"):
            obstore.head(store, "x")


# -- RangeHTTPServer ----------------------------------------------------------------

@pytest.fixture
def http_store(range_http_server):
    (range_http_server.root_path / "sub").mkdir()
    (range_http_server.root_path / "sub" / "f.bin").write_bytes(DATA)
    return HTTPStore.from_url(range_http_server.url, client_options={"allow_http": True},
                              retry_config=fast_retry_config())


def test_range_http_server_with_obstore(range_http_server, http_store):
    meta = obstore.head(http_store, "sub/f.bin")
    st = os.stat(range_http_server.root_path / "sub" / "f.bin")
    assert meta["size"] == len(DATA) and meta["e_tag"] == range_http_server.etag(st)
    assert bytes(obstore.get(http_store, "sub/f.bin").bytes()) == DATA
    assert bytes(obstore.get_range(http_store, "sub/f.bin", start=7, end=70_000)) == DATA[7:70_000]
    tail = obstore.get(http_store, "sub/f.bin", options={"range": {"suffix": 5}})
    assert bytes(tail.bytes()) == DATA[-5:] and tail.range == (len(DATA) - 5, len(DATA))
    ok = obstore.get(http_store, "sub/f.bin", options={"if_match": meta["e_tag"], "range": (0, 3)})
    assert bytes(ok.bytes()) == DATA[:3]
    with pytest.raises(obx.PreconditionError):
        obstore.get(http_store, "sub/f.bin", options={"if_match": '"other"', "range": (0, 3)})
    with pytest.raises(obx.GenericError, match="416 Range Not Satisfiable"):
        obstore.get_range(http_store, "sub/f.bin", start=len(DATA) + 10, end=len(DATA) + 20)
    with pytest.raises(FileNotFoundError):
        obstore.head(http_store, "nope")
    assert range_http_server.requests[1] == ("GET", "/sub/f.bin", None)


def test_range_http_server_headers(range_http_server, http_store):
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", range_http_server.port, timeout=5)

    def ask(method, headers=None):
        conn.request(method, "/sub/f.bin", headers=headers or {})
        resp = conn.getresponse()
        return resp, resp.read()

    resp, body = ask("GET", {"Range": "bytes=10-19"})
    assert resp.status == 206 and body == DATA[10:20]
    assert resp.getheader("Content-Range") == f"bytes 10-19/{len(DATA)}"
    assert resp.getheader("Content-Length") == "10" and resp.getheader("Last-Modified")
    etag = resp.getheader("ETag")
    resp, body = ask("HEAD")
    assert resp.status == 200 and body == b"" and resp.getheader("Content-Length") == str(len(DATA))
    resp, body = ask("GET", {"Range": f"bytes={len(DATA)}-"})
    assert resp.status == 416 and resp.getheader("Content-Range") == f"bytes */{len(DATA)}"
    resp, _ = ask("GET", {"If-None-Match": etag})
    assert resp.status == 304
    resp, body = ask("GET", {"Range": "bytes=0-1", "If-Range": '"stale"'})
    assert resp.status == 200 and body == DATA
    resp, body = ask("GET", {"Range": "bytes=0-1,5-6"})                 # several ranges: the whole file
    assert resp.status == 200 and len(body) == len(DATA)
    assert range_http_server.connections_total == 1                     # all on one kept-alive connection
    conn.request("GET", "/../../etc/passwd")
    assert conn.getresponse().status == 404
    conn.close()


def test_fault_proxy_in_front_of_range_http_server(range_http_server, http_store):
    with FaultProxy(range_http_server.url) as proxy:
        through = HTTPStore.from_url(proxy.url, client_options={"allow_http": True},
                                     retry_config=fast_retry_config())
        proxy.reset(1, after_bytes=1000)
        assert bytes(obstore.get(through, "sub/f.bin").bytes()) == DATA
        assert [s.range for s in proxy.requests] == [None, f"bytes=1000-{len(DATA) - 1}"]


# -- throughput ------------------------------------------------------------------------

@pytest.mark.slow
def test_moto_throughput_8_ranged_gets(s3_server, s3_bucket, capsys):
    """8 parallel ranged GETs of one object straight from moto, through
    obstore.  REMOTE_BENCH_MIB (default 16) sets the size; REMOTE_NOTES.md
    has the 256 MiB numbers."""
    size = int(os.environ.get("REMOTE_BENCH_MIB", "16")) << 20
    data = os.urandom(1 << 20) * (size >> 20)
    s3_server.put(s3_bucket, "big", data)
    direct = s3_server.store(s3_bucket)
    part = size // 8
    start = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        parts = list(pool.map(lambda i: obstore.get_range(direct, "big", start=i * part, end=(i + 1) * part),
                              range(8)))
    seconds = time.perf_counter() - start
    assert b"".join(bytes(p) for p in parts) == data
    s3_server.delete(s3_bucket, "big")
    with capsys.disabled():
        print(f"\nmoto, 8 ranged GETs of {size >> 20} MiB: {size / seconds / 1e6:.0f} MB/s")
