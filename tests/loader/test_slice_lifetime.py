"""A slice from ``safe_open(...).get_slice(name)`` stays usable after its
handle is closed, as safetensors' does, and holds the file only as long as
it lives (issue 21, finding 13).

Descriptors are counted in /proc/self/fd: the file stays open while a slice
of it is alive and is closed when the last one is dropped (or collected in a
cycle); the handle's own methods still refuse after close.  Results equal
safetensors' slices read after its ``with`` block, bit for bit.
"""

import gc
import os
import threading

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")
from safetensors import safe_open as st_safe_open

from instant_staging.loader import safe_open

INDICES = [slice(0, 8), 3, (slice(None), 2), (slice(1, 9, 2), slice(None, None, 3)), (), [0, 5]]


def fds():
    return set(os.listdir("/proc/self/fd"))


def same(got, ref):
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert torch.equal(got.contiguous().reshape(-1).view(torch.uint8),
                       ref.contiguous().reshape(-1).view(torch.uint8))


@pytest.fixture
def path(tmp_path):
    g = torch.Generator().manual_seed(7)
    p = tmp_path / "m.safetensors"
    st.save_file({"w": torch.randn(16, 12, generator=g),
                  "b": torch.randn(16, generator=g).to(torch.bfloat16)}, p)
    return p


def test_a_slice_is_usable_after_the_with_block_like_safetensors(path):
    with st_safe_open(path, framework="pt") as f:
        ref = f.get_slice("w")
    with safe_open(path, framework="pt") as f:
        got = f.get_slice("w")
    assert got.get_shape() == ref.get_shape() and got.get_dtype() == ref.get_dtype()
    for index in INDICES:
        same(got[index], ref[index])


def test_the_file_stays_open_while_a_slice_lives_and_closes_when_it_goes(path):
    before = fds()
    with safe_open(path, framework="pt") as f:
        s1, s2 = f.get_slice("w"), f.get_slice("b")
        assert len(fds() - before) == 1         # one descriptor, shared
    with pytest.raises(ValueError, match="File is closed"):
        f.keys()
    assert len(fds() - before) == 1              # held by the slices
    s1[0:8]
    del s1
    assert len(fds() - before) == 1
    s2[2:4]
    del s2
    assert fds() - before == set()               # the last slice closed it


def test_a_slice_in_a_reference_cycle_closes_the_file_when_collected(path):
    before = fds()
    with safe_open(path, framework="pt") as f:
        s = f.get_slice("w")
    box = [s]
    box.append(box)                   # a cycle holding the slice
    s = None
    del box
    assert len(fds() - before) == 1
    gc.collect()
    assert fds() - before == set()


def test_slices_dropped_while_open_do_not_keep_the_file_after_close(path):
    before = fds()
    with safe_open(path, framework="pt") as f:
        for _ in range(100):
            f.get_slice("w")[0]
    assert fds() - before == set()


def test_many_slices_after_close_leak_nothing(path):
    """Descriptors and resident memory stay flat over many handles whose
    slices outlive them."""
    from support import rss
    before = fds()
    for _ in range(30):                 # warm-up: allocator, caches
        with safe_open(path, framework="pt") as f:
            s = f.get_slice("w")
        s[0:16]
    base = rss()
    for _ in range(2000):
        with safe_open(path, framework="pt") as f:
            s = f.get_slice("w")
        s[0:16]
    del s
    gc.collect()
    assert fds() - before == set()
    assert rss() - base < 16 << 20


def test_reads_through_slices_from_several_threads_after_close(path):
    with st_safe_open(path, framework="pt") as f:
        ref = f.get_tensor("w")
    with safe_open(path, framework="pt") as f:
        slices = [f.get_slice("w") for _ in range(4)]
    errors = []

    def work(s):
        try:
            for i in range(50):
                same(s[i % 16], ref[i % 16])
        except Exception as e:      # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in slices]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)


def test_a_slice_of_a_handle_closed_by_collection_still_reads(path):
    s = safe_open(path, framework="pt").get_slice("b")     # the handle is dropped at once
    gc.collect()
    with st_safe_open(path, framework="pt") as f:
        same(s[3:7], f.get_slice("b")[3:7])


@pytest.mark.gpu
def test_gpu_slice_after_close_reads_through_a_staging_buffer_of_its_own(path, gpu):
    from instant_staging.loader import _staging_pool
    with safe_open(path, framework="pt", device="cuda:0") as f:
        s = f.get_slice("w")
        f.get_tensor("b")                # the handle's staging buffer
    with st_safe_open(path, framework="pt", device="cuda:0") as ref:
        for index in INDICES:
            same(s[index].cpu(), ref.get_slice("w")[index].cpu())
    del s
    _staging_pool.empty_cache()
