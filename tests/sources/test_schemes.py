"""The URL schemes' table (loader/_schemes.py): each row agrees with obstore,
and no message of the package lists the schemes by hand."""

import ast
import os
import re

import pytest

import instant_staging
from instant_staging.loader import is_url, schemes_text
from instant_staging.loader._schemes import SCHEMES, Stores

PACKAGE_DIR = os.path.dirname(os.path.abspath(instant_staging.__file__))

obstore = pytest.importorskip("obstore")

# A store of each kind, as obstore builds it: a bucket or host, and what
# the store needs to be made without a request or a credential.
_STORE_CLASSES = {"s3": "S3Store", "gcs": "GCSStore", "azure": "AzureStore", "http": "HTTPStore"}
_OPTIONS = {"s3": {"skip_signature": True, "region": "us-east-1"}, "gcs": {"skip_signature": True},
            "azure": {"account_name": "acct", "skip_signature": True}, "http": None}


@pytest.mark.parametrize("scheme", [s for s, row in SCHEMES.items() if row.store != "hub"])
def test_each_rows_store_is_the_one_obstore_builds(scheme):
    row = SCHEMES[scheme]
    url = f"{scheme}://bucket/m/x.safetensors"
    # obstore's own name of the scheme's store kind
    assert obstore.store._parse_scheme(url) == row.store
    ours, key = Stores(_OPTIONS[row.store]).split(url)
    theirs = obstore.store.from_url(f"{scheme}://bucket", config=_OPTIONS[row.store])
    assert type(ours) is type(theirs) and type(ours).__name__ == _STORE_CLASSES[row.store]
    assert key == "m/x.safetensors"
    assert is_url(url) and is_url(url.upper().replace("BUCKET", "bucket"))
    assert f"{scheme}://" in schemes_text()


def test_the_hub_row_makes_no_store():
    # hf:// is read through huggingface_hub's cache (_open.hub_files), never
    # through an object store; listed with the others in every message.
    (hub,) = [s for s, row in SCHEMES.items() if row.store == "hub"]
    assert hub == "hf" and is_url("hf://org/name") and "hf://" in schemes_text()
    with pytest.raises(ValueError, match="huggingface_hub's cache"):
        Stores(None).split("hf://org/name/model.safetensors")


def _plain_http(store):
    return str((store.client_options or {}).get("allow_http")).lower() == "true"


def test_a_rows_fields_decide_the_store():
    # plain HTTP: http:// always; an s3:// endpoint on http:// (a test
    # server); never for https://
    http, _ = Stores(None).split("http://host/x.safetensors")
    assert _plain_http(http)
    https, _ = Stores(None).split("https://host/x.safetensors")
    assert not _plain_http(https)
    s3, _ = Stores({"endpoint": "http://127.0.0.1:9000", "skip_signature": True}).split(
        "s3://b/x.safetensors")
    assert _plain_http(s3)
    s3, _ = Stores({"endpoint": "https://s3.example", "skip_signature": True}).split(
        "s3a://b/x.safetensors")
    assert not _plain_http(s3)
    # the path is the key as written, but an http(s) URL's is percent-encoded
    assert Stores({"skip_signature": True}).split("s3://b/a%20b.safetensors")[1] == "a%20b.safetensors"
    assert Stores(None).split("https://h/a%20b.safetensors")[1] == "a b.safetensors"


def test_an_unknown_scheme_is_refused_naming_the_table():
    with pytest.raises(ValueError) as e:
        Stores(None).split("ftp://host/x.safetensors")
    assert schemes_text() in str(e.value)
    assert not is_url("ftp://host/x.safetensors") and not is_url("model.safetensors")


# -- no hand-written list -----------------------------------------------------------

_A_SCHEME = re.compile(r"\b([a-z][a-z0-9+.-]*)://")


def _literals(path):
    """Every string of ``path`` that is not a docstring: ``(line, text)``;
    an f-string's parts joined."""
    with open(path) as f:
        tree = ast.parse(f.read())
    docstrings = set()      # (and an f-string's parts: said with the f-string)
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            docstrings.update(id(v) for v in node.values)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            yield node.lineno, "".join(v.value for v in node.values
                                       if isinstance(v, ast.Constant) and isinstance(v.value, str))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in docstrings):
            yield node.lineno, node.value


def listed_by_hand(path):
    """The lines of ``path`` whose strings name schemes of two stores or more
    (a list of the schemes that ``schemes_text()`` should say)."""
    found = []
    for line, text in _literals(path):
        stores = {SCHEMES[s].store for s in _A_SCHEME.findall(text.lower()) if s in SCHEMES}
        if len(stores) >= 2:
            found.append(line)
    return found


def test_no_message_lists_the_schemes_by_hand():
    bad = {}
    for root, _, files in os.walk(PACKAGE_DIR):
        for name in files:
            path = os.path.join(root, name)
            if name.endswith(".py") and name != "_schemes.py":
                lines = listed_by_hand(path)
                if lines:
                    bad[os.path.relpath(path, PACKAGE_DIR)] = lines
    assert not bad, f"use schemes_text(): {bad}"


def test_the_checker_finds_a_list(tmp_path):
    planted = tmp_path / "m.py"
    planted.write_text('"""A docstring may say s3://, gs://."""\n'
                       'def f(x):\n    raise ValueError(f"{x} applies to a URL (s3://, gs://)")\n'
                       'E = "http://host:port or https://host"\n')
    assert listed_by_hand(planted) == [3]
