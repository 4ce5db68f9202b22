"""``layer_order`` (issue 56): names grouped by layer in the model's order,
whatever their order in the files; a pure function."""

from instant_staging.loader import layer_key, layer_order


def test_layers_by_number_not_as_strings_and_the_rest_first():
    names = ["model.layers.10.mlp.w", "lm_head.weight", "model.layers.2.attn.q",
             "model.embed_tokens.weight", "model.layers.2.mlp.w", "model.norm.weight",
             "model.layers.10.attn.q", "model.layers.1.attn.q"]
    assert layer_order(names) == [
        "lm_head.weight", "model.embed_tokens.weight", "model.norm.weight",
        "model.layers.1.attn.q",
        "model.layers.2.attn.q", "model.layers.2.mlp.w",
        "model.layers.10.mlp.w", "model.layers.10.attn.q"]


def test_experts_stay_in_their_layer_and_stacks_keep_their_first_order():
    names = ["lm.layers.1.mlp.experts.3.w", "vision.blocks.0.w", "lm.layers.0.mlp.experts.12.w",
             "lm.layers.0.mlp.experts.2.w", "vision.blocks.1.w", "transformer.h.5.x"]
    assert layer_order(names) == [
        "lm.layers.0.mlp.experts.12.w", "lm.layers.0.mlp.experts.2.w",
        "lm.layers.1.mlp.experts.3.w",
        "vision.blocks.0.w", "vision.blocks.1.w", "transformer.h.5.x"]


def test_layer_key():
    assert layer_key("model.layers.12.mlp.experts.3.w1") == ("model.layers", 12)
    assert layer_key("transformer.h.0.attn") == ("transformer.h", 0)
    assert layer_key("layers.4") == ("layers", 4)
    assert layer_key("model.embed_tokens.weight") is None
    assert layer_key("model.mylayers.3.w") is None           # a whole word only
    assert layer_order([]) == []
