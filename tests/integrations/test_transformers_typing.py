"""README's claim, with the real torch and transformers: the model
``from_pretrained`` returns has a ``generate()`` that ``mypy --strict``
accepts (tests/core/test_typing.py checks the same against stand-ins in
seconds; this one follows torch and transformers, which takes mypy about
half a minute of CPU).
"""

import os
import re
import subprocess
import sys

import pytest

from support import PACKAGE_PARENT, ROOT

README = os.path.join(ROOT, "README.md")
GENERATE = "out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4)\n"


def test_mypy_strict_accepts_generate_on_readmes_model(tmp_path):
    pytest.importorskip("mypy")
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    version = tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
    if version < (5, 25):
        # The claim is checked with transformers 5.25 (the cuda env's); 5.22
        # (vLLM 0.34's pin) types generate()'s self as its own protocol,
        # which mypy then holds this model type against, and refuses.
        pytest.skip(f"typed generate() checked with transformers 5.25+, not {transformers.__version__}")
    if not os.path.isfile(README):
        pytest.skip("no README.md beside the tests")
    with open(README) as f:
        blocks = [b for b in re.findall(r"^```python\n(.*?)^```", f.read(), re.S | re.M)
                  if "model = from_pretrained(" in b]
    assert blocks, "README has no python block that makes a model with from_pretrained"
    example = tmp_path / "readme_generate.py"
    example.write_text(blocks[0] + GENERATE)
    config = tmp_path / "mypy.ini"     # this package as an installed one: its own errors not the user's
    config.write_text("[mypy]\n[mypy-instant_staging.*]\nfollow_imports = silent\n")
    env = dict(os.environ)
    env.pop("MYPYPATH", None)
    if os.path.basename(PACKAGE_PARENT) not in ("site-packages", "dist-packages"):
        env["MYPYPATH"] = PACKAGE_PARENT     # the in-place build
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--config-file", str(config), "--cache-dir",
         str(tmp_path / "cache"), "--python-executable", sys.executable, "--no-error-summary",
         "--show-error-codes", str(example)],
        capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=600, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
