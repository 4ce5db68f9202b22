"""Every door opens a source the one way (loader/_open.py): the same
refusals, in the same words, at ``load_file``, ``Checkpoint.open``,
``safe_open`` and ``load_into``."""

import functools

import pytest
import torch
from safetensors.torch import save_file

from instant_staging.loader import Checkpoint, load_file, load_into, safe_open, schemes_text

DOORS = {
    "load_file": lambda source, **kw: load_file(source, "cpu", **kw),
    "Checkpoint.open": lambda source, **kw: Checkpoint.open(source, **kw).close(),
    "safe_open": lambda source, **kw: safe_open(source, "pt", "cpu", **kw).close(),
    "load_into": lambda source, **kw: load_into(source, {"w": torch.zeros(4)}, **kw),
}


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.arange(4, dtype=torch.float32)}, str(path))
    return str(path)


def _said(call):
    with pytest.raises(ValueError) as e:
        call()
    return str(e.value)


@pytest.mark.parametrize("option, value", [("storage_options", {"region": "x"}),
                                           ("cache_dir", "/tmp/anywhere")])
def test_a_urls_option_with_a_file_is_one_message_at_every_door(a_file, option, value):
    said = {door: _said(functools.partial(call, a_file, **{option: value}))
            for door, call in DOORS.items()}
    assert len(set(said.values())) == 1, said
    message = said["load_file"]
    assert message.startswith(f"{option} appl") and schemes_text() in message


def test_an_unknown_scheme_is_one_message_at_every_door():
    url = "ftp://user:pw@host/m.safetensors?token=T"
    said = {door: _said(functools.partial(call, url)) for door, call in DOORS.items()}
    assert len(set(said.values())) == 1, said
    message = said["load_file"]
    assert "'ftp'" in message and schemes_text() in message
    assert "pw" not in message and "token=T" not in message        # (redacted)


def test_every_door_still_loads_the_file(a_file):
    assert load_file(a_file)["w"].tolist() == [0, 1, 2, 3]
    dest = {"w": torch.zeros(4)}
    load_into(a_file, dest)
    assert dest["w"].tolist() == [0, 1, 2, 3]
    with safe_open(a_file, "pt") as f:
        assert f.get_tensor("w").tolist() == [0, 1, 2, 3]
    with Checkpoint.open(a_file) as ck:
        assert ck.names() == ["w"]
