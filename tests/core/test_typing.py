"""Types: the compiled modules' signatures and stubs.

``inspect.signature`` reads StagingBuffer's real constructor (keyword-only
after ``size``, as DESIGN.md says), and mypy accepts README's examples
(tests/core/typing_examples.py) against the stubs (py.typed, *.pyi) of the
package under test, and rejects a call that the signature forbids.
"""

import inspect
import os
import subprocess
import sys
import textwrap

import pytest

import instant_staging as ist
from instant_staging.testing import SimulatedRuntime

from support import ROOT

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE_DIR = os.path.dirname(os.path.abspath(ist.__file__))
PACKAGE_PARENT = os.path.dirname(PACKAGE_DIR)

KEYWORD_ONLY = ["alignment", "segment_size", "copy_unit", "register_flags", "alloc_flags",
                "prefault_threads", "hugepages", "allow_pageable", "runtime"]


def test_staging_buffer_signature_is_keyword_only_after_size():
    sig = inspect.signature(ist.StagingBuffer)
    params = list(sig.parameters.values())
    assert [p.name for p in params] == ["size"] + KEYWORD_ONLY
    assert params[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[1:])
    assert sig.parameters["segment_size"].default == ist.defaults.SEGMENT_SIZE
    assert sig.parameters["allow_pageable"].default is False
    # help() shows the same: alignment never as a positional parameter.
    import pydoc
    text = pydoc.render_doc(ist.StagingBuffer, renderer=pydoc.plaintext)
    assert "StagingBuffer(size, *, alignment=None" in text


def test_positional_alignment_is_refused():
    with pytest.raises(TypeError):
        ist.StagingBuffer(4096, 4096, runtime=SimulatedRuntime())


def test_simulated_runtime_signature():
    sig = inspect.signature(SimulatedRuntime)
    assert list(sig.parameters) == ["faults", "device_count", "log_limit", "backend"]
    assert sig.parameters["device_count"].kind is inspect.Parameter.KEYWORD_ONLY


def test_every_compiled_module_has_a_stub():
    compiled = set()
    for dirpath, _, files in os.walk(PACKAGE_DIR):
        for f in files:
            if f.endswith(".so"):
                compiled.add(os.path.join(dirpath, f.split(".")[0]))
    assert compiled, "no compiled module found"
    missing = [m for m in compiled if not os.path.isfile(m + ".pyi")]
    assert not missing, f"no .pyi stub for {missing}"
    assert os.path.isfile(os.path.join(PACKAGE_DIR, "py.typed"))


def _stub_names(path):
    import ast
    with open(path) as f:
        tree = ast.parse(f.read())
    return {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}


@pytest.mark.parametrize("module", ["_staging", "runtime._table", "runtime._faults", "runtime._simulated"])
def test_stub_names_exist_in_the_module(module):
    import importlib
    mod = importlib.import_module(f"instant_staging.{module}")
    names = _stub_names(os.path.join(PACKAGE_DIR, *module.split(".")) + ".pyi")
    assert names and all(hasattr(mod, n) for n in names), names


def _compiled_modules():
    """Dotted names of the compiled modules this build holds (_hip only on ROCm)."""
    out = []
    for dirpath, _, files in os.walk(PACKAGE_DIR):
        for f in files:
            if f.endswith(".so"):
                rel = os.path.relpath(os.path.join(dirpath, f.split(".")[0]), PACKAGE_PARENT)
                out.append(rel.replace(os.sep, "."))
    return sorted(out)


# What the stubs may differ in from the compiled modules, and why (stubtest's
# allowlist: one regular expression a line).
STUBTEST_ALLOWLIST = """\
# Cython's own pickling helpers and doctest table, on every compiled module.
.*\\.__reduce_cython__
.*\\.__setstate_cython__
.*\\.__test__
# The C-level API a module exports to Cython callers (cimport).
.*\\.__pyx_capi__
# The buffer protocol: a Cython type fills the C slots; Python 3.12+ also
# shows them as __buffer__/__release_buffer__, 3.11 does not.  The stub
# declares them so that mypy accepts memoryview(buf).
instant_staging\\._staging\\.StagingBuffer\\.__buffer__
instant_staging\\._staging\\.StagingBuffer\\.__release_buffer__
"""


def test_stubs_match_the_compiled_modules(tmp_path):
    """mypy's stubtest compares every stub with its compiled module: every
    public name of the module is in the stub and the other way round, and
    each signature Cython exposes matches (STUBTEST_ALLOWLIST says what may
    differ, and why)."""
    pytest.importorskip("mypy")
    allowlist = tmp_path / "stubtest_allowlist.txt"
    allowlist.write_text(STUBTEST_ALLOWLIST)
    modules = _compiled_modules()
    assert "instant_staging._staging" in modules
    config = tmp_path / "stubtest.ini"
    # The Python modules' own typing is not what this checks (they are not
    # typed strictly); the stubs' is.
    config.write_text(textwrap.dedent(f"""\
        [mypy]
        ignore_missing_imports = True
        [mypy-torch.*]
        follow_imports = skip
        [mypy-instant_staging.*]
        ignore_errors = True
        [mypy-{",".join(modules)}]
        ignore_errors = False
        """))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
    env.pop("MYPYPATH", None)
    if os.path.basename(PACKAGE_PARENT) not in ("site-packages", "dist-packages"):
        env["MYPYPATH"] = PACKAGE_PARENT
    command = [sys.executable, "-m", "mypy.stubtest", "--concise", "--ignore-unused-allowlist",
               "--allowlist", str(allowlist),
               "--mypy-config-file", str(config)]
    help_text = subprocess.run([sys.executable, "-m", "mypy.stubtest", "--help"],
                               capture_output=True, text=True, env=env, check=False).stdout
    if "--ignore-disjoint-bases" in help_text:
        # PEP 800 markers (mypy 1.18+): no user of these stubs subclasses them.
        command.append("--ignore-disjoint-bases")
    result = subprocess.run(command + modules, capture_output=True, text=True, env=env,
                            cwd=str(tmp_path), timeout=600, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def _mypy(path, tmp_path, *flags):
    pytest.importorskip("mypy")
    config = tmp_path / "mypy.ini"
    # torch, transformers and safetensors are skipped: the examples are
    # about this package's types, and analysing torch takes minutes,
    # transformers half of one (test_from_pretrained_is_typed_as_transformers_model
    # checks what from_pretrained returns).
    config.write_text(textwrap.dedent("""\
        [mypy]
        follow_imports = silent
        ignore_missing_imports = True
        [mypy-torch.*]
        follow_imports = skip
        [mypy-transformers.*]
        follow_imports = skip
        [mypy-safetensors.*]
        follow_imports = skip
        [mypy-numpy.*]
        follow_imports = skip
        """))
    env = dict(os.environ)
    env.pop("MYPYPATH", None)
    if os.path.basename(PACKAGE_PARENT) not in ("site-packages", "dist-packages"):
        env["MYPYPATH"] = PACKAGE_PARENT     # the in-place build (mypy refuses site-packages here)
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(config), "--cache-dir",
         str(tmp_path / "cache"), "--python-executable", sys.executable, "--no-error-summary",
         "--show-error-codes", *flags, *([str(p) for p in path] if isinstance(path, list)
                                         else [str(path)])],
        capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=600, check=False)


def test_mypy_accepts_readme_examples(tmp_path):
    result = _mypy(os.path.join(HERE, "typing_examples.py"), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


README = os.path.join(ROOT, "README.md")


def test_mypy_strict_accepts_readme_python_blocks(tmp_path):
    """Every ```python block of README, as a user pastes it, type-checks
    under ``mypy --strict`` against the package's stubs and annotations (the
    package's own modules are followed silently, as an installed one is)."""
    if not os.path.isfile(README):
        pytest.skip("no README.md beside the tests")
    import re
    with open(README) as f:
        blocks = re.findall(r"^```python\n(.*?)^```", f.read(), re.S | re.M)
    assert len(blocks) >= 3
    paths = []
    for i, block in enumerate(blocks):
        path = tmp_path / f"readme_block_{i}.py"
        path.write_text(block)
        paths.append(path)
    result = _mypy(paths, tmp_path, "--strict")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_rejects_what_the_signature_forbids(tmp_path):
    bad = tmp_path / "bad_example.py"
    bad.write_text(textwrap.dedent("""\
        import instant_staging as ist
        ist.StagingBuffer(4096, 4096)
        ist.StagingBuffer("4096")
        x: str = ist.StagingBuffer(4096).kind
        """))
    result = _mypy(bad, tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert [e.split(":")[1] for e in errors] == ["2", "3", "4"], result.stdout


def test_faulty_runtime_signature():
    from instant_staging.runtime._faults import FaultyRuntime
    assert list(inspect.signature(FaultyRuntime).parameters) == ["inner", "plan"]


# Stand-ins for torch and transformers, so that what from_pretrained is
# typed as is checked in seconds (mypy over the real ones takes a minute):
# what a module does not declare is Any, as for a module followed silently.
FAKE_STUBS = {
    "torch/__init__.pyi": """\
        from typing import Any
        from . import nn as nn
        class dtype: ...
        class Tensor: ...
        bfloat16: dtype
        def tensor(data: Any) -> Tensor: ...
        def __getattr__(name: str) -> Any: ...
        """,
    "torch/nn/__init__.pyi": """\
        from typing import Any
        from torch import Tensor
        class Module:
            training: bool
            def __getattr__(self, name: str) -> Tensor | Module: ...
        def __getattr__(name: str) -> Any: ...
        """,
    # as transformers 4.50 and newer: generate() is GenerationMixin's, not
    # PreTrainedModel's (where mypy finds Module.__getattr__ instead)
    "transformers/__init__.pyi": """\
        from typing import Any
        from torch.nn import Module
        class PreTrainedModel(Module): ...
        class GenerationMixin:
            def generate(self, inputs: Any = ..., **kwargs: Any) -> Any: ...
        def __getattr__(name: str) -> Any: ...
        """,
}


def test_from_pretrained_is_typed_as_transformers_model(tmp_path):
    """``model.generate(...)`` type-checks under ``mypy --strict``: the model is
    transformers' PreTrainedModel with GenerationMixin's generate (as
    transformers types AutoModelForCausalLM.from_pretrained), and with
    ``output_loading_info=True`` a (model, info) pair."""
    pytest.importorskip("mypy")
    fakes = tmp_path / "fakes"
    for name, text in FAKE_STUBS.items():
        (fakes / name).parent.mkdir(parents=True, exist_ok=True)
        (fakes / name).write_text(textwrap.dedent(text))
    example = tmp_path / "generate_example.py"
    example.write_text(textwrap.dedent("""\
        import torch
        from instant_staging.integrations.transformers import from_pretrained

        model = from_pretrained("Llama-3-8B/", device="cuda:0", dtype=torch.bfloat16)
        out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4)
        pair = from_pretrained("Llama-3-8B/", output_loading_info=True)
        reveal_type(model)
        reveal_type(pair)
        """))
    config = tmp_path / "mypy.ini"     # this package followed, nothing else (but stubs)
    config.write_text("[mypy]\nfollow_imports = skip\n[mypy-instant_staging.*]\nfollow_imports = silent\n")
    env = dict(os.environ)
    parts = [str(fakes)]
    if os.path.basename(PACKAGE_PARENT) not in ("site-packages", "dist-packages"):
        parts.append(PACKAGE_PARENT)         # the in-place build
    env["MYPYPATH"] = os.pathsep.join(parts)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--config-file", str(config), "--cache-dir",
         str(tmp_path / "cache"), "--python-executable", sys.executable, "--no-error-summary",
         "--show-error-codes", str(example)],
        capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=600, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    revealed = [line.split("Revealed type is ")[1].replace("builtins.", "")   # (as older mypy names them)
                for line in result.stdout.splitlines() if "Revealed type is" in line]
    model = '"instant_staging.integrations.transformers.PreTrainedModelWithGenerate"'
    assert revealed == [model, f'"tuple[{model[1:-1]}, dict[str, Any]]"'], result.stdout


def test_an_editable_install_is_a_path_mypy_follows(tmp_path, monkeypatch):
    """README's ``pip install -e .``: setuptools writes a plain path into a
    .pth file (not an import hook, which mypy cannot follow), and mypy,
    given an interpreter with that file, finds the package and its stubs.
    The strategy is setuptools' own choice for this pyproject.toml, made
    without building anything."""
    pytest.importorskip("mypy")
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} cannot read this pyproject.toml "
                    "(the build requires 77+)")
    import setuptools.command.editable_wheel as editable
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution
    if not os.path.isfile(os.path.join(ROOT, "pyproject.toml")):
        pytest.skip("no pyproject.toml beside the tests")
    if not hasattr(editable.editable_wheel, "_select_strategy"):
        pytest.skip("this setuptools chooses its editable strategy elsewhere")
    monkeypatch.chdir(ROOT)
    dist = apply_configuration(Distribution(), "pyproject.toml")
    command = editable.editable_wheel(dist)
    command.ensure_finalized()
    strategy = command._select_strategy("instant_staging", "py3-none-any", "build/lib")
    entries = getattr(strategy, "path_entries", None)
    assert entries, f"setuptools installs {type(strategy).__name__}: an import hook mypy cannot follow"
    assert [os.path.realpath(p) for p in entries] == [os.path.realpath(ROOT)]
    # An interpreter whose site-packages holds only that .pth file.
    import venv
    venv.create(tmp_path / "env", with_pip=False, symlinks=True)
    python = tmp_path / "env" / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "__editable__.instant_staging.pth"), "w") as f:
        f.write("".join(os.path.realpath(p) + "\n" for p in entries))   # as setuptools resolves them
    example = tmp_path / "editable_example.py"
    example.write_text(textwrap.dedent("""\
        import instant_staging as ist

        buf = ist.StagingBuffer(4096)
        kind: ist.Kind = buf.kind
        reveal_type(buf.spans())
        """))
    env = dict(os.environ)
    env.pop("MYPYPATH", None)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache"),
         "--python-executable", str(python), "--no-error-summary", "--show-error-codes", str(example)],
        capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=600, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert 'Revealed type is "list[tuple[int, int]]"' in result.stdout.replace("builtins.", ""), \
        result.stdout
