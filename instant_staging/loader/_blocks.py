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

# Bytes a view's offset in its block is a multiple of.
ALIGN = 16


class Run(NamedTuple):
    """Entries ``[first, stop)`` of a load, in reading order.  ``block``:
    they share one allocation of ``nbytes`` holding the file's bytes from
    ``begin``; otherwise a single tensor allocated on its own."""

    first: int
    stop: int
    begin: int
    nbytes: int
    block: bool


def runs(entries, joins):
    """The runs of ``entries`` (``[(file_index, TensorEntry), ...]`` in
    reading order); ``joins[k]``: whether tensor k may be a view by its
    dtype (the target's rule: not converted); a tensor without bytes never
    is one."""
    out = []
    run = None              # the open block run: [first, file index, begin, end]

    def close(stop):
        first, _, begin, end = run
        out.append(Run(first, stop, begin, end - begin, True))

    for k, (i, t) in enumerate(entries):
        view = joins[k] and t.end > t.begin
        if run is not None and not (view and i == run[1] and t.begin == run[3]
                                    and (t.begin - run[2]) % ALIGN == 0):
            close(k)
            run = None
        if not view:
            out.append(Run(k, k + 1, t.begin, t.end - t.begin, False))
        elif run is None:
            run = [k, i, t.begin, t.end]
        else:
            run[3] = t.end
    if run is not None:
        close(len(entries))
    return out


def joined(run_list):
    """``Plan(joins=)``: whether each tensor's copy continues the one before
    it, which it does only inside one block."""
    out = []
    for r in run_list:
        out.append(False)
        if r.block:
            out.extend([True] * (r.stop - r.first - 1))
    return out


def packed(run_list):
    """Whether every tensor with bytes is a view (the plan may then cut
    chunks without regard to tensor boundaries: ``Plan(packed=True)``)."""
    return all(r.block or not r.nbytes for r in run_list)
