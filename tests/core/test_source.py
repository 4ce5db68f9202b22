"""The source tree itself: the docs' Layout page (docs/develop/layout.md)
lists what exists, README's StagingBuffer example runs on any host,
nothing cites notes users lack, and the linters
(ruff, cython-lint) are clean on instant_staging, tests and benchmarks."""

import os
import re
import shutil
import subprocess

import pytest

from support import ROOT

PACKAGE = os.path.join(ROOT, "instant_staging")
SOURCES = (".py", ".pyx", ".pxd", ".pxi", ".pyi")
GENERATED = {"_build_config.py"}          # written by setup.py
NAME = re.compile(r"^[\w.]+/?$")


LAYOUT = os.path.join(ROOT, "docs", "develop", "layout.md")


def readme_layout():
    """{path relative to instant_staging/: listed} from the Layout page's block."""
    with open(LAYOUT) as f:
        text = f.read()
    block = text.split("# Layout", 1)[1].split("```", 2)[1]
    lines = block.splitlines()
    start = lines.index("instant_staging/")
    listed, parents = set(), []
    for line in lines[start + 1:]:
        indent = len(line) - len(line.lstrip(" "))
        if indent == 0:
            break                                # the next top-level entry
        if indent % 2:
            continue
        depth = indent // 2
        token = line.split()[0]
        if depth > len(parents) + 1 or not NAME.match(token) or not (
                token.endswith("/") or token.endswith(SOURCES)):
            continue                             # a description's continuation
        parents = parents[:depth - 1]
        if token.endswith("/"):
            parents.append(token[:-1])
            listed.add("/".join(parents))
        else:
            listed.add("/".join(parents + [token]))
    return listed


def tree():
    """Modules and packages under instant_staging/ (sources, not builds)."""
    found = set()
    for dirpath, dirnames, filenames in os.walk(PACKAGE):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        rel = os.path.relpath(dirpath, PACKAGE)
        prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
        if prefix:
            found.add(prefix[:-1])
        for name in filenames:
            if name.endswith(SOURCES) and name not in GENERATED:
                found.add(prefix + name)
    return found


def test_readme_layout_lists_every_module_and_nothing_else():
    listed, present = readme_layout(), tree()
    # A package's __init__.py is the package line itself.
    expected = {p for p in present if not (p.endswith("/__init__.py") or
                                           (p.endswith(".pyi") and "/" in p))}
    assert listed - present == set(), "docs/develop/layout.md lists what does not exist"
    modules = {p for p in expected if p.endswith((".py", ".pyx")) or "." not in p.split("/")[-1]}
    assert modules - listed == set(), "docs/develop/layout.md misses these"


LINTED = ["instant_staging", "tests", "benchmarks"]


def _tool(name):
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed")
    return path


def test_ruff_is_clean():
    out = subprocess.run([_tool("ruff"), "check", "--no-cache", *LINTED], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_cython_lint_is_clean():
    files = []
    for top in LINTED:
        for dirpath, _, filenames in os.walk(os.path.join(ROOT, top)):
            files += [os.path.join(dirpath, n) for n in filenames if n.endswith((".pyx", ".pxd", ".pxi"))]
    out = subprocess.run([_tool("cython-lint"), *sorted(files)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


# -- what ships cites only what ships -----------------------------------------------

SKIPPED_DIRS = {".git", "build", "dist", "__pycache__", ".tox", ".venv", ".whl"}
TEXT = (".py", ".pyx", ".pxd", ".pxi", ".pyi", ".md", ".toml", ".ini", ".cfg", ".sh", ".txt")
# Notes of the project's authors that users never get: facts taken from
# them live in docs/design.md ("Measured"), which is where citations point.
OUTSIDE = ("FIELD_NOTES" + ".md",)          # spelled so that this line is not one


def shipped_text_files():
    for dirpath, dirnames, filenames in os.walk(ROOT):
        # (and the hidden ones but CI's: a developer's scratch, never shipped)
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIRS and not d.endswith(".egg-info")
                       and (d == ".ci" or not d.startswith("."))]
        for name in filenames:
            if name.endswith(TEXT):
                yield os.path.join(dirpath, name)


def test_no_file_cites_notes_users_do_not_have():
    cited = []
    for path in shipped_text_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if any(name in line for name in OUTSIDE):
                    cited.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
    assert not cited, "\n".join(cited)


# A citation of docs/design.md names a part of it: a heading, or the words a
# paragraph begins with (read across line breaks and comment marks).
CITATION = re.compile(r'docs/design\.md[,:]? "([^"]+)"')


def test_every_citation_of_the_design_names_a_part_of_it():
    with open(os.path.join(ROOT, "docs", "design.md"), encoding="utf-8") as f:
        starts = [re.sub(r"^#+ ", "", line.strip()) for line in f if line.strip()]
    dangling = []
    for path in shipped_text_files():
        if not path.endswith(SOURCES):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            text = re.sub(r"\n\s*(#\s*)?", " ", f.read())
        for cited in CITATION.findall(text):
            if not any(start.startswith(cited.strip()) for start in starts):
                dangling.append(f"{os.path.relpath(path, ROOT)}: {cited!r}")
    assert not dangling, "\n".join(dangling)


# -- README's promises ------------------------------------------------------------------

def readme_python_blocks():
    with open(os.path.join(ROOT, "README.md")) as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), re.S | re.M)


def test_readme_staging_example_runs_on_this_host(tmp_path):
    """README's StagingBuffer example runs as pasted, with or without a
    GPU (without one: on the simulated runtime, as it says)."""
    import sys

    from support import child_env
    first = next(block for block in readme_python_blocks() if "StagingBuffer(" in block)
    proc = subprocess.run([sys.executable, "-c", first], cwd=str(tmp_path), env=child_env(),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Pinned, whichever path this host's driver takes (simulated: REGISTERED).
    assert re.search(r"^Kind\.(REGISTERED|SEGMENTED|RUNTIME_PINNED) True ", proc.stdout, re.M), \
        proc.stdout + proc.stderr


def test_importing_an_unbuilt_checkout_says_how_to_build(tmp_path):
    """A source tree without its build (no _build_config.py, no compiled
    modules) is an ImportError naming the build command, not a bare
    ``No module named 'instant_staging._build_config'``."""
    import sys
    shutil.copytree(PACKAGE, tmp_path / "instant_staging",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__", *GENERATED))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for code in ("import instant_staging", "import instant_staging.loader",
                 "from instant_staging import StagingBuffer"):
        proc = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env,
                              capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("ImportError: instant_staging is not built"), proc.stderr
        assert "setup.py build_ext --inplace" in last and "pip install -e ." in last
        assert "No module named" not in proc.stderr
    # Built but for one compiled module gone: named too.
    import instant_staging  # the build under test (in place, or installed)
    built = os.path.join(os.path.dirname(instant_staging.__file__), "_build_config.py")
    shutil.copy(built, tmp_path / "instant_staging" / "_build_config.py")
    proc = subprocess.run([sys.executable, "-c", "import instant_staging"], cwd=str(tmp_path),
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert "instant_staging._staging is missing" in proc.stderr, proc.stderr


ENV_NAME = re.compile(r"INSTANT_STAGING_[A-Z][A-Z0-9_]*[A-Z0-9]")
# Where the package reads its variables: its modules, the build and its backend.
READERS = ("instant_staging", "setup.py", "_build_backend")


def variables_the_code_reads():
    found = set()
    for top in READERS:
        path = os.path.join(ROOT, top)
        files = [path] if os.path.isfile(path) else [
            os.path.join(d, n) for d, _, names in os.walk(path) for n in names
            if n.endswith(SOURCES) and n not in GENERATED]
        for name in files:
            with open(name, encoding="utf-8") as f:
                found.update(ENV_NAME.findall(f.read()))
    return found


def docs_variable_table():
    """{name: (default, where)} from the docs' "Environment variables" table
    (envs.markdown_table(), which docs/_hooks.py writes into the page)."""
    from instant_staging import envs
    rows = {}
    for line in envs.markdown_table().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and ENV_NAME.fullmatch(cells[0].strip("`")):
            rows[cells[0].strip("`")] = (cells[1], cells[2])
    return rows


def test_docs_table_every_variable_the_code_reads():
    read, table = variables_the_code_reads(), docs_variable_table()
    assert "INSTANT_STAGING_PREFAULT_THREADS" in read     # the one once documented nowhere
    assert read - set(table) == set(), "read by the code, missing from the docs' table"
    assert set(table) - read == set(), "in the docs' table, read nowhere"
    for name, (default, where) in table.items():
        assert default and where, name


def _loader_imports(module):
    """The loader's own modules ``loader/<module>.py`` imports, anywhere in it."""
    import ast
    with open(os.path.join(PACKAGE, "loader", module + ".py")) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                names.add(node.module)
            else:
                names.update(a.name for a in node.names)
    return names


def test_the_loaders_paths_import_one_way():
    # The doors (_load, _checkpoint) prepare (_prepare) and hand the
    # Prepared to _run or _distributed; those never reach back (issue 21,
    # 6: the two paths had imported each other), and preparing knows
    # neither of them.
    doors = {"_load", "_checkpoint"}
    assert not (doors | {"_distributed"}) & _loader_imports("_run")
    assert not doors & _loader_imports("_distributed")
    assert not (doors | {"_run", "_distributed"}) & _loader_imports("_prepare")
    assert {"_run", "_distributed", "_prepare"} <= _loader_imports("_checkpoint")
    assert "_checkpoint" in _loader_imports("_load")


def test_the_loader_has_no_import_circle():
    # _schemes (the URL schemes) is asked by both _source and _remote and
    # asks neither: the circle _remote -> _shards -> _source -> _remote
    # (one message's lazy import) is gone, and stays so.
    assert _loader_imports("_schemes") == set()
    assert not {"_remote", "_cache", "_checkpoint"} & _loader_imports("_source")
    modules = [f[:-3] for f in os.listdir(os.path.join(PACKAGE, "loader"))
               if f.endswith(".py") and f != "__init__.py"]
    graph = {m: _loader_imports(m) & set(modules) for m in modules}
    seen, done = [], set()

    def visit(m):
        assert m not in seen, f"an import circle: {' -> '.join(seen[seen.index(m):] + [m])}"
        if m in done:
            return
        seen.append(m)
        for n in sorted(graph[m]):
            visit(n)
        seen.pop()
        done.add(m)
    for m in sorted(modules):
        visit(m)


# What makes shards or a cache: a call of one of these.
_MAKERS = {"Shards", "RemoteShards", "CachedShards", "HitShards", "open_hit", "Cache", "cached",
           "Stores", "resolve",
           "resolve_url", "open_recorded"}


def _calls(module):
    """The names ``loader/<module>.py`` calls (``f(...)`` and ``x.f(...)``)."""
    import ast
    with open(os.path.join(PACKAGE, "loader", module + ".py")) as f:
        tree = ast.parse(f.read())
    return {getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            for node in ast.walk(tree) if isinstance(node, ast.Call)}


def test_only_open_shards_makes_shards_or_a_cache():
    # Every door opens its source through _open.open_shards: none resolves
    # a source, makes shards, stores or a cache itself (issue 52: the two
    # copies in Checkpoint.open and safe_open had drifted in wording).
    for door in ("_checkpoint", "_safe_open", "_load", "_into"):
        assert not _calls(door) & _MAKERS, (door, _calls(door) & _MAKERS)
        assert not {"_cache", "_source"} & _loader_imports(door), door
    assert {"Shards", "RemoteShards", "Cache", "cached", "Stores"} <= _calls("_open")
    assert "_open" in _loader_imports("_checkpoint") and "_open" in _loader_imports("_safe_open")


# -- the tests themselves -----------------------------------------------------------------

def test_tests_share_helpers_through_support_only():
    """A test module imports what it shares from tests/support/, never from
    another test module or from conftest.py (which holds pytest's hooks)."""
    import ast
    tests = os.path.join(ROOT, "tests")
    bad, read = [], 0
    for dirpath, dirnames, filenames in os.walk(tests):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in sorted(n for n in filenames if n.endswith(".py")):
            path = os.path.join(dirpath, name)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            read += 1
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    modules = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    modules = [node.module or ""]
                else:
                    continue
                for module in modules:
                    top = module.split(".")[0]
                    if top.startswith("test_") or top == "conftest":
                        bad.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {module}")
    assert read > 50, read
    assert not bad, "\n".join(bad)
