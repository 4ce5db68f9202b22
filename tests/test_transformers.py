"""integrations.transformers.from_pretrained against transformers' own.

Tiny models of several architectures (Llama, GPT-2, Qwen2 and Mistral; GPT-2
and Qwen2 with tied embeddings) are saved with ``save_pretrained`` (one
file, and sharded with an index) and loaded on the CPU by both: the same
class, parameters and buffers equal bit for bit (same dtypes), the same
tying, eval mode, and the same logits for one input.
"""

import json
import logging
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from instant_staging.integrations.transformers import from_pretrained
from instant_staging.loader import _load

SMALL = {"vocab_size": 96, "max_position_embeddings": 64}


def configs():
    return {
        "llama": (transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2,
                                           tie_word_embeddings=False, **SMALL),
                  transformers.LlamaForCausalLM),
        "gpt2": (transformers.GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=2,
                                         n_head=4, bos_token_id=0, eos_token_id=0),
                 transformers.GPT2LMHeadModel),
        "qwen2": (transformers.Qwen2Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2,
                                           tie_word_embeddings=True, **SMALL),
                  transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=1,
                                               head_dim=8, **SMALL),
                    transformers.MistralForCausalLM),
    }


def save(tmp_path, arch, sharded, seed=0):
    config, cls = configs()[arch]
    torch.manual_seed(seed)
    model = cls(config)
    path = tmp_path / f"{arch}-{'sharded' if sharded else 'single'}"
    model.save_pretrained(path, max_shard_size="24KB" if sharded else "10GB")
    assert os.path.exists(path / "model.safetensors.index.json") == sharded
    return path, cls


def assert_same_model(ours, ref):
    assert type(ours) is type(ref)
    assert not ours.training and not ref.training
    ours_p = dict(ours.named_parameters(remove_duplicate=False))
    ref_p = dict(ref.named_parameters(remove_duplicate=False))
    assert list(ours_p) == list(ref_p)
    for name, p in ref_p.items():
        q = ours_p[name]
        assert q.dtype == p.dtype and q.shape == p.shape and q.device.type == "cpu", name
        assert torch.equal(q.view(torch.uint8) if q.dim() else q, p.view(torch.uint8) if p.dim() else p), name
        assert q.requires_grad == p.requires_grad, name
    ours_b, ref_b = dict(ours.named_buffers()), dict(ref.named_buffers())
    assert list(ours_b) == list(ref_b)
    for name, b in ref_b.items():
        assert ours_b[name].dtype == b.dtype and torch.equal(ours_b[name], b), name
    # tying: the same parameters are one object in both
    def groups(m):
        ids = {}
        for n, p in m.named_parameters(remove_duplicate=False):
            ids.setdefault(id(p), []).append(n)
        return sorted(sorted(g) for g in ids.values())
    assert groups(ours) == groups(ref)
    ids = torch.tensor([[3, 17, 42, 5, 90, 1]])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, ref(ids).logits)


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2", "mistral"])
def test_same_model_as_transformers(tmp_path, arch, sharded):
    path, cls = save(tmp_path, arch, sharded)
    ref = cls.from_pretrained(path)
    ours = from_pretrained(path, device="cpu")
    assert_same_model(ours, ref)
    assert ours.config.dtype == ref.config.dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_same_model_with_dtype(tmp_path, arch, dtype):
    path, cls = save(tmp_path, arch, sharded=True)
    ref = cls.from_pretrained(path, dtype=dtype)
    ours = from_pretrained(path, device="cpu", dtype=dtype)
    assert_same_model(ours, ref)


def test_tied_embeddings_are_one_tensor(tmp_path):
    path, _ = save(tmp_path, "qwen2", sharded=True)
    weights = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in weights           # save_pretrained drops the tied copy
    model = from_pretrained(path, device="cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_rotary_buffers_made_not_read(tmp_path):
    path, _ = save(tmp_path, "llama", sharded=False)
    model = from_pretrained(path, device="cpu")
    inv_freq = model.model.rotary_emb.inv_freq
    dim = 32 // 4
    base = model.config.rope_parameters["rope_theta"] if hasattr(model.config, "rope_parameters") \
        else model.config.rope_theta
    expected = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    assert inv_freq.device.type == "cpu" and torch.equal(inv_freq, expected)


def test_model_class_and_auto_class(tmp_path):
    path, cls = save(tmp_path, "llama", sharded=False)
    ref = cls.from_pretrained(path)
    assert_same_model(from_pretrained(path, device="cpu", model_class=transformers.AutoModelForCausalLM), ref)
    base = from_pretrained(path, device="cpu", model_class=transformers.LlamaModel)
    assert type(base) is transformers.LlamaModel     # the base_model_prefix is stripped
    assert torch.equal(base.embed_tokens.weight, ref.model.embed_tokens.weight)


def test_missing_weight_is_an_error_before_reading(tmp_path, monkeypatch):
    path, _ = save(tmp_path, "llama", sharded=True)
    index = path / "model.safetensors.index.json"
    obj = json.loads(index.read_text())
    # a shard file that lacks one tensor: rewrite it without it, fix the index
    victim = "model.layers.1.mlp.down_proj.weight"
    shard = path / obj["weight_map"].pop(victim)
    from safetensors.torch import load_file as st_load
    from safetensors.torch import save_file as st_save
    tensors = st_load(shard)
    del tensors[victim]
    st_save(tensors, shard, metadata={"format": "pt"})
    index.write_text(json.dumps(obj))
    monkeypatch.setattr(_load, "_load", lambda *a, **k: pytest.fail("read before the check"))
    with pytest.raises(KeyError, match=victim):
        from_pretrained(path, device="cpu")


def test_unexpected_weights_are_ignored_and_not_read(tmp_path, caplog):
    path, cls = save(tmp_path, "llama", sharded=False)
    from safetensors.torch import load_file as st_load
    from safetensors.torch import save_file as st_save
    tensors = st_load(path / "model.safetensors")
    tensors["extra.head.weight"] = torch.ones(4, 4)
    st_save(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="instant_staging"):
        ours = from_pretrained(path, device="cpu")
    assert "extra.head.weight" in caplog.text
    assert_same_model(ours, cls.from_pretrained(path))


def test_shape_mismatch(tmp_path):
    path, _ = save(tmp_path, "llama", sharded=False)
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 72
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"shape mismatch.*mlp"):
        from_pretrained(path, device="cpu")


def test_bad_arguments(tmp_path):
    path, _ = save(tmp_path, "llama", sharded=False)
    with pytest.raises(ValueError, match="floating-point"):
        from_pretrained(path, device="cpu", dtype=torch.int8)
    with pytest.raises(ValueError, match="device"):
        from_pretrained(path, device="mps")
    with pytest.raises(TypeError, match="model_class"):
        from_pretrained(path, device="cpu", model_class="LlamaForCausalLM")
    with pytest.raises(FileNotFoundError, match="no such model directory"):
        from_pretrained(tmp_path / "absent", device="cpu")
    with pytest.raises(FileNotFoundError, match=r"config.json"):
        from_pretrained(tmp_path, device="cpu")
    config = json.loads((path / "config.json").read_text())
    del config["architectures"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="architectures"):
        from_pretrained(path, device="cpu")


def test_failed_read_frees_everything_and_restores_torch(tmp_path, monkeypatch):
    import gc
    import weakref

    from instant_staging.loader import LoadError
    path, _ = save(tmp_path, "llama", sharded=True)
    refs = []
    real = _load._load

    def failing(*args, **kwargs):
        # every tensor is loaded and held by from_pretrained when the load fails
        for item in real(*args, **kwargs):
            refs.append(weakref.ref(item[1]))
            yield item
            item = None           # this spy's frame outlives the failure too
        raise LoadError("injected: the read of the last chunk failed")
    monkeypatch.setattr(_load, "_load", failing)
    before = torch.nn.Module.register_parameter
    with pytest.raises(LoadError) as info:
        from_pretrained(path, device="cpu")
    assert info.value is not None            # the exception (and its traceback) still alive
    gc.collect()
    assert refs and all(r() is None for r in refs)
    assert torch.nn.Module.register_parameter is before
    assert torch.get_default_dtype() == torch.float32


def test_meta_patch_is_undone(tmp_path):
    path, _ = save(tmp_path, "gpt2", sharded=False)
    before = torch.nn.Module.register_parameter
    from_pretrained(path, device="cpu")
    assert torch.nn.Module.register_parameter is before
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.gpu
def test_gpu_same_parameters(tmp_path, gpu):
    path, cls = save(tmp_path, "qwen2", sharded=True)
    ref = cls.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda:0")
    ours = from_pretrained(path, device="cuda:0", dtype=torch.bfloat16)
    for (n, p), (m, q) in zip(ref.named_parameters(), ours.named_parameters()):
        assert n == m and q.device == p.device and torch.equal(p, q), n
    for (n, b), (m, c) in zip(ref.named_buffers(), ours.named_buffers()):
        assert n == m and c.device == b.device and torch.equal(b, c), n
