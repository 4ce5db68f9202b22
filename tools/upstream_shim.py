"""pytest plugin: safetensors' own Python tests with instant_staging's
reader standing in for theirs (``tools/upstream_safetensors.py`` loads it
with ``-p upstream_shim``, before any test module imports safetensors).

Replaced, for every caller that looks them up after this plugin loads:

- ``safetensors.safe_open`` (and ``safetensors.torch``'s): ours for the
  torch frameworks ("pt", "torch", "pytorch"); theirs for numpy, flax, tf,
  paddle, mlx, which ours does not serve;
- ``safetensors.torch.load_file`` (which ``load_model`` calls too) and
  ``safetensors.torch.load``: ours.

The writers (``save``, ``save_file``, ``serialize``) stay theirs: the tests
write with safetensors and read with us.  Each test's calls into our reader
are counted, and the summary at the end sorts the tests into: passed through
our reader; ran without calling it (writer-only tests, which say nothing
about us); not applicable (skipped here, each with its reason); failed.
"""

import fnmatch
import os

import pytest
import safetensors
import safetensors.torch

from instant_staging import loader

TORCH_FRAMEWORKS = ("pt", "torch", "pytorch")

# Tests that cannot exercise instant_staging's reader, with the reason; a
# pattern is matched against the test's node id.
# Whole modules are not even collected (they import jax, h5py, paddle, mlx).
NOT_APPLICABLE_MODULES = {
    "test_flax_comparison.py": "flax (jax) arrays: ours returns torch tensors only",
    "test_mlx_comparison.py": "mlx arrays: ours returns torch tensors only",
    "test_paddle_comparison.py": "paddle tensors: ours returns torch tensors only",
    "test_tf_comparison.py": "tensorflow tensors: ours returns torch tensors only",
    "test_handle.py": "_safe_open_handle reads a Python file object (and fsspec) into numpy; "
                      "ours reads paths",
    "test_threadable.py": "serialize_file (the writer) releasing the GIL, read back with "
                          "safetensors.numpy",
}
NOT_APPLICABLE = {
    "tests/test_multithreaded.py::test_multithreaded_roundtripping_numpy": "safetensors.numpy",
    "tests/test_simple.py::TestCase::test_serialization": "safetensors.numpy's writer",
    "tests/test_simple.py::TestCase::test_deserialization": "safetensors.numpy.load",
    "tests/test_simple.py::TestCase::test_deserialization_metadata": "safe_open(framework='np')",
    "tests/test_simple.py::TestCase::test_serialization_*": "safetensors.numpy's writer",
    "tests/test_simple.py::ReadmeTestCase::test_numpy_*": "safetensors.numpy",
    "tests/test_simple.py::ReadmeTestCase::test_exception": "TensorSpec and serialize (the writer)",
    "tests/test_simple.py::test_safetensor_error_module_is_importable": "safetensors' own module",
    "tests/test_pread_backend.py::PreadBackendTests::test_numpy_framework": "framework='numpy'",
    "tests/test_pt_comparison.py::TorchTestCase::test_mps*": "MPS: ours loads to the CPU and "
                                                             "CUDA/ROCm devices only",
    "tests/test_pt_comparison.py::TorchTestCase::test_npu": "NPU: ours loads to the CPU and "
                                                            "CUDA/ROCm devices only",
    "tests/test_pt_comparison.py::TorchTestCase::test_hpu": "HPU: ours loads to the CPU and "
                                                            "CUDA/ROCm devices only",
    # safetensors 0.9's prefetch
    "tests/test_pread_backend.py::PreadBackendTests::test_prefetch_works_from_any_backend":
        "expects prefetch to the CPU refused: ours loads to the CPU too",
    "tests/test_pread_backend.py::PreadBackendTests::test_prefetch_requires_cuda":
        "expects prefetch to the CPU refused: ours loads to the CPU too",
    "tests/test_pread_backend.py::PreadBackendTests::test_prefetch_device_overrides_the_handle":
        "expects prefetch to the CPU refused: ours loads to the CPU too",
    "tests/test_pread_backend.py::PreadBackendTests::test_prefetch_requires_pt":
        "framework='numpy': ours serves torch only",
    "tests/test_pread_backend.py::PreadBackendTests::test_prefetch_loader_is_exported":
        "safetensors' own export (ours: instant_staging.loader.PrefetchLoader)",
}
# Not applicable on a host whose torch sees no GPU: they open a cuda:0
# handle there, which ours refuses when it opens (an unusable device is
# the first error, docs/design.md) and safetensors at its first read.  Our
# own tests check the same plan errors on a CPU handle
# (tests/loader/test_checkpoint.py); on a GPU host these run.
NOT_APPLICABLE_WITHOUT_GPU = {
    "tests/test_pread_backend.py::PreadBackendTests::test_prefetch_plan_rejects_bad_entries":
        "opens a cuda:0 handle on a host without a GPU: ours refuses that device at open",
    "tests/test_pread_backend.py::PreadBackendTests::test_prefetch_rejects_unsupported_dtype":
        "opens a cuda:0 handle on a host without a GPU: ours refuses that device at open",
}

_calls = [0]
_theirs_safe_open = safetensors.safe_open


def safe_open(filename, framework, device="cpu", *, backend="mmap"):
    if isinstance(framework, str) and framework.lower() in TORCH_FRAMEWORKS:
        _calls[0] += 1
        return loader.safe_open(filename, framework, device, backend=backend)
    return _theirs_safe_open(filename, framework=framework, device=device, backend=backend)


def load_file(filename, device="cpu", *, backend="mmap"):
    _calls[0] += 1
    return loader.load_file(filename, device, backend=backend)


def load(data):
    _calls[0] += 1
    return loader.load(data)


safetensors.safe_open = safe_open  # type: ignore[misc,assignment]
safetensors.torch.safe_open = safe_open
safetensors.torch.load_file = load_file
safetensors.torch.load = load

_results: dict = {}


def _reason(nodeid):
    import torch
    table = dict(NOT_APPLICABLE)
    if not torch.cuda.is_available():
        table.update(NOT_APPLICABLE_WITHOUT_GPU)
    for pattern, reason in table.items():
        if fnmatch.fnmatchcase(nodeid, pattern):
            return reason
    return None


def pytest_ignore_collect(collection_path, config):
    reason = NOT_APPLICABLE_MODULES.get(collection_path.name)
    if reason is None:
        return None
    _results[f"tests/{collection_path.name}"] = (f"skipped: not applicable (module not "
                                                 f"collected): {reason}", 0)
    return True


def pytest_collection_modifyitems(config, items):
    for item in items:
        reason = _reason(item.nodeid)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"not applicable: {reason}"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _calls[0] = 0
    yield
    outcome, _ = _results.get(item.nodeid, ("?", 0))
    _results[item.nodeid] = (outcome, _calls[0])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    previous = _results.get(item.nodeid, ("passed", 0))[0]
    if report.failed:
        _results[item.nodeid] = ("failed", _calls[0])
    elif report.skipped and report.when in ("setup", "call"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _results[item.nodeid] = (f"skipped: {reason}", _calls[0])
    elif report.when == "call" and previous != "failed":
        _results[item.nodeid] = ("passed", _calls[0])


def pytest_terminal_summary(terminalreporter):
    groups = {"passed through instant_staging's reader": [],
              "ran without calling it (safetensors' writer only)": [],
              "not applicable / skipped": [], "FAILED": []}
    for nodeid, (outcome, calls) in sorted(_results.items()):
        if outcome == "failed":
            groups["FAILED"].append(f"{nodeid} ({calls} call(s) of ours)")
        elif outcome.startswith("skipped"):
            groups["not applicable / skipped"].append(f"{nodeid}: {outcome[len('skipped: '):]}")
        elif calls:
            groups["passed through instant_staging's reader"].append(f"{nodeid} ({calls})")
        else:
            groups["ran without calling it (safetensors' writer only)"].append(nodeid)
    write = terminalreporter.write_line
    write("")
    tests = os.environ.get("UPSTREAM_TESTS_VERSION", safetensors.__version__)
    writer = "" if tests == safetensors.__version__ else f" (safetensors {safetensors.__version__} writing)"
    write(f"== safetensors {tests}'s tests{writer} with instant_staging's load_file, "
          "load and safe_open ==")
    for title, lines in groups.items():
        write(f"-- {title}: {len(lines)}")
        for line in lines:
            write(f"   {line}")
