"""The documentation, kept true where mkdocs cannot see: README's first
screen (what it is, the two commands, a load example, the duration of the
test command), README's links into the tree, the environment page written
from envs.py, the examples the guides include being the ones
tests/examples runs, and benchmarks/RESULTS.md staying the current tables.
(``tox -e docs`` builds the site itself with ``mkdocs build --strict``,
which checks every link and include inside docs/.)"""

import importlib.util
import os
import re

from instant_staging import envs

from support import ROOT


def read(*parts):
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def test_readme_first_screen_is_for_users():
    text = read("README.md")
    first = text.split("\n## ", 2)
    # the first section after the commands is the load example, five lines at most
    assert first[1].startswith("Load a checkpoint\n"), first[1][:80]
    block = re.search(r"```python\n(.*?)```", first[1], re.S).group(1)
    assert "load_file(" in block and len(block.strip().splitlines()) <= 5
    # the test command's duration is stated beside it
    assert re.search(r"about\s+[\d-]+\s+minutes", first[0]), first[0]
    assert len(text.splitlines()) < 250


def test_readme_links_resolve():
    text = read("README.md")
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert links
    missing = [link for link in links if "://" not in link
               and not os.path.exists(os.path.join(ROOT, link))]
    assert not missing, missing


def load_hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", os.path.join(ROOT, "docs", "_hooks.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_environment_page_is_written_from_envs():
    hooks = load_hooks()
    page = read("docs", "guides", "environment.md")
    assert hooks.MARKER in page and "INSTANT_STAGING_" not in page.split(hooks.MARKER)[0]
    written = hooks.on_page_markdown(page, page=None, config=None, files=None)
    assert envs.markdown_table() in written and hooks.MARKER not in written
    for variable in envs.VARIABLES:
        assert f"`{variable.name}`" in written


def test_the_table_is_not_copied_by_hand():
    # one definition: a second copy of the table would drift from envs.py
    for path in ("README.md",) + tuple(
            os.path.join(d, n) for d, _, names in os.walk(os.path.join(ROOT, "docs"))
            for n in names if n.endswith(".md")):
        assert "| variable | default | where it applies |" not in read(path), path


def test_included_examples_are_the_tested_ones():
    included = []
    for dirpath, _, names in os.walk(os.path.join(ROOT, "docs")):
        for name in names:
            if name.endswith(".md"):
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    included += re.findall(r'^--8<-- "([^"]+)"', f.read(), re.M)
    examples = [path for path in included if path.startswith("examples/")]
    assert len(examples) >= 5, included
    tested = read("tests", "examples", "test_examples.py")
    for path in examples:
        assert os.path.isfile(os.path.join(ROOT, path)), path
        assert os.path.basename(path) in tested, path


def test_results_are_the_current_tables():
    text = read("benchmarks", "RESULTS.md")
    assert len(text.splitlines()) < 600
    assert "RESULTS-archive.md" in text and os.path.isfile(
        os.path.join(ROOT, "benchmarks", "RESULTS-archive.md"))
    # the host and the peers named, with versions
    for needed in ("NVIDIA H200", "580.159.04", "safetensors 0.9.0rc1", "InstantTensor 0.2.2",
                   "fastsafetensors 0.5.0", "runai-model-streamer 0.17.1"):
        assert needed in text, needed
    # no dated work log: sessions are cited, not logged
    assert not re.search(r"^## Session \d+", text, re.M)


def test_the_sdist_holds_the_site_sources():
    # tox -e wheel runs these tests from the unpacked sdist: the hook, the
    # pages and mkdocs.yml must be in it
    manifest = read("MANIFEST.in")
    assert re.search(r"^include .*\bmkdocs\.yml\b", manifest, re.M)
    assert re.search(r"^recursive-include docs .*\*\.md\b.*\*\.py\b", manifest, re.M)
