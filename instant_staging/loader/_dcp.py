"""``SafetensorsStorageWriter``: ``torch.distributed.checkpoint``'s Hugging
Face writer, its files written through the save's path.

A subclass of DCP's ``HuggingFaceStorageWriter`` (torch's
``distributed/checkpoint/hf_storage.py``): its planning is kept (which
tensor goes to which file: ``fqn_to_index_mapping``; with
``save_distributed=True`` every rank its own files, named with its shard
index), its file names, its ``__metadata__`` (``DCP_SHARDING_INFO``: each
tensor's ``saved_offsets`` in the whole tensor, as ``json.dumps`` writes
them, ``DCP_VERSION``, ``format``) and its index
``model.safetensors.index.json`` (written once, by the coordinator).  What
changes is how a file is written (``write_data``): each file is
``_save.make_plan`` + ``_save.publish``, as ``save_file`` writes one, so

- the file is safetensors' own bytes for those tensors (DCP's writer calls
  ``safetensors.torch.save``: the same header and data; only the order of
  the three metadata keys differs, which safetensors' hash map changes
  from one process to the next);
- it is published atomically (a temporary name, synced, renamed), where
  DCP's writer truncates the file in place and writes it whole from host
  memory;
- device tensors go through the pinned staging buffer in chunks with
  writer threads, never a host copy of the rank's state dict (DCP's
  writer copies every tensor to the host, then serialises the file in
  memory once more).

The index is written atomically too, after every file.  With
``enable_consolidation`` (``save_distributed`` on), the coordinator
assembles each output file (``model-0000i-of-0000N.safetensors``) from the
ranks' files that this save wrote (DCP's reads every ``*.safetensors`` in
the directory, an earlier save's included), one output file in host memory
at a time, and publishes it with ``{"format": "pt"}`` in safetensors'
layout (DCP's consolidation writes its own unpadded header in the
mapping's order).

Refused before anything is written, on every rank (the checks run in the
planning DCP gathers): a value that is not a tensor (DCP's writer writes
its pickled bytes at the start of the file, before the safetensors bytes:
a file nobody can read); ranks that would write the same file (two ranks'
tensors without ``save_distributed``: DCP's writers overwrite each
other).  Tensors a state dict ties (two names, one storage) are written
each with its bytes, as DCP's writer does for device tensors; a
non-contiguous one is made contiguous on its device first.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from ._load import iter_load
from ._safe_open import safe_open
from ._save import make_plan, publish
from ._save_model import _publish_bytes

try:
    import torch
    from torch.distributed.checkpoint._hf_utils import (
        CUSTOM_METADATA_KEY,
        DCP_VERSION_KEY,
        FORMAT_KEY,
        FORMAT_VALUE,
        HF_DCP_VERSION,
        SAVED_OFFSETS_KEY,
        _gen_file_name,
        _metadata_fn,
    )
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future
except ImportError as e:     # torch without DCP's Hugging Face writer (before 2.8)
    raise ImportError("SafetensorsStorageWriter needs torch.distributed.checkpoint's "
                      f"HuggingFaceStorageWriter (torch 2.8 or later): {e}") from None

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

    from .._staging import StagingBuffer


class SafetensorsStorageWriter(HuggingFaceStorageWriter):
    """A ``torch.distributed.checkpoint`` storage writer of safetensors
    files, each written as ``save_file`` writes one (atomically; device
    tensors staged in chunks).

    A drop-in for ``torch.distributed.checkpoint.HuggingFaceStorageWriter``:
    the same arguments, file names, tensors, metadata and index; its
    reader (``HuggingFaceStorageReader``), safetensors and this loader
    read the files back::

        import torch.distributed.checkpoint as dcp
        from instant_staging.loader import SafetensorsStorageWriter

        dcp.save(model.state_dict(),
                 storage_writer=SafetensorsStorageWriter("ckpt/step-120", save_distributed=True))

    Args:
        path: the checkpoint's directory (made where missing).
        fqn_to_index_mapping: ``{name: file index}``, indices 1..N (files
            ``model-0000i-of-0000N.safetensors``); None: one file.
        thread_count: writer threads per file (None: the save's default,
            ``SAVE_THREADS``); DCP's writer counts files written at once.
        save_distributed: every rank writes its own files
            (``shard-0000r-model-...``, its share of each tensor and the
            offsets of that share); no index unless consolidated.
        enable_consolidation: with ``save_distributed``, the ranks' files
            go to ``path/sharded`` and the coordinator writes the whole
            tensors' files and the index in ``path``.
        thread_count_consolidation: unused (kept for DCP's signature);
            consolidation writes each file with ``thread_count`` threads.
        sync: fsync each file before its rename (default True).
        staging: a ``StagingBuffer`` to copy device tensors through; None:
            the one a load to that device kept, else a new one.
    """

    def __init__(self, path: str | os.PathLike, fqn_to_index_mapping: dict[str, int] | None = None,
                 thread_count: int | None = None, save_distributed: bool = False,
                 enable_consolidation: bool = False, thread_count_consolidation: int = 1, *,
                 sync: bool = True, staging: StagingBuffer | None = None) -> None:
        if thread_count is not None and (isinstance(thread_count, bool)
                                         or not isinstance(thread_count, int) or thread_count < 1):
            raise ValueError(f"thread_count must be a positive int or None, not {thread_count!r}")
        if fqn_to_index_mapping is not None:
            bad = [(k, v) for k, v in fqn_to_index_mapping.items()
                   if isinstance(v, bool) or not isinstance(v, int) or v < 1]
            if bad:
                raise ValueError(f"fqn_to_index_mapping's indices count from 1: {bad[:3]}")
        if enable_consolidation and not save_distributed:
            raise ValueError("enable_consolidation assembles the files of a distributed save: "
                             "pass save_distributed=True with it")
        super().__init__(os.fspath(path), fqn_to_index_mapping, 1, save_distributed,
                         enable_consolidation, thread_count_consolidation)
        self.sync_files = sync
        self.threads = thread_count
        self.staging = staging
        self._publish_options: dict = {}     # the tests' staged path on the CPU (stage_cpu, chunk)

    # -- planning: DCP's, with the refusals before any write ---------------------------

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        not_tensors = [item.index.fqn for item in plan.items
                       if item.type == WriteItemType.BYTE_IO]
        if not_tensors:
            raise ValueError(f"safetensors holds tensors only: {not_tensors[:5]} "
                             f"{'are' if len(not_tensors) > 1 else 'is'} not (save them apart, "
                             "or with DCP's FileSystemWriter)")
        names = [item.index.fqn for item in plan.items]
        twice = sorted({n for n in names if names.count(n) > 1}) if len(set(names)) < len(names) \
            else []
        if twice:
            raise ValueError(f"two shares of {twice[:5]} on one rank: a safetensors file holds "
                             "one tensor per name")
        mapping = self.fqn_to_index_mapping
        if mapping is not None:
            missing = [item.index.fqn for item in plan.items if item.index.fqn not in mapping]
            if missing:
                raise ValueError(f"fqn_to_index_mapping has no file for {missing[:5]}")
        return super().prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        plans = super().prepare_global_plan(plans)
        writers: dict[str, int] = {}
        for rank, plan in enumerate(plans):
            for name in self._files(plan):
                if writers.setdefault(name, rank) != rank:
                    raise ValueError(f"ranks {writers[name]} and {rank} would both write {name}: "
                                     "each rank holding tensors of its own needs "
                                     "save_distributed=True (one file each)")
        return plans

    def _files(self, plan):
        """``{file name: [write items]}`` of ``plan``, as DCP names them."""
        if not plan.items:
            return {}
        mapping = plan.storage_data.get("fqn_to_index_mapping")
        shard = plan.storage_data.get("shard_index")
        highest = max(mapping.values()) if mapping is not None else 1
        return {_gen_file_name(index, highest, shard): items
                for index, items in self._split_by_storage_plan(mapping, plan.items).items()}

    # -- the files ----------------------------------------------------------------------

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results: list[WriteResult] = []
        for name, items in self._files(plan).items():
            results.extend(self._write_file(name, items, planner))
        future: Future = Future()
        future.set_result(results)
        return future

    def _write_file(self, name, items, planner):
        tensors, offsets = {}, {}
        for item in items:
            fqn = item.index.fqn
            tensor = planner.resolve_data(item).detach()
            tensors[fqn] = tensor if tensor.is_contiguous() else tensor.contiguous()
            offsets[fqn] = {SAVED_OFFSETS_KEY: item.tensor_data.chunk.offsets}
        # DCP's metadata, the same strings: json.dumps' defaults.
        metadata = {CUSTOM_METADATA_KEY: json.dumps(offsets),
                    DCP_VERSION_KEY: str(HF_DCP_VERSION), FORMAT_KEY: FORMAT_VALUE}
        plan = make_plan(tensors, metadata, allow_shared=True)
        publish(plan, os.path.join(self.path, name), sync=self.sync_files, staging=self.staging,
                threads=self.threads, **self._publish_options)
        where = {e.name: (plan.data_start + e.begin, e.nbytes) for e in plan.entries}
        return [WriteResult(index=item.index, size_in_bytes=where[item.index.fqn][1],
                            storage_data=_StorageInfo(name, *where[item.index.fqn]))
                for item in items]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self.save_distributed and not self.enable_consolidation:
            return      # every rank's files hold shares of tensors: no one file per name
        if self.save_distributed:
            index = self._consolidate(metadata, results)
            directory = self.consolidated_output_path
        else:
            weight_map = {}
            total = 0
            for rank_results in results:
                for r in rank_results:
                    weight_map[r.index.fqn] = r.storage_data.relative_path
                    total += r.storage_data.length
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            directory = str(self.path)
        _publish_bytes(json.dumps(index, indent=2).encode(), directory, _metadata_fn, False,
                       sync=self.sync_files, storage_options=None)

    def _consolidate(self, metadata, results):
        """Writes the whole tensors' files from the shares this save wrote;
        returns their index."""
        names = metadata.state_dict_metadata
        mapping = self.fqn_to_index_mapping or dict.fromkeys(names, 1)
        highest = max(mapping.values())
        outputs: dict[str, list[str]] = {}     # DCP's order: the mapping's
        for fqn, index in mapping.items():
            if fqn in names:
                outputs.setdefault(_gen_file_name(index, highest), []).append(fqn)
        shares: dict[str, set[str]] = {}     # fqn -> the files holding a share of it
        for rank_results in results:
            for r in rank_results:
                shares.setdefault(r.index.fqn, set()).add(r.storage_data.relative_path)
        weight_map, total = {}, 0
        for output, fqns in outputs.items():
            whole = {}
            for fqn in fqns:
                md = names[fqn]
                whole[fqn] = torch.empty(md.size, dtype=md.properties.dtype)
            self._assemble(whole, sorted({f for fqn in fqns for f in shares.get(fqn, ())}))
            plan = make_plan(whole, {FORMAT_KEY: FORMAT_VALUE})
            publish(plan, os.path.join(self.consolidated_output_path, output),
                    sync=self.sync_files, threads=self.threads)
            for fqn in fqns:
                weight_map[fqn] = output
            total += plan.size - plan.data_start
            del whole, plan
        return {"metadata": {"total_size": total}, "weight_map": weight_map}

    def _assemble(self, whole, files):
        covered = dict.fromkeys(whole, 0)
        for name in files:
            path = os.path.join(self.path, name)
            with safe_open(path, framework="pt") as f:
                info = json.loads((f.metadata() or {}).get(CUSTOM_METADATA_KEY, "{}"))
            for fqn, share in iter_load(path, "cpu", names=[n for n in info if n in whole]):
                at = info[fqn][SAVED_OFFSETS_KEY]
                region = whole[fqn]
                for dim, (begin, size) in enumerate(zip(at, share.shape)):
                    region = region.narrow(dim, begin, size)
                region.copy_(share)
                covered[fqn] += share.numel()
        short = [fqn for fqn, n in covered.items() if n != whole[fqn].numel()]
        if short:
            raise ValueError(f"consolidation: the ranks' files cover {short[:5]} only in part")
