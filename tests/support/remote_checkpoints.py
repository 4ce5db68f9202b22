"""What the remote-source tests share (s3 on moto, gs and az on their
servers, the cache): a checkpoint written locally and to a bucket, the
bit-for-bit comparison, and the threads and descriptors a load must give
back."""

import json
import os
import threading
import time

import safetensors.torch as safetensors_torch
import torch


def upload(put, prefix, files, tmp_path, index=True):
    """Writes ``files`` (``[(file name, {name: tensor})]``) to tmp_path/prefix
    and, through ``put(key, bytes)``, to the bucket under prefix, with an
    index where there are several (and ``index``); returns the local
    directory."""
    local = tmp_path / prefix
    local.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for fname, tensors in files:
        path = local / fname
        safetensors_torch.save_file(tensors, str(path), metadata={"format": "pt"})
        put(f"{prefix}/{fname}", path.read_bytes())
        weight_map.update({n: fname for n in tensors})
    if index and len(files) > 1:
        raw = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
        (local / "model.safetensors.index.json").write_bytes(raw)
        put(f"{prefix}/model.safetensors.index.json", raw)
    return local


def shards(seed, count=2):
    """A small dense checkpoint of bf16 tensors (q, up and norm of four
    layers) in ``count`` files, as ``upload`` takes them."""
    g = torch.Generator().manual_seed(seed)
    tensors = {f"layers.{i}.{p}": torch.randn(shape, generator=g).to(torch.bfloat16)
               for i in range(4) for p, shape in (("q", (64, 64)), ("up", (160, 64)), ("norm", (64,)))}
    names = sorted(tensors)
    step = -(-len(names) // count)
    return [(f"model-{k + 1:05d}-of-{count:05d}.safetensors",
             {n: tensors[n] for n in names[k * step:(k + 1) * step]}) for k in range(count)]


def random_tensor(shape, dtype, g):
    """A tensor of ``shape`` and ``dtype`` made of random bytes from ``g``
    (any bit pattern: NaNs, subnormals, every float8 value)."""
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def same(got, want):
    """``got`` holds ``want``'s tensors, bit for bit (as raw bytes)."""
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        g = got[name]
        assert g.dtype == t.dtype and g.shape == t.shape, name
        assert torch.equal(g.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def fds():
    return set(os.listdir("/proc/self/fd"))


def threads():
    return {t.ident for t in threading.enumerate()}


def settled(before_threads, before_fds=None, timeout=5.0):
    """Threads (and descriptors: sockets) back to what they were before: the
    client closes a dropped pool's connections on its own runtime's
    threads, a moment after the last reference goes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if threads() <= before_threads and (before_fds is None or fds() <= before_fds):
            return True
        time.sleep(0.05)
    return False


def put_in(server, bucket):
    """``upload``'s ``put`` for ``bucket`` of an S3 server (moto)."""
    return lambda key, data: server.put(bucket, key, data)
