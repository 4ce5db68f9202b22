"""``reload_weights`` (issue 42): a checkpoint B written into a model built
from checkpoint A, in place: every parameter and buffer equal to a fresh
``from_pretrained`` of B bit for bit, every ``data_ptr`` unchanged, tied
weights written once, names mapped as transformers maps them (the MoE
experts fused by transformers 5 included)."""

import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
st = pytest.importorskip("safetensors.torch")

from instant_staging.integrations.transformers import reload_weights
from instant_staging.loader import LoadError

from support.models import bits, save


def assert_same_weights(ours, ref, logits=True):
    """Every parameter and buffer bit for bit, the tying, the logits (the
    configs differ in name_or_path alone; ``logits=False``: not run)."""
    ours_p = dict(ours.named_parameters(remove_duplicate=False))
    ref_p = dict(ref.named_parameters(remove_duplicate=False))
    assert list(ours_p) == list(ref_p)
    for name, p in ref_p.items():
        assert ours_p[name].dtype == p.dtype and torch.equal(bits(ours_p[name]), bits(p)), name
    ours_b, ref_b = dict(ours.named_buffers()), dict(ref.named_buffers())
    assert list(ours_b) == list(ref_b)
    for name, b in ref_b.items():
        assert torch.equal(bits(ours_b[name]), bits(b)), name
    tied = [n for n, p in ref_p.items() if any(q is p for m, q in ref_p.items() if m != n)]
    assert tied == [n for n, p in ours_p.items() if any(q is p for m, q in ours_p.items() if m != n)]
    if not logits:
        return
    ids = torch.tensor([[3, 17, 42, 5, 90, 1]])
    with torch.no_grad():       # (each model's input on its own device: a GPU model's too)
        assert torch.equal(ours(ids.to(ours.device)).logits.cpu(), ref(ids.to(ref.device)).logits.cpu())


def _ptrs(model):
    return {**{n: p.data_ptr() for n, p in model.named_parameters(remove_duplicate=False)},
            **{n: b.data_ptr() for n, b in model.named_buffers()}}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_reload_equals_a_fresh_load_in_place(tmp_path, arch, sharded):
    a, cls = save(tmp_path, arch, sharded, seed=1, name="a")
    b, _ = save(tmp_path, arch, sharded, seed=2, name="b")
    model = cls.from_pretrained(a).eval()
    before = _ptrs(model)
    fresh = cls.from_pretrained(b).eval()
    differs = [n for n, p in fresh.named_parameters() if not torch.equal(bits(p), bits(dict(
        model.named_parameters())[n]))]
    assert differs                         # A and B are different checkpoints
    reports = reload_weights(model, b, chunk_size=4096)
    assert len(reports) == 1 and reports[0].device == "cpu"
    assert _ptrs(model) == before
    assert_same_weights(model, fresh)


def test_a_checkpoint_of_another_architecture_is_refused_before_any_write(tmp_path):
    a, cls = save(tmp_path, "llama", False, seed=1, name="a")
    other, _ = save(tmp_path, "qwen2", False, seed=2, name="b")
    model = cls.from_pretrained(a).eval()
    copy = {n: bits(p).clone() for n, p in model.named_parameters()}
    with pytest.raises((ValueError, TypeError)):
        reload_weights(model, other)
    assert all(torch.equal(bits(p), copy[n]) for n, p in model.named_parameters())


def test_a_missing_weight_is_named_and_strict_false_leaves_it(tmp_path):
    a, cls = save(tmp_path, "llama", False, seed=1, name="a")
    b, _ = save(tmp_path, "llama", False, seed=2, name="b")
    path = os.path.join(b, "model.safetensors")
    state = st.load_file(path)
    dropped = state.pop("lm_head.weight")
    st.save_file(state, path, metadata={"format": "pt"})
    model = cls.from_pretrained(a).eval()
    kept = model.lm_head.weight.detach().clone()
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        reload_weights(model, b)
    reload_weights(model, b, strict=False)
    assert torch.equal(model.lm_head.weight, kept) and not torch.equal(kept, dropped)
    assert torch.equal(model.model.embed_tokens.weight, state["model.embed_tokens.weight"])


def test_a_failure_part_way_names_the_written_weights(tmp_path, monkeypatch):
    a, cls = save(tmp_path, "llama", False, seed=1, name="a")
    b, _ = save(tmp_path, "llama", False, seed=2, name="b")
    model = cls.from_pretrained(a).eval()
    monkeypatch.setenv("INSTANT_STAGING_FAULTS", "read#6=EIO")
    with pytest.raises(LoadError) as e:
        reload_weights(model, b, chunk_size=4096, threads=1)
    assert e.value.unwritten


def test_bench_reload_quick(tmp_path):
    from support import run_bench_quick
    rows = run_bench_quick(tmp_path, "bench_reload.py")["results"]
    assert [(x["layout"], x["method"]) for x in rows] == [
        ("dense", "load_file"), ("dense", "load_into"), ("dense", "load_into-flat"),
        ("dense-model", "load_state_dict"), ("dense-model", "reload_weights"),
        ("finemoe", "load_file"), ("finemoe", "load_into"), ("finemoe", "load_into-flat")]
    flat = [x for x in rows if x["method"] == "load_into-flat"]
    assert all(x["back_to_back"][0] == x["back_to_back"][1] > 0 for x in flat)
    assert all(x["bit_exact"] is True and x["best"] > 0 for x in rows)


def test_the_base_model_prefix_is_added_and_stripped_as_from_pretrained_does(tmp_path):
    a, cls = save(tmp_path, "llama", False, seed=1, name="a")
    b, _ = save(tmp_path, "llama", False, seed=2, name="b")
    task = cls.from_pretrained(a).eval()
    base_b = transformers.LlamaModel.from_pretrained(b).eval()       # its keys lack "model."
    base_dir = tmp_path / "base-b"
    base_b.save_pretrained(base_dir)
    reload_weights(task, base_dir, strict=False)                      # lm_head: not in it
    for name, p in base_b.named_parameters():
        assert torch.equal(bits(dict(task.model.named_parameters())[name]), bits(p)), name
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        reload_weights(task, base_dir)
    base = transformers.LlamaModel.from_pretrained(a).eval()
    ptrs = {n: p.data_ptr() for n, p in base.named_parameters()}
    reload_weights(base, b, strict=False)                             # "model." stripped; lm_head unused
    fresh = cls.from_pretrained(b).eval()
    for name, p in fresh.model.named_parameters():
        got = dict(base.named_parameters())[name]
        assert torch.equal(bits(got), bits(p)) and got.data_ptr() == ptrs[name], name


@pytest.mark.gpu
def test_a_model_over_two_devices_is_reloaded_on_each(tmp_path):
    a, cls = save(tmp_path, "llama", False, seed=1, name="a")
    b, _ = save(tmp_path, "llama", False, seed=2, name="b")
    where = {"model.embed_tokens": "cpu", "model.layers.0": 0, "model.layers.1": "cpu",
             "model.norm": 0, "model.rotary_emb": 0, "lm_head": 0}
    model = cls.from_pretrained(a, device_map=where).eval()
    devices = {p.device.type for p in model.parameters()}
    if "meta" in devices:
        # This transformers offloads a "cpu" entry beside a GPU (its weights
        # kept by accelerate's hooks, the parameters on meta): nothing there
        # to write in place, and reload_weights says so before any write.
        with pytest.raises(ValueError, match="meta device"):
            reload_weights(model, b)
        return
    assert devices == {"cpu", "cuda"}, devices
    before = _ptrs(model)
    reports = reload_weights(model, b)
    assert sorted(r.device for r in reports) == ["cpu", "cuda:0"]
    assert _ptrs(model) == before
    fresh = cls.from_pretrained(b).eval()
    ours = dict(model.named_parameters())
    for name, p in fresh.named_parameters():
        assert torch.equal(bits(ours[name].cpu()), bits(p)), name


@pytest.mark.gpu
def test_fp8_block_quantized_weights_and_scales_bit_exact(tmp_path):
    """transformers builds an FP8 block-quantized model only on a GPU."""
    pytest.importorskip("accelerate")
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      tie_word_embeddings=False)
    quant = transformers.FineGrainedFP8Config(weight_block_size=(128, 128))
    dirs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        plain = tmp_path / f"plain-{seed}"
        transformers.LlamaForCausalLM(config).save_pretrained(plain)
        q = transformers.LlamaForCausalLM.from_pretrained(plain, quantization_config=quant,
                                                          device_map={"": 0})
        q.save_pretrained(tmp_path / f"fp8-{seed}")
        dirs.append(tmp_path / f"fp8-{seed}")
    model = transformers.LlamaForCausalLM.from_pretrained(dirs[0], device_map={"": 0}).eval()
    assert any(p.dtype == torch.float8_e4m3fn for p in model.parameters())
    before = _ptrs(model)
    reload_weights(model, dirs[1])
    assert _ptrs(model) == before
    fresh = transformers.LlamaForCausalLM.from_pretrained(dirs[1], device_map={"": 0}).eval()
    assert_same_weights(model, fresh, logits=False)
    # The forward pass needs transformers' FP8 kernel (the `kernels` package,
    # fetched from the Hub): where it is missing, the weights and scales above
    # are the proof, and the logits are skipped with the reason.
    ids = torch.tensor([[3, 17, 42, 5, 90, 1]], device=model.device)
    try:
        with torch.no_grad():
            ours, ref = model(ids).logits, fresh(ids).logits
    except ImportError as e:
        pytest.skip(f"weights and scales bit-exact; logits not compared: {e}")
    assert torch.equal(ours, ref)
