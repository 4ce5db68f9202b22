"""Tensor names grouped by layer, in the model's order: ``layer_order``.

An engine that processes a layer once all of its weights arrived (vLLM's
layerwise reload, which buffers every tensor of a layer until the layer
is complete) holds on the device whatever came early: a checkpoint whose
files interleave layers (shards cut by size across layers, names sorted
as strings so that ``layers.10`` comes before ``layers.2``) makes it
buffer many layers at once.  Every iterator we hand to an engine yields
in this order instead, whatever the order in the files.

The rule, a pure function of the names:

- a name's layer is the first ``<stack>.<N>.`` in it, where ``<stack>``
  is one of ``LAYER_STACKS`` (``layers``, ``h``, ``blocks``, ``layer``,
  ``block``, ``decoder_layers``) and ``N`` an integer: ``model.layers.12.mlp.
  experts.3.w1`` is layer 12 of the stack ``model.layers`` (the expert
  number is not a layer);
- names of no layer come first, in their given order (embeddings; the
  final norm and head are small and complete by themselves);
- then each stack, in the order its first name was given (a vision
  tower's layers, then the language model's, if the files list them so),
  its layers by number, ascending;
- within a layer, the given order (stable).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

LAYER_STACKS = ("layers", "h", "blocks", "layer", "block", "decoder_layers")

_LAYER = re.compile(r"(?:^|\.)(" + "|".join(LAYER_STACKS) + r")\.(\d+)(?:\.|$)")


def layer_key(name: str) -> tuple[str, int] | None:
    """``(stack prefix, layer number)`` of ``name`` (``"model.layers.3.x"`` ->
    ``("model.layers", 3)``), or None for a name of no layer."""
    found = _LAYER.search(name)
    if found is None:
        return None
    return name[:found.end(1)], int(found.group(2))


def layer_order(names: Iterable[str]) -> list[str]:
    """``names`` grouped by layer in the model's order (the module's
    docstring): names of no layer first, then each stack's layers by
    number; stable otherwise."""
    names = list(names)
    stacks: dict[str, int] = {}
    keyed = []
    for i, name in enumerate(names):
        key = layer_key(name)
        if key is None:
            keyed.append(((-1, 0, i), name))
            continue
        rank = stacks.setdefault(key[0], len(stacks))
        keyed.append(((rank, key[1], i), name))
    keyed.sort(key=lambda pair: pair[0])
    return [name for _, name in keyed]
