"""Real servers on 127.0.0.1 for the remote-source tests: an S3 server
(moto's, in a child process), a fault-injecting HTTP/1.1 reverse proxy to
put in front of it (or of any upstream), and a static HTTP server with
Range support.

Only loopback addresses are ever used, and every server stops by itself:
``stop()``, the context manager, the fixtures' teardown, an ``atexit``
hook, and for moto's child process its stdin, whose end (this process
exiting, however it dies) makes the child exit too.

Fixtures: ``s3_server`` (session) is one moto server for the whole run;
``s3_bucket`` (function) a fresh, empty bucket on it; ``fault_proxy``
(function) a new FaultProxy in front of ``s3_server``, with no faults and
no counts; ``range_http_server`` (function) a RangeHTTPServer on a fresh
directory under ``tmp_path``.  ``s3_server`` skips the test (with the
reason) where moto[server] or boto3 is not installed; nothing here
imports them before a server is started.

pytest finds a fixture by its name among the test module's globals (or a
conftest's, or a plugin's).  The functions here are named ``*_fixture``
and the fixtures ``name=``'d, so a test module imports them and its tests
take the short names as arguments without ruff's F811 (an unused import
redefined by an argument)::

    from support.remote_servers import fault_proxy_fixture, s3_bucket_fixture, s3_server_fixture  # noqa: F401

    def test_x(s3_server, s3_bucket, fault_proxy): ...

(``fault_proxy`` and ``s3_bucket`` need ``s3_server``: import it too.)
Or, once for every test module, ``pytest_plugins = ["support.remote_servers"]``
in tests/conftest.py (the rootdir conftest), and no import at all.

Faults apply to the next ``n`` requests that match (method, a substring
of the request target, and whether a Range header is present), in the
order they were added; one request consumes at most one fault::

    proxy.fail(503, n=2, method="GET", ranged=True)  # two SlowDowns
    proxy.reset(1, after_bytes=4096)                 # RST after 4 KiB of body
    proxy.truncate(1, after_bytes=10)                # FIN after 10 bytes
    proxy.delay(0.5, 1, path="/bucket/key")          # 0.5 s before answering
    proxy.hook(lambda seen: server.put(...), 1)      # runs before forwarding
"""

from __future__ import annotations

import atexit
import contextlib
import email.utils
import fcntl
import http.client
import http.server
import os
import pathlib
import posixpath
import select
import socket
import socketserver
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
import urllib.parse
import uuid
import weakref
from collections import namedtuple
from datetime import timedelta

import pytest

ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"
HOST = "127.0.0.1"

_CHUNK = 256 * 1024

# Every server started and not yet stopped; stopped at interpreter exit.
_live: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_all():
    for server in list(_live):
        with contextlib.suppress(Exception):
            server.stop()


def fast_retry_config(max_retries=3, init_backoff=0.01, max_backoff=0.1, retry_timeout=10.0):
    """An obstore ``retry_config`` for tests: a few retries, 10 ms first
    backoff (obstore's defaults: 10 retries, 100 ms doubling up to 15 s, 3
    minutes in all)."""
    return {
        "max_retries": max_retries,
        "backoff": {"init_backoff": timedelta(seconds=init_backoff),
                    "max_backoff": timedelta(seconds=max_backoff), "base": 2},
        "retry_timeout": timedelta(seconds=retry_timeout),
    }


def s3_config(endpoint):
    """obstore S3 config (S3Store's ``config=``) for a server here."""
    return {"endpoint": endpoint, "access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY,
            "region": REGION}


def storage_options(endpoint, **extra):
    """The loader's ``storage_options=`` for the S3 server here at
    ``endpoint``, with fast retries (and ``extra``)."""
    return {**s3_config(endpoint), "retry_config": fast_retry_config(), **extra}


def s3_store(bucket, endpoint, retry_config=None, client_options=None, **config):
    """An obstore S3Store on ``bucket`` at ``endpoint`` (moto's url or a
    FaultProxy's), plain http allowed, with fast retries unless told."""
    from obstore.store import S3Store
    options = {"allow_http": True}
    options.update(client_options or {})
    return S3Store(bucket, config={**s3_config(endpoint), **config}, client_options=options,
                   retry_config=retry_config if retry_config is not None else fast_retry_config())


def s3_env(endpoint):
    """Environment variables that point boto3 and obstore (S3Store(bucket)
    and obstore.store.from_url("s3://bucket/...") read them) at
    ``endpoint``, plain http allowed, with the dummy credentials."""
    return {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_REGION": REGION, "AWS_DEFAULT_REGION": REGION,
        "AWS_ENDPOINT_URL": endpoint, "AWS_ENDPOINT": endpoint, "AWS_ALLOW_HTTP": "true",
    }


def _wait_port(host, port, deadline):
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)


# ---------------------------------------------------------------------------
# S3: moto's server in a child process
# ---------------------------------------------------------------------------

# The child: moto's threaded werkzeug server on port 0, the port printed
# on stdout, then it waits for its stdin to end (stop(), or this process
# gone) and exits.  Werkzeug's per-request log lines are silenced (they
# would cost time); its errors still go to stderr.
_MOTO_CHILD = r"""
import logging, os, sys
logging.getLogger("werkzeug").setLevel(logging.ERROR)
from moto.moto_server.threaded_moto_server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address=sys.argv[1], port=0, verbose=False)
server.start()
sys.stdout.write("%d\n" % server.get_host_and_port()[1])
sys.stdout.flush()
try:
    sys.stdin.buffer.read()
finally:
    os._exit(0)
"""


class S3ServerError(RuntimeError):
    pass


class S3Server:
    """A real S3 server (moto's) on 127.0.0.1, in a child process.

    ``url`` is its endpoint; ``create_bucket``, ``put``, ``delete`` and
    ``head`` go through boto3.  Dummy credentials (``testing``), region
    us-east-1; moto checks no signature.
    """

    def __init__(self, host=HOST, start_timeout=30.0):
        self.host = host
        self.port = None
        self.start_timeout = start_timeout
        self._proc = None
        self._stderr = None
        self._client = None

    @property
    def url(self):
        return f"http://{self.host}:{self.port}"

    def start(self):
        if self._proc is not None:
            return self
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop())
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT")}
        env.update({k: v for k, v in s3_env("").items() if not k.startswith("AWS_ENDPOINT")})
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _MOTO_CHILD, self.host], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._stderr, env=env, close_fds=True)
        _live.add(self)
        deadline = time.monotonic() + self.start_timeout
        try:
            line = self._read_port_line(deadline)
            self.port = int(line)
            if not _wait_port(self.host, self.port, deadline):
                raise S3ServerError(f"moto's server on port {self.port} never answered")
            self._wait_answers(deadline)
        except Exception as e:
            err = self.stderr()
            self.stop()
            raise S3ServerError(f"moto's S3 server did not start: {e}\n--- its stderr ---\n{err}") from e
        return self

    def _read_port_line(self, deadline):
        out = self._proc.stdout
        buf = b""
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                raise S3ServerError(f"no port within {self.start_timeout:g} s")
            ready, _, _ = select.select([out], [], [], min(left, 0.2))
            if ready:
                byte = os.read(out.fileno(), 1)
                if not byte:
                    code = self._proc.wait(timeout=5)
                    raise S3ServerError(f"the child exited with status {code}")
                buf += byte
        return buf.decode().strip()

    def _wait_answers(self, deadline):
        last = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise S3ServerError(f"the child exited with status {self._proc.returncode}")
            try:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=2)
                conn.request("GET", "/")
                resp = conn.getresponse()
                resp.read()
                conn.close()
                if resp.status < 500:
                    return
                last = f"status {resp.status}"
            except OSError as e:
                last = repr(e)
            time.sleep(0.05)
        raise S3ServerError(f"no answer within {self.start_timeout:g} s (last: {last})")

    def stderr(self):
        """What the child wrote on stderr so far."""
        if self._stderr is None:
            return ""
        try:
            self._stderr.seek(0)
            return self._stderr.read().decode(errors="replace")
        except (OSError, ValueError):
            return ""

    def stop(self):
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            with contextlib.suppress(OSError):
                proc.stdout.close()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None
        self._client = None
        _live.discard(self)

    @property
    def running(self):
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self):
        return self._proc.pid if self._proc is not None else None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    @property
    def client(self):
        """A boto3 S3 client on this server (path-style addressing)."""
        if self._client is None:
            import boto3
            from botocore.config import Config
            self._client = boto3.client(
                "s3", endpoint_url=self.url, aws_access_key_id=ACCESS_KEY,
                aws_secret_access_key=SECRET_KEY, region_name=REGION,
                config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))
        return self._client

    def create_bucket(self, name):
        """Creates ``name`` (S3 rules: 3 to 63 of a-z, 0-9, '.', '-'); no error
        where it exists already."""
        try:
            self.client.create_bucket(Bucket=name)
        except self.client.exceptions.BucketAlreadyOwnedByYou:
            pass
        return name

    def put(self, bucket, key, data: bytes):
        """Stores ``data`` at bucket/key; returns its ETag (with its quotes)."""
        return self.client.put_object(Bucket=bucket, Key=key, Body=data)["ETag"]

    def delete(self, bucket, key):
        self.client.delete_object(Bucket=bucket, Key=key)

    def head(self, bucket, key):
        """boto3's head_object answer (ETag, ContentLength, LastModified...)."""
        return self.client.head_object(Bucket=bucket, Key=key)

    def store(self, bucket, endpoint=None, **kw):
        """An obstore S3Store on ``bucket`` at ``endpoint`` (this server by
        default; pass a FaultProxy's url to go through it); see s3_store."""
        return s3_store(bucket, endpoint or self.url, **kw)


# ---------------------------------------------------------------------------
# Threaded HTTP servers: shared plumbing
# ---------------------------------------------------------------------------

class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, owner, handler):
        self.owner = owner
        self._lock = threading.Lock()
        self._conns = set()
        self.connections_total = 0
        super().__init__((HOST, 0), handler)

    def handle_error(self, request, client_address):
        # A client that closed or reset its connection is no error here; others are.
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)

    def opened(self, sock):
        with self._lock:
            self._conns.add(sock)
            self.connections_total += 1

    def closed(self, sock):
        with self._lock:
            self._conns.discard(sock)

    def open_connections(self):
        with self._lock:
            return len(self._conns)

    def close_connections(self):
        with self._lock:
            conns = list(self._conns)
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class _Threaded:
    """start()/stop()/context manager for an _Server in a thread."""

    _handler: type

    def __init__(self):
        self._server = None
        self._thread = None

    @property
    def port(self):
        return self._server.server_address[1] if self._server else None

    @property
    def url(self):
        return f"http://{HOST}:{self.port}"

    def start(self):
        if self._server is None:
            self._server = _Server(self, self._handler)
            self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                            name=type(self).__name__, daemon=True)
            self._thread.start()
            _live.add(self)
        return self

    def stop(self):
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
            server.close_connections()
            self._thread.join(5)
        _live.discard(self)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def open_connections(self):
        """Client connections open now (a connection counts until its
        handler thread has seen it close)."""
        return self._server.open_connections() if self._server else 0

    @property
    def connections_total(self):
        """Client connections accepted since start."""
        return self._server.connections_total if self._server else 0

    def wait_connections(self, at_most=0, timeout=2.0):
        """Waits until at most ``at_most`` client connections are open;
        returns how many are (for leak checks: the handler notices a closed
        connection a moment after the client closed it)."""
        deadline = time.monotonic() + timeout
        while self.open_connections() > at_most and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.open_connections()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 60                        # an idle keep-alive client connection
    disable_nagle_algorithm = True

    def setup(self):
        super().setup()
        self.server.opened(self.connection)

    def finish(self):
        try:
            super().finish()
        except OSError:
            pass
        finally:
            self.server.closed(self.connection)

    def log_message(self, format, *args):
        pass

    def write_head(self, status, reason, headers):
        lines = [f"HTTP/1.1 {status} {reason}"]
        if not any(k.lower() == "date" for k, _ in headers):
            lines.append(f"Date: {email.utils.formatdate(usegmt=True)}")
        lines += [f"{k}: {v}" for k, v in headers]
        self.wfile.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))

    def write_file_head(self, size, span, common):
        """Writes the head of an answer that carries a file's bytes: all
        ``size`` of them (200, ``span`` None) or ``span`` (206, with its
        Content-Range); returns (the first byte, how many)."""
        if span is None:
            status, start, end, headers = 200, 0, size - 1, common
        else:
            status, (start, end) = 206, span
            headers = [*common, ("Content-Range", f"bytes {start}-{end}/{size}")]
        length = end - start + 1
        self.write_head(status, _reason(status), [("Content-Type", "application/octet-stream"),
                                                  ("Content-Length", length), *headers])
        return start, length

    def write_from(self, f, left):
        """Writes ``left`` bytes of ``f`` from where it stands (fewer where it ends)."""
        while left:
            data = f.read(min(_CHUNK, left))
            if not data:
                break
            self.wfile.write(data)
            left -= len(data)

    def read_body(self):
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""


def _reason(status):
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


# ---------------------------------------------------------------------------
# FaultProxy
# ---------------------------------------------------------------------------

Seen = namedtuple("Seen", "method path range")
Seen.__doc__ = "A request the proxy saw: method, target (path and query), Range header or None."

# S3's error code for each status, where fail() is not told one.
_S3_CODES = {400: "BadRequest", 403: "AccessDenied", 404: "NoSuchKey", 409: "Conflict",
             412: "PreconditionFailed", 416: "InvalidRange", 429: "SlowDown", 500: "InternalError",
             501: "NotImplemented", 502: "BadGateway", 503: "SlowDown", 504: "GatewayTimeout"}

_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization",
        "te", "trailer", "trailers", "transfer-encoding", "upgrade", "expect"}


class Match:
    """Which requests a fault applies to: ``method`` (one or a tuple, any
    case), ``path`` (a substring of the request target, query included),
    ``ranged`` (True: has a Range header; False: has none); None: any."""

    def __init__(self, method=None, path=None, ranged=None):
        if isinstance(method, str):
            method = (method,)
        self.method = tuple(m.upper() for m in method) if method else None
        self.path = path
        self.ranged = ranged

    def __call__(self, method, target, range_header):
        if self.method is not None and method.upper() not in self.method:
            return False
        if self.path is not None and self.path not in target:
            return False
        return self.ranged is None or self.ranged == (range_header is not None)

    def __repr__(self):
        return f"Match(method={self.method}, path={self.path!r}, ranged={self.ranged})"


class Fault:
    """One fault rule: ``remaining`` of its ``n`` requests left, ``fired``
    how many it hit, ``hits`` the Seen of each."""

    def __init__(self, kind, n, match, **params):
        self.kind = kind
        self.remaining = n
        self.fired = 0
        self.hits = []
        self.match = match
        self.params = params

    def __repr__(self):
        return (f"Fault({self.kind}, remaining={self.remaining}, fired={self.fired}, {self.match}, "
                f"{self.params})")


def _match(match, method, path, ranged):
    if match is None:
        return Match(method, path, ranged)
    if isinstance(match, dict):
        return Match(**match)
    return match


class FaultProxy(_Threaded):
    """A threaded HTTP/1.1 reverse proxy on 127.0.0.1 in front of
    ``upstream`` (a url such as S3Server.url), keep-alive on both sides.

    It forwards each request as it came (method, target, headers, Host
    included, so SigV4 signatures stay valid; body), and streams the answer
    back, unless a fault set through fail/reset/truncate/delay applies.
    ``requests`` lists a Seen (method, path, range) for every request,
    ``request_headers`` its headers (a dict, names in lower case);
    ``body_bytes``: the bytes of answer bodies relayed to clients,
    ``bytes_by_path`` the same for each path (the target without its query).
    ``rewrite_host``: forward with the upstream's Host instead of the
    client's (for a server that routes by Host, such as fake-gcs-server;
    it breaks SigV4, which signs Host).
    """

    def __init__(self, upstream, upstream_timeout=60.0, rewrite_host=False):
        super().__init__()
        self.rewrite_host = rewrite_host
        self.body_bytes = 0
        self.bytes_by_path = {}
        parts = urllib.parse.urlsplit(upstream)
        if parts.scheme != "http":
            raise ValueError(f"FaultProxy forwards to http:// upstreams only, not {upstream!r}")
        self.upstream = (parts.hostname, parts.port or 80)
        self.upstream_timeout = upstream_timeout
        self._lock = threading.Lock()
        self._faults = []
        self.requests = []
        self.request_headers = []

    _handler = None                     # set below, once _ProxyHandler exists

    # -- faults -----------------------------------------------------------
    def _add(self, kind, n, match, method, path, ranged, **params):
        fault = Fault(kind, n, _match(match, method, path, ranged), **params)
        with self._lock:
            self._faults.append(fault)
        return fault

    def fail(self, status, n=1, code=None, message=None, headers=None, match=None, method=None, path=None,
             ranged=None):
        """The next ``n`` matching requests are answered ``status`` with an S3
        XML error body (<Error><Code>code</Code>...), without forwarding;
        ``code`` defaults to S3's for the status (503 SlowDown, 500
        InternalError, 403 AccessDenied, 404 NoSuchKey, 412
        PreconditionFailed...).  ``headers``: extra headers (Retry-After...)."""
        return self._add("fail", n, match, method, path, ranged, status=status,
                         code=code or _S3_CODES.get(status, "InternalError"),
                         message=message or f"fault injected by FaultProxy ({status})",
                         headers=dict(headers or {}))

    def reset(self, n=1, after_bytes=0, match=None, method=None, path=None, ranged=None):
        """Forwards the next ``n`` matching requests, sends the answer's
        headers and ``after_bytes`` bytes of its body, then aborts the TCP
        connection with an RST (SO_LINGER 0), after the client has
        acknowledged those bytes."""
        return self._add("reset", n, match, method, path, ranged, after_bytes=after_bytes)

    def truncate(self, n=1, after_bytes=0, match=None, method=None, path=None, ranged=None):
        """Forwards the next ``n`` matching requests, sends the answer's
        headers (with the full Content-Length) and only ``after_bytes``
        bytes of its body, then closes the connection cleanly (FIN)."""
        return self._add("truncate", n, match, method, path, ranged, after_bytes=after_bytes)

    def delay(self, seconds, n=1, after_bytes=None, match=None, method=None, path=None, ranged=None):
        """Holds the next ``n`` matching requests ``seconds`` before
        forwarding them, or with ``after_bytes``, after sending the headers
        and that many bytes of the body (a stall mid-body)."""
        return self._add("delay", n, match, method, path, ranged, seconds=seconds, after_bytes=after_bytes)

    def hook(self, fn, n=1, match=None, method=None, path=None, ranged=None):
        """Calls ``fn(seen)`` (seen: the request's Seen) in the proxy's
        thread before it forwards each of the next ``n`` matching requests,
        which then go on as usual: to change the upstream (replace an
        object...) at an exact point of a client's sequence of requests."""
        return self._add("hook", n, match, method, path, ranged, fn=fn, after_bytes=None)

    def clear_faults(self):
        with self._lock:
            self._faults.clear()

    def faults(self):
        with self._lock:
            return list(self._faults)

    def reset_counts(self):
        """Forgets the requests seen (faults stay)."""
        with self._lock:
            self.requests.clear()
            self.request_headers.clear()
            self.body_bytes = 0
            self.bytes_by_path.clear()

    def _take(self, seen, headers):
        with self._lock:
            self.requests.append(seen)
            self.request_headers.append(headers)
            for fault in self._faults:
                if fault.remaining > 0 and fault.match(*seen):
                    fault.remaining -= 1
                    fault.fired += 1
                    fault.hits.append(seen)
                    return fault
        return None


class _ProxyHandler(_Handler):

    def _upstream(self):
        conn = getattr(self, "_conn", None)
        if conn is None:
            proxy = self.server.owner
            host, port = proxy.upstream
            conn = self._conn = http.client.HTTPConnection(host, port, timeout=proxy.upstream_timeout)
        return conn

    def _drop_upstream(self):
        conn, self._conn = getattr(self, "_conn", None), None
        if conn is not None:
            conn.close()

    def finish(self):
        self._drop_upstream()
        super().finish()

    def proxy(self):
        proxy = self.server.owner
        body = self.read_body()
        seen = Seen(self.command, self.path, self.headers.get("Range"))
        fault = proxy._take(seen, {k.lower(): v for k, v in self.headers.items()})
        kind = fault.kind if fault else None
        if kind == "fail":
            return self._fail(fault.params)
        if kind == "delay" and fault.params["after_bytes"] is None:
            time.sleep(fault.params["seconds"])
            fault = kind = None
        elif kind == "hook":
            fault.params["fn"](seen)
            fault = kind = None
        try:
            resp = self._forward(body)
        except OSError as e:
            self._drop_upstream()
            data = f"FaultProxy: upstream {proxy.upstream}: {e!r}".encode()
            self.write_head(502, "Bad Gateway", [("Content-Type", "text/plain"),
                                                 ("Content-Length", len(data))])
            self.wfile.write(data)
            return
        try:
            self._relay(resp, fault)
        except OSError:                     # the client went away (gave up, timed out)
            self.close_connection = True
        finally:
            if not resp.isclosed():
                self._drop_upstream()       # not read to its end: the connection is spent

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = do_PATCH = do_OPTIONS = proxy

    def _fail(self, params):
        status, code, message = params["status"], params["code"], params["message"]
        data = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                f"<Message>{message}</Message><RequestId>faultproxy</RequestId>"
                f"<HostId>faultproxy</HostId></Error>").encode()
        if self.command == "HEAD":
            data = b""
        headers = [("Content-Type", "application/xml"), ("Content-Length", len(data)),
                   ("x-amz-request-id", "faultproxy")]
        headers += list(params["headers"].items())
        if self.close_connection:
            headers.append(("Connection", "close"))
        self.write_head(status, _reason(status), headers)
        self.wfile.write(data)

    def _forward(self, body):
        for attempt in range(2):
            conn = self._upstream()
            try:
                proxy = self.server.owner
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                if proxy.rewrite_host:
                    conn.putheader("Host", "{}:{}".format(*proxy.upstream))
                for k, v in self.headers.items():
                    if k.lower() not in _HOP and k.lower() != "content-length" and \
                            not (proxy.rewrite_host and k.lower() == "host"):
                        conn.putheader(k, v)
                if body or "Content-Length" in self.headers or "Transfer-Encoding" in self.headers:
                    conn.putheader("Content-Length", str(len(body)))
                conn.endheaders(body or None)
                return conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                # A kept-alive upstream connection the upstream had closed: once more on a new one.
                self._drop_upstream()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _relay(self, resp, fault):
        no_body = self.command == "HEAD" or resp.status in (204, 304) or 100 <= resp.status < 200
        length = resp.getheader("Content-Length")
        headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP]
        chunked = False
        if no_body:
            pass
        elif length is None and resp.chunked:
            chunked = True
            headers.append(("Transfer-Encoding", "chunked"))
        elif length is None:
            self.close_connection = True    # delimited by the close, as upstream did
        if self.close_connection:
            headers.append(("Connection", "close"))
        self.write_head(resp.status, resp.reason, headers)
        if no_body:
            resp.read()
            return
        cut = fault.params["after_bytes"] if fault is not None else None
        sent = 0
        while True:
            if cut is not None and sent >= cut:
                if fault.kind != "delay":
                    return self._abort(fault)
                time.sleep(fault.params["seconds"])     # a stall mid-body, then the rest
                cut = None
            data = resp.read1(_CHUNK if cut is None else min(_CHUNK, cut - sent))
            if not data:
                break
            sent += len(data)
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
            owner = self.server.owner
            with owner._lock:
                owner.body_bytes += len(data)
                key = self.path.split("?", 1)[0]
                owner.bytes_by_path[key] = owner.bytes_by_path.get(key, 0) + len(data)
        if chunked:
            self.wfile.write(b"0\r\n\r\n")
        if cut is not None and fault.kind != "delay":   # the body was shorter than after_bytes
            self._abort(fault)

    def _abort(self, fault):
        """reset: RST once the client has acknowledged what was sent;
        truncate: FIN."""
        sock = self.connection
        self.close_connection = True
        self._drop_upstream()
        _wait_acked(sock, 2.0)
        if fault.kind == "reset":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        else:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)


FaultProxy._handler = _ProxyHandler


def _wait_acked(sock, timeout):
    """Waits until the peer has acknowledged all that was written on
    ``sock`` (SIOCOUTQ, i.e. TIOCOUTQ, 0): an RST discards what is still
    queued, and a reset after K bytes must deliver the K bytes."""
    deadline = time.monotonic() + timeout
    buf = bytearray(4)
    while time.monotonic() < deadline:
        try:
            fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, buf)
        except OSError:
            return
        if struct.unpack("i", buf)[0] == 0:
            return
        time.sleep(0.002)


# ---------------------------------------------------------------------------
# RangeHTTPServer
# ---------------------------------------------------------------------------

class RangeHTTPServer(_Threaded):
    """A static HTTP/1.1 server on 127.0.0.1 for the files under ``root``:
    GET and HEAD, one byte range per request (206 with Content-Range; 416
    where it cannot be satisfied; several ranges are answered 200 with the
    whole file), ETag and Last-Modified, If-Match (412), If-None-Match
    (304), If-Range; keep-alive.  ``requests``: a Seen for each request.

    To misbehave: ``ignore_if_match`` answers as if no If-Match were sent;
    ``send_etag = False`` sends no ETag; ``on_request(seen)`` runs before
    each request is served (to replace a file mid-load); ``stall_after`` (a
    byte count) stops a ranged body after that many bytes until
    ``release`` is set (or the client goes), the connection left open."""

    def __init__(self, root):
        super().__init__()
        self.root = os.path.realpath(os.fspath(root))
        self.root_path = pathlib.Path(self.root)
        self.requests = []
        self._lock = threading.Lock()
        self.ignore_if_match = False
        self.send_etag = True
        self.on_request = None
        self.stall_after = None
        self.release = threading.Event()

    def url_for(self, relpath):
        return f"{self.url}/{urllib.parse.quote(relpath)}"

    def reset_counts(self):
        with self._lock:
            self.requests.clear()

    @staticmethod
    def etag(st):
        return f'"{st.st_mtime_ns:x}-{st.st_size:x}"'


def _parse_range(value, size):
    """(start, end inclusive) for one 'bytes=' range; None to ignore the
    header (not bytes, several ranges, malformed); 'unsatisfiable'."""
    unit, _, spec = value.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    first, sep, last = spec.strip().partition("-")
    if not sep:
        return None
    try:
        if first == "":
            n = int(last)
            if n <= 0:
                return "unsatisfiable"
            return max(0, size - n), size - 1
        start = int(first)
        end = int(last) if last else size - 1
    except ValueError:
        return None
    if start > end and last:
        return None
    if start >= size:
        return "unsatisfiable"
    return start, min(end, size - 1)


def _peer_gone(sock):
    """Whether the client closed (or reset) its end of ``sock``."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _etag_in(header, etag):
    tags = [t.strip() for t in header.split(",")]
    weakless = etag.removeprefix("W/")
    return "*" in tags or any(t.removeprefix("W/") == weakless for t in tags)


class _StaticHandler(_Handler):

    def do_GET(self):
        self._serve(body=True)

    def do_HEAD(self):
        self._serve(body=False)

    def _plain(self, status, text, extra=()):
        data = text.encode() if self.command != "HEAD" else b""
        headers = [("Content-Type", "text/plain"), ("Content-Length", len(data)), *extra]
        self.write_head(status, _reason(status), headers)
        self.wfile.write(data)

    def _serve(self, body):
        owner = self.server.owner
        self.read_body()
        rng = self.headers.get("Range")
        seen = Seen(self.command, self.path, rng)
        with owner._lock:
            owner.requests.append(seen)
        if owner.on_request is not None:
            owner.on_request(seen)
        rel = posixpath.normpath(urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)).lstrip("/")
        path = os.path.realpath(os.path.join(owner.root, rel))
        if not (path == owner.root or path.startswith(owner.root + os.sep)) or not os.path.isfile(path):
            return self._plain(404, "not found\n")
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            size, etag = st.st_size, RangeHTTPServer.etag(st)
            common = [("ETag", etag)] if owner.send_etag else []
            common += [("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True)),
                       ("Accept-Ranges", "bytes")]
            if_match = self.headers.get("If-Match")
            if if_match is not None and not owner.ignore_if_match and not _etag_in(if_match, etag):
                return self._plain(412, "precondition failed\n", common)
            if_none = self.headers.get("If-None-Match")
            if if_none is not None and _etag_in(if_none, etag):
                self.write_head(304, "Not Modified", common)
                return
            span = _parse_range(rng, size) if rng else None
            if_range = self.headers.get("If-Range")
            if span is not None and if_range is not None and if_range.strip() != etag:
                span = None
            if span == "unsatisfiable":
                return self._plain(416, "range not satisfiable\n", [("Content-Range", f"bytes */{size}")])
            start, length = self.write_file_head(size, span, common)
            if not body or length <= 0:
                return
            f.seek(start)
            left = length
            if owner.stall_after is not None and span is not None:
                self.wfile.write(f.read(min(owner.stall_after, left)))
                self.wfile.flush()
                left -= min(owner.stall_after, left)
                while not owner.release.wait(0.05):
                    if _peer_gone(self.connection):
                        return
            self.write_from(f, left)


RangeHTTPServer._handler = _StaticHandler


# ---------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------

def require_s3():
    """Skips the test unless boto3 and moto's server mode (moto[server]:
    flask) are installed."""
    import importlib.util
    for module, what in [("boto3", "boto3"), ("moto", "moto"), ("flask", "moto's server mode (flask)")]:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {what}: pip install 'moto[server]' boto3")


@pytest.fixture(scope="session", name="s3_server")
def s3_server_fixture():
    """One moto S3 server (a child process) for the session."""
    require_s3()
    with S3Server() as server:
        yield server


@pytest.fixture(name="s3_bucket")
def s3_bucket_fixture(s3_server):
    """A new empty bucket on s3_server; its name."""
    return s3_server.create_bucket(f"test-{uuid.uuid4().hex[:20]}")


@pytest.fixture(name="fault_proxy")
def fault_proxy_fixture(s3_server):
    """A new FaultProxy in front of s3_server: no faults, no counts."""
    with FaultProxy(s3_server.url) as proxy:
        yield proxy


@pytest.fixture(name="range_http_server")
def range_http_server_fixture(tmp_path):
    """A RangeHTTPServer serving a new empty directory (``.root_path``)."""
    root = tmp_path / "http-root"
    root.mkdir()
    with RangeHTTPServer(root) as server:
        yield server
