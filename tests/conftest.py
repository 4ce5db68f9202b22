"""pytest's hooks and fixtures for every test folder: GPU tests skip
cleanly on a machine without a device; the tests left out of the quick run
are marked ``slow``.  What the tests share besides is in ``support``
(tests/support/), which this file puts on sys.path for them (pytest
inserts a rootdir conftest's folder)."""

import os

import pytest

from support import SLOW_MODULES, SLOW_TESTS, TESTS, gpu_count


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
