"""Tiny transformers models of several architectures, saved with
``save_pretrained``, and the comparison of a loaded model with
transformers' own (torch and transformers needed: import this after
``pytest.importorskip`` of them).
"""

import os

import torch
import transformers

SMALL = {"vocab_size": 96, "max_position_embeddings": 64}
AUTO = transformers.AutoModelForCausalLM


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
        "mixtral": (transformers.MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2,
                                               num_local_experts=4, num_experts_per_tok=2, **SMALL),
                    transformers.MixtralForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig(hidden_size=32, intermediate_size=64,
                                                  moe_intermediate_size=16,
                                                  shared_expert_intermediate_size=32, num_experts=4,
                                                  num_experts_per_tok=2, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2, **SMALL),
                      transformers.Qwen2MoeForCausalLM),
        # fine-grained: a shared expert neither, the experts' gate and up fused
        "qwen3_moe": (transformers.Qwen3MoeConfig(hidden_size=32, intermediate_size=64,
                                                  moe_intermediate_size=16, num_experts=4,
                                                  num_experts_per_tok=2, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                                  **SMALL),
                      transformers.Qwen3MoeForCausalLM),
    }


def save(tmp_path, arch, sharded, seed=0, name=None):
    config, cls = configs()[arch]
    torch.manual_seed(seed)
    model = cls(config)
    path = tmp_path / (name or f"{arch}-{'sharded' if sharded else 'single'}")
    model.save_pretrained(path, max_shard_size="24KB" if sharded else "10GB")
    assert os.path.exists(path / "model.safetensors.index.json") == sharded
    return path, cls


def bits(t):
    return t.reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1)


def assert_same_model(ours, ref, logits=True):
    assert type(ours) is type(ref)
    assert not ours.training and not ref.training
    ours_p = dict(ours.named_parameters(remove_duplicate=False))
    ref_p = dict(ref.named_parameters(remove_duplicate=False))
    assert list(ours_p) == list(ref_p)
    for name, p in ref_p.items():
        q = ours_p[name]
        assert q.dtype == p.dtype and q.shape == p.shape and q.device == p.device, name
        assert torch.equal(bits(q), bits(p)), name
        assert q.requires_grad == p.requires_grad, name
    ours_b, ref_b = dict(ours.named_buffers()), dict(ref.named_buffers())
    assert list(ours_b) == list(ref_b)
    for name, b in ref_b.items():
        assert ours_b[name].dtype == b.dtype and torch.equal(ours_b[name], b), name

    def groups(m):       # tying: the same parameters are one object in both
        ids = {}
        for n, p in m.named_parameters(remove_duplicate=False):
            ids.setdefault(id(p), []).append(n)
        return sorted(sorted(g) for g in ids.values())
    assert groups(ours) == groups(ref)
    assert ours.config.to_dict() == ref.config.to_dict()
    assert ours.generation_config.to_dict() == ref.generation_config.to_dict()
    if not logits:
        return
    ids = torch.tensor([[3, 17, 42, 5, 90, 1]])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, ref(ids).logits)
