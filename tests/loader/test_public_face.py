"""The loader's one public face (DESIGN.md, "The loader"): no module of
instant_staging outside ``instant_staging/loader/`` imports an underscored
loader module, in any spelling: ``instant_staging.loader._x``,
``..loader._x``, ``...loader._x``, ``from ..loader import _x``, a
``cimport`` of one in a .pyx/.pxd, ``importlib.import_module`` of one.

The .py and .pyi files are read with ``ast``; the Cython files with a
regular expression over their import statements (continuations and
parenthesised lists joined first).  The checker is tested on strings and on
a planted file as well, so that it cannot pass by finding nothing.
"""

import ast
import os
import re

import instant_staging

PACKAGE = "instant_staging"
LOADER = f"{PACKAGE}.loader"
PACKAGE_DIR = os.path.dirname(os.path.abspath(instant_staging.__file__))
PYTHON = (".py", ".pyi")
CYTHON = (".pyx", ".pxd")


# -- the checker ---------------------------------------------------------------------

def private_loader_module(module, names=()):
    """Whether importing ``names`` from absolute ``module`` (or ``module``
    itself, without names) reaches an underscored loader module."""
    parts = module.split(".")
    if module.startswith(LOADER + ".") and parts[2].startswith("_"):
        return True
    return module == LOADER and any(n.startswith("_") for n in names)


def absolute(package, level, module):
    """The module ``from <level dots><module> import ...`` names inside ``package``."""
    if level == 0:
        return module or ""
    base = package.split(".")
    if level > 1:
        base = base[:-(level - 1)]
    return ".".join(p for p in (*base, module or "") if p)


def _python_imports(text, filename):
    """``(line, level, module, names)`` of every import in Python source
    (``names`` empty for a plain ``import``), and of ``import_module`` /
    ``__import__`` calls with a constant name."""
    for node in ast.walk(ast.parse(text, filename)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, 0, alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            yield node.lineno, node.level, node.module, tuple(a.name for a in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__"):
                yield node.lineno, 0, node.args[0].value, ()


_FROM = re.compile(r"^from\s+(\.*)\s*([\w.]*)\s+c?import\s+(.+)$", re.S)
_IMPORT = re.compile(r"^c?import\s+(.+)$", re.S)


def _cython_statements(text):
    """``(line, statement)`` with comments dropped and a statement's
    continuation lines (a trailing backslash, an open parenthesis) joined."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        first = i + 1
        line = lines[i].split("#", 1)[0].strip()
        while (line.endswith("\\") or line.count("(") > line.count(")")) and i + 1 < len(lines):
            i += 1
            line = line.rstrip("\\") + " " + lines[i].split("#", 1)[0].strip()
        i += 1
        if line:
            yield first, line


def _cython_imports(text):
    for lineno, stmt in _cython_statements(text):
        m = _FROM.match(stmt)
        if m:
            names = [n.strip().split()[0] for n in m.group(3).strip("() ").split(",") if n.strip()]
            yield lineno, len(m.group(1)), m.group(2), tuple(names)
            continue
        m = _IMPORT.match(stmt)
        if m:
            for item in m.group(1).split(","):
                if item.strip():
                    yield lineno, 0, item.strip().split()[0], ()


def violations(text, module, *, cython=False, is_package=False, filename="<string>"):
    """``["line: statement"]`` for each import of an underscored loader
    module in ``text``, the source of module ``module`` (a package's
    ``__init__`` where ``is_package``)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    imports = _cython_imports(text) if cython else _python_imports(text, filename)
    for lineno, level, name, names in imports:
        target = absolute(package, level, name)
        if private_loader_module(target, names) or any(
                private_loader_module(f"{target}.{n}") for n in names):
            shown = "." * level + (name or "")
            found.append(f"{lineno}: from {shown} import {', '.join(names)}" if names
                         else f"{lineno}: import {shown}")
    return found


def scan(root):
    """``{path: violations}`` of every .py/.pyi/.pyx/.pxd under ``root``'s
    instant_staging/ package outside its loader/; and the files read."""
    package_dir = os.path.join(root, PACKAGE)
    loader_dir = os.path.join(package_dir, "loader")
    bad, read = {}, []
    for dirpath, dirnames, files in os.walk(package_dir):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        if os.path.commonpath([dirpath, loader_dir]) == loader_dir:
            continue
        for f in sorted(files):
            if not f.endswith(PYTHON + CYTHON):
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, root)
            stem = os.path.splitext(rel)[0].replace(os.sep, ".")
            is_package = stem.endswith(".__init__")
            module = stem[: -len(".__init__")] if is_package else stem
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
            read.append(rel)
            found = violations(text, module, cython=f.endswith(CYTHON), is_package=is_package,
                               filename=path)
            if found:
                bad[rel] = found
    return bad, read


# -- the package -------------------------------------------------------------------------

def test_no_module_outside_the_loader_imports_an_underscored_loader_module():
    bad, read = scan(os.path.dirname(PACKAGE_DIR))
    # not a pass by finding nothing: the neighbours and a Cython file were read
    for rel in ("cli/load.py", "cli/main.py", "integrations/transformers/__init__.py",
                "integrations/transformers/_background.py", "integrations/vllm/_weights.py",
                "integrations/vllm/_loader.py", "_staging.pyx"):
        assert os.path.join(PACKAGE, *rel.split("/")) in read, read
    assert not any(r.startswith(os.path.join(PACKAGE, "loader") + os.sep) for r in read)
    assert not bad, "\n".join(f"{path}:{line}" for path, lines in bad.items() for line in lines)


# -- the checker -----------------------------------------------------------------------

PLANTED = {
    # (module, source): whether it reaches an underscored loader module
    ("instant_staging.cli.main", "from ..loader._header import SafetensorsError"): True,
    ("instant_staging.integrations.vllm._loader",
     "from ...loader._progress import resolve as _progress"): True,
    ("instant_staging.cli.load", "from instant_staging.loader._target import parse_device"): True,
    ("instant_staging.cli.load", "import instant_staging.loader._source as source"): True,
    ("instant_staging.cli.load", "from ..loader import Checkpoint, _progress"): True,
    ("instant_staging.cli.load", "from instant_staging.loader import _load"): True,
    ("instant_staging.runtime", "from .loader._load import iter_load"): True,
    ("instant_staging.cli.load", "def f():\n    from ..loader._shards import Shards\n"): True,
    ("instant_staging.cli.load",
     "import importlib\nimportlib.import_module('instant_staging.loader._remote')"): True,
    ("instant_staging.cli.load", "from ..loader import Checkpoint, resolve_progress"): False,
    ("instant_staging.cli.load", "from .. import loader\nfrom .._staging import StagingBuffer"): False,
    ("instant_staging.integrations.vllm._weights", "from ._options import Options"): False,
    ("instant_staging.cli.load", "from .report import error_result"): False,
    ("instant_staging.cli.load", "import os, re\nfrom ..loader import (\n    Progress,\n    format_si,\n)"):
        False,
}


def test_the_checker_on_strings():
    for (module, text), bad in PLANTED.items():
        assert bool(violations(text, module)) is bad, (module, text)
    # a package's own __init__: "." is the package itself
    assert violations("from .loader._load import x", "instant_staging", is_package=True)
    assert not violations("from ._load import x", "instant_staging.cli", is_package=True)
    assert violations("from ..loader._header import (\n    DTYPE_BITS,\n)\n",
                      "instant_staging.cli.main") == ["1: from ..loader._header import DTYPE_BITS"]


def test_the_checker_on_cython_strings():
    cases = {
        "from instant_staging.loader._pipeline cimport Pipeline": True,
        "from ..loader._pipeline import Pipeline  # a comment": True,
        "cimport instant_staging.loader._canonical as canonical": True,
        "from ..loader import (\n    Checkpoint,\n    _progress,\n)": True,
        "from ..loader import \\\n    _progress": True,
        "from instant_staging.loader import Checkpoint": False,
        "from .runtime._table cimport Runtime\nfrom libc.stdint cimport uint64_t": False,
        "# from ..loader._pipeline import Pipeline": False,
    }
    for text, bad in cases.items():
        assert bool(violations(text, "instant_staging.cli._fast", cython=True)) is bad, text


def test_the_checker_finds_a_planted_file(tmp_path):
    package = tmp_path / PACKAGE
    for sub, files in {"": {"__init__.py": "from . import loader\n"},
                       "loader": {"__init__.py": "from ._x import y\n", "_x.py": "y = 1\n"},
                       "cli": {"__init__.py": "", "ok.py": "from ..loader import y\n",
                               "bad.py": "import os\nfrom ..loader._x import y\n"},
                       "deep/er": {"mod.pyx": "from ...loader._x cimport y\n"}}.items():
        (package / sub).mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (package / sub / name).write_text(text)
    bad, read = scan(str(tmp_path))
    assert bad == {os.path.join(PACKAGE, "cli", "bad.py"): ["2: from ..loader._x import y"],
                   os.path.join(PACKAGE, "deep", "er", "mod.pyx"): ["1: from ...loader._x import y"]}
    assert os.path.join(PACKAGE, "loader", "__init__.py") not in read     # the loader's own
