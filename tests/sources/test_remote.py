"""Object-storage sources against a real S3 server (moto's, on 127.0.0.1),
a fault-injecting proxy in front of it, and a plain ranged-GET HTTP server
(``support/remote_servers.py``): every source form, bit for bit against the same
files on disk, and each way the network misbehaves, with its outcome and
what is left afterwards (descriptors, threads, sockets)."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("obstore")
safetensors_torch = pytest.importorskip("safetensors.torch")

from instant_staging.loader import (
    Checkpoint,
    LoadError,
    RemoteChangedError,
    SafetensorsError,
    iter_load,
    load_file,
    safe_open,
)

from support import TESTS, child_env
from support.remote_checkpoints import fds as _fds
from support.remote_checkpoints import put_in, same, upload
from support.remote_checkpoints import random_tensor as _random
from support.remote_checkpoints import settled as _settled
from support.remote_checkpoints import threads as _threads
from support.remote_servers import (  # noqa: F401
    REGION,
    SECRET_KEY,
    fast_retry_config,
    fault_proxy_fixture,
    range_http_server_fixture,
    s3_bucket_fixture,
    s3_env,
    s3_server_fixture,
)
from support.remote_servers import storage_options as options


def layouts():
    """The benchmark layouts at small scale: {name: [(file name, {tensor: t})]}."""
    g = torch.Generator().manual_seed(1)
    bf, f32 = torch.bfloat16, torch.float32
    dense = {f"model.layers.{i}.{p}": _random(s, bf, g) for i in range(4)
             for p, s in (("q.weight", (64, 64)), ("mlp.up.weight", (160, 64)), ("norm.weight", (64,)))}
    dense["lm_head.weight"] = _random((300, 64), bf, g)
    moe = {f"layers.{i}.experts.{e}.{w}": _random((8, 16), bf, g) for i in range(2) for e in range(40)
           for w in ("gate", "up", "down")}
    fp8 = {}
    for i in range(6):
        fp8[f"l{i}.weight"] = _random((96, 80), torch.float8_e4m3fn, g)
        fp8[f"l{i}.weight_scale_inv"] = _random((1, 1), f32, g)
        fp8[f"l{i}.odd"] = _random((13,), torch.uint8, g)
    awq = {}
    for i in range(4):
        awq[f"l{i}.qweight"] = _random((64, 8), torch.int32, g)
        awq[f"l{i}.qzeros"] = _random((1, 8), torch.int32, g)
        awq[f"l{i}.scales"] = _random((1, 64), torch.float16, g)
    mixed = {"a.f64": _random((3, 5), torch.float64, g), "b.i8": _random((7,), torch.int8, g),
             "c.bool": torch.tensor([True, False, True]), "d.f16": _random((11,), torch.float16, g),
             "e.empty": torch.zeros((0, 3)), "f.scalar": torch.tensor(2.5),
             "g.u8": _random((1,), torch.uint8, g)}
    names = sorted(dense)
    return {"dense": [("model-00001-of-00002.safetensors", {n: dense[n] for n in names[:7]}),
                      ("model-00002-of-00002.safetensors", {n: dense[n] for n in names[7:]})],
            "moe": [("model.safetensors", moe)],
            "fp8": [("model.safetensors", fp8)],
            "awq": [("model-00001-of-00002.safetensors", dict(list(awq.items())[:6])),
                    ("model-00002-of-00002.safetensors", dict(list(awq.items())[6:]))],
            "mixed": [("model.safetensors", mixed)]}


# -- every layout and every source form, bit for bit ------------------------------------

@pytest.mark.parametrize("layout", ["dense", "moe", "fp8", "awq", "mixed"])
def test_layout_from_s3_equals_disk(s3_server, s3_bucket, tmp_path, layout):
    files = layouts()[layout]
    local = upload(put_in(s3_server, s3_bucket), layout, files, tmp_path)
    want = load_file(local)
    got = load_file(f"s3://{s3_bucket}/{layout}/", storage_options=options(s3_server.url),
                    chunk_size=4096)               # many chunks: every range path
    same(got, want)
    for _, tensors in files:                       # and equal to safetensors' own
        for name, t in tensors.items():
            assert torch.equal(got[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def test_every_s3_source_form(s3_server, s3_bucket, tmp_path):
    files = layouts()["dense"]
    local = upload(put_in(s3_server, s3_bucket), "m", files, tmp_path)
    upload(put_in(s3_server, s3_bucket), "noindex", files, tmp_path / "x", index=False)
    want = load_file(local)
    base = f"s3://{s3_bucket}"
    opts = options(s3_server.url)
    urls = [f"{base}/m/{f}" for f, _ in files]
    for source in (f"{base}/m/", f"{base}/m", f"{base}/m/model.safetensors.index.json", urls,
                   f"{base}/noindex/"):
        with Checkpoint.open(source, storage_options=opts) as ck:
            assert ck.files == urls if "noindex" not in str(source) else \
                [u.replace("/m/", "/noindex/") for u in urls]
            same(ck.load("cpu"), want)
    one = load_file(urls[0], storage_options=opts)
    same(one, load_file(str(local / files[0][0])))


def test_credentials_and_endpoint_from_the_environment(s3_server, s3_bucket, tmp_path, monkeypatch):
    """No storage_options: the client's standard chain (AWS_* variables,
    AWS_ENDPOINT_URL for an S3-compatible server) finds everything."""
    local = upload(put_in(s3_server, s3_bucket), "env", layouts()["mixed"], tmp_path)
    for k, v in s3_env(s3_server.url).items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ALLOW_HTTP")          # an http:// endpoint is allowed by itself
    same(load_file(f"s3://{s3_bucket}/env/"), load_file(local))


def test_no_credentials_is_said_so(s3_server, s3_bucket, tmp_path, monkeypatch):
    # Without credentials the client asks the instance metadata service
    # last; where that gives none, the error says which variables were
    # missing and how a public bucket is read, not just the metadata
    # request that failed.  The advice works: skip_signature reads the
    # bucket (moto serves anyone).
    import socket
    local = upload(put_in(s3_server, s3_bucket), "nc", layouts()["dense"], tmp_path)
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]          # nothing listens there once closed
    bare = {"endpoint": s3_server.url, "region": REGION, "retry_config": fast_retry_config(max_retries=1),
            "metadata_endpoint": f"http://127.0.0.1:{closed}"}
    with pytest.raises(PermissionError, match="no credentials") as err:
        load_file(f"s3://{s3_bucket}/nc/", storage_options=bare)
    assert "AWS_ACCESS_KEY_ID" in str(err.value) and "skip_signature" in str(err.value)
    policy = {"Version": "2012-10-17", "Statement": [{
        "Effect": "Allow", "Principal": "*", "Action": "s3:GetObject",
        "Resource": f"arn:aws:s3:::{s3_bucket}/*"}]}
    s3_server.client.put_bucket_policy(Bucket=s3_bucket, Policy=json.dumps(policy))    # public
    same(load_file(f"s3://{s3_bucket}/nc/model.safetensors.index.json",
                   storage_options={**bare, "skip_signature": True}), load_file(local))


def test_inspect_fetches_headers_only(s3_server, s3_bucket, tmp_path, fault_proxy):
    files = layouts()["dense"]
    upload(put_in(s3_server, s3_bucket), "h", files, tmp_path)
    fault_proxy.reset_counts()
    with Checkpoint.open(f"s3://{s3_bucket}/h/", storage_options=options(fault_proxy.url)) as ck:
        names, nbytes = ck.names(), ck.nbytes
        seen = list(fault_proxy.requests)
    assert sorted(names) == sorted(n for _, t in files for n in t)
    assert nbytes == sum(t.numel() * t.element_size() for _, ts in files for t in ts.values())
    # a listing, the index, and per shard one GET of the header, which
    # also gives its size and ETag: no HEAD
    gets = [r for r in seen if r[0] == "GET" and r[2]]
    assert len(gets) == len(files) and all(r[2].startswith("bytes=0-") for r in gets)
    assert not [r for r in seen if r[0] == "HEAD"]


def _four_shards():
    """The dense layout in four shards (its tensors, in order)."""
    (_, a), (_, b) = layouts()["dense"]
    tensors = list({**a, **b}.items())
    return [(f"model-{k + 1:05d}-of-00004.safetensors", dict(tensors[k::4])) for k in range(4)]


def test_open_asks_every_object_at_once(s3_server, s3_bucket, tmp_path, fault_proxy):
    # A start of round trips: the header GETs must be in flight together.
    # Each waits at the proxy until all are there (a barrier, not a clock):
    # one after the other, the first would wait alone and break it.
    files = _four_shards()
    local = upload(put_in(s3_server, s3_bucket), "together", files, tmp_path)
    barrier, broken = threading.Barrier(len(files)), []

    def together(seen):
        try:
            barrier.wait(timeout=15)
        except threading.BrokenBarrierError:
            broken.append(seen)
    fault_proxy.hook(together, n=len(files), method="GET", ranged=True)
    with Checkpoint.open(f"s3://{s3_bucket}/together/",
                         storage_options=options(fault_proxy.url)) as ck:
        got = ck.load("cpu")
    assert not broken
    same(got, load_file(str(local)))
    assert not [t for t in threading.enumerate() if t.name.startswith("instant_staging-open")]


def test_open_names_the_first_missing_object_and_leaves_no_thread(s3_server, s3_bucket, tmp_path,
                                                                   fault_proxy):
    files = _four_shards()
    upload(put_in(s3_server, s3_bucket), "gone", files, tmp_path)
    for fname, _ in files[1:3]:
        s3_server.delete(s3_bucket, f"gone/{fname}")
    with pytest.raises(FileNotFoundError, match=files[1][0]):
        Checkpoint.open(f"s3://{s3_bucket}/gone/", storage_options=options(fault_proxy.url))
    assert not [t for t in threading.enumerate() if t.name.startswith("instant_staging-open")]


@pytest.mark.parametrize("fault", ["503", "cut short"])
def test_a_header_get_that_fails_is_asked_again(s3_server, s3_bucket, tmp_path, fault_proxy, fault):
    # Past the client's own retries (503), or a body cut short: the HEAD
    # and a GET with If-Match, as before the first GET carried the size.
    files = _four_shards()
    local = upload(put_in(s3_server, s3_bucket), f"again{fault[:3]}", files, tmp_path)
    if fault == "503":
        fault_proxy.fail(503, n=4, method="GET", path=files[2][0], ranged=True)
    else:
        fault_proxy.truncate(n=1, after_bytes=5, method="GET", path=files[2][0], ranged=True)
    fault_proxy.reset_counts()
    with Checkpoint.open(f"s3://{s3_bucket}/again{fault[:3]}/",
                         storage_options=options(fault_proxy.url)) as ck:
        got = ck.load("cpu")
    same(got, load_file(str(local)))
    if fault == "503":
        heads = [r for r in fault_proxy.requests if r[0] == "HEAD"]
        assert len(heads) == 1 and files[2][0] in heads[0][1]


def test_an_empty_object_is_too_short(s3_server, s3_bucket):
    # Its ranged GET is a 416: the HEAD's size says what is wrong.
    s3_server.put(s3_bucket, "empty/model.safetensors", b"")
    with pytest.raises(SafetensorsError, match="too short"):
        Checkpoint.open(f"s3://{s3_bucket}/empty/model.safetensors",
                        storage_options=options(s3_server.url))


def test_names_fetch_only_their_ranges(s3_server, s3_bucket, tmp_path, fault_proxy):
    files = layouts()["moe"]
    upload(put_in(s3_server, s3_bucket), "sel", files, tmp_path)
    tensors = files[0][1]
    pick = sorted(tensors)[:5]
    with Checkpoint.open(f"s3://{s3_bucket}/sel/", storage_options=options(fault_proxy.url)) as ck:
        fault_proxy.reset_counts()
        got = ck.load("cpu", names=pick, chunk_size=1 << 20)
        ranges = [r[2] for r in fault_proxy.requests if r[0] == "GET"]
    same({n: got[n] for n in sorted(got)}, {n: tensors[n] for n in sorted(pick)})
    fetched = sum(int(b) - int(a) + 1 for a, b in (r.split("=")[1].split("-") for r in ranges))
    assert fetched == sum(tensors[n].numel() * tensors[n].element_size() for n in pick)


def test_https_source_is_plain_ranged_gets(range_http_server, tmp_path):
    files = layouts()["fp8"]
    path = os.path.join(range_http_server.root, "model.safetensors")
    safetensors_torch.save_file(files[0][1], path)
    same(load_file(range_http_server.url_for("model.safetensors")), load_file(path))


def test_a_url_source_through_device_slots(range_http_server):
    # A device load's readers copy each fetched range into a pinned slot,
    # then out of it (_pipeline._fetch_chunk); a CPU load copies from the
    # client's buffer straight into its tensors (_fetch_to_host).  The
    # simulated runtime's device mode takes the first path without a GPU,
    # bit-exact, every registration given back.
    from support.tensors import SimTarget, assert_same, iterator, mixed_tensors, sim_staging
    tensors = mixed_tensors(seed=3)
    safetensors_torch.save_file(tensors, os.path.join(range_http_server.root, "sim.safetensors"))
    rt, buf = sim_staging()
    with Checkpoint.open(range_http_server.url_for("sim.safetensors")) as ck:
        shards = ck._hold()
        target = SimTarget(rt)
        dtypes = [target.check(t, shards.paths[i]) for i, t in shards.entries]
        with iterator(shards, target, dtypes, io_depth=4, threads=3, staging=buf) as it:
            got = dict(it)
        assert it.report.fetched_bytes == it.report.bytes > 0
    assert_same(got, tensors)
    buf.close()
    assert rt.live_registrations == 0


def test_the_requests_are_dealt_to_the_checkpoints_loops(range_http_server, monkeypatch):
    # REMOTE_REQUEST_LOOPS loops at most, each a thread, the requests dealt
    # to them in turn; every one joined when the checkpoint closes.
    from instant_staging.loader import _remote

    def running():
        return [t for t in threading.enumerate() if t.name == "instant_staging-requests"]
    monkeypatch.setattr(_remote, "REMOTE_REQUEST_LOOPS", 3)
    tensors = {"a": torch.arange(1 << 20, dtype=torch.float32), "b": torch.ones(7)}
    safetensors_torch.save_file(tensors, os.path.join(range_http_server.root, "m.safetensors"))
    dealt = []
    start = _remote._Requests._start

    def seen(self):
        loop = start(self)
        dealt.append(id(loop))
        return loop
    monkeypatch.setattr(_remote._Requests, "_start", seen)
    before = len(running())
    with Checkpoint.open(range_http_server.url_for("m.safetensors")) as ck:
        got = ck.load("cpu", chunk_size=256 << 10, threads=4)
        assert len(running()) - before == 3
    assert len(set(dealt)) == 3 and len(dealt) > 10
    assert all(dealt.count(d) >= len(dealt) // 3 for d in set(dealt))   # (in turn)
    same(got, tensors)
    assert len(running()) == before


@pytest.mark.parametrize("status", [302, 307])
def test_https_source_behind_a_redirect(range_http_server, status):
    # The hub's resolve URLs answer with a redirect to a signed CDN URL:
    # every ranged GET follows it, and the report names the URL given, not
    # the signed one.
    import http.server
    files = layouts()["fp8"]
    path = os.path.join(range_http_server.root, "model.safetensors")
    safetensors_torch.save_file(files[0][1], path)
    where = range_http_server.url_for("model.safetensors") + "?X-Amz-Signature=s3cr3t"

    class Redirect(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(status)
            self.send_header("Location", where)
            self.send_header("Content-Length", "0")
            self.end_headers()
        do_HEAD = do_GET

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/model.safetensors"
        with iter_load(url) as it:
            got = dict(it)
        same(got, load_file(path))
        ranged = [r for r in range_http_server.requests if r.range]
        assert ranged and all(r.path.endswith("X-Amz-Signature=s3cr3t") for r in ranged)
        assert "s3cr3t" not in repr(it.report) and "s3cr3t" not in str(it.report)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_safe_open_and_plan_on_a_url(s3_server, s3_bucket, tmp_path):
    files = layouts()["dense"]
    local = upload(put_in(s3_server, s3_bucket), "p", files, tmp_path)
    with Checkpoint.open(f"s3://{s3_bucket}/p/", storage_options=options(s3_server.url)) as ck:
        got = ck.load("cpu", plan={"lm_head.weight": slice(100, 200), "model.layers.0.norm.weight": None})
    want = load_file(local)
    same(got, {"lm_head.weight": want["lm_head.weight"][100:200],
               "model.layers.0.norm.weight": want["model.layers.0.norm.weight"]})


def test_verify_rereads_the_object(s3_server, s3_bucket, tmp_path):
    local = upload(put_in(s3_server, s3_bucket), "v", layouts()["awq"], tmp_path)
    same(load_file(f"s3://{s3_bucket}/v/", storage_options=options(s3_server.url), verify=True),
         load_file(local))


# -- when the network misbehaves -----------------------------------------------------------

@pytest.mark.parametrize("fault", ["slowdown", "500", "reset", "truncate"])
def test_transient_failures_are_retried(s3_server, s3_bucket, tmp_path, fault_proxy, fault):
    local = upload(put_in(s3_server, s3_bucket), "t", layouts()["moe"], tmp_path)
    want = load_file(local)
    with Checkpoint.open(f"s3://{s3_bucket}/t/", storage_options=options(fault_proxy.url)) as ck:
        if fault == "slowdown":
            fault_proxy.fail(503, n=3, code="SlowDown", method="GET", ranged=True)
        elif fault == "500":
            fault_proxy.fail(500, n=2, code="InternalError", method="GET", ranged=True)
        elif fault == "reset":
            fault_proxy.reset(2, after_bytes=1000, method="GET", ranged=True)
        else:
            fault_proxy.truncate(2, after_bytes=1000, method="GET", ranged=True)
        fault_proxy.reset_counts()
        got = ck.load("cpu", chunk_size=16 << 10)
        assert all(f.remaining == 0 for f in fault_proxy.faults())   # every fault was met
    same(got, want)


def test_a_failure_that_persists_is_one_error_and_leaks_nothing(s3_server, s3_bucket, tmp_path,
                                                                 fault_proxy, monkeypatch):
    from instant_staging.loader import _remote
    monkeypatch.setattr(_remote, "RETRY_SECONDS", 2.0)
    upload(put_in(s3_server, s3_bucket), "bad", layouts()["moe"], tmp_path)
    url = f"s3://{s3_bucket}/bad/"
    fds, threads = _fds(), _threads()
    with Checkpoint.open(url, storage_options=options(fault_proxy.url)) as ck:
        fault_proxy.reset(10_000, after_bytes=100, method="GET", ranged=True)
        with pytest.raises(LoadError, match=r"bad/model\.safetensors.*gave up after") as e:
            ck.load("cpu", chunk_size=64 << 10)
    assert e.value.path == f"{url}model.safetensors"
    assert _settled(threads, fds), (_fds() - fds)
    fault_proxy.clear_faults()


def test_object_replaced_during_the_load(s3_server, s3_bucket, tmp_path):
    files = layouts()["dense"]
    upload(put_in(s3_server, s3_bucket), "r", files, tmp_path)
    url = f"s3://{s3_bucket}/r/{files[1][0]}"
    with Checkpoint.open(f"s3://{s3_bucket}/r/", storage_options=options(s3_server.url)) as ck:
        # a new version of one shard between its header and its data
        changed = {n: t.clone() for n, t in files[1][1].items()}
        first = next(iter(changed))
        changed[first].view(-1).view(torch.uint8)[0] ^= 1
        path = tmp_path / "new.safetensors"
        safetensors_torch.save_file(changed, str(path), metadata={"format": "pt"})
        s3_server.put(s3_bucket, f"r/{files[1][0]}", path.read_bytes())
        with pytest.raises(RemoteChangedError, match="changed while it was loaded") as e:
            ck.load("cpu")
    assert e.value.path == url


@pytest.mark.parametrize("status, code, error, words", [
    (403, "AccessDenied", PermissionError, "access denied"),
    (404, "NoSuchKey", FileNotFoundError, "no such object"),
])
def test_refused_or_missing_object_is_one_error_before_loading(s3_server, s3_bucket, tmp_path,
                                                               fault_proxy, status, code, error, words):
    upload(put_in(s3_server, s3_bucket), "e", layouts()["mixed"], tmp_path)
    url = f"s3://{s3_bucket}/e/model.safetensors"
    fault_proxy.fail(status, n=100, code=code)
    fds = _fds()
    with pytest.raises(error, match=words) as e:
        load_file(url, "cpu", storage_options=options(fault_proxy.url))
    assert url in str(e.value) and SECRET_KEY not in str(e.value)
    assert _settled(_threads(), fds), (_fds() - fds)     # the error keeps no socket alive


def test_missing_objects_and_bad_urls(s3_server, s3_bucket):
    opts = options(s3_server.url)
    with pytest.raises(FileNotFoundError, match="no such object"):
        load_file(f"s3://{s3_bucket}/none.safetensors", storage_options=opts)
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors\.index\.json"):
        load_file(f"s3://{s3_bucket}/empty/", storage_options=opts)
    with pytest.raises(ValueError, match="query"):
        load_file(f"s3://{s3_bucket}/a.safetensors?x-amz-signature=SECRET", storage_options=opts)
    with pytest.raises(TypeError, match="storage_options"):
        load_file(f"s3://{s3_bucket}/a.safetensors", storage_options=["x"])
    with pytest.raises(ValueError, match="storage_options apply to a URL"):
        load_file("model.safetensors", storage_options={})


def test_index_names_stay_inside_the_prefix(s3_server, s3_bucket):
    raw = json.dumps({"weight_map": {"w": "../other/model.safetensors"}}).encode()
    s3_server.put(s3_bucket, "i/model.safetensors.index.json", raw)
    with pytest.raises(SafetensorsError, match=r"'\.\.' component"):
        load_file(f"s3://{s3_bucket}/i/", storage_options=options(s3_server.url))


def test_invalid_header_is_safetensors_error(s3_server, s3_bucket):
    s3_server.put(s3_bucket, "bad.safetensors", (10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(SafetensorsError):
        load_file(f"s3://{s3_bucket}/bad.safetensors", storage_options=options(s3_server.url))


def test_close_mid_load_stops_the_requests(s3_server, s3_bucket, tmp_path, fault_proxy):
    """close() from another thread while GETs are slow: the load ends with
    LoadError (cancelled), no thread, descriptor or connection is left."""
    upload(put_in(s3_server, s3_bucket), "c", layouts()["moe"], tmp_path)
    fds, threads = _fds(), _threads()
    fault_proxy.delay(0.3, n=10_000, method="GET", ranged=True)
    it = iter_load(f"s3://{s3_bucket}/c/", "cpu", storage_options=options(fault_proxy.url),
                   chunk_size=8 << 10, threads=4)
    first = next(it)
    assert first
    timer = threading.Timer(0.2, it.close)
    timer.start()
    with pytest.raises(LoadError, match="cancelled"):
        for _ in it:
            pass
    timer.join()
    del it, first
    assert _settled(threads, fds), (_fds() - fds)
    fault_proxy.clear_faults()


@pytest.mark.parametrize("loops", [None, 4])
def test_ctrl_c_mid_load_in_a_subprocess(s3_server, s3_bucket, tmp_path, loops):
    """A real SIGINT while a reader waits on a GET the proxy holds: the
    signal is sent from the proxy when that GET arrives, so the load is
    mid-way whatever the host's speed (it cannot finish before the signal:
    the held GET never completes).  KeyboardInterrupt, no reader thread
    and no request loop left, and the process exits 0 within seconds (not
    the client's timeout).  With several request loops the signal often
    lands while one of them is being started (the read-ahead's first
    GETs, from the load's own thread): that loop is closed too."""
    upload(put_in(s3_server, s3_bucket), "k", layouts()["moe"], tmp_path)
    code = f"""
import os, signal, sys, threading, time
sys.path.insert(0, {TESTS!r})
signal.signal(signal.SIGINT, signal.default_int_handler)
from support.remote_servers import FaultProxy, fast_retry_config
from instant_staging.loader import load_file
from instant_staging.loader import _remote
if {loops!r} is not None:
    _remote.REMOTE_REQUEST_LOOPS = {loops!r}
release, held = threading.Event(), threading.Event()

def hold(seen):
    if seen.range and not seen.range.startswith("bytes=0-") and not held.is_set():
        held.set()
        os.kill(os.getpid(), signal.SIGINT)     # a reader waits on this GET now
        release.wait(60)

with FaultProxy({s3_server.url!r}) as proxy:
    proxy.hook(hold, n=10_000, method="GET", ranged=True)
    opts = {{"endpoint": proxy.url, "access_key_id": "testing", "secret_access_key": "testing",
            "region": "us-east-1", "retry_config": fast_retry_config()}}
    try:
        load_file("s3://{s3_bucket}/k/", storage_options=opts, chunk_size=8 << 10, threads=4)
        print("not interrupted")
    except KeyboardInterrupt:
        names = [t.name for t in threading.enumerate() if t.name.startswith("instant_staging")]
        print("interrupted", names)
    release.set()
"""
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env=child_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "interrupted []", out.stdout + out.stderr
    assert time.monotonic() - t0 < 30


def test_a_fork_child_of_a_process_that_read_a_bucket_is_told_not_left_hanging(s3_server, s3_bucket,
                                                                               tmp_path):
    """obstore's runtime does not survive fork: a child forked after its
    parent read a bucket would wait forever on its first request.  It gets
    one RuntimeError saying why, at once; a child forked before any client
    was made reads as any process, and so does the parent after the fork."""
    local = upload(put_in(s3_server, s3_bucket), "fork", layouts()["dense"], tmp_path)
    code = f"""
import os, signal, sys, time
from instant_staging.loader import load_file
opts = {{"endpoint": {s3_server.url!r}, "access_key_id": "testing", "secret_access_key": "testing",
         "region": "us-east-1"}}
url = "s3://{s3_bucket}/fork/"

def child():
    signal.alarm(30)                    # (a hang ends the child, not the test run)
    t0 = time.monotonic()
    try:
        got = load_file(url, storage_options=opts)
        os._exit(10 if len(got) == {len(load_file(local))} else 11)
    except RuntimeError as e:
        ok = "forked from pid" in str(e) and "spawn" in str(e) and time.monotonic() - t0 < 5
        os._exit(20 if ok else 21)
    os._exit(12)

def fork():
    pid = os.fork()
    if pid == 0:
        child()
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

print("before", fork())
print("parent", len(load_file(url, storage_options=opts)))
print("after", fork())
print("parent", len(load_file(url, storage_options=opts)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env=child_env())
    n = len(load_file(local))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["before", "10", "parent", str(n), "after", "20", "parent", str(n)], (
        out.stdout + out.stderr[-3000:])



def test_a_fork_child_closes_its_copy_of_an_open_remote_checkpoint(s3_server, s3_bucket, tmp_path):
    """A child forked while its parent holds an open URL Checkpoint (its
    request loop started) closes its copy, with the ``with`` block or at
    exit, without an error: the loop's thread is not in the child, so
    nothing is joined or stopped there, and the child's copies of the
    loop's descriptors are closed without unregistering anything from the
    epoll instance the parent's loop shares: the parent's checkpoint goes
    on loading."""
    local = upload(put_in(s3_server, s3_bucket), "forkclose", layouts()["dense"], tmp_path)
    code = f"""
import gc, os, signal
from instant_staging.loader import Checkpoint
opts = {{"endpoint": {s3_server.url!r}, "access_key_id": "testing", "secret_access_key": "testing",
         "region": "us-east-1"}}

def fds():
    return len(os.listdir("/proc/self/fd"))

with Checkpoint.open("s3://{s3_bucket}/forkclose/", storage_options=opts) as ck:
    n = len(ck.load())
    pid = os.fork()
    if pid == 0:
        signal.alarm(30)
        before = fds()
        try:
            ck.close()
            gc.collect()
        except BaseException as e:
            print("child", type(e).__name__, e, flush=True)
            os._exit(1)
        print("child closed", before > fds(), flush=True)
        os._exit(0)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    print("child exit", code)
    print("parent", len(ck.load()) == n)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env=child_env())
    assert load_file(local)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:3] == ["child closed True", "child exit 0", "parent True"], (
        out.stdout + out.stderr[-3000:])
    assert "Traceback" not in out.stderr and "RuntimeError" not in out.stderr, out.stderr[-3000:]

def test_without_obstore_a_url_names_the_extra(tmp_path):
    code = ("import sys; sys.modules['obstore'] = None\n"
            "from instant_staging.loader import load_file\n"
            "try:\n    load_file('s3://b/k.safetensors')\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path, env=child_env())
    assert "pip install 'instant_staging[remote]'" in out.stdout, out.stderr


def test_gcs_and_azure_urls_reach_their_stores():
    """gs:// and az:// make obstore's GCS and Azure stores with the options
    passed through (no emulator of either is on PyPI: the store is made,
    no request is sent)."""
    from instant_staging.loader._schemes import Stores
    stores = Stores({"skip_signature": True})
    gcs, key = stores.split("gs://bucket/models/llama/model.safetensors")
    assert type(gcs).__name__ == "GCSStore" and key == "models/llama/model.safetensors"
    az, key = Stores({"account_name": "acct", "skip_signature": True}).split("az://container/m/x.safetensors")
    assert type(az).__name__ == "AzureStore" and key == "m/x.safetensors"
    with pytest.raises(ValueError, match="scheme"):
        stores.split("ftp://host/x.safetensors")


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_from_pretrained_from_a_bucket(s3_server, s3_bucket, tmp_path, sharded):
    """A model whose files live in a bucket: config and tokenizer files
    fetched to the cache directory, weights streamed; the same model as
    transformers' own from the same files on disk."""
    transformers = pytest.importorskip("transformers")
    from instant_staging.integrations.transformers import from_pretrained

    from support.models import AUTO, assert_same_model, save
    path, _ = save(tmp_path, "llama", sharded)
    for name in sorted(os.listdir(path)):
        s3_server.put(s3_bucket, f"llama/{name}", (path / name).read_bytes())
    assert transformers
    ours = from_pretrained(f"s3://{s3_bucket}/llama", device="cpu", cache_dir=tmp_path / "cache",
                           storage_options=options(s3_server.url))
    ref = AUTO.from_pretrained(path)
    assert ours.config._name_or_path == f"s3://{s3_bucket}/llama"     # as the user named it
    ref.config._name_or_path = ours.config._name_or_path
    assert_same_model(ours, ref)
    # the config files in a directory of the URL's; the weights, in the
    # cache_dir's own entries beside it (loader/_cache.py), not among them
    cached = os.listdir(next(p for p in (tmp_path / "cache").iterdir() if p.is_dir()))
    assert "config.json" in cached and not any(n.endswith(".safetensors") for n in cached)


def test_safe_open_of_an_object_reads_only_what_is_asked(s3_server, s3_bucket, tmp_path, fault_proxy):
    files = layouts()["moe"]
    local = upload(put_in(s3_server, s3_bucket), "so", files, tmp_path)
    url = f"s3://{s3_bucket}/so/model.safetensors"
    want = load_file(local)
    with safe_open(url, framework="pt", storage_options=options(fault_proxy.url)) as f:
        assert f.keys() == sorted(want)
        name = f.keys()[7]
        fault_proxy.reset_counts()
        same({name: f.get_tensor(name)}, {name: want[name]})
        rows = f.get_slice(name)[2:5]
        gets = [r for r in fault_proxy.requests if r[0] == "GET"]
    assert torch.equal(rows.reshape(-1).view(torch.uint8), want[name][2:5].reshape(-1).view(torch.uint8))
    row = want[name][0].numel() * want[name].element_size()
    fetched = [int(b) - int(a) + 1 for a, b in (r[2].split("=")[1].split("-") for r in gets)]
    assert fetched == [want[name].numel() * want[name].element_size(), 3 * row]
    with pytest.raises(ValueError, match=r"one \.safetensors object"):
        safe_open(f"s3://{s3_bucket}/so/", framework="pt", storage_options=options(s3_server.url))


def test_vllm_weights_from_a_bucket(s3_server, s3_bucket, tmp_path, monkeypatch):
    """The vLLM load format's pairs for a URL source (its batches of
    iter_load over the objects), and its extra config's ``weights`` key."""
    from instant_staging.integrations.vllm._options import parse
    from instant_staging.integrations.vllm._weights import Options, iter_weights
    local = upload(put_in(s3_server, s3_bucket), "vl", layouts()["dense"], tmp_path)
    for k, v in s3_env(s3_server.url).items():
        monkeypatch.setenv(k, v)
    with Checkpoint.open(f"s3://{s3_bucket}/vl/") as ck:
        urls = ck.files
    got = dict(iter_weights(urls, "cpu", Options(batch_bytes=20_000)))
    same(got, load_file(local))
    assert parse({"weights": f"s3://{s3_bucket}/vl/"}).weights == f"s3://{s3_bucket}/vl/"
    with pytest.raises(ValueError, match="weights"):
        parse({"weights": "/a/local/dir"})


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["dense", "moe", "fp8", "mixed"])
def test_url_to_the_gpu_equals_disk(range_http_server, tmp_path, layout):
    """Ranged GETs into the staging slots and on to the GPU, through every
    kind of staging buffer the device path takes (views and own tensors)."""
    files = layouts()[layout]
    for fname, tensors in files:
        safetensors_torch.save_file(tensors, os.path.join(range_http_server.root, fname))
    urls = [range_http_server.url_for(f) for f, _ in files]
    want = {n: t.cuda() for f, _ in files
            for n, t in load_file(os.path.join(range_http_server.root, f)).items()}
    for views in (True, False):
        got = load_file(urls, "cuda:0", views=views, chunk_size=64 << 10)
        assert all(t.is_cuda for t in got.values())
        same(got, want)
    with Checkpoint.open(urls) as ck:
        part = ck.load("cuda:0", plan={n: slice(1, 3) for n in ck.names() if ck.info(n).shape})
        assert ck.last_report.staging_kind is not None
    same(part, {n: want[n][1:3] for n in part})


def test_close_ends_the_range_retries(s3_server, s3_bucket, tmp_path, fault_proxy, monkeypatch):
    """A range that keeps failing waits between tries; close() from another
    thread ends those waits at once instead of after every retry."""
    from instant_staging.loader import _remote
    monkeypatch.setattr(_remote, "_BACKOFF", 5.0)           # tries 5, 10, 20 s apart
    upload(put_in(s3_server, s3_bucket), "cr", layouts()["moe"], tmp_path)
    threads = _threads()
    with Checkpoint.open(f"s3://{s3_bucket}/cr/", storage_options=options(fault_proxy.url)) as ck:
        fault_proxy.fail(500, n=10**6, method="GET", ranged=True)
        it = ck.iter_load("cpu", chunk_size=64 << 10)
        timer = threading.Timer(1.0, it.close)
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(LoadError):
            for _ in it:
                pass
        elapsed = time.monotonic() - t0
        timer.join()
    assert elapsed < 4.0, elapsed
    assert _settled(threads)
    fault_proxy.clear_faults()


def test_a_listing_without_an_answer_ends_within_the_budget(s3_server, s3_bucket, tmp_path,
                                                            fault_proxy, monkeypatch):
    """Resolving a prefix (its listing) is bounded as a range is: no answer
    within RETRY_SECONDS is an OSError naming the URL, not a wait as long
    as the server's (and a Ctrl-C there ends it: the same requests)."""
    from instant_staging.loader import _remote
    upload(put_in(s3_server, s3_bucket), "l", layouts()["moe"], tmp_path)
    monkeypatch.setattr(_remote, "RETRY_SECONDS", 1.0)
    fault_proxy.delay(6.0, n=1, method="GET", ranged=False)
    t0 = time.monotonic()
    with pytest.raises(OSError, match=r"no answer within 1 s while listing") as e:
        Checkpoint.open(f"s3://{s3_bucket}/l/", storage_options=options(fault_proxy.url))
    assert time.monotonic() - t0 < 4.0
    assert f"s3://{s3_bucket}/l/" in str(e.value)


def _data_gets(proxy):
    """The ranged GETs of tensor bytes the proxy saw (a header's starts at 0)."""
    return [(r.path, r.range) for r in list(proxy.requests)
            if r.method == "GET" and r.range and not r.range.startswith("bytes=0-")]


def test_the_first_chunks_are_fetched_while_the_load_starts(s3_server, s3_bucket, tmp_path,
                                                            fault_proxy, monkeypatch):
    # The readers start once the staging buffer is made (tens of ms on a
    # GPU host, more than a round trip): their first chunks are asked for
    # before it, one GET each, and none is fetched twice.  The pipeline's
    # start waits here (bounded) until the proxy saw them.
    from instant_staging.loader import _run
    local = upload(put_in(s3_server, s3_bucket), "pre", layouts()["moe"], tmp_path)
    want = load_file(local)
    threads, before = 3, []
    real = _run._LoadState.open_pipeline

    def open_pipeline(self, *args, **kwargs):
        deadline = time.monotonic() + 10
        while len(_data_gets(fault_proxy)) < threads and time.monotonic() < deadline:
            time.sleep(0.01)
        before.append(len(_data_gets(fault_proxy)))
        return real(self, *args, **kwargs)
    monkeypatch.setattr(_run._LoadState, "open_pipeline", open_pipeline)
    with Checkpoint.open(f"s3://{s3_bucket}/pre/", storage_options=options(fault_proxy.url)) as ck:
        fault_proxy.reset_counts()
        got = ck.load("cpu", chunk_size=16 << 10, threads=threads)
    same(got, want)
    assert before == [threads]
    gets = _data_gets(fault_proxy)
    assert len(gets) == len(set(gets))              # no range fetched twice
    nbytes = sum(t.numel() * t.element_size() for t in want.values())
    assert sum(int(b) - int(a) + 1 for _, r in gets for a, b in [r[6:].split("-")]) == nbytes


def test_the_next_chunks_are_in_flight_while_the_readers_copy(s3_server, s3_bucket, tmp_path,
                                                               fault_proxy, monkeypatch):
    # A reader's chunk answered, the next is requested at once, not after
    # the reader copied it into its slot (slowed here): the requests in
    # flight stay as many as the readers, with no range fetched twice.
    from instant_staging.loader import _remote
    local = upload(put_in(s3_server, s3_bucket), "ahead", layouts()["moe"], tmp_path)
    want = load_file(local)
    seen = []
    real = _remote.RemoteShards._fetch

    def slow_copy(self, index, offset, length):
        data = real(self, index, offset, length)
        time.sleep(0.2)
        seen.append(len(_data_gets(fault_proxy)))
        return data
    monkeypatch.setattr(_remote.RemoteShards, "_fetch", slow_copy)
    with Checkpoint.open(f"s3://{s3_bucket}/ahead/", storage_options=options(fault_proxy.url)) as ck:
        fault_proxy.reset_counts()
        got = ck.load("cpu", chunk_size=8 << 10, threads=2)
    same(got, want)
    assert len(seen) > 4 and seen[0] >= 3, seen
    gets = _data_gets(fault_proxy)
    assert len(gets) == len(set(gets)) == len(seen)


def test_no_first_chunks_fetched_ahead_under_a_bandwidth_cap(s3_server, s3_bucket, tmp_path,
                                                             fault_proxy, monkeypatch):
    # A cap paces every fetch: none is started before the readers take it.
    from instant_staging.loader import _run
    local = upload(put_in(s3_server, s3_bucket), "capped", layouts()["moe"], tmp_path)
    want = load_file(local)
    before = []
    real = _run._LoadState.open_pipeline

    def open_pipeline(self, *args, **kwargs):
        time.sleep(0.3)         # (what a fetch started ahead would reach the proxy in)
        before.append(len(_data_gets(fault_proxy)))
        return real(self, *args, **kwargs)
    monkeypatch.setattr(_run._LoadState, "open_pipeline", open_pipeline)
    with Checkpoint.open(f"s3://{s3_bucket}/capped/", storage_options=options(fault_proxy.url)) as ck:
        fault_proxy.reset_counts()
        got = ck.load("cpu", chunk_size=16 << 10, threads=3, max_bytes_per_second=1 << 30)
    same(got, want)
    assert before == [0]


# -- the bandwidth cap: every byte fetched, none twice (issue 53) ------------------------

def _sent(server, size):
    """Bytes the RangeHTTPServer sent in answer to ranged GETs."""
    total = 0
    for r in list(server.requests):
        if r.method == "GET" and r.range:
            a, b = r.range[6:].split("-")
            total += min(int(b), size - 1) - int(a) + 1
    return total


def test_a_capped_open_pays_for_its_first_get_and_its_load_fetches_none_of_it_again(
        range_http_server):
    # The open's first GET (a MiB, here the header and the first tensors)
    # is paid for at the cap, and its bytes past the header are the first
    # load's: the server sends each byte once.
    g = torch.Generator().manual_seed(5)
    tensors = {f"t{i}": _random((96 << 10,), torch.uint8, g) for i in range(20)}    # 1.9 MiB
    path = os.path.join(range_http_server.root, "model.safetensors")
    safetensors_torch.save_file(tensors, path)
    size, cap = os.path.getsize(path), 8 << 20
    url = range_http_server.url_for("model.safetensors")
    t0 = time.monotonic()
    with Checkpoint.open(url, max_bytes_per_second=cap) as ck:
        opened = time.monotonic() - t0
        assert opened >= (1 << 20) / cap * 0.9
        got = ck.load("cpu", chunk_size=256 << 10, max_bytes_per_second=cap)
    assert time.monotonic() - t0 >= size / cap * 0.9
    same(got, tensors)
    assert _sent(range_http_server, size) == size
    # the doors pass their cap to the open too
    range_http_server.reset_counts()
    t0 = time.monotonic()
    same(load_file(url, max_bytes_per_second=cap, chunk_size=256 << 10), tensors)
    assert time.monotonic() - t0 >= size / cap * 0.9 and _sent(range_http_server, size) == size
    from instant_staging.loader import load_into
    dests = {n: torch.zeros_like(t) for n, t in tensors.items()}
    range_http_server.reset_counts()
    load_into(url, dests, max_bytes_per_second=cap, chunk_size=256 << 10)
    same(dests, tensors)
    assert _sent(range_http_server, size) == size


def test_a_cap_makes_the_first_range_pay_and_gives_back_what_was_not_fetched():
    from instant_staging.loader._throttle import Throttle
    t = Throttle(1000)
    assert t.take(500) == pytest.approx(0.5, abs=0.05)       # the first range pays too
    assert t.take(500) == pytest.approx(1.0, abs=0.05)
    t.give_back(800)
    assert t.take(100) == pytest.approx(0.3, abs=0.05)


def test_a_cancel_ends_a_capped_loads_wait(range_http_server):
    g = torch.Generator().manual_seed(6)
    tensors = {f"t{i}": _random((64 << 10,), torch.uint8, g) for i in range(8)}
    path = os.path.join(range_http_server.root, "model.safetensors")
    safetensors_torch.save_file(tensors, path)
    with Checkpoint.open(range_http_server.url_for("model.safetensors")) as ck:
        it = ck.iter_load("cpu", chunk_size=64 << 10, threads=2, max_bytes_per_second=16 << 10)
        timer = threading.Timer(0.3, it.close)      # each range waits 4 s at the cap
        t0 = time.monotonic()
        timer.start()
        with pytest.raises(LoadError, match="cancelled"):
            list(it)
        timer.join()
    assert time.monotonic() - t0 < 2.5


# -- what a mutation run found untested (issue 53) ---------------------------------------

def test_each_answer_is_compared_with_the_pinned_size():
    from instant_staging.loader._remote import _Object
    obj = _Object("s3://b/k", None, "k")
    obj.pin({"size": 100, "e_tag": '"e"', "version": None, "last_modified": 1})
    assert obj.changed({"size": 100, "e_tag": '"e"', "last_modified": 1}) is None
    assert obj.changed({"size": 101, "e_tag": '"e"', "last_modified": 1}) == "its size is 101, not 100"
    obj.pin({"size": 100, "e_tag": None, "version": None, "last_modified": 1})     # no ETag
    assert obj.changed({"size": 99, "e_tag": None, "last_modified": 1}) == "its size is 99, not 100"


class _Chunks:
    """A read plan of ``n_chunks`` chunks of 100 bytes of file 0 (the
    read-ahead's tests)."""

    def __init__(self, n_chunks):
        self.n_chunks = n_chunks

    def chunk(self, k):
        return (0, 100 * k, 100)


def test_the_read_ahead_never_fetches_a_range_a_reader_fetched_first():
    from instant_staging.loader._remote import _ReadAhead

    class Shards:
        submitted = []

        def _kept_part(self, index, offset, length):
            return None, offset, length

        def _wanted(self, index, length):
            return True

        def _submit(self, *key):
            self.submitted.append(key)
            return object()
    shards = Shards()
    ahead = _ReadAhead(shards, _Chunks(5), 1)
    assert shards.submitted == [(0, 0, 100)]
    assert ahead.take(0, 200, 100) is None          # a reader ahead of its turn: its own GET
    assert ahead.take(0, 0, 100) is not None
    ahead.answered()
    assert ahead.take(0, 100, 100) is not None
    ahead.answered()                                # chunk 2 is the reader's: chunk 3 next
    assert shards.submitted == [(0, 0, 100), (0, 100, 100), (0, 300, 100)]


def test_the_read_ahead_starts_requests_outside_its_lock():
    # A request being started (handed to the request loop) holds no lock:
    # another reader takes and answers its own range meanwhile, and a
    # reader that takes the range being started waits for its request
    # (never a second GET of it); a drop meanwhile cancels it once started.
    import threading

    from instant_staging.loader._remote import _ReadAhead

    class Future:
        def __init__(self):
            self.cancelled = False

        def cancel(self):
            self.cancelled = True

    gate, inside = threading.Event(), threading.Event()

    class Shards:
        submitted = []
        block = None        # the key whose start waits for the gate

        def _kept_part(self, index, offset, length):
            return None, offset, length

        def _wanted(self, index, length):
            return True

        def _submit(self, *key):
            if key == self.block:
                inside.set()
                assert gate.wait(10)
            self.submitted.append(key)
            self.futures[key] = Future()
            return self.futures[key]
        futures = {}
    shards = Shards()
    ahead = _ReadAhead(shards, _Chunks(6), 2)
    assert shards.submitted == [(0, 0, 100), (0, 100, 100)]
    shards.block = (0, 200, 100)
    assert ahead.take(0, 0, 100) is not None
    starter = threading.Thread(target=ahead.answered)       # starts chunk 2, held at the gate
    starter.start()
    assert inside.wait(10)
    other = []
    reader = threading.Thread(target=lambda: other.append(ahead.take(0, 100, 100)))
    reader.start()
    reader.join(5)
    held = reader.is_alive()
    if held:
        gate.set()          # (the old way: the start held the lock; let it end)
        reader.join(10)
    assert not held and other[0] is not None                # no lock held by the start
    taken = []
    taker = threading.Thread(target=lambda: taken.append(ahead.take(0, 200, 100)))
    taker.start()
    taker.join(0.2)
    assert taker.is_alive() and not taken                   # it waits for the request...
    gate.set()
    starter.join(10)
    taker.join(10)
    assert taken[0] is not None and taken[0][1] is not None  # ...and gets it: no second GET
    assert shards.submitted.count((0, 200, 100)) == 1

    # A drop while a start is under way: that request is cancelled once made.
    gate.clear()
    inside.clear()
    shards.block = (0, 300, 100)
    starter = threading.Thread(target=ahead.answered)
    starter.start()
    assert inside.wait(10)
    ahead.drop()
    gate.set()
    starter.join(10)
    assert shards.futures[(0, 300, 100)].cancelled
    assert not shards.futures[(0, 200, 100)].cancelled      # (taken before the drop)
    assert ahead.take(0, 300, 100) is None      # (dropped: the reader fetches it itself)
    ahead.answered()
    assert shards.submitted[-1] == (0, 300, 100)    # nothing started after the drop


@pytest.mark.parametrize("keep", ["handle", "slice"])
def test_the_end_of_a_safe_open_block_closes_the_object_and_the_exit_prints_nothing(
        range_http_server, keep):
    # The block's end stops the request loop (a slice that outlives the
    # handle starts one for its read, and stops it after); the handle or
    # slice kept to the interpreter's exit leaves nothing to say there.
    from support import run_child
    safetensors_torch.save_file({"a": torch.arange(1000.0), "b": torch.ones(10)},
                                os.path.join(range_http_server.root, "m.safetensors"))
    code = f"""
        import threading
        import torch
        from instant_staging.defaults import REMOTE_REQUEST_LOOPS
        from instant_staging.loader import safe_open

        def running():
            return [t.name for t in threading.enumerate() if t.name.startswith("instant_staging")]
        with safe_open({range_http_server.url_for("m.safetensors")!r}) as f:
            assert torch.equal(f.get_tensor("a"), torch.arange(1000.0))
            s = f.get_slice("a")
            assert torch.equal(s[:3], torch.arange(3.0))
            assert 1 <= len(running()) <= REMOTE_REQUEST_LOOPS, running()
            assert set(running()) == {{"instant_staging-requests"}}, running()
        assert running() == [], running()
        assert torch.equal(s[5:7], torch.arange(5.0, 7.0))
        assert running() == [], running()
        {"del s" if keep == "handle" else "del f"}
        print("ok")
    """
    out = run_child(code)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert out.stderr == ""
