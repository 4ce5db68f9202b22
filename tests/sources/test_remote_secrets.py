"""Secrets in URLs (issue 40, item 1): a password in a URL's userinfo and a
presigned URL's signature never reach a message, a repr, a report or the
CLI's output.  A password in a URL is refused, with the URL shown redacted
(README, "Object storage": credentials come through storage_options or the
environment)."""

import datetime

import pytest

pytest.importorskip("obstore")

from instant_staging.loader import Checkpoint, iter_load, load_file, redact_text, redact_url, safe_open

from support.cli import cli

SECRET = "TOKEN-s3cr3t"


@pytest.mark.parametrize("url, shown", [
    ("https://user:TOKEN@host/model/", "https://***@host/model/"),
    ("https://user:@host/m.safetensors", "https://***@host/m.safetensors"),
    # a token alone (a personal access token's form) is as much a secret
    ("https://TOKEN@host/m/", "https://***@host/m/"),
    ("https://TOKEN:x-oauth-basic@host/m/?a=1", "https://***@host/m/?a=1"),
    ("s3://TOKEN@bucket/k.safetensors", "s3://***@bucket/k.safetensors"),
    ("https://@host/m/", "https://***@host/m/"),
    ("s3://bucket/key.safetensors", "s3://bucket/key.safetensors"),
    ("https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIA%2F1"
     "&X-Amz-Date=20260101T000000Z&X-Amz-Expires=60&X-Amz-Security-Token=TOKEN"
     "&X-Amz-SignedHeaders=host&X-Amz-Signature=TOKEN",
     "https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=***"
     "&X-Amz-Date=20260101T000000Z&X-Amz-Expires=60&X-Amz-Security-Token=***"
     "&X-Amz-SignedHeaders=host&X-Amz-Signature=***"),
    ("https://acct.blob.core.windows.net/c/m.safetensors?sv=2022-11-02&sp=r&sig=TOKEN",
     "https://acct.blob.core.windows.net/c/m.safetensors?sv=2022-11-02&sp=r&sig=***"),
    ("https://storage.googleapis.com/b/k?X-Goog-Credential=TOKEN&X-Goog-Signature=TOKEN",
     "https://storage.googleapis.com/b/k?X-Goog-Credential=***&X-Goog-Signature=***"),
    ("https://h/k?AWSAccessKeyId=TOKEN&Expires=1&Signature=TOKEN",
     "https://h/k?AWSAccessKeyId=***&Expires=1&Signature=***"),
    ("https://h/k?access_token=TOKEN&api_key=TOKEN&client_secret=TOKEN&Password=TOKEN",
     "https://h/k?access_token=***&api_key=***&client_secret=***&Password=***"),
    ("https://u:p@h/k#access_token=TOKEN", "https://***@h/k#***"),
    # a parameter's name percent-escaped is decoded before it is judged
    ("https://h/k?X-Amz-%53ignature=TOKEN&%73ig=TOKEN&%61pi_%6Bey=TOKEN&a%3Db=1",
     "https://h/k?X-Amz-%53ignature=***&%73ig=***&%61pi_%6Bey=***&a%3Db=1"),
    ("/a/local/path.safetensors", "/a/local/path.safetensors"),
])
def test_redact_url(url, shown):
    assert redact_url(url) == shown
    assert redact_url(shown) == shown           # idempotent: a shown URL is shown as it is
    assert redact_text(f"GET {url} failed: 403") == f"GET {shown} failed: 403"


@pytest.mark.parametrize("url", [
    f"https://user:{SECRET}@127.0.0.1:9/model/",
    f"https://user:{SECRET}@127.0.0.1:9/model/model.safetensors",
    f"https://user:{SECRET}@127.0.0.1:9/model/model.safetensors.index.json",
    [f"https://user:{SECRET}@127.0.0.1:9/model/a.safetensors"],
    f"s3://user:{SECRET}@bucket/model/",
    f"http://:{SECRET}@127.0.0.1:9/m.safetensors",
])
def test_a_password_in_a_url_is_refused_and_never_shown(url):
    # Nothing is asked of any server: port 9 (discard) has none here, and
    # a refusal that came from a request would be an OSError.
    for call in (lambda: Checkpoint.open(url), lambda: load_file(url, "cpu"),
                 lambda: iter_load(url, "cpu")):
        with pytest.raises(ValueError, match=r"credentials in the URL .* are not used") as e:
            call()
        assert SECRET not in str(e.value) and "://***@" in str(e.value)
        assert "storage_options" in str(e.value)
    if isinstance(url, str) and url.endswith(".safetensors"):
        with pytest.raises(ValueError, match="credentials in the URL") as e:
            safe_open(url, "pt")
        assert SECRET not in str(e.value)


def test_a_secret_in_the_clients_message_is_redacted():
    # The client's own message names the request's URL: an endpoint with a
    # password (storage_options, never shown) is redacted there too.
    opts = {"endpoint": f"http://u:{SECRET}@127.0.0.1:9", "access_key_id": "a",
            "secret_access_key": "b", "region": "us-east-1",
            "retry_config": {"max_retries": 0, "retry_timeout": datetime.timedelta(seconds=2)}}
    with pytest.raises(OSError) as e:
        load_file("s3://bucket/k.safetensors", "cpu", storage_options=opts)
    assert SECRET not in str(e.value), str(e.value)


def test_the_cli_never_prints_a_password():
    for args in (["load", f"https://user:{SECRET}@127.0.0.1:9/m/", "--device", "cpu"],
                 ["load", f"https://user:{SECRET}@127.0.0.1:9/m/", "--device", "cpu", "--json"],
                 ["load", f"https://user:{SECRET}@127.0.0.1:9/a.safetensors", "b.safetensors",
                  "--device", "cpu"],
                 ["load", f"ftp://user:{SECRET}@127.0.0.1:9/m/", "--device", "cpu"]):
        proc = cli(*args, timeout=120)
        assert SECRET not in proc.stdout + proc.stderr, (args, proc.stdout + proc.stderr)
        assert proc.returncode == 2, (args, proc.stdout + proc.stderr)
        assert len(proc.stderr.strip().splitlines()) <= 2, proc.stderr     # usage + one line
        if "--json" not in args:
            assert "***" in proc.stderr



def test_a_token_alone_in_the_userinfo_is_refused_and_never_shown(tmp_path):
    """``https://TOKEN@host/...`` (a personal access token's form: no
    colon) was neither refused nor redacted: shown by redact_url,
    Checkpoint.files, repr(safe_open), a FileNotFoundError, the CLI's
    --json and its error line (issue 53, 3).  Any userinfo is a credential."""
    import torch
    from safetensors.torch import save_file

    from support.remote_servers import RangeHTTPServer
    save_file({"w": torch.ones(4)}, str(tmp_path / "m.safetensors"))
    with RangeHTTPServer(tmp_path) as server:
        url = server.url_for("m.safetensors").replace("://", f"://{SECRET}@", 1)
        absent = server.url_for("absent.safetensors").replace("://", f"://{SECRET}@", 1)
        assert SECRET not in redact_url(url) and SECRET not in redact_text(f"GET {url}: 404")
        shown = []
        for call in (lambda: Checkpoint.open(url).files, lambda: repr(Checkpoint.open(url)),
                     lambda: repr(safe_open(url, "pt")), lambda: load_file(absent, "cpu"),
                     lambda: list(iter_load(url, "cpu"))):
            try:
                shown.append(str(call()))
            except (ValueError, OSError) as e:
                assert isinstance(e, ValueError) and "credentials in the URL" in str(e), e
                shown.append(str(e))
        assert not [s for s in shown if SECRET in s], shown
        for args in ([url, "--device", "cpu", "--json"], [absent, "--device", "cpu"],
                     [url, "--device", "cpu"]):
            proc = cli("load", *args, timeout=120)
            out = proc.stdout + proc.stderr
            assert SECRET not in out and proc.returncode == 2, (args, out)
            assert "***@" in out, out
