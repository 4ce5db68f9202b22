"""Each credential form obstore offers that a server here can check
(docs/object-storage-emulators.md, "Credentials", lists them and says
which are untested).  S3's forms are seen in what signed each request:
moto checks no signature, so the access key id in each request's
Authorization header (at the FaultProxy) tells which source the
credentials came from; Azure's account key and SAS are checked by the
Azure server (tests/sources/test_clouds.py); GCS's service-account file
reaches fake-gcs-server (ibid.)."""

import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("obstore")
safetensors_torch = pytest.importorskip("safetensors.torch")

from instant_staging.loader import load_file

from support.cloud_servers import AwsCredentialServer
from support.remote_servers import (  # noqa: F401 (the *_fixture: fixtures, found by their names)
    ACCESS_KEY,
    REGION,
    fast_retry_config,
    fault_proxy_fixture,
    s3_bucket_fixture,
    s3_server_fixture,
)

AWS_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN", "AWS_ROLE_SESSION_NAME", "AWS_STS_ENDPOINT",
                 "AWS_METADATA_ENDPOINT", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                 "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_REQUEST_PAYER", "AWS_SKIP_SIGNATURE",
                 "AWS_ENDPOINT_URL", "AWS_ENDPOINT", "AWS_ALLOW_HTTP", "AWS_IMDSV1_FALLBACK")


@pytest.fixture
def bare_env(monkeypatch):
    """No AWS variable from the environment the tests run in."""
    for k in AWS_VARIABLES:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_REGION", REGION)
    return monkeypatch


@pytest.fixture
def creds_server():
    with AwsCredentialServer() as server:
        yield server


@pytest.fixture
def model(s3_server, s3_bucket, tmp_path):
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file({"w": torch.arange(1000, dtype=torch.float32)}, str(path))
    s3_server.put(s3_bucket, "c/model.safetensors", path.read_bytes())
    return f"s3://{s3_bucket}/c/model.safetensors", load_file(str(path))


def signed_by(proxy):
    """The access key ids of the requests' SigV4 signatures ('-' unsigned)."""
    out = set()
    for h in proxy.request_headers:
        m = re.search(r"Credential=([^/]+)/", h.get("authorization", ""))
        out.add(m.group(1) if m else "-")
    return out


def load(url, proxy, **config):
    return load_file(url, storage_options={"endpoint": proxy.url, "retry_config": fast_retry_config(),
                                           **config})


def test_static_keys(bare_env, model, fault_proxy):
    url, want = model
    got = load(url, fault_proxy, access_key_id=ACCESS_KEY, secret_access_key="testing")
    assert torch.equal(got["w"], want["w"]) and signed_by(fault_proxy) == {ACCESS_KEY}


def test_instance_metadata(bare_env, model, fault_proxy, creds_server):
    """No key anywhere: the instance metadata service (IMDSv2, its token
    first) at AWS_METADATA_ENDPOINT gives the credentials."""
    url, want = model
    bare_env.setenv("AWS_METADATA_ENDPOINT", creds_server.url)
    got = load(url, fault_proxy)
    assert torch.equal(got["w"], want["w"])
    assert signed_by(fault_proxy) == {AwsCredentialServer.IMDS_KEY}
    assert [(m, p) for m, p, _, _ in creds_server.calls][:2] == [
        ("PUT", "/latest/api/token"), ("GET", "/latest/meta-data/iam/security-credentials/")]


def test_skip_signature_asks_no_credentials(bare_env, s3_server, model, fault_proxy, creds_server):
    """skip_signature (AWS_SKIP_SIGNATURE): unsigned requests, for public
    buckets; no credential source is asked, the metadata service neither."""
    url, want = model
    bucket = url.split("/")[2]
    s3_server.client.put_bucket_acl(Bucket=bucket, ACL="public-read")           # a public bucket
    s3_server.client.put_object_acl(Bucket=bucket, Key="c/model.safetensors", ACL="public-read")
    bare_env.setenv("AWS_METADATA_ENDPOINT", creds_server.url)
    bare_env.setenv("AWS_SKIP_SIGNATURE", "true")
    got = load(url, fault_proxy)
    assert torch.equal(got["w"], want["w"])
    assert signed_by(fault_proxy) == {"-"} and creds_server.calls == []


@pytest.mark.parametrize("how", ["option", "variable"])
def test_requester_pays(bare_env, model, fault_proxy, how):
    url, want = model
    if how == "variable":
        bare_env.setenv("AWS_REQUEST_PAYER", "true")
        config = {}
    else:
        config = {"request_payer": True}
    got = load(url, fault_proxy, access_key_id=ACCESS_KEY, secret_access_key="testing", **config)
    assert torch.equal(got["w"], want["w"])
    assert {h.get("x-amz-request-payer") for h in fault_proxy.request_headers} == {"requester"}


def test_aws_profile_is_not_read(bare_env, model, fault_proxy, creds_server, tmp_path):
    """obstore 0.12 reads no AWS profile: with AWS_PROFILE and a shared
    credentials file, the next source in its chain (instance metadata
    here) signs.  docs/object-storage-emulators.md says what to do instead;
    this test fails once obstore reads profiles, to update the docs."""
    (tmp_path / "credentials").write_text(
        "[loader]\naws_access_key_id = AKIAPROFILEKEY000001\naws_secret_access_key = profile-secret\n")
    bare_env.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    bare_env.setenv("AWS_PROFILE", "loader")
    bare_env.setenv("AWS_METADATA_ENDPOINT", creds_server.url)
    url, want = model
    assert torch.equal(load(url, fault_proxy)["w"], want["w"])
    assert signed_by(fault_proxy) == {AwsCredentialServer.IMDS_KEY}
