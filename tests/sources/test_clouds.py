"""The loader against each cloud's server: s3:// on moto's, gs:// on
fake-gcs-server, az:// on the Azure Blob server of support/cloud_servers.py,
each behind a FaultProxy.  One suite, parametrized over the three
(``cloud``): every source form bit for bit against the files, the faults
the proxy injects (5xx, resets, truncated bodies), an object replaced
during a load, refused and missing objects, credentials from the
documented variables, and nothing leaked (threads, sockets, secrets in a
message).  docs/object-storage-emulators.md says where each server
differs from its cloud."""

import os
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("obstore")
safetensors_torch = pytest.importorskip("safetensors.torch")

from instant_staging.loader import Checkpoint, LoadError, RemoteChangedError, load_file

from support.cloud_servers import (  # noqa: F401 (the *_fixture: fixtures, found by their names)
    AZURE_KEY,
    azure_server_fixture,
    cloud_fixture,
    gcs_server_fixture,
)
from support.remote_checkpoints import fds as _fds
from support.remote_checkpoints import random_tensor as _random
from support.remote_checkpoints import same, upload
from support.remote_checkpoints import settled as _settled
from support.remote_checkpoints import threads as _threads
from support.remote_servers import SECRET_KEY, s3_server_fixture  # noqa: F401


def sharded():
    """Two shards and their tensors (bf16, fp8, odd sizes, an empty one)."""
    g = torch.Generator().manual_seed(3)
    a = {f"layers.{i}.w": _random((64, 48), torch.bfloat16, g) for i in range(4)}
    a["layers.0.odd"] = _random((13,), torch.uint8, g)
    b = {f"layers.{i}.w8": _random((40, 40), torch.float8_e4m3fn, g) for i in range(4, 8)}
    b["empty"] = torch.zeros((0, 3))
    return [("model-00001-of-00002.safetensors", a), ("model-00002-of-00002.safetensors", b)]


def moe():
    g = torch.Generator().manual_seed(4)
    return [("model.safetensors", {f"layers.{i}.experts.{e}.{w}": _random((8, 16), torch.bfloat16, g)
                                   for i in range(2) for e in range(24) for w in ("gate", "up", "down")})]


def secrets(cloud):
    """What no message may show."""
    return [SECRET_KEY if cloud.scheme == "s3" else AZURE_KEY, AZURE_KEY[:20]] + \
        ([cloud.sa_path] if cloud.scheme == "gs" else [])


# -- every source form, bit for bit -------------------------------------------------------

def test_every_source_form(cloud, tmp_path):
    files = sharded()
    local = upload(cloud.put, "m", files, tmp_path)
    upload(cloud.put, "noindex", files, tmp_path / "x", index=False)
    want = load_file(local)
    opts = cloud.storage_options()
    urls = [cloud.url(f"m/{f}") for f, _ in files]
    for source in (cloud.url("m/"), cloud.url("m"), cloud.url("m/model.safetensors.index.json"), urls,
                   cloud.url("noindex/")):
        with Checkpoint.open(source, storage_options=opts) as ck:
            assert ck.files == ([u.replace("/m/", "/noindex/") for u in urls]
                                if "noindex" in str(source) else urls)
            same(ck.load("cpu", chunk_size=4096), want)       # many chunks: every range path
    same(load_file(urls[1], storage_options=opts), load_file(str(local / files[1][0])))
    # Every data byte came through the server: one load's GETs cover it.
    assert cloud.proxy.body_bytes >= 5 * sum(os.path.getsize(local / f) for f, _ in files)


def test_credentials_and_endpoint_from_the_environment(cloud, tmp_path, monkeypatch):
    """No storage_options: the documented variables alone (AWS_*;
    GOOGLE_SERVICE_ACCOUNT; AZURE_STORAGE_* with the emulator switch)."""
    local = upload(cloud.put, "env", moe(), tmp_path)
    for k, v in cloud.env.items():
        monkeypatch.setenv(k, v)
    cloud.proxy.reset_counts()
    same(load_file(cloud.url("env/")), load_file(local))
    assert cloud.proxy.requests                             # through the proxy: the variables were read
    if cloud.scheme == "az":
        assert set(cloud.server.auth[-len(cloud.proxy.requests):]) == {"SharedKey"}


# -- when the network misbehaves ----------------------------------------------------------

@pytest.mark.parametrize("fault", ["503", "500", "reset", "truncate"])
def test_transient_failures_are_retried(cloud, tmp_path, fault):
    local = upload(cloud.put, "t", moe(), tmp_path)
    want = load_file(local)
    proxy = cloud.proxy
    with Checkpoint.open(cloud.url("t/"), storage_options=cloud.storage_options()) as ck:
        if fault == "503":
            proxy.fail(503, n=3, method="GET", ranged=True)
        elif fault == "500":
            proxy.fail(500, n=2, method="GET", ranged=True)
        elif fault == "reset":
            proxy.reset(2, after_bytes=1000, method="GET", ranged=True)
        else:
            proxy.truncate(2, after_bytes=1000, method="GET", ranged=True)
        got = ck.load("cpu", chunk_size=16 << 10)
        assert all(f.remaining == 0 for f in proxy.faults())     # every fault was met
    same(got, want)


def test_a_failure_that_persists_is_one_error_and_leaks_nothing(cloud, tmp_path, monkeypatch):
    from instant_staging.loader import _remote
    monkeypatch.setattr(_remote, "RETRY_SECONDS", 2.0)
    upload(cloud.put, "bad", moe(), tmp_path)
    url = cloud.url("bad/")
    fds, threads = _fds(), _threads()
    with Checkpoint.open(url, storage_options=cloud.storage_options()) as ck:
        cloud.proxy.reset(10_000, after_bytes=100, method="GET", ranged=True)
        with pytest.raises(LoadError, match=r"bad/model\.safetensors.*gave up after") as e:
            ck.load("cpu", chunk_size=64 << 10)
    assert e.value.path == f"{url}model.safetensors"
    assert not any(s in str(e.value) for s in secrets(cloud))
    assert _settled(threads, fds), (_fds() - fds)
    cloud.proxy.clear_faults()


def test_object_replaced_during_the_load(cloud, tmp_path):
    """A new version of a shard between its header and its data: an
    error naming it, never a model of two versions (S3 and Azure: If-Match
    answered 412; fake-gcs-server ignores If-Match, and the old
    generation the GET asks for is gone: 404, "no such object")."""
    files = sharded()
    upload(cloud.put, "r", files, tmp_path)
    url = cloud.url(f"r/{files[1][0]}")
    with Checkpoint.open(cloud.url("r/"), storage_options=cloud.storage_options()) as ck:
        changed = {n: t.clone() for n, t in files[1][1].items()}
        changed["layers.4.w8"].view(-1).view(torch.uint8)[0] ^= 1
        path = tmp_path / "new.safetensors"
        safetensors_torch.save_file(changed, str(path), metadata={"format": "pt"})
        cloud.put(f"r/{files[1][0]}", path.read_bytes())
        with pytest.raises(LoadError) as e:
            ck.load("cpu")
    assert url in str(e.value)
    if cloud.scheme == "gs":
        assert "no such object" in str(e.value)
    else:
        assert isinstance(e.value, RemoteChangedError) and e.value.path == url


def test_object_replaced_between_retries_of_a_range(cloud, tmp_path):
    """A body cut short, then the object replaced before the range is asked
    again: the resumed or retried GET is refused, not mixed."""
    files = moe()
    local = upload(cloud.put, "rr", files, tmp_path)
    raw = (local / files[0][0]).read_bytes()
    proxy = cloud.proxy
    with Checkpoint.open(cloud.url("rr/"), storage_options=cloud.storage_options()) as ck:
        proxy.truncate(1, after_bytes=100, method="GET", ranged=True)
        proxy.hook(lambda seen: cloud.put(f"rr/{files[0][0]}", raw[:-1] + bytes([raw[-1] ^ 1])), 1,
                   method="GET", ranged=True)
        with pytest.raises(LoadError, match=r"changed while it was loaded|no such object"):
            ck.load("cpu", chunk_size=1 << 20)


@pytest.mark.parametrize("status, error, words", [
    (403, PermissionError, "access denied"),
    (404, FileNotFoundError, "no such object"),
])
def test_refused_or_missing_object_is_one_error_before_loading(cloud, tmp_path, status, error, words):
    upload(cloud.put, "e", moe(), tmp_path)
    url = cloud.url("e/model.safetensors")
    cloud.proxy.fail(status, n=100)
    fds = _fds()
    with pytest.raises(error, match=words) as e:
        load_file(url, "cpu", storage_options=cloud.storage_options())
    assert url in str(e.value)
    assert not any(s in str(e.value) for s in secrets(cloud))
    assert _settled(_threads(), fds), (_fds() - fds)
    cloud.proxy.clear_faults()


def test_missing_object_and_empty_prefix(cloud):
    opts = cloud.storage_options()
    with pytest.raises(FileNotFoundError, match="no such object"):
        load_file(cloud.url("none.safetensors"), storage_options=opts)
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors\.index\.json"):
        load_file(cloud.url("empty/"), storage_options=opts)


# -- credentials: each form a server can check --------------------------------------------

@pytest.mark.parametrize("cloud", ["az"], indirect=True)
def test_azure_account_key_and_sas(cloud, tmp_path, monkeypatch):
    """The Azure server checks Shared Key signatures and service SAS
    tokens: the account key (storage_options or AZURE_STORAGE_ACCOUNT_KEY)
    and a SAS (sas_key, or AZURE_STORAGE_SAS_KEY) load; a wrong key, an
    expired SAS, a SAS without read permission, and none at all are
    PermissionError, naming the URL and showing no key or signature."""
    import datetime

    from support.cloud_servers import AZURE_ACCOUNT, azure_sas
    local = upload(cloud.put, "k", moe(), tmp_path)
    want = load_file(local)
    url = cloud.url("k/")
    server = cloud.server
    base = {"account_name": AZURE_ACCOUNT, "endpoint": f"{cloud.proxy.url}/{AZURE_ACCOUNT}",
            "client_options": {"allow_http": True}}

    def auth_of_last(n):
        return set(server.auth[-n:])

    n = len(server.auth)
    same(load_file(url, storage_options={**base, "access_key": AZURE_KEY}), want)
    assert auth_of_last(len(server.auth) - n) == {"SharedKey"}

    sas = azure_sas(cloud.bucket)
    n = len(server.auth)
    same(load_file(url, storage_options={**base, "sas_key": sas}), want)
    assert auth_of_last(len(server.auth) - n) == {"SAS"}

    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", AZURE_ACCOUNT)
    monkeypatch.setenv("AZURE_STORAGE_SAS_KEY", sas)
    n = len(server.auth)
    same(load_file(url, storage_options={"endpoint": base["endpoint"],
                                         "client_options": {"allow_http": True}}), want)
    assert auth_of_last(len(server.auth) - n) == {"SAS"}
    monkeypatch.delenv("AZURE_STORAGE_SAS_KEY")

    other_key = "A" * 86 + "=="
    expired = azure_sas(cloud.bucket, expiry=datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc))
    write_only = azure_sas(cloud.bucket, permissions="w")
    for bad, shown in [({"access_key": other_key}, other_key[:20]),
                       ({"sas_key": expired}, expired.split("sig=")[1][:12]),
                       ({"sas_key": write_only}, write_only.split("sig=")[1][:12]),
                       ({"skip_signature": "true"}, None)]:
        fds = _fds()
        with pytest.raises(PermissionError, match="access denied") as e:
            load_file(cloud.url("k/model.safetensors"), storage_options={**base, **bad})
        assert cloud.url("k/model.safetensors") in str(e.value)
        assert shown is None or shown not in str(e.value), bad
        assert AZURE_KEY[:20] not in str(e.value)
        assert _settled(_threads(), fds)


@pytest.mark.parametrize("cloud", ["gs"], indirect=True)
def test_gcs_service_account_file(cloud, tmp_path, monkeypatch):
    """A service-account file, by storage_options (service_account_path)
    or by GOOGLE_SERVICE_ACCOUNT (the environment test above): its
    gcs_base_url reaches the server.  fake-gcs-server checks no token,
    so what the file signs is not tested (docs/object-storage-emulators.md)."""
    local = upload(cloud.put, "sa", moe(), tmp_path)
    cloud.proxy.reset_counts()
    same(load_file(cloud.url("sa/"), storage_options={"service_account_path": cloud.sa_path}),
         load_file(local))
    assert cloud.proxy.requests
    with pytest.raises((ValueError, OSError)):
        load_file(cloud.url("sa/"), storage_options={"service_account_path": str(tmp_path / "none.json")})


def test_gcs_server_exits_with_its_parent():
    """fake-gcs-server (a Go binary, which watches no pipe) is killed when
    the process that started it dies, not only on stop()."""
    import subprocess
    import sys

    from support import TESTS
    from support.cloud_servers import require_gcs
    require_gcs()
    script = ("import os, sys; sys.path.insert(0, sys.argv[1]); import support.cloud_servers as c; "
              "s = c.GCSServer().start(); print(s.pid, flush=True); os.kill(os.getpid(), 9)")
    out = subprocess.run([sys.executable, "-c", script, TESTS], capture_output=True, text=True, timeout=60)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"fake-gcs-server (pid {pid}) outlived its parent")
