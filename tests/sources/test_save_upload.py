"""save_file to a bucket: one multipart upload, on each cloud's server
that takes uploads (moto's S3, the Azure Blob server of
support/cloud_servers.py; not fake-gcs-server), behind a FaultProxy.  The object equals
``save()``'s bytes (parts from CPU memory as it lies, and through staging
slots); a failure part-way (the server refusing a part, an error while the
bytes are made) leaves no object, or the old one, and no upload behind."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("obstore")

import instant_staging as ist
from instant_staging.loader import _save, _upload, load_file, save, save_file, save_model
from instant_staging.testing import SimulatedRuntime

from support.cloud_servers import (  # noqa: F401 (the *_fixture: fixtures, found by their names)
    azure_server_fixture,
    cloud_fixture,
    gcs_server_fixture,
)
from support.remote_servers import s3_server_fixture  # noqa: F401

PART = 5 << 20      # S3's smallest part (all but the last)


def tensors():
    """12 MiB and then some: three parts of PART, small tensors packed."""
    g = torch.Generator().manual_seed(7)
    out = {"big": torch.randn(3 << 20, generator=g),
           "half": torch.randn(1000, 7, generator=g).to(torch.bfloat16),
           "ids": torch.arange(777, dtype=torch.int64),
           "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5)}
    out.update({f"small.{i}": torch.full((5,), i, dtype=torch.int16) for i in range(20)})
    return out


def read(cloud, key):
    import obstore
    return bytes(obstore.get(cloud.store(), key).bytes())


def exists(cloud, key):
    import obstore
    return any(o["path"] == key for batch in obstore.list(cloud.store()) for o in batch)


def writable(cloud):
    if cloud.scheme == "gs":
        pytest.skip("fake-gcs-server answers obstore's XML API uploads (PUT, POST ?uploads) "
                    "400 'invalid uploadType' (docs/object-storage-emulators.md)")


def staging(parts):
    return ist.StagingBuffer(parts * PART, runtime=SimulatedRuntime())


def test_one_part_is_one_put(cloud):
    """An object of one part or less: one PUT."""
    writable(cloud)
    t = {"w": torch.randn(50, 20), "ids": torch.arange(9), "e": torch.zeros(0)}
    save_file(t, cloud.url("small.safetensors"), {"format": "pt"},
              storage_options=cloud.storage_options())
    assert read(cloud, "small.safetensors") == save(t, {"format": "pt"})
    puts = [s for s in cloud.proxy.requests if s.method in ("PUT", "POST")]
    assert len(puts) == 1


def test_upload_equals_save(cloud):
    writable(cloud)
    t = tensors()
    url = cloud.url("ckpt/model.safetensors")
    save_file(t, url, {"format": "pt"}, storage_options=cloud.storage_options())
    assert read(cloud, "ckpt/model.safetensors") == save(t, {"format": "pt"})
    got = load_file(url, storage_options=cloud.storage_options())
    assert all(torch.equal(got[k], t[k]) for k in t)


def test_upload_in_parts_through_staging(cloud):
    """Parts of 5 MiB; every byte through 6 staging slots (the stage_cpu
    path a device tensor takes), with digests in the header."""
    writable(cloud)
    t = tensors()
    plan = _save.make_plan(t, None, version="v1", digests=True)
    buf = staging(6)
    try:
        _upload.upload(plan, cloud.url("m"), storage_options=cloud.storage_options(),
                       staging=buf, part=PART, stage_cpu=True)
    finally:
        buf.close()        # refuses while a slot's view is held
    assert read(cloud, "m") == save(t, version="v1", digests=True)
    if cloud.scheme == "s3":
        parts = [s for s in cloud.proxy.requests if s.method == "PUT" and "partNumber=" in s.path]
        assert len(parts) == 3


def test_refused_part_leaves_the_old_object(cloud):
    writable(cloud)
    old = save({"x": torch.ones(3)})
    cloud.put("m", old)
    path = {"s3": "partNumber=2", "gs": "partNumber=2", "az": "comp=block&"}[cloud.scheme]
    cloud.proxy.fail(500, n=100, method="PUT", path=path)
    with pytest.raises(OSError, match="nothing was published"):
        save_file(tensors(), cloud.url("m"), storage_options=cloud.storage_options(max_retries=1))
    assert read(cloud, "m") == old
    if cloud.scheme == "s3":
        assert not cloud.server.client.list_multipart_uploads(Bucket=cloud.bucket).get("Uploads")
        assert any(s.method == "DELETE" and "uploadId=" in s.path for s in cloud.proxy.requests)


def test_error_while_producing_leaves_no_object(cloud, monkeypatch):
    """An error here after two parts went: raised as it was, the upload
    aborted, no object; the staging slots all came back."""
    writable(cloud)
    t = tensors()
    plan = _save.make_plan(t, None)
    buf = staging(6)
    real = _upload._Stream._hand
    calls = []

    def hand(self, *a):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("copy failed")
        return real(self, *a)
    monkeypatch.setattr(_upload._Stream, "_hand", hand)
    try:
        with pytest.raises(RuntimeError, match="copy failed"):
            _upload.upload(plan, cloud.url("gone"), storage_options=cloud.storage_options(),
                           staging=buf, part=PART, stage_cpu=True)
    finally:
        buf.close()
    assert not exists(cloud, "gone")
    if cloud.scheme == "s3":
        assert not cloud.server.client.list_multipart_uploads(Bucket=cloud.bucket).get("Uploads")


def test_save_model_to_a_bucket(cloud):
    """Shards, then the index; on S3 also an earlier save's stale shard
    removed and other files left (obstore deletes on Azure with a batch
    call, which the Azure server here does not serve)."""
    writable(cloud)
    t = tensors()
    opts = cloud.storage_options()
    prefix = cloud.url("run/step-1")
    stale = cloud.scheme == "s3"
    if stale:
        cloud.put("run/step-1/model-00001-of-00005.safetensors", b"stale")
        cloud.put("run/step-1/notes.txt", b"kept")
    files = save_model(t, prefix, max_shard_size="6MB", storage_options=opts,
                       is_main_process=stale)
    assert len(files) == 2
    assert exists(cloud, "run/step-1/model.safetensors.index.json")
    if stale:
        assert not exists(cloud, "run/step-1/model-00001-of-00005.safetensors")
        assert exists(cloud, "run/step-1/notes.txt")
    got = load_file(prefix + "/model.safetensors.index.json", storage_options=opts)
    assert sorted(got) == sorted(t) and all(torch.equal(got[k], t[k]) for k in t)


def test_refused_urls(tmp_path):
    with pytest.raises(ValueError, match="read-only"):
        save_file({"x": torch.ones(1)}, "https://example.com/m.safetensors")
    with pytest.raises(ValueError, match="no object name"):
        save_file({"x": torch.ones(1)}, "s3://bucket/dir/")
