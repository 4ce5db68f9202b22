"""Step 4 in place (integrations/transformers/_inplace.py): which route
each load takes, and the model equal to transformers' own on both.

With transformers 5 on one device, a checkpoint that covers the model with
its own dtypes is written into the parameters transformers makes (the log
line says "weights written in place", and transformers is handed no
tensor); anything else (a weight missing, one the model lacks, a cast,
experts that are not each there once in order, a quantization config, a
map over several devices, transformers 4) hands transformers the state
dict as before.  Each case is compared with transformers' own
``from_pretrained`` bit for bit (parameters, buffers, tying, logits) and,
where it says so, its loading info.
"""

import json
import logging
import threading

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file as st_load
from safetensors.torch import save_file as st_save

from instant_staging.integrations.transformers import _background, _inplace, from_pretrained

from support.models import AUTO, assert_same_model, configs, save

MAJOR = int(transformers.__version__.split(".")[0])
# transformers 4 has no conversion to stand in for: always the state dict.
IN_PLACE = "in place" if MAJOR >= 5 else "state dict"
FIVE = pytest.mark.skipif(MAJOR < 5, reason="the in-place route is transformers 5's (4: the state dict)")


def load(path, caplog, monkeypatch, **kwargs):
    """(what from_pretrained returns, its route, the tensors transformers
    was handed from the state dict)."""
    handed = []
    real = _background.BackgroundLoad.wait

    def wait(self, name):
        handed.append(name)
        return real(self, name)
    monkeypatch.setattr(_background.BackgroundLoad, "wait", wait)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="instant_staging"):
        result = from_pretrained(path, device="cpu", **kwargs)
    monkeypatch.setattr(_background.BackgroundLoad, "wait", real)
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("from_pretrained ")]
    route = "in place" if line.endswith("weights written in place") else "state dict"
    assert line.endswith("weights handed over in a state dict") or route == "in place", line
    return result, route, handed


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("arch", sorted(configs()))
def test_every_architecture_is_written_in_place(tmp_path, caplog, monkeypatch, arch, sharded):
    # (tied embeddings: gpt2, qwen2; experts fused: mixtral, qwen2_moe, qwen3_moe)
    path, _ = save(tmp_path, arch, sharded)
    ours, route, handed = load(path, caplog, monkeypatch)
    assert route == IN_PLACE
    assert (handed == []) == (route == "in place")
    assert_same_model(ours, AUTO.from_pretrained(path))


@FIVE
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_fine_grained_moe_in_bfloat16_as_transformers(tmp_path, caplog, monkeypatch, dtype):
    # The bench's layout in small: a Qwen3-MoE saved in bf16, one tensor per
    # expert matrix, read into the fused gate_up and down parameters.
    config, cls = configs()["qwen3_moe"]
    torch.manual_seed(3)
    cls(config).to(torch.bfloat16).save_pretrained(tmp_path / "m", max_shard_size="24KB")
    ours, route, _ = load(tmp_path / "m", caplog, monkeypatch, dtype=dtype)
    assert route == "in place"
    ref = AUTO.from_pretrained(tmp_path / "m", dtype=dtype)
    assert ours.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    assert_same_model(ours, ref)
    # saved back as transformers saves its own (its conversions, reverted)
    assert ours._weight_conversions and repr(ours._weight_conversions) == repr(ref._weight_conversions)
    ours.save_pretrained(tmp_path / "ours")
    ref.save_pretrained(tmp_path / "ref")
    saved, ref_saved = (st_load(tmp_path / d / "model.safetensors") for d in ("ours", "ref"))
    assert list(saved) == list(ref_saved) and all(torch.equal(saved[n], ref_saved[n]) for n in saved)
    # each expert's gate and up halves are the checkpoint's own tensors
    names = st_load(next((tmp_path / "m").glob("*00001-of-*.safetensors")))
    for name, tensor in names.items():
        if ".mlp.experts.2.up_proj." in name:
            layer = int(name.split(".")[2])
            fused = ours.model.layers[layer].mlp.experts.gate_up_proj[2]
            assert torch.equal(fused[fused.shape[0] // 2:], tensor)


def rewrite(path, change):
    """The one-file checkpoint at ``path`` with ``change(tensors)`` applied."""
    tensors = st_load(path / "model.safetensors")
    change(tensors)
    st_save(tensors, path / "model.safetensors", metadata={"format": "pt"})


def drop(name):
    return lambda tensors: tensors.pop(name)


def add(name, tensor):
    return lambda tensors: tensors.__setitem__(name, tensor)


def half(name):
    return lambda tensors: tensors.__setitem__(name, tensors[name].half())


def rename(old, new):
    return lambda tensors: tensors.__setitem__(new, tensors.pop(old))


def renumber(prefix, old, new):
    def change(tensors):
        for name in [n for n in tensors if n.startswith(f"{prefix}.{old}.")]:
            tensors[name.replace(f"{prefix}.{old}.", f"{prefix}.{new}.")] = tensors.pop(name)
    return change


EXPERTS = "model.layers.0.mlp.experts"


@FIVE
@pytest.mark.parametrize("arch, change", [
    ("llama", drop("model.layers.1.mlp.down_proj.weight")),          # transformers initialises it
    ("llama", add("extra.head.weight", torch.ones(4, 4))),            # unexpected: its report
    ("llama", half("model.layers.0.self_attn.q_proj.weight")),       # one cast, found in the model
    ("llama", add("model.norm.weight", torch.ones(7))),              # a shape mismatch
    ("qwen3_moe", drop(f"{EXPERTS}.1.up_proj.weight")),               # an expert's half missing
    ("qwen3_moe", renumber(EXPERTS, 3, 5)),                           # experts 0, 1, 2, 5
    ("qwen2", rename("model.embed_tokens.weight", "lm_head.weight")),  # a tie's source missing
], ids=["missing", "unexpected", "one-cast", "mismatch", "expert-half", "expert-numbers", "tie-source"])
def test_what_is_not_provably_the_same_is_transformers_own(tmp_path, caplog, monkeypatch, arch, change):
    path, _ = save(tmp_path, arch, sharded=False)
    rewrite(path, change)
    kwargs = {"output_loading_info": True, "ignore_mismatched_sizes": True}
    planned = []
    real = _inplace.plan
    monkeypatch.setattr(_inplace, "plan", lambda *a: planned.append(real(*a)) or planned[-1])
    torch.manual_seed(7)
    try:
        ref, ref_info = AUTO.from_pretrained(path, **kwargs)
    except RuntimeError as e:            # a conversion that fails: its error
        with pytest.raises(RuntimeError, match=str(e).splitlines()[0][:40]):
            load(path, caplog, monkeypatch, **kwargs)
        assert planned == [None]
        return
    torch.manual_seed(7)
    (ours, info), route, handed = load(path, caplog, monkeypatch, **kwargs)
    assert route == "state dict" and handed
    assert planned == [None]             # found in the model, not before
    assert_same_model(ours, ref)
    assert {k: sorted(map(str, v)) for k, v in info.items()} == {k: sorted(map(str, v))
                                                                  for k, v in ref_info.items()}


@FIVE
def test_a_tied_weight_the_checkpoint_also_has_is_written_in_place(tmp_path, caplog, monkeypatch):
    # transformers compares the two and ties them (equal) or warns and keeps
    # both (different): its own tie_weights, after either route.
    path, _ = save(tmp_path, "qwen2", sharded=False)
    for value in ("same", "different"):
        head = st_load(path / "model.safetensors")["model.embed_tokens.weight"] + (value == "different")
        rewrite(path, add("lm_head.weight", head))
        ours, route, _ = load(path, caplog, monkeypatch)
        assert route == IN_PLACE
        ref = AUTO.from_pretrained(path)
        assert_same_model(ours, ref)
        assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == (value == "same")


def test_a_cast_of_every_weight_is_known_from_the_headers(tmp_path, caplog, monkeypatch):
    # An fp32 checkpoint loaded as bf16: the read starts at once, as before,
    # not once the model is built (plan() would refuse it there).
    path, _ = save(tmp_path, "llama", sharded=True)
    planned = []
    real = _inplace.plan
    monkeypatch.setattr(_inplace, "plan", lambda *a: planned.append(1) or real(*a))
    ours, route, _ = load(path, caplog, monkeypatch, dtype=torch.bfloat16)
    assert route == "state dict" and planned == []
    assert_same_model(ours, AUTO.from_pretrained(path, dtype=torch.bfloat16))


def fp8(path):
    """The checkpoint at ``path`` quantized as a block-wise FP8 one (which
    transformers dequantizes on a host without a GPU)."""
    def change(tensors):
        for name in [n for n in tensors if ".layers." in n and n.endswith("proj.weight")]:
            w = tensors[name]
            tensors[name] = w.to(torch.float8_e4m3fn)
            tensors[name + "_scale_inv"] = torch.ones((w.shape[0] + 15) // 16, (w.shape[1] + 15) // 16)
    rewrite(path, change)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [16, 16]}
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.skipif(MAJOR < 5, reason="transformers 4 has no FP8 quantizer that dequantizes on the CPU")
def test_a_quantization_config_hands_over_real_tensors(tmp_path, caplog, monkeypatch):
    path, _ = save(tmp_path, "llama", sharded=False)
    fp8(path)
    ours, route, _ = load(path, caplog, monkeypatch)
    assert route == "state dict"
    assert_same_model(ours, AUTO.from_pretrained(path))


def test_a_map_over_several_devices_hands_over_the_state_dict(tmp_path, caplog, monkeypatch):
    path, _ = save(tmp_path, "mixtral", sharded=True)
    device_map = {"model.embed_tokens": "cpu", "model.layers": "cpu", "model.norm": "cpu",
                  "model.rotary_emb": "cpu", "lm_head": "disk"}
    kwargs = {"device_map": device_map, "offload_folder": str(tmp_path / "off")}
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="instant_staging"):
        from_pretrained(path, **kwargs)
    assert any(r.getMessage().endswith("weights handed over in a state dict") for r in caplog.records)


def test_in_place_off_hands_over_the_state_dict(tmp_path, caplog, monkeypatch):
    path, _ = save(tmp_path, "qwen3_moe", sharded=True)
    monkeypatch.setattr(_inplace, "IN_PLACE", False)
    ours, route, handed = load(path, caplog, monkeypatch)
    assert route == "state dict" and handed
    assert_same_model(ours, AUTO.from_pretrained(path))


@FIVE
def test_only_the_call_with_its_state_dict_is_answered(tmp_path):
    # transformers' own from_pretrained meanwhile (this thread, another one)
    # runs its own function; the last block out gives it back.
    path, _ = save(tmp_path, "mixtral", sharded=True)
    modeling = transformers.modeling_utils
    original = modeling.convert_and_load_state_dict_in_model
    ref = AUTO.from_pretrained(path)
    asked = []

    def refuse(*args):
        asked.append(args)
        raise AssertionError("answered a call that is not its own")
    a, b = {}, {}
    with _inplace.writing_in_place(transformers, a, refuse):
        with _inplace.writing_in_place(transformers, b, refuse):
            assert modeling.convert_and_load_state_dict_in_model is not original
            assert_same_model(AUTO.from_pretrained(path), ref)
        out = []
        thread = threading.Thread(target=lambda: out.append(AUTO.from_pretrained(path)))
        thread.start()
        thread.join()
        assert_same_model(out[0], ref)
        assert modeling.convert_and_load_state_dict_in_model is not original
    assert modeling.convert_and_load_state_dict_in_model is original
    assert asked == []


@FIVE
def test_a_failed_write_raises_its_error_and_keeps_nothing(tmp_path, monkeypatch):
    import gc
    import weakref

    from instant_staging.loader import Checkpoint, LoadError
    path, _ = save(tmp_path, "qwen3_moe", sharded=True)
    written = []
    real = Checkpoint.load_into

    def failing(self, tensors, **kwargs):
        written.extend(weakref.ref(t) for t in tensors.values())
        raise LoadError("injected: a read failed")
    monkeypatch.setattr(Checkpoint, "load_into", failing)
    with pytest.raises(LoadError, match="injected"):
        from_pretrained(path, device="cpu")
    monkeypatch.setattr(Checkpoint, "load_into", real)
    gc.collect()
    assert written and all(r() is None for r in written)
