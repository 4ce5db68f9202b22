"""The weight-transfer engine ``instant_staging`` against a real vLLM (tox -e
vllm-0.34: vLLM 0.34 from PyPI, a CUDA build of torch running on the CPU;
skipped where vLLM is not installed).

- Where vLLM has the registry: the plugin's entry point registers the
  engine in vLLM's own ``WeightTransferEngineFactory`` under
  ``instant_staging``, a subclass of vLLM's ``WeightTransferEngine``, its
  info classes vLLM's base dataclasses.
- vLLM 0.34 (the interface verified): the factory makes it from a real
  ``VllmConfig`` (``EngineArgs(weight_transfer_config={"backend":
  "instant_staging"})``) and the worker's model: vLLM's own
  ``LlamaForCausalLM`` of a tiny checkpoint, built on the CPU by vLLM's
  ``initialize_model`` (no generation: PyPI's vLLM has no CPU kernels).
  Driven by vLLM's own ``gpu_worker.Worker`` methods (start, update,
  finish: the session the worker keeps), an update goes through the
  model's ``load_weights`` (vLLM stacks q/k/v and gate/up) inside vLLM's
  reload, every parameter keeping its storage, holding the checkpoint's
  tensors as vLLM stacks them; a delta applies there too (to the tensors
  of the version held, read again); refused updates (a delta over another
  version, a source of another version, tensors of other shapes) leave
  every parameter bit-identical, and the worker can start the next update.
"""

import contextlib
import os
import re
import socket
import types

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
vllm = pytest.importorskip("vllm", reason="vLLM is not installed (tox -e vllm-0.34 installs it)")

from instant_staging.integrations.vllm import _transfer
from instant_staging.loader import UpdateRefused, save_delta, save_file

from support.tensors import raw_bytes


def registry():
    try:
        from vllm.distributed.weight_transfer import base
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        pytest.skip(f"vLLM {vllm.__version__} has no weight-transfer registry: "
                    "collective_rpc('reload_weights') is the way there")
    return base, WeightTransferEngineFactory


def minor():
    match = re.match(r"(\d+)\.(\d+)", vllm.__version__)
    return (int(match[1]), int(match[2])) if match else None


def needs_034():
    if minor() != (0, 34):
        pytest.skip(f"the engine's interface is verified against vLLM 0.34; this is {vllm.__version__}")


def test_the_plugin_registers_the_engine_in_vllms_factory():
    base, factory = registry()
    from vllm.plugins import load_general_plugins
    load_general_plugins()          # our entry point's register(), as every vLLM process runs it
    cls = factory._registry[_transfer.BACKEND]()
    assert issubclass(cls, base.WeightTransferEngine) and issubclass(cls, _transfer.Engine)
    assert not getattr(cls, "__abstractmethods__", None)       # every abstract method defined
    if minor() == (0, 34):          # (the info classes' bases, where vLLM has them)
        assert issubclass(cls.init_info_cls, base.WeightTransferInitInfo)
        assert issubclass(cls.update_info_cls, base.WeightTransferUpdateInfo)
    assert _transfer.register_engine() and factory._registry[_transfer.BACKEND]() is cls


# -- vLLM's own Llama, built on the CPU ---------------------------------------------

SIZES = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, vocab_size=256, max_position_embeddings=128)


def hf_tensors(seed):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(tie_word_embeddings=False, **SIZES)
    return {n: t.contiguous() for n, t in transformers.LlamaForCausalLM(config).state_dict().items()}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """``(vllm_config, model, checkpoints)``: vLLM's LlamaForCausalLM on the
    CPU (dummy weights), in a world of one (gloo), torn down after."""
    registry()
    needs_034()
    import vllm.triton_utils
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.plugins import load_general_plugins

    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaConfig(tie_word_embeddings=False, dtype="float32", **SIZES).save_pretrained(path)
    v1, v2 = hf_tensors(1), hf_tensors(2)
    save_file(v1, path / "model.safetensors", version="v1")
    save_file(v2, path / "v2.safetensors", version="v2")
    save_file(v2, path / "says-v2.safetensors", version="v2")
    v3 = {n: t.clone() for n, t in v2.items()}
    v3["model.layers.0.mlp.up_proj.weight"][0, 0] += 1
    save_delta(v3, v2, path / "delta.safetensors", base_version="v2", version="v3")
    wide = dict(v2)
    wide["model.layers.1.mlp.down_proj.weight"] = torch.zeros(128, 512)
    save_file(wide, path / "wide.safetensors", version="v4")
    load_general_plugins()
    args = EngineArgs(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=64,
                      enforce_eager=True, load_format="dummy",
                      weight_transfer_config={"backend": _transfer.BACKEND})
    # vLLM's CPU platform asks for triton-cpu to serve; a model built here
    # runs no kernel
    triton = vllm.triton_utils.HAS_TRITON
    vllm.triton_utils.HAS_TRITON = True
    try:
        config = args.create_engine_config()
    finally:
        vllm.triton_utils.HAS_TRITON = triton
    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        parallel_state.initialize_model_parallel(1, 1)
        try:
            with torch.device("cpu"):
                model = initialize_model(config)
            yield config, model, {"v1": v1, "v2": v2, "v3": v3, "path": path}
        finally:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()


def stacked(tensors, layer):
    """What vLLM's Llama holds of ``tensors``' layer ``layer``."""
    p = f"model.layers.{layer}."
    return {
        p + "self_attn.qkv_proj.weight": torch.cat([tensors[p + f"self_attn.{x}_proj.weight"]
                                                    for x in "qkv"]),
        p + "self_attn.o_proj.weight": tensors[p + "self_attn.o_proj.weight"],
        p + "mlp.gate_up_proj.weight": torch.cat([tensors[p + "mlp.gate_proj.weight"],
                                                  tensors[p + "mlp.up_proj.weight"]]),
        p + "mlp.down_proj.weight": tensors[p + "mlp.down_proj.weight"],
        p + "input_layernorm.weight": tensors[p + "input_layernorm.weight"],
        p + "post_attention_layernorm.weight": tensors[p + "post_attention_layernorm.weight"],
    }


def as_vllm_holds(tensors):
    out = {n: tensors[n] for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")}
    for layer in range(SIZES["num_hidden_layers"]):
        out.update(stacked(tensors, layer))
    return out


def holds(model, tensors):
    got = dict(model.named_parameters())
    want = as_vllm_holds(tensors)
    assert sorted(got) == sorted(want)
    return all(torch.equal(raw_bytes(got[n]), raw_bytes(want[n].contiguous())) for n in want)


def worker_of(config, engine, model):
    """vLLM 0.34's ``gpu_worker.Worker`` as far as its weight-update methods
    reach: the session it keeps, around this engine and model."""
    from vllm.v1.worker.gpu_worker import Worker
    worker = object.__new__(Worker)
    worker.vllm_config = config
    worker.rank = 0
    worker.speculative_config = None
    worker.weight_transfer_engine = engine
    worker._weight_update_active = False
    worker._weight_update_is_draft = False
    worker._incomplete_weight_updates = set()
    worker._kv_cache_reclaimable = False
    worker._weight_update_kv_cache_loan = contextlib.ExitStack()
    worker.model_runner = types.SimpleNamespace(get_model=lambda: model, get_draft_model=lambda: None,
                                                reset_lora_state=lambda: None)
    return worker


def test_the_factory_makes_it_from_a_real_config(llama):
    config, model, _ = llama
    base, factory = registry()
    assert config.weight_transfer_config.backend == _transfer.BACKEND
    engine = factory.create_engine(config.weight_transfer_config, config, torch.device("cpu"), model)
    assert isinstance(engine, base.WeightTransferEngine) and isinstance(engine, _transfer.Engine)
    assert engine.model is model and engine.vllm_config is config
    assert engine.parallel_config is config.parallel_config
    assert engine.model_config is config.model_config
    # vLLM's own hf_to_vllm_mapper: the names it stacks have no parameter
    # of their own, so a Llama's update goes through its load_weights
    name_map = engine._name_map(model)
    assert name_map("model.layers.0.self_attn.o_proj.weight") == "model.layers.0.self_attn.o_proj.weight"
    assert name_map("model.layers.0.self_attn.q_proj.weight") is None
    assert name_map("model.layers.0.mlp.up_proj.weight") is None
    infos = {n: tuple(t.shape) for n, t in llama[2]["v1"].items()}
    _, plan, missing = _transfer.direct_destinations(dict(model.named_parameters()), infos, 0, 1,
                                                     name_map)
    assert sorted(missing) == sorted(n for n in infos if re.search(r"\.(q|k|v|gate|up)_proj\.", n))
    assert "lm_head.weight" in plan and "model.layers.1.mlp.down_proj.weight" in plan
    engine.set_weight_update_target(torch.nn.Linear(1, 1), None)      # (vLLM's draft target)
    engine.reset_weight_update_target()
    assert engine.model is model and engine.model_config is config.model_config


def test_its_info_classes_parse_what_vllm_passes(llama):
    config, model, _ = llama
    base, factory = registry()
    engine = factory.create_engine(config.weight_transfer_config, config, torch.device("cpu"), model)
    # as LLM.init_weight_transfer_engine / update_weights hand them to the worker
    init = base.WeightTransferInitRequest(init_info={"version": "v0"}).init_info
    parsed = engine.parse_init_info(init)
    assert isinstance(parsed, base.WeightTransferInitInfo) and parsed.version == "v0"
    update = base.WeightTransferUpdateRequest(update_info={
        "source": "s3://b/step-1/", "version": "step-1", "return_digests": True,
        "options": {"threads": 2}}).update_info
    parsed = engine.parse_update_info(update)
    assert isinstance(parsed, base.WeightTransferUpdateInfo)
    assert (parsed.source, parsed.version, parsed.return_digests, parsed.options) == \
        ("s3://b/step-1/", "step-1", True, {"threads": 2})
    with pytest.raises(ValueError, match=r"invalid update_info.*'path'"):
        engine.parse_update_info({"path": "x", "version": "v1"})
    with pytest.raises(ValueError, match="invalid init_info"):
        engine.parse_init_info({"versoin": "v0"})


def test_updates_through_vllms_worker_into_vllms_llama(llama):
    config, model, ck = llama
    _, factory = registry()
    path = ck["path"]
    engine = factory.create_engine(config.weight_transfer_config, config, torch.device("cpu"), model)
    worker = worker_of(config, engine, model)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}

    def update(name, version):
        worker.start_weight_update()
        worker.update_weights({"source": str(path / name), "version": version})
        worker.finish_weight_update()

    worker.init_weight_transfer_engine({"version": "v0"})
    update("model.safetensors", "v1")
    assert str(engine.state) == "version v1" and holds(model, ck["v1"])
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    before = {n: raw_bytes(p).clone() for n, p in model.named_parameters()}
    refused = [("delta.safetensors", "v3", "a delta over version 'v2', and the model holds "
                                           "version 'v1'"),
               ("says-v2.safetensors", "v9", "holds version 'v2'"),
               ("wide.safetensors", "v4", "differ from the version held")]
    for name, version, why in refused:
        worker.start_weight_update()
        with pytest.raises(UpdateRefused, match=why):
            worker.update_weights({"source": str(path / name), "version": version})
        assert not worker._weight_update_active              # the worker ended the session
        assert str(engine.state) == "version v1"
        assert all(torch.equal(raw_bytes(p), before[n]) for n, p in model.named_parameters()), name
    update("v2.safetensors", "v2")
    assert str(engine.state) == "version v2" and holds(model, ck["v2"])
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    update("delta.safetensors", "v3")                 # a delta over v2 (up_proj: gate_up)
    assert str(engine.state) == "version v3" and holds(model, ck["v3"])
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    # a session with no update: the worker's finish completes, nothing changes
    worker.start_weight_update()
    worker.finish_weight_update()
    assert not worker._weight_update_active and holds(model, ck["v3"])
