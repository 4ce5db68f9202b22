"""The read in the background (steps 3 and 4 of the package's docstring):
one ``Checkpoint``'s loads consumed by a thread of their own
(``BackgroundLoad``) into a state dict of ``Arriving`` tensors, while
transformers builds the model on meta and takes each as it arrives."""

from __future__ import annotations

import contextlib
import threading
import traceback
import weakref

from ...loader import TORCH_DTYPES, Checkpoint, import_torch
from .._whole import whole
from . import _inplace
from ._placement import Spread, offloading_a_state_dict, reading_where_mapped


def assemble_while_reading(transformers, cls, weights, device, kwargs, in_place=False):
    """transformers' from_pretrained on a state dict whose tensors are still
    being read (``Arriving``): it builds the model on meta while the load
    runs, and takes each tensor as it arrives.  A failed read raises its
    LoadError (transformers would log it as a conversion error and go on).
    Over several devices (``Spread``) the load starts once transformers has
    resolved the map (``reading_where_mapped``), one load per device.

    ``in_place`` (one device, transformers 5): the load waits for the model
    instead, and is written into its parameters where ``_inplace.plan``
    proves that the same (``_inplace.py``); else transformers takes the
    state dict, the load started then.  Returns ``(model, info, route)``,
    route "in place" or "state dict"."""
    torch = import_torch()
    spread = isinstance(device, Spread)
    in_place = in_place and not spread
    load = BackgroundLoad(weights.source, None if spread else device, weights.storage_options,
                          weights.cache_dir, deferred=in_place)
    model = info = None
    route = "state dict"
    try:
        if in_place and not _inplace.may_apply(torch, kwargs.get("dtype"), load.layout):
            in_place = False
            load.begin()
        state = {name: Arriving(load, name, shape, dtype) for name, (shape, dtype) in load.layout.items()}

        def handle(original, model, state_dict, load_config, disk_offload_index):
            nonlocal route
            from transformers import core_model_loading as core
            planned = _inplace.plan(torch, core, model, load.layout, load_config)
            if planned is None:
                load.begin()
                return original(model, state_dict, load_config, disk_offload_index)
            route = "in place"
            return _inplace.write(torch, core, original, model, load, load_config, disk_offload_index,
                                  planned)
        placing = (reading_where_mapped(transformers, load, kwargs.get("offload_folder")) if spread
                   else contextlib.nullcontext())
        # In place, the read starts after transformers' allocator warm-up: the
        # warm-up's block is what the model's parameters (or the read tensors)
        # are made of, not a second model-sized block beside them.
        warmup = contextlib.nullcontext() if in_place else no_allocator_warmup(transformers)
        writing = (_inplace.writing_in_place(transformers, state, handle) if in_place
                   else contextlib.nullcontext())
        with warmup, placing, writing, offloading_a_state_dict(transformers, cls, spread):
            model, info = cls.from_pretrained(None, state_dict=state, **kwargs)
        state.clear()
        load.finish()
    except BaseException as e:
        failed = load.error            # the read's own failure, not the cancel that close() causes
        load.close()
        model = info = state = handle = None
        # The traceback's frames would keep the tensors read so far alive.
        traceback.clear_frames(e.__traceback__)
        if failed is not None and e is not failed and not isinstance(e, KeyboardInterrupt):
            raise failed from None
        raise
    return model, info, route


class BackgroundLoad:
    """One ``Checkpoint``'s loads, ``iter_load(device, names=...)`` for each
    group of ``start``'s in turn, consumed by a thread of its own into
    ``{name: tensor}``; ``wait(name)`` blocks until that tensor is there.
    The headers are read (and checked) in the caller's thread, at once, and
    once: the layout and the loads come from one ``Checkpoint``.  Given a
    device, the one load starts at once; else at ``start`` (a device_map
    transformers resolves first).

    A load of small tensors (``integrations/_whole.py``'s rule, the vLLM
    path's) is handed over whole, once every tensor of it is read; one of
    larger tensors, as each finishes.  transformers' main thread and its
    loading threads call into the device for each tensor they take
    (converting, fusing experts, assigning): made while the reader threads
    copy, those calls would slow both, and a fine-grained MoE checkpoint
    has thousands of them."""

    def __init__(self, source, device=None, storage_options=None, cache_dir=None, deferred=False):
        self.error = None
        self._tensors = {}
        # Handed out once (wait() drops ours): where transformers converts a
        # tensor (dtype=) it keeps only its copy, and ours would otherwise
        # stay on the device beside the model until the call ends (2x an fp16
        # checkpoint loaded as bf16).  A second ask gets it while it lives.
        self._handed = {}
        self._done = False
        self._cancelled = False
        self._cond = threading.Condition()
        self._it = self._thread = None
        self._whole = False
        self._rest = []
        # (where each tensor goes is the map's, known at start())
        self.placed = device is None
        self._deferred = device if deferred else None
        self._checkpoint = Checkpoint.open(source, storage_options=storage_options,
                                           cache_dir=cache_dir)
        try:
            self.layout = layout_of(self._checkpoint)
            if device is not None and not deferred:
                self.start([(device, None)])
        except BaseException:
            self._checkpoint.close()
            raise

    @property
    def started(self):
        return self._thread is not None

    def start(self, groups):
        """Loads each ``(device, names)`` of ``groups`` in turn (names None:
        all), the first one made here (its errors are the caller's)."""
        if self._thread is not None:
            raise RuntimeError("the load has started already")
        self._rest = list(groups)
        self._next_load()
        self._thread = threading.Thread(target=self._run, name="instant_staging-from_pretrained",
                                        daemon=True)
        self._thread.start()

    def begin(self):
        """Starts a deferred load (nothing where it has started)."""
        with self._cond:
            self._begin()

    def _begin(self):
        if self._thread is None and self._deferred is not None:
            try:
                self.start([(self._deferred, None)])
            except BaseException as e:
                self.error, self._done = e, True
                raise

    def load_into(self, tensors):
        """A deferred load written into ``tensors`` ({name: tensor}, every
        checkpoint tensor's) in this thread (``Checkpoint.load_into``),
        instead of read into tensors of its own; the handle closed after."""
        if self._thread is not None or self._deferred is None:
            raise RuntimeError("load_into is for a deferred load that has not started")
        try:
            return self._checkpoint.load_into(tensors)
        finally:
            self._deferred = None
            self._checkpoint.close()

    def _run(self):
        try:
            while True:
                if self._whole:
                    loaded = dict(self._it)
                    with self._cond:
                        self._tensors.update(loaded)
                        self._cond.notify_all()
                    loaded = None            # wait() hands each out as the only reference
                else:
                    for name, tensor in self._it:
                        with self._cond:
                            self._tensors[name] = tensor
                            self._cond.notify_all()
                        tensor = None
                with self._cond:
                    if self._cancelled or not self._rest:
                        break
                    self._next_load()
        except BaseException as e:
            with self._cond:
                self.error = e
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def _next_load(self):
        """Starts the load of the next group; the handle is closed with the
        last one (closing it leaves the files to the load, which holds them)."""
        device, names = self._rest.pop(0)
        try:
            self._whole = loads_whole(self._checkpoint, names)
            self._it = self._checkpoint.iter_load(device, names=names)
        finally:
            if not self._rest:
                self._checkpoint.close()

    def wait(self, name):
        with self._cond:
            while name not in self._tensors:
                handed = self._handed.get(name)
                tensor = handed() if handed is not None else None
                if tensor is not None:
                    return tensor
                if handed is not None:
                    raise RuntimeError(f"{name} was asked for again after transformers dropped it")
                if self.error is not None:
                    raise self.error
                if self._done:
                    raise KeyError(f"{name} was not loaded")
                self._begin()
                if self._thread is None:
                    raise RuntimeError(f"transformers asked for {name} before it resolved its device_map "
                                       "(modeling_utils._get_device_map), so this loader knows no device "
                                       "for it: pass one device")
                self._cond.wait()
            tensor = self._tensors.pop(name)
            self._handed[name] = weakref.ref(tensor)
            return tensor

    def finish(self):
        """Waits for the loads; raises their error; drops our references."""
        self._join_and_drop()
        if self.error is not None:
            raise self.error

    def close(self):
        """Cancels the load (from this thread: LoadIterator.close may come
        from any thread), joins the consumer, drops every tensor."""
        with self._cond:
            self._cancelled = True
            it = self._it
        if it is not None:
            it.close()
        self._join_and_drop()

    def _join_and_drop(self):
        if self._thread is not None:
            self._thread.join()
        self._checkpoint.close()
        with self._cond:
            self._tensors.clear()
            self._handed.clear()


class Arriving:
    """A checkpoint tensor still being read, standing where transformers'
    own loading puts a safetensors slice (``safe_open(...).get_slice(k)``):
    ``t[...]`` is the tensor (it waits for it), a narrower index a tensor of
    its own as a slice's (a tensor-parallel rank's part does not keep the
    whole alive); ``t.to(device)``, what transformers 4 asks of a state
    dict's value, the tensor moved there (the tensor itself when it is
    there).  Shape, dtype, and what else a meta tensor tells, come from the
    header."""

    __slots__ = ("_load", "dtype", "name", "shape")

    def __init__(self, load, name, shape, dtype):
        self._load, self.name, self.shape, self.dtype = load, name, shape, dtype

    def get_shape(self):
        return list(self.shape)

    def is_floating_point(self):
        return self.dtype.is_floating_point

    # What transformers 4's tensor parallelism asks of the meta tensor it
    # takes a state dict's value for (the layout, from the header).
    def dim(self):
        return len(self.shape)

    def size(self, dim=None):
        return self.shape if dim is None else self.shape[dim]

    def stride(self, dim=None):
        strides, step = [], 1
        for n in reversed(self.shape):
            strides.append(step)
            step *= n
        strides = tuple(reversed(strides))
        return strides if dim is None else strides[dim]

    def __getitem__(self, index):
        tensor = self._load.wait(self.name)
        part = tensor[index]
        return part if part.numel() == tensor.numel() else part.clone()

    def to(self, *args, **kwargs):
        tensor = self._load.wait(self.name)
        # Under a map transformers resolved (``BackgroundLoad.placed``),
        # transformers 4 asks a device-only .to() of every value: the map's
        # "" entry, else the CPU ("disk" where the map is {"": "disk"}),
        # where its own loading has safe_open read, before it moves the
        # tensor to its module's device.  Ours was read there already (a
        # "disk" one to the CPU): as read, not a round trip through the CPU.
        if self._load.placed and len(args) + len(kwargs) == 1 and (
                (args and is_device(args[0])) or is_device(kwargs.get("device"))):
            return tensor
        return tensor.to(*args, **kwargs)


def is_device(value):
    torch = import_torch()
    return (isinstance(value, (str, torch.device)) or
            (isinstance(value, int) and not isinstance(value, bool)))


def loads_whole(checkpoint, names=None):
    """Whether the load of ``names`` (None: every tensor) of an open
    ``checkpoint`` is handed over whole (``integrations/_whole.py``'s rule),
    from the headers alone."""
    infos = [checkpoint.info(name) for name in (checkpoint.names() if names is None else names)]
    return whole(sum(t.nbytes for t in infos), len(infos))


def layout_of(checkpoint):
    """{name: (torch.Size, torch dtype)} of every shard, from the headers:
    shard by shard, each one's names sorted (as safetensors lists them)."""
    torch = import_torch()
    infos = [checkpoint.info(name) for name in checkpoint.names()]
    order = {path: i for i, path in enumerate(checkpoint.files)}
    infos.sort(key=lambda t: (order[t.file], t.name))
    return {t.name: (torch.Size(t.shape), getattr(torch, TORCH_DTYPES[t.dtype])) for t in infos}


@contextlib.contextmanager
def no_progress_bar(transformers):
    """transformers' own progress bars off for one call: handed a state dict,
    transformers 5 draws an empty "Loading weights: 0it" bar beside the
    load's, counting nothing it reads.  Its module flag (``utils.logging.
    _tqdm_active``, what ``disable_progress_bar`` sets) rather than that
    function, which would also switch huggingface_hub's bars off and, set
    back on, clear their per-group settings.  As the warm-up's switch:
    another thread's transformers call meanwhile draws no bar either."""
    utils_logging = getattr(getattr(transformers, "utils", None), "logging", None)
    if getattr(utils_logging, "_tqdm_active", None) is not True:
        yield                      # off already, or a transformers without the flag
        return
    utils_logging._tqdm_active = False
    try:
        yield
    finally:
        utils_logging._tqdm_active = True


@contextlib.contextmanager
def no_allocator_warmup(transformers):
    """transformers' caching_allocator_warmup off for one call (see the module
    docstring, step 4).  A module attribute: another thread's from_pretrained
    meanwhile would skip its warm-up too (slower, never wrong)."""
    modeling = getattr(transformers, "modeling_utils", None)
    original = getattr(modeling, "caching_allocator_warmup", None)
    if original is None:
        yield
        return
    modeling.caching_allocator_warmup = lambda *args, **kwargs: None
    try:
        yield
    finally:
        modeling.caching_allocator_warmup = original
