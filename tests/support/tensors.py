"""Safetensors files and the loader's device path on the simulated
runtime, for the loader's tests (torch and safetensors needed: import this
after ``pytest.importorskip`` of them).

``SimTarget`` is the loader's device path with the simulated runtime as
the device: its "device" memory is the runtime's device_malloc, and the
simulation fails any copy that straddles two registrations, so a test that
loads through it also checks that no chunk does.
"""

import safetensors.torch as st
import torch

import instant_staging as ist
from instant_staging.loader import _options, _prepare, _run, _shards, _target
from instant_staging.testing import FaultPlan

from support import PAGE

CHUNK = 2 * PAGE              # small: many chunks, tensors spanning chunks

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64]
DTYPES += [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32",
                                       "uint64", "complex64") if hasattr(torch, n)]


def random_tensor(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def raw_bytes(t):
    return t.reshape(-1).view(torch.uint8)


def assert_same(loaded, expected):
    assert set(loaded) == set(expected)
    for name, ref in expected.items():
        got = loaded[name]
        assert got.dtype == ref.dtype and tuple(got.shape) == tuple(ref.shape), name
        assert got.device.type == "cpu"
        assert torch.equal(raw_bytes(got), raw_bytes(ref.contiguous())), name


def save(tmp_path, tensors, name="model.safetensors", metadata=None):
    path = str(tmp_path / name)
    st.save_file(tensors, path, metadata=metadata)
    return path


def mixed_tensors(seed=0, count=40):
    """Tensors of many sizes: some inside a chunk, some spanning several."""
    out = {}
    for i in range(count):
        dtype = DTYPES[i % 10]
        shape = [(i * 37) % 700 + 1] if i % 3 else [i % 5 + 1, (i * 101) % 2000 + 1]
        out[f"layer.{i}.weight"] = random_tensor(dtype, shape, seed + i)
    return out


def sim_staging(faults=None, size=8 * CHUNK, **kw):
    from instant_staging.testing import SimulatedRuntime
    rt = SimulatedRuntime(faults=faults)
    kw.setdefault("segment_size", 2 * CHUNK)
    kw.setdefault("prefault_threads", 0)
    return rt, ist.StagingBuffer(size, runtime=rt, copy_unit=CHUNK, **kw)


class SimBlock:
    """One device_malloc allocation of the simulated runtime; freed on collection."""

    def __init__(self, rt, nbytes):
        self.rt, self.nbytes = rt, nbytes
        code, self.ptr = rt.device_malloc(nbytes) if nbytes else (0, 0)
        assert code == 0

    def __del__(self):
        if self.ptr:
            self.rt.device_free(self.ptr)


class SimTarget:
    """The loader's device path with the simulated runtime as the device."""

    def __init__(self, rt):
        from instant_staging.loader._pipeline import DEVICE
        self.rt, self.mode, self.index = rt, DEVICE, 0
        self.torch_target = _target._TorchTarget(torch, torch.device("cpu"))

    def check(self, entry, path):
        return self.torch_target.check(entry, path)

    def dtypes(self, entries, paths):
        return self.torch_target.dtypes(entries, paths)

    def allocate(self, entry, dtype):
        block = SimBlock(self.rt, entry.nbytes)
        return (block, entry, dtype), block.ptr

    def placed(self):
        return None                         # (allocate() hands out each address)

    def reserve(self, entries):
        pass

    def before_copies(self):
        pass

    def written(self):
        pass                                # (a load into given destinations: no autograd here)

    # Views (loader/_blocks.pyx): a handle is (block, entry, dtype, offset).

    def joins(self, dtype, views):
        return views                        # (no dtype= on this target)

    def allocate_blocks(self, run_list, entries, dtypes):
        return {r: SimBlock(self.rt, run.nbytes) for r, run in enumerate(run_list) if run.block}

    def addresses(self, run, block, entries):
        return [block.ptr + entries[k][1].begin - run.begin for k in range(run.first, run.stop)]

    def views(self, run, block, entries, dtypes):
        return [(block, entries[k][1], dtypes[k], entries[k][1].begin - run.begin)
                for k in range(run.first, run.stop)]

    def tensor(self, handle):
        return handle

    def result(self, handle):
        block, entry, dtype, *offset = handle
        out = torch.empty(entry.shape, dtype=dtype)
        if entry.nbytes:
            src = block.ptr + (offset[0] if offset else 0)
            assert self.rt.memcpy_async(out.data_ptr(), src, entry.nbytes, 2) == 0
        return out

    def equal(self, handle, offset, data):
        out = raw_bytes(self.result(handle))
        return bytes(out[offset:offset + len(data)].numpy()) == bytes(data)


def iterator(checkpoint, target, dtypes, *, chunk_size=CHUNK, io_depth=None, threads=None,
             staging=None, verify=False, progress=None, faults=None, views=False):
    """A LoadIterator of a load of one process of ``checkpoint`` as it is
    (``_prepare.planned``: the reads planned, a staging buffer started where
    none is given), with LoadOptions made of these arguments."""
    options = _options.LoadOptions(chunk_size, io_depth, threads, staging=staging,
                                   verify=verify, progress=progress, views=views)
    return _run.LoadIterator(_prepare.planned(checkpoint, target, dtypes, options, faults))


def sim_load(paths, staging, *, faults=None, threads=None, verify=False, progress=None,
             target=None):
    """Loads through SimTarget; returns {name: CPU tensor}."""
    checkpoint = _shards.Shards().open(paths if isinstance(paths, list) else [paths])
    target = target or SimTarget(staging.runtime)
    dtypes = [target.check(t, checkpoint.paths[i]) for i, t in checkpoint.entries]
    with iterator(checkpoint, target, dtypes, io_depth=4, threads=threads, staging=staging,
                  verify=verify, progress=progress, faults=faults and FaultPlan.parse(faults)) as it:
        return dict(it)
