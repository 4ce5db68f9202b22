"""Types of the compiled ``loader._canonical`` module (private to ``_header``)."""

_Entry = tuple[str, str, tuple[int, ...], int, int]

def read(raw: bytes, dtypes: dict[bytes, str]) -> tuple[dict[str, str] | None, list[_Entry]] | None: ...
