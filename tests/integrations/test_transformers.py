"""integrations.transformers.from_pretrained against transformers' own.

Tiny models of several architectures (Llama, GPT-2, Qwen2 and Mistral, and
the MoE models Mixtral, Qwen2-MoE and Qwen3-MoE, whose per-expert checkpoint tensors
transformers 5 fuses on load; GPT-2 and Qwen2 with tied embeddings) are
saved with ``save_pretrained`` (one file, and sharded with an index) and
loaded on the CPU by both ``AutoModelForCausalLM.from_pretrained`` and
ours: the same class, parameters and buffers equal bit for bit (same
dtypes), the same tying, config and generation config, eval mode, and the
same logits for one input.  Then each argument users pass (device_map,
torch_dtype, revision with a hub id in a local huggingface_hub cache,
attn_implementation, trust_remote_code, a config without architectures)
against transformers given the same, and the errors.
"""

import gc
import json
import os
import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from instant_staging.integrations import transformers as integration
from instant_staging.integrations.transformers import _background, _placement, from_pretrained
from instant_staging.loader import _run

from support import ROOT, record_reads, run_script
from support.models import AUTO, assert_same_model, configs, save

# transformers 5 fuses per-expert MoE tensors and loads dtype="auto" by
# default; 4 (4.56 is the floor this package declares) does neither.
MAJOR = int(transformers.__version__.split(".")[0])


def checkpoint_names(path):
    from safetensors import safe_open
    names = []
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(path / f, framework="pt") as g:
                names += list(g.keys())
    return names


@pytest.fixture(params=["whole", "streamed"])
def handover(request, monkeypatch):
    """Each load handed to transformers whole, or streamed (the tiny test
    models' tensors are all small: whole unless the threshold is 0)."""
    from instant_staging.integrations import _whole
    if request.param == "streamed":
        monkeypatch.setattr(_whole, "WHOLE_BATCH_MEAN_BYTES", 0)
    return request.param


def test_the_model_dir_by_transformers_name(tmp_path):
    # from_pretrained(pretrained_model_name_or_path=...) as written for transformers'
    path, _ = save(tmp_path, "llama", sharded=False)
    ref = AUTO.from_pretrained(pretrained_model_name_or_path=path)
    ours = from_pretrained(pretrained_model_name_or_path=path, device="cpu")
    assert_same_model(ours, ref)
    assert ours.config.name_or_path == str(path)
    with pytest.raises(TypeError, match="not both"):
        from_pretrained(path, pretrained_model_name_or_path=path, device="cpu")
    with pytest.raises(TypeError, match="none given"):
        from_pretrained(device="cpu")


def test_transformers_own_progress_bar_is_not_drawn(tmp_path, monkeypatch, capfd):
    # (transformers 5 drew an empty "Loading weights: 0it" bar, counting nothing)
    path, _ = save(tmp_path, "llama", sharded=False)
    utils_logging = transformers.utils.logging
    monkeypatch.setattr(utils_logging, "_tqdm_active", True)     # whatever HF_HUB_DISABLE_PROGRESS_BARS says
    capfd.readouterr()
    from_pretrained(path, device="cpu")
    assert "Loading weights" not in capfd.readouterr().err
    assert utils_logging.is_progress_bar_enabled()               # on again after the call

    def fails(*args, **kwargs):
        raise RuntimeError("failed while loading")
    monkeypatch.setattr(integration, "assemble_while_reading", fails)
    with pytest.raises(RuntimeError, match="failed while loading"):
        from_pretrained(path, device="cpu")
    assert utils_logging.is_progress_bar_enabled()               # and after a failure
    monkeypatch.undo()
    monkeypatch.setattr(utils_logging, "_tqdm_active", False)    # bars the user turned off stay off
    from_pretrained(path, device="cpu")
    assert not utils_logging.is_progress_bar_enabled()


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2", "mistral", "mixtral", "qwen2_moe", "qwen3_moe"])
def test_same_model_as_transformers(tmp_path, arch, sharded):
    path, cls = save(tmp_path, arch, sharded)
    ref = AUTO.from_pretrained(path)
    ours = from_pretrained(path, device="cpu")
    assert type(ref) is cls
    assert_same_model(ours, ref)


@pytest.mark.skipif(MAJOR < 5, reason="transformers 4 keeps the per-expert tensors as they are")
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_experts_are_fused_from_per_expert_tensors(tmp_path, arch, handover):
    # The case the re-implementation failed on: the checkpoint has one tensor
    # per expert, the model one fused tensor per layer.
    path, _ = save(tmp_path, arch, sharded=True)
    names = checkpoint_names(path)
    assert any(".experts.0." in n for n in names)
    model = from_pretrained(path, device="cpu")
    fused = [n for n, _ in model.named_parameters() if n.endswith("experts.gate_up_proj")]
    assert len(fused) == 2
    assert not any(".experts.0." in n for n, _ in model.named_parameters())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_same_model_with_dtype(tmp_path, arch, dtype):
    path, _ = save(tmp_path, arch, sharded=True)
    ref = AUTO.from_pretrained(path, dtype=dtype)
    assert_same_model(from_pretrained(path, device="cpu", dtype=dtype), ref)
    # torch_dtype, transformers' older name, is an alias
    assert_same_model(from_pretrained(path, device="cpu", torch_dtype=dtype), ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_converted_weights_do_not_outlive_their_conversion(tmp_path, monkeypatch, dtype, handover):
    # transformers keeps only its converted copy; the loaded tensor must not
    # stay alive beside the model until from_pretrained returns (2x the
    # checkpoint on the device for fp16 loaded as bf16).
    import weakref
    path, cls = save(tmp_path, "llama", sharded=True)
    cls.from_pretrained(path).half().save_pretrained(tmp_path / "fp16", max_shard_size="24KB")
    handed, alive_at_end = [], []
    real_wait, real_finish = _background.BackgroundLoad.wait, _background.BackgroundLoad.finish

    def wait(self, name):
        tensor = real_wait(self, name)
        handed.append(weakref.ref(tensor))
        return tensor

    def finish(self):               # transformers' from_pretrained has returned
        gc.collect()
        alive_at_end.append(sum(r() is not None for r in handed))
        return real_finish(self)
    monkeypatch.setattr(_background.BackgroundLoad, "wait", wait)
    monkeypatch.setattr(_background.BackgroundLoad, "finish", finish)
    model = from_pretrained(tmp_path / "fp16", device="cpu", dtype=dtype)
    assert handed and alive_at_end == [0]
    assert_same_model(model, AUTO.from_pretrained(tmp_path / "fp16", dtype=dtype))


@pytest.mark.parametrize("case", ["single-over-sharded", "sharded-over-single", "variant-beside"])
def test_the_weights_transformers_reads_in_a_mixed_directory(tmp_path, case):
    # transformers' own saves leave both forms behind, and hub repos hold
    # variants: we read the files transformers reads (model.safetensors
    # first, then the index), so the model is its model.
    config, cls = configs()["llama"]
    path = tmp_path / "mixed"
    torch.manual_seed(1)
    first = cls(config)
    torch.manual_seed(2)
    second = cls(config)
    if case == "single-over-sharded":        # the index and its shards stay
        first.save_pretrained(path, max_shard_size="24KB")
        second.save_pretrained(path)
    elif case == "sharded-over-single":      # model.safetensors stays
        first.save_pretrained(path)
        second.save_pretrained(path, max_shard_size="24KB")
    else:
        first.save_pretrained(path)
        second.half().save_pretrained(path, variant="fp16")
    assert (path / "model.safetensors").is_file()
    assert_same_model(from_pretrained(path, device="cpu"), AUTO.from_pretrained(path))


def test_dtype_auto_takes_the_config_dtype(tmp_path):
    path, _ = save(tmp_path, "llama", sharded=False)
    config = json.loads((path / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(config))
    ref = AUTO.from_pretrained(path, dtype="auto")
    for kwargs in ({"dtype": "auto"}, {"torch_dtype": "auto"}):
        ours = from_pretrained(path, device="cpu", **kwargs)
        assert ours.model.embed_tokens.weight.dtype == torch.bfloat16
        assert_same_model(ours, ref)
    # none given: transformers' own default ("auto" in 5, float32 in 4)
    ours = from_pretrained(path, device="cpu")
    assert ours.model.embed_tokens.weight.dtype == (torch.bfloat16 if MAJOR >= 5 else torch.float32)
    assert_same_model(ours, AUTO.from_pretrained(path))


def test_keep_in_fp32_modules(tmp_path, monkeypatch):
    # transformers keeps these modules in fp32 at fp16; our reading must not
    # round them to fp16 first (the checkpoint's fp32 bits survive).
    monkeypatch.setattr(transformers.LlamaForCausalLM, "_keep_in_fp32_modules", ["lm_head"])
    path, _ = save(tmp_path, "llama", sharded=False)
    ref = AUTO.from_pretrained(path, dtype=torch.float16)
    ours = from_pretrained(path, device="cpu", dtype=torch.float16)
    assert ours.lm_head.weight.dtype == torch.float32
    assert ours.model.embed_tokens.weight.dtype == torch.float16
    assert_same_model(ours, ref, logits=False)      # Llama's forward is not made for an fp32 head


def test_tied_embeddings_are_one_tensor(tmp_path):
    path, _ = save(tmp_path, "qwen2", sharded=True)
    weights = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in weights           # save_pretrained drops the tied copy
    model = from_pretrained(path, device="cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_rotary_buffers_equal_transformers(tmp_path):
    path, _ = save(tmp_path, "llama", sharded=False)
    model = from_pretrained(path, device="cpu")
    inv_freq = model.model.rotary_emb.inv_freq
    dim = 32 // 4
    rope = getattr(model.config, "rope_parameters", None)      # transformers 5; 4: rope_theta
    base = rope["rope_theta"] if rope else model.config.rope_theta
    expected = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    assert inv_freq.device.type == "cpu" and torch.equal(inv_freq, expected)


def test_weights_are_read_by_instant_staging(tmp_path, monkeypatch):
    path, _ = save(tmp_path, "mixtral", sharded=True)
    names = checkpoint_names(path)
    read = record_reads(monkeypatch)
    import safetensors
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: pytest.fail("read by safetensors"))
    from_pretrained(path, device="cpu")
    assert sorted(read) == sorted(names)


def test_the_model_is_built_while_the_weights_are_read(tmp_path, monkeypatch):
    # The read may not deliver a tensor before transformers has started to
    # build the model: only a route that overlaps the two finishes.
    import threading
    path, cls = save(tmp_path, "llama", sharded=True)
    building = threading.Event()
    real_init, real_load = cls.__init__, _run._load

    def init(self, *args, **kwargs):
        building.set()
        real_init(self, *args, **kwargs)

    def load(*args, **kwargs):
        assert building.wait(30), "the weights were read before the model was built"
        yield from real_load(*args, **kwargs)
    monkeypatch.setattr(cls, "__init__", init)
    monkeypatch.setattr(_run, "_load", load)
    assert_same_model(from_pretrained(path, device="cpu"), AUTO.from_pretrained(path))


def test_model_class_and_auto_class(tmp_path):
    path, cls = save(tmp_path, "llama", sharded=False)
    ref = cls.from_pretrained(path)
    assert_same_model(from_pretrained(path, device="cpu", model_class=AUTO), ref)
    assert_same_model(from_pretrained(path, device="cpu", model_class=cls), ref)
    base = from_pretrained(path, device="cpu", model_class=transformers.LlamaModel)
    assert type(base) is transformers.LlamaModel     # the base_model_prefix is stripped
    assert torch.equal(base.embed_tokens.weight, ref.model.embed_tokens.weight)


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_config_without_architectures(tmp_path, arch):
    path, cls = save(tmp_path, arch, sharded=False)
    config = json.loads((path / "config.json").read_text())
    del config["architectures"]
    (path / "config.json").write_text(json.dumps(config))
    ref = AUTO.from_pretrained(path)          # the Auto class maps model_type to its class
    ours = from_pretrained(path, device="cpu")
    assert type(ours) is cls
    assert_same_model(ours, ref)


@pytest.mark.parametrize("device_map", ["cpu", "auto", {"": "cpu"}, torch.device("cpu"),
                                        {"model": "cpu", "lm_head": "cpu"}],
                         ids=["str", "auto", "dict", "torch.device", "one-device-dict"])
def test_device_map(tmp_path, device_map):
    path, _ = save(tmp_path, "qwen2", sharded=True)
    ref = AUTO.from_pretrained(path)
    if torch.cuda.is_available() and device_map == "auto":
        pytest.skip("'auto' is the GPU where torch sees one")
    assert_same_model(from_pretrained(path, device_map=device_map), ref)


# -- device_map over several devices, offload, strategies --------------------------

# The tiny Llama's modules, some offloaded to the disk.
OFFLOADING = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
              "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "disk"}


def record_loads(monkeypatch):
    """(device, names) of each Checkpoint.iter_load from now on, and the
    number of Checkpoints opened."""
    from instant_staging.loader import Checkpoint
    loads, opened = [], []
    real_iter, real_open = Checkpoint.iter_load, Checkpoint.open.__func__

    def iter_load(self, device="cpu", **kwargs):
        loads.append((str(device), kwargs.get("names")))
        return real_iter(self, device, **kwargs)

    def open_(cls, *args, **kwargs):
        opened.append(args)
        return real_open(cls, *args, **kwargs)
    monkeypatch.setattr(Checkpoint, "iter_load", iter_load)
    monkeypatch.setattr(Checkpoint, "open", classmethod(open_))
    return loads, opened


def offloaded(model):
    """{parameter name: its value} of every parameter accelerate offloaded
    (meta in the model; the value where its hook reads it from)."""
    values = {}
    for prefix, module in model.named_modules():
        weights = getattr(getattr(module, "_hf_hook", None), "weights_map", None)
        if weights is None:
            continue
        for name, p in module.named_parameters(recurse=False):
            if p.device.type == "meta":
                values[f"{prefix}.{name}" if prefix else name] = weights[name]
    return values


def assert_same_placed_model(ours, ref):
    """assert_same_model for a model dispatched by accelerate: the same map,
    each parameter on the same device, those in memory equal bit for bit,
    the offloaded ones equal where their hooks read them, the same logits."""
    from support.models import bits
    assert type(ours) is type(ref) and not ours.training
    assert getattr(ours, "hf_device_map", None) == getattr(ref, "hf_device_map", None)
    ours_p = dict(ours.named_parameters(remove_duplicate=False))
    ref_p = dict(ref.named_parameters(remove_duplicate=False))
    assert list(ours_p) == list(ref_p)
    for name, p in ref_p.items():
        q = ours_p[name]
        assert (q.dtype, q.shape, q.device) == (p.dtype, p.shape, p.device), name
        if p.device.type != "meta":
            assert torch.equal(bits(q), bits(p)), name
    ours_off, ref_off = offloaded(ours), offloaded(ref)
    assert sorted(ours_off) == sorted(ref_off)
    for name, value in ref_off.items():
        assert ours_off[name].dtype == value.dtype and torch.equal(bits(ours_off[name]), bits(value)), name
    assert ours.config.to_dict() == ref.config.to_dict()
    ids = torch.tensor([[3, 17, 42, 5, 90, 1]], device=ours.get_input_embeddings().weight.device
                       if ours.get_input_embeddings().weight.device.type != "meta" else "cpu")
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, ref(ids).logits)


@pytest.mark.parametrize("kwargs", [
    {"device_map": "balanced"}, {"device_map": "sequential"}, {"device_map": "balanced_low_0"},
    {"device_map": "auto", "max_memory": {"cpu": 60_000}},
    {"device_map": "sequential", "max_memory": {"cpu": 60_000}},
    {"device_map": OFFLOADING},
    {"device_map": {"model": "cpu", "lm_head": "disk"}, "offload_buffers": True},
], ids=["balanced", "sequential", "balanced_low_0", "auto-max_memory", "sequential-max_memory",
        "disk", "disk-offload_buffers"])
def test_device_map_as_transformers_places_it(tmp_path, monkeypatch, kwargs):
    pytest.importorskip("accelerate")
    if torch.cuda.is_available():
        pytest.skip("strategies spread over the GPUs torch sees: test_gpu_device_map")
    path, _ = save(tmp_path, "llama", sharded=True)
    ref = AUTO.from_pretrained(path, offload_folder=str(tmp_path / "ref-offload"), **kwargs)
    loads, opened = record_loads(monkeypatch)
    ours = from_pretrained(path, offload_folder=str(tmp_path / "offload"), **kwargs)
    assert_same_placed_model(ours, ref)
    # one Checkpoint, one load per device: here the CPU (disk is read to it)
    assert len(opened) == 1 and len(loads) == 1 and loads[0][0] == "cpu"
    assert sorted(loads[0][1]) == sorted(checkpoint_names(path))
    if "disk" in set(getattr(ref, "hf_device_map", {}).values()):
        assert os.listdir(tmp_path / "offload")       # transformers wrote what we read


@pytest.mark.parametrize("arch, device_map", [
    ("gpt2", {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.h.0": "disk",
              "transformer.h.1": "cpu", "transformer.ln_f": "cpu", "lm_head": "cpu"}),
    ("mixtral", {"model.embed_tokens": "cpu", "model.layers.0": "disk", "model.layers.1": "cpu",
                 "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "disk"}),
], ids=["gpt2-tied", "mixtral-fused-experts"])
def test_disk_offload_of_tied_and_fused_weights(tmp_path, arch, device_map, handover):
    # a tied model (its prefix "transformer"), and experts transformers 5
    # fuses before it writes them to the offload folder
    pytest.importorskip("accelerate")
    path, _ = save(tmp_path, arch, sharded=True)
    ref = AUTO.from_pretrained(path, device_map=device_map, offload_folder=str(tmp_path / "ref-offload"))
    ours = from_pretrained(path, device_map=device_map, offload_folder=str(tmp_path / "offload"))
    assert_same_placed_model(ours, ref)


def test_transformers_4_gets_a_mapped_tensor_where_it_was_read():
    # Under a resolved map transformers 4 asks .to(<the map's "" device, else
    # "cpu">) before it moves a value to its module's device: the tensor as
    # read, not a round trip through the CPU (a meta tensor plays one read to
    # a GPU: it cannot be copied to the CPU).
    read = torch.empty(2, 3, device="meta")

    class Load:
        placed = True

        def wait(self, name):
            return read
    arriving = _background.Arriving(Load(), "w", torch.Size([2, 3]), torch.float32)
    for args, kwargs in [(("cpu",), {}), ((0,), {}), (("disk",), {}), ((), {"device": "cpu"})]:
        assert arriving.to(*args, **kwargs) is read
    assert arriving.to(torch.float16).dtype == torch.float16       # not a move: done
    Load.placed = False                                             # one device: as asked
    with pytest.raises((NotImplementedError, RuntimeError)):
        arriving.to("cpu")


def test_one_load_per_device(tmp_path, monkeypatch):
    # Two groups (as two devices would be; both the CPU here): one Checkpoint,
    # one load each, in the order given, the model as transformers'.
    pytest.importorskip("accelerate")
    path, _ = save(tmp_path, "llama", sharded=True)
    ref = AUTO.from_pretrained(path, offload_folder=str(tmp_path / "ref-offload"), device_map=OFFLOADING)
    real = _placement.groups
    split = []

    def two(torch_, model, device_map, names):
        ((device, every),) = real(torch_, model, device_map, names)
        half = len(every) // 2
        split.append(every)
        return [(device, every[half:]), (device, every[:half])]
    monkeypatch.setattr(_placement, "groups", two)
    loads, opened = record_loads(monkeypatch)
    ours = from_pretrained(path, offload_folder=str(tmp_path / "offload"), device_map=OFFLOADING)
    assert_same_placed_model(ours, ref)
    half = len(split[0]) // 2
    assert len(opened) == 1 and loads == [("cpu", split[0][half:]), ("cpu", split[0][:half])]


def test_each_tensor_is_read_to_the_device_its_module_is_mapped_to(tmp_path, monkeypatch, handover):
    # (the GPU devices only named: which tensor goes to which load)
    monkeypatch.setattr(_placement, "resolve_device",
                        lambda torch_, d: torch.device(f"cuda:{d}" if isinstance(d, int) else d))
    with torch.device("meta"):
        model = AUTO.from_config(configs()["llama"][0])
    device_map = {"model.embed_tokens": 0, "model.layers.0": "cuda:0", "model.layers.1": "cuda:1",
                  "model.norm": "cpu", "lm_head": "disk", "": "cuda:1"}
    names = {"model.embed_tokens.weight": "cuda:0", "model.layers.0.mlp.up_proj.weight": "cuda:0",
             "model.layers.1.input_layernorm.weight": "cuda:1", "model.norm.weight": "cpu",
             "lm_head.weight": "cpu",                                   # disk: read to the CPU
             "layers.0.self_attn.q_proj.weight": "cuda:0",             # saved without the prefix
             "model.layers.10.mlp.up_proj.weight": "cuda:1",           # not layers.1's: ""
             "something.else": "cuda:1"}
    groups = _placement.groups(torch, model, device_map, list(names))
    assert [str(d) for d, _ in groups] == ["cuda:0", "cuda:1", "cpu"]      # in the order first named
    assert {name: str(d) for d, group in groups for name in group} == names


def test_attn_implementation(tmp_path):
    path, _ = save(tmp_path, "llama", sharded=False)
    for impl in ("eager", "sdpa"):
        ref = AUTO.from_pretrained(path, attn_implementation=impl)
        ours = from_pretrained(path, device="cpu", attn_implementation=impl)
        assert ours.config._attn_implementation == ref.config._attn_implementation == impl
        assert_same_model(ours, ref)


def hub_cache(tmp_path, arch="llama"):
    """A huggingface_hub cache holding org/tiny at two revisions: main
    (seed 0) and the tag v2 (seed 1), as snapshot_download leaves it."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    for ref, seed, commit in (("main", 0, "a" * 40), ("v2", 1, "b" * 40)):
        path, _ = save(tmp_path, arch, sharded=True, seed=seed, name=f"src-{ref}")
        shutil.copytree(path, repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return cache


@pytest.fixture
def offline(monkeypatch):
    """Nothing is fetched: huggingface_hub's own offline switch."""
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("revision", [None, "main", "v2", "b" * 40])
def test_hub_id_and_revision_from_the_cache(tmp_path, offline, revision):
    cache = hub_cache(tmp_path)
    kwargs = {"cache_dir": str(cache)}
    if revision is not None:
        kwargs["revision"] = revision
    ref = AUTO.from_pretrained("org/tiny", **kwargs)
    ours = from_pretrained("org/tiny", device="cpu", **kwargs)
    assert ours.config.name_or_path == ref.config.name_or_path == "org/tiny"
    assert_same_model(ours, ref)
    other = from_pretrained("org/tiny", device="cpu", cache_dir=str(cache),
                            revision="main" if revision in ("v2", "b" * 40) else "v2")
    assert not torch.equal(other.lm_head.weight, ours.lm_head.weight)   # another revision, other weights


def test_hub_id_not_in_the_cache(tmp_path, offline):
    cache = hub_cache(tmp_path)
    with pytest.raises(FileNotFoundError, match="org/absent"):
        from_pretrained("org/absent", device="cpu", cache_dir=str(cache))
    with pytest.raises(FileNotFoundError, match="org/tiny"):
        from_pretrained("org/tiny", device="cpu", cache_dir=str(cache), revision="v3")
    with pytest.raises(FileNotFoundError, match="org/tiny"):
        from_pretrained("org/tiny", device="cpu", cache_dir=str(cache), local_files_only=True,
                        revision="c" * 40)


@pytest.mark.parametrize("layout", ["one_file", "sharded", "neither"])
def test_hub_fetches_only_the_weights_it_reads(tmp_path, monkeypatch, layout):
    # A repo holding a variant (model.fp16.safetensors) beside its weights:
    # only what _hub.weights reads is asked for, after the configs.
    import huggingface_hub

    from instant_staging import _hub
    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    if layout == "one_file":
        (snapshot / "model.safetensors").write_bytes(b"")
    elif layout == "sharded":
        (snapshot / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "a": "model-00002-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
            "c": "model-00001-of-00002.safetensors"}}))
    asked = []

    def snapshot_download(repo, *, allow_patterns, **kwargs):
        assert repo == "org/tiny" and kwargs == {"revision": "v2", "token": None}
        asked.append(allow_patterns)
        return str(snapshot)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert _hub.snapshot("org/tiny", revision="v2", token=None) == str(snapshot)
    first = ["*.json", "*.py", "model.safetensors"]
    assert asked == {"one_file": [first],
                     "sharded": [first, ["model-00001-of-00002.safetensors",
                                         "model-00002-of-00002.safetensors"]],
                     "neither": [first, ["*.safetensors"]]}[layout]


REMOTE_CONFIG = '''
from transformers import LlamaConfig


class TinyRemoteConfig(LlamaConfig):
    model_type = "tiny_remote"
'''
REMOTE_MODEL = '''
from transformers import LlamaForCausalLM

from .configuration_tiny import TinyRemoteConfig


class TinyRemoteForCausalLM(LlamaForCausalLM):
    config_class = TinyRemoteConfig
'''


def test_trust_remote_code(tmp_path, monkeypatch):
    import transformers.dynamic_module_utils as dynamic
    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    path, _ = save(tmp_path, "llama", sharded=True, name="remote")
    (path / "configuration_tiny.py").write_text(REMOTE_CONFIG)
    (path / "modeling_tiny.py").write_text(REMOTE_MODEL)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="tiny_remote", architectures=["TinyRemoteForCausalLM"],
                  auto_map={"AutoConfig": "configuration_tiny.TinyRemoteConfig",
                            "AutoModelForCausalLM": "modeling_tiny.TinyRemoteForCausalLM"})
    (path / "config.json").write_text(json.dumps(config))
    ref = AUTO.from_pretrained(path, trust_remote_code=True)
    ours = from_pretrained(path, device="cpu", trust_remote_code=True)
    assert type(ours).__name__ == type(ref).__name__ == "TinyRemoteForCausalLM"
    # the same code, loaded into the same module of transformers' cache
    assert type(ours) is type(ref)
    assert_same_model(ours, ref)
    with pytest.raises(ValueError, match="trust_remote_code"):
        from_pretrained(path, device="cpu")


def test_missing_weight_is_an_error(tmp_path):
    path, _ = save(tmp_path, "llama", sharded=True)
    index = path / "model.safetensors.index.json"
    obj = json.loads(index.read_text())
    victim = "model.layers.1.mlp.down_proj.weight"
    shard = path / obj["weight_map"].pop(victim)
    from safetensors.torch import load_file as st_load
    from safetensors.torch import save_file as st_save
    tensors = st_load(shard)
    del tensors[victim]
    st_save(tensors, shard, metadata={"format": "pt"})
    index.write_text(json.dumps(obj))
    with pytest.raises(KeyError, match=victim):
        from_pretrained(path, device="cpu")


def test_unexpected_weights_are_ignored(tmp_path):
    path, _ = save(tmp_path, "llama", sharded=False)
    from safetensors.torch import load_file as st_load
    from safetensors.torch import save_file as st_save
    tensors = st_load(path / "model.safetensors")
    tensors["extra.head.weight"] = torch.ones(4, 4)
    st_save(tensors, path / "model.safetensors", metadata={"format": "pt"})
    assert_same_model(from_pretrained(path, device="cpu"), AUTO.from_pretrained(path))


def test_shape_mismatch_is_an_error(tmp_path):
    path, _ = save(tmp_path, "llama", sharded=False)
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 72
    (path / "config.json").write_text(json.dumps(config))
    # transformers' own error (its report, logged, names the keys), as from its from_pretrained
    with pytest.raises(RuntimeError, match=r"ignore_mismatched_sizes|size mismatch") as theirs:
        AUTO.from_pretrained(path)
    with pytest.raises(RuntimeError) as ours:
        from_pretrained(path, device="cpu")
    assert str(ours.value) == str(theirs.value)


def no_read(monkeypatch):
    monkeypatch.setattr(integration, "load_file", lambda *a, **k: pytest.fail("read before the check"))


def test_bad_arguments_before_reading(tmp_path, monkeypatch):
    path, _ = save(tmp_path, "llama", sharded=False)
    no_read(monkeypatch)
    with pytest.raises(ValueError, match="floating-point"):
        from_pretrained(path, device="cpu", dtype=torch.int8)
    with pytest.raises(ValueError, match="differ"):
        from_pretrained(path, device="cpu", dtype=torch.float16, torch_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="device"):
        from_pretrained(path, device="mps")
    with pytest.raises(TypeError, match="model_class"):
        from_pretrained(path, device="cpu", model_class="LlamaForCausalLM")
    for kwargs, what in (({"use_safetensors": False}, "use_safetensors=False"),
                         ({"from_tf": True}, "from_tf"), ({"gguf_file": "m.gguf"}, "gguf_file"),
                         ({"state_dict": {}}, "state_dict"),
                         ({"adapter_kwargs": {"revision": "x"}}, "adapter_kwargs")):
        with pytest.raises(ValueError, match=rf"{what}.*safetensors"):
            from_pretrained(path, device="cpu", **kwargs)
    with pytest.raises(TypeError, match="use_safetensors"):
        from_pretrained(path, device="cpu", use_safetensors="yes")
    with pytest.raises(TypeError, match="config must be"):
        from_pretrained(path, device="cpu", config=7)
    with pytest.raises(FileNotFoundError, match="subfolder"):
        from_pretrained(path, device="cpu", subfolder="absent")
    with pytest.raises(FileNotFoundError, match=r"model\.fp8\.safetensors"):
        from_pretrained(path, device="cpu", variant="fp8")
    with pytest.raises(TypeError, match="trust_remote_code"):
        from_pretrained(path, device="cpu", trust_remote_code="yes")
    with pytest.raises(FileNotFoundError, match="no such model directory"):
        from_pretrained(tmp_path / "absent", device="cpu")
    with pytest.raises(FileNotFoundError, match="no such model directory"):
        from_pretrained("./absent", device="cpu")
    with pytest.raises(FileNotFoundError, match=r"config.json"):
        from_pretrained(tmp_path, device="cpu")
    with pytest.raises(TypeError, match="model_dir"):
        from_pretrained(None, device="cpu")
    with pytest.raises(ValueError, match=r"transformers .* has no class 'NoSuchForCausalLM'"):
        config = json.loads((path / "config.json").read_text())
        config["architectures"] = ["NoSuchForCausalLM"]
        (path / "config.json").write_text(json.dumps(config))
        from_pretrained(path, device="cpu")


@pytest.mark.parametrize("architectures, match", [
    ("LlamaForCausalLM", "a str"),
    ([["LlamaForCausalLM"]], "a list"),
    ([7], "an int"),
])
def test_architectures_that_is_not_a_list_of_names_says_so(tmp_path, monkeypatch, architectures, match):
    """Not a class named 'L' (the first letter of a string): the field's form."""
    path, _ = save(tmp_path, "llama", sharded=False)
    no_read(monkeypatch)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = architectures
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json's architectures must be a list of class "
                                         rf"names, not .*{match}"):
        from_pretrained(path, device="cpu")


@pytest.mark.parametrize("device_map, match", [
    ({"model": "cpu", "lm_head": "disk"}, "offload_folder"),
    ({"model": "cpu", "lm_head": "meta"}, "device"),
    ({"model": "cpu", "lm_head": "cuda:1"}, "cuda:1"),
    ({}, "empty"),
    ({0: "cpu"}, "keys must be"),
    (1.5, "device_map must be"),
])
def test_bad_device_map_is_an_error_before_reading(tmp_path, monkeypatch, device_map, match):
    path, _ = save(tmp_path, "llama", sharded=False)
    if torch.cuda.device_count() > 1 and "cuda:1" in str(device_map):
        pytest.skip("this host has a cuda:1")
    no_read_after_error(monkeypatch)
    with pytest.raises((ValueError, TypeError), match=match):
        from_pretrained(path, device_map=device_map)


def test_a_strategy_that_offloads_to_the_disk_needs_an_offload_folder(tmp_path, monkeypatch):
    # known once transformers resolved it: before anything is read
    pytest.importorskip("accelerate")
    path, _ = save(tmp_path, "llama", sharded=False)
    loads, _ = record_loads(monkeypatch)
    with pytest.raises(ValueError, match="offload_folder"):
        from_pretrained(path, device_map="auto", max_memory={"cpu": 20_000})
    assert loads == []


def test_device_with_a_spreading_device_map_is_an_error(tmp_path, monkeypatch):
    path, _ = save(tmp_path, "llama", sharded=False)
    no_read_after_error(monkeypatch)
    with pytest.raises(ValueError, match="pass one of them"):
        from_pretrained(path, device="cpu", device_map="balanced")


def test_device_and_device_map_must_agree(tmp_path, monkeypatch):
    path, _ = save(tmp_path, "llama", sharded=False)
    # the default device ("cuda:0") gives way to device_map; an equal one agrees
    assert_same_model(from_pretrained(path, device="cpu", device_map={"": "cpu"}), AUTO.from_pretrained(path))
    no_read(monkeypatch)
    if not torch.cuda.is_available():
        monkeypatch.setattr(_placement, "resolve_device", lambda torch, d: torch.device(d))
    with pytest.raises(ValueError, match="different devices"):
        from_pretrained(path, device="cpu", device_map="cuda:0")


def test_auto_device_map_is_what_transformers_resolves(tmp_path, monkeypatch):
    # "auto" with several GPUs (or one too small) is transformers' to resolve:
    # the map its _get_device_map gives decides where each tensor is read.
    pytest.importorskip("accelerate")
    path, _ = save(tmp_path, "llama", sharded=False)
    asked = []

    def resolved(model, device_map, *args, **kwargs):
        asked.append(device_map)
        return dict(OFFLOADING)
    monkeypatch.setattr(transformers.modeling_utils, "_get_device_map", resolved)
    ref = AUTO.from_pretrained(path, device_map=OFFLOADING, offload_folder=str(tmp_path / "ref"))
    asked.clear()
    ours = from_pretrained(path, device_map="auto", offload_folder=str(tmp_path / "ours"))
    assert asked == ["auto"]
    assert_same_placed_model(ours, ref)


def test_failed_read_frees_everything(tmp_path, monkeypatch, handover):
    import gc
    import weakref

    from instant_staging.loader import LoadError
    path, _ = save(tmp_path, "llama", sharded=True)
    refs = []
    real = _run._load

    def failing(*args, **kwargs):
        for item in real(*args, **kwargs):
            refs.append(weakref.ref(item[1]))
            yield item
            item = None           # this spy's frame outlives the failure too
        raise LoadError("injected: the read of the last chunk failed")
    monkeypatch.setattr(_run, "_load", failing)
    with pytest.raises(LoadError) as info:
        from_pretrained(path, device="cpu")
    assert info.value is not None            # the exception (and its traceback) still alive
    gc.collect()
    assert refs and all(r() is None for r in refs)


def test_allocator_warmup_is_restored(tmp_path):
    path, _ = save(tmp_path, "gpt2", sharded=False)
    before = transformers.modeling_utils.caching_allocator_warmup
    from_pretrained(path, device="cpu")
    assert transformers.modeling_utils.caching_allocator_warmup is before


@pytest.mark.gpu
def test_gpu_same_parameters(tmp_path, gpu):
    pytest.importorskip("accelerate")
    path, _ = save(tmp_path, "mixtral", sharded=True)
    ref = AUTO.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda:0")
    ours = from_pretrained(path, device="cuda:0", dtype=torch.bfloat16)
    for (n, p), (m, q) in zip(ref.named_parameters(), ours.named_parameters()):
        assert n == m and q.device == p.device and torch.equal(p, q), n
    for (n, b), (m, c) in zip(ref.named_buffers(), ours.named_buffers()):
        assert n == m and c.device == b.device and torch.equal(b, c), n
    ours = from_pretrained(path, device_map="auto", torch_dtype=torch.bfloat16)
    assert ours.model.embed_tokens.weight.device.type == "cuda"


@pytest.mark.gpu
@pytest.mark.parametrize("device_map", [
    "auto",
    {"model.embed_tokens": "cuda:0", "model.layers.0": "cuda:0", "model.layers.1": "cpu",
     "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cuda:0"},
    {"model.embed_tokens": "cuda:0", "model.layers.0": "cpu", "model.layers.1": "disk",
     "model.norm": "cuda:0", "model.rotary_emb": "cuda:0", "lm_head": "cpu"},
], ids=["auto", "gpu-cpu", "gpu-cpu-disk"])
def test_gpu_device_map(tmp_path, monkeypatch, gpu, device_map):
    # Each tensor read straight to its module's device (the disk's to the CPU),
    # one load per device, the model as transformers' own.
    pytest.importorskip("accelerate")
    path, _ = save(tmp_path, "llama", sharded=True)
    ref = AUTO.from_pretrained(path, dtype=torch.bfloat16, device_map=device_map,
                               offload_folder=str(tmp_path / "ref-offload"))
    loads, opened = record_loads(monkeypatch)
    ours = from_pretrained(path, dtype=torch.bfloat16, device_map=device_map,
                           offload_folder=str(tmp_path / "offload"))
    assert_same_placed_model(ours, ref)
    assert len(opened) == 1
    read_to = {name: device for device, names in loads for name in names}
    assert sorted(read_to) == sorted(checkpoint_names(path))
    assert len(loads) == len({device for device, _ in loads})
    expected = {name: ("cuda:0" if p.device.type == "cuda" else "cpu")
                for name, p in ref.named_parameters()}
    for name, device in read_to.items():
        assert device == expected[name], name


def test_gpu_without_accelerate_is_an_error_before_reading(tmp_path, monkeypatch):
    path, _ = save(tmp_path, "llama", sharded=False)
    no_read(monkeypatch)
    monkeypatch.setattr(_placement, "resolve_device", lambda torch, d: torch.device(d))
    monkeypatch.setattr(transformers.utils, "is_accelerate_available", lambda: False)
    with pytest.raises(ImportError, match="accelerate"):
        from_pretrained(path, device="cuda:0")


def test_transformers_error_while_reading_is_that_error(tmp_path, monkeypatch, handover):
    # transformers fails while the read still runs: its error comes out (not
    # the cancel of the read that follows it), and the read is stopped.
    import threading
    path, cls = save(tmp_path, "llama", sharded=True)
    real_load, stop = _run._load, threading.Event()

    def slow(*args, **kwargs):
        assert stop.wait(30)
        yield from real_load(*args, **kwargs)

    def init(self, *args, **kwargs):
        stop.set()                # the read starts as transformers fails
        raise RuntimeError("injected: the model cannot be built")
    monkeypatch.setattr(_run, "_load", slow)
    monkeypatch.setattr(cls, "__init__", init)
    with pytest.raises(RuntimeError, match="injected: the model cannot be built"):
        from_pretrained(path, device="cpu")
    assert not [t for t in threading.enumerate() if t.name == "instant_staging-from_pretrained"]


def test_no_device_loads_where_torch_can(tmp_path, caplog):
    """device=None (the default): the current CUDA device where torch sees
    one, else the CPU, with an INFO line saying which."""
    path, _ = save(tmp_path, "llama", False)
    with caplog.at_level("INFO", logger="instant_staging"):
        model = from_pretrained(path)
    want = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    assert next(model.parameters()).device == torch.device(want)
    assert f"no device given: loading onto {want}" in caplog.text


# -- every transformers the package declares (issue 29, item 1) ------------------------

def test_the_declared_floor_is_the_one_tox_tests():
    """pyproject's transformers floor is the version tox's transformers-floor
    env installs: the oldest transformers the package claims is tested."""
    import re
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        floors = set(re.findall(r'"transformers>=([0-9.]+)"', f.read()))
    with open(os.path.join(ROOT, "tox.ini")) as f:
        tox = f.read()
    env = tox[tox.index("[testenv:transformers-floor]"):]
    env = env[:env.find("\n[", 1) if "\n[" in env[1:] else len(env)]
    assert len(floors) == 1 and re.search(rf"transformers=={re.escape(floors.pop())}\.\*", env), env


def test_an_arriving_tensor_is_what_each_transformers_asks_of_a_state_dict_value(tmp_path):
    """transformers 5 asks ``t[...]`` (a safetensors slice's call), 4 asks
    ``t.to(device)`` of a state dict's value: both wait for the tensor and
    give it (not a copy) where it is already there."""
    path, _ = save(tmp_path, "llama", sharded=False)
    load = _background.BackgroundLoad(str(path / "model.safetensors"), torch.device("cpu"))
    try:
        name = "model.embed_tokens.weight"
        shape, dtype = load.layout[name]
        value = _background.Arriving(load, name, shape, dtype)
        assert value.get_shape() == list(shape) and value.is_floating_point()
        meta = torch.empty(shape, dtype=dtype, device="meta")
        assert (value.dim(), value.size(), value.size(1), value.stride(), value.stride(0)) == \
            (meta.dim(), meta.size(), meta.size(1), meta.stride(), meta.stride(0))
        moved = value.to("cpu")
        assert moved.shape == shape and moved.dtype == dtype
        assert value[...].data_ptr() == moved.data_ptr()     # the tensor itself, no copy
        part = value[1:3]                                     # a rank's rows: a tensor of its own
        assert torch.equal(part, moved[1:3]) and part.data_ptr() != moved[1:3].data_ptr()
        assert value.to(torch.float16).dtype == torch.float16
        load.finish()
    finally:
        load.close()


# -- small tensors handed over whole (issue 45, item 5) -----------------------------------

def test_which_loads_are_handed_over_whole():
    """The vLLM path's rule, on each load: whole where its tensors average
    under WHOLE_BATCH_MEAN_BYTES (a fine-grained MoE checkpoint, a map's
    group of experts), streamed where they do not (a dense one, the
    embedding alone)."""
    from types import SimpleNamespace

    from instant_staging import defaults
    from instant_staging.integrations import _whole
    assert _whole.WHOLE_BATCH_MEAN_BYTES is defaults.WHOLE_BATCH_MEAN_BYTES == 4 << 20

    class Layout:
        def __init__(self, sizes):
            self.sizes = sizes

        def names(self):
            return list(self.sizes)

        def info(self, name):
            return SimpleNamespace(nbytes=self.sizes[name])
    mib = 1 << 20
    fine = Layout({"embed": 256 * mib, "lm_head": 256 * mib,
                   **{f"layers.{i}.experts.{e}.{w}": mib
                      for i in range(12) for e in range(128) for w in ("gate", "up", "down")}})
    dense = Layout({"embed": 1002 * mib, **{f"layers.{i}.{w}": 32 * mib for i in range(32)
                                            for w in ("q", "k", "v", "o", "gate", "up", "down")},
                    **{f"layers.{i}.norm": 8192 for i in range(64)}})
    assert _background.loads_whole(fine)
    assert not _background.loads_whole(dense)
    experts = [n for n in fine.sizes if ".experts." in n]
    assert _background.loads_whole(fine, experts)
    assert not _background.loads_whole(fine, ["embed", "lm_head"])
    # the boundary: a mean of exactly 4 MiB streams, a byte under is whole
    assert not _background.loads_whole(Layout({"a": 4 * mib, "b": 4 * mib}))
    assert _background.loads_whole(Layout({"a": 4 * mib, "b": 4 * mib - 1}))


def small_and_large(path):
    """small.* (256 B each) and large.* (16 KiB each) tensors in one file."""
    from safetensors.torch import save_file as st_save
    tensors = {f"small.{i}": torch.full((64,), float(i)) for i in range(6)}
    tensors.update({f"large.{i}": torch.full((4096,), float(i)) for i in range(3)})
    path.mkdir(exist_ok=True)
    st_save(tensors, str(path / "model.safetensors"))
    return str(path / "model.safetensors"), tensors


class Logged:
    """A load's iterator that logs each pair as the loader hands it over
    and, before the second, waits (at most ``patience`` s) for ``gate``."""

    def __init__(self, it, log, gate, patience):
        self.it, self.log, self.gate, self.patience, self.pulled = it, log, gate, patience, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.pulled == 1 and self.gate is not None:
            self.gate.wait(self.patience)
        name, tensor = next(self.it)
        self.pulled += 1
        self.log.append(("loaded", name))
        return name, tensor

    def close(self):
        self.it.close()


def logged_loads(monkeypatch, log, gates, patience=1.0):
    """Every Checkpoint.iter_load from now on is ``Logged``, the k-th one
    gated by ``gates[k]`` (None: not gated)."""
    from instant_staging.loader import Checkpoint
    real = Checkpoint.iter_load
    made = []

    def iter_load(self, device="cpu", **kwargs):
        gate = gates[len(made)] if len(made) < len(gates) else None
        made.append(Logged(real(self, device, **kwargs), log, gate, patience))
        return made[-1]
    monkeypatch.setattr(Checkpoint, "iter_load", iter_load)


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "streamed"])
def test_a_whole_load_is_handed_over_once_read(tmp_path, monkeypatch, whole):
    # Above every tensor's size, the load is whole; at 0, streamed.  The
    # loader's iterator waits before its second tensor until the first is
    # handed out: a streamed load hands it out then, a whole one only once
    # every tensor is read (the wait times out).
    from instant_staging.integrations import _whole
    monkeypatch.setattr(_whole, "WHOLE_BATCH_MEAN_BYTES", 1 << 40 if whole else 0)
    import threading
    file, tensors = small_and_large(tmp_path)
    log, gate = [], threading.Event()
    logged_loads(monkeypatch, log, [gate])
    load = _background.BackgroundLoad(file, torch.device("cpu"))
    try:
        first = next(iter(load.layout))
        assert torch.equal(load.wait(first), tensors[first])
        log.append(("handed", first))
        gate.set()
        for name in list(load.layout)[1:]:
            assert torch.equal(load.wait(name), tensors[name])
        load.finish()
    finally:
        load.close()
    loaded = [n for what, n in log if what == "loaded"]
    assert sorted(loaded) == sorted(tensors)
    handed_at = log.index(("handed", first))
    assert handed_at == (len(tensors) if whole else 1), log


def test_each_group_of_a_map_gets_its_own_mode_and_whole_tensors_are_freed_as_handed_out(
        tmp_path, monkeypatch):
    # Two loads (a device_map's groups): the small tensors whole, the large
    # ones streamed.  A tensor of the whole load handed out and dropped is
    # freed while the next load runs: the load keeps none it handed out.
    import threading
    import time
    import weakref

    from instant_staging.integrations import _whole
    monkeypatch.setattr(_whole, "WHOLE_BATCH_MEAN_BYTES", 1024)
    file, tensors = small_and_large(tmp_path)
    small = [n for n in tensors if n.startswith("small.")]
    large = [n for n in tensors if n.startswith("large.")]
    with _background.Checkpoint.open(file) as checkpoint:
        assert not _background.loads_whole(checkpoint)      # mean 5.6 KiB: the file alone streams
    modes = []
    real_whole = _background.loads_whole
    monkeypatch.setattr(_background, "loads_whole",
                        lambda c, names=None: modes.append(real_whole(c, names)) or modes[-1])
    log, gate = [], threading.Event()
    logged_loads(monkeypatch, log, [None, gate], patience=10.0)
    load = _background.BackgroundLoad(file)
    try:
        load.start([(torch.device("cpu"), small), (torch.device("cpu"), large)])
        tensor = load.wait(small[0])
        assert torch.equal(tensor, tensors[small[0]])
        gone = weakref.ref(tensor)
        del tensor
        gc.collect()
        # the large load has handed its first tensor to the consumer thread
        # and waits for the gate: the whole load's dict is gone by then
        deadline = time.monotonic() + 10
        while ("loaded", large[0]) not in log and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gone() is None
        gate.set()
        for name in small[1:] + large:
            assert torch.equal(load.wait(name), tensors[name])
        load.finish()
    finally:
        load.close()
    assert modes == [True, False]


def test_bench_transformers_quick(tmp_path):
    # The benchmark's smoke mode: both models (the fine-grained MoE written
    # by save_pretrained, one tensor per expert matrix), each loaded by
    # transformers and by ours, bit-equal, in one table with the versions.
    out = tmp_path / "bench.json"
    r = run_script(os.path.join(ROOT, "benchmarks", "bench_transformers.py"), "--quick", "--repeat", "1",
                   "--skip-slices", "--handovers", "--dir", str(tmp_path), "--json", str(out),
                   env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert doc["versions"]["transformers"] == transformers.__version__
    models = doc["models"]
    assert list(models) == ["dense", "finemoe"]
    assert all(m["parameters_and_buffers_equal"] and m["speedup_best"] > 0 for m in models.values())
    # the route each took: in place (transformers 5), and the state dict when told
    route = "in place" if MAJOR >= 5 else "state dict"
    assert all(m["route"] == route and m["state_dict_route"] == "state dict" for m in models.values())
    assert all(set(m["handovers"]) == {"whole_s", "streamed_s"} for m in models.values())
    assert any(".experts.0." in n for n in checkpoint_names(tmp_path / "qwen3-moe-fine-small"))
    assert f"| finemoe | 69 | 0.00 | {route} |" in r.stderr
    assert "transformers " + transformers.__version__ in r.stderr


# -- the arguments transformers users pass (issue 29, item 3) ---------------------------

def no_read_after_error(monkeypatch):
    monkeypatch.setattr(_background, "BackgroundLoad", lambda *a, **k: pytest.fail("read before the check"))
    no_read(monkeypatch)


@pytest.mark.parametrize("kwargs", [{"low_cpu_mem_usage": True}, {"low_cpu_mem_usage": False},
                                    {"use_safetensors": True}, {"use_safetensors": None},
                                    {"num_hidden_layers": 1}, {"output_attentions": True},
                                    {"ignore_mismatched_sizes": False}, {"weights_only": True},
                                    {"force_download": False, "proxies": None}],
                         ids=lambda kw: ",".join(kw))
def test_arguments_transformers_takes(tmp_path, kwargs):
    """As transformers' own from_pretrained given the same: config
    attributes override the config (one layer: the second's weights are
    unexpected, not missing), the others mean what they mean there."""
    path, _ = save(tmp_path, "llama", sharded=True)
    ref = AUTO.from_pretrained(path, **kwargs)
    ours = from_pretrained(path, device="cpu", **kwargs)
    assert_same_model(ours, ref)
    if "num_hidden_layers" in kwargs:
        assert len(ours.model.layers) == 1


def test_config_object_and_path(tmp_path):
    path, cls = save(tmp_path, "llama", sharded=False)
    config = transformers.AutoConfig.from_pretrained(path, num_hidden_layers=1)
    ref = AUTO.from_pretrained(path, config=config)
    ours = from_pretrained(path, device="cpu", config=config)
    assert_same_model(ours, ref)
    assert config.num_hidden_layers == 1 and len(ours.model.layers) == 1
    # a path: its config.json, the model directory's weights (which then
    # needs none of its own), as the model class takes it (the Auto class
    # reads the model directory's config.json whatever config names)
    other = tmp_path / "config-only"
    config.save_pretrained(other)
    (path / "config.json").unlink()
    assert_same_model(from_pretrained(path, device="cpu", config=str(other)),
                      cls.from_pretrained(path, config=str(other)))


def test_subfolder(tmp_path):
    inner, _ = save(tmp_path / "outer", "qwen2", sharded=True, name="sub")
    outer = inner.parent
    ref = AUTO.from_pretrained(outer, subfolder="sub")
    assert_same_model(from_pretrained(outer, device="cpu", subfolder="sub"), ref)


def test_variant(tmp_path):
    config, cls = configs()["llama"]
    path = tmp_path / "variants"
    torch.manual_seed(1)
    cls(config).save_pretrained(path)
    torch.manual_seed(2)
    cls(config).save_pretrained(path, variant="v2", max_shard_size="24KB")
    ours = from_pretrained(path, device="cpu", variant="v2")
    assert_same_model(ours, AUTO.from_pretrained(path, variant="v2"))
    assert not torch.equal(ours.lm_head.weight, from_pretrained(path, device="cpu").lm_head.weight)


def test_hub_id_with_subfolder_from_the_cache(tmp_path, offline):
    cache = tmp_path / "hub"
    snapshot = cache / "models--org--nested" / "snapshots" / ("c" * 40)
    save(snapshot, "llama", sharded=True, name="model")
    (cache / "models--org--nested" / "refs").mkdir(parents=True)
    (cache / "models--org--nested" / "refs" / "main").write_text("c" * 40)
    ref = AUTO.from_pretrained("org/nested", subfolder="model", cache_dir=str(cache))
    assert_same_model(from_pretrained("org/nested", device="cpu", subfolder="model", cache_dir=str(cache)),
                      ref)


def remove_weight(path, victim):
    from safetensors.torch import load_file as st_load
    from safetensors.torch import save_file as st_save
    tensors = st_load(path / "model.safetensors")
    del tensors[victim]
    tensors["extra.head.weight"] = torch.ones(4, 4)
    st_save(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_output_loading_info(tmp_path):
    """(model, info) as transformers returns them: the same missing and
    unexpected keys; a missing weight is then no error, and it is
    initialised as transformers initialises it."""
    path, _ = save(tmp_path, "llama", sharded=False)
    ours, info = from_pretrained(path, device="cpu", output_loading_info=True)
    ref, ref_info = AUTO.from_pretrained(path, output_loading_info=True)
    assert_same_model(ours, ref)
    assert info == ref_info
    victim = "model.layers.1.mlp.down_proj.weight"
    remove_weight(path, victim)
    torch.manual_seed(7)
    ref, ref_info = AUTO.from_pretrained(path, output_loading_info=True)
    torch.manual_seed(7)
    ours, info = from_pretrained(path, device="cpu", output_loading_info=True)
    assert sorted(info["missing_keys"]) == sorted(ref_info["missing_keys"]) == [victim]
    assert sorted(info["unexpected_keys"]) == sorted(ref_info["unexpected_keys"]) == ["extra.head.weight"]
    assert sorted(info["mismatched_keys"]) == sorted(ref_info["mismatched_keys"]) == []
    assert_same_model(ours, ref)
    with pytest.raises(KeyError, match=victim):       # without it: the error
        from_pretrained(path, device="cpu")


def test_key_mapping(tmp_path):
    """A checkpoint whose names are not the model's: transformers renames
    them with the caller's key_mapping, as from its own files."""
    from safetensors.torch import load_file as st_load
    from safetensors.torch import save_file as st_save
    path, _ = save(tmp_path, "llama", sharded=False)
    tensors = st_load(path / "model.safetensors")
    st_save({n.replace(".mlp.", ".feed_forward."): t for n, t in tensors.items()},
            path / "model.safetensors", metadata={"format": "pt"})
    mapping = {r"\.feed_forward\.": ".mlp."}
    ref = AUTO.from_pretrained(path, key_mapping=mapping)
    ours = from_pretrained(path, device="cpu", key_mapping=mapping)
    assert_same_model(ours, ref)
    name = "model.layers.1.mlp.up_proj.weight"
    assert torch.equal(ours.get_parameter(name), tensors[name])


@pytest.fixture
def one_rank(monkeypatch):
    """torch.distributed's environment of a world of one (gloo on the CPU):
    transformers' tensor parallelism sets up its group from it."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        monkeypatch.setenv(name, value)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a world of one on the CPU")
def test_tp_plan(tmp_path, one_rank):
    import warnings
    path, _ = save(tmp_path, "llama", sharded=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)     # transformers 5: "pass a DistributedConfig"
        ref = AUTO.from_pretrained(path, tp_plan="auto")
        ours = from_pretrained(path, tp_plan="auto")
    assert_same_model(ours, ref)
    with pytest.raises(ValueError, match="tensor parallelism"):
        from_pretrained(path, device="cpu", tp_plan="auto")


def test_an_argument_transformers_refuses_is_its_error(tmp_path):
    path, _ = save(tmp_path, "llama", sharded=False)
    with pytest.raises(TypeError) as theirs:
        AUTO.from_pretrained(path, no_such_argument=1)
    with pytest.raises(TypeError) as ours:
        from_pretrained(path, device="cpu", no_such_argument=1)
    assert str(ours.value) == str(theirs.value)
    assert not [t for t in __import__("threading").enumerate() if t.name == "instant_staging-from_pretrained"]
