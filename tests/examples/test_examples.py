"""examples/: each example that can run on the CPU runs here, as a user
would run it (``python examples/NAME.py``, the installed package), so that
none of them rots; the vLLM one, which needs a vLLM that runs models (a GPU
or a CPU build), is compiled only."""

import os
import subprocess
import sys

import pytest

from support import ROOT, child_env

pytest.importorskip("torch")
pytest.importorskip("safetensors", reason="the examples write their checkpoint with safetensors")

EXAMPLES = os.path.join(ROOT, "examples")


def run(tmp_path, name, *args):
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *args], cwd=tmp_path,
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_every_example_is_tested_here():
    names = sorted(n for n in os.listdir(EXAMPLES) if n.endswith(".py") and not n.startswith("_"))
    assert names == ["group_load.py", "load_file.py", "safe_open.py", "transformers_from_pretrained.py",
                     "vllm_load_format.py"]
    for name in names:
        with open(os.path.join(EXAMPLES, name)) as f:
            compile(f.read(), name, "exec")          # a syntax error fails here, whatever imports


def test_load_file(tmp_path):
    out = run(tmp_path, "load_file.py")
    assert "12 tensors on cpu" in out
    assert "['model.layers.0.o_proj.weight', 'model.layers.0.q_proj.weight'] {torch.float32}" in out
    assert "LoadReport(tensors=12, bytes=393216" in out


def test_safe_open(tmp_path):
    out = run(tmp_path, "safe_open.py")
    assert "6 tensors; metadata {'format': 'pt'}" in out
    assert "model.layers.0.o_proj.weight (128, 128) -> (64, 128) torch.bfloat16" in out
    assert "prefetched (64, 128) ['model.layers.0.q_proj.weight']" in out


def test_group_load_over_gloo(tmp_path):
    out = run(tmp_path, "group_load.py", "--world", "2")
    for rank in (0, 1):
        assert f"rank {rank} of 2: 12 tensors, 393216 bytes on cpu" in out


def test_transformers_from_pretrained(tmp_path):
    pytest.importorskip("transformers")
    out = run(tmp_path, "transformers_from_pretrained.py")
    assert "LlamaForCausalLM on cpu equal to transformers' own: True" in out
    assert "greedy tokens: [1, 5, 7, 9," in out
