"""Offline mode (``INSTANT_STAGING_OFFLINE=1``, or huggingface_hub's
``HF_HUB_OFFLINE=1``): a URL source's objects served from the cache's
entries without asking the server (no request, no client made), a miss an
error naming the object; against moto's S3 server behind the fault proxy,
which counts every request (``support/remote_servers.py``)."""

import logging
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("obstore")
pytest.importorskip("safetensors.torch")

from instant_staging.loader import (
    Checkpoint,
    _cache,
    _schemes,
    iter_load,
    load_file,
    safe_open,
    wait_for_cache_fills,
)

from support.remote_checkpoints import put_in, same, shards, upload
from support.remote_servers import (  # noqa: F401
    fault_proxy_fixture,
    s3_bucket_fixture,
    s3_server_fixture,
)
from support.remote_servers import storage_options as options


@pytest.fixture
def online(monkeypatch):
    for name in ("INSTANT_STAGING_OFFLINE", "HF_HUB_OFFLINE", "INSTANT_STAGING_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _no_client(monkeypatch):
    """Makes any store the loader would make an error: offline makes none."""
    def refuse(*args, **kwargs):
        raise AssertionError("a store was made in offline mode")
    monkeypatch.setattr(_schemes.Stores, "_make", refuse)


def _filled(s3_server, s3_bucket, tmp_path, proxy, prefix, files, index=True):
    local = upload(put_in(s3_server, s3_bucket), prefix, files, tmp_path, index=index)
    url, cache = f"s3://{s3_bucket}/{prefix}/", tmp_path / "cache"
    load_file(url, storage_options=options(proxy.url), cache_dir=cache)
    assert wait_for_cache_fills(timeout=30)
    return local, url, cache


@pytest.mark.parametrize("env", [("INSTANT_STAGING_OFFLINE", "1"), ("HF_HUB_OFFLINE", "1"),
                                 ("HF_HUB_OFFLINE", "true")])
@pytest.mark.parametrize("index", [True, False], ids=["index", "listing"])
def test_offline_hit_asks_nothing(s3_server, s3_bucket, tmp_path, fault_proxy, online, env, index):
    files = shards(1)
    local, url, cache = _filled(s3_server, s3_bucket, tmp_path, fault_proxy, "m", files, index)
    want = load_file(local)
    fault_proxy.reset_counts()
    online.setenv(*env)
    _no_client(online)
    opts = options(fault_proxy.url)
    same(load_file(url, storage_options=opts, cache_dir=cache), want)
    with Checkpoint.open(url, storage_options=opts, cache_dir=cache) as ck:
        assert type(ck._shards).__name__ == "CachedShards"
        assert ck.files == [f"{url}{f}" for f, _ in files]
        same(ck.load("cpu", verify=True), want)     # (against the fill's digest: no server)
        assert (ck.last_report.cache_hit_bytes, ck.last_report.fetched_bytes) == (
            sum(t.nbytes for _, ts in files for t in ts.values()), 0)
    one = f"{url}{files[0][0]}"
    same(load_file([one], storage_options=opts, cache_dir=cache), load_file(local / files[0][0]))
    with safe_open(one, storage_options=opts, cache_dir=cache) as f:
        same({n: f.get_tensor(n) for n in f.keys()}, load_file(local / files[0][0]))  # noqa: SIM118
    with iter_load(url, storage_options=opts, cache_dir=cache) as it:
        same(dict(it), want)
    assert fault_proxy.requests == []


def test_offline_miss_names_the_object_and_asks_nothing(s3_server, s3_bucket, tmp_path, fault_proxy,
                                                       online):
    files = shards(2)
    local, url, cache = _filled(s3_server, s3_bucket, tmp_path, fault_proxy, "m", files)
    upload(put_in(s3_server, s3_bucket), "other", shards(3), tmp_path)
    fault_proxy.reset_counts()
    online.setenv("INSTANT_STAGING_OFFLINE", "1")
    _no_client(online)
    opts = options(fault_proxy.url)
    missing = f"s3://{s3_bucket}/other/model-00001-of-00002.safetensors"
    with pytest.raises(FileNotFoundError, match=r"other/model-00001-of-00002\.safetensors: offline "
                       r"mode is on \(INSTANT_STAGING_OFFLINE=1\).*holds no entry"):
        load_file(missing, storage_options=opts, cache_dir=cache)
    # one object of two cached: the other's miss, before anything is loaded
    with pytest.raises(FileNotFoundError, match=r"other/model-00001-of-00002\.safetensors"):
        load_file([f"{url}{files[0][0]}", missing], storage_options=opts, cache_dir=cache)
    # a directory never loaded online: nothing says which objects it holds
    with pytest.raises(FileNotFoundError, match=r"other/ \(a directory: its list of objects\)"):
        load_file(f"s3://{s3_bucket}/other/", storage_options=opts, cache_dir=cache)
    # no cache at all
    with pytest.raises(FileNotFoundError, match=r"offline mode is on .*no cache is set"):
        load_file(url, storage_options=opts)
    # a URL's secret is never shown
    with pytest.raises(FileNotFoundError) as raised:
        load_file("https://user:hunter2@example.invalid/m.safetensors", cache_dir=cache)
    assert "hunter2" not in str(raised.value)
    assert fault_proxy.requests == []
    # INSTANT_STAGING_OFFLINE=0 wins over HF_HUB_OFFLINE=1: online again (the server asked)
    online.undo()
    online.setenv("HF_HUB_OFFLINE", "1")
    online.setenv("INSTANT_STAGING_OFFLINE", "0")
    same(load_file(url, storage_options=opts, cache_dir=cache), load_file(local))
    assert fault_proxy.requests


def test_offline_a_damaged_entry_is_removed_and_a_miss(s3_server, s3_bucket, tmp_path, fault_proxy,
                                                      online, caplog):
    files = shards(4, count=1)
    _, url, cache = _filled(s3_server, s3_bucket, tmp_path, fault_proxy, "d", files)
    (entry,) = [n for n in os.listdir(cache) if n.endswith(".safetensors")]
    with open(cache / entry, "r+b") as f:
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 0xFF]))
    online.setenv("INSTANT_STAGING_OFFLINE", "1")
    fault_proxy.reset_counts()
    with caplog.at_level(logging.WARNING, logger="instant_staging"), \
            pytest.raises(FileNotFoundError, match="offline mode is on"):
        load_file(url, storage_options=options(fault_proxy.url), cache_dir=cache)
    assert any("is damaged" in r.getMessage() for r in caplog.records)
    assert not os.path.exists(cache / entry) and fault_proxy.requests == []


def test_offline_takes_the_newest_entry_of_an_object(s3_server, s3_bucket, tmp_path, fault_proxy,
                                                    online):
    old, new = shards(5, count=1), shards(6, count=1)
    _, url, cache = _filled(s3_server, s3_bucket, tmp_path, fault_proxy, "v", old)
    (first,) = [n for n in os.listdir(cache) if n.endswith(".safetensors")]
    kept = (cache / first).read_bytes()
    local = upload(put_in(s3_server, s3_bucket), "v", new, tmp_path / "new")
    load_file(url, storage_options=options(fault_proxy.url), cache_dir=cache)
    assert wait_for_cache_fills(timeout=30)
    # the old version's entry back beside the new one (a crash before the finisher removed it),
    # older by its time
    (cache / first).write_bytes(kept)
    os.utime(cache / first, ns=(1, 1))
    assert len([n for n in os.listdir(cache) if n.endswith(".safetensors")]) == 2
    online.setenv("INSTANT_STAGING_OFFLINE", "1")
    same(load_file(url, storage_options=options(fault_proxy.url), cache_dir=cache),
         load_file(local))


def test_offline_value_is_checked(online):
    online.setenv("INSTANT_STAGING_OFFLINE", "maybe")
    with pytest.raises(ValueError, match="INSTANT_STAGING_OFFLINE"):
        _cache.offline()
    online.setenv("INSTANT_STAGING_OFFLINE", "")
    online.setenv("HF_HUB_OFFLINE", "maybe")       # (huggingface_hub reads it as off)
    assert _cache.offline() is None
    online.setenv("HF_HUB_OFFLINE", "YES")
    assert _cache.offline() == "HF_HUB_OFFLINE"


def test_a_directory_is_recorded_only_once_each_object_is_an_entry(s3_server, s3_bucket, tmp_path,
                                                                   fault_proxy, online):
    files = shards(7)
    local = upload(put_in(s3_server, s3_bucket), "r", files, tmp_path)
    url, cache = f"s3://{s3_bucket}/r/", tmp_path / "cache"
    opts = options(fault_proxy.url)
    load_file(url, storage_options=opts, cache_dir=cache, names=list(files[0][1]))
    assert wait_for_cache_fills(timeout=30)
    assert not [n for n in os.listdir(cache) if n.endswith(_cache.RECORD_SUFFIX)]
    online.setenv("INSTANT_STAGING_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"r/ \(a directory: its list of objects\)"):
        load_file(url, storage_options=opts, cache_dir=cache)
    online.delenv("INSTANT_STAGING_OFFLINE")
    load_file(url, storage_options=opts, cache_dir=cache)
    assert wait_for_cache_fills(timeout=30)
    (record,) = [n for n in os.listdir(cache) if n.endswith(_cache.RECORD_SUFFIX)]
    assert s3_bucket not in (cache / record).read_text()       # names relative to it only
    online.setenv("INSTANT_STAGING_OFFLINE", "1")
    same(load_file(url, storage_options=opts, cache_dir=cache), load_file(local))
