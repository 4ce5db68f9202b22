"""instant_staging/envs.py: the one table of INSTANT_STAGING_* variables.

The docs' table is its output (docs/_hooks.py writes it when the site is
built: tests/core/test_docs.py), every INSTANT_STAGING_* name in the package
and the build is one of its rows, no module of the package reads one of
them from the environment itself (the build's _build_backend/backends.py
and setup.py do, at build time), each parser refuses a bad value with a
ValueError naming its variable, and unset or empty means None."""

import ast
import os
import re

import pytest

from instant_staging import envs

from support import ROOT, build_backends

PACKAGE = os.path.join(ROOT, "instant_staging")
NAME = re.compile(r"INSTANT_STAGING_[A-Z_]+")
SOURCES = (".py", ".pyx", ".pxd", ".pxi", ".pyi")
# The package's one reader of os.environ (the build's, setup.py and
# _build_backend/backends.py, are outside the package).
ENVIRON_READERS = {"envs.py"}


def source_files():
    """The package's sources, setup.py and the build backend's."""
    for top in (PACKAGE, os.path.join(ROOT, "_build_backend")):
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            yield from (os.path.join(dirpath, n) for n in sorted(filenames) if n.endswith(SOURCES))
    yield os.path.join(ROOT, "setup.py")


def test_table_rows_are_whole():
    names = [v.name for v in envs.VARIABLES]
    assert len(names) == len(set(names))
    for v in envs.VARIABLES:
        assert NAME.fullmatch(v.name), v.name
        assert v.type and v.default and v.applies, v.name
        assert v.parse is None or callable(v.parse), v.name


def test_every_name_in_the_code_is_in_the_table():
    table = {v.name for v in envs.VARIABLES}
    unlisted = {}
    for path in source_files():
        with open(path, encoding="utf-8") as f:
            for name in NAME.findall(f.read()):
                name = name.rstrip("_")
                if name not in table:
                    unlisted.setdefault(name, os.path.relpath(path, ROOT))
    assert unlisted == {}, "INSTANT_STAGING_* names missing from envs.VARIABLES"
    # ... and every row is named somewhere but the table itself.
    named = set()
    for path in source_files():
        if os.path.basename(path) != "envs.py":
            with open(path, encoding="utf-8") as f:
                named.update(NAME.findall(f.read()))
    assert table - named == set(), "rows of envs.VARIABLES nothing reads"


def test_build_time_names_are_the_tables():
    backends = build_backends()
    for name in (backends.BACKEND_VAR, backends.CUDA_VAR):
        assert envs.variable(name).parse is None, name
    with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as f:
        for name in NAME.findall(f.read()):
            assert envs.variable(name).parse is None, name


def _environ_reads(tree):
    """Constant names read through os.environ / os.getenv in a module's AST
    (module-level NAME = "..." constants resolved)."""
    constants = {node.targets[0].id: node.value.value for node in tree.body
                 if isinstance(node, ast.Assign) and len(node.targets) == 1
                 and isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.Constant)
                 and isinstance(node.value.value, str)}

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return constants.get(node.id)
        return None

    def is_environ(node):
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
            isinstance(node, ast.Name) and node.id == "environ")

    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and is_environ(node.value):
            yield value(node.slice)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            if (isinstance(func, ast.Attribute) and (
                    (func.attr in ("get", "pop", "setdefault") and is_environ(func.value))
                    or func.attr == "getenv")):
                yield value(node.args[0])


def test_run_time_readers_read_through_envs():
    bypass = []
    for path in source_files():
        base = os.path.basename(path)
        if base in ENVIRON_READERS or not path.startswith(PACKAGE + os.sep):
            continue
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if path.endswith(".py"):
            names = [n for n in _environ_reads(ast.parse(text)) if n and n.startswith("INSTANT_STAGING_")]
        else:      # Cython: no AST here, the lines that touch the environment
            names = [line for line in text.splitlines()
                     if re.search(r"environ|getenv", line) and "INSTANT_STAGING_" in line]
        bypass += [(os.path.relpath(path, ROOT), n) for n in names]
    assert bypass == [], "read around instant_staging/envs.py"


# -- parsing ---------------------------------------------------------------------------

BAD = {
    "INSTANT_STAGING_FAULTS": ["garbage", "register>lots=1", "regster=invalid_value"],
    "INSTANT_STAGING_HUGEPAGES": ["maybe", "2", "enable", "y"],
    "INSTANT_STAGING_PREFAULT_THREADS": ["-1", "abc", "1.5", "1025", "0x10", "4 threads"],
    "INSTANT_STAGING_CHUNK_SIZE": ["0", "lots", "-1MiB", "0.5"],
    "INSTANT_STAGING_IO_DEPTH": ["0", "2.5", "x", "-1"],
    "INSTANT_STAGING_THREADS": ["-3", "four", "0", "1e3"],
    "INSTANT_STAGING_KEEP_STAGING": ["2", "yes", "true", "off"],
    "INSTANT_STAGING_DIST_TIMEOUT": ["0", "-1", "soon", "nan", "inf", "1e400", "1e15", "604801"],
    "INSTANT_STAGING_CACHE_DIR": ["s3://bucket/cache"],
    "INSTANT_STAGING_CACHE_MAX_BYTES": ["0", "lots", "-1GiB"],
    "INSTANT_STAGING_MAX_BYTES_PER_SECOND": ["0", "fast", "-1MiB"],
    "INSTANT_STAGING_OFFLINE": ["maybe", "2", "offline"],
}

GOOD = {
    "INSTANT_STAGING_HUGEPAGES": [("1", True), (" YES ", True), ("off", False), ("0", False)],
    "INSTANT_STAGING_PREFAULT_THREADS": [("0", 0), (" 3 ", 3), ("1024", 1024)],
    "INSTANT_STAGING_CHUNK_SIZE": [("8MiB", 8 << 20), ("4096", 4096), ("1.5KiB", 1536)],
    "INSTANT_STAGING_IO_DEPTH": [("1", 1), ("64", 64)],
    "INSTANT_STAGING_THREADS": [("3", 3)],
    "INSTANT_STAGING_KEEP_STAGING": [("1", True), ("0", False)],
    "INSTANT_STAGING_DIST_TIMEOUT": [("2.5", 2.5), ("600", 600.0), ("604800", 604800.0)],
    "INSTANT_STAGING_CACHE_DIR": [("/nvme/cache", "/nvme/cache"), ("rel/dir", "rel/dir"),
                                  ("~/c", os.path.expanduser("~/c"))],
    "INSTANT_STAGING_CACHE_MAX_BYTES": [("100GiB", 100 << 30)],
    "INSTANT_STAGING_MAX_BYTES_PER_SECOND": [("200MiB", 200 << 20), ("1000", 1000)],
    "INSTANT_STAGING_OFFLINE": [("1", True), ("TRUE", True), ("0", False), ("no", False)],
}

RUN_TIME = [v.name for v in envs.VARIABLES if v.parse is not None]


def test_every_parser_is_tried():
    assert set(BAD) == set(RUN_TIME)
    assert set(GOOD) | {"INSTANT_STAGING_FAULTS"} == set(RUN_TIME)


@pytest.mark.parametrize("name, value", [(n, v) for n, values in BAD.items() for v in values])
def test_parser_rejects_a_bad_value_naming_the_variable(name, value, monkeypatch):
    with pytest.raises(ValueError) as info:
        envs.variable(name).parse(value)
    assert name in str(info.value)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        envs.get(name)
    with pytest.raises(ValueError, match=name):
        envs.get(name, {name: value})


@pytest.mark.parametrize("name, text, value", [(n, t, v) for n, pairs in GOOD.items() for t, v in pairs])
def test_parser_accepts_a_good_value(name, text, value, monkeypatch):
    monkeypatch.setenv(name, text)
    got = envs.get(name)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("text, reason", [
    ("1TiB", r"not a size: '1TiB' \(use bytes or a KiB/MiB/GiB suffix\)"),
    ("8 MB", r"not a size"),
    ("0.5", r"not a whole, non-negative number of bytes"),
    ("0", r"must be a size of at least 1 byte"),
])
def test_a_bad_size_says_why(text, reason, monkeypatch):
    monkeypatch.setenv("INSTANT_STAGING_CHUNK_SIZE", text)
    with pytest.raises(ValueError, match=r"^INSTANT_STAGING_CHUNK_SIZE=.*: " + reason):
        envs.get("INSTANT_STAGING_CHUNK_SIZE")


@pytest.mark.parametrize("text", ["inf", "1e400", "1e15", "604801"])
def test_a_dist_timeout_beyond_a_week_is_refused_by_name(text, monkeypatch):
    # Accepted, these overflowed inside torch at the next group load (a
    # bare OverflowError).
    monkeypatch.setenv("INSTANT_STAGING_DIST_TIMEOUT", text)
    with pytest.raises(ValueError, match=r"^INSTANT_STAGING_DIST_TIMEOUT must be > 0 and at most 604800"):
        envs.get("INSTANT_STAGING_DIST_TIMEOUT")


def _imports(path):
    """The instant_staging modules ``path`` imports, anywhere in it
    (function-level imports too)."""
    import importlib.util
    package = "instant_staging" + "".join(
        "." + p for p in os.path.relpath(os.path.dirname(path), os.path.join(ROOT, "instant_staging")
                                         ).split(os.sep) if p != ".")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("instant_staging")}
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                if node.level else node.module
            if base and base.startswith("instant_staging"):
                found.add(base)
                found |= {f"{base}.{a.name}" for a in node.names}
    return found


def test_envs_imports_nothing_that_imports_it():
    # envs is imported by everything at import time: what it imports (the
    # fault grammar, when a spec is parsed) must not import it back.
    mine = _imports(os.path.join(ROOT, "instant_staging", "envs.py"))
    assert "instant_staging.faults" in mine
    for name in sorted(m for m in mine if m != "instant_staging.envs"):
        path = os.path.join(ROOT, *name.split(".")) + ".py"
        if os.path.isfile(path):
            assert "instant_staging.envs" not in _imports(path), f"{name} imports envs: a cycle"


def test_fault_spec_parses_to_a_plan(monkeypatch):
    from instant_staging.faults import FaultPlan
    monkeypatch.setenv("INSTANT_STAGING_FAULTS", " read#2=EIO; register>1MiB=invalid_value ")
    plan = envs.get("INSTANT_STAGING_FAULTS")
    assert isinstance(plan, FaultPlan) and str(plan) == "read#2=EIO;register>1MiB=invalid_value"
    assert envs.raw("INSTANT_STAGING_FAULTS") == "read#2=EIO; register>1MiB=invalid_value"


@pytest.mark.parametrize("name", [v.name for v in envs.VARIABLES])
@pytest.mark.parametrize("text", [None, "", "  ", "\t\n"])
def test_unset_and_empty_mean_none(name, text, monkeypatch):
    if text is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, text)
    assert envs.raw(name) is None and envs.get(name) is None
    environ = {} if text is None else {name: text}
    assert envs.raw(name, environ) is None and envs.get(name, environ) is None
    assert envs.parse_text(name, text) is None


def test_build_time_variables_read_as_text(monkeypatch):
    monkeypatch.setenv("INSTANT_STAGING_BACKEND", " rocm ")
    assert envs.get("INSTANT_STAGING_BACKEND") == envs.raw("INSTANT_STAGING_BACKEND") == "rocm"


def test_a_name_not_in_the_table_is_read_nowhere(monkeypatch):
    monkeypatch.setenv("INSTANT_STAGING_NOT_A_KNOB", "1")
    for read in (envs.get, envs.raw, envs.variable):
        with pytest.raises(KeyError, match="INSTANT_STAGING_NOT_A_KNOB"):
            read("INSTANT_STAGING_NOT_A_KNOB")
    with pytest.raises(KeyError):
        envs.parse_text("INSTANT_STAGING_NOT_A_KNOB", "1")


def test_values_are_read_when_asked(monkeypatch):
    monkeypatch.setenv("INSTANT_STAGING_THREADS", "2")
    assert envs.get("INSTANT_STAGING_THREADS") == 2
    monkeypatch.setenv("INSTANT_STAGING_THREADS", "5")
    assert envs.get("INSTANT_STAGING_THREADS") == 5


def test_variables_are_frozen():
    import dataclasses
    with pytest.raises(dataclasses.FrozenInstanceError):
        envs.VARIABLES[0].default = "x"
