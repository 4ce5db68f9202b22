"""Tensors as views into one device block per run of tensors that lie back
to back in a file.

A copy per tensor costs a launch per tensor: small copies move a sliver
of what the link can, and checkpoints of many small tensors (MoE shards,
AWQ checkpoints) lost a noticeable part of the link to them
(docs/design.md, "Measured: a copy per tensor").  So a
load to a GPU allocates one block per *run*, copies each chunk into it at
the chunk's place in the file (the pipeline joins the pieces of a chunk
that continue one block into one copy: ``_pipeline.pyx``'s ``_next_copy``,
``Plan(joins=)``), and hands out each tensor as a view of its block.

A tensor continues the run before it when it lies in the same file right
where that one ends, at a multiple of ``ALIGN`` bytes from the run's start
(torch views need a multiple of the element size; 16 bytes keep the
alignment of a fresh allocation that vectorized kernels and cuBLAS look
for), and is kept in the file's dtype.  A misaligned tensor starts a run
of its own; a tensor that ``dtype=`` converts, or that has no bytes, gets
its own allocation (``Run.block`` False): converting a view would keep its
whole block alive beside the converted copy.

What a view means for memory: a tensor keeps its whole block alive (del of
some tensors of a run frees nothing until the last goes; ``torch.save``
of one tensor writes its block); ``tensor.clone()`` detaches one, and
``views=False`` gives each tensor its own allocation, as safetensors does.
"""

from typing import NamedTuple

ALIGN: int

class Run(NamedTuple):
    first: int
    stop: int
    begin: int
    nbytes: int
    block: bool

def runs(entries: list[tuple[int, tuple[object, ...]]], joins: list[bool]) -> list[Run]: ...
def joined(run_list: list[Run]) -> list[bool]: ...
def packed(run_list: list[Run]) -> bool: ...
