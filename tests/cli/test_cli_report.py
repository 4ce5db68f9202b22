"""``load --json`` is built from the LoadReport's fields (cli/load.py,
``report_fields``): a field added to the report reaches the JSON without
touching the CLI."""

from typing import NamedTuple, Optional

from instant_staging.cli.load import load, report_fields
from instant_staging.loader import Checkpoint, LoadReport


def _report(**extra):
    values = dict(tensors=3, bytes=48, seconds=0.5, gbps=1e-7, device="cpu", staging_kind=None,
                  threads=2, chunk_size=4096, phases={"open": 0.1, "prepare": 0.1, "load": 0.3},
                  cache_hit_bytes=16, fetched_bytes=32)
    return LoadReport(**values), values


def test_every_field_of_the_report_is_in_the_json():
    report, values = _report()
    out = report_fields(report)
    # each under its own name, but the two the JSON names otherwise
    assert out.pop("reader_threads") == values.pop("threads")
    values.pop("staging_kind")          # (said in "staging")
    assert out == values and out["phases"] is not report.phases


def test_a_new_field_reaches_the_json():
    class Wider(NamedTuple):
        tensors: int
        threads: Optional[int]
        staging_kind: Optional[str]
        retried_ranges: int

    out = report_fields(Wider(1, 4, "REGISTERED", 7))
    assert out == {"tensors": 1, "reader_threads": 4, "retried_ranges": 7}


def test_a_load_says_its_reports_fields(tmp_path):
    import torch
    from safetensors.torch import save_file
    path = str(tmp_path / "m.safetensors")
    save_file({"a": torch.ones(4), "b": torch.zeros(3)}, path)
    with Checkpoint.open(path) as ck:
        result = load(ck, device="cpu", chunk_size=1 << 20, io_depth=2, threads=1)
    for name in LoadReport._fields:
        assert {"threads": "reader_threads"}.get(name, name) in result or name == "staging_kind"
    assert result["tensors"] == 2 and result["bytes"] == 28 and result["ok"] is True
