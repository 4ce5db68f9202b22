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


def test_readmes_test_times_are_the_testing_pages():
    # README's figure for each test command is the one docs/develop/testing.md
    # gives with its measurements (issue 55: README said 10-14 minutes of a
    # run whose CI counterpart took 33.8)
    first = read("README.md").split("\n## ", 1)[0]
    testing = " ".join(read("docs", "develop", "testing.md").split())
    first = " ".join(first.split())
    for command, figure in (("tox -e cuda", "10-14 minutes"), ("tox -e quick", "3 minutes"),
                            (".ci/run", "38-42 minutes")):
        assert command in first and figure in first, (command, figure)
        assert figure in testing, (command, figure)


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


def test_the_sites_header_names_the_repository_and_this_version():
    import instant_staging
    config = load_hooks().on_config({})
    assert config["repo_name"] == f"instant_staging {instant_staging.__version__}"
    assert config["repo_url"].startswith("https://") and config["repo_url"] in read("pyproject.toml")


def test_the_defaults_the_pages_quote_are_the_codes():
    # (issue 55: the environment page and the API reference said 4 MiB
    # chunks where the code had 2 MiB)
    from instant_staging import defaults
    from instant_staging._types import format_size
    chunk, cold_chunk = format_size(defaults.CHUNK_SIZE), format_size(defaults.COLD_CHUNK_SIZE)
    row = envs.variable("INSTANT_STAGING_CHUNK_SIZE").default
    assert row.startswith(f"{chunk} ({cold_chunk} "), row
    assert f"at most {defaults.MAX_THREADS} ({defaults.COLD_THREADS} " in envs.variable(
        "INSTANT_STAGING_THREADS").default
    knobs = " ".join(read("docs", "guides", "loading.md").split("## The knobs", 1)[1].split())
    assert (f"read in {chunk} pieces by up to {defaults.MAX_THREADS} threads, one the page cache lacks "
            f"in {cold_chunk} pieces by {defaults.COLD_THREADS}") in knobs, knobs[:400]
    assert f"more reads in flight ({defaults.WARM_THREADS})" in knobs
    assert f"{defaults.MAX_SLOTS_PER_THREAD} slots per reader thread" in knobs
    environment = read("docs", "guides", "environment.md")
    assert f"({cold_chunk} chunks, {defaults.COLD_THREADS} threads)" in environment
    # a docstring that gives a default's figure beside its name gives the code's
    quoted = []
    for dirpath, _, names in os.walk(os.path.dirname(envs.__file__)):
        for name in names:
            if name.endswith((".py", ".pyi", ".pyx")):
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    quoted += re.findall(r"``defaults\.([A-Z_]+)``[,\s(]+(\d+ [KMGT]?i?B)\b", f.read())
    assert ("CHUNK_SIZE", chunk) in quoted, quoted
    for constant, figure in quoted:
        assert format_size(getattr(defaults, constant)) == figure, (constant, figure)


def test_the_home_page_quotes_readmes_speedups():
    # one table of them: README's, included by the home page
    readme, home = read("README.md"), read("docs", "index.md")
    assert "<!-- --8<-- [start:speedups] -->" in readme and "<!-- --8<-- [end:speedups] -->" in readme
    table = readme.split("[start:speedups] -->", 1)[1].split("<!-- --8<-- [end:speedups]", 1)[0]
    assert re.search(r"\| \d+\.\d+x \|", table)
    assert '--8<-- "README.md:speedups"' in home
    assert not re.search(r"\d\.\d+x|GB/s", home), "a figure of README's table copied by hand"


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


def test_public_docstrings_cite_no_private_file():
    # (issue 55: the API reference, read from these docstrings, sent users
    # to loader/_cache.py and _upload.py, which they cannot open from there)
    import inspect

    import pytest
    pytest.importorskip("torch")
    import instant_staging
    from instant_staging import loader
    private = re.compile(r"\b_\w+\.(?:py|pyx|pxd)\b|\b(?:loader|runtime)/_\w+")
    cited = []
    for module in (instant_staging, loader):
        for name in module.__all__:
            obj = getattr(module, name)
            members = [(name, obj)]
            if inspect.isclass(obj):
                members += [(f"{name}.{k}", v) for k, v in vars(obj).items()
                            if not k.startswith("_") or k == "__init__"]
            for where, member in members:
                doc = inspect.getdoc(getattr(member, "__func__", member)) or ""
                cited += [f"{where}: {line.strip()}" for line in doc.splitlines() if private.search(line)]
    assert not cited, "\n".join(cited)
