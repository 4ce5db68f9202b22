"""The canonical safetensors header, read in C.

safetensors writes its header compactly, the metadata first, each entry's
keys in one order, padded with spaces::

    {"__metadata__":{"format":"pt"},"a":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},...}

Such a header, with no escape in any string and no number of 20 digits or
more (so below 2**64), means exactly what its bytes say.  ``read`` reads
it in one pass; for anything else it returns None and ``_header._parse``
(the JSON parser with serde_json's rules) decides the header and words
its errors.  So this module only decides *whether* the fast reading
applies, never whether a file is valid: a header it declines is read the
slow way, and ``tests/loader/test_header_validity.py`` checks that both
readings agree.

Python (regular expressions) took a tenth of a MoE shard's load on a
slow host; this takes about a tenth of that (docs/design.md, "Measured:
the fast header reading").

``checked`` does the same for the entries' rules (``_header``'s coverage,
byte counts and torch's limits): it accepts entries that pass them all,
else returns None and ``_header`` applies them one by one and words the
error.

``read`` and ``table`` read the entries into a C table (offsets, dtype,
dimensions; no Python object per tensor).  ``table`` is ``read`` and
``checked`` in one pass, the loader's path for every header: the table is
checked and sorted in C, and only what passes becomes the header's
``TensorEntry`` objects, each made once.  It accepts exactly what
``read`` followed by ``checked`` accepts, with the same result
(``tests/loader/test_header_validity.py`` compares them); the intermediate
tuples, the sort keys and the second walk were a third of a fine-grained
MoE shard's header time (docs/design.md, "Measured: the header table").
"""

from typing import TypeVar

_Entry = tuple[str, str, tuple[int, ...], int, int]

def read(raw: bytes, dtypes: dict[bytes, str]) -> tuple[dict[str, str] | None, list[_Entry]] | None: ...

_T = TypeVar("_T")

def checked(tensors: list[_Entry], data_start: int, bits: dict[str, int],
            entry: type[_T]) -> tuple[list[_T], int] | None: ...

def table(raw: bytes, dtypes: dict[bytes, str], bits: dict[str, int],
          entry: type[_T]) -> tuple[dict[str, str] | None, list[_T], int] | None: ...
