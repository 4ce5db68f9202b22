"""The URL schemes read here: one row each, and what follows from a row.

``SCHEMES`` maps each scheme to its ``Scheme`` row: the obstore store it
makes, the environment its client reads, the variables that carry its
credentials, when it may speak plain HTTP and how its path becomes a key.
Everything else here asks the row, never the scheme's name: ``is_url``,
the stores (``Stores``), the checks of the values the client would panic
on (``check_value``, ``check_environment``), the message where no
credentials were found (``no_credentials``) and every message that lists
the schemes (``schemes_text``).  Adding a scheme is one row here (and a
test server, and a line in docs/guides/object-storage.md).

Redaction lives here too, since every message naming a URL passes through
it: ``redact_url``, ``redact_text``.  No value of ``storage_options=`` or
of the environment is ever put in a message.

This module imports no other module of the loader (tests/core/test_source.py):
``_source`` (a path that is a URL of another scheme) and ``_remote`` (the
objects) both ask it.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping
from typing import Literal, NamedTuple
from urllib.parse import unquote, urlsplit

# The extra that installs the object-store client.
EXTRA = "instant_staging[remote]"


# What is said of a store whose row names no credential variables.
_ANY_CREDENTIALS = "the store's credential variables"


class Scheme(NamedTuple):
    """What the loader knows of one URL scheme: a row of ``SCHEMES``."""

    store: Literal["s3", "gcs", "azure", "http", "hub"]
    """The obstore store the scheme makes, named as obstore's
    ``parse_scheme`` names it: ``obstore.store.from_url`` builds an
    ``S3Store``, ``GCSStore``, ``AzureStore`` or ``HTTPStore``
    (tests/sources/test_schemes.py holds each row to obstore's answer).
    ``"hub"``: no store; the Hugging Face Hub, read through huggingface_hub's
    cache into local files (``_open``, ``instant_staging/_hub.py``)."""
    env_prefixes: tuple[str, ...] = ()
    """The prefixes of the environment variables the store's client reads
    (its credential chain, its endpoint): each such variable is checked
    before the store is made (``check_environment``), and an endpoint
    among them (``<PREFIX>ENDPOINT_URL``, ``<PREFIX>ENDPOINT``) decides
    ``plain_http="endpoint"``."""
    credentials: str = _ANY_CREDENTIALS
    """The variables that carry the store's credentials, as said where none
    were found (``no_credentials``: the client asked the instance's
    metadata service last, and it gave none)."""
    plain_http: Literal["never", "always", "endpoint"] = "never"
    """When the client may speak plain HTTP: ``"always"`` (an http:// URL),
    ``"endpoint"`` (where the endpoint given is an http:// URL:
    ``storage_options``' ``endpoint`` or ``<prefix>endpoint``, else the
    environment's; an S3-compatible server such as MinIO, Ceph or a test
    server, which boto3 also takes as it is), ``"never"``."""
    quoted_path: bool = False
    """Whether the URL's path is percent-encoded (an http(s) URL's): the key
    is then the path decoded, since the client encodes a key again (a space
    as %20, so %20 as %2520).  Else the key is the path as written (an
    s3:// URL's is the key as it is)."""
    made_as: str = ""
    """The scheme the store is made with, where it is not this one
    (``s3a://`` is made as ``s3://``); "" for this one."""


_AWS = dict(store="s3", env_prefixes=("AWS_",), plain_http="endpoint",
            credentials="AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
_AZURE = dict(store="azure", env_prefixes=("AZURE_",),
              credentials="AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_KEY")

# Every scheme read here, in the order messages list them.
SCHEMES: dict[str, Scheme] = {
    "s3": Scheme(**_AWS),
    "s3a": Scheme(**_AWS, made_as="s3"),
    "gs": Scheme("gcs", ("GOOGLE_",), "GOOGLE_APPLICATION_CREDENTIALS"),
    "az": Scheme(**_AZURE),
    "azure": Scheme(**_AZURE),
    "abfs": Scheme(**_AZURE),
    "abfss": Scheme(**_AZURE),
    "http": Scheme("http", plain_http="always", quoted_path=True),
    "https": Scheme("http", quoted_path=True),
    "hf": Scheme("hub", credentials="HF_TOKEN (or `hf auth login`'s token)"),
}


def schemes_text() -> str:
    """The schemes read here, as every message lists them: "s3://, s3a://, ...".

    Returns:
        Each scheme of ``SCHEMES`` with its ``://``, in the table's order.
    """
    return ", ".join(f"{name}://" for name in SCHEMES)


def scheme_of(url) -> Scheme | None:
    """``url``'s row of ``SCHEMES``; None where it is no URL of a scheme read here."""
    if not isinstance(url, str) or "://" not in url:
        return None
    return SCHEMES.get(url.split("://", 1)[0].lower())


def is_hub_url(source) -> bool:
    """Whether ``source`` (or the first item of a list) is a URL of the Hub's
    row (``hf://``): read as local files of huggingface_hub's cache, not
    through a store."""
    if isinstance(source, (list, tuple)) and source:
        source = source[0]
    row = scheme_of(source)
    return row is not None and row.store == "hub"


def is_url(source) -> bool:
    """Whether ``source`` (or the first item of a list) is a URL of a scheme we read.

    Args:
        source: anything a load takes as its source.

    Returns:
        True for a URL of a scheme read here (``schemes_text()``: s3://,
        gs://, az://, https://, ...).
    """
    if isinstance(source, (list, tuple)) and source:
        source = source[0]
    return scheme_of(source) is not None


# -- the client ---------------------------------------------------------------------

# The process that made an object-store client.  obstore's requests run on
# a runtime of Rust threads started by the first of them; a process forked
# from that one has none of those threads and obstore starts no new ones, so
# its first request would wait forever (obstore 0.12; "not fork safe"
# upstream).  A forked child is told so before it asks anything
# (docs/FORK.md); a process forked before any client was made, or started
# with spawn or forkserver, reads as any other.
_client_pid = None


def load_obstore():
    """The obstore module, in a process whose requests can be answered."""
    if _client_pid is not None and _client_pid != os.getpid():
        raise RuntimeError(
            f"this process (pid {os.getpid()}) was forked from pid {_client_pid}, which had read "
            "from object storage: the client's runtime does not survive fork, and a request made "
            "here would wait forever.  Read object storage in processes started with spawn or "
            "forkserver (multiprocessing.get_context('spawn')), or before the fork")
    try:
        import obstore
    except ImportError:
        raise ImportError("reading from object storage needs the obstore client: "
                          f"pip install '{EXTRA}'") from None
    return obstore


class Stores:
    """One obstore store per scheme://bucket (or host), made once."""

    def __init__(self, storage_options):
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise TypeError("storage_options must be a mapping (passed to the object store's "
                            f"config), not {type(storage_options).__name__}")
        options = dict(storage_options or {})
        self.client_options = dict(options.pop("client_options", None) or {})
        self.retry_config = options.pop("retry_config", None)
        self.config = options
        for key, value in options.items():
            check_value(f"storage_options[{key!r}]", value, endpoint="endpoint" in str(key).lower())
        for key, value in self.client_options.items():
            if isinstance(value, Mapping):      # default_headers
                for k, v in value.items():
                    check_value(f"storage_options['client_options'][{key!r}][{k!r}]", v)
            else:
                check_value(f"storage_options['client_options'][{key!r}]", value)
        self._stores = {}

    def split(self, url):
        """``(store, key)`` for ``url``."""
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        row = SCHEMES.get(scheme)
        if row is None:
            raise ValueError(f"{redact_url(url)}: scheme {parts.scheme!r} is not one of "
                             f"{schemes_text()}")
        if not parts.netloc:
            raise ValueError(f"{redact_url(url)}: no bucket or host in the URL")
        if parts.query or parts.fragment:
            raise ValueError(f"{redact_url(url)}: a source URL takes no query or fragment")
        if "@" in parts.netloc:
            # Neither used nor kept: a password or a token in a URL ends up
            # in messages, reports and shell history; any userinfo is one
            # (a personal access token is the whole of it: TOKEN@host).
            # (README, "Object storage".)
            raise ValueError(f"{redact_url(url)}: credentials in the URL (a password or token "
                             "before its '@') are not used: pass "
                             "credentials through storage_options= or the environment "
                             "(AWS_*, GOOGLE_*, AZURE_*; for https, an Authorization "
                             "header in storage_options={'client_options': "
                             "{'default_headers': ...}})")
        if row.store == "hub":
            raise ValueError(f"{redact_url(url)}: a Hub URL is read through huggingface_hub's "
                             "cache, not an object store")
        root = f"{scheme}://{parts.netloc}"
        store = self._stores.get(root)
        if store is None:
            store = self._stores[root] = self._make(root, scheme, row)
        key = parts.path.lstrip("/")
        if row.quoted_path:
            key = unquote(key)
        return store, key

    def _make(self, root, scheme, row):
        global _client_pid
        obstore = load_obstore()
        _client_pid = os.getpid()       # (its requests follow: a fork from here is refused them)
        check_environment(row)
        client = dict(self.client_options)
        config = dict(self.config)
        if row.plain_http == "always" or (row.plain_http == "endpoint"
                                          and _endpoint(row, config).startswith("http://")):
            client.setdefault("allow_http", True)
        if row.made_as:
            root = root.replace(f"{scheme}://", f"{row.made_as}://", 1)
        kwargs = {"client_options": client or None, "retry_config": self.retry_config}
        try:
            with no_panic(root):
                return obstore.store.from_url(root, config=config or None, **kwargs)
        except ClientPanic:
            raise
        except Exception as e:
            raise ValueError(f"{root}: cannot make an object-store client: {describe(e)}") from None


def _endpoint(row, config):
    """The endpoint a store of ``row`` is given: ``config``'s, else the
    environment's ("" where none is)."""
    for prefix in row.env_prefixes:
        found = (config.get("endpoint") or config.get(f"{prefix.lower()}endpoint")
                 or os.environ.get(f"{prefix}ENDPOINT_URL") or os.environ.get(f"{prefix}ENDPOINT"))
        if found:
            return found
    return config.get("endpoint") or ""


def check_value(name, value, endpoint=False):
    """A ValueError naming ``name`` (never its value: it may be a secret)
    where ``value`` is a string the client cannot send: a control character
    (a token read from a file keeps its newline), surrounding blanks; an
    endpoint without its scheme (``127.0.0.1:9000``).  The client panics on
    those, at its first request."""
    if not isinstance(value, str):
        return
    if any(ord(c) < 32 or ord(c) == 127 for c in value) or value != value.strip():
        raise ValueError(f"{name} holds a newline, a control character or surrounding blanks "
                         "(a value read from a file keeps its newline): strip it")
    if endpoint and value and not value.lower().startswith(("http://", "https://")):
        raise ValueError(f"{name} must be a URL with its scheme (http://host:port or "
                         f"https://host), not {redact_url(value)!r}")


def check_environment(row):
    """``check_value`` for the variables the client of ``row`` reads."""
    if not row.env_prefixes:
        return
    for name, value in os.environ.items():
        if name.startswith(row.env_prefixes):
            check_value(name, value, endpoint="ENDPOINT" in name)


class ClientPanic(ValueError):
    """The object-store client panicked (a Rust panic, pyo3's
    ``PanicException``, a BaseException): almost always a value it was
    given that it could not use.  One line, no backtrace."""


@contextlib.contextmanager
def no_panic(url):
    """Turns a panic of the client inside the block into ``ClientPanic``."""
    try:
        yield
    except Exception as e:
        if type(e).__name__ != "RustPanic":      # (a panic in an awaited request)
            raise
        raise ClientPanic(f"{redact_url(url)}: the object-store client failed: it panicked "
                          "(check the endpoint, credentials and storage_options)") from None
    except BaseException as e:
        if type(e).__name__ != "PanicException":
            raise                       # KeyboardInterrupt, SystemExit
        raise ClientPanic(f"{redact_url(url)}: the object-store client failed: "
                          f"{describe(e)} (check the endpoint, credentials and "
                          "storage_options)") from None


# -- what may be shown -----------------------------------------------------------------

# A query parameter whose value is a secret: a presigned URL's signature
# and credential (S3's X-Amz-*, GCS's X-Goog-*, the old AWSAccessKeyId &
# Signature), an Azure SAS's sig, and anything named like a token or a key.
_SECRET_PARAMS = ("sig", "awsaccesskeyid")
_SECRET_WORDS = ("token", "signature", "secret", "key", "credential", "password")
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")
REDACTED = "***"


def _secret_param(name):
    name = unquote(name).lower()
    return name in _SECRET_PARAMS or any(word in name for word in _SECRET_WORDS)


def redact_url(url: str) -> str:
    """``url`` as it may be shown: in messages, reprs, reports, logs.

    The userinfo becomes ``***`` (``***@host``): any userinfo is a
    credential (a password, a token given alone as in ``https://TOKEN@host/``,
    a user name beside either).  So do the values of query parameters that
    carry a secret (their names percent-decoded first; a presigned URL's
    ``X-Amz-Signature``/``X-Amz-Credential``/``X-Amz-Security-Token``,
    ``X-Goog-Signature``, an Azure SAS's ``sig``, any parameter named like
    a token, signature, secret, key, credential or password) and a
    fragment; the scheme, host, path and the other parameters stay, so the
    object is recognised.  A URL without secrets is returned unchanged.

    Args:
        url: any URL (or text that is not one: returned as it is).

    Returns:
        The URL with its secrets replaced by ``***``.
    """
    if not isinstance(url, str) or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    cut = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0),
              default=len(rest))
    netloc, tail = rest[:cut], rest[cut:]
    _, at, host = netloc.rpartition("@")
    if at:
        netloc = f"{REDACTED}@{host}"
    tail, hash_, _ = tail.partition("#")
    path, q, query = tail.partition("?")
    if query:
        query = "&".join(f"{p.split('=', 1)[0]}={REDACTED}" if _secret_param(p.split("=", 1)[0])
                         else p for p in query.split("&"))
    return f"{scheme}://{netloc}{path}{q}{query}" + (f"#{REDACTED}" if hash_ else "")


def redact_text(text: str) -> str:
    """``text`` with every URL in it passed through ``redact_url``."""
    return _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)


def describe(exc):
    """The client's message, first line: it names the request (its URLs
    redacted), never the credentials."""
    text = str(exc).strip().splitlines()
    return redact_text(text[0]) if text else type(exc).__name__


# Where a client asks the instance's metadata service for credentials (AWS
# IMDS, GCP's metadata server, Azure's managed identity), whatever endpoint
# it is at: asked only when no credentials were given, so a failure there
# means none were (its own message names only the metadata request).
_METADATA_PATHS = ("/latest/api/token", "/latest/meta-data/", "/computeMetadata/", "/metadata/identity/")


def no_credentials(exc, url, what):
    """A PermissionError saying that no credentials were found, where ``exc``
    is the client's failure to get them from the metadata service; else None."""
    text = str(exc)
    if not any(p in text for p in _METADATA_PATHS):
        return None
    row = scheme_of(url)
    variables = _ANY_CREDENTIALS if row is None else row.credentials
    return PermissionError(
        f"{url}: no credentials while {what}: none in storage_options= or the environment "
        f"({variables}), and the instance metadata service, asked last, gave none (not a cloud "
        "instance with a role?); a public bucket reads with storage_options={'skip_signature': True} "
        f"({describe(exc)})")
