"""pytest's hooks and fixtures for every test folder: GPU tests skip
cleanly on a machine without a device; the tests left out of the quick run
are marked ``slow``.  What the tests share besides is in ``support``
(tests/support/), which this file puts on sys.path for them (pytest
inserts a rootdir conftest's folder)."""

import os

import pytest

from support import TESTS, gpu_count

# ``pytest -m "not slow"`` (tox -e quick): the core (the buffer, runtimes,
# faults, the loader, local sources, probe and doctor) in under 3 minutes
# on 2 cores.  Slow, beside the tests marked so where they are: these
# modules (children started per test, randomized campaigns, race and
# interrupt loops, tools run over the tree: mypy, cython-lint, a Cython
# build) and these tests of otherwise quick modules (each several seconds).
SLOW_MODULES = {
    "core/test_fault_campaign.py", "core/test_threads.py", "core/test_interrupts.py", "core/test_soak.py",
    "core/test_typing.py", "core/test_source.py", "core/test_cython_caller.py",
    "loader/test_harden_loader.py", "loader/test_distributed.py", "loader/test_speed.py",
    "sources/test_remote_servers.py",
    "cli/test_cli_errors.py", "cli/test_cli_load.py", "cli/test_cli_load_sources.py",
    "integrations/test_transformers.py", "integrations/test_vllm.py", "examples/test_examples.py",
}
SLOW_TESTS = {
    "core/test_prefault.py::test_bench_alloc_runs_end_to_end",
    "core/test_prefault.py::test_bench_h2d_runs_end_to_end",
    "loader/test_blocks.py::test_random_layouts_through_views_equal_safetensors",
    "loader/test_blocks.py::test_random_faults_through_views_fail_or_equal_and_free_everything",
    "loader/test_blocks.py::test_fork_while_the_staging_buffer_is_made",
    "loader/test_blocks.py::test_ctrl_c_while_next_waits_for_the_buffer_keeps_the_making_thread_waited_for",
    "loader/test_blocks.py::test_interpreter_exit_while_the_staging_buffer_is_made",
}


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    for item in items:
        path = os.path.relpath(str(item.path), TESTS).replace(os.sep, "/")
        if path in SLOW_MODULES or f"{path}::{item.originalname}" in SLOW_TESTS:
            item.add_marker(slow)
    if gpu_count() > 0:
        return
    skip = pytest.mark.skip(reason="needs a GPU: the real runtime sees no device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gpu():
    """Skips unless a GPU is present; returns the device count."""
    if gpu_count() == 0:
        pytest.skip("needs a GPU")
    return gpu_count()
