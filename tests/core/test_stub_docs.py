"""Each ``.pyi`` stub's docstrings are its compiled module's: the site
renders the stub, ``help()`` the ``.pyx`` (issue 52, 5).  A stub written by
hand beside its ``.pyx`` drifted: its module docstrings said only "Types
of the compiled module"."""

import ast
import importlib
import inspect
import os
import re

import pytest

import instant_staging

PACKAGE_DIR = os.path.dirname(os.path.abspath(instant_staging.__file__))
STUBS = sorted(os.path.relpath(os.path.join(d, f), os.path.dirname(PACKAGE_DIR))
               for d, _, files in os.walk(PACKAGE_DIR) for f in files if f.endswith(".pyi"))
_PYX_DOCSTRING = re.compile(r'\A(?:#[^\n]*\n|\s)*"""(.*?)"""', re.S)


def _docstring(node):
    body = node.body
    if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        return body[0].value.value
    return None


def _stub_docstrings(tree, module):
    """``(name, stub's docstring, compiled object or None)`` of each docstring."""
    yield "<module>", _docstring(tree), module

    def walk(body, obj, prefix):
        for node in body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                if obj is None:
                    target = None
                elif isinstance(obj, type):
                    target = obj.__dict__.get(node.name)
                else:
                    target = getattr(obj, node.name, None)
                if _docstring(node) is not None:
                    yield prefix + node.name, _docstring(node), target
                if isinstance(node, ast.ClassDef):
                    yield from walk(node.body, target, prefix + node.name + ".")
    yield from walk(tree.body, module, "")


@pytest.mark.parametrize("stub", STUBS)
def test_each_stub_docstring_is_the_compiled_objects(stub):
    path = os.path.join(os.path.dirname(PACKAGE_DIR), stub)
    with open(path) as f:
        tree = ast.parse(f.read())
    with open(path[:-4] + ".pyx") as f:
        pyx = _PYX_DOCSTRING.match(f.read())
    try:
        module = importlib.import_module(stub[:-4].replace(os.sep, "."))
    except ImportError:
        module = None       # (another backend's: its module docstring from the .pyx)
    checked = 0
    for name, doc, obj in _stub_docstrings(tree, module):
        if name == "<module>":
            want = module.__doc__ if module is not None else pyx and pyx.group(1)
        else:
            want = None if obj is None else obj.__doc__
        if doc is None or want is None:
            assert module is None or doc is None, f"{stub}: {name} is not in the compiled module"
            continue
        assert inspect.cleandoc(doc) == inspect.cleandoc(want), f"{stub}: {name}'s docstring"
        checked += 1
    assert checked, f"{stub} has no docstring to check"
