"""The ``(name, tensor)`` pairs vLLM's ``model.load_weights`` takes, read by
instant_staging onto the worker's device.  Needs no vLLM.

    stats = Stats()
    for name, tensor in iter_weights(files, "cuda:0", Options(), stats=stats):
        ...                      # what vLLM's safetensors_weights_iterator yields

The pairs: every tensor of ``files`` (for which ``keep(name)`` holds), once,
with the file's name, dtype, shape and bytes, as vLLM's default
``safetensors_weights_iterator`` yields them, but on ``device`` instead of
the CPU (vLLM's weight loaders copy each into its parameter, or their
tensor-parallel slice of it, from any device).  The order is the model's,
grouped by layer (``loader.layer_order``: names of no layer first, then
layer 0, 1, ... whatever the files' order; within a layer, the files'
order), not the files': an engine that processes a layer once all of its
weights arrived (vLLM's layerwise reload) then holds at most the layer it
is filling, never tensors of layers to come.  Within a batch, a tensor
that finishes early waits for those before it (its memory is allocated
anyway: a load allocates its whole batch when it starts).

The files are opened once, as one ``Checkpoint`` (every header read and
checked once, before anything is allocated), and its tensors are read in
batches (``plan``): consecutive tensors in layer order up to
``Options.batch_bytes`` (``_options.BATCH_BYTES``), each batch one
``checkpoint.iter_load(device, names=batch)``, so that no more than one
batch of checkpoint tensors sits on the device beside the model at any
time (a load allocates all its tensors when it starts).  The staging
buffer is the one the loader keeps between loads, so batches pin nothing
anew.  A batch of large tensors is yielded as each tensor finishes; one of
small tensors (on average under ``defaults.WHOLE_BATCH_MEAN_BYTES``) once
all of it is loaded, so that vLLM's copy of each tensor into its parameter
does not run while the readers copy (``whole()``).

``process_group`` (``Options.shared_read``): every rank of the group calls
with the same files; each batch is then a collective ``iter_load(...,
process_group=pg)`` (each rank reads about 1/N of its bytes, the ranks
exchange them), so every rank must make the same batches: ``keep`` then
filters after the load instead of before (a rank still ends with only what
it keeps).

``on_cpu`` (vLLM's Engram tables with ``engram_config.cpu_offload``, as
vLLM's ``instanttensor_weights_iterator`` keeps them): the tensors for which
it holds are read to the CPU, never to ``device``, in batches of their own
after the device's, each rank reading its own (never collective).

``shuffle_seed`` (vLLM's ``shuffle_safetensors_files``): the files in
vLLM's rank-seeded random order instead of its natural one.
"""

from __future__ import annotations

import hashlib
import random
import re
import time
from collections.abc import Iterator
from typing import Any, Callable, NamedTuple

from ...loader import Checkpoint, is_url, layer_order
from .. import _whole
from ._options import Options


class Batch(NamedTuple):
    files: tuple[str, ...]       # the files holding its tensors, in order
    names: tuple[str, ...]
    nbytes: int


class Stats:
    """What a finished ``iter_weights`` read (for vLLM's log line)."""

    def __init__(self):
        self.tensors = 0
        self.bytes = 0
        self.batches = 0
        self.on_cpu = 0                     # tensors read to the CPU by on_cpu (Engram tables)
        self.seconds = 0.0
        self.kinds: list[str] = []          # staging kinds seen (every rank's with a group)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def natural_key(path: str) -> list[Any]:
    """vLLM's file order: numbers in the base name compared as numbers
    (model-00002-of-00010 before model-00010-of-00010)."""
    name = re.split(r"[\\/]", path)[-1]
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def file_order(files: list[str], shuffle_seed: int | None = None) -> list[str]:
    """vLLM's order of the files: natural, or, with ``shuffle_seed`` (the
    rank, vLLM's ``shuffle_safetensors_files``), that order shuffled by
    ``random.Random(shuffle_seed)``, as vLLM's ``_shuffle_files``."""
    ordered = sorted(files, key=natural_key)
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(ordered)
    return ordered


def tensor_sizes(checkpoint: Checkpoint) -> list[tuple[str, list[tuple[str, int]]]]:
    """``[(file, [(name, nbytes), ...]), ...]`` of an open ``checkpoint``,
    from its headers alone, in layer order (``layer_order`` of its files in
    its order, each file's names sorted as safetensors lists them): runs
    of consecutive names of one file, a file in several runs where its
    layers are apart."""
    by_file: dict[str, list[str]] = {path: [] for path in checkpoint.files}
    for name in checkpoint.names():
        by_file[checkpoint.info(name).file].append(name)
    runs: list[tuple[str, list[tuple[str, int]]]] = []
    for name in layer_order(n for names in by_file.values() for n in sorted(names)):
        info = checkpoint.info(name)
        if not runs or runs[-1][0] != info.file:
            runs.append((info.file, []))
        runs[-1][1].append((name, info.nbytes))
    return runs


def plan(sizes: list[tuple[str, list[tuple[str, int]]]], batch_bytes: int) -> list[Batch]:
    """Consecutive tensors in batches of at most ``batch_bytes`` (a larger
    tensor alone)."""
    batches: list[Batch] = []
    files: list[str] = []
    names: list[str] = []
    total = 0
    for path, entries in sizes:
        for name, nbytes in entries:
            if names and total + nbytes > batch_bytes:
                batches.append(Batch(tuple(files), tuple(names), total))
                files, names, total = [], [], 0
            if not files or files[-1] != path:
                files.append(path)
            names.append(name)
            total += nbytes
    if names:
        batches.append(Batch(tuple(files), tuple(names), total))
    return batches


def whole(batch: Batch) -> bool:
    """Whether ``batch`` is loaded whole before its first tensor is yielded
    (``integrations/_whole.py``'s rule, shared with transformers' path)."""
    return _whole.whole(batch.nbytes, len(batch.names))


def iter_weights(files: list[str], device: Any, options: Options | None = None, *,
                 keep: Callable[[str], bool] | None = None, on_cpu: Callable[[str], bool] | None = None,
                 process_group: Any = None, progress: Callable[[int, int], object] | None = None,
                 stats: Stats | None = None, shuffle_seed: int | None = None) -> Iterator[tuple[str, Any]]:
    """Yields ``(name, tensor)`` for every tensor of ``files`` that ``keep``
    accepts, on ``device`` (the CPU for those ``on_cpu`` accepts; see the
    module docstring).  Every header is read and checked before the first
    tensor is allocated; ``stats`` is filled when the iteration ends."""
    options = options if options is not None else Options()
    stats = stats if stats is not None else Stats()
    files = file_order(list(files), shuffle_seed)
    cache_dir = options.cache_dir if files and is_url(files[0]) else None
    with Checkpoint.open(files, cache_dir=cache_dir) as checkpoint:
        yield from _iter_batches(checkpoint, device, options, keep, on_cpu, process_group,
                                 progress, stats)


def _iter_batches(checkpoint: Checkpoint, device: Any, options: Options,
                  keep: Callable[[str], bool] | None, on_cpu: Callable[[str], bool] | None,
                  process_group: Any, progress: Callable[[int, int], object] | None,
                  stats: Stats) -> Iterator[tuple[str, Any]]:
    """``iter_weights`` over its open ``checkpoint``: the batches, each a load."""
    sizes = tensor_sizes(checkpoint)
    host: list[tuple[str, list[tuple[str, int]]]] = []
    if on_cpu is not None:
        host = [(path, [(n, b) for n, b in entries if on_cpu(n) and (keep is None or keep(n))])
                for path, entries in sizes]
        sizes = [(path, [(n, b) for n, b in entries if not on_cpu(n)]) for path, entries in sizes]
    if keep is not None and process_group is None:
        sizes = [(path, [(n, b) for n, b in entries if keep(n)]) for path, entries in sizes]
    batches = plan(sizes, options.batch_bytes)
    if process_group is not None:
        _check_same_plan(batches, process_group)
    loads = [(batch, device, process_group, False) for batch in batches]
    loads += [(batch, "cpu", None, True) for batch in plan(host, options.batch_bytes)]
    total = sum(load[0].nbytes for load in loads)
    knobs = {"chunk_size": options.chunk_size, "io_depth": options.io_depth, "threads": options.threads,
             "verify": options.verify, "max_bytes_per_second": options.max_bytes_per_second}
    start = time.perf_counter()
    done = 0
    kinds: set[str] = set()
    for batch, where, group, to_host in loads:
        report = None
        if progress is not None:
            def report(n, _total, before=done):
                progress(before + n, total)
        with checkpoint.iter_load(where, names=set(batch.names), process_group=group,
                                  progress=report, **knobs) as it:
            for name, tensor in _in_order(_loaded(it) if whole(batch) else it, batch.names):
                if keep is not None and not keep(name):
                    continue                 # a shared read loads what other ranks keep
                stats.tensors += 1
                stats.bytes += tensor.numel() * tensor.element_size()
                stats.on_cpu += to_host
                yield name, tensor
                tensor = None                # the consumer's alone: freed when it drops it
            kinds.update(_kinds(it))         # (known once the load ran: asked once a batch)
        done += batch.nbytes
        stats.batches += 1
    stats.seconds = time.perf_counter() - start
    stats.kinds = sorted(kinds)


def _loaded(it) -> Iterator[tuple[str, Any]]:
    """The pairs of load ``it``, once all of it is loaded; each dropped here
    when yielded, so that it is the consumer's alone, as a streamed one is."""
    stack = list(it)[::-1]
    while stack:
        yield stack.pop()


def _in_order(pairs: Iterator[tuple[str, Any]], names: tuple[str, ...]) -> Iterator[tuple[str, Any]]:
    """The pairs of a batch in the batch's order (``names``): one that comes
    early waits until those before it came (a load allocates its whole
    batch as it starts: waiting holds nothing more); any the order does
    not name, as they come."""
    named = set(names)
    waiting: dict[str, Any] = {}
    position = 0
    for name, tensor in pairs:
        if name not in named:
            yield name, tensor
            continue
        waiting[name] = tensor
        tensor = None
        while position < len(names) and names[position] in waiting:
            yield names[position], waiting.pop(names[position])
            position += 1
    for name in list(waiting):
        yield name, waiting.pop(name)


def _check_same_plan(batches: list[Batch], group: Any) -> None:
    """Every rank of a shared read makes the same batches (the same files
    and tensors), else the collective loads would pair different batches:
    a ValueError on every rank, naming the ranks that differ."""
    import torch.distributed as dist
    mine = [([re.split(r"[\\/]", f)[-1] for f in b.files], list(b.names)) for b in batches]
    digest = hashlib.sha256(repr(mine).encode()).hexdigest()
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, digest, group=group)
    differ = [rank for rank, d in enumerate(everyone) if d != everyone[0]]
    if differ:
        raise ValueError(f"shared_read: rank(s) {differ} would read other files or tensors than rank 0; "
                         "every rank of the group must load the same checkpoint (turn shared_read off)")


def _kinds(it) -> list[str]:
    """The staging kinds of a started load: every rank's with a process
    group, else its own (none when loading to the CPU)."""
    return ["none (cpu)" if k is None else k.name for k in it.staging_kinds or ()]
