"""The weight-transfer engine ``instant_staging`` (issue 56) through vLLM's
protocol (init, start, update, finish), against fake models, without vLLM:
updates in place and deltas through ``loader.VersionedWeights``, a refused
update in between that leaves the parameters bit-identical, tensor-parallel
ranks writing their rows, and models whose parameters are not the
checkpoint's tensors through their ``load_weights``."""

import pytest

torch = pytest.importorskip("torch")

from instant_staging.integrations.vllm import _transfer
from instant_staging.loader import UpdateRefused, device_digests, save_delta, save_file

from support.tensors import raw_bytes


def checkpoint(seed, rows=8):
    g = torch.Generator().manual_seed(seed)
    return {"model.embed.weight": torch.randn(16, 4, generator=g),
            "model.layers.0.proj.weight": torch.randn(rows, 4, generator=g),
            "model.layers.0.norm.weight": torch.randn(4, generator=g).bfloat16()}


class Model(torch.nn.Module):
    """Parameters named as the checkpoint's tensors; ``rank`` of ``size``
    holds its rows of the projection (a column-parallel layer)."""

    def __init__(self, rank=0, size=1):
        super().__init__()
        self.rank, self.size = rank, size
        base = checkpoint(0)
        for name, t in base.items():
            if "proj" in name:
                per = t.shape[0] // size
                t = t[rank * per:(rank + 1) * per]
            self.register_parameter(name.replace(".", "_"), torch.nn.Parameter(t.clone(),
                                                                               requires_grad=False))

    def named_parameters(self, *args, **kwargs):
        for name, p in super().named_parameters(*args, **kwargs):
            yield name.replace("_", "."), p


def engine(model, version="v0", **init):
    e = _transfer.Engine(None, None, "cpu", model)
    e.init_transfer_engine(e.parse_init_info({"version": version, **init}))
    return e


def update(e, **info):
    e.start_weight_update()
    e.update_weights(info)
    e.finish_weight_update()


@pytest.fixture
def steps(tmp_path):
    v1 = checkpoint(1)
    v2 = {n: t.clone() for n, t in v1.items()}
    v2["model.layers.0.proj.weight"][1, 2] += 1
    v3 = checkpoint(3)
    save_file(v1, tmp_path / "v1.safetensors", version="v1")
    save_delta(v2, v1, tmp_path / "v2.safetensors", base_version="v1", version="v2")
    save_delta(v2, v1, tmp_path / "bad.safetensors", base_version="v9", version="v2")
    save_file(v3, tmp_path / "v3.safetensors", version="v3")
    return tmp_path, {"v1": v1, "v2": v2, "v3": v3}


def params_hold(model, tensors, rank=0, size=1):
    got = dict(model.named_parameters())
    for name, t in tensors.items():
        if "proj" in name:
            per = t.shape[0] // size
            t = t[rank * per:(rank + 1) * per]
        if not torch.equal(raw_bytes(got[name]), raw_bytes(t.contiguous())):
            return False
    return True


@pytest.mark.parametrize("size", [1, 2])
def test_full_delta_refused_full_through_the_protocol(steps, size):
    path, v = steps
    models = [Model(rank, size) for rank in range(size)]
    engines = [engine(m, tp_rank=rank, tp_size=size) for rank, m in enumerate(models)]
    ptrs = [{n: p.data_ptr() for n, p in m.named_parameters()} for m in models]
    for e in engines:
        update(e, source=str(path / "v1.safetensors"), version="v1", return_digests=True)
        assert str(e.state) == "version v1"
        assert e.last_report.digests == device_digests(dict(e.model.named_parameters()))
    for e in engines:
        update(e, source=str(path / "v2.safetensors"), version="v2")
        assert e.state.version == "v2"
    for rank, (m, e) in enumerate(zip(models, engines)):
        assert params_hold(m, v["v2"], rank, size)
        before = {n: raw_bytes(p).clone() for n, p in m.named_parameters()}
        e.start_weight_update()
        with pytest.raises(UpdateRefused, match="applies to version 'v9'"):
            e.update_weights({"source": str(path / "bad.safetensors"), "version": "v2"})
        assert e.state.version == "v2"
        assert all(torch.equal(raw_bytes(p), before[n]) for n, p in m.named_parameters())
    for rank, (m, e) in enumerate(zip(models, engines)):
        update(e, source=str(path / "v3.safetensors"), version="v3")
        assert e.state.version == "v3" and params_hold(m, v["v3"], rank, size)
        assert {n: p.data_ptr() for n, p in m.named_parameters()} == ptrs[rank]


def test_the_protocol_is_kept(caplog):
    # vLLM 0.34's worker keeps the session: it keeps one open whose
    # finish_weight_update raised (and refuses to start another), so start
    # and finish never raise over the session's state; they say it.
    e = engine(Model())
    with caplog.at_level("WARNING", logger="vllm.instant_staging"):
        e.finish_weight_update()
        e.start_weight_update()
        e.start_weight_update()
        e.finish_weight_update()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3 and "no update under way" in said[0] and "not finished" in said[1]
    assert "no update was received" in said[2] and "version v0" in said[2]
    assert e.state.version == "v0"
    with pytest.raises(ValueError, match="invalid update_info"):
        e.parse_update_info({"path": "x"})
    with pytest.raises(ValueError, match="a list is vLLM's"):
        e.parse_update_info([{"source": "x", "version": "v1"}])
    with pytest.raises(ValueError, match="invalid init_info"):
        e.parse_init_info({"versoin": "v1"})
    with pytest.raises(ValueError, match="version"):
        e.parse_update_info({"source": "x", "version": ""})
    with pytest.raises(NotImplementedError, match="save_delta"):
        _transfer.Engine.trainer_send_weights(iter(()), {})


class Stacked(torch.nn.Module):
    """A model that keeps no checkpoint tensor as it is (as vLLM stacks
    q/k/v): its ``load_weights`` takes the pairs and builds its own."""

    def __init__(self):
        super().__init__()
        self.both = torch.nn.Parameter(torch.zeros(32, 4), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16), requires_grad=False)
        self.seen = []

    def load_weights(self, weights):
        got = {}
        for name, t in weights:
            self.seen.append(name)
            got[name] = t
        self.both.data[:16].copy_(got["model.embed.weight"])
        self.both.data[16:24].copy_(got["model.layers.0.proj.weight"])
        self.norm.data.copy_(got["model.layers.0.norm.weight"])


def stacked_holds(m, tensors):
    return (torch.equal(m.both[:16], tensors["model.embed.weight"])
            and torch.equal(m.both[16:24], tensors["model.layers.0.proj.weight"])
            and torch.equal(raw_bytes(m.norm), raw_bytes(tensors["model.layers.0.norm.weight"])))


def test_a_model_of_other_parameters_updates_through_its_load_weights(steps):
    path, v = steps
    m = Stacked()
    e = engine(m)
    # a delta before any checkpoint was installed here: nothing to apply it to
    e.start_weight_update()
    with pytest.raises(UpdateRefused, match="not installed from a checkpoint by this engine"):
        e.update_weights({"source": str(path / "v2.safetensors"), "version": "v2"})
    update(e, source=str(path / "v1.safetensors"), version="v1")
    assert e.state.version == "v1" and stacked_holds(m, v["v1"])
    assert m.seen == ["model.embed.weight", "model.layers.0.norm.weight",
                      "model.layers.0.proj.weight"]        # no layer first, then layer by layer
    e.start_weight_update()
    with pytest.raises(UpdateRefused, match="holds version 'v3'"):
        e.update_weights({"source": str(path / "v3.safetensors"), "version": "v4"})
    with pytest.raises(UpdateRefused, match="a delta over version 'v9', and the model holds "
                                            "version 'v1'"):
        e.update_weights({"source": str(path / "bad.safetensors"), "version": "v2"})
    assert e.state.version == "v1" and stacked_holds(m, v["v1"])
    # a delta: the tensors it names read again from v1's file, patched, and
    # every tensor handed to load_weights (the patched ones first)
    m.seen.clear()
    update(e, source=str(path / "v2.safetensors"), version="v2")
    assert e.state.version == "v2" and stacked_holds(m, v["v2"])
    assert m.seen == ["model.layers.0.proj.weight", "model.embed.weight",
                      "model.layers.0.norm.weight"]
    # a delta over that one: the chain v1, v2's delta, then this
    v4 = {n: t.clone() for n, t in v["v2"].items()}
    v4["model.embed.weight"][3, 1] = 7
    v4["model.layers.0.norm.weight"][0] = 2
    save_delta(v4, v["v2"], path / "v4.safetensors", base_version="v2", version="v4")
    update(e, source=str(path / "v4.safetensors"), version="v4")
    assert e.state.version == "v4" and stacked_holds(m, v4)
    # the checkpoint the chain starts from replaced: refused, nothing written
    save_file(v["v3"], path / "v1.safetensors", version="v3")
    v5 = {n: t.clone() for n, t in v4.items()}
    v5["model.embed.weight"][0, 0] = 5
    save_delta(v5, v4, path / "v5.safetensors", base_version="v4", version="v5")
    e.start_weight_update()
    with pytest.raises(UpdateRefused, match=r"could not be read again.*holds version 'v3'"):
        e.update_weights({"source": str(path / "v5.safetensors"), "version": "v5"})
    assert e.state.version == "v4" and stacked_holds(m, v4)
    # a full checkpoint starts the chain anew
    update(e, source=str(path / "v3.safetensors"), version="v3")
    assert e.state.version == "v3" and stacked_holds(m, v["v3"])


def test_a_failure_inside_load_weights_says_mixed(steps):
    path, _ = steps
    m = Stacked()
    e = engine(m)

    def broken(weights):
        next(iter(weights))
        raise RuntimeError("the worker ran out of memory")
    e.start_weight_update()
    with pytest.raises(RuntimeError, match="out of memory"):
        e.receive_weights(e.parse_update_info({"source": str(path / "v1.safetensors"),
                                               "version": "v1"}), load_weights=broken)
    assert e.state.mixed and e.state.version is None and e.state.target == "v1"


def test_direct_destinations_is_pure():
    params = {"a": torch.zeros(4, 3), "b": torch.zeros(2, 3), "c": torch.zeros(3, 2)}
    infos = {"a": (4, 3), "b": (4, 3), "c": (3, 4), "d": (1,)}
    mapper, plan, missing = _transfer.direct_destinations(params, infos, 1, 2)
    assert plan == {"a": None, "b": slice(2, 4)} and missing == ["c", "d"]
    assert mapper("a") == "a" and mapper("c") is None


def test_tensors_stacked_into_one_parameter_are_not_direct():
    # tensor-parallel 2: a rank's gate_up holds its rows of gate and of up,
    # as many as gate's whole: by shape alone gate would be written there
    params = {"mlp.gate_up.weight": torch.zeros(8, 3), "norm.weight": torch.zeros(3)}
    infos = {"mlp.gate.weight": (8, 3), "mlp.up.weight": (8, 3), "norm.weight": (3,)}
    stack = {"mlp.gate.weight": "mlp.gate_up.weight", "mlp.up.weight": "mlp.gate_up.weight"}
    _, plan, missing = _transfer.direct_destinations(params, infos, 0, 2,
                                                     lambda n: stack.get(n, n))
    assert plan == {"norm.weight": None} and missing == ["mlp.gate.weight", "mlp.up.weight"]


def test_the_mappers_stacked_names_are_not_direct():
    # vLLM 0.34's WeightsMapper: a stacked name comes with its shard id
    class Mapper:
        weights_transforms: list = []

        def _map_name_with_shard(self, name):
            if name.startswith("drop."):
                return None
            if ".q_proj" in name:
                return name.replace(".q_proj", ".qkv_proj"), "q"
            return "model." + name, None

    class M(torch.nn.Module):
        hf_to_vllm_mapper = Mapper()
    name_map = _transfer.Engine(None, None, "cpu", M())._name_map(M())
    assert name_map("a.weight") == "model.a.weight"
    assert name_map("l.q_proj.weight") is None and name_map("drop.x") is None
    Mapper.weights_transforms = [lambda weights: weights]    # the stream rewritten: load_weights
    assert _transfer.Engine(None, None, "cpu", M())._name_map(M())("a.weight") is None


def test_registered_where_vllm_has_the_registry(monkeypatch):
    import abc
    import sys
    import types

    class Base(abc.ABC):
        @abc.abstractmethod
        def receive_weights(self, update_info): ...

    class Factory:
        _registry: dict = {}

        @classmethod
        def register_engine(cls, name, engine_cls):
            if name in cls._registry:
                raise ValueError(f"{name} is already registered")
            cls._registry[name] = lambda: engine_cls

    base = types.ModuleType("vllm.distributed.weight_transfer.base")
    base.WeightTransferEngine = Base
    factory = types.ModuleType("vllm.distributed.weight_transfer.factory")
    factory.WeightTransferEngineFactory = Factory
    for name in ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, base.__name__, base)
    monkeypatch.setitem(sys.modules, factory.__name__, factory)
    assert _transfer.register_engine() and _transfer.register_engine()     # idempotent
    cls = Factory._registry[_transfer.BACKEND]()
    assert issubclass(cls, Base) and issubclass(cls, _transfer.Engine)
    assert isinstance(cls(None, None, "cpu", Model()), Base)       # every abstract method defined


def test_no_registry_without_it(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "vllm.distributed.weight_transfer.factory", None)
    assert _transfer.register_engine() is False
