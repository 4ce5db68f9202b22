"""The safetensors loader: round trips, malformed files, failures, every kind.

CPU tests load into CPU tensors (memcpy out of the slots).  The device
path (memcpy_async, streams, an event per slot) runs on the simulated
runtime through ``SimTarget``, whose "device" memory is its device_malloc:
the simulation fails any copy that straddles two registrations, so these
tests also check that no chunk does.  GPU tests are marked ``gpu``.
"""

import errno
import gc
import json
import os
import struct
import time

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

import instant_staging as ist
from instant_staging.loader import (
    Checkpoint,
    LoadError,
    SafetensorsError,
    VerifyError,
    _options,
    _shards,
    iter_load,
    load_file,
)

from support import PAGE, cached_fraction, drop_from_page_cache, run_child
from support.tensors import (
    CHUNK,
    DTYPES,
    SimTarget,
    assert_same,
    mixed_tensors,
    random_tensor,
    raw_bytes,
    save,
    sim_load,
    sim_staging,
)

# The kinds a StagingBuffer can be forced into, with the faults that force them.
KINDS = {
    ist.Kind.REGISTERED: (None, {}),
    ist.Kind.SEGMENTED: ("register#1=invalid_value", {}),
    ist.Kind.RUNTIME_PINNED: ("register=invalid_value", {}),
    ist.Kind.PAGEABLE: ("register=invalid_value;host_alloc=memory_allocation",
                        {"allow_pageable": True}),
}


def write_raw(tmp_path, header, data=b"", name="bad.safetensors", length=None):
    """A safetensors file with this header (dict or raw bytes) and data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path = str(tmp_path / name)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if length is None else length))
        f.write(raw)
        f.write(data)
    return path


# -- round trips on the CPU --------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_dtype(tmp_path, dtype):
    tensors = {"matrix": random_tensor(dtype, [37, 129], 1),
               "vector": random_tensor(dtype, [3 * CHUNK + 5], 2),
               "scalar": random_tensor(dtype, [], 3)}
    try:
        path = save(tmp_path, tensors)
    except Exception as e:   # a dtype this safetensors cannot write
        pytest.skip(f"safetensors cannot save {dtype}: {e}")
    expected = st.load_file(path)
    loaded = load_file(path, "cpu", chunk_size=CHUNK, io_depth=4)
    assert_same(loaded, expected)
    assert_same(loaded, tensors)


def test_empty_tensors_and_scalars(tmp_path):
    tensors = {"empty": torch.empty(0, dtype=torch.float32),
               "empty2d": torch.empty(4, 0, dtype=torch.int64),
               "scalar": torch.tensor(7, dtype=torch.int16),
               "bscalar": torch.tensor(1.5, dtype=torch.bfloat16),
               "one": torch.ones(1, dtype=torch.float64)}
    path = save(tmp_path, tensors)
    loaded = load_file(path, "cpu", chunk_size=CHUNK)
    assert_same(loaded, tensors)
    assert loaded["scalar"].dim() == 0 and loaded["empty2d"].shape == (4, 0)


def test_file_of_only_empty_tensors(tmp_path):
    path = save(tmp_path, {"a": torch.empty(0), "b": torch.empty(0, 3, dtype=torch.int8)})
    assert_same(load_file(path, "cpu"), {"a": torch.empty(0), "b": torch.empty(0, 3, dtype=torch.int8)})


def test_many_small_tensors(tmp_path):
    tensors = {f"t{i}": random_tensor(torch.float32, [i % 17 + 1], i) for i in range(600)}
    path = save(tmp_path, tensors)
    assert_same(load_file(path, "cpu", chunk_size=CHUNK, io_depth=3, threads=2), tensors)


def test_tensors_own_their_memory(tmp_path):
    tensors = mixed_tensors()
    loaded = load_file(save(tmp_path, tensors), "cpu", chunk_size=CHUNK)
    storages = {t.untyped_storage().data_ptr() for t in loaded.values() if t.numel()}
    assert len(storages) == sum(1 for t in loaded.values() if t.numel())
    assert all(t.storage_offset() == 0 for t in loaded.values())


def test_multi_shard(tmp_path):
    parts = [mixed_tensors(seed=100 * k, count=10) for k in range(3)]
    paths = []
    for k, part in enumerate(parts):
        part = {f"s{k}.{n}": t for n, t in part.items()}
        parts[k] = part
        paths.append(save(tmp_path, part, f"model-{k}.safetensors"))
    expected = {n: t for part in parts for n, t in part.items()}
    loaded = load_file(paths, "cpu", chunk_size=CHUNK, io_depth=5)
    assert_same(loaded, expected)
    assert list(loaded)[:10] == [n for n in loaded if n.startswith("s0.")]   # shard order


def test_the_source_by_safetensors_name_filename(tmp_path):
    # load_file(filename=..., device=...) as written for safetensors' load_file
    tensors = mixed_tensors(count=5)
    path = save(tmp_path, tensors)
    assert_same(load_file(filename=path, device="cpu"), tensors)
    assert_same(load_file(source=path), tensors)
    with pytest.raises(TypeError, match="both"):
        load_file(path, filename=path)
    with pytest.raises(TypeError, match="missing its source"):
        load_file()
    with pytest.raises(TypeError, match="missing its source"):
        load_file(device="cpu")


def test_metadata_allowed(tmp_path):
    tensors = {"w": random_tensor(torch.float16, [10, 10], 0)}
    path = save(tmp_path, tensors, metadata={"format": "pt", "step": "12"})
    assert_same(load_file(path, "cpu"), tensors)


@pytest.mark.parametrize("threads", [1, 2, 7])
@pytest.mark.parametrize("chunk", [PAGE, CHUNK, 3 * PAGE + 1, 1 << 20])
def test_chunk_sizes_and_threads(tmp_path, chunk, threads):
    tensors = mixed_tensors(seed=chunk + threads)
    path = save(tmp_path, tensors)
    assert_same(load_file(path, "cpu", chunk_size=chunk, io_depth=6, threads=threads), tensors)


# -- the iterator form, progress, verify ---------------------------------------

def test_iterator_yields_each_tensor_once(tmp_path):
    tensors = mixed_tensors()
    path = save(tmp_path, tensors)
    seen = {}
    with iter_load(path, "cpu", chunk_size=CHUNK, io_depth=4) as it:
        assert sorted(it.names) == sorted(tensors)
        for name, tensor in it:
            assert name not in seen
            seen[name] = tensor
    assert_same(seen, tensors)


def test_iterator_closed_early_then_load_again(tmp_path):
    tensors = mixed_tensors()
    path = save(tmp_path, tensors)
    rt, buf = sim_staging()
    it = iter_load(path, "cpu", chunk_size=CHUNK, staging=buf)
    assert it.staging_kind is None
    first = next(it)
    assert it.staging_kind is ist.Kind.REGISTERED and it.threads >= 1
    assert it.staging_kinds == (ist.Kind.REGISTERED,)     # as a process group's lists every rank's
    it.close()
    assert first[0] in tensors
    assert torch.equal(raw_bytes(first[1]), raw_bytes(tensors[first[0]]))
    assert_same(load_file(path, "cpu", chunk_size=CHUNK, staging=buf), tensors)
    buf.close()
    assert rt.live_registrations == 0


def test_iter_load_validates_before_iterating(tmp_path):
    path = write_raw(tmp_path, {"x": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4)
    with pytest.raises(SafetensorsError):
        iter_load(path, "cpu")          # raised by the call, nothing allocated


def test_progress(tmp_path):
    tensors = mixed_tensors()
    path = save(tmp_path, tensors)
    calls = []
    load_file(path, "cpu", chunk_size=CHUNK, io_depth=2, threads=1,
              progress=lambda done, total: calls.append((done, total)))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert calls and calls[-1] == (total, total)
    assert all(c[1] == total for c in calls)
    dones = [c[0] for c in calls]
    assert dones == sorted(dones) and len(set(dones)) == len(dones)


def test_verify_passes(tmp_path):
    tensors = mixed_tensors()
    assert_same(load_file(save(tmp_path, tensors), "cpu", chunk_size=CHUNK, verify=True), tensors)


def test_verify_catches_bytes_that_differ(tmp_path):
    # Once some bytes are copied, flip every data byte of the file: a tensor
    # with a piece copied before the flip no longer matches its file bytes.
    tensors = {f"t{i}": random_tensor(torch.uint8, [CHUNK * 3], i) for i in range(8)}
    path = save(tmp_path, tensors)
    with open(path, "rb") as f:
        header_end = 8 + struct.unpack("<Q", f.read(8))[0]
    flipped = []

    def flip(done, total):
        if done and not flipped:
            with open(path, "r+b") as f:
                f.seek(header_end)
                data = f.read()
                f.seek(header_end)
                f.write(bytes(b ^ 0xFF for b in data))
            flipped.append(True)

    with pytest.raises(VerifyError) as info:
        load_file(path, "cpu", chunk_size=CHUNK, io_depth=2, threads=1, verify=True, progress=flip)
    assert info.value.path == path and info.value.tensor in tensors


# -- malformed files: a ValueError naming the file and the tensor ------------

F32_4 = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}


@pytest.mark.parametrize("case, header, data, length, tensor, words", [
    ("header beyond file", {"a": F32_4}, b"\0" * 16, 10_000, None, "beyond"),
    ("header over limit", {"a": F32_4}, b"", 200_000_000, None, "limit"),
    ("invalid json", b'{"a": {"dtype": "F32",,}}', b"", None, None, "JSON"),
    ("not an object", b"[1, 2]", b"", None, None, "object"),
    ("a number", b"0", b"", None, None, "JSON number, not an object"),
    ("a string", b'"{}"', b"", None, None, "JSON string, not an object"),
    ("null", b"null", b"", None, None, "not an object"),
    ("not utf-8", b'{"\xff\xfe": 1}', b"", None, None, "UTF-8"),
    ("duplicate field", b'{"a": {"dtype": "U8", "dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}',
     b"\0", None, "a", "twice"),
    ("unknown dtype", {"a": {"dtype": "F12", "shape": [4], "data_offsets": [0, 16]}},
     b"\0" * 16, None, "a", "dtype"),
    ("shape mismatch", {"a": {"dtype": "F32", "shape": [5], "data_offsets": [0, 16]}},
     b"\0" * 16, None, "a", "needs 20 bytes"),
    ("negative shape", {"a": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}},
     b"\0" * 16, None, "a", "shape"),
    ("offsets outside", {"a": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}},
     b"\0" * 16, None, "a", "gap"),
    ("offsets reversed", {"a": {"dtype": "U8", "shape": [0], "data_offsets": [8, 4]}},
     b"\0" * 16, None, "a", "gap"),
    ("overlap", {"a": F32_4, "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}},
     b"\0" * 16, None, "b", "overlap"),
    ("missing key", {"a": {"dtype": "F32", "shape": [4]}}, b"\0" * 16, None, "a", "data_offsets"),
    ("entry not an object", {"a": 4}, b"", None, "a", "not an object"),
    ("trailing bytes", {"a": F32_4}, b"\0" * 17, None, None, "trailing"),
    ("bad metadata", {"__metadata__": {"k": 1}, "a": F32_4}, b"\0" * 16, None, None, "__metadata__"),
])
def test_malformed(tmp_path, case, header, data, length, tensor, words):
    path = write_raw(tmp_path, header, data, length=length)
    with pytest.raises(SafetensorsError) as info:
        load_file(path, "cpu")
    err = info.value
    assert isinstance(err, ValueError)
    assert err.path == path and path in str(err)
    assert err.tensor == tensor
    if tensor is not None:
        assert repr(tensor) in str(err)
    assert words in str(err)


def test_file_too_short(tmp_path):
    path = str(tmp_path / "short.safetensors")
    with open(path, "wb") as f:
        f.write(b"\1\0\0")
    with pytest.raises(SafetensorsError, match="too short"):
        load_file(path, "cpu")


def test_duplicate_names_across_shards(tmp_path):
    a = save(tmp_path, {"x": torch.ones(3), "y": torch.ones(2)}, "a.safetensors")
    b = save(tmp_path, {"x": torch.zeros(3)}, "b.safetensors")
    with pytest.raises(SafetensorsError) as info:
        load_file([a, b], "cpu")
    assert info.value.tensor == "x" and a in str(info.value) and b in str(info.value)


def test_gaps_between_tensors_are_rejected_as_safetensors_does(tmp_path):
    header = {"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
              "b": {"dtype": "U8", "shape": [2], "data_offsets": [10, 12]}}
    path = write_raw(tmp_path, header, bytes(range(12)))
    with pytest.raises(SafetensorsError, match="gap") as info:
        load_file(path, "cpu", chunk_size=4)
    assert info.value.tensor == "b"
    with pytest.raises(Exception, match="offset"):     # safetensors: "invalid offset"
        st.load_file(path)


def test_bad_arguments(tmp_path):
    path = save(tmp_path, {"x": torch.ones(3)})
    for kw, exc in [({"chunk_size": 0}, ValueError), ({"io_depth": 0}, ValueError),
                    ({"threads": 0}, ValueError), ({"chunk_size": 1.5}, TypeError),
                    ({"staging": bytearray(10)}, TypeError)]:
        with pytest.raises(exc):
            load_file(path, "cpu", **kw)
    with pytest.raises(ValueError, match="device"):
        load_file(path, "meta")
    with pytest.raises(TypeError):
        load_file(42, "cpu")
    with pytest.raises(ValueError):
        load_file([], "cpu")
    with pytest.raises(FileNotFoundError):
        load_file(str(tmp_path / "missing.safetensors"), "cpu")


def _rewrite_in_place(path):
    """Writes other bytes over ``path``'s data, same size, same file (as a
    writer that saves over a checkpoint does), a clock tick after now."""
    time.sleep(0.05)                # (the kernel moves file times a tick at a time)
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(size // 2)
        f.write(bytes(size - size // 2))


def test_a_file_written_while_it_is_loaded_is_an_error(tmp_path):
    # A server reloading a checkpoint a trainer is saving over: the tensors
    # may mix two versions, so the load says so instead of returning them.
    tensors = {f"t{i}": torch.full((64 << 10,), i, dtype=torch.int32) for i in range(8)}
    path = save(tmp_path, tensors)
    it = iter_load(path, "cpu", chunk_size=CHUNK, threads=1)
    next(it)
    _rewrite_in_place(path)
    with pytest.raises(LoadError, match="written to while it was loaded") as err:
        list(it)
    assert path in str(err.value)
    # a checkpoint opened before the write, loaded after it: refused before
    # any byte is read (issue 53)
    path = save(tmp_path, tensors, name="b.safetensors")
    with Checkpoint.open(path) as ck:
        _rewrite_in_place(path)
        with pytest.raises(LoadError, match="written to since the checkpoint was opened"):
            ck.load("cpu")
    # replaced by a rename mid-load: the descriptors read the file opened
    path = save(tmp_path, tensors, name="c.safetensors")
    it = iter_load(path, "cpu", chunk_size=CHUNK, threads=1)
    first = dict([next(it)])
    save(tmp_path, {n: t + 1 for n, t in tensors.items()}, name="new.safetensors")
    os.replace(tmp_path / "new.safetensors", path)
    got = {**first, **dict(it)}
    assert all(torch.equal(got[n], tensors[n]) for n in tensors)


def test_a_url_of_another_scheme_is_said_so(tmp_path, monkeypatch):
    # oci://, ftp://: not "no such file", but the schemes read, secrets hidden (hf:// is a Hub source)
    from instant_staging.loader import safe_open
    for load in (lambda s: load_file(s, "cpu"), lambda s: load_file([s], "cpu"),
                 lambda s: safe_open(s, "pt")):
        for url in ("oci://org/model/model.safetensors", "ftp://me:pw@host/m.safetensors"):
            with pytest.raises(ValueError, match="is not read here") as err:
                load(url)
            assert "s3://" in str(err.value) and "pw" not in str(err.value)
    # a file whose name only looks like one is still read
    monkeypatch.chdir(tmp_path)
    (tmp_path / "odd:").mkdir()
    (tmp_path / "odd:" / "x").mkdir()
    path = save(tmp_path / "odd:" / "x", {"x": torch.ones(4)})
    assert torch.equal(load_file(os.path.relpath(path).replace("odd:/x", "odd://x"), "cpu")["x"],
                       torch.ones(4))


def test_staging_too_small_or_closed(tmp_path):
    path = save(tmp_path, {"x": torch.ones(CHUNK)})     # 4 * CHUNK bytes
    _rt, buf = sim_staging(size=CHUNK)
    with pytest.raises(ValueError, match="no chunk"):
        load_file(path, "cpu", chunk_size=2 * CHUNK, staging=buf)
    # A slot is only as long as the longest chunk: a small file fits anyway.
    small = save(tmp_path, {"x": torch.ones(3)}, "small.safetensors")
    assert_same(load_file(small, "cpu", chunk_size=2 * CHUNK, staging=buf), {"x": torch.ones(3)})
    buf.close()
    with pytest.raises(ValueError, match="closed"):
        load_file(path, "cpu", chunk_size=CHUNK, staging=buf)


# -- a checkpoint the page cache lacks: the cold knobs ----------------------------

def _cold_file(tmp_path):
    # 8 MiB: the samples lie beyond the readahead of the header's read.
    tensors = {f"t{i:02d}": random_tensor(torch.float32, [(64 << 10) + i], i) for i in range(32)}
    path = save(tmp_path, tensors)
    drop_from_page_cache(path)
    return path, tensors


def on_a_cold_file(tmp_path, check, tries=3):
    """``check(path, tensors)`` on a freshly dropped file, again on a new one
    where it fails, up to ``tries`` times.  Where the kernel lacks
    cachestat(2), resident() samples with RWF_NOWAIT reads, and on a VM
    whose disk is the host's page cache a read of a page dropped and cold
    by mincore can finish before it is judged, as if cached: a host's
    doing, not resident()'s (a resident() that never tells cold still
    fails)."""
    for attempt in range(tries):
        where = tmp_path / f"try{attempt}"
        where.mkdir()
        try:
            return check(*_cold_file(where))
        except AssertionError:
            if attempt == tries - 1:
                raise


def test_resident_tells_a_hot_checkpoint_from_a_cold_one(tmp_path, caplog):
    def check(path, _):
        checkpoint = _shards.Shards().open([path])
        try:
            # One probe only: its sample reads start readahead, so a second
            # one may find those pages cached.
            caplog.clear()
            with caplog.at_level("INFO", logger="instant_staging"):
                assert checkpoint.default_knobs() == {"chunk_size": ist.defaults.COLD_CHUNK_SIZE,
                                                        "io_depth": None,
                                                        "threads": ist.defaults.COLD_THREADS}
            assert "reading it from disk in 16 MiB pieces with 4 threads" in caplog.text
            load_file(path)                          # reading it brings it in
            assert checkpoint.resident() == 1.0 and checkpoint.default_knobs() == {}
        finally:
            checkpoint.close()
    on_a_cold_file(tmp_path, check)


def _without_cachestat(monkeypatch):
    """resident() as on a kernel older than 6.5: cachestat(2) is ENOSYS."""
    def enosys(fd, offset):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))
    monkeypatch.setattr(_shards, "page_cached", enosys)


@pytest.mark.parametrize("probe", ["cachestat", "rwf_nowait"])
def test_resident_samples_the_same_bytes_with_every_tensor_or_a_selection_of_their_bytes(
        tmp_path, monkeypatch, probe):
    # With every tensor selected it samples the data sections (no list of
    # every tensor); a selection leaving out only a tensor without bytes
    # samples tensor by tensor, and must ask for the same bytes.
    if probe == "rwf_nowait" and not hasattr(os, "RWF_NOWAIT"):
        pytest.skip("no RWF_NOWAIT here")
    paths = [save(tmp_path, {**{f"s{s}.{k}": v for k, v in mixed_tensors(count=9, seed=s).items()},
                             f"s{s}.empty": torch.zeros(0)}, f"s{s}.safetensors") for s in (1, 2)]
    where = []
    if probe == "cachestat":
        real = _shards.page_cached

        def page_cached(fd, offset):
            where.append((os.readlink(f"/proc/self/fd/{fd}"), offset))
            return real(fd, offset)
        monkeypatch.setattr(_shards, "page_cached", page_cached)
    else:
        _without_cachestat(monkeypatch)
        real = os.preadv

        def preadv(fd, buffers, offset, *flags):
            where.append((os.readlink(f"/proc/self/fd/{fd}"), offset))
            return real(fd, buffers, offset, *flags)
        monkeypatch.setattr(os, "preadv", preadv)
    seen = []
    for names in (None, lambda name: not name.endswith(".empty")):
        checkpoint = _shards.Shards().open(paths)
        try:
            checkpoint.select(names)
            assert len(checkpoint.entries) == 20 - 2 * (names is not None)
            where.clear()
            assert checkpoint.resident(samples=16) is not None
            seen.append(list(where))
        finally:
            checkpoint.close()
    assert len(seen[0]) == 16 and seen[0] == seen[1]
    assert {p for p, _ in seen[0]} == set(paths)


def test_resident_reads_nothing_and_starts_no_readahead(tmp_path):
    """Asked with cachestat(2), a cold checkpoint stays cold: no page of it
    comes into the page cache (a sampling read would start readahead, and
    on a VM whose disk is the host's cache could finish before the kernel
    judged it: a cold file looked cached on this CI host's kind)."""
    def check(path, _):
        checkpoint = _shards.Shards().open([path])
        try:
            try:
                _shards.page_cached(checkpoint.fds[0], 0)
            except OSError as e:
                pytest.skip(f"no cachestat(2) here: {e}")
            before = cached_fraction(path)
            assert checkpoint.resident() == 0.0
            assert cached_fraction(path) == before
        finally:
            checkpoint.close()
    on_a_cold_file(tmp_path, check)


def test_resident_falls_back_to_reads_without_cachestat(tmp_path, monkeypatch):
    if not hasattr(os, "RWF_NOWAIT"):
        pytest.skip("no RWF_NOWAIT here")
    path = save(tmp_path, {"a": torch.zeros(1 << 16)})
    _without_cachestat(monkeypatch)
    checkpoint = _shards.Shards().open([path])
    try:
        assert checkpoint.resident() == 1.0         # just written: cached
    finally:
        checkpoint.close()


def test_resident_cannot_tell_without_cachestat_or_rwf_nowait(tmp_path, monkeypatch):
    path = save(tmp_path, {"a": torch.zeros(8)})
    _without_cachestat(monkeypatch)
    monkeypatch.delattr(os, "RWF_NOWAIT", raising=False)
    checkpoint = _shards.Shards().open([path])
    try:
        assert checkpoint.resident() is None and checkpoint.default_knobs() == {}
    finally:
        checkpoint.close()


@pytest.mark.parametrize("knob", [None, "threads", "env"])
def test_a_cold_load_uses_the_cold_knobs_where_they_are_not_set(tmp_path, monkeypatch, knob):
    for name in ("INSTANT_STAGING_CHUNK_SIZE", "INSTANT_STAGING_IO_DEPTH", "INSTANT_STAGING_THREADS"):
        monkeypatch.delenv(name, raising=False)
    # Cold chunks this file has several of, so that the threads are not
    # cut to its chunk count.
    monkeypatch.setattr(_options, "COLD_CHUNK_SIZE", 256 << 10)
    kwargs = {}
    if knob == "threads":
        kwargs["threads"] = 3
    elif knob == "env":
        monkeypatch.setenv("INSTANT_STAGING_IO_DEPTH", "6")

    def check(path, tensors):
        with iter_load(path, **kwargs) as it:
            assert_same(dict(it), tensors)
            # (each knob on its own: a variable's io_depth leaves the cold
            # threads and chunks, threads= the cold chunks)
            expected = {None: ist.defaults.COLD_THREADS, "threads": 3,
                        "env": min(ist.defaults.COLD_THREADS, 6)}[knob]     # <= its slots
            assert it.threads == expected
            assert it.report.chunk_size == 256 << 10
    on_a_cold_file(tmp_path, check)


# -- the staging buffer: every kind, reuse, odd segments -----------------------

@pytest.mark.parametrize("kind", list(KINDS), ids=lambda k: k.name)
def test_every_kind_cpu(tmp_path, kind):
    faults, kw = KINDS[kind]
    tensors = mixed_tensors(seed=3)
    path = save(tmp_path, tensors)
    rt, buf = sim_staging(faults, **kw)
    assert buf.kind is kind
    assert_same(load_file(path, "cpu", chunk_size=CHUNK, staging=buf), tensors)
    buf.close()
    assert rt.live_registrations == 0 and rt.live_host_allocs == 0


@pytest.mark.parametrize("kind", list(KINDS), ids=lambda k: k.name)
def test_every_kind_device_path(tmp_path, kind):
    faults, kw = KINDS[kind]
    tensors = mixed_tensors(seed=4)
    path = save(tmp_path, tensors)
    rt, buf = sim_staging(faults, **kw)
    assert buf.kind is kind
    assert_same(sim_load(path, buf, threads=3, verify=True), tensors)
    copies = [c for c in rt.calls if c[0] == "memcpy_async" and c[4] == 1]
    assert copies and all(c[-1] == 0 for c in copies)
    gc.collect()
    assert rt.live_device_allocs == 0
    buf.close()
    assert rt.live_registrations == 0 and rt.live_host_allocs == 0


def test_one_load_at_a_time_per_buffer(tmp_path):
    tensors = mixed_tensors()
    path = save(tmp_path, tensors)
    _rt, buf = sim_staging()
    first = iter_load(path, "cpu", chunk_size=CHUNK, staging=buf)
    next(first)
    with pytest.raises(RuntimeError, match="in use"):
        load_file(path, "cpu", chunk_size=CHUNK, staging=buf)
    first.close()
    assert_same(load_file(path, "cpu", chunk_size=CHUNK, staging=buf), tensors)
    buf.close()


def test_plan_names_each_chunk_as_its_reader_reads_it():
    # (a remote load fetches its readers' first chunks ahead by these)
    from instant_staging.loader._pipeline import Plan
    plan = Plan([(3, 8, 100), (3, 100, 300), (5, 8, 40)], 128)
    assert [plan.chunk(c) for c in range(plan.n_chunks)] == [
        (3, 8, 92), (3, 100, 128), (3, 228, 72), (5, 8, 32)]
    with pytest.raises(IndexError):
        plan.chunk(plan.n_chunks)


def test_plan_interleaves_its_files_chunks():
    # (a load that fills a cache: its objects' partial files written side
    # by side, not one after another)
    from instant_staging.loader._pipeline import Pipeline, Plan
    ranges = [(3, 10 * i, 10 * i + 10) for i in range(6)] + [(4, 10 * i, 10 * i + 10) for i in range(3)]
    plan = Plan(ranges + [(5, 0, 10)], 10)
    before = [plan.chunk(c) for c in range(plan.n_chunks)]
    plan.interleave_files()
    after = [plan.chunk(c) for c in range(plan.n_chunks)]
    assert sorted(after) == sorted(before)
    for fd in (3, 4, 5):        # each file's chunks in their order, spread over the load
        assert [c for c in after if c[0] == fd] == [c for c in before if c[0] == fd]
    assert after == [(3, 0, 10), (4, 0, 10), (3, 10, 10), (3, 20, 10), (4, 10, 10), (5, 0, 10),
                     (3, 30, 10), (3, 40, 10), (4, 20, 10), (3, 50, 10)]
    one = Plan([(3, 0, 100)], 10)
    one.interleave_files()
    assert [one.chunk(c)[1] for c in range(one.n_chunks)] == list(range(0, 100, 10))
    pipe = Pipeline(plan, threads=1, depth=1)
    with pytest.raises(RuntimeError, match="before a Pipeline"):
        plan.interleave_files()     # (the pipeline reads its chunks: never moved under it)
    pipe.close()


def test_segments_not_multiple_of_chunk(tmp_path):
    # A caller's buffer whose 3-page segments hold one 2-page chunk each:
    # only whole chunks inside one registration become slots.
    from instant_staging.testing import SimulatedRuntime
    rt = SimulatedRuntime(faults="register#1=invalid_value")
    buf = ist.StagingBuffer(9 * PAGE, runtime=rt, segment_size=3 * PAGE, prefault_threads=0)
    assert buf.kind is ist.Kind.SEGMENTED and len(buf.segments) == 3
    from instant_staging.loader._pipeline import Pipeline, Plan
    pipe = Pipeline(Plan([(0, 0, 100 * CHUNK)], CHUNK), threads=2, staging=buf, device=0)
    assert pipe.slots == 3 and pipe.slot_bytes == CHUNK
    pipe.close()
    tensors = mixed_tensors(seed=5)
    assert_same(sim_load(save(tmp_path, tensors), buf), tensors)
    buf.close()


def test_one_staging_buffer_across_loads(tmp_path):
    rt, buf = sim_staging("register#1=invalid_value")
    for k in range(3):
        tensors = mixed_tensors(seed=10 * k)
        path = save(tmp_path, tensors, f"m{k}.safetensors")
        assert_same(load_file(path, "cpu", chunk_size=CHUNK, staging=buf), tensors)
        assert_same(sim_load(path, buf), tensors)
    assert buf.kind is ist.Kind.SEGMENTED and not buf.closed
    regs = rt.live_registrations
    buf.close()
    assert regs == len(buf.segments) and rt.live_registrations == 0


# -- failing while loading ----------------------------------------------------

def test_file_truncated_after_validation(tmp_path):
    tensors = mixed_tensors()
    path = save(tmp_path, tensors)
    rt, buf = sim_staging()
    it = iter_load(path, "cpu", chunk_size=CHUNK, staging=buf)   # headers validated
    os.truncate(path, os.path.getsize(path) - 3 * CHUNK)
    with pytest.raises(LoadError) as info:
        list(it)
    assert info.value.path == path and info.value.tensor in tensors
    assert "truncated" in str(info.value)
    path2 = save(tmp_path, tensors, "ok.safetensors")
    assert_same(load_file(path2, "cpu", chunk_size=CHUNK, staging=buf), tensors)
    buf.close()
    assert rt.live_registrations == 0


@pytest.mark.parametrize("kind", list(KINDS), ids=lambda k: k.name)
@pytest.mark.parametrize("fail_chunk", [0, 5, 11])
def test_read_failing_mid_load_frees_everything(tmp_path, kind, fail_chunk):
    faults, kw = KINDS[kind]
    tensors = mixed_tensors(seed=6)
    path = save(tmp_path, tensors)
    rt, buf = sim_staging(faults, **kw)
    live = (rt.live_registrations, rt.live_host_allocs)
    with pytest.raises(LoadError) as info:
        sim_load(path, buf, faults=f"read#{fail_chunk + 1}=EIO", threads=2)
    assert info.value.code == 5 and info.value.path == path     # EIO
    assert info.value.tensor in tensors
    gc.collect()
    assert rt.live_device_allocs == 0                  # every tensor of the load freed
    assert (rt.live_registrations, rt.live_host_allocs) == live
    assert rt.pending_error == 0
    assert_same(sim_load(path, buf), tensors)          # the buffer is reusable
    gc.collect()
    buf.close()
    assert rt.live_registrations == 0 and rt.live_host_allocs == 0 and rt.live_device_allocs == 0


def test_copy_failing_mid_load(tmp_path):
    # A runtime that refuses copies into device memory it does not know.
    tensors = mixed_tensors(seed=7)
    path = save(tmp_path, tensors)
    rt, buf = sim_staging()

    class BadTarget(SimTarget):
        def allocate(self, entry, dtype):
            handle, ptr = super().allocate(entry, dtype)
            return handle, (ptr + 1 if entry.name == "layer.20.weight" else ptr)

    with pytest.raises(LoadError) as info:
        sim_load(path, buf, threads=2, target=BadTarget(rt))
    assert "memcpy_async" in str(info.value) and info.value.tensor == "layer.20.weight"
    gc.collect()
    assert rt.live_device_allocs == 0 and rt.pending_error == 0
    assert_same(sim_load(path, buf), tensors)
    buf.close()


def test_fault_wrapper_forwards_events():
    # The device path needs events through any runtime, faults included.
    from instant_staging.testing import SimulatedRuntime, inject_faults
    rt = inject_faults(SimulatedRuntime(), "register=invalid_value")
    code, stream = rt.stream_create()
    code2, event = rt.event_create()
    assert (code, code2) == (0, 0) and event
    assert rt.event_record(event, stream) == 0
    assert rt.event_synchronize(event) == 0
    assert rt.event_destroy(event) == 0 and rt.stream_destroy(stream) == 0


def test_import_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import instant_staging, instant_staging.loader as l\n"
            "try:\n    l.load_file(__file__, 'cpu')\nexcept ImportError as e:\n"
            "    assert 'instant_staging[torch]' in str(e), e\nelse:\n    raise SystemExit(1)\n")
    result = run_child(code.replace("__file__", repr(ist.__file__)))
    assert result.returncode == 0, result.stderr


# -- on a real GPU ------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(KINDS), ids=lambda k: k.name)
def test_gpu_every_kind(tmp_path, kind):
    from instant_staging.testing import inject_faults
    faults, kw = KINDS[kind]
    runtime = ist.real_runtime() if faults is None else inject_faults(ist.real_runtime(), faults)
    tensors = mixed_tensors(seed=8, count=64)
    tensors["big"] = random_tensor(torch.bfloat16, [3 << 20], 9)
    path = save(tmp_path, tensors)
    chunk = 1 << 20
    with ist.StagingBuffer(16 * chunk, runtime=runtime, copy_unit=chunk,
                           segment_size=4 * chunk, **kw) as buf:
        assert buf.kind is kind
        loaded = load_file(path, "cuda:0", chunk_size=chunk, staging=buf, verify=True)
        assert all(t.device.type == "cuda" for t in loaded.values())
        assert_same({n: t.cpu() for n, t in loaded.items()}, tensors)


@pytest.mark.gpu
def test_gpu_default_staging_and_failure_frees(tmp_path):
    tensors = mixed_tensors(seed=9, count=64)
    path = save(tmp_path, tensors)
    loaded = load_file(path, "cuda", chunk_size=64 << 10)
    assert_same({n: t.cpu() for n, t in loaded.items()}, tensors)
    del loaded
    gc.collect()                # an earlier test's garbage (a model's cycles) is not this load's
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    it = iter_load(path, "cuda:0", chunk_size=64 << 10)
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(LoadError):
        list(it)
    gc.collect()
    assert torch.cuda.memory_allocated() == before


@pytest.mark.gpu
def test_gpu_large_tensors_are_cut_from_one_reserved_block(tmp_path):
    # _TorchTarget.reserve: one cudaMalloc for every tensor above torch's
    # small pool, instead of one per tensor or 20 MiB segment.
    tensors = {f"expert.{i}": random_tensor(torch.bfloat16, [768, 2048], i) for i in range(40)}
    tensors["norm"] = random_tensor(torch.float32, [1024], 99)
    path = save(tmp_path, tensors)
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_stats().get("segment.large_pool.allocated", 0)
    loaded = load_file(path, "cuda:0")
    # At most one cudaMalloc (none where a segment an earlier test left
    # pinned, by a cuBLAS workspace say, has the room), and the tensors cut
    # from one block, in order (below).
    assert torch.cuda.memory_stats()["segment.large_pool.allocated"] - before <= 1
    assert_same({n: t.cpu() for n, t in loaded.items()}, tensors)
    ptrs = sorted(t.data_ptr() for n, t in loaded.items() if n != "norm")
    assert ptrs[-1] - ptrs[0] == 39 * (3 << 20)      # one block, cut in order


@pytest.mark.parametrize("knob", [None, "env"])
def test_safe_open_reads_a_cold_file_with_the_cold_knobs(tmp_path, monkeypatch, knob):
    from instant_staging.loader import _safe_open, safe_open
    for name in ("INSTANT_STAGING_CHUNK_SIZE", "INSTANT_STAGING_IO_DEPTH", "INSTANT_STAGING_THREADS"):
        monkeypatch.delenv(name, raising=False)
    if knob == "env":
        monkeypatch.setenv("INSTANT_STAGING_THREADS", "3")
    seen = []
    real = _safe_open.LoadIterator

    def spy(prepared):
        seen.append((prepared.options.chunk_size, prepared.options.threads))
        return real(prepared)
    monkeypatch.setattr(_safe_open, "LoadIterator", spy)

    def check(path, tensors):
        seen.clear()
        with safe_open(path, "pt") as f:
            # (all of them, one read: get_tensor of one small tensor to the
            # CPU is read in this thread, with no pipeline and no knobs)
            got = f.get_tensors()
            assert all(torch.equal(raw_bytes(got[n]), raw_bytes(t)) for n, t in tensors.items())
        _, threads = seen[0]
        assert threads == (ist.defaults.COLD_THREADS if knob is None else 3)
    on_a_cold_file(tmp_path, check)
