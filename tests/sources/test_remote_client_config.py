"""What the object-store client is given (issue 40, item 3): values it
cannot use are refused with a ValueError naming the variable (never its
value), before any request; a panic of the client (pyo3's PanicException,
a BaseException) becomes one line of ours; the CLI exits 2 with one line."""

import pytest

pytest.importorskip("obstore")

from instant_staging.loader import load_file

from support.cli import cli

OPTS = {"access_key_id": "a", "secret_access_key": "b", "region": "us-east-1",
        "endpoint": "http://127.0.0.1:9"}


@pytest.mark.parametrize("env, extra, name", [
    ({"AWS_ENDPOINT_URL": "127.0.0.1:9000"}, {"endpoint": None}, "AWS_ENDPOINT_URL"),
    ({}, {"endpoint": "127.0.0.1:9000"}, "storage_options['endpoint']"),
    ({}, {"session_token": "S3CRET\n"}, "storage_options['session_token']"),
    ({}, {"access_key_id": "AKIA\nX"}, "storage_options['access_key_id']"),
    ({"AWS_SESSION_TOKEN": "S3CRET\n"}, {}, "AWS_SESSION_TOKEN"),
    ({}, {"client_options": {"default_headers": {"authorization": "Bearer S3CRET\r\n"}}},
     "storage_options['client_options']['default_headers']['authorization']"),
])
def test_values_the_client_cannot_use_are_refused_by_name(monkeypatch, env, extra, name):
    for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    opts = {k: v for k, v in {**OPTS, **extra}.items() if v is not None}
    with pytest.raises(ValueError) as e:
        load_file("s3://bucket/k.safetensors", "cpu", storage_options=opts)
    assert str(e.value).startswith(name), str(e.value)
    assert "S3CRET" not in str(e.value)


def test_an_azure_token_with_a_newline_is_refused(monkeypatch):
    monkeypatch.setenv("AZURE_STORAGE_SAS_TOKEN", "sv=1&sig=S3CRET\n")
    with pytest.raises(ValueError, match=r"^AZURE_STORAGE_SAS_TOKEN holds a newline") as e:
        load_file("az://container/m.safetensors", "cpu", storage_options={"account_name": "acct"})
    assert "S3CRET" not in str(e.value)


def test_a_panic_of_the_client_is_one_error_of_ours(monkeypatch):
    # The checks above skipped: the client itself panics on such an
    # endpoint at its first request.
    from instant_staging.loader import _schemes
    monkeypatch.setattr(_schemes, "check_value", lambda *a, **k: None)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "127.0.0.1:9000")
    opts = {k: v for k, v in OPTS.items() if k != "endpoint"}
    with pytest.raises(ValueError, match="the object-store client failed") as e:
        load_file("s3://bucket/k.safetensors", "cpu", storage_options=opts)
    assert isinstance(e.value, Exception) and "\n" not in str(e.value)


@pytest.mark.parametrize("json", [False, True])
def test_the_cli_says_one_line_and_exits_2(json):
    env = {"AWS_ENDPOINT_URL": "127.0.0.1:9000", "AWS_ACCESS_KEY_ID": "a",
           "AWS_SECRET_ACCESS_KEY": "b", "AWS_REGION": "us-east-1"}
    proc = cli("load", "s3://bucket/m/", "--device", "cpu", *(["--json"] if json else []),
               env=env, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "panicked" not in out and "Traceback" not in out and "backtrace" not in out, out
    assert "AWS_ENDPOINT_URL must be a URL with its scheme" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) <= 2, proc.stderr      # usage + the line
