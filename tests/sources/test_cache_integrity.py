"""What a cache entry must be before it is returned as its object, and the
files an attacker who can write the cache directory could plant
(issue 53: findings 1 and 4, and the cache's mutants that no test killed),
against the plain ranged-GET HTTP server (``support/remote_servers``;
its ETag is the file's mtime and size) and moto's S3 where a directory of
shards is needed."""

import logging
import os
import pathlib
import stat
import time
import types
import zlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("obstore")
safetensors_torch = pytest.importorskip("safetensors.torch")

from instant_staging.loader import (
    Checkpoint,
    VerifyError,
    _cache,
    iter_load,
    load_file,
    wait_for_cache_fills,
)

from support.remote_checkpoints import put_in, same, upload
from support.remote_servers import (  # noqa: F401
    range_http_server_fixture,
    s3_bucket_fixture,
    s3_server_fixture,
)
from support.remote_servers import storage_options as _options

TENSORS = 8
ELEMENTS = 16 * 1024          # 64 KiB of float32 each
CHUNK = 64 * 1024


def _model(value):
    return {f"t{i}": torch.full((ELEMENTS,), float(value * 100 + i)) for i in range(TENSORS)}


def _serve(server, value=1, name="model.safetensors"):
    """Writes model ``value`` under the server's root; its URL and path."""
    path = server.root_path / name
    safetensors_torch.save_file(_model(value), str(path))
    return server.url_for(name), path


def _files(cache):
    assert wait_for_cache_fills(timeout=30)
    return sorted(os.listdir(cache)) if os.path.isdir(cache) else []


def _entries(cache):
    return [n for n in _files(cache) if n.endswith(_cache.ENTRY_SUFFIX)]


def _object(entry):
    """The object's bytes in ``entry`` (its fills finished), less the digest after them."""
    assert wait_for_cache_fills(timeout=30)
    data = pathlib.Path(entry).read_bytes()
    size = _cache._FOOTER.unpack_from(data, len(data) - _cache._FOOTER.size)[0]
    return data[:size]


def _filled(url, cache):
    """Loads ``url`` once with ``cache``: its entry's path (the one it made)."""
    before = set(_entries(cache))
    load_file(url, "cpu", cache_dir=cache, chunk_size=CHUNK)
    (name,) = set(_entries(cache)) - before
    return cache / name


def _stamp(entry):
    return entry.with_name(entry.name[:-len(_cache.ENTRY_SUFFIX)] + _cache.STAMP_SUFFIX)


def _has_stamp(entry):
    """Whether ``entry`` has a stamp (a file, not a link) that records it as it is."""
    stamp = _stamp(entry)
    return (stamp.is_file() and not stamp.is_symlink()
            and stamp.read_bytes() == _cache._stamp_of(os.lstat(entry)))


def _stamped(url, cache):
    """Loads ``url`` with ``cache`` until its entry has its stamp (the
    finisher's, or, where the entry was named in the tick of the kernel's
    clock in which the stamp would have been written, a later hit's)."""
    entry = _filled(url, cache)
    for _ in range(3):
        if _has_stamp(entry):
            return entry
        time.sleep(0.02)
        _load(url, cache)
    raise AssertionError(f"no stamp: {_files(cache)}")


def _spy_checks(monkeypatch):
    """The full checks made from here on (``_cache._check``'s calls: each reads an entry's bytes)."""
    calls, check = [], _cache._check

    def spy(fd, ranges):
        calls.append(len(ranges))
        return check(fd, ranges)
    monkeypatch.setattr(_cache, "_check", spy)
    return calls


def _load(url, cache, **kw):
    with iter_load(url, "cpu", cache_dir=cache, chunk_size=CHUNK, **kw) as it:
        got = dict(it)
    return got, it.report


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and "cache" in r.getMessage()]


def _rewrite(entry, obj):
    """Replaces ``entry`` with object bytes ``obj`` and a digest that fits
    them (one range): an entry only the header comparison can refuse."""
    entry.unlink()
    entry.write_bytes(obj + _cache._trailer(len(obj), [(0, len(obj), zlib.crc32(obj))]))


# -- finding 1: a damaged entry is never returned as the object ---------------------------

def _flip_a_data_byte(entry, obj):
    data = bytearray(entry.read_bytes())
    data[len(obj) - 3 * CHUNK] ^= 0x40                  # (in t5's bytes: size and header kept)
    entry.write_bytes(bytes(data))


def _flip_keeping_its_times(entry, obj):
    # in place (its inode, size, mtime and atime kept): only its ctime tells
    st = os.lstat(entry)
    fd = os.open(entry, os.O_RDWR)
    try:
        at = len(obj) - 3 * CHUNK
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x40]), at)
    finally:
        os.close(fd)
    os.utime(entry, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.lstat(entry)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (st.st_ino, st.st_size,
                                                                st.st_mtime_ns)


def _digest_with_a_hole(entry, obj):
    # a digest that says nothing of the middle: its bytes zeroed, checked by nobody
    size = len(obj)
    data = bytearray(obj)
    data[size // 2:size // 2 + 4096] = bytes(4096)
    ranges = [(0, size // 2, zlib.crc32(data[:size // 2])),
              (size // 2 + 4096, size - size // 2 - 4096, zlib.crc32(data[size // 2 + 4096:]))]
    entry.unlink()
    entry.write_bytes(bytes(data) + _cache._trailer(size, ranges))


def _damaged_table(entry, obj):
    data = bytearray(entry.read_bytes())
    data[len(obj) + 2] ^= 1                             # an offset in the digest's table
    entry.write_bytes(bytes(data))


def _another_header(entry, obj):
    # t0's dtype F32 -> I32 (same length): a self-consistent entry of another object
    assert obj.count(b'"F32"') == TENSORS
    _rewrite(entry, obj.replace(b'"F32"', b'"I32"', 1))


def _cut_short(entry, obj):
    data = entry.read_bytes()
    entry.write_bytes(data[:len(obj) + 5])


@pytest.mark.parametrize("damage", [_flip_a_data_byte, _flip_keeping_its_times,
                                    _digest_with_a_hole, _damaged_table, _another_header,
                                    _cut_short],
                         ids=["flipped-bit", "flipped-bit-times-kept", "digest-with-a-hole",
                              "damaged-digest", "another-header", "cut-short"])
def test_a_damaged_entry_is_removed_and_fetched_again(range_http_server, tmp_path, caplog,
                                                      damage):
    """Each damage made through the file system after the entry's last full
    check (its stamp) is found by the next open: the write moved its ctime."""
    url, path = _serve(range_http_server)
    cache = tmp_path / "cache"
    entry = _stamped(url, cache)
    obj = _object(entry)
    assert obj == path.read_bytes()
    damage(entry, obj)
    caplog.set_level(logging.INFO, logger="instant_staging")
    got, report = _load(url, cache)
    same(got, _model(1))
    assert (report.cache_hit_bytes, report.fetched_bytes) == (0, TENSORS * CHUNK)
    said = _warnings(caplog)
    assert len(said) == 1 and "damaged" in said[0] and entry.name in said[0], said
    assert _entries(cache) == [entry.name] and _object(entry) == obj        # filled again
    got, report = _load(url, cache)
    same(got, _model(1))
    assert report.cache_hit_bytes == TENSORS * CHUNK


# -- checked once and recorded: the stamp -------------------------------------------------

def test_a_hit_with_its_stamp_reads_no_tensor_bytes(range_http_server, tmp_path, monkeypatch):
    url, _ = _serve(range_http_server)
    cache = tmp_path / "cache"
    entry = _stamped(url, cache)
    checks = _spy_checks(monkeypatch)
    for _ in range(2):
        got, report = _load(url, cache)
        same(got, _model(1))
        assert report.cache_hit_bytes == TENSORS * CHUNK
    assert checks == [] and _has_stamp(entry)


def test_a_stamped_entry_is_still_compared_with_the_objects_header(range_http_server, tmp_path,
                                                                    caplog):
    """The object rewritten on the server with its ETag (this server's: mtime
    and size) kept and its header changed: the stamp says the entry is as
    its fill made it, not that it is this object; the header tells."""
    url, path = _serve(range_http_server)
    cache = tmp_path / "cache"
    entry = _stamped(url, cache)
    st = path.stat()
    renamed = {f"u{n[1:]}": t for n, t in _model(1).items()}       # (the same lengths)
    safetensors_torch.save_file(renamed, str(path))
    os.utime(path, ns=(st.st_mtime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size
    caplog.set_level(logging.WARNING, logger="instant_staging")
    got, report = _load(url, cache)
    same(got, renamed)
    assert report.fetched_bytes == TENSORS * CHUNK
    said = _warnings(caplog)
    assert len(said) == 1 and "header is not the object's" in said[0], said
    assert _object(entry) == path.read_bytes()


def test_the_finisher_checks_and_stamps_the_entry_it_made(range_http_server, tmp_path,
                                                          monkeypatch):
    url, _ = _serve(range_http_server)
    cache = tmp_path / "cache"
    fsync_directory = _cache._fsync_directory

    def ticking(path):          # (a disk's flush: the kernel's clock ticks meanwhile)
        time.sleep(0.02)
        fsync_directory(path)
    monkeypatch.setattr(_cache, "_fsync_directory", ticking)
    checks = _spy_checks(monkeypatch)
    entry = _filled(url, cache)
    assert checks == [TENSORS + 1] and _has_stamp(entry)   # (its ranges and its header's)
    got, report = _load(url, cache)
    same(got, _model(1))
    assert report.cache_hit_bytes == TENSORS * CHUNK and len(checks) == 1


def test_an_entry_damaged_before_its_flush_is_not_kept(range_http_server, tmp_path, monkeypatch,
                                                       caplog):
    """The finisher reads the entry it made back: bytes that are not those
    fetched (a write gone wrong under the fill) are no entry, one warning."""
    url, path = _serve(range_http_server)
    cache = tmp_path / "cache"
    flush = _cache._flush

    def flipping(fd):
        at = path.stat().st_size - 3 * CHUNK
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x40]), at)
        flush(fd)
    monkeypatch.setattr(_cache, "_flush", flipping)
    caplog.set_level(logging.WARNING, logger="instant_staging")
    got, _ = _load(url, cache)
    same(got, _model(1))                                # (the load had the fetched bytes)
    assert _files(cache) == []
    said = _warnings(caplog)
    assert len(said) == 1 and "read back damaged" in said[0], said
    monkeypatch.undo()
    assert _object(_filled(url, cache)) == path.read_bytes()


def _another_ctime(stamp, entry):
    st = os.lstat(entry)
    stamp.write_bytes(_cache._STAMP.pack(_cache._STAMP_MAGIC, st.st_dev, st.st_ino, st.st_size,
                                         st.st_mtime_ns, st.st_ctime_ns - 1))


def _another_inode(stamp, entry):
    st = os.lstat(entry)
    stamp.write_bytes(_cache._STAMP.pack(_cache._STAMP_MAGIC, st.st_dev, st.st_ino + 1,
                                         st.st_size, st.st_mtime_ns, st.st_ctime_ns))


def _longer(stamp, entry):
    stamp.write_bytes(stamp.read_bytes() + b"\0")


def _no_magic(stamp, entry):
    stamp.write_bytes(bytes(8) + stamp.read_bytes()[8:])


def _a_directory(stamp, entry):
    stamp.unlink()
    stamp.mkdir()


@pytest.mark.parametrize("forge", [_another_ctime, _another_inode, _longer, _no_magic,
                                   lambda stamp, entry: stamp.unlink(), _a_directory],
                         ids=["another-ctime", "another-inode", "longer", "no-magic", "none",
                              "a-directory"])
def test_a_stamp_that_does_not_fit_means_a_full_check(range_http_server, tmp_path, monkeypatch,
                                                      forge):
    url, _ = _serve(range_http_server)
    cache = tmp_path / "cache"
    entry = _stamped(url, cache)
    forge(_stamp(entry), entry)
    checks = _spy_checks(monkeypatch)
    got, report = _load(url, cache)
    same(got, _model(1))
    assert report.cache_hit_bytes == TENSORS * CHUNK and len(checks) == 1
    if forge is _a_directory:       # (not ours to remove: it stays, and each hit checks)
        return
    assert _has_stamp(entry)        # written again by the check
    _load(url, cache)
    assert len(checks) == 1


def test_a_stamp_is_not_written_in_the_tick_of_the_entrys_change(range_http_server, tmp_path,
                                                                monkeypatch):
    """Where the stamp's own time is not later than the entry's last change
    (the kernel's clock has not ticked), a write just after the check would
    leave the entry's times as the stamp records them: no stamp; the next
    open checks again."""
    url, _ = _serve(range_http_server)
    cache = tmp_path / "cache"
    entry = _stamped(url, cache)
    _stamp(entry).unlink()
    ctime, fstat = os.lstat(entry).st_ctime_ns, os.fstat

    def same_tick(fd):
        if ".checked-" in os.readlink(f"/proc/self/fd/{fd}"):
            return types.SimpleNamespace(st_mtime_ns=ctime)
        return fstat(fd)
    monkeypatch.setattr(os, "fstat", same_tick)
    checks = _spy_checks(monkeypatch)
    got, _ = _load(url, cache)
    monkeypatch.setattr(os, "fstat", fstat)
    same(got, _model(1))
    assert len(checks) == 1 and _files(cache) == [entry.name]      # (no stamp, no temporary)
    _load(url, cache)
    assert len(checks) == 2 and _has_stamp(entry)


def test_an_entry_written_during_its_check_is_not_stamped(range_http_server, tmp_path,
                                                         monkeypatch, caplog):
    """A write through the file system while the check reads (after it read
    those bytes): the stamp would record the entry as written, so none is
    made, and the next open checks it again and finds it."""
    url, _ = _serve(range_http_server)
    cache = tmp_path / "cache"
    entry = _stamped(url, cache)
    _stamp(entry).unlink()
    obj, check = _object(entry), _cache._check

    def then_written(fd, ranges):
        bad = check(fd, ranges)
        monkeypatch.setattr(_cache, "_check", check)
        _flip_keeping_its_times(entry, obj)
        return bad
    monkeypatch.setattr(_cache, "_check", then_written)
    _load(url, cache)       # (what it returns is the writer's race: after the check, before reading)
    assert _cache._check is check and not os.path.lexists(_stamp(entry))
    caplog.set_level(logging.WARNING, logger="instant_staging")
    got, report = _load(url, cache)
    same(got, _model(1))
    assert report.fetched_bytes == TENSORS * CHUNK
    assert any("differ from their digest" in m for m in _warnings(caplog)), _warnings(caplog)


def test_eviction_removes_stamps_with_their_entries(range_http_server, tmp_path, monkeypatch):
    """The least recently used entry goes with its stamp (a hit marks its
    stamp used: the entry's own times are the stamp's record); a stamp
    without its entry, and a stamp's temporary file whose writer is gone,
    are removed; a stamp's temporary file still locked is kept."""
    import fcntl
    urls, paths = zip(*(_serve(range_http_server, v, f"m{v}.safetensors") for v in (1, 2, 3)))
    size = paths[0].stat().st_size
    monkeypatch.setenv("INSTANT_STAGING_CACHE_MAX_BYTES", str(2 * size + size // 2))  # two fit
    cache = tmp_path / "cache"
    first = _stamped(urls[0], cache)
    time.sleep(0.02)
    _stamped(urls[1], cache)
    time.sleep(0.02)
    _load(urls[0], cache)                       # used after the second
    orphan = cache / ("0" * 64 + "." + "0" * 16 + _cache.STAMP_SUFFIX)
    orphan.write_bytes(_stamp(first).read_bytes())
    gone = cache / ("1" * 64 + "." + "1" * 16 + _cache.STAMP_SUFFIX + "-" + "2" * 16)
    gone.write_bytes(b"")
    held = cache / ("3" * 64 + "." + "3" * 16 + _cache.STAMP_SUFFIX + "-" + "4" * 16)
    held.write_bytes(b"")
    fd = os.open(held, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)          # (its writer at work)
        time.sleep(0.02)
        third = _filled(urls[2], cache)
    finally:
        os.close(fd)
    left = set(_files(cache)) - {_stamp(third).name}    # (the finisher's, if the clock ticked)
    assert left == {first.name, _stamp(first).name, third.name, held.name}, left
    assert _has_stamp(first)


def test_a_link_at_a_stamp_name_is_not_followed(range_http_server, tmp_path, monkeypatch):
    """A stamp reached through a link is none (the entry checked in full),
    and the stamp then written replaces the link: its target is not written."""
    url, _ = _serve(range_http_server)
    cache = tmp_path / "cache"
    entry = _stamped(url, cache)
    stamp = _stamp(entry)
    record = tmp_path / "record"
    record.write_bytes(stamp.read_bytes())      # a record that fits, outside the cache
    os.utime(record, ns=(0, 0))
    victim = _victim(tmp_path)
    checks = _spy_checks(monkeypatch)
    for n, target in enumerate((record, victim), 1):
        stamp.unlink()
        stamp.symlink_to(target)
        got, report = _load(url, cache)
        same(got, _model(1))
        assert report.cache_hit_bytes == TENSORS * CHUNK and len(checks) == n
        assert not stamp.is_symlink() and _has_stamp(entry)
    assert record.stat().st_mtime_ns == 0       # (not marked used through the link either)
    assert victim.read_bytes() == b"the user's own file\n"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600


def test_an_entry_of_an_earlier_version_is_filled_again_quietly(range_http_server, tmp_path,
                                                                caplog):
    url, path = _serve(range_http_server)
    cache = tmp_path / "cache"
    entry = _filled(url, cache)
    entry.write_bytes(path.read_bytes())                # the object alone: no digest
    caplog.set_level(logging.WARNING, logger="instant_staging")
    got, report = _load(url, cache)
    same(got, _model(1))
    assert report.fetched_bytes == TENSORS * CHUNK and not _warnings(caplog)
    assert _object(entry) == path.read_bytes()


def test_a_damaged_entry_among_hits_is_fetched_alone(s3_server, s3_bucket, tmp_path, caplog):
    files = [("model-00001-of-00002.safetensors", _model(1)),
             ("model-00002-of-00002.safetensors", {f"u{n}": t for n, t in _model(2).items()})]
    upload(put_in(s3_server, s3_bucket), "h", files, tmp_path)
    url, cache = f"s3://{s3_bucket}/h/", tmp_path / "cache"
    opts = _options(s3_server.url)
    load_file(url, storage_options=opts, cache_dir=cache, chunk_size=CHUNK)
    entries = _entries(cache)
    assert len(entries) == 2
    for name in entries:            # the second shard's entry damaged
        if b'"ut0"' in _object(cache / name):
            _flip_a_data_byte(cache / name, _object(cache / name))
    caplog.set_level(logging.WARNING, logger="instant_staging")
    with iter_load(url, storage_options=opts, cache_dir=cache, chunk_size=CHUNK) as it:
        got = dict(it)
    same(got, {**files[0][1], **files[1][1]})
    assert (it.report.cache_hit_bytes, it.report.fetched_bytes) == (TENSORS * CHUNK,) * 2
    assert len(_warnings(caplog)) == 1


def test_verify_on_a_hit_compares_with_the_server(range_http_server, tmp_path):
    """The entry's bytes are the server's as the fill fetched them; an
    object rewritten with the same ETag (this server's: mtime and size)
    is still the entry on a hit, but ``verify=`` asks the server, so it
    sees the difference (compared with the entry itself, it could not)."""
    url, path = _serve(range_http_server)
    cache = tmp_path / "cache"
    _filled(url, cache)
    st = path.stat()
    safetensors_torch.save_file(_model(2), str(path))
    os.utime(path, ns=(st.st_mtime_ns, st.st_mtime_ns))     # same size, same ETag
    got, report = _load(url, cache)
    same(got, _model(1))                                    # the hit: the ETag is the contract
    assert report.cache_hit_bytes == TENSORS * CHUNK
    range_http_server.reset_counts()
    with pytest.raises(VerifyError, match="differ"):
        load_file(url, "cpu", cache_dir=cache, chunk_size=CHUNK, verify=True)
    assert any(r.range and not r.range.startswith("bytes=0-") for r in range_http_server.requests)
    with Checkpoint.open(url, cache_dir=cache) as ck, pytest.raises(VerifyError):
        ck.load("cpu", verify=True)


def test_verify_on_a_hit_passes_where_the_server_agrees(range_http_server, tmp_path):
    url, _ = _serve(range_http_server)
    cache = tmp_path / "cache"
    _filled(url, cache)
    with Checkpoint.open(url, cache_dir=cache) as ck:
        same(ck.load("cpu", verify=True, chunk_size=CHUNK), _model(1))
        assert ck.last_report.cache_hit_bytes == TENSORS * CHUNK


# -- the fill: only a whole object, checked, flushed, named, its directory flushed ---------

def test_the_first_and_last_tensors_leave_no_entry(range_http_server, tmp_path, caplog):
    url, _ = _serve(range_http_server)
    cache = tmp_path / "cache"
    caplog.set_level(logging.WARNING, logger="instant_staging")
    with Checkpoint.open(url, cache_dir=cache) as ck:
        same(ck.load("cpu", names=["t0", f"t{TENSORS - 1}"], chunk_size=CHUNK),
             {n: t for n, t in _model(1).items() if n in ("t0", f"t{TENSORS - 1}")})
    assert _files(cache) == [] and not _warnings(caplog)   # a hole: neither entry nor partial
    got, report = _load(url, cache)
    same(got, _model(1))
    assert report.fetched_bytes == TENSORS * CHUNK


def test_an_object_whose_digest_has_a_hole_is_not_named(range_http_server, tmp_path, caplog):
    """The finisher names nothing its digest does not cover, whatever the
    fill's coverage said (two checks of one rule)."""
    url, _ = _serve(range_http_server)
    cache = tmp_path / "cache"
    caplog.set_level(logging.WARNING, logger="instant_staging")
    with Checkpoint.open(url, cache_dir=cache) as ck:
        ck.load("cpu", chunk_size=CHUNK)
        ck._shards.cache._writers.drain()      # (the fill's writes, made beside the load)
        (fill,) = ck._shards.cache._fills.values()
        digests = sorted(fill.digests)
        assert len(digests) > 3 and fill.whole
        del digests[len(digests) // 2]          # (a range's record lost: its bytes unchecked)
        fill.digests = digests
    assert _files(cache) == []
    assert any("no fill wrote" in m for m in _warnings(caplog)), _warnings(caplog)


@pytest.mark.parametrize("change", [+(1 << 20), -100], ids=["longer", "shorter"])
def test_a_partial_file_of_another_size_is_not_named(range_http_server, tmp_path, caplog, change):
    url, path = _serve(range_http_server)
    cache = tmp_path / "cache"
    size = path.stat().st_size
    caplog.set_level(logging.WARNING, logger="instant_staging")
    with Checkpoint.open(url, cache_dir=cache) as ck:
        ck.load("cpu", chunk_size=CHUNK)
        ck._shards.cache._writers.drain()      # (no write of the fill after the truncate)
        (partial,) = [n for n in os.listdir(cache) if n.endswith(_cache.PARTIAL_SUFFIX)]
        os.truncate(cache / partial, size + change)     # (another program, a bad disk)
    assert _files(cache) == []
    assert any(f"not {size} bytes" in m for m in _warnings(caplog)), _warnings(caplog)


def test_the_directory_is_flushed_after_the_rename(range_http_server, tmp_path, monkeypatch):
    url, _ = _serve(range_http_server)
    cache = tmp_path / "cache"
    events = []
    fsync, rename = os.fsync, os.rename

    def spy_fsync(fd):
        st = os.fstat(fd)
        events.append(("fsync", "dir" if stat.S_ISDIR(st.st_mode) else "file", st.st_ino))
        return fsync(fd)

    def spy_rename(a, b):
        events.append(("rename", os.path.basename(a), os.path.basename(b)))
        return rename(a, b)
    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "rename", spy_rename)
    entry = _filled(url, cache)
    monkeypatch.undo()
    renamed = events.index(("rename", entry.name[:-len(".safetensors")] + ".partial", entry.name))
    assert ("fsync", "file", entry.stat().st_ino) in events[:renamed]
    assert ("fsync", "dir", cache.stat().st_ino) in events[renamed + 1:], events


def test_an_object_without_an_etag_is_not_cached(range_http_server, tmp_path, caplog):
    url, _ = _serve(range_http_server)
    range_http_server.send_etag = False
    cache = tmp_path / "cache"
    caplog.set_level(logging.WARNING, logger="instant_staging")
    for _ in range(2):
        got, report = _load(url, cache)
        same(got, _model(1))
        assert report.cache_hit_bytes == 0
    assert _files(cache) == []
    # Said, once per load, and as what it is: the cache is not used for it,
    # not only that a change is seen by Last-Modified (issue 55).
    said = [r.getMessage() for r in caplog.records if "no ETag" in r.getMessage()]
    assert len(said) == 2 and all(f"the cache in {cache} is not used for it" in m for m in said), said


def test_a_short_read_of_an_entry_is_fetched(s3_server, s3_bucket, tmp_path, caplog):
    """An entry cut short after the open checked it (its descriptor open):
    the range it no longer has is fetched, never given as zeros."""
    files = [("model-00001-of-00002.safetensors", _model(1)),
             ("model-00002-of-00002.safetensors", {f"u{n}": t for n, t in _model(2).items()})]
    upload(put_in(s3_server, s3_bucket), "s", files, tmp_path)
    url, cache = f"s3://{s3_bucket}/s/", tmp_path / "cache"
    opts = _options(s3_server.url)
    load_file(url + files[0][0], storage_options=opts, cache_dir=cache)   # one shard's entry
    (entry,) = _entries(cache)
    caplog.set_level(logging.WARNING, logger="instant_staging")
    with Checkpoint.open(url, storage_options=opts, cache_dir=cache) as ck:
        os.truncate(cache / entry, 4 * CHUNK)
        got = ck.load("cpu", chunk_size=CHUNK)
    same(got, {**files[0][1], **files[1][1]})
    assert any("ended at byte" in m for m in _warnings(caplog)), _warnings(caplog)


# -- finding 4: what an attacker who can write the directory could plant -------------------

def _victim(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"the user's own file\n")
    victim.chmod(0o600)
    return victim


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_a_file_planted_at_a_partial_name_is_never_written(range_http_server, tmp_path, how):
    url, path = _serve(range_http_server)
    cache = tmp_path / "cache"
    entry = _filled(url, cache)
    entry.unlink()              # the name of the next fill's partial file is known
    partial = cache / (entry.name[:-len(".safetensors")] + ".partial")
    victim = _victim(tmp_path)
    (os.symlink if how == "symlink" else os.link)(victim, partial)
    got, _ = _load(url, cache)
    same(got, _model(1))
    assert victim.read_bytes() == b"the user's own file\n"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert _entries(cache) == [entry.name] and _object(entry) == path.read_bytes()
    assert not os.path.lexists(partial) and not entry.is_symlink()


def test_a_link_at_an_entry_name_is_not_followed(range_http_server, tmp_path):
    url, _ = _serve(range_http_server)
    cache = tmp_path / "cache"
    entry = _filled(url, cache)
    elsewhere = tmp_path / "elsewhere"
    entry.rename(elsewhere)                     # a whole entry, but not in the cache
    entry.symlink_to(elsewhere)
    got, report = _load(url, cache)
    same(got, _model(1))
    assert report.fetched_bytes == TENSORS * CHUNK          # not served through the link
    assert not entry.is_symlink() and _entries(cache) == [entry.name]


def test_the_cache_directory_is_made_private(range_http_server, tmp_path):
    url, _ = _serve(range_http_server)
    cache = tmp_path / "new" / "cache"
    _filled(url, cache)
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    # a directory the user made keeps its mode
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    mine.chmod(0o755)
    _filled(url, mine)
    assert stat.S_IMODE(mine.stat().st_mode) == 0o755
