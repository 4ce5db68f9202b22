"""Loading under a process group (loader/_distributed.py) on the CPU with gloo.

The share plan is checked alone (tests/loader/test_share_plan.py).  The load itself
runs in 2 and 3 real processes (tests/loader/_dist_worker.py, a gloo group over
a free port), each world running every scenario in one group so that the
processes start once: replicated loads, per-rank ``names=``, uneven
shards, more ranks than tensors, a rank with a bad file, another layout
or an unknown name, a rank whose file shrinks under it, a rank whose read
fails (INSTANT_STAGING_FAULTS='read#1=EIO' there only), a rank whose
staging buffer is unusable, a rank that falls back to RUNTIME_PINNED, a
rank that never comes, and a load after all of those; every tensor
compared with safetensors' own.
"""

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")
dist = pytest.importorskip("torch.distributed")

from instant_staging.loader import DistributedLoadError, load_file
from instant_staging.loader import _distributed as D

from support.ranks import free_port, rank_env, run_ranks
from support.tensors import random_tensor as rand

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_dist_worker.py")
TESTS = os.path.dirname(os.path.dirname(WORKER))       # the worker imports support.calls
TIMEOUT = 5       # INSTANT_STAGING_DIST_TIMEOUT of the workers: the "timeout" scenario waits this


# -- a rank's selection -------------------------------------------------------

@pytest.mark.parametrize("count", [0, 1, 7, 8, 9, 64, 1000])
def test_a_ranks_selection_travels_as_a_mask_of_its_places(tmp_path, count):
    # _wanted's mask (bit k: place k in all_entries) and _places read back
    # the same places, for everything and for any selection; made from the
    # selection alone (the checkpoint's places table), not a walk of all.
    import random

    import torch
    from safetensors.torch import save_file

    from instant_staging.loader import _shards
    path = str(tmp_path / "m.safetensors")
    save_file({f"t{k:04d}": torch.tensor([k % 256], dtype=torch.uint8) for k in range(count)}
              | {"zz": torch.zeros(0)}, path)
    ck = _shards.Shards().open([path])
    try:
        n = len(ck.all_entries)
        assert D._places(D._wanted(ck)[0]) == list(range(n)) and D._wanted(ck)[1] == {}
        names = [t.name for _, t in ck.all_entries]
        rng = random.Random(count)
        for _ in range(5):
            share = ck.share(lambda: None)
            share.select(rng.sample(names, rng.randint(0, n)))
            places = ck.name_places()
            assert D._places(D._wanted(share)[0]) == sorted(places[t.name] for _, t in share.entries)
            assert len(D._wanted(share)[0]) == (n + 7) // 8
    finally:
        ck.close()


# -- without torch.distributed set up ------------------------------------------

def test_group_arguments(tmp_path):
    path = str(tmp_path / "a.safetensors")
    st.save_file({"a": torch.ones(3)}, path)
    with pytest.raises(RuntimeError, match="not initialized"):
        load_file(path, process_group=object())
    assert load_file(path, process_group=None)["a"].tolist() == [1, 1, 1]


def test_timeout_env(monkeypatch):
    monkeypatch.setenv("INSTANT_STAGING_DIST_TIMEOUT", "2.5")
    assert D.timeout_from_env() == 2.5
    for bad in ("soon", "0", "-1"):
        monkeypatch.setenv("INSTANT_STAGING_DIST_TIMEOUT", bad)
        with pytest.raises(ValueError, match="INSTANT_STAGING_DIST_TIMEOUT"):
            D.timeout_from_env()
    monkeypatch.delenv("INSTANT_STAGING_DIST_TIMEOUT")
    assert D.timeout_from_env() == D.DISTRIBUTED_TIMEOUT


def test_the_ranks_agree_on_the_cold_knobs():
    # Every rank computes this from every rank's post: one answer for all.
    from instant_staging import defaults
    cold = {"chunk_size": defaults.COLD_CHUNK_SIZE, "io_depth": None,
            "threads": defaults.COLD_THREADS}
    assert D._for_cache([0.0, 0.25]) == cold             # cold on average
    assert D._for_cache([0.0, 1.0, 1.0]) == {}           # hot on average
    assert D._for_cache([0.0, False]) == {}              # a rank set a knob: nobody switches
    assert D._for_cache([None, 0.0]) == cold             # a rank that cannot tell does not vote
    assert D._for_cache([None, None]) == {}


def test_a_group_loads_samples_the_cache_only_where_no_knob_is_set(tmp_path, monkeypatch):
    from instant_staging.loader import _load
    path = str(tmp_path / "a.safetensors")
    st.save_file({"a": torch.ones(3)}, path)
    seen = []

    def group(prepared, process_group):
        seen.append(prepared.resident)
        prepared.shards.close()
        raise RuntimeError("stop")
    monkeypatch.setattr(D, "iter_load_group", group)
    for kw in ({}, {"threads": 2}):
        with pytest.raises(RuntimeError, match="stop"):
            _load.iter_load(path, process_group=object(), **kw)
    assert seen[0] in (1.0, None) and seen[1] is False     # False: a knob set, no sample


def test_error_pickles():
    import pickle
    e = pickle.loads(pickle.dumps(DistributedLoadError("rank 1 failed", {1: "EIO"})))
    assert e.ranks == {1: "EIO"} and str(e) == "rank 1 failed"


# -- real groups -----------------------------------------------------------------

def make_files(d):
    """Three shards of uneven size (one big, one of many mixed tensors, one
    of odd ones), a one-tensor file, a medium file, a bad and another one."""
    shards = [
        {"model.embed_tokens.weight": rand(torch.bfloat16, (300, 64), 1)},
        {**{f"model.layers.{i}.{n}": rand(dt, shape, 10 * i + j)
            for i in range(3)
            for j, (n, dt, shape) in enumerate([
                ("input_layernorm.weight", torch.bfloat16, (64,)),
                ("self_attn.q_proj.weight", torch.bfloat16, (64, 64)),
                ("mlp.up_proj.weight", torch.float16, (96, 64)),
                ("mlp.gate.bias", torch.float32, (7,)),
                ("post_attention_layernorm.weight", torch.float32, (64,))])}},
        {"scalar": torch.tensor(3.5, dtype=torch.float64), "empty": torch.empty(0, 4),
         "mask": torch.tensor([True, False, True]), "ids": rand(torch.int64, (13,), 5),
         "lm_head.weight": rand(torch.bfloat16, (100, 64), 6)},
    ]
    files = {"shards": []}
    os.makedirs(os.path.join(d, "model"))        # a directory of the shards alone
    for i, tensors in enumerate(shards):
        path = os.path.join(d, "model", f"model-{i}.safetensors")
        st.save_file(tensors, path)
        files["shards"].append(path)
    for key, tensors in (("tiny", {"x": torch.tensor([1, 2, 3], dtype=torch.uint8)}),
                         ("single", {f"w{i}": rand(torch.float32, (97, 33 + i), 40 + i) for i in range(12)}),
                         ("other", {f"w{i}": rand(torch.float32, (33 + i, 97), 40 + i) for i in range(12)})):
        files[key] = os.path.join(d, f"{key}.safetensors")
        st.save_file(tensors, files[key])
    single = {f"w{i}": rand(torch.float32, (97, 33 + i), 40 + i) for i in range(12)}
    for key, note in (("meta_a", "a"), ("meta_b", "b")):
        files[key] = os.path.join(d, f"{key}.safetensors")
        st.save_file(single, files[key], metadata={"note": note})
    # The same bytes (512,000) as 100 tensors and as 4,000.
    for key, count in (("few", 100), ("many", 4000)):
        files[key] = os.path.join(d, f"{key}.safetensors")
        st.save_file({f"t{k:04d}": rand(torch.float32, (128000 // count,), 100 + k)
                      for k in range(count)}, files[key])
    files["bad"] = os.path.join(d, "bad.safetensors")
    with open(files["single"], "rb") as src, open(files["bad"], "wb") as dst:
        data = bytearray(src.read())
        data[8:9] = b"["                  # the header is no longer a JSON object
        dst.write(data)
    return files


SCENARIOS = ["replicated", "load_file", "progress_true", "dtype_and_directory", "names", "predicate",
             "nothing_on_one_rank", "tiny", "bad_file", "other_layout", "prefix_sources",
             "own_copies", "other_data", "other_last_page",
             "other_header", "other_dtype", "unsampled_change", "unknown_name", "plan_rows",
             "truncated", "written", "read_fault", "kinds", "staging_unusable", "subgroup", "not_a_group",
             "dropped", "leak_plan", "leak_pipeline", "leak_allocate", "leak_read", "leak_exchange",
             "leak_verify", "leak_close", "after_failures", "collectives", "blocks", "leak_midway",
             "timeout"]
BUCKET = 16 << 10           # the workers' bucket size (their files are ~100 KiB)
COUNT_BUCKET = 64 << 10     # and the collectives scenario's


def run_world(tmp, world):
    files = make_files(tmp)
    spec = dict(world=world, port=free_port(), out=tmp, files=files, scenarios=SCENARIOS,
                bucket=BUCKET, count_bucket=COUNT_BUCKET)
    spec_path = os.path.join(tmp, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    run_ranks(lambda r: [sys.executable, WORKER, spec_path, str(r)], world,
              rank_env(INSTANT_STAGING_DIST_TIMEOUT=str(TIMEOUT)), cwd=tmp)
    results = []
    for r in range(world):
        with open(os.path.join(tmp, f"rank{r}.json")) as f:
            results.append(json.load(f))
    return files, results


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"{w}ranks")
def world(request, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp(f"dist{request.param}"))
    files, results = run_world(tmp, request.param)
    return request.param, files, results


def scenario(world, name):
    return [r[name] for r in world[2]]


def assert_all_equal(recs):
    for r, rec in enumerate(recs):
        assert rec["ok"], f"rank {r}: {rec}"
        assert rec["equal"] and rec.get("owns", True), f"rank {r}: {rec}"


def test_replicated(world):
    n, files, _ = world
    recs = scenario(world, "replicated")
    assert_all_equal(recs)
    total = sum(os.path.getsize(p) for p in files["shards"])
    shares = [rec["read_bytes"] for rec in recs]
    data = sum(t.numel() * t.element_size() for p in files["shards"] for t in st.load_file(p).values())
    assert sum(shares) == data < total                 # each byte read once, by one rank
    assert max(shares) <= data / n * 1.3               # balanced (cuts snap to tensors)
    assert all(rec["kinds"] == [None] * n for rec in recs)
    recs = scenario(world, "load_file")
    assert_all_equal(recs)
    for rec, share in zip(recs, shares):      # progress: this rank's reads, ending complete
        done = [d for d, _ in rec["progress"]]
        assert done == sorted(done) and rec["progress"][-1] == [share, share]


def test_progress_true_lines_name_their_rank_and_the_whole(world):
    # Each rank prints its own share's progress; every line says whose it is
    # and what the whole load is (the lines were unlabelled, each rank's share
    # shown as the total: "loaded 100%: 256 MiB of 256 MiB" twice for 512 MiB).
    from instant_staging import format_size
    n = world[0]
    recs = scenario(world, "progress_true")
    assert_all_equal(recs)
    shares = [rec["read_bytes"] for rec in scenario(world, "replicated")]
    whole = format_size(sum(shares))
    for r, (rec, share) in enumerate(zip(recs, shares)):
        lines = [line for line in rec["lines"] if "loaded" in line]
        assert lines, rec["lines"]
        for line in lines:
            assert line.startswith(f"rank {r} of {n}: loaded "), line
            assert f"(its share of {whole})" in line, line
        assert lines[-1].startswith(f"rank {r} of {n}: loaded 100%: {format_size(share)} of "
                                    f"{format_size(share)} (its share of {whole})"), lines


def test_dtype_and_directory(world):
    assert_all_equal(scenario(world, "dtype_and_directory"))


def test_per_rank_names(world):
    recs = scenario(world, "names")
    assert_all_equal(recs)
    assert all(any("norm" in k for k in rec["names"]) for rec in recs)
    assert_all_equal(scenario(world, "predicate"))
    recs = scenario(world, "nothing_on_one_rank")
    assert_all_equal(recs)
    assert recs[-1]["names"] == [] and recs[-1]["read_bytes"] == 0


def test_more_ranks_than_tensors(world):
    recs = scenario(world, "tiny")
    assert_all_equal(recs)
    assert sorted(rec["read_bytes"] for rec in recs) == [0] * (world[0] - 1) + [3]


def test_bad_file_on_one_rank(world):
    n = world[0]
    recs = scenario(world, "bad_file")
    assert recs[-1]["error"] == "SafetensorsError"
    for rec in recs[:-1]:
        assert rec["error"] == "DistributedLoadError" and rec["ranks"] == [n - 1]
        assert "SafetensorsError" in rec["message"] and "bad.safetensors" in rec["message"]


def test_other_layout_on_one_rank(world):
    for rec in scenario(world, "other_layout"):
        assert rec["error"] == "DistributedLoadError" and rec["ranks"] == [1]
        assert "different checkpoints" in rec["message"]


def test_copies_at_other_paths_are_the_same_checkpoint(world):
    assert_all_equal(scenario(world, "own_copies"))


@pytest.mark.parametrize("name, words", [
    ("other_data", ["other_data-rank1.safetensors", "sampled data pages"]),
    ("other_last_page", ["other_last_page-rank1.safetensors", "sampled data pages"]),
    ("other_header", ["meta_b.safetensors", "header"]),
    ("other_dtype", ["dtype"]),
])
def test_other_contents_on_one_rank_are_an_error_on_every_rank(world, name, words):
    """The ranks compare what they load, not its paths: a file whose data
    or header differs on one rank (the same layout), or another dtype=, is
    a DistributedLoadError on every rank naming the rank and the file,
    before any byte is exchanged (never a mix of two checkpoints)."""
    for r, rec in enumerate(scenario(world, name)):
        assert rec["error"] == "DistributedLoadError" and rec["ranks"] == [1], f"rank {r}: {rec}"
        assert "different checkpoints" in rec["message"], rec["message"]
        for word in words:
            assert word in rec["message"], rec["message"]


def test_sources_that_are_a_prefix_of_rank_0s_are_refused_on_every_rank(world):
    # rank 0 loads [a, b], rank 1 [a]: "different checkpoints", never an IndexError
    for r, rec in enumerate(scenario(world, "prefix_sources")):
        assert rec["error"] == "DistributedLoadError" and rec["ranks"] == [1], f"rank {r}: {rec}"
        assert "different checkpoints" in rec["message"], rec["message"]


def test_the_content_check_compares_the_file_counts():
    one = [("a.safetensors", 10, "h", "p", None)]      # (None: a file, no URL's ETag)
    two = one + [("b.safetensors", 20, "h2", "p2", None)]
    assert D._differences([two, one], ["x", "x"]) == {1: "1 file(s) where rank 0 has 2"}
    assert D._differences([one, two], ["x", "x"]) == {1: "2 file(s) where rank 0 has 1"}
    assert D._differences([two, two], ["x", "x"]) == {}


def test_the_identity_sees_the_last_data_page(tmp_path):
    from instant_staging.loader import Checkpoint
    path = str(tmp_path / "m.safetensors")
    st.save_file({f"w{i}": rand(torch.float32, (97, 33 + i), 40 + i) for i in range(12)}, path)

    def identity():
        with Checkpoint.open(path) as ck:
            return D._contents(ck._shards)[0]
    before = identity()
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte ^ 0xFF]))
    after = identity()
    assert after[:3] == before[:3] and after[3] != before[3]


def test_a_change_between_the_sampled_pages_is_caught_by_verify(world):
    """What the sampled identity cannot see (one byte elsewhere in the data),
    verify= does: the rank whose tensor came from the other file fails."""
    recs = scenario(world, "unsampled_change")
    assert not all(rec["ok"] for rec in recs), recs
    assert any(rec.get("error") == "VerifyError" for rec in recs), recs


def test_unknown_name_on_one_rank(world):
    recs = scenario(world, "unknown_name")
    assert recs[0]["error"] == "KeyError"
    assert all(rec["error"] == "DistributedLoadError" and rec["ranks"] == [0] for rec in recs[1:])


def test_each_rank_its_own_rows_under_a_group(world):
    # plan= under a group: each rank gets the rows it asked for (once handed
    # out whole, without a word), bit for bit safetensors' get_slice, with
    # rows of one tensor that other ranks take whole, overlap or skip.
    recs = scenario(world, "plan_rows")
    assert all(rec["ok"] and rec["equal"] and rec["rows"] > 0 for rec in recs), recs
    # each byte some rank wants read once, by one of them
    assert sum(rec["read_bytes"] for rec in recs) == recs[0]["union_bytes"]


@pytest.mark.parametrize("name, words, error", [
    ("truncated", "truncated", "LoadError"),            # a read fails
    # the same bytes written back: it cannot know (reopen() says so)
    ("written", "written to while it was loaded", "CheckpointChangedError"),
])
def test_a_file_changed_mid_load_on_one_rank_is_an_error_on_every_rank(world, name, words, error):
    recs = scenario(world, name)
    assert recs[1]["error"] == error and words in recs[1]["message"]
    for r, rec in enumerate(recs):
        if r != 1:
            assert rec["error"] == "DistributedLoadError" and rec["ranks"] == [1], rec
            assert words in rec["message"]


def test_staging_kinds_reported(world):
    n = world[0]
    recs = scenario(world, "kinds")
    assert_all_equal(recs)
    for rec in recs:
        assert rec["kinds"] == ["RUNTIME_PINNED"] + ["REGISTERED"] * (n - 1)
        assert any("rank 0 RUNTIME_PINNED" in w and "fell back" in w for w in rec["warnings"])
        assert rec["leaks"] == [0, 0]


def test_read_fault_on_one_rank(world):
    # INSTANT_STAGING_FAULTS='read#1=EIO' on rank 1 only: its first chunk fails.
    recs = scenario(world, "read_fault")
    assert recs[1]["error"] == "LoadError" and "Input/output error" in recs[1]["message"]
    for r, rec in enumerate(recs):
        if r != 1:
            assert rec["error"] == "DistributedLoadError" and rec["ranks"] == [1], rec
            assert "Input/output error" in rec["message"]


def test_staging_unusable_on_one_rank(world):
    # Rank 1 passes a staging buffer too small for one chunk: it fails before
    # any read, and so does everyone else.
    recs = scenario(world, "staging_unusable")
    assert recs[1]["error"] == "ValueError" and "holds no chunk" in recs[1]["message"]
    assert recs[1]["leaks"] == [0, 0]
    for r, rec in enumerate(recs):
        if r != 1:
            assert rec["error"] == "DistributedLoadError" and rec["ranks"] == [1]
            assert "holds no chunk" in rec["message"]


def test_subgroup(world):
    # Ranks 1..n-1 load through their own group (group rank r is global rank
    # r + 1); rank 0, outside it, gets a ValueError and no one waits for it.
    recs = scenario(world, "subgroup")
    assert recs[0]["error"] == "ValueError" and "not a member" in recs[0]["message"]
    assert all(rec["ok"] and rec["equal"] for rec in recs[1:])


def test_not_a_group(world):
    for rec in scenario(world, "not_a_group"):
        assert rec["error"] == "TypeError" and "ProcessGroup" in rec["message"]


def test_iterator_closed_unstarted_on_one_rank(world):
    recs = scenario(world, "dropped")
    for r, rec in enumerate(recs):
        if r != 1:
            assert rec["error"] == "DistributedLoadError" and rec["ranks"] == [1]
            assert "closed its iterator" in rec["message"] and rec["seconds"] < TIMEOUT


def assert_left_nothing(rec, r):
    assert rec["alive"] == 0, f"rank {r}: tensors not freed: {rec}"
    assert rec["open"] == 0, f"rank {r}: the checkpoint's files still open: {rec}"
    assert rec["held"] is False, f"rank {r}: the staging buffer still held: {rec}"
    assert rec["leaks"] == [0, 0], f"rank {r}: registrations, host allocations: {rec}"


@pytest.mark.parametrize("name, error, words", [
    ("leak_plan", "RuntimeError", "injected: plan"),
    ("leak_pipeline", "RuntimeError", "injected: pipeline"),
    ("leak_allocate", "MemoryError", "injected: allocation 4 failed"),
    ("leak_read", "LoadError", "Input/output error"),
    ("leak_exchange", "KeyboardInterrupt", "interrupted while exchanging: KeyboardInterrupt"),
])
def test_a_failure_at_each_step_of_a_group_load_leaves_nothing(world, name, error, words):
    """The group's strategy (loader/_distributed.py's _Shared) in the one
    skeleton (loader/_run.py's run): rank 1 fails at one step; it raises its
    own error, every other rank a DistributedLoadError naming it (at once,
    not after the timeout), and no rank's load leaves a tensor, a file, a
    held staging buffer or a registration behind."""
    recs = scenario(world, name)
    assert recs[1]["error"] == error, recs[1]
    for r, rec in enumerate(recs):
        if r != 1:
            assert rec["error"] == "DistributedLoadError" and rec["ranks"] == [1], f"rank {r}: {rec}"
            assert words in rec["message"], f"rank {r}: {rec}"
        assert rec["seconds"] < TIMEOUT, f"rank {r} waited for the timeout: {rec}"
        assert_left_nothing(rec, r)
    if name in ("leak_allocate", "leak_read", "leak_exchange"):
        assert all(rec["allocated"] for rec in recs)      # (tensors there were, and went)


def test_a_group_load_ended_while_handing_out_leaves_nothing(world):
    # After the last agreement only this rank is concerned: a verify= error
    # on rank 1 (the others finish), or every rank closing after one tensor.
    recs = scenario(world, "leak_verify")
    assert recs[1]["error"] == "VerifyError" and recs[1]["taken"] == 2, recs[1]
    for r, rec in enumerate(recs):
        if r != 1:
            assert rec["ok"], f"rank {r}: {rec}"
        assert_left_nothing(rec, r)
    for r, rec in enumerate(scenario(world, "leak_close")):
        assert rec["ok"] and rec["taken"] == 1 and rec["allocated"] > 1, f"rank {r}: {rec}"
        assert_left_nothing(rec, r)


def test_a_rank_that_stops_mid_exchange_is_an_error_on_every_rank_at_once(world):
    # Rank 1 is interrupted before its second bucket; the others, waiting
    # for a bucket it will never send (their slots full), see its post and
    # raise at once, naming it, instead of waiting for the timeout.
    recs = scenario(world, "leak_midway")
    assert recs[1]["error"] == "KeyboardInterrupt", recs[1]
    for r, rec in enumerate(recs):
        if r != 1:
            assert rec["error"] == "DistributedLoadError" and rec["ranks"] == [1], f"rank {r}: {rec}"
            assert "interrupted while exchanging: KeyboardInterrupt" in rec["message"], rec
        assert rec["seconds"] < TIMEOUT, f"rank {r} waited for the timeout: {rec}"
        assert_left_nothing(rec, r)


def test_collectives_follow_the_bytes_not_the_tensors(world):
    # 100 tensors or 4,000 of the same 512,000 bytes: the same collectives,
    # at most one per bucket of each rank's share (ceil(bytes / bucket) + world),
    # where there had been one per tensor.
    n = world[0]
    for r, rec in enumerate(scenario(world, "collectives")):
        assert rec["equal"] == [True, True], f"rank {r}: {rec}"
        few, many = rec["counts"]
        assert few == many <= -(-512000 // COUNT_BUCKET) + n, f"rank {r}: {rec}"
        assert few > 0
        # Nor a Python slice per tensor to hand a bucket's pieces out: a
        # piece that is a whole tensor is that tensor, a received bucket is
        # cut in one split; a slice per bucket, and one for each tensor that
        # straddles a bucket's end.
        assert rec["slices"][1] <= 3 * many, f"rank {r}: {rec}"


def test_tensors_in_blocks_are_a_copy_per_block_not_per_tensor(world):
    # A GPU's tensors are views of device blocks, in a group load as in a
    # solo one (here on CPU ranks, the GPU's rule patched in): a bucket's
    # pieces of one block are one slice and one copy, however many tensors.
    n = world[0]
    for r, rec in enumerate(scenario(world, "blocks")):
        assert rec["equal"] == [True] and rec["shards_equal"], f"rank {r}: {rec}"
        assert rec["counts"][0] <= -(-512000 // COUNT_BUCKET) + n, f"rank {r}: {rec}"
        # (the 4,000 tensors: a slice or two per bucket, where there was a
        # view of each tensor's)
        assert rec["slices"][0] <= 2 * rec["counts"][0] + 2, f"rank {r}: {rec}"
        assert rec["storages"] < rec["tensors"] / 2, f"rank {r}: {rec}"
        assert rec["names"]["ok"] and rec["names"]["equal"], f"rank {r}: {rec}"
        views_false = rec["views_false"]
        assert views_false["ok"] and views_false["equal"] and views_false["owns"], f"rank {r}: {rec}"
        rows = rec["plan_rows"]
        assert rows["ok"] and rows["equal"] and rows["rows"] > 0, f"rank {r}: {rec}"


def test_group_usable_after_failures(world):
    assert_all_equal(scenario(world, "after_failures"))


def test_rank_that_never_comes_is_named(world):
    n = world[0]
    recs = scenario(world, "timeout")
    for rec in recs[:-1]:
        assert rec["error"] == "DistributedLoadError" and rec["ranks"] == [n - 1]
        assert f"rank {n - 1}" in rec["message"] and "did not reach" in rec["message"]
        assert TIMEOUT - 0.5 <= rec["seconds"] <= TIMEOUT + 30


def test_the_group_benchmark_runs_on_cpu_ranks(tmp_path):
    # benchmarks/group_load.py, the one command the GPU runs take: its CPU
    # mode end to end (2 ranks, small tensors), every load bit-exact
    # against a solo load, both faults failing on every rank.
    script = os.path.join(os.path.dirname(TESTS), "benchmarks", "group_load.py")
    env = rank_env()
    done = subprocess.run([sys.executable, script, "--modes", "cpu", "--ranks", "2", "--tensor-bytes",
                           "4KiB", "--repeat", "1", "--dir", str(tmp_path), "--bucket", "1MiB"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines()
            if line.startswith("cpu ") and not line.endswith("done")]
    loads = [r for r in rows if r[2] in ("dense", "finemoe")]
    assert [r[2] for r in loads] == ["dense", "finemoe"] and all(r[-1] == "yes" for r in loads), rows
    assert loads[0][-2] == loads[1][-2]              # the same collectives for 291 tensors and 4,680
    faults = [r for r in rows if r not in loads]
    assert len(faults) == 2 and all("yes" in r for r in faults), rows
