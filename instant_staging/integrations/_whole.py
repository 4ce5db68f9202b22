"""The one rule both integrations apply to a load they hand over tensor by
tensor: whole (every tensor read before the first is handed over) or
streamed (each as it finishes), from the mean size of its tensors
(``defaults.WHOLE_BATCH_MEAN_BYTES``).  The vLLM path applies it to each
batch (``vllm/_weights.py``), transformers' background load to each of its
loads (``transformers/_background.py``)."""

from __future__ import annotations

from ..defaults import WHOLE_BATCH_MEAN_BYTES


def whole(nbytes: int, count: int) -> bool:
    """Whether a load of ``count`` tensors of ``nbytes`` in all is handed over
    whole: its tensors average fewer than ``WHOLE_BATCH_MEAN_BYTES`` (the
    consumer's per-tensor calls into the device, made while the readers
    copy, would slow both)."""
    return nbytes < WHOLE_BATCH_MEAN_BYTES * count
