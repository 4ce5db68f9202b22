"""A node loads a URL checkpoint once: ``process_group=`` with an s3://
source, 2 and 4 real ranks (gloo, tests/loader/_url_group_worker.py),
moto's server behind a FaultProxy that counts every body byte it relays.
The ranks together fetch 1.0-1.05x of the object's bytes (each rank's open
asks for the object's first HEADER_PREFETCH bytes and its header once
more; the data once, by one rank each), and every rank's tensors equal
safetensors' own.  An object replaced between the ranks' opens (a
versioned bucket: each rank's GETs would get its own version) is an error
on every rank before any data is fetched."""

import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")
dist = pytest.importorskip("torch.distributed")
pytest.importorskip("obstore")

from instant_staging.loader import _remote

from support.ranks import free_port, rank_env, run_ranks
from support.remote_servers import (  # noqa: F401 (the *_fixture: fixtures, found by their names)
    ACCESS_KEY,
    REGION,
    SECRET_KEY,
    FaultProxy,
    s3_server_fixture,
)

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_url_group_worker.py")
TESTS = os.path.dirname(os.path.dirname(WORKER))
# 32 MiB a rank: the opens' header GETs (HEADER_PREFETCH, 1 MiB, per rank)
# are ~3% of it; 1 MiB tensors, so that the shares cut between them.
MIB_PER_RANK, ROWS, COLS = 32, 512, 1024          # a tensor: 1 MiB of float16


def _options(endpoint):
    return {"endpoint": endpoint, "access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY,
            "region": REGION, "client_options": {"allow_http": True}}


def run_world(tmp, world, proxy, scenarios):
    spec = dict(world=world, port=free_port(), out=str(tmp), options=_options(proxy.url), scenarios=scenarios)
    spec_path = os.path.join(tmp, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    run_ranks(lambda r: [sys.executable, WORKER, spec_path, str(r)], world,
              rank_env(INSTANT_STAGING_DIST_TIMEOUT="30"), cwd=tmp)
    out = []
    for r in range(world):
        with open(os.path.join(tmp, f"rank{r}.json")) as f:
            out.append({rec["name"]: rec for rec in json.load(f)})
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_a_group_fetches_each_byte_once(s3_server, tmp_path, world):
    g = torch.Generator().manual_seed(world)
    tensors = {f"layers.{i}.w": torch.randint(0, 1 << 15, (ROWS, COLS), dtype=torch.int16, generator=g)
               .view(torch.float16) for i in range(MIB_PER_RANK * world)}
    local = tmp_path / "model.safetensors"
    st.save_file(tensors, str(local))
    del tensors
    raw = local.read_bytes()
    bucket = s3_server.create_bucket(f"group-{world}")
    s3_server.put(bucket, "m/model.safetensors", raw)

    # The versioned object: rank 0 opens v1, the others (1.5 s later) v2.
    vbucket = s3_server.create_bucket(f"group-v-{world}")
    s3_server.client.put_bucket_versioning(Bucket=vbucket, VersioningConfiguration={"Status": "Enabled"})
    small = tmp_path / "v.safetensors"
    st.save_file({"a": torch.arange(4096, dtype=torch.float32), "b": torch.ones(4096)}, str(small))
    v1 = small.read_bytes()
    v2 = v1[:-1] + bytes([v1[-1] ^ 1])          # the same header, one data byte other
    s3_server.put(vbucket, "v.safetensors", v1)
    opens = []

    def replace_after_the_first_open(seen):
        opens.append(seen)
        if len(opens) == 2:
            s3_server.put(vbucket, "v.safetensors", v2)

    with FaultProxy(s3_server.url) as proxy:
        proxy.hook(replace_after_the_first_open, 2, method="GET", path=f"/{vbucket}/v.safetensors")
        ranks = run_world(tmp_path, world, proxy, [
            {"name": "shared", "url": f"s3://{bucket}/m/", "local": str(local)},
            {"name": "replaced", "url": f"s3://{vbucket}/v.safetensors", "local": str(small),
             "delay_others": 1.5}])
        fetched = proxy.bytes_by_path[f"/{bucket}/m/model.safetensors"]

    shared = [r["shared"] for r in ranks]
    assert all(s["ok"] and s["equal"] for s in shared), shared
    header = 8 + int.from_bytes(raw[:8], "little")
    data = len(raw) - header
    assert sum(s["read_bytes"] for s in shared) == data                 # the shares: each byte once
    assert all(abs(s["read_bytes"] - data / world) <= (1 << 20) + data / world / 8 for s in shared)
    overhead = world * min(len(raw), _remote.HEADER_PREFETCH) + 2 * world * header
    assert len(raw) <= fetched <= len(raw) + overhead
    assert fetched <= 1.05 * len(raw), (fetched, len(raw))
    print(f"{world} ranks fetched {fetched / len(raw):.4f}x of the object's {len(raw)} bytes")

    replaced = [r["replaced"] for r in ranks]
    assert len(opens) >= 2
    for rec in replaced:
        assert not rec["ok"] and rec["error"] == "DistributedLoadError", rec
        assert "replaced between the opens" in rec["message"], rec
