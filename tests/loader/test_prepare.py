"""A load made ready, as a value (loader/_prepare.py): ``Prepared``, and the
two process-group entries, which prepare inside the ranks' first agreement.

A bad device or bad options on one rank of a 2-rank gloo group, through
``iter_load(..., process_group=)`` and ``Checkpoint.iter_load(...,
process_group=)``: every rank raises within seconds with
``INSTANT_STAGING_DIST_TIMEOUT`` left at its default (600 s), and nothing
is left open.
"""

import dataclasses
import json
import os
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from instant_staging.loader import LoadOptions, _prepare, _shards
from instant_staging.loader._options import KNOBS

from support.ranks import free_port, rank_env, run_ranks
from support.tensors import CHUNK, SimTarget, save

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def checkpoint(tmp_path):
    path = save(tmp_path, {f"t{i}": torch.full((1000,), i, dtype=torch.int32) for i in range(6)})
    shards = _shards.Shards().open([path])
    yield path, shards
    shards.close()


def test_prepared_is_immutable(checkpoint):
    from instant_staging.testing import SimulatedRuntime
    _, shards = checkpoint
    target = SimTarget(SimulatedRuntime())
    options = LoadOptions(CHUNK, 4, 2)
    prepared = _prepare.prepare_share(shards.share(lambda: None), target, options)
    with pytest.raises(dataclasses.FrozenInstanceError):
        prepared.options = options          # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        prepared.reads = None               # type: ignore[misc]


def test_a_share_leaves_the_reads_to_the_group_and_samples_only_where_tuned(checkpoint):
    from instant_staging.testing import SimulatedRuntime
    _, shards = checkpoint
    target = SimTarget(SimulatedRuntime())
    untuned = _prepare.prepare_share(shards.share(lambda: None), target,
                                     LoadOptions(CHUNK, 4, 2))
    assert untuned.reads is None            # the group plans every rank's reads
    assert untuned.resident is False        # a knob set: no sample of the page cache
    tuned = _prepare.prepare_share(shards.share(lambda: None), target,
                                   LoadOptions(CHUNK, 4, 2, left=KNOBS), names=["t1", "t3"])
    assert tuned.resident is None or 0.0 <= tuned.resident <= 1.0
    assert [t.name for _, t in tuned.shards.entries] == ["t1", "t3"]
    assert len(tuned.dtypes) == 2


def test_a_solo_load_is_planned_and_its_buffer_given_back_when_dropped(checkpoint):
    from instant_staging.loader import _staging_pool
    from instant_staging.testing import SimulatedRuntime
    rt = SimulatedRuntime()
    _, shards = checkpoint
    target = SimTarget(rt)
    prepared = _prepare.prepare_solo(shards.share(lambda: None), target,
                                     LoadOptions(CHUNK, 4, 2))
    assert prepared.reads is not None and prepared.reads.plan.total_bytes == shards.total_bytes
    assert prepared.reads.staging is not None     # a GPU load given none: its own, being made
    prepared.abandon()
    assert prepared.reads.staging is None
    _staging_pool.empty_cache()
    assert rt.live_registrations == 0 and rt.live_host_allocs == 0


def test_preparing_that_fails_closes_the_share(checkpoint):
    from instant_staging.testing import SimulatedRuntime
    _, shards = checkpoint
    closed = []
    share = shards.share(lambda: closed.append(True))
    with pytest.raises(KeyError):
        _prepare.prepare_solo(share, SimTarget(SimulatedRuntime()),
                              LoadOptions(CHUNK, 4, 2), names=["nope"])
    assert closed == [True]


# -- both group entries prepare inside the first agreement ----------------------------

WORKER = textwrap.dedent("""
    import json, os, sys, threading, time
    import torch.distributed as dist
    from instant_staging.loader import Checkpoint, iter_load

    path, rank, entry, bad, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", rank=rank, world_size=2)
    fds = set(os.listdir("/proc/self/fd"))
    threads = threading.active_count()
    device, options = "cpu", {}
    if rank == 1 and bad == "device":
        device = "cuda:0"           # no GPU on this host: not available
    if rank == 1 and bad == "options":
        options = {"threads": 0}
    began = time.monotonic()
    try:
        if entry == "module":
            it = iter_load(path, device, process_group=dist.group.WORLD, **options)
        else:
            with Checkpoint.open(path) as ck:
                it = ck.iter_load(device, process_group=dist.group.WORLD, **options)
        with it:
            dict(it)
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - began
    left = sorted(set(os.listdir("/proc/self/fd")) - fds)
    with open(out, "w") as f:
        json.dump({"error": error, "seconds": seconds, "fds": left,
                   "threads": threading.active_count() - threads}, f)
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("bad", ["device", "options"])
@pytest.mark.parametrize("entry", ["module", "checkpoint"])
def test_a_bad_rank_raises_on_every_rank_within_seconds(tmp_path, entry, bad):
    path = save(tmp_path, {f"t{i}": torch.full((1000,), i, dtype=torch.int32) for i in range(6)})
    env = rank_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), CUDA_VISIBLE_DEVICES="",
                   INSTANT_STAGING_DIST_TIMEOUT=None)      # the default: 600 s
    outs = [str(tmp_path / f"rank{r}.json") for r in range(2)]
    # (cwd: not the checkout, whose unbuilt source tree `python -c` would import)
    run_ranks(lambda r: [sys.executable, "-c", WORKER, path, str(r), entry, bad, outs[r]], 2, env,
              cwd=str(tmp_path), timeout=120)
    got = []
    for o in outs:
        with open(o) as f:
            got.append(json.load(f))
    words = "not available" if bad == "device" else "threads"
    assert words in got[1]["error"], got[1]
    assert "DistributedLoadError" in got[0]["error"] and "rank 1" in got[0]["error"], got[0]
    assert words in got[0]["error"]             # the other rank is told why
    for rec in got:
        assert rec["seconds"] < 30, rec         # not INSTANT_STAGING_DIST_TIMEOUT's 600 s
        assert rec["fds"] == [] and rec["threads"] <= 0, rec


@pytest.mark.parametrize("entry", ["module", "checkpoint"])
def test_a_group_refused_before_any_agreement_leaves_no_file_open(tmp_path, entry):
    # Preparing (the files opened and held) comes before the group is
    # looked at: a refused group gives the held share back.
    from instant_staging.loader import Checkpoint, iter_load
    path = save(tmp_path, {"a": torch.ones(3)})

    def open_on_path():
        return sum(os.path.realpath(os.path.join("/proc/self/fd", fd)) == os.path.realpath(path)
                   for fd in os.listdir("/proc/self/fd"))
    with pytest.raises((TypeError, RuntimeError), match=r"ProcessGroup|not initialized"):
        if entry == "module":
            iter_load(path, process_group="world")
        else:
            with Checkpoint.open(path) as ck:
                ck.iter_load(process_group="world")
    assert open_on_path() == 0
