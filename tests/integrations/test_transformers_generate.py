"""generate() on the models integrations.transformers.from_pretrained
returns, against transformers' own: greedy, a few tokens, tiny random
models saved with ``save_pretrained`` (whose generation_config.json says
``"_from_model_config": true``), on one device and offloaded to the disk.
Run on each transformers tox names (transformers-floor, transformers-4.57,
and the newest in every other env).
"""

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from instant_staging.integrations.transformers import _placement, from_pretrained

from support.models import AUTO, configs

PROMPT = [[3, 17, 42, 5, 90, 1], [8, 8, 61, 2, 33, 70]]
NEW_TOKENS = 6


def save(tmp_path, arch):
    config, cls = configs()[arch]
    torch.manual_seed(0)
    path = tmp_path / arch
    cls(config).save_pretrained(path, max_shard_size="24KB")
    # the case generate() failed on with transformers 4.56-4.57
    assert json.loads((path / "generation_config.json").read_text())["_from_model_config"] is True
    return path


def generated(model):
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        # no eos: every row gets NEW_TOKENS tokens, whatever the random weights pick
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    assert out.shape == (len(PROMPT), len(PROMPT[0]) + NEW_TOKENS)
    return out


@pytest.mark.parametrize("arch", ["llama", "mixtral", "qwen3_moe", "qwen2", "gpt2"])
def test_generate_as_transformers(tmp_path, arch):
    path = save(tmp_path, arch)
    ref = AUTO.from_pretrained(path)
    ours = from_pretrained(path, device="cpu")
    assert arch != "qwen2" or ours.lm_head.weight is ours.model.embed_tokens.weight      # tied
    assert ours.generation_config.to_dict() == ref.generation_config.to_dict()
    assert torch.equal(generated(ours), generated(ref))


def test_generate_takes_the_changes_to_the_config_as_transformers_does(tmp_path):
    # transformers' legacy rule: a generation config made from the model's
    # config and not changed since follows later changes of the config (4,
    # with a warning; 5 refuses them)
    path = save(tmp_path, "llama")
    ref, ours = AUTO.from_pretrained(path), from_pretrained(path, device="cpu")
    for model in (ref, ours):
        model.config.no_repeat_ngram_size = 2
    if not transformers.__version__.startswith("4."):
        for model in (ref, ours):
            with pytest.raises(ValueError, match="no_repeat_ngram_size"):
                generated(model)
        return
    with pytest.warns(UserWarning, match="modified the pretrained model configuration"):
        mine = generated(ours)
    assert torch.equal(mine, generated(ref))


@pytest.mark.parametrize("arch, device_map", [
    ("llama", {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
               "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "disk"}),
    ("gpt2", {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.h.0": "disk",
              "transformer.h.1": "cpu", "transformer.ln_f": "cpu", "lm_head": "cpu"}),
], ids=["llama", "gpt2-tied"])
def test_generate_offloaded_to_the_disk(tmp_path, arch, device_map):
    # transformers 4.57 failed on a state dict under a map with "disk"
    pytest.importorskip("accelerate")
    path = save(tmp_path, arch)
    ref = AUTO.from_pretrained(path, device_map=device_map, offload_folder=str(tmp_path / "ref-offload"))
    ours = from_pretrained(path, device_map=device_map, offload_folder=str(tmp_path / "offload"))
    assert "disk" in ours.hf_device_map.values()
    assert torch.equal(generated(ours), generated(ref))


def test_the_offloading_stand_in_leaves_the_class_as_it_was(tmp_path):
    cls = transformers.LlamaForCausalLM
    before = cls.__dict__.get("_load_pretrained_model")
    with _placement.offloading_a_state_dict(transformers, cls):
        pass
    with pytest.raises(RuntimeError), _placement.offloading_a_state_dict(transformers, cls):
        raise RuntimeError
    assert cls.__dict__.get("_load_pretrained_model") is before
