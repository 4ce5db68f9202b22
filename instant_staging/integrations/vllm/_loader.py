"""The vLLM model loader of load format ``instant_staging`` (imports vLLM).

A ``DefaultModelLoader`` whose weights iterator is ``_weights.iter_weights``;
everything else is vLLM's own: the files (``_prepare_weights`` of a
DefaultModelLoader for load format ``safetensors``: local directories, hub
ids through huggingface_hub's cache and ``--download-dir``, the index's
shards, ``--ignore-patterns``), its shard filters (``--mm-encoder-only``,
the model's ``is_unused_checkpoint_weight``), the expert-parallel filter
(``local_expert_ids``: non-local experts are not read), ``secondary_weights``,
``model.load_weights(...)`` with vLLM's per-model mapping, and its check
that every parameter was loaded.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
import weakref

import torch
from vllm.model_executor.model_loader import weight_utils
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.weight_utils import (
    filter_mm_encoder_only_safetensors_files,
    filter_safetensors_files_by_weight_name,
)

from ..._types import format_rate, format_size
from ...loader import Checkpoint, is_url
from ...loader import resolve_progress as _progress
from . import LOAD_FORMAT
from ._options import parse, shared_default
from ._settings import prefetch, settings
from ._weights import Stats, iter_weights, natural_key

# A child of vLLM's logger: its handler and format (vLLM configures "vllm").
logger = logging.getLogger("vllm.instant_staging")

# vLLM's names of Engram tables (weight_utils._ENGRAM_WEIGHT_RE of vLLM 0.33
# and 0.34), for a vLLM that does not define them.
ENGRAM_TABLES = re.compile(r"(?:^|\.)(?:engram\.embed\.(?:weight|scale)|"
                           r"ple\.ple_embedding\.ngram_embedding\.shard_[0-9]+\.weight)$")


def _should_skip_weight():
    try:
        from vllm.model_executor.model_loader.ep_weight_filter import should_skip_weight
    except ImportError:            # a vLLM without expert-parallel weight filtering
        return None
    return should_skip_weight


class InstantStagingModelLoader(DefaultModelLoader):
    """``--load-format instant_staging``: vLLM's default loader reading the
    safetensors weights through instant_staging's staging buffer onto the
    worker's device."""

    def __init__(self, load_config):
        self.options = parse(load_config.model_loader_extra_config)
        passed = {} if self.options.enable_weights_track is None else {
            "enable_weights_track": self.options.enable_weights_track}
        # DefaultModelLoader's own setup, told only the keys it knows.
        super().__init__(dataclasses.replace(load_config, model_loader_extra_config=passed))
        self.load_config = load_config
        # vLLM's file resolution for safetensors weights: a loader of that format.
        self._files = DefaultModelLoader(dataclasses.replace(
            load_config, load_format="safetensors", model_loader_extra_config={}))
        self.stats = Stats()

    def _prepare_weights(self, model_name_or_path, subfolder, revision, fall_back_to_pt,
                         allow_patterns_overrides):
        return self._files._prepare_weights(model_name_or_path, subfolder, revision,
                                            fall_back_to_pt, allow_patterns_overrides)

    def _get_weights_iterator(self, source):
        strategy = getattr(self.load_config, "safetensors_load_strategy", None)
        if strategy == "torchao":
            raise ValueError("load format instant_staging does not read torchao-serialized checkpoints "
                             "(their tensor subclasses): use --load-format safetensors")
        url = self._weights_url(source)
        if url is not None:
            # Object storage: vLLM pulled the config files (a --model URL,
            # ModelConfig.model_weights), or the extra config names the
            # weights; the objects are the URL source's, as load_file reads it.
            with Checkpoint.open(url) as checkpoint:
                folder, files, use_safetensors, index_file = url, checkpoint.files, True, None
        else:
            folder, files, use_safetensors, index_file = self._prepare_weights(
                source.model_or_path, source.subfolder, source.revision, source.fall_back_to_pt,
                source.allow_patterns_overrides)
        if not use_safetensors:
            raise ValueError(f"load format instant_staging reads safetensors checkpoints; "
                             f"{source.model_or_path} has none")
        prefixes = getattr(self, "_encoder_only_lm_prefixes", None)
        if prefixes is not None and files:
            files = filter_mm_encoder_only_safetensors_files(
                files, folder, index_file, prefixes,
                weights_mapper=getattr(self, "_encoder_only_weights_mapper", None))
            if not files:
                raise RuntimeError(f"--mm-encoder-only removed every weight file of {source.model_or_path}")
        unused = getattr(source, "is_unused_weight", None)
        if unused is not None:
            files = filter_safetensors_files_by_weight_name(files, unused)
        if self.counter_before_loading_weights == 0.0:
            self.counter_before_loading_weights = time.perf_counter()
        weights = self._iterate(files, local=url is None)
        return ((source.prefix + name, tensor) for name, tensor in weights)

    def _weights_url(self, source):
        """The URL the weights of ``source`` come from, or None for files:
        ``source`` itself where it is a URL (``reload_weights`` given one
        as its ``weights_path``); for the model the engine started with, the
        extra config's ``weights``, else the model config's ``model_weights``
        where vLLM pulled a URL model's config files."""
        if getattr(source, "subfolder", None):
            return None             # a sub-model's own files (vLLM resolves them locally)
        if is_url(source.model_or_path):
            return source.model_or_path
        from vllm.config import get_current_vllm_config_or_none
        config = get_current_vllm_config_or_none()
        model_config = getattr(config, "model_config", None)
        if self.options.weights is not None:
            # The engine's own weights: not those of another checkpoint that
            # reload_weights(weights_path=) pointed the model config at.
            if model_config is None or source.model_or_path == _started_with(config, model_config):
                return self.options.weights
            return None
        weights = getattr(model_config, "model_weights", None) or None
        if weights and is_url(weights) and source.model_or_path == model_config.model:
            return weights
        return None

    def _iterate(self, files, local=True):
        device = self._device()
        group, rank, world, one_node = _world()
        keep = None
        skip, experts = _should_skip_weight(), getattr(self, "local_expert_ids", None)
        if skip is not None and experts is not None:
            def keep(name):
                return not skip(name, experts)
        shared = group is not None and shared_default(self.options.shared_read, one_node)
        show = self.options.progress
        if show is None:
            show = self.load_config.use_tqdm_on_load
        progress = _progress(True) if show and rank == 0 else None
        shuffle = None
        if local:                       # vLLM's settings for files (object storage has no page cache)
            chosen = settings(self.load_config, list(files), rank=rank, shared_read=shared)
            if chosen.prefetch:
                prefetch(sorted(files, key=natural_key), rank=rank, world=world,
                         threads=chosen.prefetch_threads, block_size=chosen.prefetch_block_size)
            shuffle = chosen.shuffle_seed
        stats = Stats()
        yield from iter_weights(files, device, self.options, keep=keep, on_cpu=_engram_on_cpu(),
                                process_group=group if shared else None, progress=progress, stats=stats,
                                shuffle_seed=shuffle)
        self.stats = stats
        logger.info("instant_staging read %s (%d tensors) in %.2f s (%s) onto %s, staging %s, "
                    "rank %d of %d%s%s", format_size(stats.bytes), stats.tensors, stats.seconds,
                    format_rate(stats.bytes / max(stats.seconds, 1e-9)),
                    device, "/".join(stats.kinds) or "none", rank, world, ", shared read" if shared else "",
                    f", {stats.on_cpu} Engram table(s) on the CPU" if stats.on_cpu else "")

    def _device(self):
        """Where vLLM's load_model puts the model: LoadConfig.device, else the
        device config's (the worker's own GPU once vLLM set it current)."""
        if self.load_config.device is not None:
            return torch.device(self.load_config.device)
        from vllm.config import get_current_vllm_config_or_none
        config = get_current_vllm_config_or_none()
        if config is None:
            return torch.device("cpu")
        return torch.device(config.device_config.device)


# The model each engine started with, by its config ({id(VllmConfig):
# model}, an entry as long as its config lives): vLLM's
# reload_weights(weights_path=) changes model_config.model in place, and a
# new loader is made for each load, so the first model is kept here.
_STARTED_WITH = {}


def _started_with(config, model_config):
    """The model ``config``'s engine loaded first (``model_config.model`` at
    its first load through this format)."""
    key = id(config)
    if key not in _STARTED_WITH:
        _STARTED_WITH[key] = model_config.model
        weakref.finalize(config, _STARTED_WITH.pop, key, None)
    return _STARTED_WITH[key]


def _engram_on_cpu():
    """Which names vLLM keeps on the CPU, as its own iterators do: with
    ``engram_config.cpu_offload``, the Engram tables (vLLM's own pattern of
    their names, ``_ENGRAM_WEIGHT_RE``, else ``ENGRAM_TABLES``, a copy of
    it); else None."""
    from vllm.config import get_current_vllm_config_or_none
    config = get_current_vllm_config_or_none()
    engram = getattr(config, "engram_config", None)
    if engram is None or not getattr(engram, "cpu_offload", False):
        return None
    pattern = getattr(weight_utils, "_ENGRAM_WEIGHT_RE", None) or ENGRAM_TABLES

    def on_cpu(name):
        return pattern.search(name) is not None
    return on_cpu


def _world():
    """(the group for a shared read or None, this rank, the world size,
    whether every rank of it runs on this node)."""
    try:
        from vllm.distributed.parallel_state import get_world_group
        world = get_world_group()
    except (AssertionError, ImportError):      # no distributed state (a bare loader, tests)
        return None, 0, 1, True
    if world.world_size == 1:
        return None, world.rank_in_group, 1, True
    from vllm.distributed.parallel_state import in_the_same_node_as
    # Collective, over the gloo group (vLLM's helper refuses NCCL): every
    # rank gets the same answer, so every rank makes the same choice.
    one_node = all(in_the_same_node_as(world.cpu_group, source_rank=0))
    return world.device_group, world.rank_in_group, world.world_size, one_node


__all__ = ["LOAD_FORMAT", "InstantStagingModelLoader"]
